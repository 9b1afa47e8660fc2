"""`make setup-neuron` installs the workbench into an existing Python without touching its torch.

The stand-in for a Neuron DLAMI venv: a fresh venv whose torch (and everything else) is pre-installed in another
site directory it sees through a `.pth` file — the way a system/DLAMI torch sits beside a user's packages. The real
`python -m workbench.setup_neuron` runs real pip in it; afterwards torch must be the same distribution at the same
place, and nothing named torch may have been installed into the venv.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

from tests.run_helpers import ROOT


@pytest.mark.slow
def test_setup_neuron_leaves_preinstalled_torch_untouched(tmp_path):
    venv = tmp_path / "neuron-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "preinstalled.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    torch_dist = metadata.distribution("torch")
    before = (torch_dist.version, Path(torch_dist._path).resolve(), (Path(torch_dist._path) / "RECORD").stat().st_mtime)

    proc = subprocess.run([py, "-m", "workbench.setup_neuron"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert f"kept as installed: torch=={before[0]}" in out
    assert f"torch {before[0]} untouched" in out
    after = metadata.distribution("torch")
    assert (after.version, Path(after._path).resolve(), (Path(after._path) / "RECORD").stat().st_mtime) == before
    assert not list(site.glob("torch*")), "a torch was installed into the venv"
    # the workbench itself is installed (editable) into the venv and imports from there
    assert list(site.glob("__editable__*qwen3_trainium_workbench*")), sorted(p.name for p in site.iterdir())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # import through the venv's install only
    check = subprocess.run([py, "-c", "import workbench.doctor, torch; print(workbench.doctor.__file__); "
                            "print(torch.__version__)"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert check.returncode == 0, check.stderr
    where, version = check.stdout.splitlines()
    assert where == str(ROOT / "workbench" / "doctor.py") and version.split("+")[0] == before[0]


def test_setup_neuron_refuses_without_torch(tmp_path):
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    proc = subprocess.run([venv / "bin" / "python", "-m", "workbench.setup_neuron"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "torch is not installed here" in proc.stderr and "never installs torch" in proc.stderr


def test_setup_neuron_checks_the_nki_the_kernels_are_written_for(tmp_path):
    """The check table setup-neuron prints before installing has the nki row: an NKI older than 0.7 warns (and
    does not stop the install); an SDK 2.34 torch-neuronx (2.14.3.1.*) is in the matrix and is pinned as found."""
    for name, version in (("nki", "0.6.0"), ("torch_neuronx", "2.14.3.1.52")):
        site = tmp_path / "site" / f"{name}-{version}.dist-info"
        site.mkdir(parents=True)
        (site / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site.parent), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "workbench.setup_neuron", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line[6:].startswith("nki "))
    assert row.startswith("warn") and "kernels written for NKI 0.7.0" in row and "nl.fori_loop" in row
    assert "kept as installed:" in proc.stdout and "nki==0.6.0" in proc.stdout
    assert "torch-neuronx==2.14.3.1.52" in proc.stdout
    tnx = next(line for line in proc.stdout.splitlines() if line[6:].startswith("torch-neuronx "))
    assert tnx.startswith("ok") and tnx.endswith("2.14.3.1.52 (Neuron SDK 2.34)")
