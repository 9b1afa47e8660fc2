"""Pins torchtitan to this process's device kind and applies the per-device adjustments.

`pin(kind)` must run before torchtitan is imported anywhere in the process: torchtitan reads the device type
once, at import of `torchtitan.tools.utils`, and falls back to "cuda" when no accelerator is present. `pin`
fixes that choice (and, on CPU only, applies the adjustments in `workbench.platform.cpu_adjustments`; where
`[neuron] apply` says so, those in `workbench.platform.neuron_adjustments`). Detection is `workbench.platform.device`.
"""

from __future__ import annotations

_pinned: str | None = None


def pin(kind: str, neuron_cfg=None) -> list[str]:
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
    global _pinned
    from workbench.core.config import Neuron
    from workbench.platform import neuron_adjustments

    if _pinned == kind:
        return []
    if _pinned is not None:
        raise RuntimeError(f"device already pinned to {_pinned!r}; cannot switch to {kind!r} in one process")
    neuron_cfg = neuron_cfg or Neuron()
    on_neuron_path = neuron_adjustments.applies(neuron_cfg, kind)
    if kind == "cpu":
        from workbench.platform import cpu_adjustments

        cpu_adjustments.apply(force_sum=not on_neuron_path)
    else:
        import torchtitan.tools.utils  # noqa: F401  (auto-detects cuda, or the neuron PrivateUse1 device)
    _pinned = kind
    return neuron_adjustments.apply(neuron_cfg, kind) if on_neuron_path else []


def pinned_kind() -> str | None:
    return _pinned
