"""Blockwise Qwen3-MoE experts in plain torch: routing, the block plan, the blockwise MLP and a dense oracle.

The `nki_moe` path computes the routed experts *blockwise* so every shape is static (no recompiles on Neuron):

1. `plan_blocks`: sort the T*K (token, expert) assignments by expert, pad each expert's group to a whole number
   of `block_size` slots, give every block one expert (`block_to_expert_B`). Padding slots point at token T,
   a zero row appended to x, and carry affinity 0. The number of blocks is a static bound (`max_blocks`).
2. `blockwise_moe`: gather the block rows, run one SwiGLU expert MLP per block (batched `bmm` over blocks with
   the block's expert weights), scale each slot by its affinity and sum each token's K slots.

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


def max_blocks(num_tokens: int, top_k: int, num_experts: int, block_size: int) -> int:
    """Static upper bound on blocks: m + (T*K - m) // block_size with m = min(E, T*K) non-empty experts.

    Each non-empty expert with n rows needs ceil(n / bs) = 1 + (n - 1) // bs blocks; summing, the floors add to at
    most (T*K - m) // bs, and the total grows with m, so m = min(E, T*K) is the worst case. Never more than
    ceil(T*K / bs) + E.
    """
    assignments = num_tokens * top_k
    nonempty = min(num_experts, assignments)
    return nonempty + (assignments - nonempty) // block_size


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


def plan_blocks(topk_ids_TK: torch.Tensor, num_experts: int, block_size: int) -> BlockPlan:
    """Sort assignments by expert and pad each expert's group to whole blocks; no host sync, static shapes.

    Expert ids must lie in [0, num_experts) (not checked: that would need a device->host sync).
    """
    if topk_ids_TK.dim() != 2 or topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids_TK must be an integer [T, K] tensor, got {topk_ids_TK.dtype} {tuple(topk_ids_TK.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    T, K = topk_ids_TK.shape
    device = topk_ids_TK.device
    flat = topk_ids_TK.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, token order kept within an expert
    counts_E = torch.bincount(flat, minlength=num_experts)
    blocks_E = (counts_E + block_size - 1) // block_size
    block_end_E = torch.cumsum(blocks_E, 0)
    sorted_e = flat[order]
    # rank of each sorted assignment inside its expert group -> slot = first slot of the expert's blocks + rank
    rank = torch.arange(T * K, device=device) - (torch.cumsum(counts_E, 0) - counts_E)[sorted_e]
    slot = (block_end_E - blocks_E)[sorted_e] * block_size + rank

    num_b = max_blocks(T, K, num_experts, block_size)
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


class _ExpertBlocks(torch.autograd.Function):
    """y[b] = down_e(silu(gate_e x[b]) * up_e x[b]) for every block b, e = block_to_expert[b].

    Saves only the block inputs and the gate/up activations: the per-block weight copies ([B, F, D] each) are
    gathered again in backward instead of being kept alive between forward and backward.
    """

    @staticmethod
    def forward(ctx, x_BSD, w_gate_EFD, w_up_EFD, w_down_EDF, block_to_expert_B):
        g_BSF = torch.bmm(x_BSD, w_gate_EFD.index_select(0, block_to_expert_B).transpose(1, 2))
        u_BSF = torch.bmm(x_BSD, w_up_EFD.index_select(0, block_to_expert_B).transpose(1, 2))
        h_BSF = F.silu(g_BSF) * u_BSF
        ctx.save_for_backward(x_BSD, g_BSF, u_BSF, w_gate_EFD, w_up_EFD, w_down_EDF, block_to_expert_B)
        return torch.bmm(h_BSF, w_down_EDF.index_select(0, block_to_expert_B).transpose(1, 2))

    @staticmethod
    def backward(ctx, dy_BSD):
        x_BSD, g_BSF, u_BSF, w_gate_EFD, w_up_EFD, w_down_EDF, be_B = ctx.saved_tensors
        sig = torch.sigmoid(g_BSF)
        silu = g_BSF * sig
        h_BSF = silu * u_BSF
        dh_BSF = torch.bmm(dy_BSD, w_down_EDF.index_select(0, be_B))
        du_BSF = dh_BSF * silu
        dg_BSF = dh_BSF * u_BSF * (sig * (1 + g_BSF * (1 - sig)))  # d silu(g) / dg
        dx_BSD = torch.bmm(dg_BSF, w_gate_EFD.index_select(0, be_B))
        dx_BSD = dx_BSD.baddbmm_(du_BSF, w_up_EFD.index_select(0, be_B))
        # weight grads: per-block outer products summed into each block's expert
        dw_gate = torch.zeros_like(w_gate_EFD).index_add_(0, be_B, torch.bmm(dg_BSF.transpose(1, 2), x_BSD))
        dw_up = torch.zeros_like(w_up_EFD).index_add_(0, be_B, torch.bmm(du_BSF.transpose(1, 2), x_BSD))
        dw_down = torch.zeros_like(w_down_EDF).index_add_(0, be_B, torch.bmm(dy_BSD.transpose(1, 2), h_BSF))
        return dx_BSD, dw_gate, dw_up, dw_down, None


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


def blockwise_moe(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, *, block_size: int):
    """Routed experts computed blockwise (see module doc). Differentiable w.r.t. x, all weights and topk_weights.

    Computes in the input dtype; the affinity scaling and the sum over k run in fp32 and are cast back.
    """
    T, K, E, _, D = check_moe_args(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF)
    plan = plan_blocks(topk_ids_TK, E, block_size)
    x_pad = F.pad(x_TD, (0, 0, 0, 1))  # row T = zeros, read by padding slots
    x_BSD = x_pad.index_select(0, plan.token_index_N).view(plan.max_blocks, block_size, D)
    y_ND = _ExpertBlocks.apply(x_BSD, w_gate_EFD, w_up_EFD, w_down_EDF, plan.block_to_expert_B).view(-1, D)
    y_ND = y_ND.float() * slot_weights(topk_weights_TK, plan).float()[:, None]
    out_TD = y_ND.index_select(0, plan.slot_of_assignment_TK.reshape(-1)).view(T, K, D).sum(1)
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
