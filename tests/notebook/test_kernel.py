"""workbench.notebook.kernel: registering the "Qwen3 workbench" Jupyter kernel never takes over another clone's."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def test_kernel_registration_never_takes_over_another_clones_kernel(tmp_path, monkeypatch):
    """`make setup` registers qwen3-workbench; a second clone's setup warns (naming the old Python) and keeps it."""
    from workbench.notebook.kernel import NAME, register, registered_python

    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("JUPYTER_PATH", "")
    warnings = []
    assert register(echo=lambda *_: None, warn=warnings.append) and registered_python() == Path(sys.executable)
    spec = tmp_path / "data" / "kernels" / NAME / "kernel.json"
    other = tmp_path / "other-clone" / ".venv" / "bin" / "python"
    other.parent.mkdir(parents=True)
    other.write_text("")  # another clone's interpreter, still there
    spec.write_text(json.dumps({"argv": [str(other), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                                "display_name": "Qwen3 workbench", "language": "python"}))
    assert not register(echo=lambda *_: None, warn=warnings.append)
    assert registered_python() == other and str(other) in warnings[0] and "--replace" in warnings[0]
    assert register(replace=True, echo=lambda *_: None) and registered_python() == Path(sys.executable)
    other.unlink()  # a deleted clone's kernel is taken over without asking
    spec.write_text(spec.read_text().replace(sys.executable, str(other)))
    assert register(echo=lambda *_: None, warn=warnings.append) and len(warnings) == 1
    assert registered_python() == Path(sys.executable)
