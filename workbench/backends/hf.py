"""Hugging Face safetensors in and out: published Qwen3 weights into any workbench model, and back out.

The interchange format between the paths (and with the Hugging Face Hub) is what `transformers` reads and writes:
a directory with `config.json` and either `model.safetensors` or `model-0000i-of-0000N.safetensors` shards
listed in `model.safetensors.index.json`. Keys are the published ones; MoE experts on disk are per expert
(`mlp.experts.E.{gate,up,down}_proj.weight`). transformers 5.x can also write its in-memory fused layout
(`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]); the
loader reads that too, by slicing the fused tensors into the per-expert keys ("virtual" keys below).

Key mapping belongs to the backend: `backends.hf_adapter(name, shape)` returns an object with
`to_hf(state_dict)` / `from_hf(hf_state_dict)` between the model's `state_dict()` keys and the per-expert HF
keys. Both directions must accept any subset of keys that covers one *unit* (below).

Loading (`load_into_trainer`, `load_into_model`) never holds the whole checkpoint:
  1. the table of contents: the index and every shard's header (no tensor data); pickle weights are refused;
  2. a check against what the adapter expects (its `to_hf` of the model's state dict built on the meta
     device): missing, unexpected and mis-shaped keys are reported together, before any weight is touched;
  3. one unit at a time — a decoder layer (`layers.N`), or a top-level module (embedding, final norm,
     lm_head): its tensors are read with `safe_open` (each file opened only for that unit, so no shard stays
     mapped), converted by the adapter, cut to the local shard of each live DTensor (`distribute_tensor` with
     `src_data_rank=None`: every rank slices its own part, no communication) and `load_state_dict`-ed into
     the unit, whose own hooks handle layout details such as torchtitan's fused QKV.
  Peak host memory per rank: its shard of the model plus one unit in full.

Export (`export_trainer`, `export_model`) is the reverse, unit by unit: gather each unit's full tensors
(collective; every rank calls it), convert with `to_hf` on rank 0, append to the current safetensors shard
and write the shard as soon as it is complete. Everything goes into a temporary directory next to the
target, renamed into place at the end, so a crash never leaves a half-written export.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench.core import flavors
from workbench.core.errors import EXIT_CHECKPOINT, HFCheckpointError, HFExportError
from workbench.core.files import check_regular, inside, owner_tag, read_json, remove_abandoned
from workbench.core.schema import DictOf, Obj, Str, check
from workbench.platform.dist_utils import broadcast
from workbench.platform.dist_utils import rank as _rank

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # what published Qwen3 checkpoints use (~5 GB shards)
EXPORT_MARKER = ".workbench-hf-export"
"""Written into every export: `overwrite` replaces only a folder that has it (never a run folder or anything else)."""
INDEX = Obj({"weight_map": DictOf(Str(r"[^/\\\0]+\.safetensors", what="a .safetensors file name in the folder"),
                                  key=Str(max_len=1000))})
"""What the loader reads of `model.safetensors.index.json`: tensor key -> a file name in the same folder."""
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# transformers v5's fused expert tensors; split into the per-expert keys on reading.
_FUSED_EXPERTS = re.compile(r"(?P<prefix>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)")
_SHOW = 5  # offending keys listed per category in error messages


@dataclass(frozen=True)
class ModelInfo:
    """What export needs to know about a model built by `workbench.load_model` (attached as `workbench_info`).

    Attributes:
        backend: the backend that built it (its `hf_adapter` maps the keys).
        shape: the architecture (written as config.json).
        model_config: the torchtitan model config (rebuilt on meta to plan keys and shapes).
        tokenizer_path: `model.tokenizer_path` ("" = the bundled Qwen3 tokenizer).
    """

    backend: str
    shape: flavors.Qwen3Shape
    model_config: Any
    tokenizer_path: str = ""


# ------------------------------------------------------------------------------------------------
# Reading: the table of contents of a checkpoint directory
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    """Where one (per-expert) HF tensor lives: a whole stored tensor, or a slice of a fused one."""

    file: Path
    key: str  # the key stored in the file
    shape: tuple[int, ...]  # the shape of the tensor this source yields
    dtype: str = ""  # as stored (safetensors' spelling: F32, BF16, I8, BOOL, ...)
    expert: int | None = None  # fused layout: index along dim 0
    rows: slice | None = None  # fused gate_up_proj: the gate or the up half

    def read(self, handle) -> torch.Tensor:
        """Reads the tensor from an open `safe_open` handle (slices read only their own bytes)."""
        if self.expert is None:
            return handle.get_tensor(self.key)
        part = handle.get_slice(self.key)
        return part[self.expert] if self.rows is None else part[self.expert, self.rows]


def weight_files(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory (all shards named by the index, which must exist).

    Raises:
        HFCheckpointError: no safetensors (pickle weights are refused, never unpickled), an unreadable
            index, or shards the index names that are missing.
    """
    d = Path(checkpoint_dir)
    index = d / INDEX_FILE
    if index.is_file():
        files = [d / name for name in sorted(set(read_index(d).values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise HFCheckpointError(
                f"{index} names {len(missing)} shard(s) missing from {d}: {', '.join(missing[:_SHOW])}. "
                "The download or copy is incomplete: fetch the missing shard file(s) again."
            )
        return _regular(files)
    if (d / SINGLE_FILE).is_file():
        return [d / SINGLE_FILE]
    files = sorted(d.glob("*.safetensors"))
    if files:
        return _regular(files)
    pickles = sorted(p.name for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise HFCheckpointError(
            f"{d} holds PyTorch pickle weights ({', '.join(pickles[:_SHOW])}) and no *.safetensors. The workbench "
            "never unpickles weights (unpickling runs arbitrary code). Convert them to safetensors first, in an "
            "environment you trust: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT) writes "
            "model.safetensors."
        )
    raise HFCheckpointError(f"{d} has no model.safetensors (or shards + {INDEX_FILE}); nothing to load.")


def read_index(checkpoint_dir: Path) -> dict[str, str]:
    """The `weight_map` of a checkpoint's index (tensor key -> file name), checked: an object of plain
    `.safetensors` names in the same folder, refused (the file and the key named) before any file is opened.

    Raises:
        HFCheckpointError: not JSON, not an index, or a name that leaves the folder.
    """
    index = checkpoint_dir / INDEX_FILE
    try:
        weight_map = check(read_json(index), INDEX, str(index))["weight_map"]
        for name in set(weight_map.values()):
            inside(checkpoint_dir, name)
    except (OSError, ValueError) as e:
        raise HFCheckpointError(f"{e}: not a valid safetensors index (a 'weight_map' of key -> a .safetensors file "
                                "in the same folder). Re-download or re-export the checkpoint.") from None
    return weight_map


def _regular(files: list[Path]) -> list[Path]:
    """`files`, each checked to be a regular file (a FIFO or device would block the reader forever)."""
    for f in files:
        try:
            check_regular(f)
        except OSError as e:
            raise HFCheckpointError(f"{e}; a checkpoint holds regular files only. Fetch or export it again."
                                    ) from None
    return files


def _file_keys(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """key -> (shape, stored dtype) from one file's header (no tensor data read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise HFCheckpointError(
            f"{file} is not a readable safetensors file ({e}). It is probably truncated or corrupt (an "
            "interrupted download or copy): fetch or export it again."
        ) from None


def _expand(file: Path, key: str, shape: tuple[int, ...], dtype: str = "") -> dict[str, _Source]:
    """One stored tensor -> the per-expert HF keys it provides (itself, unless it is a fused expert tensor)."""
    m = _FUSED_EXPERTS.fullmatch(key)
    if m is None or len(shape) != 3:
        return {key: _Source(file, key, shape, dtype=dtype)}
    n_experts, rows, cols = shape
    prefix = m["prefix"]
    out = {}
    for e in range(n_experts):
        if m["kind"] == "down_proj":  # [E, H, I] -> per expert [H, I]
            out[f"{prefix}.{e}.down_proj.weight"] = _Source(file, key, (rows, cols), dtype, e)
        else:  # [E, 2I, H], gate rows first -> gate [I, H], up [I, H]
            half = rows // 2
            out[f"{prefix}.{e}.gate_proj.weight"] = _Source(file, key, (half, cols), dtype, e, slice(0, half))
            out[f"{prefix}.{e}.up_proj.weight"] = _Source(file, key, (half, cols), dtype, e, slice(half, rows))
    return out


def table_of_contents(checkpoint_dir: str | os.PathLike) -> dict[str, _Source]:
    """Per-expert HF key -> where its data lives, for every tensor of the checkpoint (headers only).

    Raises:
        HFCheckpointError: see `weight_files`; also a corrupt or truncated file, or an index that names a
            tensor its file does not hold.
    """
    d = Path(checkpoint_dir)
    toc: dict[str, _Source] = {}
    stored: dict[str, Path] = {}  # keys as stored, to check the index against
    for file in weight_files(d):
        for key, (shape, dtype) in _file_keys(file).items():
            stored[key] = file
            toc.update(_expand(file, key, shape, dtype))
    index = d / INDEX_FILE
    if index.is_file():
        weight_map = read_index(d)
        wrong = [k for k, name in weight_map.items() if k not in stored or stored[k].name != name]
        if wrong:
            raise HFCheckpointError(
                f"{index} lists {len(wrong)} tensor(s) that are not in the file it names, e.g. "
                + ", ".join(f"{k} (in {weight_map[k]}?)" for k in wrong[:_SHOW])
                + ". The index and the shards come from different exports: fetch the checkpoint again."
            )
    return toc


# ------------------------------------------------------------------------------------------------
# Units: the pieces loaded and exported one at a time
# ------------------------------------------------------------------------------------------------


def unit_of(key: str) -> str:
    """The module a key is loaded with: up to the first numeric path part (`layers.3`), else its owner."""
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1])


@dataclass
class _Unit:
    """One unit: its model keys, the HF keys they map to (meta tensors: shapes only), and the model keys
    with no HF counterpart (a tied lm_head, torchtitan's expert bias)."""

    name: str
    model: dict[str, torch.Tensor] = field(default_factory=dict)
    hf: dict[str, torch.Tensor] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)

    def relative(self, key: str) -> str:
        return key[len(self.name) + 1:] if self.name else key


def meta_state_dict(model_config) -> dict[str, torch.Tensor]:
    """The model's `state_dict()` built on the meta device: every key with its global shape, no memory."""
    with torch.device("meta"):
        return model_config.build().state_dict()


def plan_units(meta_sd: dict[str, torch.Tensor], adapter) -> list[_Unit]:
    """Groups a (meta) state dict into units, in model order, each with the HF keys the adapter gives it."""
    units: dict[str, _Unit] = {}
    for key, value in meta_sd.items():
        units.setdefault(unit_of(key), _Unit(unit_of(key))).model[key] = value
    for unit in units.values():
        unit.hf = adapter.to_hf(dict(unit.model))
        unit.dropped = [k for k, v in unit.model.items() if not adapter.to_hf({k: v})]
    return list(units.values())


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------


def _ignorable(key: str, shape: flavors.Qwen3Shape) -> bool:
    """Stored keys that carry nothing the model needs: RoPE tables, and lm_head when tied to the embedding."""
    return key.endswith(".rotary_emb.inv_freq") or (shape.tied and key == "lm_head.weight")


def check_against(toc: dict[str, _Source], units: list[_Unit], shape: flavors.Qwen3Shape, where: str) -> None:
    """Raises one HFCheckpointError listing missing, unexpected and mis-shaped keys (first few of each)."""
    expected = {k: tuple(v.shape) for u in units for k, v in u.hf.items()}
    missing = [k for k in expected if k not in toc]
    unexpected = [k for k in toc if k not in expected and not _ignorable(k, shape)]
    mismatched = [k for k in expected if k in toc and toc[k].shape != expected[k]]
    if not (missing or unexpected or mismatched):
        return
    lines = []
    if mismatched:
        lines.append(f"shape mismatch ({len(mismatched)}): " + "; ".join(
            f"{k} expected {list(expected[k])}, found {list(toc[k].shape)}" for k in mismatched[:_SHOW]))
    if missing:
        lines.append(f"missing ({len(missing)}): " + ", ".join(f"{k} {list(expected[k])}" for k in missing[:_SHOW]))
    if unexpected:
        lines.append(f"unexpected ({len(unexpected)}): " + ", ".join(
            f"{k} {list(toc[k].shape)}" for k in unexpected[:_SHOW]))
    raise HFCheckpointError(
        f"The weights in {where} do not match the model its config.json describes "
        f"({'MoE' if shape.is_moe else 'dense'}, dim {shape.dim}, {shape.n_layers} layers, vocab {shape.vocab_size}"
        f"{', tied' if shape.tied else ''}):\n  " + "\n  ".join(lines)
        + "\nconfig.json and the *.safetensors must come from the same model: re-export the checkpoint or fix "
        "config.json."
    )


def _read(keys: list[str], toc: dict[str, _Source]) -> dict[str, torch.Tensor]:
    """Reads HF tensors, opening each file once and closing it before returning (nothing stays mapped)."""
    from safetensors import SafetensorError, safe_open

    by_file: dict[Path, list[str]] = {}
    for key in keys:
        by_file.setdefault(toc[key].file, []).append(key)
    out = {}
    for file, file_keys in by_file.items():
        try:
            with safe_open(str(file), "pt") as f:
                for key in file_keys:
                    out[key] = toc[key].read(f)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise HFCheckpointError(f"Reading {file} failed ({e}); the file is corrupt: fetch it again.") from None
    return out


def _like(full: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """`full` (the global tensor) in the dtype of `live`, as the same kind of tensor: a DTensor holding only
    this rank's shard when `live` is one (each rank slices locally: src_data_rank=None)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(live.dtype)
    if isinstance(live, DTensor):
        return distribute_tensor(full, live.device_mesh, live.placements, src_data_rank=None)
    return full.to(live.device)


def _load_unit(root: torch.nn.Module, unit: _Unit, toc: dict[str, _Source], adapter,
               casts: dict[str, list[str]]) -> set[int]:
    """Loads one unit's weights into `root`; returns the ids of the parameters that received data. Each cast
    (stored dtype -> the model's) is added to `casts`; a weight that is not finite is refused (this rank checks its
    own shard)."""
    converted = adapter.from_hf(_read(list(unit.hf), toc))
    stray = sorted(set(converted) - set(unit.model))
    if stray:
        raise RuntimeError(f"The backend's hf_adapter mapped {unit.name} weights to keys outside it: {stray[:_SHOW]}")
    module = root.get_submodule(unit.name)
    live = module.state_dict()
    local = {}
    for k, v in converted.items():
        target = live[unit.relative(k)]
        if v.dtype != target.dtype:
            casts.setdefault(f"{str(v.dtype).removeprefix('torch.')} -> {str(target.dtype).removeprefix('torch.')}",
                             []).append(k)
        local[unit.relative(k)] = _like(v, target)
        if local[unit.relative(k)].is_floating_point() and not bool(torch.isfinite(_local(local[unit.relative(k)]))
                                                                    .all()):
            raise HFCheckpointError(f"The weights of {k} hold NaN or infinite values; a model started from them "
                                    "trains on NaN. Fetch the checkpoint again, or fix the model that wrote it.")
    del converted, live
    result = module.load_state_dict(local, strict=False)
    params = dict(module.named_parameters())
    not_loaded = [k for k in result.missing_keys if k in params]
    if not_loaded or result.unexpected_keys:
        raise RuntimeError(
            f"Loading {unit.name}: parameters not filled {not_loaded[:_SHOW]}, keys not taken "
            f"{result.unexpected_keys[:_SHOW]} (the backend's hf_adapter and the model disagree)."
        )
    return {id(p) for k, p in params.items() if k not in result.missing_keys}


def load_weights(model: torch.nn.Module, checkpoint_dir: str | os.PathLike, *, model_config, shape: flavors.Qwen3Shape,
                 backend: str) -> dict[str, float]:
    """Loads a Hugging Face checkpoint directory into a built model (plain, or FSDP/TP-sharded DTensors).

    Collective when the model is distributed: every rank calls it (each fills its own shards).

    Args:
        model: the model, already materialised (`to_empty` + init) and possibly parallelised.
        checkpoint_dir: config.json + *.safetensors.
        model_config: the model's torchtitan config (rebuilt on meta to learn every key and shape).
        shape: the architecture (from the checkpoint's config.json).
        backend: whose `hf_adapter` maps the keys.

    Returns:
        {"tensors": HF tensors read, "elements": their total number of values, "seconds": wall time,
        "casts": {"int8 -> float32": [model keys], ...} for every weight stored in another dtype than the model's}.

    Raises:
        HFCheckpointError: an unusable directory, weights that do not fit the model, or that are not finite (the
            message names the fix).
    """
    from workbench import backends

    t0 = time.perf_counter()
    toc = table_of_contents(checkpoint_dir)
    adapter = backends.hf_adapter(backend, shape)
    units = plan_units(meta_state_dict(model_config), adapter)
    check_against(toc, units, shape, str(checkpoint_dir))
    loaded: set[int] = set()
    casts: dict[str, list[str]] = {}
    for unit in units:
        if unit.hf:
            loaded |= _load_unit(model, unit, toc, adapter, casts)
    # A parameter of a unit without HF keys must be shared with a loaded one (the tied lm_head).
    unfilled = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in loaded]
    if unfilled:
        raise RuntimeError(f"No checkpoint weights reached {unfilled[:_SHOW]} (the backend's hf_adapter maps nothing "
                           "to them; if they should be tied, the model lost the tie).")
    elements = sum(math.prod(toc[k].shape) for u in units for k in u.hf)
    return {"tensors": sum(len(u.hf) for u in units), "elements": elements, "seconds": time.perf_counter() - t0,
            "casts": casts}


def describe_casts(casts: dict[str, list[str]]) -> str:
    """'cast on load: 3 weight(s) int8 -> float32 (first: a, b), ...': what `load_weights` converted."""
    return "cast on load: " + "; ".join(f"{len(keys)} weight(s) {kind} (first: {', '.join(keys[:2])})"
                                        for kind, keys in sorted(casts.items()))


def load_into_model(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> dict[str, float]:
    """Loads HF weights into a model from `workbench.load_model` (uses its `workbench_info`); a weight stored in
    another dtype than the model's is reported in a warning."""
    info = _info(model)
    stats = load_weights(model, checkpoint_dir, model_config=info.model_config, shape=info.shape,
                         backend=info.backend)
    if stats["casts"]:
        warnings.warn(f"{checkpoint_dir}: {describe_casts(stats['casts'])}", stacklevel=2)
    return stats


def load_into_trainer(trainer, path: str | os.PathLike) -> dict[str, float]:
    """Loads published weights into a `WorkbenchTrainer`'s (sharded) model before training; every rank calls it.

    Args:
        trainer: the trainer, after torchtitan built, parallelised and initialised `trainer.model_parts`.
        path: the checkpoint directory (`model.hf_checkpoint`).
    """
    job = trainer.job
    stats = load_weights(_single_part(trainer), path, model_config=trainer.model_config, shape=job.shape,
                         backend=job.model.backend)
    if _rank() == 0:
        print(f"loaded {stats['tensors']} Hugging Face tensors ({stats['elements'] / 1e6:.1f}M values) from {path} "
              f"in {stats['seconds']:.1f}s" + (f"; {describe_casts(stats['casts'])}" if stats["casts"] else ""),
              flush=True)
    return stats


# ------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------


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


def _single_part(trainer) -> torch.nn.Module:
    if len(trainer.model_parts) != 1:
        raise NotImplementedError(
            "Hugging Face load/export with pipeline parallelism (several model parts) is not supported.")
    return trainer.model_parts[0]


def _info(model: torch.nn.Module) -> ModelInfo:
    info = getattr(model, "workbench_info", None)
    if not isinstance(info, ModelInfo):
        raise TypeError("This model has no workbench_info: build it with workbench.load_model(...) "
                        "(it records the shape and backend that HF load/export need).")
    return info


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


def _shard_names(units: list[_Unit], dtype: torch.dtype, max_shard_bytes: int) -> dict[str, str]:
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
            raise RuntimeError(f"export plan not fulfilled: {unwritten} incomplete")
        names = set(self.file_of.values())
        if names != {SINGLE_FILE}:
            total = sum((self.folder / n).stat().st_size for n in names)  # close to tensor bytes; headers are tiny
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(self.file_of.items()))}
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _full_unit(model: torch.nn.Module, unit: _Unit, dtype: torch.dtype, keep: bool) -> dict[str, torch.Tensor]:
    """A unit's state dict gathered to full tensors (collective) and cast to `dtype`; {} where not `keep`."""
    from torch.distributed.tensor import DTensor

    out = {}
    for rel, value in model.get_submodule(unit.name).state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            out[f"{unit.name}.{rel}" if unit.name else rel] = value.detach().to(dtype=dtype, device="cpu", copy=True)
    return out


def _warn_dropped(model: torch.nn.Module, units: list[_Unit]) -> None:
    """Warns about non-zero buffers the HF format cannot hold (torchtitan's aux-loss-free expert bias)."""
    buffers = dict(model.named_buffers())
    lost = [k for u in units for k in u.dropped if k in buffers and bool(_local(buffers[k]).any())]
    if lost:
        warnings.warn(
            f"{len(lost)} non-zero buffer(s) have no Hugging Face equivalent and are not exported "
            f"({', '.join(lost[:3])}"
            f"{', ...' if len(lost) > 3 else ''}): torchtitan's expert-bias load balancing; the exported model routes "
            "without it. Train with model.moe_load_balance_coeff = 0 for an exact match.", stacklevel=3)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def export_weights(model: torch.nn.Module, out_dir: str | os.PathLike, *, model_config, shape: flavors.Qwen3Shape,
                   backend: str, dtype: str | torch.dtype, tokenizer_path: str = "", overwrite: bool = False,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Writes a model as a Hugging Face checkpoint directory; collective when the model is distributed.

    Args:
        model: a plain or parallelised (DTensor) model; every rank calls, rank 0 writes.
        out_dir: the directory to create.
        model_config: its torchtitan config (rebuilt on meta to plan keys, shapes and shards).
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
    units = plan_units(meta_state_dict(model_config), adapter)
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


def _write_units(model: torch.nn.Module, units: list[_Unit], adapter, dtype: torch.dtype,
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
    info = _info(model)
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
    job = trainer.job
    return export_weights(
        _single_part(trainer), out_dir, model_config=trainer.model_config, shape=job.shape,
        backend=job.model.backend, dtype=job.checkpoint.export_dtype,
        tokenizer_path=job.model.tokenizer_path, overwrite=overwrite,
    )


__all__ = [
    "ModelInfo", "weight_files", "table_of_contents", "unit_of",
    "meta_state_dict", "plan_units", "check_against", "load_weights", "load_into_model", "load_into_trainer",
    "export_dtype", "target_problem", "export_weights", "export_model", "export_trainer",
]
