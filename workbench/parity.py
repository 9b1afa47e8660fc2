"""Parity harness: one Hugging Face checkpoint, every training path, the same numbers.

Given a directory written by transformers (`config.json` + `*.safetensors`), the harness builds

  * the reference: transformers' own `AutoModelForCausalLM.from_pretrained(dir)` (fp32, sdpa);
  * each backend's model (`workbench.model.build_model`), with the checkpoint's weights loaded through that
    backend's HF key mapping (`hf_adapter(shape).from_hf`):
      huggingface_v5  transformers' modeling code again, inside the torchtitan wrapper: this row checks the
                      wrapper, init and key mapping;
      native          torchtitan's Qwen3 (torchtitan's `Qwen3StateDictAdapter.from_hf`), with
                      `moe_load_balance_coeff = 0` (no aux-loss-free expert-bias updates, i.e. the routing
                      Hugging Face computes);
      nki_moe         the same way as native, when the model is MoE (otherwise the row says why it was skipped);

and reports per backend: the max-abs difference of its logits from the reference's on one batch, its step-0
loss, and the per-step loss differences after N identical training steps — same packed rows from
`workbench.data.loader.PackedDataset`, same seed, fp32 on CPU, AdamW with the same hyper-parameters, one process, a
plain loop (no FSDP: sharding does not change the math and is tested by the training tests).

Output: a pandas DataFrame (one row per model, reference first) and, when asked, a JSON file with the same rows
plus the settings. Command line: `python -m workbench.parity CHECKPOINT_DIR [--steps 20] [--out parity.json]`.

`--packed` checks packed documents instead (`run_packed_parity`): each backend, built with
`training.document_mask`, reads ONE row packing `Settings.doc_lengths` documents (positions restarting at 0 in
each, the block-causal mask of `workbench.backends.attention`); transformers reads each document alone, no
packing. Per backend: `packed_max_abs`, the max-abs difference of the two logits, and `causal_max_abs`, the same
row with plain causal attention and continuous positions (what isolation takes away).

Checkpoints with a trimmed vocabulary (test models) get the tokenizer's ids folded modulo their vocab size.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from workbench.core.config import BACKENDS
from workbench.core.errors import BackendUnavailable, ConfigError, WorkbenchError, announce, recognised

REFERENCE = "transformers"


@dataclass(frozen=True)
class Settings:
    """What every model is run with (identical for all of them)."""

    steps: int = 20
    batch_size: int = 2
    seq_len: int = 64
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    seed: int = 0
    dataset: str = "shakespeare"
    doc_lengths: tuple[int, ...] = (24, 17, 23)
    """`--packed`: the documents of the packed row (each the start of another row of the training stream)."""


Batch = tuple[torch.Tensor, torch.Tensor]  # (input ids [B, S], labels [B, S])
Forward = Callable[[torch.Tensor], torch.Tensor]  # input ids -> logits [B, S, V]


# --------------------------------------------------------------------------------------------
# Inputs: weights and data
# --------------------------------------------------------------------------------------------


def load_hf_state_dict(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files (`hf.weight_files`: regular files only, pickles refused),
    by Hugging Face key."""
    from safetensors.torch import load_file

    from workbench.hf_weights import weight_files

    files = weight_files(checkpoint_dir)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def make_batches(settings: Settings, vocab_size: int) -> list[Batch]:
    """`steps` batches of packed rows (the training stream of `workbench.data`), ids folded into the vocab."""
    from workbench.data.loader import PackedDataset

    rows = iter(PackedDataset(settings.dataset, "", settings.seq_len, seed=settings.seed))
    batches = []
    for _ in range(settings.steps):
        picked = [next(rows) for _ in range(settings.batch_size)]
        inputs = torch.stack([row["input"] for row, _ in picked]) % vocab_size
        labels = torch.stack([label for _, label in picked]) % vocab_size
        batches.append((inputs, labels))
    return batches


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def reference_model(checkpoint_dir: str | Path) -> tuple[torch.nn.Module, Forward]:
    """transformers' own model for the checkpoint (fp32, sdpa) and its logits function."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model, lambda ids: model(input_ids=ids, use_cache=False).logits


def backend_model(name: str, checkpoint_dir: str | Path, settings: Settings,
                  document_mask: bool = False) -> tuple[torch.nn.Module, Forward]:
    """One backend's model for the checkpoint, weights loaded through the backend's own HF key mapping
    (`document_mask`: built as `training.document_mask` builds it).

    Raises:
        BackendUnavailable: the backend does not apply to this model (e.g. nki_moe on a dense checkpoint).
    """
    from workbench import backends
    from workbench.core.config import load_config
    from workbench.model import build_model

    try:  # the backend's own rules (nki_moe on a dense checkpoint) decide what applies
        job = load_config(
            None,
            model={"backend": name, "hf_checkpoint": str(checkpoint_dir), "moe_load_balance_coeff": 0.0},
            training={"seq_len": settings.seq_len, "document_mask": document_mask},
            job={"seed": settings.seed},
        )
    except ConfigError as e:
        raise BackendUnavailable(str(e)) from None
    model = build_model(job)  # seeded by job.seed = settings.seed
    adapter = backends.hf_adapter(name, job.shape)
    _load_strict(model, adapter.from_hf(dict(load_hf_state_dict(checkpoint_dir))), name)
    return model, model


def _load_strict(model: torch.nn.Module, state: dict[str, Any], name: str) -> None:
    """Loads converted weights; every parameter must come from the checkpoint (buffers may keep their init).

    A tied lm_head has no key of its own in HF checkpoints: it counts as loaded through the shared embedding.
    """
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in state if k in params}
    missing_params = [k for k in missing if k in params and id(params[k]) not in loaded]
    if missing_params or unexpected:
        raise RuntimeError(
            f"{name}: the converted checkpoint does not match the model: missing parameters {missing_params[:5]}, "
            f"unexpected keys {unexpected[:5]}. The backend's HF adapter (hf_adapter / state_dict_adapter) is wrong."
        )


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def logits_of(model: torch.nn.Module, forward: Forward, inputs: torch.Tensor) -> torch.Tensor:
    model.eval()
    return forward(inputs).float()


def train_losses(model: torch.nn.Module, forward: Forward, batches: Iterable[Batch], settings: Settings) -> list[float]:
    """Trains in place, one AdamW step per batch (mean token cross-entropy), and returns each step's loss."""
    torch.manual_seed(settings.seed)
    model.train()
    params = list(model.parameters())  # de-duplicated: a tied embedding is one parameter
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=settings.betas, eps=settings.eps,
                            weight_decay=settings.weight_decay)
    losses = []
    for inputs, labels in batches:
        logits = forward(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _row(backend: str, logits: torch.Tensor, ref_logits: torch.Tensor, losses: list[float],
         ref_losses: list[float]) -> dict[str, Any]:
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=False)]
    return {
        "backend": backend, "status": "ok", "note": "",
        "logits_max_abs_diff": float((logits - ref_logits).abs().max()),
        "loss_step0": losses[0], "loss_step0_abs_diff": abs(losses[0] - ref_losses[0]),
        "max_rel_loss_diff": max(rel), "final_loss": losses[-1],
        "losses": losses, "rel_loss_diffs": rel,
    }


