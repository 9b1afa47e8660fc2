"""The HBM tensors one call of an NKI MoE kernel allocates, from its argument shapes (for `workbench.plan`).

A kernel's `nl.ndarray(..., buffer=nl.shared_hbm)` allocations are not torch tensors, so a memory plan traced with
torch cannot see them. `hbm_allocations(kernel, lnc, args)` lists them from the arguments the kernel gets: name,
shape, dtype, and which of the kernel's outputs each is (None: scratch, freed when the call ends). The lists must
say what the `nki_moe` kernels allocate: tests/kernels/test_buffers.py and tests/test_plan.py run the real kernels in
the emulator, whose `Counters.hbm_allocations` records every HBM allocation, and assert equality. When a kernel's HBM
allocations change (a new scratch tensor, an output in another dtype or order, ...), change its function here.
"""

from __future__ import annotations

import torch

from workbench.kernels import nki_moe
from workbench.kernels.nki_emulator import HbmAllocation

SHARED = "shared_hbm"


def _forward(lnc, x_pad, token_index, slot_weight, piece, seg_table, seg_count, row_of_slot, top_k, w_gate_t,
             w_up_t, w_down_t) -> list[HbmAllocation]:
    """`moe_blockwise_fwd`: the token-major y_rows scratch (fp32 when F is split into chunks: partial sums over
    chunks), the saved gT and uT (outputs 1, 2: live until the backward), then `out`."""
    ng, G = token_index.shape
    T, D, io = x_pad.shape[0] - 1, x_pad.shape[1], x_pad.dtype
    F = w_gate_t.shape[2]
    nT, TT = nki_moe.token_tiles(T, lnc)
    R = nki_moe.assignment_rows(T, top_k, ng * G, lnc)
    chunked = nki_moe.f_chunk(D, F, torch.empty((), dtype=io).element_size(), 3) < F
    return [HbmAllocation("y_rows", (R, D), torch.float32 if chunked else io, SHARED, None),
            HbmAllocation("g_saved", (F, ng * G), io, SHARED, 1),
            HbmAllocation("u_saved", (F, ng * G), io, SHARED, 2),
            HbmAllocation("", (nT, TT, D), io, SHARED, 0)]


def _backward(lnc, x_pad, dout_pad, token_index, slot_weight, piece, seg_table, seg_count, sub_table, zero_rows,
              zero_count, row_of_slot, top_k, g_saved, u_saved, w_down, w_gate, w_up) -> list[HbmAllocation]:
    """`moe_blockwise_bwd`: the token-major dx_rows scratch, d_slot_weight (fp32), the three weight gradients in the
    io dtype with one dummy expert row per core (E + lnc rows: the host drops them), then `dx` (which it returns
    first)."""
    ng, G = token_index.shape
    D, io = x_pad.shape[1], x_pad.dtype
    E, F = w_gate.shape[0], w_gate.shape[1]
    T = x_pad.shape[0] - 1
    nT, TT = nki_moe.token_tiles(T, lnc)
    L = (seg_table.shape[1] - nki_moe.SegCol.HEAD) // 2
    fc = nki_moe.fit_backward(D, F, io, nki_moe.piece_widths(G * 2 ** (L - 1), L))[0]
    return [HbmAllocation("dx_rows", (nki_moe.assignment_rows(T, top_k, ng * G, lnc), D),
                          torch.float32 if fc < F else io, SHARED, None),
            HbmAllocation("", (ng, G), torch.float32, SHARED, 1),
            HbmAllocation("", (E + lnc, F, D), io, SHARED, 2),
            HbmAllocation("", (E + lnc, F, D), io, SHARED, 3),
            HbmAllocation("", (E + lnc, D, F), io, SHARED, 4),
            HbmAllocation("", (nT, TT, D), io, SHARED, 0)]


def hbm_allocations(kernel, lnc: int, args) -> list[HbmAllocation]:
    """The HBM tensors one `kernel[lnc](*args)` call allocates, in allocation order (shapes only are read).

    Args:
        kernel: `nki_moe.moe_blockwise_fwd` or `nki_moe.moe_blockwise_bwd` (the `@nki.jit` object).
        lnc: the launch's logical core count (the backward's weight gradients carry one dummy row per core).
        args: the kernel's tensor arguments (real or fake tensors), in its order.

    Raises:
        ValueError: a kernel this module has no list for.
    """
    for known, allocations in ((nki_moe.moe_blockwise_fwd, _forward), (nki_moe.moe_blockwise_bwd, _backward)):
        if kernel is known:
            return allocations(lnc, *args)
    raise ValueError(f"no HBM allocation list for kernel {kernel!r}: add one to workbench/kernels/buffers.py")
