"""Autograd glue: run the blockwise-MoE NKI kernels as a differentiable torch op.

`blockwise_moe_nki` has `blockwise_moe`'s signature and runs the NKI forward/backward kernels: on a Neuron device
through TorchNeuron custom ops, elsewhere through the CPU emulator (slow; for tests). `blockwise_moe_auto` is
what a model calls: the kernels on Neuron, the torch reference everywhere else.

The host side builds the block plan (`moe_reference.plan_blocks`) and the kernels' int32 tables from it
(`nki_moe.tables.KernelPlan`), pads x / dout with a zero row for padding slots, and hands the forward kernel
transposed weight copies.
"""

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workbench.core.moe_blocks import kernel_block_size
from workbench.core.neuron_env import logical_nc_config
from workbench.kernels import nki_moe
from workbench.kernels.moe_reference import blockwise_moe, check_moe_args, max_blocks, slot_weights
from workbench.kernels.nki_api import REAL_NKI, nki
from workbench.kernels.nki_moe.tables import KernelPlan, slot_granule, tiles_per_sub

__all__ = ["BlockwiseMoEFunction", "KernelPlan", "blockwise_moe_auto", "blockwise_moe_nki", "nki_on_device",
           "saved_for_backward", "slot_granule", "tiles_per_sub"]


