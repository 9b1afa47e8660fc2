"""Fixtures shared by the integration files."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.run_helpers import cached_run, losses_by_step


@pytest.fixture(scope="module")
def reference_12(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """12 uninterrupted native steps of configs/cpu_dense.toml on 2 ranks, checkpoints at 4, 8, 12 (lr schedule
    fixed to 12 steps): the run folder and its loss per step. One launch for every file that asks (`cached_run`)."""
    run_dir, _ = cached_run(tmp_path_factory, "configs/cpu_dense.toml", "--model.backend", "native",
                            "--checkpoint.enable", "true", "--lr_scheduler.total_steps", "12",
                            "--checkpoint.interval", "4", "--training.steps", "12", nproc=2)
    return run_dir, losses_by_step(run_dir)
