"""Blockwise Qwen3-MoE experts in plain torch: routing, the block plan, the blockwise MLP and a dense oracle.

The `nki_moe` path computes the routed experts *blockwise* so every shape is static (no recompiles on Neuron):

1. `plan_blocks`: sort the T*K (token, expert) assignments by expert, pad each expert's group to a whole number
   of `block_size` slots, give every block one expert (`block_to_expert_B`). Padding slots point at token T,
   a zero row appended to x, and carry affinity 0. The number of blocks is a static bound (`max_blocks`).
2. `blockwise_moe`: gather the block rows, run one SwiGLU expert MLP per block (a grouped GEMM over the
   block-aligned expert groups), scale each slot by its affinity and sum each token's K slots.

Weight layouts are torchtitan's GroupedExperts: gate `w1_EFD` [E, F, D], up `w3_EFD` [E, F, D], down `w2_EDF`
[E, D, F]; out[t] = sum_k w[t, k] * down_e(silu(gate_e x_t) * up_e x_t) with e = topk_ids[t, k].
The same algorithm runs as NKI kernels in `nki_moe.py`; `dense_moe_oracle` is an independent check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def route(router_logits_TE: torch.Tensor, top_k: int, *, norm_topk_prob: bool = True,
          expert_bias_E: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-choice top-k routing: returns (topk_weights_TK, topk_ids_TK).

    Without `expert_bias_E` this is Qwen3 / Hugging Face (`Qwen3MoeTopKRouter`): softmax in fp32 over all experts,
    top-k, renormalise the k weights to sum 1 if `norm_topk_prob`, weights cast back to the logits dtype.
    With `expert_bias_E` this is torchtitan's aux-loss-free balancing (`TokenChoiceTopKRouter`): the bias is added
    to the scores only to *choose* experts; the weights are gathered from the unbiased scores and renormalised
    with denominator sum + 1e-20; they stay fp32 (titan applies them in fp32).
    """
    scores_TE = torch.softmax(router_logits_TE.float(), dim=-1)
    if expert_bias_E is None:
        weights_TK, ids_TK = torch.topk(scores_TE, top_k, dim=-1)
        if norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return weights_TK.to(router_logits_TE.dtype), ids_TK
    _, ids_TK = torch.topk(scores_TE + expert_bias_E, top_k, dim=-1, sorted=False)
    weights_TK = scores_TE.gather(-1, ids_TK)
    if norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return weights_TK, ids_TK


def max_blocks(num_tokens: int, top_k: int, num_experts: int, block_size: int, min_blocks: int = 1) -> int:
    """Static upper bound on blocks: m * min_blocks + (T*K - m) // block_size with m = min(E, T*K) non-empty
    experts.

    Each non-empty expert with n rows needs max(min_blocks, ceil(n / bs)) <= min_blocks + (n - 1) // bs blocks;
    summing, the floors add to at most (T*K - m) // bs, and the total grows with m, so m = min(E, T*K) is the worst
    case. With min_blocks 1: never more than ceil(T*K / bs) + E.
    """
    assignments = num_tokens * top_k
    nonempty = min(num_experts, assignments)
    return nonempty * min_blocks + (assignments - nonempty) // block_size


@dataclass(frozen=True)
class BlockPlan:
    """Where every (token, k) assignment goes in the blockwise layout. N = max_blocks * block_size slots.

    Attributes:
        token_index_N: [N] int64, slot -> token; padding slots hold T (the zero row appended to x).
        assignment_of_slot_N: [N] int64, slot -> flat assignment t * K + k; padding slots hold T * K.
        slot_of_assignment_TK: [T, K] int64, (t, k) -> slot (the inverse map; used to combine).
        block_to_expert_B: [B] int64, block -> expert; sorted, trailing unused blocks repeat the last expert.
        num_blocks: 0-d int64 tensor, blocks that hold real rows (the rest are all padding).
        block_size: rows per block.
    """

    token_index_N: torch.Tensor
    assignment_of_slot_N: torch.Tensor
    slot_of_assignment_TK: torch.Tensor
    block_to_expert_B: torch.Tensor
    num_blocks: torch.Tensor
    block_size: int

    @property
    def max_blocks(self) -> int:
        return self.block_to_expert_B.numel()

    @property
    def num_slots(self) -> int:
        return self.token_index_N.numel()


