"""Kernels of the `nki_moe` path: the blockwise MoE experts three ways, tested to agree.

- `moe_reference`: torch reference with autograd (the CPU/CUDA training path) + routing + dense oracle.
- `nki_moe`: NKI forward/backward kernels (standalone `nki` API, imported through `nki_api`).
- `nki_emulator`: CPU executor of the NKI subset those kernels use, enforcing the documented rules.
- `autograd`: torch.autograd glue that runs the kernels (TorchNeuron custom ops on Neuron, emulator elsewhere).

The kernels launch on `logical_nc_config()` cores (LNC, 1 or 2): set by `set_logical_nc_config`, else read once
from NEURON_LOGICAL_NC_CONFIG; unset means 1 off-Neuron (trn2's runtime and neuronx-cc default to 2, and the
kernel's LNC must match the compiler's, else NCC_EVRF066).
"""

import os

from workbench.kernels.autograd import BlockwiseMoEFunction, blockwise_moe_auto, blockwise_moe_nki, nki_on_device
from workbench.kernels.moe_reference import (
    BlockPlan,
    blockwise_moe,
    dense_moe_oracle,
    max_blocks,
    plan_blocks,
    route,
    slot_weights,
)

_lnc: int | None = None


def set_logical_nc_config(lnc: int) -> None:
    """Make the kernels launch on `lnc` cores (1 or 2; `workbench.neuron_adjustments` calls this on Neuron)."""
    global _lnc
    if lnc not in (1, 2):
        raise ValueError(f"logical NeuronCore config must be 1 or 2, got {lnc!r} (NEURON_LOGICAL_NC_CONFIG)")
    _lnc = lnc


def logical_nc_config() -> int:
    """The LNC degree the kernels launch with: `set_logical_nc_config`'s value, else NEURON_LOGICAL_NC_CONFIG
    (read once; unset -> 1)."""
    if _lnc is None:
        raw = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1").strip()
        if raw not in ("1", "2"):
            raise ValueError(f"NEURON_LOGICAL_NC_CONFIG must be 1 or 2, got {raw!r}; unset it or set 1 or 2")
        set_logical_nc_config(int(raw))
    return _lnc


__all__ = [
    "BlockPlan",
    "BlockwiseMoEFunction",
    "blockwise_moe",
    "blockwise_moe_auto",
    "blockwise_moe_nki",
    "dense_moe_oracle",
    "logical_nc_config",
    "max_blocks",
    "nki_on_device",
    "plan_blocks",
    "route",
    "set_logical_nc_config",
    "slot_weights",
]

