"""Units: the pieces a model is loaded and exported in, one at a time (a decoder layer `layers.N`, or a top-level
module: embedding, final norm, lm_head), and the check of a checkpoint's tensors against them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.core import flavors
from workbench.core.errors import HFCheckpointError
from workbench.hf_weights.folder import SHOW, Source


@dataclass(frozen=True)
class ModelInfo:
    """What export needs to know about a model built by `workbench.load_model` (attached as `workbench_info`).

    Attributes:
        backend: the backend that built it (its `hf_adapter` maps the keys).
        shape: the architecture (written as config.json).
        model_config: the torchtitan model config (rebuilt on meta to list keys and shapes).
        tokenizer_path: `model.tokenizer_path` ("" = the bundled Qwen3 tokenizer).
    """

    backend: str
    shape: flavors.Qwen3Shape
    model_config: Any
    tokenizer_path: str = ""


def model_info(model: torch.nn.Module) -> ModelInfo:
    info = getattr(model, "workbench_info", None)
    if not isinstance(info, ModelInfo):
        raise TypeError("This model has no workbench_info: build it with workbench.load_model(...) "
                        "(it records the shape and backend that HF load/export need).")
    return info


def unit_of(key: str) -> str:
    """The module a key is loaded with: up to the first numeric path part (`layers.3`), else its owner."""
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1])


@dataclass
class Unit:
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


def group_units(meta_sd: dict[str, torch.Tensor], adapter) -> list[Unit]:
    """Groups a (meta) state dict into units, in model order, each with the HF keys the adapter gives it."""
    units: dict[str, Unit] = {}
    for key, value in meta_sd.items():
        units.setdefault(unit_of(key), Unit(unit_of(key))).model[key] = value
    for unit in units.values():
        unit.hf = adapter.to_hf(dict(unit.model))
        unit.dropped = [k for k, v in unit.model.items() if not adapter.to_hf({k: v})]
    return list(units.values())


def _ignorable(key: str, shape: flavors.Qwen3Shape) -> bool:
    """Stored keys that carry nothing the model needs: RoPE tables, and lm_head when tied to the embedding."""
    return key.endswith(".rotary_emb.inv_freq") or (shape.tied and key == "lm_head.weight")


def check_against(toc: dict[str, Source], units: list[Unit], shape: flavors.Qwen3Shape, where: str) -> None:
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
            f"{k} expected {list(expected[k])}, found {list(toc[k].shape)}" for k in mismatched[:SHOW]))
    if missing:
        lines.append(f"missing ({len(missing)}): " + ", ".join(f"{k} {list(expected[k])}" for k in missing[:SHOW]))
    if unexpected:
        lines.append(f"unexpected ({len(unexpected)}): " + ", ".join(
            f"{k} {list(toc[k].shape)}" for k in unexpected[:SHOW]))
    raise HFCheckpointError(
        f"The weights in {where} do not match the model its config.json describes "
        f"({'MoE' if shape.is_moe else 'dense'}, dim {shape.dim}, {shape.n_layers} layers, vocab {shape.vocab_size}"
        f"{', tied' if shape.tied else ''}):\n  " + "\n  ".join(lines)
        + "\nconfig.json and the *.safetensors must come from the same model: re-export the checkpoint or fix "
        "config.json."
    )


def single_part(trainer) -> torch.nn.Module:
    if len(trainer.model_parts) != 1:
        raise NotImplementedError(
            "Hugging Face load/export with pipeline parallelism (several model parts) is not supported.")
    return trainer.model_parts[0]



def local_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
