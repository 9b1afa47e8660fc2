"""Autograd glue: run the blockwise-MoE NKI kernels as a differentiable torch op.

`blockwise_moe_nki` has `blockwise_moe`'s signature and runs the NKI forward/backward kernels: on a Neuron device
through TorchNeuron custom ops, elsewhere through the CPU emulator (slow; for tests). `blockwise_moe_auto` is
what a model calls: the kernels on Neuron, the torch reference everywhere else.

The host side builds the block plan (`moe_reference.plan_blocks`), converts it to the kernels' int32 layouts,
pads x / dout with a zero row for padding slots, and hands the forward kernel transposed weight copies.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workbench.device import logical_nc_config
from workbench.kernels import nki_moe
from workbench.kernels.moe_reference import BlockPlan, blockwise_moe, check_moe_args, plan_blocks, slot_weights
from workbench.kernels.nki_api import REAL_NKI, nki


def kernel_block_size(block_size: int) -> int:
    """Slots per full kernel block: the plan's block if <= 128, else the largest of 256/128 dividing it.

    A plan block larger than that is several consecutive kernel blocks with the same expert (one segment, so
    the expert's weights are still loaded once). 256 keeps the backward's resident weights plus one block's
    activations inside SBUF at D = 2048 (docs/nki_kernels.md).
    """
    if 1 <= block_size <= nki_moe.P:
        return block_size
    for kb in (256, 128):
        if block_size % kb == 0:
            return kb
    raise ValueError(f"the NKI kernels need block_size <= 128 or a multiple of 128, got {block_size}")


TAIL_GRANULE = 32  # slots: each expert is padded to a multiple of this, not of the block


def slot_granule(kb: int) -> int:
    """G: each expert's slots are padded to a multiple of G. 32 when the kernel block KB is 32 x a power of two
    (its tail then runs as pieces of KB/2, ..., 32 slots), else KB itself (no tail pieces)."""
    r = kb // TAIL_GRANULE
    if kb % TAIL_GRANULE == 0 and r & (r - 1) == 0:
        return TAIL_GRANULE
    return kb


@dataclass(frozen=True)
class KernelPlan:
    """The block plan in the kernels' int32 layouts (see `nki_moe.moe_blockwise_fwd`), for `lnc` cores.

    The plan's blocks are slot groups of G (`plan.block_size`); each expert's groups run as full kernel blocks
    of KB = G * 2^(L-1) slots, then a tail of at most one piece of each of KB/2, ..., G slots (the binary digits
    of its remaining group count), so padding is only each expert's rounding up to G.

    Every core runs the same compiled control flow (the LNC page: control flow that differs between the cores is
    undefined). The non-empty experts, sorted by group count, are dealt to the cores in rounds (round s: position s
    of every core, the larger expert alternating between cores 0 and 1); at each position both cores run the same
    number of pieces of each width class, the core with fewer real pieces topping up with no-op pieces: they read
    the zero row of x (slot weight 0) and write only that core's `dummy_groups` slot rows, so the dW rows of its
    expert get exact zeros added and nothing it returns changes. Experts of equal group count have equal piece
    counts, so sorting makes most positions need none. Built with static-shaped tensor ops only (no host sync), so
    the kernels' input shapes depend on (T, K, E, block size, lnc) alone.
    """

    token_index: torch.Tensor  # [NG + lnc * KB/G, G]; the last lnc * KB/G groups: one KB-slot no-op area per core
    piece: torch.Tensor  # [M, 2]: first slot group, first slot row; per class, per core, per position
    seg_table: torch.Tensor  # [lnc * S, 1 + 2L]: core c's position s: expert, then [begin, end) piece rows per class
    seg_count: torch.Tensor  # [1, 1]: positions run, the same on every core
    slot_of_assignment: torch.Tensor  # [nT, TT, K], nT a multiple of lnc
    num_tokens: int
    lnc: int
    kb: int

    @classmethod
    def build(cls, topk_ids_TK: torch.Tensor, num_experts: int, block_size: int, lnc: int):
        """(slot plan at granule G, kernel plan) for the model's `block_size` (kernel block `kernel_block_size`)."""
        kb = kernel_block_size(block_size)
        plan = plan_blocks(topk_ids_TK, num_experts, slot_granule(kb))
        return plan, cls.from_plan(plan, num_experts, lnc, kb)

    @classmethod
    def from_plan(cls, plan: BlockPlan, num_experts: int, lnc: int, kb: int | None = None) -> "KernelPlan":
        G = plan.block_size
        kb = G if kb is None else kb
        r = kb // G
        if kb % G or r & (r - 1):
            raise ValueError(f"kernel block {kb} must be the slot granule {G} times a power of two")
        E = num_experts
        if lnc > E:
            raise ValueError(f"{E} experts on {lnc} logical cores: the NKI kernels give each core whole experts and "
                             f"need at least one per core; run at NEURON_LOGICAL_NC_CONFIG=1")
        L = r.bit_length()
        dev = plan.block_to_expert_B.device
        i32, i64 = torch.int32, torch.long
        ng = plan.max_blocks
        real = torch.arange(ng, device=dev) < plan.num_blocks
        n_E = torch.zeros(E, dtype=i64, device=dev).index_add_(0, plan.block_to_expert_B, real.long())  # groups
        gstart_E = n_E.cumsum(0) - n_E
        full_E, rem_E = n_E // r, n_E % r
        # per class k (KB >> k slots): pieces of each expert and the first slot group of its first one
        count_kE = [full_E] + [((rem_E & (r >> k)) > 0).long() for k in range(1, L)]
        first_kE = [gstart_E] + [gstart_E + r * full_E + (rem_E & ~(2 * (r >> k) - 1)) for k in range(1, L)]
        # positions: experts by group count (descending, empty ones last), dealt in rounds of lnc
        order = torch.argsort(n_E, descending=True, stable=True)
        nseg = (n_E > 0).sum()
        S = -(-E // lnc)
        s_cs = torch.arange(S, device=dev)[None, :].expand(lnc, S)
        c_cs = torch.arange(lnc, device=dev)[:, None].expand(lnc, S)
        rank = s_cs * lnc + (c_cs - s_cs) % lnc  # round s: core (j + s) % lnc takes its j-th largest expert
        live = rank < nseg
        own = order[rank.clamp(max=E - 1)]
        # a core without an expert at a position runs its no-op pieces on its own first expert, else on an empty
        # expert (one nobody else writes after the zero fill): never on another core's expert (lnc-race)
        spare = torch.where(live[:, :1], own[:, :1], order[nseg.clamp(max=E - 1)])
        expert_cs = torch.where(live, own, spare)
        runs_kcs = [torch.where(live, cnt[own], 0) for cnt in count_kE]  # real pieces per class, core, position
        m_ks = [runs.max(0).values for runs in runs_kcs]  # pieces every core runs there: real ones, then no-ops
        # piece rows: class k's rows per core, positions in order; bounds: sum_s m_0 <= all full blocks <= NG/r
        # and m_k <= 1 for the tail classes
        rows_k = [max(1, ng // r)] + [S] * (L - 1)
        noop_group = ng + r * torch.arange(lnc, device=dev)  # each core's KB-slot no-op area
        groups, cols = [], [expert_cs]
        base = 0
        for k in range(L):
            end_s = m_ks[k].cumsum(0)
            beg_s = end_s - m_ks[k]
            q = torch.arange(rows_k[k], device=dev)
            s_q = torch.searchsorted(end_s, q, right=True).clamp(max=S - 1)
            t_q = q - beg_s[s_q]  # index of the row's piece among those of its position
            for c in range(lnc):
                e_q = expert_cs[c, s_q]
                is_real = live[c, s_q] & (t_q < runs_kcs[k][c, s_q])
                groups.append(torch.where(is_real, first_kE[k][e_q] + r * t_q, noop_group[c]))
            cbase = base + rows_k[k] * torch.arange(lnc, device=dev)[:, None]
            cols += [cbase + beg_s[None, :], cbase + end_s[None, :]]
            base += lnc * rows_k[k]
        group = torch.cat(groups)
        T, K = plan.slot_of_assignment_TK.shape
        tt = min(T, nki_moe.P)
        nt = -(-T // (tt * lnc)) * lnc  # token tiles: a multiple of lnc, the same count per core in the combine
        soa = F.pad(plan.slot_of_assignment_TK, (0, 0, 0, nt * tt - T))  # padded tokens read slot 0 (always real)
        token_index = F.pad(plan.token_index_N.view(ng, G), (0, 0, 0, lnc * r), value=T)  # no-op areas: zero row
        return cls(
            token_index=token_index.to(i32),
            piece=torch.stack([group, group * G], 1).to(i32),
            seg_table=torch.stack(cols, 2).reshape(lnc * S, 1 + 2 * L).to(i32),
            seg_count=(-(-nseg // lnc)).view(1, 1).to(i32),
            slot_of_assignment=soa.to(i32).view(nt, tt, K),
            num_tokens=T,
            lnc=lnc,
            kb=kb,
        )

    def plan_args(self) -> tuple[torch.Tensor, ...]:
        """piece, seg_table, seg_count (kernel arguments after token_index and slot_weight)."""
        return (self.piece, self.seg_table, self.seg_count)

    def slot_weights(self, slot_weight_N: torch.Tensor) -> torch.Tensor:
        """The plan's [N] slot weights padded with the no-op areas' zeros (differentiable: grads slice back)."""
        return F.pad(slot_weight_N, (0, self.token_index.numel() - slot_weight_N.numel()))

    def pieces(self) -> list[tuple[int, int, int]]:
        """(core, slots, first slot row) of every piece the kernels run, no-op pieces included (their rows lie in
        the last lnc * KB slot rows); host-side, for tests and the cost report."""
        L = (self.seg_table.shape[1] - 1) // 2
        S = self.seg_table.shape[0] // self.lnc
        out = []
        for c in range(self.lnc):
            for s in range(int(self.seg_count[0, 0])):
                row = self.seg_table[c * S + s]
                for k in range(L):
                    for j in range(int(row[1 + 2 * k]), int(row[2 + 2 * k])):
                        out.append((c, self.kb >> k, int(self.piece[j, 1])))
        return out

    def tokens(self, out: torch.Tensor) -> torch.Tensor:
        """[nT, TT, D] kernel output -> [T, D]."""
        return out.reshape(-1, out.shape[-1])[: self.num_tokens]


@dataclass(frozen=True)
class Kernels:
    forward: Callable
    backward: Callable


class BlockwiseMoEFunction(torch.autograd.Function):
    """out = blockwise experts(x) via the NKI kernels; grads for x, slot weights and the three expert weights."""

    @staticmethod
    def forward(ctx, x_TD, slot_weight_N, w_gate_EFD, w_up_EFD, w_down_EDF, kplan: KernelPlan, kernels: Kernels):
        io = x_TD.dtype
        x_pad = F.pad(x_TD.contiguous(), (0, 0, 0, 1))
        weight = slot_weight_N.detach().float().view(kplan.token_index.shape)
        ctx.save_for_backward(x_pad, weight, w_gate_EFD, w_up_EFD, w_down_EDF)
        ctx.kplan, ctx.kernels, ctx.slot_dtype = kplan, kernels, slot_weight_N.dtype
        out = kernels.forward(kplan.lnc, x_pad, kplan.token_index, weight, *kplan.plan_args(),
                              kplan.slot_of_assignment, _transposed(w_gate_EFD, io), _transposed(w_up_EFD, io),
                              _transposed(w_down_EDF, io))
        return kplan.tokens(out)

    @staticmethod
    def backward(ctx, dout_TD):
        x_pad, weight, w_gate, w_up, w_down = ctx.saved_tensors
        kplan, io = ctx.kplan, x_pad.dtype
        dout_pad = F.pad(dout_TD.to(io).contiguous(), (0, 0, 0, 1))
        dx, d_slot, dw_gate, dw_up, dw_down = ctx.kernels.backward(
            kplan.lnc, x_pad, dout_pad, kplan.token_index, weight, *kplan.plan_args(), kplan.slot_of_assignment,
            w_gate.to(io).contiguous(), w_up.to(io).contiguous(), w_down.to(io).contiguous(),
            _transposed(w_gate, io), _transposed(w_up, io))
        return (kplan.tokens(dx), d_slot.reshape(-1).to(ctx.slot_dtype), dw_gate.to(w_gate.dtype),
                dw_up.to(w_up.dtype), dw_down.to(w_down.dtype), None, None)


def _transposed(w, dtype):
    """[E, A, B] -> contiguous [E, B, A] copy in the kernels' io dtype."""
    return w.to(dtype).transpose(1, 2).contiguous()


@functools.cache
def neuron_stack_available() -> bool:
    try:
        import nki  # noqa: F401
        import torch_neuronx  # noqa: F401
    except ImportError:
        return False
    return True


def nki_on_device(x: torch.Tensor) -> bool:
    """True when x lives on a Neuron device and torch-neuronx + nki import: the kernels run natively."""
    return x.device.type == "neuron" and neuron_stack_available()


@functools.cache
def neuron_moe_op():
    """The kernels as one TorchNeuron custom op with autograd, so `torch.compile` sees a single node (no break).

    `torch_neuronx.nki_op` turns a function calling `@nki.jit` kernels into a torch.library custom op; its
    `register_autograd(backward, setup_context=...)` attaches the backward op, as
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/guides/how-to-work-with-nki.html describes.
    unverified: written from those docs; nothing here has run on Trainium. Only called where `nki_on_device`.
    """
    from torch_neuronx import nki_op

    Tensor = torch.Tensor

    @nki_op("workbench::moe_blockwise_fwd", mutates_args={})
    def moe_fwd(lnc: int, x_pad: Tensor, token_index: Tensor, slot_weight: Tensor, piece: Tensor, seg_table: Tensor,
                seg_count: Tensor, slot_of_assignment: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
        io = x_pad.dtype
        return nki_moe.moe_blockwise_fwd[lnc](
            x_pad, token_index, slot_weight, piece, seg_table, seg_count, slot_of_assignment, _transposed(w_gate, io),
            _transposed(w_up, io), _transposed(w_down, io))

    @nki_op("workbench::moe_blockwise_bwd", mutates_args={})
    def moe_bwd(lnc: int, x_pad: Tensor, dout_pad: Tensor, token_index: Tensor, slot_weight: Tensor,
                piece: Tensor, seg_table: Tensor, seg_count: Tensor, slot_of_assignment: Tensor, w_gate: Tensor,
                w_up: Tensor, w_down: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        io = x_pad.dtype
        return nki_moe.moe_blockwise_bwd[lnc](
            x_pad, dout_pad, token_index, slot_weight, piece, seg_table, seg_count, slot_of_assignment,
            w_gate.to(io).contiguous(), w_up.to(io).contiguous(), w_down.to(io).contiguous(),
            _transposed(w_gate, io), _transposed(w_up, io))

    def setup_context(ctx, inputs, output):
        ctx.lnc = inputs[0]
        ctx.save_for_backward(*inputs[1:])

    def backward(ctx, dout):
        x_pad, *plan, w_gate, w_up, w_down = ctx.saved_tensors
        T = x_pad.shape[0] - 1  # rows past T of out are padded tokens: their grads are dropped, row T is zero
        dout_pad = F.pad(dout.reshape(-1, dout.shape[-1])[:T].to(x_pad.dtype), (0, 0, 0, 1))
        dx, d_slot, dw_gate, dw_up, dw_down = moe_bwd(ctx.lnc, x_pad, dout_pad, *plan, w_gate, w_up, w_down)
        grads = [None] * 11
        grads[1] = F.pad(dx.reshape(-1, dx.shape[-1])[:T], (0, 0, 0, 1))
        grads[3] = d_slot
        grads[8], grads[9], grads[10] = dw_gate.to(w_gate.dtype), dw_up.to(w_up.dtype), dw_down.to(w_down.dtype)
        return tuple(grads)

    moe_fwd.register_autograd(backward, setup_context=setup_context)
    return moe_fwd


def _on_host(kernel) -> Callable:
    """Run a kernel on CPU tensors: the emulator, or `nki.simulate` (fp32 numpy) where the real nki imports."""

    def run(lnc, *args):
        device = args[0].device
        if REAL_NKI:
            if any(a.dtype == torch.bfloat16 for a in args):
                raise NotImplementedError("nki.simulate from this wrapper takes fp32 inputs (numpy has no bf16)")
            outs = nki.simulate(kernel[lnc])(*(a.detach().cpu().numpy() for a in args))
            outs = tuple(torch.from_numpy(o) for o in (outs if isinstance(outs, tuple) else (outs,)))
        else:
            outs = kernel[lnc](*(a.detach().cpu() for a in args))
            outs = outs if isinstance(outs, tuple) else (outs,)
        outs = tuple(o.to(device) for o in outs)
        return outs if len(outs) > 1 else outs[0]

    return run


HOST_KERNELS = Kernels(_on_host(nki_moe.moe_blockwise_fwd), _on_host(nki_moe.moe_blockwise_bwd))


def blockwise_moe_nki(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, *, block_size: int):
    """`blockwise_moe` computed by the NKI kernels (natively on Neuron, else through the CPU emulator), launched on
    the configured logical NeuronCore count (`workbench.device.logical_nc_config()`, the compiler's LNC)."""
    _, _, E, _, _ = check_moe_args(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF)
    plan, kplan = KernelPlan.build(topk_ids_TK, E, block_size, logical_nc_config())
    slot_w = kplan.slot_weights(slot_weights(topk_weights_TK, plan))
    if nki_on_device(x_TD):  # one custom op with registered autograd: traceable by torch.compile
        out = neuron_moe_op()(kplan.lnc, F.pad(x_TD, (0, 0, 0, 1)), kplan.token_index,
                              slot_w.float().view(kplan.token_index.shape), *kplan.plan_args(),
                              kplan.slot_of_assignment, w_gate_EFD, w_up_EFD, w_down_EDF)
        return kplan.tokens(out).to(x_TD.dtype)
    return BlockwiseMoEFunction.apply(x_TD, slot_w, w_gate_EFD, w_up_EFD, w_down_EDF, kplan, HOST_KERNELS)


def blockwise_moe_auto(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, *, block_size: int):
    """The training path: NKI kernels on a Neuron device, the torch reference (`blockwise_moe`) elsewhere."""
    fn = blockwise_moe_nki if nki_on_device(x_TD) else blockwise_moe
    return fn(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, block_size=block_size)
