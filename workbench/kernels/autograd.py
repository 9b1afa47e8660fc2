"""Autograd glue: run the blockwise-MoE NKI kernels as a differentiable torch op.

`blockwise_moe_nki` has `blockwise_moe`'s signature and runs the NKI forward/backward kernels: on a Neuron device
through TorchNeuron custom ops, elsewhere through the CPU emulator (slow; for tests). `blockwise_moe_auto` is
what a model calls: the kernels on Neuron, the torch reference everywhere else.

The host side builds the block plan (`moe_reference.plan_blocks`), converts it to the kernels' int32 layouts,
pads x / dout with a zero row for padding slots, and hands the forward kernel transposed weight copies.
"""

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from workbench.kernels import nki_moe
from workbench.kernels.moe_reference import BlockPlan, blockwise_moe, check_moe_args, plan_blocks, slot_weights
from workbench.kernels.nki_api import REAL_NKI, nki


def kernel_block_size(block_size: int) -> int:
    """Rows per kernel block: the plan's block if <= 128, else the largest of 512/384/256/128 dividing it.

    A plan block larger than that is several consecutive kernel blocks with the same expert.
    """
    if 1 <= block_size <= nki_moe.P:
        return block_size
    for kb in (512, 384, 256, 128):
        if block_size % kb == 0:
            return kb
    raise ValueError(f"the NKI kernels need block_size <= 128 or a multiple of 128, got {block_size}")


@dataclass(frozen=True)
class KernelPlan:
    """The block plan in the kernels' int32 layouts (see `nki_moe.moe_blockwise_fwd`)."""

    token_index: torch.Tensor  # [N, 1]
    block_to_expert: torch.Tensor  # [NB, 1], one entry per kernel block
    slot_of_assignment: torch.Tensor  # [T, K]

    @classmethod
    def from_plan(cls, plan: BlockPlan) -> "KernelPlan":
        repeat = plan.block_size // kernel_block_size(plan.block_size)
        return cls(
            token_index=plan.token_index_N.to(torch.int32)[:, None],
            block_to_expert=plan.block_to_expert_B.repeat_interleave(repeat).to(torch.int32)[:, None],
            slot_of_assignment=plan.slot_of_assignment_TK.to(torch.int32),
        )


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
        weight = slot_weight_N.detach().float()
        ctx.save_for_backward(x_pad, weight, w_gate_EFD, w_up_EFD, w_down_EDF)
        ctx.kplan, ctx.kernels, ctx.slot_dtype = kplan, kernels, slot_weight_N.dtype
        return kernels.forward(x_pad, kplan.token_index, weight[:, None], kplan.block_to_expert,
                               kplan.slot_of_assignment, _transposed(w_gate_EFD, io), _transposed(w_up_EFD, io),
                               _transposed(w_down_EDF, io))

    @staticmethod
    def backward(ctx, dout_TD):
        x_pad, weight, w_gate, w_up, w_down = ctx.saved_tensors
        kplan, io = ctx.kplan, x_pad.dtype
        dout_pad = F.pad(dout_TD.to(io).contiguous(), (0, 0, 0, 1))
        dx, d_slot, dw_gate, dw_up, dw_down = ctx.kernels.backward(
            x_pad, dout_pad, kplan.token_index, weight[:, None], weight.view(kplan.block_to_expert.shape[0], -1),
            kplan.block_to_expert, kplan.slot_of_assignment, w_gate.to(io).contiguous(), w_up.to(io).contiguous(),
            w_down.to(io).contiguous(), _transposed(w_gate, io), _transposed(w_up, io))
        return (dx, d_slot.reshape(-1).to(ctx.slot_dtype), dw_gate.to(w_gate.dtype), dw_up.to(w_up.dtype),
                dw_down.to(w_down.dtype), None, None)


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
def neuron_kernels() -> Kernels:
    """The kernels registered as TorchNeuron custom ops (`torch_neuronx.nki_op`, a torch.library custom op).

    unverified: written from docs (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/guides/how-to-work-with-nki.html);
    nothing here has run on Trainium. Autograd comes from `BlockwiseMoEFunction`, which calls these two ops.
    """
    from torch_neuronx import nki_op

    Tensor = torch.Tensor

    @nki_op("workbench::moe_blockwise_fwd", mutates_args={})
    def moe_fwd(x_pad: Tensor, token_index: Tensor, slot_weight: Tensor, block_to_expert: Tensor,
                slot_of_assignment: Tensor, w_gate_t: Tensor, w_up_t: Tensor, w_down_t: Tensor) -> Tensor:
        return nki_moe.moe_blockwise_fwd(x_pad, token_index, slot_weight, block_to_expert, slot_of_assignment,
                                         w_gate_t, w_up_t, w_down_t)

    @nki_op("workbench::moe_blockwise_bwd", mutates_args={})
    def moe_bwd(x_pad: Tensor, dout_pad: Tensor, token_index: Tensor, slot_weight: Tensor, slot_weight_row: Tensor,
                block_to_expert: Tensor, slot_of_assignment: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                w_gate_t: Tensor, w_up_t: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        return nki_moe.moe_blockwise_bwd(x_pad, dout_pad, token_index, slot_weight, slot_weight_row,
                                         block_to_expert, slot_of_assignment, w_gate, w_up, w_down, w_gate_t, w_up_t)

    return Kernels(moe_fwd, moe_bwd)


def _on_host(kernel) -> Callable:
    """Run a kernel on CPU tensors: the emulator, or `nki.simulate` (fp32 numpy) where the real nki imports."""

    def run(*args):
        device = args[0].device
        if REAL_NKI:
            if any(a.dtype == torch.bfloat16 for a in args):
                raise NotImplementedError("nki.simulate from this wrapper takes fp32 inputs (numpy has no bf16)")
            outs = nki.simulate(kernel)(*(a.detach().cpu().numpy() for a in args))
            outs = tuple(torch.from_numpy(o) for o in (outs if isinstance(outs, tuple) else (outs,)))
        else:
            outs = kernel(*(a.detach().cpu() for a in args))
            outs = outs if isinstance(outs, tuple) else (outs,)
        outs = tuple(o.to(device) for o in outs)
        return outs if len(outs) > 1 else outs[0]

    return run


HOST_KERNELS = Kernels(_on_host(nki_moe.moe_blockwise_fwd), _on_host(nki_moe.moe_blockwise_bwd))


def blockwise_moe_nki(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, *, block_size: int):
    """`blockwise_moe` computed by the NKI kernels (natively on Neuron, else through the CPU emulator)."""
    _, _, E, _, _ = check_moe_args(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF)
    plan = plan_blocks(topk_ids_TK, E, block_size)
    kernels = neuron_kernels() if nki_on_device(x_TD) else HOST_KERNELS
    return BlockwiseMoEFunction.apply(x_TD, slot_weights(topk_weights_TK, plan), w_gate_EFD, w_up_EFD, w_down_EDF,
                                      KernelPlan.from_plan(plan), kernels)


def blockwise_moe_auto(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, *, block_size: int):
    """The training path: NKI kernels on a Neuron device, the torch reference (`blockwise_moe`) elsewhere."""
    fn = blockwise_moe_nki if nki_on_device(x_TD) else blockwise_moe
    return fn(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, block_size=block_size)
