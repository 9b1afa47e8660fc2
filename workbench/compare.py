"""Compare two checkpoints of any backend in Hugging Face key space: weights, held-out logits and perplexity, and
greedy generations side by side.

    python -m workbench.compare A B [--backend-a native] [--backend-b huggingface_v5] [--dataset D] [--out DIR]
    cmp = workbench.compare.compare("outputs/run_a", "outputs/run_b/hf", backend_b="huggingface_v5")
    cmp.tensors      # DataFrame: key, hf, shape_a, shape_b, max_abs, rel_norm, status
    cmp.heldout      # dict: logits_max_abs_diff, logits_mean_abs_diff, top1_agreement, ppl_a, ppl_b, tokens,
                     #   "ppl_a <member>" / "ppl_b <member>" for a mixture
    cmp.notes        # list: what to know when reading them (runs on different data, short held-out sets)
    cmp.generations  # DataFrame: prompt, a, b, same

A checkpoint is any of:
  * a run folder (`<job.dump_folder>/<job.experiment_name>/`, with config.toml): its newest DCP step, or `step`;
  * a DCP step directory (`<run>/checkpoint/step-N/`): read with the run's config, by the backend that wrote it;
  * a Hugging Face directory (config.json + *.safetensors), e.g. `<run>/hf/` or published weights: loaded into
    `backend` (default native) with `workbench.model.load_model`.

Weights are compared after mapping each model's `state_dict()` to HF keys with its backend's `hf_adapter`
(per-expert `mlp.experts.E.*` keys; a tied lm_head has no key), so checkpoints of different backends line up
key for key. State the HF format cannot hold is compared too, under the model's own key (column `hf` False):
torchtitan's aux-loss-free `expert_bias_E` buffers change routing, so a DCP checkpoint trained with
`model.moe_load_balance_coeff > 0` and its HF export have equal weights but different logits; a side without
such a buffer counts as zeros (routing without a bias). Logits and perplexity use the first rows of the documents
each run held out of training (its `training.dataset` and `training.holdout_docs`, read by
`workbench.data.loader.heldout_sets`; `dataset=` / `--dataset` measures both on another corpus); for a mixture also
per member. Runs trained on different data are each measured on their own held-out documents (said in `notes`);
a held-out set shorter than one row is measured on what there is. Held-out conversations are one per row and
measured on their trained tokens (the run's `training.loss_on`): logits, perplexity, top-1 and KL there only.
Generations use the real tokenizer (`workbench.data.load_tokenizer`). Everything runs on CPU in fp32, one process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
import torch
import torch.nn.functional as F

from workbench.core.errors import ConfigError, WorkbenchError, announce, recognised

DEFAULT_PROMPTS = ("To be, or not to be,", "ROMEO:", "Now is the winter of our discontent")


@dataclass
class Loaded:
    """One side of a comparison.

    Attributes:
        label: how the checkpoint is shown ("<backend>:<path>").
        backend: the backend whose model holds the weights.
        model: fp32 CPU model in eval mode from `workbench.model` (`model(input_ids)` -> logits [B, S, vocab]).
        tokenizer_path: the tokenizer directory ("" = the bundled Qwen3 tokenizer).
        data: see below.
    """

    label: str
    backend: str
    model: torch.nn.Module
    tokenizer_path: str = ""
    data: HeldOut | None = None
    """The data its run trained on and held out (None: an HF directory, which does not say)."""

    @property
    def vocab_size(self) -> int:
        return self.model.workbench_info.shape.vocab_size


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------


def _run_of(step_dir: Path) -> Path:
    """The run folder above a DCP step directory (the first parent with config.toml)."""
    for parent in step_dir.parents:
        if (parent / "config.toml").is_file():
            return parent
    raise ConfigError(f"{step_dir} is a DCP checkpoint outside any run folder (no config.toml above it); "
                      "its model config is unknown. Pass the run folder or a Hugging Face export instead.")


@dataclass(frozen=True)
class HeldOut:
    """The documents a checkpoint is measured on: the last `docs` of each member of `dataset` in its fixed order,
    which its run never trained on when `docs` is the run's `training.holdout_docs`."""

    dataset: str = "shakespeare"
    docs: int = 1
    text_field: str = "text"
    tokenizer_path: str = ""
    loss_on: str = "assistant"
    """Conversations: the tokens measured (`training.loss_on`)."""

    @classmethod
    def of_run(cls, job) -> HeldOut:
        t = job.training
        return cls(t.dataset, t.holdout_docs, t.dataset_text_field, job.model.tokenizer_path, t.loss_on)


