"""Which accelerator this process trains on: cpu, cuda or neuron.

`detect()` is cheap and import-safe. `prepare(kind)` must run before torchtitan is imported anywhere in
the process: torchtitan reads the device type once, at import of `torchtitan.tools.utils`, and falls back
to "cuda" when no accelerator is present. `prepare` fixes that choice (and, on CPU only, applies the
adjustments in `workbench.platform.cpu_adjustments`).

Neuron (TorchNeuron, `torch-neuronx` 2.14): the PrivateUse1 device is called ``neuron`` and its process
group backend ``neuron``; both are written from AWS's public docs and are unverified here (no Trainium).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from workbench.core.errors import DeviceError

KINDS = ("cpu", "cuda", "neuron")


@dataclass(frozen=True)
class DeviceInfo:
    """What `detect` found."""

    kind: str  # "cpu" | "cuda" | "neuron"
    count: int  # devices visible to this process (CPU: 1)
    name: str  # human-readable device name
    dist_backend: str  # torch.distributed backend for this kind


NEURON_FIX = ("install the Neuron packages into this Python from AWS's Neuron package index "
              "(`make setup-neuron` checks them; see README 'Devices'), or set --job.device cpu")


def neuron_device_files(dev_dir: str | None = None) -> list[str]:
    """Neuron device nodes on this host (`/dev/neuron0`, ...): present on Trainium/Inferentia instances.

    Args:
        dev_dir: where to look; default `$WORKBENCH_DEV_DIR` or `/dev` (tests point it at a temp dir).
    """
    root = Path(dev_dir or os.environ.get("WORKBENCH_DEV_DIR", "/dev"))
    return sorted(str(p) for p in root.glob("neuron[0-9]*"))


def import_neuron() -> str | None:
    """Imports TorchNeuron (which registers the `neuron` device and process group).

    Returns:
        None when it imported, else the import error as one line.
    """
    if importlib.util.find_spec("torch_neuronx") is None:
        return "No module named 'torch_neuronx'"
    try:
        import torch_neuronx  # noqa: F401
    except Exception as e:  # a broken install raises anything from ImportError to OSError (missing libnrt)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
    return None


def neuron_available() -> bool:
    """True when TorchNeuron imports."""
    return import_neuron() is None


def detect(requested: str = "auto") -> DeviceInfo:
    """Finds the device kind to train on.

    Args:
        requested: "auto" (neuron > cuda > cpu), or one of "cpu", "cuda", "neuron" to force it.

    Raises:
        DeviceError: an unknown kind; a forced kind that is not present; or "auto" on a host with Neuron device
            files where TorchNeuron does not import (training 64 CPU ranks of a 30B model is never what was meant).
    """
    import torch

    if requested not in ("auto", *KINDS):
        raise DeviceError(f"job.device must be one of auto, {', '.join(KINDS)}; got {requested!r}.")
    if requested in ("auto", "neuron"):
        error = import_neuron()
        if error is None:
            count = torch.neuron.device_count() if hasattr(torch, "neuron") else 1
            return DeviceInfo("neuron", count, "trainium (neuron)", "neuron")
        files = neuron_device_files()
        if requested == "neuron":
            raise DeviceError(f"job.device=neuron but torch_neuronx does not import ({error}): {NEURON_FIX}.")
        if files:
            raise DeviceError(
                f"this host has Neuron devices ({files[0]}, ... {len(files)} in all) but torch_neuronx does not import "
                f"({error}): {NEURON_FIX}."
            )
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return DeviceInfo("cuda", torch.cuda.device_count(), torch.cuda.get_device_name(0), "nccl")
    if requested == "cuda":
        why = "no GPU visible" if torch.version.cuda else "a CPU-only build"
        raise DeviceError(f"job.device=cuda but torch.cuda.is_available() is False (torch {torch.__version__}: {why}): "
                          "run on a GPU host with a CUDA build of torch, or set --job.device auto/cpu.")
    return DeviceInfo("cpu", 1, "cpu", "gloo")


_prepared: str | None = None


def prepare(kind: str, neuron_cfg=None) -> list[str]:
    """Pins torchtitan to `kind` (call before torchtitan is imported; idempotent).

    On CPU this also applies `workbench.platform.cpu_adjustments` — the only place where torchtitan or transformers are
    adjusted to run on CPU — and, where `[neuron] apply` says so (on the neuron device by default),
    `workbench.platform.neuron_adjustments`.

    Args:
        kind: "cpu", "cuda" or "neuron".
        neuron_cfg: the job's `[neuron]` section (`workbench.core.config.Neuron`); None = its defaults.

    Returns:
        The Neuron adjustments applied (empty when none).
    """
    global _prepared
    from workbench.core.config import Neuron
    from workbench.platform import neuron_adjustments

    if _prepared == kind:
        return []
    if _prepared is not None:
        raise RuntimeError(f"device already prepared as {_prepared!r}; cannot switch to {kind!r} in one process")
    neuron_cfg = neuron_cfg or Neuron()
    on_neuron_path = neuron_adjustments.applies(neuron_cfg, kind)
    if kind == "cpu":
        from workbench.platform import cpu_adjustments

        cpu_adjustments.apply(force_sum=not on_neuron_path)
    else:
        import torchtitan.tools.utils  # noqa: F401  (auto-detects cuda, or the neuron PrivateUse1 device)
    _prepared = kind
    return neuron_adjustments.apply(neuron_cfg, kind) if on_neuron_path else []


def prepared_kind() -> str | None:
    return _prepared


LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
TRN2_LNC = 2  # trn2's runtime and neuronx-cc default when NEURON_LOGICAL_NC_CONFIG is unset (NCC_EVRF066)


def logical_nc_config(default: int = TRN2_LNC) -> int:
    """The logical NeuronCore degree: `NEURON_LOGICAL_NC_CONFIG` (1 or 2), else `default` (trn2: 2).

    The one reader of that variable (it lives here because this module imports no torch). The NKI kernels launch
    on this many cores and the NKI emulator checks their launch grid against it, as neuronx-cc does since NKI
    0.7.0 (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/error-codes/EVRF066.html).

    Raises:
        ValueError: a value the Neuron SDK does not support (it supports LNC 1 and 2).
    """
    raw = os.environ.get(LNC_ENV, "").strip()
    if not raw:
        return default
    if raw not in ("1", "2"):
        raise ValueError(f"{LNC_ENV}={raw!r}: the Neuron SDK supports 1 or 2; export {LNC_ENV}=2 (trn2's default) "
                         "or 1, or unset it")
    return int(raw)


@contextlib.contextmanager
def compiled_for_lnc(lnc: int):
    """Inside the block `NEURON_LOGICAL_NC_CONFIG` is `lnc`, the compiler's LNC a kernel launch must match (NKI
    0.7.0); the previous value (or its absence) comes back afterwards. For tools that run the kernels at an LNC
    of their own: the memory plan, the cost report, the nki-library conformance command."""
    saved = os.environ.get(LNC_ENV)
    os.environ[LNC_ENV] = str(lnc)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(LNC_ENV, None)
        else:
            os.environ[LNC_ENV] = saved
