"""Kernels of the `nki_moe` path: the blockwise MoE experts three ways, tested to agree.

- `moe_reference`: torch reference with autograd (the CPU/CUDA training path) + routing + dense oracle.
- `nki_moe`: NKI forward/backward kernels (standalone `nki` API, imported through `nki_api`).
- `nki_emulator`: CPU executor of the NKI subset those kernels use, enforcing the documented rules.
- `autograd`: torch.autograd glue that runs the kernels (TorchNeuron custom ops on Neuron, emulator elsewhere).
"""

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

__all__ = [
    "BlockPlan",
    "BlockwiseMoEFunction",
    "blockwise_moe",
    "blockwise_moe_auto",
    "blockwise_moe_nki",
    "dense_moe_oracle",
    "max_blocks",
    "nki_on_device",
    "plan_blocks",
    "route",
    "slot_weights",
]


# (lead placeholder until the issue-12 kernels land; replaced at merge)
_LNC: int | None = None


def set_logical_nc_config(lnc: int) -> None:
    global _LNC
    if lnc not in (1, 2):
        raise ValueError(f"logical NeuronCore degree must be 1 or 2; got {lnc}")
    _LNC = lnc
