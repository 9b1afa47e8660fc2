"""The notebook tests' shared pieces: the batch runner's command line as a user runs it, and what an executed
notebook shows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat

from tests.run_helpers import ROOT


def cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python -m workbench.notebook ...` from the repository root."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "workbench.notebook", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def outputs_text(path: Path) -> str:
    """All text an executed notebook shows (streams, text/plain results, error values)."""
    nb = nbformat.read(str(path), as_version=4)
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif out.output_type == "error":
                parts.append(f"{out.ename}: {out.evalue}")
            elif "text/plain" in out.get("data", {}):
                parts.append(out.data["text/plain"])
    return "\n".join(parts)


def has_image(path: Path) -> bool:
    nb = nbformat.read(str(path), as_version=4)
    return any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
