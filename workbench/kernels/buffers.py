"""The HBM tensors one call of an NKI MoE kernel allocates, from its argument shapes (for `workbench.plan`).

A kernel's `nl.ndarray(..., buffer=nl.shared_hbm)` allocations are not torch tensors, so a memory plan traced with
torch cannot see them. `hbm_allocations(kernel, lnc, args)` lists them from the arguments the kernel gets: name,
shape, dtype, and which of the kernel's outputs each is (None: scratch, freed when the call ends). The lists must
say what `nki_moe.py` allocates: tests/kernels/test_buffers.py and tests/test_plan.py run the real kernels in the
emulator, whose `Counters.hbm_allocations` records every HBM allocation, and assert equality. When a kernel's HBM
allocations change (a new scratch tensor, an output in another dtype or order, ...), change its function here.
"""

from __future__ import annotations

import torch

from workbench.kernels import nki_moe
from workbench.kernels.nki_emulator import HbmAllocation

SHARED = "shared_hbm"


def _slot_dtype(io: torch.dtype, D: int, F: int, n_mats: int) -> torch.dtype:
    """The slot scratch's dtype: io, or fp32 when the kernel splits F into chunks (partial sums over chunks)."""
    itemsize = torch.empty((), dtype=io).element_size()
    return torch.float32 if nki_moe._f_chunk(D, F, itemsize, n_mats) < F else io


def _forward(x_pad, token_index, slot_weight, piece, seg_table, seg_count, slot_of_assignment, w_gate_t, w_up_t,
             w_down_t) -> list[HbmAllocation]:
    """`moe_blockwise_fwd`: the y_slots scratch, then `out`."""
    ng, G = token_index.shape
    D, io = x_pad.shape[1], x_pad.dtype
    nT, TT = slot_of_assignment.shape[:2]
    return [HbmAllocation("y_slots", (ng * G, D), _slot_dtype(io, D, w_gate_t.shape[2], 3), SHARED, None),
            HbmAllocation("", (nT, TT, D), io, SHARED, 0)]


def _backward(x_pad, dout_pad, token_index, slot_weight, piece, seg_table, seg_count, slot_of_assignment, w_gate, w_up,
              w_down, w_gate_t, w_up_t) -> list[HbmAllocation]:
    """`moe_blockwise_bwd`: the dx_slots scratch, d_slot_weight, the three fp32 weight gradients, then `dx` (which
    it returns first)."""
    ng, G = token_index.shape
    D, io = x_pad.shape[1], x_pad.dtype
    nT, TT = slot_of_assignment.shape[:2]
    f32 = torch.float32
    return [HbmAllocation("dx_slots", (ng * G, D), _slot_dtype(io, D, w_gate.shape[1], 5), SHARED, None),
            HbmAllocation("", (ng, G), f32, SHARED, 1),
            HbmAllocation("", tuple(w_gate.shape), f32, SHARED, 2),
            HbmAllocation("", tuple(w_up.shape), f32, SHARED, 3),
            HbmAllocation("", tuple(w_down.shape), f32, SHARED, 4),
            HbmAllocation("", (nT, TT, D), io, SHARED, 0)]


def hbm_allocations(kernel, lnc: int, args) -> list[HbmAllocation]:
    """The HBM tensors one `kernel[lnc](*args)` call allocates, in allocation order (shapes only are read).

    Args:
        kernel: `nki_moe.moe_blockwise_fwd` or `nki_moe.moe_blockwise_bwd` (the `@nki.jit` object).
        lnc: the launch's logical core count (both kernels allocate shared HBM only: the same at LNC 1 and 2).
        args: the kernel's tensor arguments (real or fake tensors), in its order.

    Raises:
        ValueError: a kernel this module has no list for.
    """
    del lnc  # a shared_hbm tensor is allocated once per launch whatever the core count
    for known, allocations in ((nki_moe.moe_blockwise_fwd, _forward), (nki_moe.moe_blockwise_bwd, _backward)):
        if kernel is known:
            return allocations(*args)
    raise ValueError(f"no HBM allocation list for kernel {kernel!r}: add one to workbench/kernels/buffers.py")
