"""Path 3: torchtitan's native Qwen3-MoE whose routed experts run blockwise (NKI kernels on Trainium).

The swap happens in the model *config*, through torchtitan's ModelSpec seam — no fork, no monkey-patching: every
layer's `RoutedExperts.Config` is replaced by `BlockwiseRoutedExperts.Config`, a subclass whose module keeps the
same parameters (`routed_experts.inner_experts.w1_EFD / w2_EDF / w3_EFD`, so checkpoints, FSDP sharding and the
HF mapping are exactly the native path's) and replaces token dispatch + grouped matmuls + combine with
`workbench.kernels.blockwise_moe_auto`:

  * on a Neuron device: the NKI forward/backward kernels (`workbench/kernels/nki_moe.py`) inside autograd;
  * elsewhere (CPU, CUDA): the blockwise torch reference, the same algorithm with torch autograd.

The router is torchtitan's (softmax -> top-k -> renormalise; aux-loss-free expert bias when
`model.moe_load_balance_coeff > 0`), so `nki_moe` and `native` agree step for step from the same init.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import RoutedExperts
from torchtitan.protocols.model_spec import ModelSpec

from workbench.backends import native
from workbench.backends.config_swap import swap_configs
from workbench.core import flavors
from workbench.core.config import JobConfig
from workbench.kernels import blockwise_moe_auto


class BlockwiseRoutedExperts(RoutedExperts):
    """RoutedExperts computed blockwise: sort by expert, pad to blocks, one expert MLP per block, combine."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        block_size: int = 128
        """Slots per block. The torch reference pads each expert's tokens to whole blocks; the NKI kernels pad
        to 32-slot granules and run full blocks plus one tail piece per expert (`kernels.autograd.KernelPlan`)."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.block_size = config.block_size

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        del num_local_tokens_per_expert_E  # the blockwise layout recounts from the ids
        B, L, D = x_BLD.shape
        experts = self.inner_experts
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (experts.w1_EFD, experts.w2_EDF, experts.w3_EFD))
        dtype = x_BLD.dtype
        out_TD = blockwise_moe_auto(
            x_BLD.reshape(B * L, D), topk_expert_ids_BLK.reshape(B * L, -1),
            topk_scores_BLK.reshape(B * L, -1).to(dtype),
            w1.to(dtype), w3.to(dtype), w2.to(dtype), block_size=self.block_size,
        )
        return out_TD.view(B, L, D)


def model_config(job: JobConfig, shape: flavors.Qwen3Shape):
    """The native Qwen3-MoE config with every RoutedExperts swapped for BlockwiseRoutedExperts."""
    cfg = native.model_config(job, shape)
    swap_configs(cfg, RoutedExperts.Config, BlockwiseRoutedExperts.Config, block_size=job.model.moe_block_size)
    return cfg


def model_spec(job: JobConfig, flavor: str, shape: flavors.Qwen3Shape) -> ModelSpec:
    spec = native.model_spec(job, flavor, shape)
    return dataclasses.replace(spec, model=model_config(job, shape))


def hf_adapter(shape: flavors.Qwen3Shape):
    """Same parameter names as native, hence the same HF mapping."""
    return native.hf_adapter(shape)
