"""The package-level Python API (`workbench.__all__`) after every submodule has been imported.

A submodule named like a package-level function would replace that function on the package once imported (Python
binds `workbench.<name>` to the submodule): `workbench.export_hf` was such a case. This runs in a fresh interpreter
so that the imports are this test's own, not whatever the session imported before.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import importlib, pkgutil, sys, types
import torch
import workbench

names = [m.name for m in pkgutil.walk_packages(workbench.__path__, "workbench.")]
for name in names:
    importlib.import_module(name)
print("imported", len(names))

job = workbench.load_config("configs/cpu_dense.toml")
model = workbench.load_model(job, backend="native")
out = workbench.export_hf(model, sys.argv[1], dtype="float32")

from transformers import AutoModelForCausalLM

ids = torch.randint(0, 151936, (2, 12), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    ours = model(ids)
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
print("max_diff", float((ours - theirs).abs().max()))
assert isinstance(workbench.train, types.ModuleType) and callable(workbench.train.train)  # the launcher module
for name in ("load_config", "load_model", "export_hf"):
    assert callable(getattr(workbench, name)), (name, type(getattr(workbench, name)))
"""


def test_package_functions_work_after_every_submodule_is_imported(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "hf")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert int(lines["imported"]) >= 40  # the walk reached the subpackages (backends, kernels, notebook)
    assert float(lines["max_diff"]) <= 1e-4  # transformers reads back the weights the model computes with
