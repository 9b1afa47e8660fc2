"""Pins one CPU code path for the whole test session, before anything imports torch (why and what:
`PINNED_CPU_PATH` in tests/run_helpers.py). Every torchrun rank and notebook kernel a test starts inherits it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))
from run_helpers import PINNED_ACTIVE, PINNED_CPU_PATH, active_cpu_path  # noqa: E402

os.environ.update(PINNED_CPU_PATH)


def pytest_sessionstart(session):
    """Refuse to run when the pin did not take in this process (torch ran an op before this file set it)."""
    active = active_cpu_path()
    if active != PINNED_ACTIVE:
        raise RuntimeError(f"the pinned CPU code path did not take in the test process: {active}, expected "
                           f"{PINNED_ACTIVE}; something ran a torch op before conftest.py set {PINNED_CPU_PATH}")
