"""pytest setup for running the notebooks under nbval (`pytest --nbval-lax ... notebooks/`).

nbval starts one kernel per notebook, in `notebooks/`, with this process's environment. Two things are set
here before any kernel starts:
  * PYTHONPATH gets the repository root, so the kernel and the torchrun children it launches import this
    checkout's `workbench` even when the project is not pip-installed (in CI it is: `pip install -e .`);
  * WORKBENCH_DASHBOARD=static (the dashboard would detect nbval anyway; this makes it explicit).
"""

import os
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
_parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *_parts])
os.environ.setdefault("WORKBENCH_DASHBOARD", "static")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