class Rows(NamedTuple):
    """Held-out rows: the inputs [rows, L] and their targets (-100 where nothing is measured: a conversation's
    context, its padding)."""

    inputs: torch.Tensor
    labels: torch.Tensor

    @property
    def targets(self) -> int:
        return int((self.labels != -100).sum())


def _load_dcp(run: Path, step_dir: Path | None, step: int | None, backend: str | None) -> Loaded:
    from workbench.model import load_run

    model, job, step_dir = load_run(run, backend, step, step_dir)
    return Loaded(f"{job.model.backend}:{step_dir}", job.model.backend, model, job.model.tokenizer_path,
                  HeldOut.of_run(job))


def load_checkpoint(path: str | os.PathLike, backend: str | None = None, step: int | None = None) -> Loaded:
    """Loads one checkpoint (run folder, DCP step directory or HF directory; see the module docstring).

    Args:
        path: the checkpoint.
        backend: HF directories: the backend to load into (default native). DCP: must be the run's (or None).
        step: run folders: the DCP step (default the newest).

    Raises:
        ConfigError: the path is none of the above, or has no such step.
    """
    from workbench.core.config import DEFAULT_BACKEND
    from workbench.model import load_model

    p = Path(path)
    if (p / "config.json").is_file():
        backend = backend or DEFAULT_BACKEND
        model = load_model(None, backend=backend, hf_checkpoint=p)
        return Loaded(f"{backend}:{p}", backend, model, model.workbench_info.tokenizer_path)
    if (p / ".metadata").is_file():
        return _load_dcp(_run_of(p), p, None, backend)
    if (p / "config.toml").is_file():
        return _load_dcp(p, None, step, backend)
    raise ConfigError(f"{p} is not a checkpoint: expected a Hugging Face directory (config.json + *.safetensors), "
                      "a run folder (config.toml + checkpoint/step-N/) or a DCP step directory (.metadata).")


# ------------------------------------------------------------------------------------------------
# Comparing
# ------------------------------------------------------------------------------------------------


def comparable_state(loaded: Loaded) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights under HF keys, buffers the HF format cannot hold under the model's keys), detached fp32."""
    from workbench import backends

    adapter = backends.hf_adapter(loaded.backend, loaded.model.workbench_info.shape)
    state = loaded.model.state_dict()
    buffers = {name for name, _ in loaded.model.named_buffers()}
    hf = {k: v.detach().float() for k, v in adapter.to_hf(state).items()}
    extra = {k: v.detach().float() for k, v in state.items() if k in buffers and not adapter.to_hf({k: v})}
    return hf, extra


def _diff_row(key: str, ta: torch.Tensor | None, tb: torch.Tensor | None, hf: bool) -> dict[str, Any]:
    row = {"key": key, "hf": hf, "shape_a": tuple(ta.shape) if ta is not None else None,
           "shape_b": tuple(tb.shape) if tb is not None else None, "max_abs": math.nan, "rel_norm": math.nan,
           "status": "same keys"}
    if ta is None or tb is None:
        row["status"] = "only in a" if tb is None else "only in b"
        if hf:
            return row
        ta, tb = (ta, torch.zeros_like(ta)) if tb is None else (torch.zeros_like(tb), tb)  # absent buffer = zeros
    elif ta.shape != tb.shape:
        row["status"] = "shape differs"
        return row
    diff = ta.double() - tb.double()
    err, ref = diff.norm().item(), ta.double().norm().item()
    row.update(max_abs=diff.abs().max().item() if diff.numel() else 0.0,
               rel_norm=err / ref if ref else (math.inf if err else 0.0))
    return row


def tensor_diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *, hf: bool = True) -> pd.DataFrame:
    """Per key: max |a - b| and ||a - b|| / ||a|| (0 when both are zero); keys on one side only are listed too.

    Args:
        a, b: key -> tensor.
        hf: the keys are HF weights (a key on one side only is a mismatch, no numbers); False = non-HF buffers
            (an absent buffer compares as zeros).

    Returns:
        Columns: key, hf, shape_a, shape_b, max_abs, rel_norm, status ("same keys", "only in a", "only in b",
        "shape differs").
    """
    rows = [_diff_row(k, a.get(k), b.get(k), hf) for k in sorted(a.keys() | b.keys())]
    return pd.DataFrame(rows, columns=["key", "hf", "shape_a", "shape_b", "max_abs", "rel_norm", "status"])


