"""MoE expert matmuls with and without `torch._grouped_mm`: the choices behind `model.moe_experts_impl`.

Both MoE paths that compute experts with grouped GEMMs (native: torchtitan's `GroupedExperts`; huggingface_v5:
transformers' experts kernels) call `torch._grouped_mm`. On the `neuron` device that is AWS's own recipe path from
Neuron SDK 2.34: its TorchTitan Neuron MoE recipes (Qwen3-30B-A3B, DeepSeek-V3-16B, GPT-OSS-20B; TP4 x FSDP16 on
Trn2) "now use upstream torch._grouped_mm and the models' own attention, not Neuron blockwise MoE kernels", at about
1.3x the MFU of the 2.33 recipes (torch-neuronx v2.34.0 release notes). Under SDK 2.33 it was unconfirmed for
`neuron`; the fallbacks below stay for that SDK and for checking. `model.moe_experts_impl` picks how the experts run:

    grouped_mm   torch._grouped_mm (default; what CPU and CUDA run, and AWS's 2.34 Neuron MoE recipes)
    batched_mm   each expert's tokens padded to the largest group -> one batched matmul (`torch.bmm`)
    loop         one matmul per expert over its token rows

For native, `FallbackGroupedExperts` swaps only torchtitan's `_grouped_mm` seam (a documented override point), so
parameters, sharding, checkpoints and the HF mapping stay torchtitan's. For huggingface_v5 the same choice maps onto
transformers' own registered implementations (`HF_EXPERTS`). tests/backends/test_moe_experts.py checks outputs and
gradients of every choice against grouped_mm (1e-5, fp32).

Both fallbacks read the group sizes on the host (`.tolist()` / `.item()`): fine for a fallback, but on a compiling
device the batched capacity is a dynamic shape. Caveat documented in docs/devices.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torchtitan.models.common.moe import GroupedExperts

from workbench.backends.config_swap import swap_configs

Impl = Literal["grouped_mm", "batched_mm", "loop"]

HF_EXPERTS = {"grouped_mm": "grouped_mm", "batched_mm": "batched_mm", "loop": "eager"}
"""model.moe_experts_impl -> transformers' `experts_implementation`."""


def grouped_mm(A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor, impl: Impl = "grouped_mm") -> torch.Tensor:
    """Row group g of `A` (rows offs[g-1]..offs[g]) times `B_t[g]`, as `torch._grouped_mm(A, B_t, offs=offs)`.

    Args:
        A: [R, D] rows sorted by group.
        B_t: [G, D, F] one matrix per group.
        offs: [G] int32 cumulative row counts (end of each group).
        impl: "grouped_mm", "batched_mm" or "loop".

    Returns:
        [R, F]; rows past offs[-1] (if any) are zero.
    """
    if impl == "grouped_mm":
        return torch._grouped_mm(A, B_t, offs=offs)
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    n_rows, n_used = A.shape[0], int(ends[-1].item()) if ends.numel() else 0
    tail = A.new_zeros(n_rows - n_used, B_t.shape[-1])  # grouped_mm leaves no group for these rows
    if impl == "loop":
        pieces = [A[s:e] @ B_t[g] for g, (s, e) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)) if e > s]
        return torch.cat([*pieces, tail])
    if impl == "batched_mm":
        counts = ends - starts
        group_of_row = torch.repeat_interleave(torch.arange(len(counts), device=A.device), counts)
        slot = torch.arange(n_used, device=A.device) - starts[group_of_row]  # position inside its group
        padded = A.new_zeros(len(counts), int(counts.max().item()) if n_used else 0, A.shape[1])
        padded = padded.index_put((group_of_row, slot), A[:n_used])
        out = torch.bmm(padded, B_t)[group_of_row, slot]
        return torch.cat([out, tail])
    raise ValueError(f"unknown experts implementation {impl!r}; choose grouped_mm, batched_mm or loop")


class FallbackGroupedExperts(GroupedExperts):
    """torchtitan's GroupedExperts with its `_grouped_mm` seam computed by `grouped_mm(..., impl)`."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        impl: str = "batched_mm"
        """batched_mm or loop (see the module docstring)."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.impl = config.impl

    def _grouped_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return grouped_mm(A, B_t, offs, self.impl)


def use_fallback_experts(model_cfg, impl: Impl) -> int:
    """Replaces every `GroupedExperts.Config` in a torchtitan model config by `FallbackGroupedExperts.Config`.

    Returns:
        How many were replaced (0 for a dense model, or impl "grouped_mm", which changes nothing).
    """
    if impl == "grouped_mm":
        return 0
    return swap_configs(model_cfg, GroupedExperts.Config, FallbackGroupedExperts.Config, impl=impl)