def _skipped(backend: str, note: str) -> dict[str, Any]:
    return {"backend": backend, "status": "skipped", "note": note, "logits_max_abs_diff": math.nan,
            "loss_step0": math.nan, "loss_step0_abs_diff": math.nan, "max_rel_loss_diff": math.nan,
            "final_loss": math.nan, "losses": [], "rel_loss_diffs": []}


def run_parity(checkpoint_dir: str | Path, *, backends: Iterable[str] = BACKENDS, settings: Settings | None = None,
               out_json: str | Path | None = None):
    """Builds the checkpoint under the reference and every backend, compares logits and training losses.

    Args:
        checkpoint_dir: transformers checkpoint directory (config.json + *.safetensors).
        backends: backends to compare (unknown-here ones are reported as skipped).
        settings: steps, batch, sequence length, optimizer, seed, data (defaults: `Settings()`).
        out_json: also write {"checkpoint", "settings", "rows"} to this file.

    Returns:
        pandas DataFrame, one row per model (the reference first) with columns backend, status, note,
        logits_max_abs_diff, loss_step0, loss_step0_abs_diff, max_rel_loss_diff, final_loss, losses,
        rel_loss_diffs (relative |loss - reference loss| / reference loss, per step).
    """
    import pandas as pd

    from workbench.platform import titan_device

    titan_device.pin("cpu")  # parity is an fp32 CPU measurement; also applies the CPU adjustments torchtitan needs
    settings = settings or Settings()
    # Before transformers reads anything: its from_pretrained would torch.load a pickle-only folder.
    from workbench.hf_weights import weight_files

    weight_files(checkpoint_dir)
    ref, ref_forward = reference_model(checkpoint_dir)
    batches = make_batches(settings, ref.config.vocab_size)
    ref_logits = logits_of(ref, ref_forward, batches[0][0])
    ref_losses = train_losses(ref, ref_forward, batches, settings)
    rows = [_row(REFERENCE, ref_logits, ref_logits, ref_losses, ref_losses)]
    for name in backends:
        try:
            model, forward = backend_model(name, checkpoint_dir, settings)
        except BackendUnavailable as e:
            rows.append(_skipped(name, str(e)))
            continue
        logits = logits_of(model, forward, batches[0][0])
        rows.append(_row(name, logits, ref_logits, train_losses(model, forward, batches, settings), ref_losses))
    table = pd.DataFrame(rows)
    if out_json is not None:
        Path(out_json).write_text(json.dumps(
            {"checkpoint": str(checkpoint_dir), "settings": asdict(settings), "rows": rows}, indent=2))
    return table