def plan_blocks(topk_ids_TK: torch.Tensor, num_experts: int, block_size: int, min_blocks: int = 1) -> BlockPlan:
    """Sort assignments by expert and pad each expert's group to whole blocks, at least `min_blocks` for an expert
    with any rows (the NKI backward needs one full 128-slot tile per expert); no host sync, static shapes.

    Expert ids must lie in [0, num_experts) (not checked: that would need a device->host sync).
    """
    if topk_ids_TK.dim() != 2 or topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"topk_ids_TK must be an integer [T, K] tensor, got {topk_ids_TK.dtype} {tuple(topk_ids_TK.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    T, K = topk_ids_TK.shape
    device = topk_ids_TK.device
    flat = topk_ids_TK.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order kept within an expert
    # scatter-add rather than bincount: the same counts with a static output shape (bincount's depends on the
    # largest id), so the block plan also traces under fake tensors (workbench.plan).
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=device).index_add_(0, flat, torch.ones_like(flat))
    blocks_E = (counts_E + block_size - 1) // block_size
    blocks_E = torch.where(counts_E > 0, blocks_E.clamp(min=min_blocks), 0)
    block_end_E = torch.cumsum(blocks_E, 0)
    sorted_e = flat[order]
    # rank of each sorted assignment inside its expert group -> slot = first slot of the expert's blocks + rank
    rank = torch.arange(T * K, device=device) - (torch.cumsum(counts_E, 0) - counts_E)[sorted_e]
    slot = (block_end_E - blocks_E)[sorted_e] * block_size + rank

    num_b = max_blocks(T, K, num_experts, block_size, min_blocks)
    assignment_of_slot = torch.full((num_b * block_size,), T * K, dtype=torch.long, device=device)
    assignment_of_slot[slot] = order
    slot_of_assignment = torch.empty(T * K, dtype=torch.long, device=device)
    slot_of_assignment[order] = slot
    block_to_expert = torch.searchsorted(block_end_E, torch.arange(num_b, device=device), right=True)
    return BlockPlan(
        token_index_N=assignment_of_slot // K,  # padding: (T * K) // K = T
        assignment_of_slot_N=assignment_of_slot,
        slot_of_assignment_TK=slot_of_assignment.view(T, K),
        block_to_expert_B=block_to_expert.clamp_(max=num_experts - 1),
        num_blocks=block_end_E[-1],
        block_size=block_size,
    )


