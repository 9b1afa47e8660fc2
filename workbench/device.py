"""Which accelerator this process trains on: cpu, cuda or neuron.

`detect()` is cheap and import-safe. `prepare(kind)` must run before torchtitan is imported anywhere in
the process: torchtitan reads the device type once, at import of `torchtitan.tools.utils`, and falls back
to "cuda" when no accelerator is present. `prepare` fixes that choice (and, on CPU only, applies the
adjustments in `workbench.cpu_adjustments`).

Neuron (TorchNeuron, `torch-neuronx` 2.14): the PrivateUse1 device is called ``neuron`` and its process
group backend ``neuron``; both are written from AWS's public docs and are unverified here (no Trainium).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

KINDS = ("cpu", "cuda", "neuron")


@dataclass(frozen=True)
class DeviceInfo:
    """What `detect` found."""

    kind: str  # "cpu" | "cuda" | "neuron"
    count: int  # devices visible to this process (CPU: 1)
    name: str  # human-readable device name
    dist_backend: str  # torch.distributed backend for this kind


def neuron_available() -> bool:
    """True when TorchNeuron is installed (`torch_neuronx` importable)."""
    return importlib.util.find_spec("torch_neuronx") is not None


def detect(requested: str = "auto") -> DeviceInfo:
    """Finds the device kind to train on.

    Args:
        requested: "auto" (neuron > cuda > cpu), or one of "cpu", "cuda", "neuron" to force it.

    Raises:
        ValueError: an unknown kind, or a forced kind that is not present.
    """
    import torch

    if requested not in ("auto", *KINDS):
        raise ValueError(f"job.device must be one of auto, {', '.join(KINDS)}; got {requested!r}.")
    if requested in ("auto", "neuron") and neuron_available():
        import torch_neuronx  # noqa: F401  (registers the `neuron` device)

        count = torch.neuron.device_count() if hasattr(torch, "neuron") else 1
        return DeviceInfo("neuron", count, "trainium (neuron)", "neuron")
    if requested == "neuron":
        raise ValueError(
            "job.device='neuron' but torch_neuronx is not installed. On a trn2 instance install the Neuron "
            "packages from AWS's Neuron package index (see environment.yml); elsewhere use 'auto' or 'cpu'."
        )
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return DeviceInfo("cuda", torch.cuda.device_count(), torch.cuda.get_device_name(0), "nccl")
    if requested == "cuda":
        raise ValueError("job.device='cuda' but torch.cuda.is_available() is False; use 'auto' or 'cpu'.")
    return DeviceInfo("cpu", 1, "cpu", "gloo")


_prepared: str | None = None


def prepare(kind: str) -> None:
    """Pins torchtitan to `kind` (call before torchtitan is imported; idempotent).

    On CPU this also applies `workbench.cpu_adjustments` — the only place where torchtitan or
    transformers are adjusted to run on CPU.
    """
    global _prepared
    if _prepared == kind:
        return
    if _prepared is not None:
        raise RuntimeError(f"device already prepared as {_prepared!r}; cannot switch to {kind!r} in one process")
    if kind == "cpu":
        from workbench import cpu_adjustments

        cpu_adjustments.apply()
    elif kind == "neuron":
        # torchtitan asks torch.distributed which backend serves its device type; make sure "neuron" maps to
        # TorchNeuron's process group (per the TorchNeuron docs; unverified here).
        import torch.distributed as dist

        dist.Backend.default_device_backend_map.setdefault("neuron", "neuron")
        import torchtitan.tools.utils  # noqa: F401  (auto-detects the neuron PrivateUse1 device)
    else:
        import torchtitan.tools.utils  # noqa: F401  (auto-detects cuda)
    _prepared = kind


def prepared_kind() -> str | None:
    return _prepared
