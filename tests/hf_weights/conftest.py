"""Fixtures of the hf_weights tests: checkpoints written by transformers itself (random init, fp32) from small
custom shapes with a 512-token vocabulary, once per test process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hf_weights.helpers import DENSE, MOE
from tests.run_helpers import hf_model
from workbench.platform import titan_device

titan_device.pin("cpu")  # the fp32 reference numerics (also on machines with an accelerator)


@pytest.fixture(scope="session")
def ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """name -> (checkpoint dir, the transformers model that wrote it)."""
    root = tmp_path_factory.mktemp("hf")
    dense, moe = hf_model(DENSE), hf_model(MOE)
    layouts = {
        "dense": (dense, {}),
        "dense-sharded": (dense, {"max_shard_size": "20KB"}),
        "moe": (moe, {}),  # published per-expert keys (transformers' default on disk)
        "moe-sharded": (moe, {"max_shard_size": "20KB"}),
        "moe-fused": (moe, {"save_original_format": False}),  # v5 in-memory gate_up_proj / down_proj
    }
    out = {}
    for name, (model, kwargs) in layouts.items():
        model.save_pretrained(root / name, **kwargs)
        out[name] = (root / name, model)
    return out
