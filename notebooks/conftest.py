"""pytest setup for running the notebooks under nbval (`pytest --nbval-lax ... notebooks/`).

nbval starts one kernel per notebook, in `notebooks/`, with this process's environment. Two things are set
here before any kernel starts:
  * PYTHONPATH gets the repository root, so the kernel and the torchrun children it launches import this
    checkout's `workbench` even when the project is not pip-installed (in CI it is: `pip install -e .`);
  * WORKBENCH_DASHBOARD=static (the dashboard would detect nbval anyway; this makes it explicit).
Each kernel starts on this machine's fast CPU path (`pytest_runtest_setup`), and every cell whose result is a raw
dict fails (`pytest_runtest_makereport`).
"""

import os
import re
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[1])
_parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *_parts])
os.environ.setdefault("WORKBENCH_DASHBOARD", "static")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """A notebook's kernel starts in its first cell's setup: it, and every torchrun it launches, run on this machine's
    fast CPU path (`MACHINE_CPU_PATH` in tests/run_helpers.py), not the test session's pinned one. No number a
    notebook shows is held to a stored value: its checked outputs are sanitized (nbval_sanitize.cfg)."""
    if item.path.suffix != ".ipynb":
        yield
        return
    from tests.run_helpers import use_machine_cpu_path

    with pytest.MonkeyPatch.context() as mp:
        use_machine_cpu_path(mp)
        yield


RAW_DICT = re.compile(r"^\{['\"].*\}$", re.S)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Fails a notebook cell whose result is a raw dict ("{'steps logged': 8, ...}"): every result a notebook shows
    goes through `workbench.notebook.display` (a table, checks with tolerances)."""
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed:
        return
    for out in getattr(item, "test_outputs", None) or []:
        text = out.get("data", {}).get("text/plain", "") if out.get("output_type") == "execute_result" else ""
        if RAW_DICT.match(text.strip()):
            report.outcome = "failed"
            report.longrepr = f"{item.name}: the cell's result is a raw dict; show it as a table:\n{text[:500]}"
