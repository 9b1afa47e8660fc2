"""Loading published weights into any workbench model, one unit at a time (never the whole checkpoint at once).

  1. the table of contents (`folder.table_of_contents`): the index and every shard's header;
  2. a check against what the backend's adapter expects (its `to_hf` of the model's state dict built on the meta
     device): missing, unexpected and mis-shaped keys are reported together, before any weight is touched;
  3. one unit at a time: its tensors are read with `safe_open` (each file opened only for that unit, so no shard
     stays mapped), converted by the adapter, cut to the local shard of each live DTensor (`distribute_tensor` with
     `src_data_rank=None`: every rank slices its own part, no communication) and `load_state_dict`-ed into the
     unit, whose own hooks handle layout details such as torchtitan's fused QKV.
  Peak host memory per rank: its shard of the model plus one unit in full.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from pathlib import Path

import torch

from workbench.core import flavors
from workbench.core.errors import HFCheckpointError
from workbench.hf_weights.folder import SHOW, Source, table_of_contents
from workbench.hf_weights.units import (
    Unit,
    check_against,
    group_units,
    local_tensor,
    meta_state_dict,
    model_info,
    single_part,
)
from workbench.platform.dist_utils import rank as _rank


def _read(keys: list[str], toc: dict[str, Source]) -> dict[str, torch.Tensor]:
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


def _load_unit(root: torch.nn.Module, unit: Unit, toc: dict[str, Source], adapter,
               casts: dict[str, list[str]]) -> set[int]:
    """Loads one unit's weights into `root`; returns the ids of the parameters that received data. Each cast
    (stored dtype -> the model's) is added to `casts`; a weight that is not finite is refused (this rank checks its
    own shard)."""
    converted = adapter.from_hf(_read(list(unit.hf), toc))
    stray = sorted(set(converted) - set(unit.model))
    if stray:
        raise RuntimeError(f"The backend's hf_adapter mapped {unit.name} weights to keys outside it: {stray[:SHOW]}")
    module = root.get_submodule(unit.name)
    live = module.state_dict()
    local = {}
    for k, v in converted.items():
        target = live[unit.relative(k)]
        if v.dtype != target.dtype:
            casts.setdefault(f"{str(v.dtype).removeprefix('torch.')} -> {str(target.dtype).removeprefix('torch.')}",
                             []).append(k)
        mine = local[unit.relative(k)] = _like(v, target)
        if mine.is_floating_point() and not bool(torch.isfinite(local_tensor(mine)).all()):
            raise HFCheckpointError(f"The weights of {k} hold NaN or infinite values; a model started from them "
                                    "trains on NaN. Fetch the checkpoint again, or fix the model that wrote it.")
    del converted, live
    result = module.load_state_dict(local, strict=False)
    params = dict(module.named_parameters())
    not_loaded = [k for k in result.missing_keys if k in params]
    if not_loaded or result.unexpected_keys:
        raise RuntimeError(
            f"Loading {unit.name}: parameters not filled {not_loaded[:SHOW]}, keys not taken "
            f"{result.unexpected_keys[:SHOW]} (the backend's hf_adapter and the model disagree)."
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
    units = group_units(meta_state_dict(model_config), adapter)
    check_against(toc, units, shape, str(checkpoint_dir))
    loaded: set[int] = set()
    casts: dict[str, list[str]] = {}
    for unit in units:
        if unit.hf:
            loaded |= _load_unit(model, unit, toc, adapter, casts)
    # A parameter of a unit without HF keys must be shared with a loaded one (the tied lm_head).
    unfilled = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in loaded]
    if unfilled:
        raise RuntimeError(f"No checkpoint weights reached {unfilled[:SHOW]} (the backend's hf_adapter maps nothing "
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
    info = model_info(model)
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
    stats = load_weights(single_part(trainer), path, model_config=trainer.model_config, shape=trainer.run.shape,
                         backend=trainer.run.backend)
    if _rank() == 0:
        print(f"loaded {stats['tensors']} Hugging Face tensors ({stats['elements'] / 1e6:.1f}M values) from {path} "
              f"in {stats['seconds']:.1f}s" + (f"; {describe_casts(stats['casts'])}" if stats["casts"] else ""),
              flush=True)
    return stats
