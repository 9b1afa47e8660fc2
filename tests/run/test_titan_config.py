"""workbench.run.titan_config: torchtitan's config built from the workbench's, in this process."""

from __future__ import annotations

import math

import torch

from tests.run_helpers import ROOT
from workbench.core.config import load_config
from workbench.platform import titan_device

titan_device.pin("cpu")  # before torchtitan is imported (the titan config imports it)

from workbench.run.titan_config import build_titan_config  # noqa: E402


def test_a_gpu_launch_can_be_planned_on_a_host_without_one():
    """`python -m workbench.plan --device h200` on this CPU host built torchtitan's config for a cuda launch, whose
    MFU peak asked torch.cuda for the GPU's name: 'Found no NVIDIA driver' (found preparing the GPU run)."""
    assert not torch.cuda.is_available()
    job = load_config(ROOT / "configs/cpu_dense.toml", argv=["--job.dump_folder", "/nonexistent-never-written"])
    cfg = build_titan_config(job, "cuda", 1)
    assert math.isnan(cfg.metrics.peak_flops)  # no GPU to name: no MFU, and no crash
