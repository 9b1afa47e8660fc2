"""Pins one CPU code path for the whole test session, before anything imports torch (why and what:
`PINNED_CPU_PATH` in tests/run_helpers.py), and sets glibc's malloc to keep freed memory (`SESSION_MALLOC`, same
file). Every xdist worker and torchrun rank a test starts inherits both, but for the launches of modules marked
`machine_cpu_path` and the notebooks' kernels, which get this machine's own CPU path (`MACHINE_CPU_PATH`, same file)."""

from __future__ import annotations

import os

from tests.run_helpers import PINNED_ACTIVE, PINNED_CPU_PATH, SESSION_MALLOC, active_cpu_path

os.environ.update(PINNED_CPU_PATH)
os.environ.update(SESSION_MALLOC)  # read by glibc when a process starts: children only


def pytest_sessionstart(session):
    """Refuse to run when the pin did not take in this process (torch ran an op before this file set it)."""
    active = active_cpu_path()
    if active != PINNED_ACTIVE:
        raise RuntimeError(f"the pinned CPU code path did not take in the test process: {active}, expected "
                           f"{PINNED_ACTIVE}; something ran a torch op before conftest.py set {PINNED_CPU_PATH}")
