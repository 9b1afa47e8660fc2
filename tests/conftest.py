"""Fixtures shared by the tests; launch helpers live in tests/run_helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.run_helpers import FIRST_12_OF_30, cached_run, use_machine_cpu_path


@pytest.fixture(scope="module", autouse=True)
def launch_cpu_path(request):
    """In a module marked `machine_cpu_path`, everything the tests launch runs on this machine's own CPU path
    (`MACHINE_CPU_PATH` in run_helpers.py: why and when); module scope, so its shared launches do too."""
    if request.node.get_closest_marker("machine_cpu_path") is None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        use_machine_cpu_path(mp)
        yield


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