def packed_documents(settings: Settings, vocab_size: int) -> list[torch.Tensor]:
    """The documents of the packed row: document i is the first `doc_lengths[i]` tokens of row i of the training
    stream, ids folded into the vocab."""
    from workbench.data.loader import PackedDataset

    rows = iter(PackedDataset(settings.dataset, "", max(settings.doc_lengths), seed=settings.seed))
    return [next(rows)[0]["input"][:n] % vocab_size for n in settings.doc_lengths]


@torch.no_grad()
def packed_logits(model: torch.nn.Module, docs: list[torch.Tensor], isolate: bool = True) -> torch.Tensor:
    """A backend model's logits [S, V] on one row packing `docs`: positions restarting at 0 in each document and
    the model's attention masks (`attention.forward_kwargs`), or (`isolate` False) continuous positions, no mask."""
    from workbench.backends import attention

    model.eval()
    row = torch.cat(docs)[None]
    if not isolate:
        return model(row)[0].float()
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    return model(row, **attention.forward_kwargs(model.workbench_info.model_config, positions))[0].float()


def run_packed_parity(checkpoint_dir: str | Path, *, backends: Iterable[str] = BACKENDS,
                      settings: Settings | None = None, out_json: str | Path | None = None):
    """Every backend's logits on one packed row against transformers' logits of each document run alone.

    Returns:
        pandas DataFrame, one row per backend: model, status, note, packed_max_abs, causal_max_abs (see the module
        docstring); `out_json` also gets {"checkpoint", "settings", "rows"}.
    """
    import pandas as pd

    from workbench.platform import titan_device

    titan_device.pin("cpu")
    settings = settings or Settings()
    if len(settings.doc_lengths) < 3 or sum(settings.doc_lengths) > settings.seq_len:
        raise ConfigError(f"--packed needs at least 3 documents within seq_len {settings.seq_len}; got lengths "
                          f"{settings.doc_lengths}.")
    ref, _ = reference_model(checkpoint_dir)
    ref.eval()
    docs = packed_documents(settings, ref.config.vocab_size)
    with torch.no_grad():
        expected = torch.cat([ref(input_ids=d[None], use_cache=False).logits[0].float() for d in docs])
    rows = []
    for name in backends:
        try:
            model, _ = backend_model(name, checkpoint_dir, settings, document_mask=True)
        except BackendUnavailable as e:
            rows.append({"model": name, "status": "skipped", "note": str(e), "packed_max_abs": math.nan,
                         "causal_max_abs": math.nan})
            continue
        rows.append({"model": name, "status": "ok", "note": "",
                     "packed_max_abs": float((packed_logits(model, docs) - expected).abs().max()),
                     "causal_max_abs": float((packed_logits(model, docs, isolate=False) - expected).abs().max())})
    table = pd.DataFrame(rows)
    if out_json is not None:
        Path(out_json).write_text(json.dumps(
            {"checkpoint": str(checkpoint_dir), "settings": asdict(settings), "rows": rows}, indent=2))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="transformers checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated backends")
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--batch-size", type=int, default=Settings.batch_size)
    parser.add_argument("--seq-len", type=int, default=Settings.seq_len)
    parser.add_argument("--lr", type=float, default=Settings.lr)
    parser.add_argument("--out", default=None, help="JSON report path")
    parser.add_argument("--packed", action="store_true",
                        help="packed documents: one row of >= 3 documents per backend against each alone")
    args = parser.parse_args(argv)
    settings = Settings(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr)
    try:
        if args.packed:
            table = run_packed_parity(args.checkpoint, backends=args.backends.split(","), settings=settings,
                                      out_json=args.out)
            print(table.to_string(index=False))
            return 0
        table = run_parity(args.checkpoint, backends=args.backends.split(","), settings=settings, out_json=args.out)
    except (WorkbenchError, FileNotFoundError) as e:
        return announce(recognised(e))
    print(table.drop(columns=["losses", "rel_loss_diffs"]).to_string(index=False))
    return 0


__all__ = ["Settings", "BackendUnavailable", "run_parity", "run_packed_parity", "packed_documents", "packed_logits",
           "reference_model", "backend_model", "make_batches", "load_hf_state_dict", "train_losses", "logits_of",
           "main", "BACKENDS", "REFERENCE"]


if __name__ == "__main__":
    raise SystemExit(main())
