"""Shapes, tolerances and small readers shared by the hf_weights tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from workbench.core import flavors

DENSE = flavors.Qwen3Shape(32, 2, 4, 2, head_dim=8, ffn_dim=48, vocab_size=512, tied=True, max_seq_len=256)
MOE = flavors.Qwen3Shape(32, 2, 4, 2, head_dim=8, vocab_size=512, tied=False, max_seq_len=256, num_experts=4,
                         top_k=2, moe_ffn_dim=16)
TOL = 1e-4


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


def stored_keys(d: Path) -> set[str]:
    from safetensors import safe_open

    keys = set()
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            keys |= set(h.keys())
    return keys


def copy_of(saved, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved[name][0], tmp_path / name))
