"""Fixtures shared by the tests; launch helpers live in tests/run_helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from run_helpers import FIRST_12_OF_30, cached_run


@pytest.fixture
def outdir(tmp_path: Path) -> Path:
    d = tmp_path / "outputs"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def native_moe_2rank(tmp_path_factory) -> Path:
    """configs/cpu_moe.toml, native, 12 of 30 steps, 2 ranks: also the reference for the other MoE paths."""
    return cached_run(tmp_path_factory, "configs/cpu_moe.toml", "--model.backend", "native", *FIRST_12_OF_30,
                      nproc=2)[0]
