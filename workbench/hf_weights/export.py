"""Writing any workbench model as a Hugging Face checkpoint folder, unit by unit.

Each unit's full tensors are gathered (collective; every rank calls it), converted with the backend adapter's
`to_hf` on rank 0, appended to the current safetensors shard, and the shard is written as soon as it is complete.
Everything goes into a temporary folder next to the target, renamed into place at the end, so a crash never leaves a
half-written export.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from workbench.core import flavors
from workbench.core.errors import EXIT_CHECKPOINT, HFExportError
from workbench.core.files import owner_tag, remove_abandoned
from workbench.hf_weights.folder import INDEX_FILE, SINGLE_FILE
from workbench.hf_weights.units import Unit, group_units, local_tensor, meta_state_dict, model_info, single_part
from workbench.platform.dist_utils import broadcast
from workbench.platform.dist_utils import rank as _rank

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # what published Qwen3 checkpoints use (~5 GB shards)
EXPORT_MARKER = ".workbench-hf-export"
"""Written into every export: `overwrite` replaces only a folder that has it (never a run folder or anything else)."""
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _agree(decide: Callable[[], str | None]) -> None:
    """Rank 0 decides (an error message or None), every rank learns it; all raise together."""
    verdict = broadcast(decide() if _rank() == 0 else None)
    if verdict:
        error = HFExportError(verdict)
        if any(sign in verdict for sign in DISK_FULL):  # the README's exit code for disk failures
            error.exit_code = EXIT_CHECKPOINT
        raise error


DISK_FULL = ("No space left on device", "Disk quota exceeded", "os error 28)", "os error 122)")
"""How a full disk reads in a failure's text (OSError's strerror; safetensors' Rust "(os error 28)")."""



def export_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' / 'bfloat16' / 'float16' (or the torch dtype itself) -> torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype in EXPORT_DTYPES.values():
        return dtype
    if dtype in EXPORT_DTYPES:
        return EXPORT_DTYPES[dtype]
    raise ValueError(f"Export dtype {dtype!r} is not supported; use one of {', '.join(EXPORT_DTYPES)}.")


def target_problem(out: str | os.PathLike, overwrite: bool) -> str | None:
    """Why `out` cannot be an export target (None if it can): it exists (without overwrite), it is something else
    than an earlier export (with overwrite: only a folder carrying `EXPORT_MARKER` is replaced, never a run folder
    or a folder of other files), or its nearest existing parent is a file or not writable (a read-only file
    system)."""
    out = Path(out)
    if out.is_symlink():
        return f"{out} is a symbolic link; the export never writes through one. Choose another output directory."
    if out.exists() and not overwrite:
        return (f"{out} already exists. Choose another output directory, or pass overwrite=True "
                "(--overwrite) to replace it.")
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a directory; remove it or choose another output directory."
    if out.exists() and any(out.iterdir()) and not (out / EXPORT_MARKER).is_file():
        return (f"{out} is not a folder the workbench exported (it has no {EXPORT_MARKER}); --overwrite replaces "
                "only an earlier export. Remove it yourself, or choose another output directory.")
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{out} cannot be created: {parent} is a file, not a directory. Choose another output directory."
    if not os.access(parent, os.W_OK):
        return (f"{out} cannot be created: {parent} is not writable (a read-only file system or its permissions). "
                "Choose another output directory.")
    return None


def _shard_names(units: list[Unit], dtype: torch.dtype, max_shard_bytes: int) -> dict[str, str]:
    """HF key -> file name, greedily filling shards in export order (transformers' naming)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, value in ((k, v) for u in units for k, v in u.hf.items()):
        nbytes = value.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    if len(shards) == 1:
        return {k: SINGLE_FILE for k in shards[0]}
    n = len(shards)
    return {k: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, keys in enumerate(shards) for k in keys}


class _ShardWriter:
    """Collects tensors per shard file and writes each file as soon as all its tensors have arrived."""

    def __init__(self, folder: Path, file_of: dict[str, str]):
        self.folder, self.file_of = folder, file_of
        self.remaining: dict[str, int] = {}
        for name in file_of.values():
            self.remaining[name] = self.remaining.get(name, 0) + 1
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, key: str, tensor: torch.Tensor) -> None:
        from safetensors.torch import save_file

        name = self.file_of[key]
        self.pending.setdefault(name, {})[key] = tensor
        self.remaining[name] -= 1
        if self.remaining[name] == 0:
            save_file(self.pending.pop(name), str(self.folder / name), metadata={"format": "pt"})
            os.chmod(self.folder / name, 0o644)  # safetensors writes 0600; exports are meant to be shared

    def finish(self) -> None:
        """Writes the index (sharded exports); checks that every planned tensor was written."""
        unwritten = [name for name, left in self.remaining.items() if left]
        if unwritten:
            raise RuntimeError(f"export incomplete: shard(s) {unwritten} not fully written")
        names = set(self.file_of.values())
        if names != {SINGLE_FILE}:
            total = sum((self.folder / n).stat().st_size for n in names)  # close to tensor bytes; headers are tiny
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(self.file_of.items()))}
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _full_unit(model: torch.nn.Module, unit: Unit, dtype: torch.dtype, keep: bool) -> dict[str, torch.Tensor]:
    """A unit's state dict gathered to full tensors (collective) and cast to `dtype`; {} where not `keep`."""
    from torch.distributed.tensor import DTensor

    out = {}
    for rel, value in model.get_submodule(unit.name).state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            out[f"{unit.name}.{rel}" if unit.name else rel] = value.detach().to(dtype=dtype, device="cpu", copy=True)
    return out