def held_out(side: Loaded, other: Loaded, dataset: str | None) -> HeldOut:
    """What `side` is measured on: `dataset` when given, else its run's data, else the other side's, else the
    bundled corpus; with its run's `holdout_docs` (at least one document) and its own tokenizer."""
    own = side.data or other.data or HeldOut()
    return HeldOut(dataset or own.dataset, max(own.docs, 1), own.text_field, side.tokenizer_path, own.loss_on)


def heldout_rows(held: HeldOut, seq_len: int, rows: int, vocab_size: int) -> tuple[dict[str, Rows], list[str]]:
    """The held-out rows: "" -> the pooled rows of every member, plus one entry per member of a mixture; and notes
    on sets shorter than one row (measured on what there is). Ids are folded into `vocab_size` (trimmed test vocabs).
    A conversation member gives its first `rows` held-out conversations, one per row.

    Raises:
        ConfigError: a held-out set of fewer than 2 tokens (nothing to predict).
    """
    from workbench.data.loader import heldout_sets

    sets = heldout_sets(held.dataset, held.tokenizer_path, held.docs, held.text_field, seq_len, held.loss_on)
    text = [t for t in sets.values() if isinstance(t, torch.Tensor)]
    named = {**({"": torch.cat(text)} if text else {}), **(sets if len(sets) > 1 or not text else {})}
    out, notes = {}, []
    for name, tokens in named.items():
        if isinstance(tokens, tuple):  # conversations: (inputs, labels) one per row
            ids, labels = tokens
            out[name] = Rows(ids[:rows] % vocab_size, torch.where(labels[:rows] >= 0, labels[:rows] % vocab_size,
                                                                  labels[:rows]))
            continue
        what = f"the held-out set of {name or held.dataset} ({held.docs} document(s))"
        if len(tokens) < 2:
            raise ConfigError(f"{what} has {len(tokens)} token(s): nothing to measure.",
                              "hold out more documents (training.holdout_docs) or pass --dataset.")
        if len(tokens) < seq_len + 1:
            notes.append(f"{what} has {len(tokens):,} tokens, fewer than one row of {seq_len + 1}: measured on all "
                         f"of it ({len(tokens) - 1:,} predicted tokens).")
        batch = _rows(tokens, seq_len, rows, vocab_size)
        out[name] = Rows(batch[:, :-1], batch[:, 1:])
    if "" not in out or len(out) > len(text) + 1:  # conversations among the members: every member's rows pooled
        out[""] = _stack([r for name, r in out.items() if name])
    return out, notes


def _stack(parts: list[Rows]) -> Rows:
    """Rows of several members as one batch, shorter rows padded (inputs 0, labels -100: never measured)."""
    width = max(r.inputs.shape[1] for r in parts)
    pad = [width - r.inputs.shape[1] for r in parts]
    return Rows(torch.cat([F.pad(r.inputs, (0, n)) for r, n in zip(parts, pad, strict=True)]),
                torch.cat([F.pad(r.labels, (0, n), value=-100) for r, n in zip(parts, pad, strict=True)]))


