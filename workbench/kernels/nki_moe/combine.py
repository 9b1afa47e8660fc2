"""The token-major slot scratch: the pieces scatter their rows into it, and the combine sums each token's K rows.

A scatter-add straight into `out` would avoid the scratch but needs a DMA read-modify-write whose two writers
(cores, or two k of one token in flight) race.
"""

from __future__ import annotations

from typing import NamedTuple

from workbench.core.errors import check_argument
from workbench.kernels.nki_api import nisa, nl

from .layout import I32, P, token_tiles
from .tiles import block_column, zero_row_share

DMA_COMPUTE_SOURCES = 16  # the most sources of one dma_compute (its ISA page)


class Scratch(NamedTuple):
    """Where a piece's rows go: the [rows, D] token-major scratch, the [NG, G] `row_of_slot` table and the piece's
    first slot group (an int32 SBUF [1, 1] tile)."""

    rows: object
    row_of_slot: object
    grp: object


def write_rows(dest, ws, s0, sl, first, where=None):
    """The scratch rows of the piece's slots [s0, s0 + sl) <- ws.out_rows[0:sl, :], scattered token-major in one DMA
    (`dest` a Scratch: each slot's row t * K + k, so the combine reads a token tile's rows contiguously) for the first
    F chunk; later chunks add to the partial sums (read-modify-write of the fp32 scratch; the rows belong to this
    core's piece). `where`: the slots' scratch rows (an int32 SBUF [sl, 1] column of `row_of_slot`), when the
    caller loaded them already."""
    D = dest.rows.shape[1]
    if where is None:
        where = block_column(dest.row_of_slot, dest.grp, s0, sl, I32)
    window = dest.rows.ap(pattern=[[D, sl], [1, D]], offset=0, vector_offset=where, indirect_dim=0)
    rows = ws.out_rows[0:sl, 0:D]
    if not first:
        partial = ws.partial[0:sl, 0:D]
        nisa.dma_copy(dst=partial, src=window)
        nisa.tensor_tensor(dst=rows, data1=rows, data2=partial, op=nl.add)
    nisa.dma_copy(dst=window, src=rows)


def combine(out, rows, K, pid, lnc):
    """out[t] = sum_k rows[t * K + k], in the DMA engines: per token tile one `dma_compute` of K sources, the tile's
    tokens' k-th rows (the pieces scattered them token-major: `write_rows`, so source k is TT rows at stride K rows),
    summed in fp32 in order k = 0 .. K-1 (as K fp32 adds would) and cast to out's dtype on the way to HBM: no Tensor,
    Vector or Scalar Engine work and no SBUF. dma_compute takes compile-time addresses only (its ISA page), so the
    core's token tiles are unrolled (`nT / LNC` instructions per core).

    Token tiles are split across the cores, the same number per core (`token_tiles`); `out` is [nT, TT, D].

    Dimensions:
        nT, TT, K: token tiles, tokens per tile, experts per token (K <= 16: dma_compute's most sources);
        D: hidden size; the scratch `rows` has `assignment_rows` rows, whole tiles of TT * K.
    """
    nT, TT = out.shape[0], out.shape[1]
    D = rows.shape[1]
    check_argument(K <= DMA_COMPUTE_SOURCES, "top_k", f"the combine sums a token's {K} rows in one dma_compute of at "
                   f"most {DMA_COMPUTE_SOURCES} sources: top_k must be <= {DMA_COMPUTE_SOURCES}")
    per = nT // lnc  # nT is a multiple of LNC (`token_tiles`)
    for t in range(pid * per, (pid + 1) * per):
        srcs = []
        for k in range(K):
            srcs.append(rows.ap(pattern=[[K * D, TT], [1, D]], offset=(t * TT * K + k) * D))
        nisa.dma_compute(dst=out.ap(pattern=[[D, TT], [1, D]], offset=t * TT * D), srcs=srcs, reduce_op=nl.add)


def zero_padded_tokens(rows, T, K, pid, lnc):
    """Zero the scratch rows of the combine's padded tokens, [T * K, nT * TT * K) (no piece writes them; the
    combine reads them), before the combine's barrier: none when the tokens fill whole tiles."""
    nT, TT = token_tiles(T, lnc)
    if nT * TT > T:
        zeros = nl.ndarray((P, rows.shape[1]), dtype=rows.dtype, buffer=nl.sbuf)
        nisa.memset(dst=zeros, value=0.0)
        zero_row_share(rows, zeros, pid, lnc, T * K, nT * TT * K)

