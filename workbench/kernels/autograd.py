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
    of its remaining group count), so padding is only each expert's rounding up to G. Built with static-shaped
    tensor ops only (no host sync), so the kernels' input shapes depend on (T, K, E, block size, lnc) alone.
    """

    token_index: torch.Tensor  # [NG, G]
    piece: torch.Tensor  # [M, 2]: first slot group, first slot row
    seg_table: torch.Tensor  # [lnc * E, 1 + 2L]: expert, then [begin, end) piece rows per class
    seg_count: torch.Tensor  # [lnc, 1]
    slot_of_assignment: torch.Tensor  # [nT, TT, K]
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
        L = r.bit_length()
        E = num_experts
        dev = plan.block_to_expert_B.device
        i32, i64 = torch.int32, torch.long
        ng = plan.max_blocks
        bte = plan.block_to_expert_B
        real = torch.arange(ng, device=dev) < plan.num_blocks
        n_E = torch.zeros(E, dtype=i64, device=dev).index_add_(0, bte, real.long())  # slot groups per expert
        gstart_E = n_E.cumsum(0) - n_E
        full_E, rem_E = n_E // r, n_E % r
        # class 0: full KB blocks, every expert's in order
        mf = max(1, ng // r)
        fend_E = full_E.cumsum(0)
        fbeg_E = fend_E - full_E
        j = torch.arange(mf, device=dev)
        e_j = torch.searchsorted(fend_E, j, right=True).clamp(max=E - 1)
        groups = [torch.where(j < fend_E[-1], gstart_E[e_j] + r * (j - fbeg_E[e_j]), 0)]
        begins, ends = [fbeg_E], [fend_E]
        # class k >= 1: one piece of r >> k groups where that bit of the expert's remainder is set
        for k in range(1, L):
            m = r >> k
            has = (rem_E & m) > 0
            cend = has.long().cumsum(0)
            cbeg = cend - has.long()
            start = gstart_E + r * full_E + (rem_E & ~(2 * m - 1))
            tab = torch.zeros(E + 1, dtype=i64, device=dev).scatter_(0, torch.where(has, cbeg, E), start)[:E]
            off = mf + (k - 1) * E
            groups.append(tab)
            begins.append(cbeg + off)
            ends.append(cend + off)
        group = torch.cat(groups)
        # segments: the non-empty experts in order, split between cores at the boundary closest to half the groups
        order = torch.argsort((n_E == 0).to(torch.int8), stable=True)
        nseg = (n_E > 0).sum()
        valid = torch.arange(E, device=dev) < nseg
        if lnc == 1:
            cuts = torch.stack([torch.zeros_like(nseg), nseg])
        else:
            total = n_E.sum()
            ends_g = torch.where(valid, (gstart_E + n_E)[order], total)
            k = (2 * ends_g <= total).sum()
            k_up = torch.clamp(k + 1, max=nseg)
            end_at = lambda q: torch.where(q > 0, ends_g[torch.clamp(q - 1, min=0)], torch.zeros_like(total))  # noqa: E731
            better_up = (2 * end_at(k_up) - total).abs() < (2 * end_at(k) - total).abs()
            cut = torch.where(better_up, k_up, k)
            cuts = torch.stack([torch.zeros_like(nseg), cut, nseg])
        cols = [order]
        for k in range(L):
            cols.append(begins[k][order])
            cols.append(ends[k][order])
        seg_all = torch.stack(cols, 1)  # [E, 1 + 2L], segment (non-empty expert) order
        rows, counts = [], []
        for c in range(lnc):
            idx = torch.clamp(torch.arange(E, device=dev) + cuts[c], max=E - 1)
            live = torch.arange(E, device=dev) < cuts[c + 1] - cuts[c]
            rows.append(torch.where(live[:, None], seg_all[idx], 0))
            counts.append(cuts[c + 1] - cuts[c])
        T, K = plan.slot_of_assignment_TK.shape
        tt = min(T, nki_moe.P)
        nt = -(-T // tt)
        soa = F.pad(plan.slot_of_assignment_TK, (0, 0, 0, nt * tt - T))  # padded tokens read slot 0 (always real)
        return cls(
            token_index=plan.token_index_N.to(i32).view(ng, G),
            piece=torch.stack([group, group * G], 1).to(i32),
            seg_table=torch.cat(rows).to(i32),
            seg_count=torch.stack(counts).to(i32)[:, None],
            slot_of_assignment=soa.to(i32).view(nt, tt, K),
            num_tokens=T,
            lnc=lnc,
            kb=kb,
        )

    def plan_args(self) -> tuple[torch.Tensor, ...]:
        """piece, seg_table, seg_count (kernel arguments after token_index and slot_weight)."""
        return (self.piece, self.seg_table, self.seg_count)

    def pieces(self) -> list[tuple[int, int, int]]:
        """(core, slots, first slot row) of every piece the kernels run (host-side, for tests and the cost report)."""
        L = (self.seg_table.shape[1] - 1) // 2
        E = self.seg_table.shape[0] // self.lnc
        out = []
        for c in range(self.lnc):
            for s in range(int(self.seg_count[c, 0])):
                row = self.seg_table[c * E + s]
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


def blockwise_moe_nki(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, *, block_size: int,
                      lnc: int | None = None):
    """`blockwise_moe` computed by the NKI kernels (natively on Neuron, else through the CPU emulator).

    `lnc`: logical NeuronCore degree the kernels launch with (default `logical_nc_config()`).
    """
    from workbench.kernels import logical_nc_config

    _, _, E, _, _ = check_moe_args(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF)
    plan, kplan = KernelPlan.build(topk_ids_TK, E, block_size, logical_nc_config() if lnc is None else lnc)
    slot_w = slot_weights(topk_weights_TK, plan)
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