def saved_for_backward(tokens: int, top_k: int, experts: int, ffn: int, block_size: int, lnc: int,
                       dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of the HBM tensors the NKI MoE path keeps from a layer's forward to its backward on top
    of what the torch reference path also saves (its input rows, routing weights and the expert weights): the
    forward kernel's gT = W_gate x and uT = W_up x for every slot, feature-major, in the io dtype (`dtype`). They
    live from the layer's forward to its backward (under full activation checkpointing: from the recomputed forward
    to the backward of that one layer). Slots: each expert padded to the 32-slot granule and to one 128-slot tile
    (a static bound, `plan_blocks` / `max_blocks`), plus one no-op area of the kernel block per core. At Qwen3-30B-A3B
    (T 4096, K 8, E 128, F 768, block 256, LNC 2, bf16): 2 x [768, 49,536] = 145 MiB per layer.

    The backward's weight-gradient outputs are [E + lnc, ...] in the io dtype (each core's dummy row E + core
    absorbs its no-op writes); the grads handed to autograd are views of their first E rows.
    """
    kb = kernel_block_size(block_size)
    G = slot_granule(kb)
    slots = (max_blocks(tokens, top_k, experts, G, nki_moe.tile_slots(kb) // G) + lnc * (kb // G)) * G
    return [("g_saved", (ffn, slots), dtype), ("u_saved", (ffn, slots), dtype)]


@dataclass(frozen=True)
class Kernels:
    forward: Callable
    backward: Callable


class BlockwiseMoEFunction(torch.autograd.Function):
    """out = blockwise experts(x) via the NKI kernels; grads for x, slot weights and the three expert weights.

    Saved for the backward (`saved_for_backward` lists them with shapes): x_pad, the slot weights, the three expert
    weights (references to the parameters) and the forward kernel's gT / uT ([F, slots] in the io dtype).
    """

    @staticmethod
    def forward(ctx, x_TD, slot_weight_N, w_gate_EFD, w_up_EFD, w_down_EDF, kplan: KernelPlan, kernels: Kernels):
        io = x_TD.dtype
        x_pad = F.pad(x_TD.contiguous(), (0, 0, 0, 1))
        weight = slot_weight_N.detach().float().view(kplan.token_index.shape)
        out, g_saved, u_saved = kernels.forward(
            kplan.lnc, x_pad, kplan.token_index, weight, *kplan.forward_tables(), kplan.row_of_slot, kplan.top_k,
            _transposed(w_gate_EFD, io), _transposed(w_up_EFD, io), _transposed(w_down_EDF, io))
        ctx.save_for_backward(x_pad, weight, w_gate_EFD, w_up_EFD, w_down_EDF, g_saved, u_saved)
        ctx.kplan, ctx.kernels, ctx.slot_dtype = kplan, kernels, slot_weight_N.dtype
        return kplan.tokens(out)

    @staticmethod
    def backward(ctx, dout_TD):
        x_pad, weight, w_gate, w_up, w_down, g_saved, u_saved = ctx.saved_tensors
        kplan, io, E = ctx.kplan, x_pad.dtype, w_gate.shape[0]
        dout_pad = F.pad(dout_TD.to(io).contiguous(), (0, 0, 0, 1))
        dx, d_slot, dw_gate, dw_up, dw_down = ctx.kernels.backward(
            kplan.lnc, x_pad, dout_pad, kplan.token_index, weight, *kplan.backward_tables(),
            kplan.row_of_slot, kplan.top_k, g_saved, u_saved, w_down.to(io).contiguous(), w_gate.to(io).contiguous(),
            w_up.to(io).contiguous())
        return (kplan.tokens(dx), d_slot.reshape(-1).to(ctx.slot_dtype), dw_gate[:E].to(w_gate.dtype),
                dw_up[:E].to(w_up.dtype), dw_down[:E].to(w_down.dtype), None, None)


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

    def moe_fwd(lnc: int, x_pad: Tensor, token_index: Tensor, slot_weight: Tensor, piece: Tensor, seg_table: Tensor,
                seg_count: Tensor, sub_table: Tensor, zero_rows: Tensor, zero_count: Tensor,
                row_of_slot: Tensor, top_k: int, w_gate: Tensor, w_up: Tensor,
                w_down: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        io = x_pad.dtype  # sub_table, zero_rows, zero_count: taken here only to be saved for the backward
        return nki_moe.moe_blockwise_fwd[lnc](
            x_pad, token_index, slot_weight, piece, seg_table, seg_count, row_of_slot, top_k,
            _transposed(w_gate, io), _transposed(w_up, io), _transposed(w_down, io))

    input_names = tuple(inspect.signature(moe_fwd).parameters)  # the backward returns a gradient per input, in order
    moe_fwd = nki_op("workbench::moe_blockwise_fwd", mutates_args={})(moe_fwd)

    @nki_op("workbench::moe_blockwise_bwd", mutates_args={})
    def moe_bwd(lnc: int, x_pad: Tensor, dout_pad: Tensor, token_index: Tensor, slot_weight: Tensor,
                piece: Tensor, seg_table: Tensor, seg_count: Tensor, sub_table: Tensor, zero_rows: Tensor,
                zero_count: Tensor, row_of_slot: Tensor, top_k: int, g_saved: Tensor, u_saved: Tensor, w_gate: Tensor,
                w_up: Tensor, w_down: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        io = x_pad.dtype
        return nki_moe.moe_blockwise_bwd[lnc](
            x_pad, dout_pad, token_index, slot_weight, piece, seg_table, seg_count, sub_table, zero_rows, zero_count,
            row_of_slot, top_k, g_saved, u_saved, w_down.to(io).contiguous(), w_gate.to(io).contiguous(),
            w_up.to(io).contiguous())

    tensor_names = tuple(n for n in input_names[1:] if n != "top_k")

    def setup_context(ctx, inputs, output):
        args = dict(zip(input_names, inputs, strict=True))
        ctx.lnc, ctx.top_k = args["lnc"], args["top_k"]
        ctx.save_for_backward(*(args[n] for n in tensor_names), output[1], output[2])  # + the forward's gT, uT

    def backward(ctx, dout, *_):  # no gradient flows into the saved gT, uT outputs
        saved = dict(zip(tensor_names + ("g_saved", "u_saved"), ctx.saved_tensors, strict=True))
        x_pad, w_gate, w_up, w_down = saved["x_pad"], saved["w_gate"], saved["w_up"], saved["w_down"]
        T, E = x_pad.shape[0] - 1, w_gate.shape[0]  # rows past T of out are padded tokens: their grads are dropped
        dout_pad = F.pad(dout.reshape(-1, dout.shape[-1])[:T].to(x_pad.dtype), (0, 0, 0, 1))
        dx, d_slot, dw_gate, dw_up, dw_down = moe_bwd(
            ctx.lnc, x_pad, dout_pad, saved["token_index"], saved["slot_weight"], saved["piece"],
            saved["seg_table"], saved["seg_count"], saved["sub_table"], saved["zero_rows"], saved["zero_count"],
            saved["row_of_slot"], ctx.top_k, saved["g_saved"], saved["u_saved"], w_gate, w_up, w_down)
        grads = dict.fromkeys(input_names)  # None: no gradient for that input
        grads["x_pad"] = F.pad(dx.reshape(-1, dx.shape[-1])[:T], (0, 0, 0, 1))
        grads["slot_weight"] = d_slot
        grads["w_gate"], grads["w_up"], grads["w_down"] = (dw_gate[:E].to(w_gate.dtype), dw_up[:E].to(w_up.dtype),
                                                           dw_down[:E].to(w_down.dtype))
        return tuple(grads.values())

    moe_fwd.register_autograd(backward, setup_context=setup_context)
    return moe_fwd


def _on_host(kernel) -> Callable:
    """Run a kernel on CPU tensors: the emulator, or `nki.simulate` (fp32 numpy) where the real nki imports."""

    def run(lnc, *args):
        device = args[0].device
        tensors = [a for a in args if isinstance(a, torch.Tensor)]  # the rest: Python ints (top_k)
        if REAL_NKI:
            if any(a.dtype == torch.bfloat16 for a in tensors):
                raise NotImplementedError("nki.simulate from this wrapper takes fp32 inputs (numpy has no bf16)")
            outs = nki.simulate(kernel[lnc])(*(a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else a
                                               for a in args))
            outs = tuple(torch.from_numpy(o) for o in (outs if isinstance(outs, tuple) else (outs,)))
        else:
            outs = kernel[lnc](*(a.detach().cpu() if isinstance(a, torch.Tensor) else a for a in args))
            outs = outs if isinstance(outs, tuple) else (outs,)
        outs = tuple(o.to(device) for o in outs)
        return outs if len(outs) > 1 else outs[0]

    return run


HOST_KERNELS = Kernels(_on_host(nki_moe.moe_blockwise_fwd), _on_host(nki_moe.moe_blockwise_bwd))


def blockwise_moe_nki(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, *, block_size: int):
    """`blockwise_moe` computed by the NKI kernels (natively on Neuron, else through the CPU emulator), launched on
    the configured logical NeuronCore count (`core.neuron_env.logical_nc_config()`, the compiler's LNC)."""
    _, _, E, F_, D = check_moe_args(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF)
    tiles, halves = tiles_per_sub(kernel_block_size(block_size), D, F_, x_TD.dtype)
    plan, kplan = KernelPlan.build(topk_ids_TK, E, block_size, logical_nc_config(), tiles, halves)
    slot_w = kplan.slot_weights(slot_weights(topk_weights_TK, plan))
    if nki_on_device(x_TD):  # one custom op with registered autograd: traceable by torch.compile
        out = neuron_moe_op()(kplan.lnc, F.pad(x_TD, (0, 0, 0, 1)), kplan.token_index,
                              slot_w.float().view(kplan.token_index.shape), *kplan.tables(),
                              kplan.row_of_slot, kplan.top_k, w_gate_EFD, w_up_EFD, w_down_EDF)[0]
        return kplan.tokens(out).to(x_TD.dtype)
    return BlockwiseMoEFunction.apply(x_TD, slot_w, w_gate_EFD, w_up_EFD, w_down_EDF, kplan, HOST_KERNELS)


def blockwise_moe_auto(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, *, block_size: int):
    """The training path: NKI kernels on a Neuron device, the torch reference (`blockwise_moe`) elsewhere."""
    fn = blockwise_moe_nki if nki_on_device(x_TD) else blockwise_moe
    return fn(x_TD, topk_ids_TK, topk_weights_TK, w_gate_EFD, w_up_EFD, w_down_EDF, block_size=block_size)
