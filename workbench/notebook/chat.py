"""Notebook 09 (chat fine-tuning): a conversation with its trained tokens coloured, the packing table, the initial
weights to fine-tune from, and replies to one prompt through the chat template before and after."""

from __future__ import annotations

import html
from pathlib import Path

from workbench.core.config import JobConfig, validate
from workbench.data import chat
from workbench.data.packing import ChatRows, PackSpec
from workbench.data.prepared import PreparedDataset
from workbench.notebook.display import Table, number, percent

# what each owner is drawn as: trained kinds in colour, the rest grey (legend order)
STYLE = {chat.CONTENT: ("assistant reply", "#1a7f37"), chat.END: ("end of turn <|im_end|>", "#cf222e"),
         chat.THINK: ("thinking", "#8250df"), chat.TOOL_CALL: ("tool call", "#0969da"),
         chat.USER: ("user", "#57606a"), chat.SYSTEM: ("system", "#57606a"), chat.TOOL: ("tool response", "#57606a"),
         chat.TEMPLATE: ("template", "#8c959f")}


def chat_data(job: JobConfig) -> PreparedDataset:
    """The prepared conversations `training.dataset` names (prepared into the data cache on first use)."""
    from workbench.data.loader import resolve

    p = PreparedDataset(resolve(job.training.dataset, job.model.tokenizer_path), job.model.tokenizer_path)
    if not p.chat:
        from workbench.core.errors import DatasetError

        raise DatasetError(f"training.dataset={job.training.dataset!r} holds documents, not conversations.",
                           "point it at conversations: 'chitchat', or data with a 'messages' field.")
    return p


class Conversation:
    """One prepared conversation drawn token by token: trained targets in colour (bold), the rest grey."""

    def __init__(self, p: PreparedDataset, index: int, job: JobConfig):
        from workbench.data import load_tokenizer

        tok = load_tokenizer(job.model.tokenizer_path)
        t = job.training
        lut = chat.trained_lut(t.loss_on, t.train_thinking, t.train_tool_calls)
        ids, owners = p.document(index).tolist(), p.owners(index)
        self.index, self.tokens = index, len(ids)
        self.trained = int(lut[owners][1:].sum())
        self.pieces = [(tok.decode([i], skip_special_tokens=False), int(o) & 7, bool(lut[o]) and k > 0)
                       for k, (i, o) in enumerate(zip(ids, owners, strict=True))]
        self.loss_on = t.loss_on

    def _repr_html_(self) -> str:
        spans = []
        for text, kind, trained in self.pieces:
            color = STYLE[kind][1]
            weight = "font-weight:bold;text-decoration:underline" if trained else ""
            spans.append(f"<span style='color:{color};{weight}'>{html.escape(text)}</span>")
        legend = " · ".join(f"<span style='color:{c}'>{html.escape(n)}</span>" for n, c in STYLE.values())
        return (f"<div><b>conversation {self.index}: {self.tokens:,} tokens, {self.trained:,} trained "
                f"(training.loss_on = {self.loss_on}; trained tokens bold and underlined)</b><br>{legend}"
                f"<pre style='white-space:pre-wrap'>{''.join(spans)}</pre></div>")

    def __repr__(self) -> str:
        body = "".join(f"⟦{text}⟧" if trained else text for text, _, trained in self.pieces)
        return (f"conversation {self.index}: {self.tokens:,} tokens, {self.trained:,} trained (⟦...⟧, "
                f"training.loss_on = {self.loss_on})\n{body}")


def packing_table(p: PreparedDataset, job: JobConfig, seq_lens: tuple[int, ...] = ()) -> Table:
    """Rows, pad fraction, trained tokens per row, conversations longer than a row and dropped, per seq_len."""
    t = job.training
    rows = []
    for seq_len in dict.fromkeys((t.seq_len, *seq_lens)):
        spec = PackSpec(seq_len=seq_len, seed=job.job.seed, holdout=t.holdout_docs, **t.chat_options())
        st = ChatRows(p, spec, job.training.dataset, job.model.tokenizer_path).stats()
        rows.append((seq_len, st["conversations"], st["rows"], percent(st["pad_fraction"]),
                     number(st["trained_targets"] / st["rows"]), st["overlong"], st["dropped"]))
    return Table.of(rows, ["seq_len (tokens)", "conversations", "rows", "padding", "trained tokens per row",
                           f"longer than a row ({t.overlong})", "dropped"],
                    title=f"best-fit-decreasing packing of {job.training.dataset}, epoch 0")


def initial_weights(job: JobConfig, out: str | Path, nproc: int = 1) -> JobConfig:
    """Exports the job's seeded initial model as Hugging Face weights into `out` and returns the job fine-tuning
    from them (`model.hf_checkpoint`), exporting its result (`checkpoint.export_hf`, fp32)."""
    import copy

    from workbench.model import export_hf, load_model

    out = Path(out)
    if not (out / "config.json").is_file():
        export_hf(load_model(job), out, dtype="float32", overwrite=True)
    tuned = copy.deepcopy(job)
    tuned.model.hf_checkpoint, tuned.model.flavor = str(out), ""
    tuned.checkpoint.export_hf, tuned.checkpoint.export_dtype = True, "float32"
    validate(tuned, nproc)
    return tuned


def replies(prompt: str, checkpoints: dict[str, str | Path], max_new_tokens: int = 24) -> Table:
    """Each checkpoint's greedy reply to `prompt` as one user turn, through its chat template
    (`apply_chat_template(..., add_generation_prompt=True)` + transformers' `generate`), and whether it stopped at
    the end of its turn."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars would be left in the saved notebook
    rows = []
    for label, folder in checkpoints.items():
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        inputs = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
        n = inputs["input_ids"].shape[1]
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)[0, n:].tolist()
        stopped = bool(out) and out[-1] in (tok.convert_tokens_to_ids(chat.IM_END), tok.eos_token_id)
        rows.append((label, tok.decode(out, skip_special_tokens=False), len(out),
                     "yes" if stopped else f"no (max_new_tokens {max_new_tokens})"))
    return Table.of(rows, ["weights", "reply (greedy)", "tokens", "ended its turn"], title=f"prompt: {prompt!r}")


__all__ = ["chat_data", "Conversation", "packing_table", "initial_weights", "replies"]
