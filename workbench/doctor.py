"""Readiness report: `python -m workbench.doctor [--job.config_file X] [--nproc N] [--json] [--section.key value ...]`.

One line per check, `ok` / `warn` / `fail`, each with the fix; exit code 1 if any check fails. Checks the software
against TorchNeuron's support matrix (`SUPPORT`), the Neuron devices of this host, the logical-core setting, ranks
and memory per rank, and free disk for the configured flavor's checkpoints. Notebook 00_setup shows the same table.

Everything is read from the environment as it is: installed package metadata (`importlib.metadata`), device files
under `$WORKBENCH_DEV_DIR` (default `/dev`), `NEURON_LOGICAL_NC_CONFIG`, the disk. Tests point those at stand-ins.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

# TorchNeuron's support matrix ("Release Notes for Neuron Component: TorchNeuron", Neuron 2.33.0 and the
# torch-neuronx v2.34.0 release notes): the PyTorch 2.14 package family of each Neuron SDK, Python 3.12 / 3.13 / 3.14,
# "install torch-neuronx==2.14.* with PyTorch 2.14". The rest are this project's pins.
SUPPORT = {
    "python": ((3, 12), (3, 14)),
    "torch": "2.14.0",
    "torch-neuronx": "2.14.",  # version prefix of the package families that match torch 2.14.0
    "torchtitan": "0.3.0",
    "transformers": "5.23.0",
}
NEURON_SDKS = {"2.14.3.0": "2.33", "2.14.3.1": "2.34"}  # torch-neuronx family (PyTorch 2.14) -> Neuron SDK
MATRIX_SOURCE = "TorchNeuron release notes of Neuron 2.33.0 and 2.34.0 (support matrix)"

# trn2.48xlarge: 16 Trainium2 chips, 8 physical NeuronCore-v3 and 96 GiB HBM each (AWS Neuron docs, "Trainium2
# Architecture Guide for NKI": https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/arch/trainium2_arch.html;
# 16 chips per instance: "Amazon EC2 Trn2 Architecture" in the same docs).
TRN2_CORES_PER_CHIP = 8
TRN2_HBM_PER_CHIP = 96 * 2**30


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    value: str
    fix: str = ""


def installed_version(dist: str) -> str | None:
    """The installed version of a distribution (from its metadata), or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _base(version: str) -> str:
    return version.split("+", 1)[0]  # PyPI's torch is "2.14.0+cu130": the local tag does not change the API


def neuron_host() -> list[str]:
    from workbench.platform.device import neuron_device_files

    return neuron_device_files()


def software_checks(on_neuron: bool) -> list[Check]:
    """Python and package versions against `SUPPORT`. `on_neuron`: this host has Neuron devices (stricter)."""
    checks = []
    lo, hi = SUPPORT["python"]
    py = sys.version_info[:2]
    checks.append(Check("python", "ok" if lo <= py <= hi else "fail", f"{py[0]}.{py[1]}",
                        "" if lo <= py <= hi else f"use Python {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]} ({MATRIX_SOURCE})"))

    torch_v = installed_version("torch")
    if torch_v is None:
        checks.append(Check("torch", "fail", "not installed",
                            "on trn2: install torch-neuronx (it brings torch 2.14.0); elsewhere: `make setup`"))
    elif _base(torch_v) == SUPPORT["torch"]:
        checks.append(Check("torch", "ok", torch_v))
    else:
        checks.append(Check("torch", "fail" if on_neuron else "warn", torch_v,
                            f"TorchNeuron supports torch {SUPPORT['torch']} only ({MATRIX_SOURCE}); install "
                            f"torch=={SUPPORT['torch']} (on trn2: the one torch-neuronx 2.14.3 installs)"))

    tnx = installed_version("torch-neuronx")
    if tnx is None:
        checks.append(Check("torch-neuronx", "fail" if on_neuron else "ok", "not installed",
                            "install torch-neuronx 2.14.3.* from AWS's Neuron package index, then `make setup-neuron`"
                            if on_neuron else "only needed on Trainium"))
    elif (sdk := neuron_sdk(tnx)) is not None:
        checks.append(Check("torch-neuronx", "ok", f"{tnx} (Neuron SDK {sdk})"))
    elif tnx.startswith(SUPPORT["torch-neuronx"]):
        families = ", ".join(f"{f}.* (SDK {s})" for f, s in NEURON_SDKS.items())
        checks.append(Check("torch-neuronx", "warn", tnx, f"a PyTorch 2.14 family this workbench was not checked "
                            f"against (known: {families}); read its release notes, or install one of those"))
    else:
        checks.append(Check("torch-neuronx", "fail", tnx,
                            f"the workbench needs the 2.14.3.* family (PyTorch 2.14.0) ({MATRIX_SOURCE})"))

    checks.append(nki_check(installed_version("nki"), on_neuron))

    for dist in ("torchtitan", "transformers"):
        v = installed_version(dist)
        if v is None:
            checks.append(Check(dist, "fail", "not installed", "`make setup` (or `make setup-neuron` on trn2)"))
        else:
            good = _base(v) == SUPPORT[dist]
            checks.append(Check(dist, "ok" if good else "warn", v,
                                "" if good else f"tested with {dist}=={SUPPORT[dist]} (pyproject.toml)"))
    return checks


