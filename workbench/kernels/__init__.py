"""Kernels of the `nki_moe` path: the blockwise MoE experts three ways, tested to agree.

- `moe_reference`: torch reference with autograd (the CPU/CUDA training path) + routing + dense oracle.
- `nki_moe`: NKI forward/backward kernels (standalone `nki` API, imported through `nki_api`).
- `nki_emulator`: CPU executor of the NKI subset those kernels use, enforcing the documented rules.
- `autograd`: torch.autograd glue that runs the kernels (TorchNeuron custom ops on Neuron, emulator elsewhere).

The kernels launch on `workbench.core.neuron_env.logical_nc_config()` cores (LNC: NEURON_LOGICAL_NC_CONFIG, 2 when
unset as on trn2), the LNC the compiler uses: since NKI 0.7.0 it rejects a kernel whose LNC differs (NCC_EVRF066),
and the emulator checks the same.
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

