"""The expert MLP's pieces both kernels run: projections against a resident matrix and the SwiGLU, in the io dtype
with fp32 PSUM accumulation (as the torch reference computes them)."""

from __future__ import annotations

from workbench.kernels.nki_api import nisa, nl

from .layout import DW_BANKS, MOVING_FMAX, P, ntiles, width
from .tiles import batches, matmul_sum, matrix


def project(out, w_res, xT, B, D, n_out, ps, swiglu=None):
    """out ([min(P, n_out), n_tiles, B]) = (x @ W^T)^T; w_res: resident W^T tiles [min(P, D), nD, n_out] (or an
    InSet of them). Evicted from PSUM by the Scalar Engine (the Vector Engine has the elementwise math). `swiglu`:
    a workspace whose SwiGLU of f-tile i runs right after that tile's eviction, while the PE projects tile i + 1."""
    for i in range(ntiles(n_out, P)):
        fl = width(n_out, P, i)
        acc = ps.acc()[0:fl, 0:B]
        terms = []
        for j in range(ntiles(D, P)):
            dl = width(D, P, j)
            terms.append((matrix(w_res, dl, j, i * P, fl), xT[0:dl, j, 0:B]))
        matmul_sum(acc, terms)
        nisa.tensor_copy(dst=out[0:fl, i, 0:B], src=acc, engine=nisa.engine.scalar)
        if swiglu is not None:
            swiglu_tile(swiglu, i, fl, B)


def swiglu(ws, FC, B):
    """silu = silu(g) (Scalar Engine), hT = silu * u; backward (the workspace has `dsilu`) also silu'(g). All in
    the io dtype, as the torch reference computes them (bf16 operands give the Vector Engine its performance mode)."""
    for i in range(ntiles(FC, P)):
        swiglu_tile(ws, i, width(FC, P, i), B)


def swiglu_tile(ws, i, fl, B):
    """`swiglu` of f-tile i (fl features)."""
    g, silu = ws.g[0:fl, i, 0:B], ws.silu[0:fl, i, 0:B]
    nisa.activation(dst=silu, op=nl.silu, data=g)
    dsilu = getattr(ws, "dsilu", None)
    if dsilu is not None:
        nisa.activation(dst=dsilu[0:fl, i, 0:B], op=nl.silu_dx, data=g)
    nisa.tensor_tensor(dst=ws.h[0:fl, i, 0:B], data1=silu, data2=ws.u[0:fl, i, 0:B], op=nl.multiply)


def narrow_batches(D, B):
    """(first, count) runs of D's 128-row tiles whose [<=128, B] fp32 results share one PSUM bank (a piece of B < 128
    slots with the weights stationary: `forward.down_narrow`, `backward.dx_tile`)."""
    return batches(D // P, D % P, MOVING_FMAX // B)


def dx_in_dw_banks(B, D):
    """Whether a B-slot piece's dx accumulates in the weight-gradient banks (idle while pieces run), all live at
    once (`backward.dx_tile`): one bank per 128 slots x 512 columns of dx, or for B < 128 one per `narrow_batches`
    run."""
    if B < P:
        return len(narrow_batches(D, B)) <= DW_BANKS
    return ntiles(B, P) * ntiles(D, MOVING_FMAX) <= DW_BANKS


def evict_rows(ws, acc, scale, sl, c0, cl):
    """ws.out_rows[0:sl, c0:c0 + cl] = acc * scale (scale None: acc), evicted from PSUM by the Scalar Engine."""
    rows = ws.out_rows[0:sl, c0:c0 + cl]
    if scale is None:
        nisa.tensor_copy(dst=rows, src=acc, engine=nisa.engine.scalar)
    else:
        nisa.tensor_scalar(dst=rows, data=acc, op0=nl.multiply, operand0=scale, engine=nisa.engine.scalar)