def neuron_sdk(torch_neuronx: str) -> str | None:
    """The Neuron SDK whose torch-neuronx family `torch_neuronx` belongs to ('2.14.3.1.52' -> '2.34'), or None."""
    return NEURON_SDKS.get(".".join(_base(torch_neuronx).split(".")[:4]))


def kernels_nki_version() -> tuple[str, str]:
    """(NKI version, Neuron SDK) the NKI kernels are written for and the CPU emulator models (`NKI_VERSION`,
    `NEURON_SDK` of workbench/kernels/nki_emulator/version.py). Read from that file: importing the kernels package
    imports torch, and setup-neuron runs the doctor before the dependencies are installed."""
    path = Path(__file__).parent / "kernels" / "nki_emulator" / "version.py"
    spec = importlib.util.spec_from_file_location("_workbench_nki_version", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NKI_VERSION, module.NEURON_SDK


def nki_check(installed: str | None, on_neuron: bool) -> Check:
    """The installed `nki` against the version the kernels are written for: that minor version ok, else warn."""
    want, sdk = kernels_nki_version()
    written = f"kernels written for NKI {want} (Neuron SDK {sdk})"
    if installed is None:
        return Check("nki", "warn" if on_neuron else "ok", f"not installed; {written}",
                     f"nki_moe on Trainium needs nki {want} from AWS's Neuron package index (Neuron SDK {sdk})"
                     if on_neuron else f"only needed on Trainium; here the kernels run on the CPU emulator, which "
                     f"models NKI {want}")
    have = tuple(int(p) for p in _base(installed).split(".")[:2] if p.isdigit())
    minor = tuple(int(p) for p in want.split(".")[:2])
    if have == minor:
        return Check("nki", "ok", f"{installed}; {written}")
    if have < minor:
        why = (f"the kernels use nl.fori_loop (NKI >= 0.6) and are checked against NKI {want}'s rules; install nki "
               f"{want[:-1]}x (Neuron SDK {sdk}, the SDK with TorchNeuron)")
    else:
        why = (f"the kernels are checked only against NKI {want}'s rules and a newer NKI can remove what they use "
               f"(as 0.7.0 removed nl.dynamic_range; see the NKI migration guide): install nki {want[:-1]}x or "
               "re-check the kernels under this version")
    return Check("nki", "warn", f"{installed}; {written}", why)


def device_checks(nproc: int | None, files: list[str]) -> list[Check]:
    """Neuron device files, visible devices, LNC, and ranks / memory per rank on this node."""
    from workbench.core.neuron_env import LNC_ENV, runtime_lnc

    checks = []
    if not files:
        checks.append(Check("neuron devices", "ok", "none (not a Trainium host)"))
    else:
        checks.append(Check("neuron devices", "ok", f"{len(files)} ({files[0]} ...)"))
    visible = "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            visible = f"{torch.cuda.device_count()} cuda"
        if files and hasattr(torch, "neuron"):
            visible = f"{torch.neuron.device_count()} neuron"
    except ImportError:
        visible = "torch not importable"
    checks.append(Check("visible devices", "ok", visible))

    raw = os.environ.get(LNC_ENV, "")
    try:
        lnc = runtime_lnc(on_neuron=bool(files))  # a Neuron host: its device files
        lnc_check = Check("NEURON_LOGICAL_NC_CONFIG", "ok", raw or f"unset (= {lnc})")
        if files and not raw:
            lnc_check.fix = "set it explicitly (export NEURON_LOGICAL_NC_CONFIG=2) so compiler, runtime and NKI agree"
            lnc_check.status = "warn"
    except ValueError as e:
        lnc, lnc_check = 1, Check("NEURON_LOGICAL_NC_CONFIG", "fail", raw, str(e))
    checks.append(lnc_check)

    if files:
        ranks = len(files) * TRN2_CORES_PER_CHIP // lnc
        per_rank = len(files) * TRN2_HBM_PER_CHIP / ranks
        fits = nproc is None or nproc <= ranks
        checks.append(Check("ranks per node", "ok" if fits else "fail", f"{ranks} at LNC={lnc}"
                            + (f" (asked: {nproc})" if nproc else ""),
                            "" if fits else f"use --nproc_per_node <= {ranks}"))
        checks.append(Check("memory per rank", "ok", f"{per_rank / 2**30:.0f} GiB HBM"))
    else:
        import psutil

        ranks = nproc or 1
        checks.append(Check("ranks per node", "ok", f"{ranks} (CPU cores: {os.cpu_count()})"))
        checks.append(Check("memory per rank", "ok",
                            f"{psutil.virtual_memory().total / ranks / 2**30:.1f} GiB host RAM"))
    return checks


def disk_check(job) -> Check:
    """Free space for the run's checkpoints of the configured flavor at their peak (`run_folder.checkpoint_space`)."""
    from workbench.core import flavors
    from workbench.run.run_folder import CHECKPOINT_BYTES_PER_PARAM, checkpoint_space

    one = flavors.param_counts(job.shape)["total"] * CHECKPOINT_BYTES_PER_PARAM
    c = job.checkpoint
    space = checkpoint_space(job.run_dir / c.folder, one, c.keep_latest_k, job.training.steps, c.interval)
    free = space.free_bytes
    value = (f"{free / 1e9:,.1f} GB free in {space.where}; one {job.model.flavor or 'model'} checkpoint "
             f"{one / 1e9:,.2f} GB")
    if free < one:
        return Check("disk", "fail", value, "free space or point job.dump_folder at a larger volume")
    if not space.fits:
        return Check("disk", "warn", value, f"{space.copies} checkpoints at once (checkpoint.keep_latest_k="
                                            f"{c.keep_latest_k}) need {space.need_bytes / 1e9:,.1f} GB more; lower "
                                            "keep_latest_k or free space")
    return Check("disk", "ok", value)


def run_checks(job=None, nproc: int | None = None) -> list[Check]:
    """Every check, in report order. `job`: a JobConfig for the disk check (None skips it)."""
    files = neuron_host()
    checks = software_checks(on_neuron=bool(files)) + device_checks(nproc, files)
    if job is not None:
        checks.append(disk_check(job))
    return checks


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        line = f"{c.status:<4}  {c.name:<{width}}  {c.value}"
        if c.fix:
            line += f"  ({c.fix})" if c.status == "ok" else f"  -> {c.fix}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from workbench.core.config import load_config
    from workbench.core.errors import ConfigError, announce

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    nproc = None
    if "--nproc" in argv:
        i = argv.index("--nproc")
        nproc = int(argv[i + 1])
        del argv[i:i + 2]
    job = None
    if argv:  # a config (and overrides) to check the disk against; without one the disk check is skipped
        try:
            job = load_config(argv=argv, world_size=nproc or 1)  # the config's parallel degrees for --nproc ranks
        except ConfigError as e:
            return announce(e)
    checks = run_checks(job, nproc)
    if job is None:
        checks.append(Check("disk", "ok", "not checked", "pass --job.config_file X to check checkpoint space"))
    print(json.dumps([asdict(c) for c in checks], indent=2) if as_json else format_table(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