def slot_weights(topk_weights_TK: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """[N] affinity per slot (0 on padding slots); differentiable w.r.t. topk_weights_TK."""
    return F.pad(topk_weights_TK.reshape(-1), (0, 1))[plan.assignment_of_slot_N]


def expert_offsets(plan: BlockPlan, num_experts: int) -> torch.Tensor:
    """[E] int32 end slot of each expert's blocks (block-aligned group ends for a grouped GEMM); last == N."""
    ids = plan.block_to_expert_B
    blocks_E = torch.zeros(num_experts, dtype=torch.long, device=ids.device).index_add_(0, ids, torch.ones_like(ids))
    return (torch.cumsum(blocks_E, 0) * plan.block_size).to(torch.int32)


def check_moe_args(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF) -> tuple[int, ...]:
    """Validate shapes; returns (T, K, E, F, D)."""
    T, D = x_TD.shape
    E, F_, D_g = w_gate_EFD.shape
    problems = []
    if topk_ids_TK.shape != topk_weights_TK.shape or topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != T:
        problems.append(f"topk_ids {tuple(topk_ids_TK.shape)} / topk_weights {tuple(topk_weights_TK.shape)} must "
                        f"both be [T={T}, K]")
    if D_g != D or w_up_EFD.shape != w_gate_EFD.shape:
        problems.append(f"w_gate {tuple(w_gate_EFD.shape)} and w_up {tuple(w_up_EFD.shape)} must be [E, F, D={D}]")
    if tuple(w_down_EDF.shape) != (E, D, F_):
        problems.append(f"w_down {tuple(w_down_EDF.shape)} must be [E={E}, D={D}, F={F_}] (torchtitan w2_EDF)")
    if T < 1:
        problems.append("need at least one token")
    if problems:
        raise ValueError("blockwise MoE arguments: " + "; ".join(problems))
    return T, topk_ids_TK.shape[1], E, F_, D


def _grouped_mm_supported(x: torch.Tensor) -> bool:
    """`torch._grouped_mm` takes bf16/fp16 everywhere; fp32 only in eager CPU mode (its CUDA/meta checks reject it)."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return True
    return x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling()


def _expert_linear(x_ND, w_EOI, offs_E, block_to_expert_B, block_size):
    """y[n] = x[n] @ w[e(n)]^T, e(n) the expert of row n's block.

    Grouped GEMM over the block-aligned expert groups where supported; otherwise one `bmm` over blocks with each
    block's expert weights gathered (portable, but it copies an expert's weights per block).
    """
    if _grouped_mm_supported(x_ND):
        return torch._grouped_mm(x_ND, w_EOI.transpose(1, 2), offs=offs_E)
    x_BSI = x_ND.view(-1, block_size, x_ND.shape[1])
    return torch.bmm(x_BSI, w_EOI.index_select(0, block_to_expert_B).transpose(1, 2)).view(x_ND.shape[0], -1)


def blockwise_moe(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, *, block_size: int):
    """Routed experts computed blockwise (see module doc). Differentiable w.r.t. x, all weights and topk_weights.

    Blocks are sorted by expert, so the per-block MLPs of one expert's consecutive blocks run as one group of a
    grouped GEMM (`torch._grouped_mm`, as torchtitan uses) with block-aligned group ends: the same math as a loop
    over blocks, without copying an expert's weights per block. Computes in the input dtype; the affinity
    weighting and the sum over k run in fp32 and are cast back.
    """
    T, K, E, F_, D = check_moe_args(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF)
    plan = plan_blocks(topk_ids_TK, E, block_size)
    # _grouped_mm wants 16-byte row strides: zero-pad odd feature sizes (exact: padded features contribute 0)
    dp, fp = (-n % (16 // x_TD.element_size()) for n in (D, F_)) if _grouped_mm_supported(x_TD) else (0, 0)
    w_gate, w_up, w_down = w_gate_EFD, w_up_EFD, w_down_EDF
    if dp or fp:
        w_gate, w_up, w_down = (F.pad(w_gate, (0, dp, 0, fp)), F.pad(w_up, (0, dp, 0, fp)),
                                F.pad(w_down, (0, fp, 0, dp)))
    groups = (expert_offsets(plan, E), plan.block_to_expert_B, block_size)
    x_ND = F.pad(x_TD, (0, dp, 0, 1)).index_select(0, plan.token_index_N)  # padding slots read zero row T
    h_NF = F.silu(_expert_linear(x_ND, w_gate, *groups)) * _expert_linear(x_ND, w_up, *groups)
    y_ND = _expert_linear(h_NF, w_down, *groups)[:, :D]
    # combine: each token's K slot outputs, weighted and summed in fp32 ([T, 1, K] @ [T, K, D])
    y_TKD = y_ND.index_select(0, plan.slot_of_assignment_TK.reshape(-1)).view(T, K, D)
    out_TD = torch.bmm(topk_weights_TK.float()[:, None, :], y_TKD.float()).view(T, D)
    return out_TD.to(x_TD.dtype)


def dense_moe_oracle(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF):
    """Independent oracle (tests/benchmarks only): every expert on every token, weighted by its routing weight."""
    check_moe_args(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF)
    out = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    for e in range(w_gate_EFD.shape[0]):
        weight_T = (topk_weights_TK * (topk_ids_TK == e)).sum(-1)  # 0 where e was not chosen
        h = F.silu(x_TD @ w_gate_EFD[e].T) * (x_TD @ w_up_EFD[e].T)
        out = out + weight_T.float()[:, None] * (h @ w_down_EDF[e].T).float()
    return out.to(x_TD.dtype)
