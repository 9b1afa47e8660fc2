"""Which accelerator this process trains on: cpu, cuda or neuron.

`detect()` is cheap and import-safe. Pinning torchtitan to the detected kind is `workbench.platform.titan_device`;
the Neuron compiler's environment (the logical NeuronCore degree) is `workbench.core.neuron_env`.

Neuron (TorchNeuron, `torch-neuronx` 2.14): the PrivateUse1 device is called ``neuron`` and its process
group backend ``neuron``; both are written from AWS's public docs and are unverified here (no Trainium).
"""

from __future__ import annotations

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