def _rows(tokens: torch.Tensor, seq_len: int, rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, seq_len + 1] from the start of `tokens`; one shorter row when there are fewer tokens than one row."""
    length = min(seq_len + 1, len(tokens))
    rows = max(min(rows, len(tokens) // length), 1)
    return tokens[: rows * length].view(rows, length) % vocab_size


def perplexity(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """exp(mean next-token cross-entropy) over the targets that are not -100."""
    return math.exp(F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100).item())


@torch.no_grad()
def heldout_eval(a: Loaded, b: Loaded, batch: Rows) -> dict[str, float]:
    """Logits of both models on the same held-out rows, at the measured targets: their differences, top-1
    agreement, KL(a || b) per token (nats) and perplexities."""
    la, lb = a.model(batch.inputs).float(), b.model(batch.inputs).float()
    if la.shape != lb.shape:
        raise ValueError(f"The models' logits differ in shape ({tuple(la.shape)} vs {tuple(lb.shape)}): they do not "
                         "share a vocabulary, so logits and generations cannot be compared.")
    measured = batch.labels != -100
    ma, mb = la[measured], lb[measured]
    diff = (ma - mb).abs()
    # KL(a || b) of the next-token distributions, averaged over the held-out tokens
    kl = F.kl_div(mb.log_softmax(-1), ma.log_softmax(-1), log_target=True, reduction="sum") / batch.targets
    return {"logits_max_abs_diff": diff.max().item(), "logits_mean_abs_diff": diff.mean().item(),
            "top1_agreement": (ma.argmax(-1) == mb.argmax(-1)).float().mean().item(), "kl_a_b": kl.item(),
            "ppl_a": perplexity(la, batch.labels), "ppl_b": perplexity(lb, batch.labels), "tokens": batch.targets}


@torch.no_grad()
def side_perplexities(loaded: Loaded, side: str, batches: dict[str, Rows]) -> dict[str, float]:
    """`loaded`'s perplexity on each member's held-out rows of a mixture, as "ppl_<side> <member>"."""
    return {f"ppl_{side} {name}": perplexity(loaded.model(batch.inputs).float(), batch.labels)
            for name, batch in batches.items() if name}


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, vocab_size: int) -> list[int]:
    """Greedy continuation (full forward each token: no KV cache, fine for comparison-sized outputs)."""
    ids = torch.tensor([i % vocab_size for i in prompt_ids])[None]
    for _ in range(max_new_tokens):
        nxt = model(ids)[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


def generations(a: Loaded, b: Loaded, prompts: Sequence[str], max_new_tokens: int) -> pd.DataFrame:
    """Both models' greedy continuations of each prompt, decoded with `a`'s tokenizer. Columns: prompt, a, b, same."""
    from workbench.data import load_tokenizer

    tok = load_tokenizer(a.tokenizer_path)
    rows = []
    for prompt in prompts:
        ids = tok.encode(prompt, add_special_tokens=False).ids
        ga, gb = (greedy(m.model, ids, max_new_tokens, m.vocab_size) for m in (a, b))
        rows.append({"prompt": prompt, "a": tok.decode(ga), "b": tok.decode(gb), "same": ga == gb})
    return pd.DataFrame(rows, columns=["prompt", "a", "b", "same"])


@dataclass
class Comparison:
    """The result of `compare` (see the module docstring)."""

    a: str
    b: str
    tensors: pd.DataFrame
    heldout: dict[str, float]
    generations: pd.DataFrame
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """What to know when reading the numbers: data that differ between the runs, short held-out sets."""

    def summary(self) -> dict[str, Any]:
        """Headline numbers: largest weight differences, key mismatches, held-out metrics, generations that agree."""
        is_hf = self.tensors.hf.astype(bool)  # pandas 3 concat of an empty frame leaves an object column
        weights, extra = self.tensors[is_hf], self.tensors[~is_hf]
        return {"a": self.a, "b": self.b, "tensors": len(weights),
                "mismatched_keys": int((weights.status != "same keys").sum()),
                "weights_max_abs": float(weights.max_abs.max()) if len(weights) else math.nan,
                "weights_max_rel_norm": float(weights.rel_norm.max()) if len(weights) else math.nan,
                "non_hf_buffers": len(extra),
                "non_hf_buffers_max_abs": float(extra.max_abs.max()) if len(extra) else math.nan,
                **self.heldout, "generations_same": int(self.generations.same.sum()),
                "generations": len(self.generations), **self.settings}

    def notes_lines(self) -> list[str]:
        return [f"note: {n}" for n in self.notes]

    def save(self, out: str | os.PathLike) -> Path:
        """Writes tensors.csv, generations.csv, summary.json and compare.md into `out`."""
        from workbench.run.profiling import markdown_table

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.tensors.to_csv(out / "tensors.csv", index=False)
        self.generations.to_csv(out / "generations.csv", index=False)
        summary = self.summary()
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        worst = self.tensors.sort_values("rel_norm", ascending=False, na_position="first").head(15)
        (out / "compare.md").write_text("\n".join([
            "# Checkpoint comparison", "", f"- a: `{self.a}`", f"- b: `{self.b}`", *(f"- {n}" for n in self.notes),
            "",
            markdown_table(pd.DataFrame([summary]).drop(columns=["a", "b"]).T.reset_index()
                           .set_axis(["metric", "value"], axis=1)),
            "## Largest weight differences", "", markdown_table(worst.astype({"shape_a": str, "shape_b": str})),
            "## Greedy generations", "", markdown_table(self.generations)]))
        return out


def compare_models(a: Loaded, b: Loaded, *, seq_len: int = 128, rows: int = 4,
                   prompts: Sequence[str] = DEFAULT_PROMPTS, max_new_tokens: int = 16,
                   dataset: str | None = None) -> Comparison:
    """Compares two loaded checkpoints (see `compare` for the arguments)."""
    (hf_a, extra_a), (hf_b, extra_b) = comparable_state(a), comparable_state(b)
    tensors = pd.concat([tensor_diffs(hf_a, hf_b), tensor_diffs(extra_a, extra_b, hf=False)], ignore_index=True)
    data_a, data_b = held_out(a, b, dataset), held_out(b, a, dataset)
    rows_a, notes = heldout_rows(data_a, seq_len, rows, a.vocab_size)
    heldout = heldout_eval(a, b, rows_a[""]) | side_perplexities(a, "a", rows_a)
    settings = {"seq_len": rows_a[""].inputs.shape[1], "rows": rows_a[""].inputs.shape[0],
                "dataset": data_a.dataset, "holdout_docs": data_a.docs}
    if data_b == data_a:
        heldout |= side_perplexities(b, "b", rows_a)
    else:  # each model on its own run's held-out documents; logits, top-1 and KL on a's
        rows_b, notes_b = heldout_rows(data_b, seq_len, rows, b.vocab_size)
        heldout |= {"ppl_b": perplexity(b.model(rows_b[""].inputs).float(), rows_b[""].labels),
                    "tokens_b": rows_b[""].targets} | side_perplexities(b, "b", rows_b)
        settings |= {"dataset": f"{data_a.dataset} (a), {data_b.dataset} (b)", "holdout_docs_b": data_b.docs}
        notes += notes_b + [f"a and b trained on different data (a: {data_a.dataset}, b: {data_b.dataset}): each "
                            "perplexity is on its own run's held-out documents; logits, top-1 and KL on a's."]
    for side, loaded in (("a", a), ("b", b)):
        if loaded.data and loaded.data.docs == 0:
            notes.append(f"{side}'s run held out no document (training.holdout_docs = 0): its perplexity is on its "
                         "last document, which it trained on.")
    return Comparison(a.label, b.label, tensors, heldout, generations(a, b, prompts, max_new_tokens), settings, notes)


def compare(a: str | os.PathLike, b: str | os.PathLike, *, backend_a: str | None = None,
            backend_b: str | None = None, step_a: int | None = None, step_b: int | None = None, seq_len: int = 128,
            rows: int = 4, prompts: Sequence[str] = DEFAULT_PROMPTS, max_new_tokens: int = 16,
            dataset: str | None = None) -> Comparison:
    """Compares two checkpoints (any kind, any backend): weights, held-out logits / perplexity, generations.

    Args:
        a, b: checkpoints (run folder, DCP step directory or Hugging Face directory).
        backend_a, backend_b: for HF directories, the backend to load into (default native).
        step_a, step_b: for run folders, the DCP step (default the newest).
        seq_len, rows: held-out rows of `seq_len` tokens for logits and perplexity.
        prompts, max_new_tokens: greedy generations.
        dataset: measure both on this corpus (`training.dataset` syntax) instead of each run's own (`held_out`).
    """
    return compare_models(load_checkpoint(a, backend_a, step_a), load_checkpoint(b, backend_b, step_b),
                          seq_len=seq_len, rows=rows, prompts=prompts, max_new_tokens=max_new_tokens, dataset=dataset)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="checkpoint A: run folder, DCP step directory or Hugging Face directory")
    parser.add_argument("b", help="checkpoint B (same kinds)")
    parser.add_argument("--backend-a", default=None, help="backend to load an HF directory A into (default native)")
    parser.add_argument("--backend-b", default=None, help="backend to load an HF directory B into (default native)")
    parser.add_argument("--step-a", type=int, default=None, help="DCP step of run folder A (default newest)")
    parser.add_argument("--step-b", type=int, default=None, help="DCP step of run folder B (default newest)")
    parser.add_argument("--seq-len", type=int, default=128, help="held-out row length (default 128)")
    parser.add_argument("--rows", type=int, default=4, help="held-out rows (default 4)")
    parser.add_argument("--prompt", action="append", default=None, help="generation prompt (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")
    parser.add_argument("--dataset", default=None, help="held-out documents of this dataset (training.dataset "
                        "syntax; default: each run's own training.dataset and holdout_docs)")
    parser.add_argument("--out", default=None, help="write tensors.csv, generations.csv, summary.json, compare.md")
    args = parser.parse_args(argv)
    try:
        cmp = compare(args.a, args.b, backend_a=args.backend_a, backend_b=args.backend_b, step_a=args.step_a,
                      step_b=args.step_b, seq_len=args.seq_len, rows=args.rows,
                      prompts=args.prompt or DEFAULT_PROMPTS, max_new_tokens=args.max_new_tokens,
                      dataset=args.dataset)
    except (WorkbenchError, FileNotFoundError) as e:
        return announce(recognised(e))
    for key, value in cmp.summary().items():
        print(f"{key:>22}: {value}")
    for line in cmp.notes_lines():
        print(line)
    with pd.option_context("display.width", 200, "display.max_colwidth", 60):
        print(cmp.generations.to_string(index=False))
    if args.out:
        print(f"wrote {cmp.save(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
