"""The token-major slot scratch: the pieces scatter their rows into it, and the combine sums each token's K rows.

A scatter-add straight into `out` would avoid the scratch but needs a DMA read-modify-write whose two writers
(cores, or two k of one token in flight) race.
"""

from __future__ import annotations

from typing import NamedTuple

from workbench.core.errors import check_argument
from workbench.kernels.nki_api import nisa, nl

from .layout import F32, I32, MOVING_FMAX, P, token_tiles
from .tiles import block_column, column_chunks, zero_row_share


class Scratch(NamedTuple):
    """Where a piece's rows go: the [rows, D] token-major scratch, the [NG, G] `row_of_slot` table and the piece's
    first slot group (an int32 SBUF [1, 1] tile)."""

    rows: object
    row_of_slot: object
    grp: object


def write_rows(dest, ws, s0, sl, first):
    """The scratch rows of the piece's slots [s0, s0 + sl) <- ws.out_rows[0:sl, :], scattered token-major in one DMA
    (`dest` a Scratch: each slot's row t * K + k, so the combine reads a token tile's rows contiguously) for the first
    F chunk; later chunks add to the partial sums (read-modify-write of the fp32 scratch; the rows belong to this
    core's piece)."""
    D = dest.rows.shape[1]
    where = block_column(dest.row_of_slot, dest.grp, s0, sl, I32)
    window = dest.rows.ap(pattern=[[D, sl], [1, D]], offset=0, vector_offset=where, indirect_dim=0)
    rows = ws.out_rows[0:sl, 0:D]
    if not first:
        partial = ws.partial[0:sl, 0:D]
        nisa.dma_copy(dst=partial, src=window)
        nisa.tensor_tensor(dst=rows, data1=rows, data2=partial, op=nl.add)
    nisa.dma_copy(dst=window, src=rows)


def combine(out, rows, K, pid, lnc):
    """out[t] = sum_k rows[t * K + k]: per token tile, K loads of its tokens' k-th rows (the pieces scattered them
    token-major: `write_rows`), each one hardware-DGE DMA of TT rows at stride K rows (an indirect gather would
    have GpSimd generate a descriptor per row), summed in fp32 PSUM by the Tensor Engine (identity^T @ rows
    accumulates each token's K rows in order, as K fp32 adds would, without the Vector Engine's fp32 adds of
    [128, D] row blocks). One caveat of the matmul: an inf in a loaded row meets the identity's zeros, so its whole
    column of the tile becomes NaN instead of one token's inf (either way the step has overflowed).

    Token tiles are split across the cores, the same number per core (`token_tiles`: one trip count for both
    cores); `out` is [nT, TT, D] (tile t at `scalar_offset=t`).

    Dimensions:
        nT, TT, K: token tiles, tokens per tile, experts per token;
        D: hidden size (D <= 8 PSUM banks of 512 columns); the scratch `rows` has `assignment_rows` rows, whole
        tiles of TT * K.
    """
    nT, TT = out.shape[0], out.shape[1]
    n_rows, D = rows.shape
    chunks = column_chunks(D)
    check_argument(len(chunks) <= 8, "rows", f"the combine sums a token tile's {D} columns in 8 PSUM banks of "
                   f"{MOVING_FMAX}: D must be <= {8 * MOVING_FMAX}")
    tiles = rows.reshape((n_rows // (TT * K), TT * K * D))  # tile t of the scratch at scalar_offset=t
    per = nT // lnc  # nT is a multiple of LNC (`token_tiles`)
    ones = nl.ndarray((TT, TT), dtype=rows.dtype, buffer=nl.sbuf, name="ones")
    nisa.memset(dst=ones, value=1.0)
    ident = nl.ndarray((TT, TT), dtype=rows.dtype, buffer=nl.sbuf, name="identity")
    nisa.affine_select(dst=ident, pattern=[[-1, TT]], on_true_tile=ones, on_false_value=0.0, offset=0,
                       channel_multiplier=1, cmp_op=nl.equal)  # 1 where partition p == column j
    parts = []
    for _ in range(2):  # load k + 1 while the Tensor Engine adds k
        parts.append(nl.ndarray((TT, D), dtype=rows.dtype, buffer=nl.sbuf, name="assignment_rows"))
    sums = []
    for _ in chunks:
        sums.append(nl.ndarray((TT, MOVING_FMAX), dtype=F32, buffer=nl.psum, name="psum_combine"))
    result = nl.ndarray((TT, D), dtype=out.dtype, buffer=nl.sbuf, name="combined")

    def token_tile(t):
        for k in range(K):
            part = parts[k % 2]
            nisa.dma_copy(dst=part, src=tiles.ap(pattern=[[K * D, TT], [1, D]], offset=k * D, scalar_offset=t,
                                                 indirect_dim=0))
            for c, c0, cl in chunks:
                nisa.nc_matmul(dst=sums[c][0:TT, 0:cl], stationary=ident, moving=part[0:TT, c0:c0 + cl],
                               accumulate=k > 0)
        for c, c0, cl in chunks:
            engine = nisa.engine.scalar if c % 2 == 0 else nisa.engine.vector
            nisa.tensor_copy(dst=result[0:TT, c0:c0 + cl], src=sums[c][0:TT, 0:cl], engine=engine)
        nisa.dma_copy(dst=out.ap(pattern=[[D, TT], [1, D]], offset=0, scalar_offset=t, indirect_dim=0), src=result)

    nl.fori_loop(pid * per, (pid + 1) * per, token_tile)


def zero_padded_tokens(rows, T, K, pid, lnc):
    """Zero the scratch rows of the combine's padded tokens, [T * K, nT * TT * K) (no piece writes them; the
    combine reads them), before the combine's barrier: none when the tokens fill whole tiles."""
    nT, TT = token_tiles(T, lnc)
    if nT * TT > T:
        zeros = nl.ndarray((P, rows.shape[1]), dtype=rows.dtype, buffer=nl.sbuf)
        nisa.memset(dst=zeros, value=0.0)
        zero_row_share(rows, zeros, pid, lnc, T * K, nT * TT * K)