def _warn_dropped(model: torch.nn.Module, units: list[Unit]) -> None:
    """Warns about non-zero buffers the HF format cannot hold (torchtitan's aux-loss-free expert bias)."""
    buffers = dict(model.named_buffers())
    lost = [k for u in units for k in u.dropped if k in buffers and bool(local_tensor(buffers[k]).any())]
    if lost:
        warnings.warn(
            f"{len(lost)} non-zero buffer(s) have no Hugging Face equivalent and are not exported "
            f"({', '.join(lost[:3])}"
            f"{', ...' if len(lost) > 3 else ''}): torchtitan's expert-bias load balancing; the exported model routes "
            "without it. Train with model.moe_load_balance_coeff = 0 for an exact match.", stacklevel=3)



def export_weights(model: torch.nn.Module, out_dir: str | os.PathLike, *, model_config, shape: flavors.Qwen3Shape,
                   backend: str, dtype: str | torch.dtype, tokenizer_path: str = "", overwrite: bool = False,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Writes a model as a Hugging Face checkpoint directory; collective when the model is distributed.

    Args:
        model: a plain or parallelised (DTensor) model; every rank calls, rank 0 writes.
        out_dir: the directory to create.
        model_config: its torchtitan config (rebuilt on meta to list keys, shapes and shards).
        shape: the architecture (config.json).
        backend: whose `hf_adapter` maps the keys.
        dtype: dtype of the stored tensors.
        tokenizer_path: tokenizer directory to copy files from ("" = bundled Qwen3 tokenizer).
        overwrite: replace an existing `out_dir` (atomically, after the new export is complete).
        max_shard_bytes: above this the weights are split into shards with an index.

    Returns:
        The output directory.

    Raises:
        HFExportError: the target exists (without overwrite), or writing failed on rank 0.
    """
    from workbench import backends, data

    out = Path(out_dir).absolute()
    dt = export_dtype(dtype)
    _agree(lambda: target_problem(out, overwrite))
    adapter = backends.hf_adapter(backend, shape)
    units = group_units(meta_state_dict(model_config), adapter)
    tmp = out.parent / f".{out.name}.partial-{owner_tag()}"
    writer, failure = None, None
    if _rank() == 0:
        try:
            for kind in ("partial", "old"):  # left by exports to `out` that were killed
                remove_abandoned(out.parent, f".{out.name}.{kind}-")
            tmp.mkdir(parents=True)
            writer = _ShardWriter(tmp, _shard_names(units, dt, max_shard_bytes))
        except OSError as e:  # a parent that became a file or read-only since target_problem
            failure = f"creating {tmp} failed: {e.strerror}"
    failure = _write_units(model, units, adapter, dt, writer) or failure
    if writer is not None and failure is None:
        _warn_dropped(model, units)
        try:
            writer.finish()
            _write_config(tmp, shape, dt, data.tokenizer_dir(tokenizer_path))
            _copy_tokenizer(data.tokenizer_dir(tokenizer_path), tmp)
            (tmp / EXPORT_MARKER).write_text("written by the workbench's Hugging Face export\n")
            _move_into_place(tmp, out, overwrite)
        except _TargetTaken as e:
            failure = str(e)
        except Exception as e:
            failure = f"finishing the export failed: {e!r}"
    if _rank() == 0 and failure is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    _agree(lambda: failure and (failure if failure.startswith(str(out)) else
                                f"Export to {out} failed ({failure}); nothing was written there."))
    return out


def _write_units(model: torch.nn.Module, units: list[Unit], adapter, dtype: torch.dtype,
                 writer: _ShardWriter | None) -> str | None:
    """Gathers every unit (collective, all ranks) and hands its HF tensors to `writer` (rank 0 only).

    A write error on rank 0 does not stop it joining the remaining gathers (the other ranks would hang); it is
    returned instead, and `export_weights` makes every rank raise it.
    """
    failure = None
    with torch.no_grad():
        for unit in units:
            if not unit.hf:
                continue  # e.g. a tied lm_head: its weights went out with the embedding
            full = _full_unit(model, unit, dtype, keep=writer is not None and failure is None)
            if not full:
                continue
            try:
                for key, tensor in adapter.to_hf(full).items():
                    # Per-expert slices are views of one stacked tensor; safetensors stores no shared memory.
                    writer.add(key, tensor.clone() if tensor._base is not None else tensor)
            except Exception as e:
                failure = f"writing {unit.name} failed: {e!r}"
    return failure


# Qwen3's published checkpoints: config.json names <|endoftext|> as bos and <|im_end|> as eos (no pad);
# generation_config.json stops at either and samples with these settings (its recommended thinking-mode ones).
QWEN3_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def _special_ids(tokenizer_dir: Path) -> tuple[int | None, int | None]:
    """(<|endoftext|>, <|im_end|>) ids of the exported tokenizer (None where it has no such token)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")


def _write_config(folder: Path, shape: flavors.Qwen3Shape, dtype: torch.dtype, tokenizer_dir: Path) -> None:
    """config.json as transformers 5.x writes it for this architecture, with the special-token ids, and a
    generation_config.json, as Qwen3's published checkpoints have them: `generate` stops at <|im_end|> (the chat
    turn's end) or <|endoftext|>."""
    from transformers import GenerationConfig

    text_end, turn_end = _special_ids(tokenizer_dir)
    cfg = flavors.hf_config(shape, torch_dtype=str(dtype).removeprefix("torch."))
    cfg.architectures = ["Qwen3MoeForCausalLM" if shape.is_moe else "Qwen3ForCausalLM"]
    cfg.bos_token_id, cfg.eos_token_id = text_end, turn_end if turn_end is not None else text_end
    cfg.save_pretrained(str(folder))
    stops = [t for t in (turn_end, text_end) if t is not None]
    GenerationConfig(bos_token_id=text_end, eos_token_id=stops, pad_token_id=text_end,
                     **QWEN3_SAMPLING).save_pretrained(str(folder))


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


class _TargetTaken(Exception):
    """Another export created the target while this one was being written (and overwrite was not asked for)."""


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Renames the finished export onto `out`.

    Without `overwrite` the target is claimed with `mkdir` first, which fails atomically if it exists (another
    export finished first): POSIX rename replaces only an empty directory, so the rename then replaces just this
    export's own claim, and no export can replace another. With `overwrite` an existing `out` is swapped out first
    and then deleted.

    Raises:
        _TargetTaken: `out` appeared after `target_problem` looked (a concurrent export won).
    """
    if not overwrite:
        try:
            out.mkdir()
        except FileExistsError:
            raise _TargetTaken(f"{out} was created by another export while this one was written; this export was "
                               "discarded. Choose another output directory, or pass --overwrite.") from None
        tmp.rename(out)
        return
    old = out.parent / f".{out.name}.old-{owner_tag()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)



def export_model(model: torch.nn.Module, out_dir: str | os.PathLike, *, dtype: str | torch.dtype | None = None,
                 overwrite: bool = False, tokenizer_path: str | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Exports a model built by `workbench.load_model` as a Hugging Face checkpoint directory.

    Args:
        model: the model (its `workbench_info` names the shape and backend).
        out_dir: the directory to create (refused if it exists, unless `overwrite`).
        dtype: stored dtype; None = the model's parameter dtype.
        overwrite: replace an existing directory.
        tokenizer_path: tokenizer files to copy; None = the model's own (`model.tokenizer_path`).
        max_shard_bytes: shard size limit.
    """
    info = model_info(model)
    if dtype is None:
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return export_weights(
        model, out_dir, model_config=info.model_config, shape=info.shape, backend=info.backend, dtype=dtype,
        tokenizer_path=info.tokenizer_path if tokenizer_path is None else tokenizer_path, overwrite=overwrite,
        max_shard_bytes=max_shard_bytes,
    )


def export_trainer(trainer, out_dir: str | os.PathLike, *, overwrite: bool = True) -> Path:
    """Exports a `WorkbenchTrainer`'s model (collective: every rank calls it, rank 0 writes).

    The run folder's `hf/` belongs to the run, so by default a newer export replaces it (atomically).

    Args:
        trainer: the trainer after training.
        out_dir: the directory to write (`<run>/hf`).
        overwrite: replace an existing export.
    """
    run = trainer.run
    return export_weights(single_part(trainer), out_dir, model_config=trainer.model_config, shape=run.shape,
                          backend=run.backend, dtype=run.export_dtype, tokenizer_path=run.tokenizer_path,
                          overwrite=overwrite)
