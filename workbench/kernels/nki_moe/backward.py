"""The backward kernel, from the forward's saved gT, uT (no recompute): per piece, hT = silu(gT) * uT; dh =
(dy @ W_down)^T; d_affinity = sum_f h * dh; dh *= affinity; du = dh * silu(g); dg = dh * u * silu'(g); dx rows =
dg @ W_gate + du @ W_up, scattered token-major. x, affinity * dy and the token-major dg, du, h stay resident in SBUF
for the expert's weight-gradient phase (`weight_grads`); then the combine sums each token's dx rows."""

from __future__ import annotations

from typing import NamedTuple

from workbench.kernels.nki_api import nisa, nki, nl

from . import layout, tiles
from .checks import expect, expect_per_core, expect_plan
from .columns import DW_IDS_EXPERT, PieceCol, SegCol, SubCol, entry, piece_classes
from .combine import Scratch, combine, write_rows, zero_padded_tokens
from .layout import DW_BANKS, F32, I32, MOVING_FMAX, BwdWorkspace, P, ntiles, token_tiles, width
from .mlp import dx_in_dw_banks, evict_rows, narrow_batches, project, swiglu, swiglu_tile
from .tiles import (
    DOWN,
    GATE,
    UP,
    DmaTimes,
    ExpertWeights,
    KernelHbm,
    PsumPool,
    feature_major,
    listed,
    load_block,
    load_feature_major,
    load_rows,
    matmul,
    matmul_sum,
    piece_loop,
    register,
    slot_tiles,
    take_ahead,
    tok,
    token_major,
    whole_matrix_copies,
    zero_row_share,
)
from .weight_grads import DwPhase, DwTargets, MainTiles, Resident, resident, weight_grads

# Bytes per partition of one part of the backward's weight prefetch (`weight_parts`): the DMA engines serve each
# engine's packets in order (DMA overview: one packet per engine per group of partitions), so one whole expert load
# would hold every dW store behind it; in parts of this size spread over the weight-gradient phase a store waits
# for at most one part (>= 2 KiB per partition keeps each part an efficient DMA)
WEIGHT_PART_BYTES = 8 * 1024


class TailGather(NamedTuple):
    """A main-tile piece's gather of a tail piece's rows: `flag` a 0/1 register, `group` the tail piece's slot group
    (int32 SBUF [1, 1]), `buffer` its one-tile Resident set, `B` its slots."""

    flag: object
    group: object
    buffer: Resident
    B: int


class Gathers(NamedTuple):
    """A main-tile piece's row gathers (`piece` columns OWN, NEXT, TAILS..): `own` and `next` 0/1 registers, the next
    row's slot group and first tile (int32 SBUF [1, 1] views), and its TailGathers."""

    own: object
    next: object
    next_group: object
    next_tile: object
    tails: list


class BwdLoop(NamedTuple):
    """What every piece of one backward class loop shares: the HBM tensors, the resident F chunk [f0, f0 + FC) of the
    expert's weights (`backward_weights`), the workspace cut to B slots, the PSUM pool, whether this is the first F
    chunk; the class's buffer set (`indexed`: the main tiles, at the tile index in `piece`; else a tail class's
    one-tile buffer); `halves` (the sub-segments alternate tile halves); the tail buffers and their widths, whose
    rows a main-tile piece gathers; and the next expert's down matrix ((dst, src) DMA pairs, None: no prefetch)."""

    hbm: KernelHbm
    w: ExpertWeights
    ws: BwdWorkspace
    ps: PsumPool
    B: int
    f0: int
    first: bool
    res: Resident
    indexed: bool
    halves: bool
    tails: list
    down: list | None


class BwdChunk(NamedTuple):
    """What every sub-segment of a position shares for one resident F chunk: the HBM tensors, the chunk `w`, the
    whole workspace, the resident main tiles and the tail buffers, the PSUM pool, the gradients (ExpertWeights of
    [E + LNC, ...]), the piece classes, f0 and whether it is the first chunk."""

    hbm: KernelHbm
    w: ExpertWeights
    ws: BwdWorkspace
    res: Resident
    tails: list
    ps: PsumPool
    grads: ExpertWeights
    widths: list
    f0: int
    first: bool


class Ahead(NamedTuple):
    """Table rows loaded one step ahead when F is one chunk: the sub-segment's `sub_table` row and its first two
    class-0 `piece` rows (int32 SBUF tiles)."""

    sub: object
    pieces: object


def bwd_workspace(KB, D, FC, io_dtype, slot_dtype, chunked, stage_sets):
    """The backward's workspace (`layout.bwd_workspace_shapes`), allocated once per kernel; `ones` set to 1."""
    tiles = []
    shapes = layout.bwd_workspace_shapes(KB, D, FC, io_dtype, slot_dtype, chunked, stage_sets)
    for name in shapes._fields:
        spec = getattr(shapes, name)
        tiles.append(None if spec is None else nl.ndarray(spec[0], dtype=spec[1], buffer=nl.sbuf, name=name))
    ws = BwdWorkspace(*tiles)
    nisa.memset(dst=ws.ones, value=1.0)
    return ws


def backward_weights(hbm_w, e, f0, FC, into=None):
    """The F chunk [f0, f0 + FC) of expert e, resident for the backward, all in torchtitan's layouts: down F on
    columns ([min(P, D), D/128, FC] of W_down: the stationary of dhT = (dy @ W_down)^T), gate and up F on rows
    ([min(P, FC), FC/128, D]: the moving of dx = dg @ W_gate + du @ W_up). Loaded down first, then gate, up, into
    the tiles of `into` (an ExpertWeights) when given."""
    into = into or ExpertWeights(None, None, None)
    down = tiles.f_columns(hbm_w.down, e, f0, FC, into.down)
    gate = tiles.f_rows(hbm_w.gate, e, f0, FC, into.gate)
    up = tiles.f_rows(hbm_w.up, e, f0, FC, into.up)
    return ExpertWeights(gate=gate, up=up, down=down)


def weight_parts(hbm_w, e, into, mats):
    """The DMAs of `backward_weights(hbm_w, e, 0, F, into)` for the matrices `mats` (positions in ExpertWeights)
    as (dst, src) pairs of about WEIGHT_PART_BYTES per partition each."""
    pairs = []
    for m in mats:
        w = hbm_w[m]
        pairs += whole_matrix_copies(w, e, into[m], max(1, ntiles(WEIGHT_PART_BYTES, w.shape[2] * w.dtype.itemsize)))
    return pairs


def broadcast_row(ws, slot_weight, grp, parts, B, ps):
    """ws.aff_bcast [parts, B], every partition a copy of the piece's slot weights (ws.aff_row <- slot_weight from
    group grp on): ones[1, parts]^T @ row (PE)."""
    nisa.dma_copy(dst=ws.aff_row, src=slot_weight.ap(pattern=[[B, 1], [1, B]], offset=0, scalar_offset=grp,
                                                     indirect_dim=0))
    acc = ps.acc()[0:parts, 0:B]
    matmul(acc, ws.ones[0:1, 0:parts], ws.aff_row, False)
    nisa.tensor_copy(dst=ws.aff_bcast, src=acc)


def swiglu_backward(ws, d_slot, grp, B, FC, ps, first, dx=None, just_in_time=False):
    """ws.dg, ws.du (feature-major, io dtype) from dhT (ws.dh); writes the affinity grads of the piece's slots,
    d_slot from group grp on.

    d_affinity = sum_f h * dh (a partition sum: ones^T @ (h * dh) on the PE); then dh *= affinity (in place),
    du = dh * silu(g), dg = dh * u * silu'(g) (silu' from the Scalar Engine's silu_dx). `dx`: (w, banks) to issue
    each f-tile's dx matmuls right after its dg, du (`dx_tile`), so the Tensor Engine works on f-tile i while the
    Vector Engine computes f-tile i + 1. `just_in_time`: each f-tile first computes its SwiGLU (`swiglu_tile`: silu,
    silu', h), instead of all f-tiles before the loop.

    Dimensions:
        B: the piece's slots; FC: the F chunk's width (the workspace's feature tiles [min(P, FC), FC/128, B]).
    """
    d_aff = ps.acc()[0:1, 0:B]
    for i in range(ntiles(FC, P)):
        fl = width(FC, P, i)
        dh, dg, h_dh = ws.dh[0:fl, i, 0:B], ws.dg[0:fl, i, 0:B], ws.h_dh[0:fl, 0:B]
        if just_in_time:
            swiglu_tile(ws, i, fl, B)
        nisa.tensor_tensor(dst=h_dh, data1=ws.h[0:fl, i, 0:B], data2=dh, op=nl.multiply)
        nisa.nc_matmul(dst=d_aff, stationary=ws.ones[0:fl, 0:1], moving=h_dh, accumulate=i > 0)
        nisa.tensor_tensor(dst=dh, data1=dh, data2=ws.aff_bcast[0:fl, 0:B], op=nl.multiply)
        nisa.tensor_tensor(dst=ws.du[0:fl, i, 0:B], data1=dh, data2=ws.silu[0:fl, i, 0:B], op=nl.multiply)
        nisa.tensor_tensor(dst=dg, data1=dh, data2=ws.u[0:fl, i, 0:B], op=nl.multiply)
        nisa.tensor_tensor(dst=dg, data1=dg, data2=ws.dsilu[0:fl, i, 0:B], op=nl.multiply)
        if dx is not None:
            dx_tile(ws, dx[0], dx[1], i, fl, B)
    nisa.tensor_copy(dst=ws.d_aff, src=d_aff)
    if not first:  # later F chunks add their partial sum over f
        nisa.dma_copy(dst=ws.d_aff_prev, src=d_slot.ap(pattern=[[B, 1], [1, B]], offset=0, scalar_offset=grp,
                                                        indirect_dim=0))
        nisa.tensor_tensor(dst=ws.d_aff, data1=ws.d_aff, data2=ws.d_aff_prev, op=nl.add)
    nisa.dma_copy(dst=d_slot.ap(pattern=[[B, 1], [1, B]], offset=0, scalar_offset=grp, indirect_dim=0),
                  src=ws.d_aff)


def dx_block(dest, ws, w, B, D, ps, first):
    """The dx rows of the piece = dg @ W_gate[e] + du @ W_up[e] (w: the resident chunk, `backward_weights`), to the
    scratch `dest`.

    Dimensions:
        B: the piece's slots; D: hidden size; FC: the chunk's width (w.gate [min(P, FC), FC/128, D]).
    """
    FC = w.down.shape[2]
    for _s, s0, sl in slot_tiles(B):
        for _c, c0, cl in tiles.column_chunks(D):
            acc = ps.acc()[0:sl, 0:cl]
            terms = []
            for i in range(ntiles(FC, P)):
                fl = width(FC, P, i)
                terms.append((ws.dg[0:fl, i, s0:s0 + sl], w.gate[0:fl, i, c0:c0 + cl]))
                terms.append((ws.du[0:fl, i, s0:s0 + sl], w.up[0:fl, i, c0:c0 + cl]))
            matmul_sum(acc, terms)
            evict_rows(ws, acc, None, sl, c0, cl)
        write_rows(dest, ws, s0, sl, first)


def dx_tile(ws, w, banks, i, fl, B):
    """dx of the piece += dg[f-tile i] @ W_gate[i] + du[f-tile i] @ W_up[i]: every (128-slot, 512-column) block of dx
    in its own PSUM bank of `banks` (f-tile 0 opens them). A piece of B < 128 slots runs with the weights stationary
    (as `forward.down_narrow`): dxT [D, B], each D tile a region of its `narrow_batches` run's bank."""
    D = w.gate.shape[2]
    if B < P:
        runs = narrow_batches(D, B)
        for b in range(len(runs)):
            j0, n = runs[b]
            dl = width(D, P, j0)
            for k in range(n):
                acc, c0 = banks[b][0:dl, k * B:(k + 1) * B], (j0 + k) * P
                matmul(acc, w.gate[0:fl, i, c0:c0 + dl], ws.dg[0:fl, i, 0:B], i > 0)
                matmul(acc, w.up[0:fl, i, c0:c0 + dl], ws.du[0:fl, i, 0:B], True)
        return
    chunks = tiles.column_chunks(D)
    for s, s0, sl in slot_tiles(B):
        for c, c0, cl in chunks:
            acc = banks[s * len(chunks) + c][0:sl, 0:cl]
            nisa.nc_matmul(dst=acc, stationary=ws.dg[0:fl, i, s0:s0 + sl], moving=w.gate[0:fl, i, c0:c0 + cl],
                           accumulate=i > 0)
            nisa.nc_matmul(dst=acc, stationary=ws.du[0:fl, i, s0:s0 + sl], moving=w.up[0:fl, i, c0:c0 + cl],
                           accumulate=True)


def dx_rows(dest, ws, banks, B, D, first, ps):
    """The piece's dx rows from `banks` (`dx_tile`) to the scratch: evicted by the Scalar and Vector Engines in
    turn, one DMA per 128 slots (B < 128: dxT evicted into ws.dyT, dead after the dh projection, and transposed back
    to token-major)."""
    if B < P:
        runs = narrow_batches(D, B)
        for b in range(len(runs)):
            j0, n = runs[b]
            dl = width(D, P, j0)
            engine = nisa.engine.scalar if b % 2 == 0 else nisa.engine.vector
            nisa.tensor_copy(dst=ws.dyT[0:dl, j0:j0 + n, 0:B], src=banks[b][0:dl, 0:n * B], engine=engine)
        token_major([ws.out_rows], None, ws.dyT, B, D, ps)
        write_rows(dest, ws, 0, B, first)
        return
    chunks = tiles.column_chunks(D)
    for s, s0, sl in slot_tiles(B):
        for c, c0, cl in chunks:
            engine = nisa.engine.scalar if c % 2 == 0 else nisa.engine.vector
            nisa.tensor_copy(dst=ws.out_rows[0:sl, c0:c0 + cl], src=banks[s * len(chunks) + c][0:sl, 0:cl],
                             engine=engine)
        write_rows(dest, ws, s0, sl, first)


def backward_block(loop, grp, row0, tile, gathers, down):
    """One piece of loop.B slots (slot group grp, slot row row0) against the resident F chunk. Leaves x,
    affinity * dy and the token-major dg, du, h in the resident tiles from `tile` on (the weight-gradient phase
    contracts them).

    Software pipeline (main-tile classes; `gathers` a Gathers): a piece gathers its own x and dy rows only when it is
    the first of its class loop (`own` 1); it gathers the next piece's rows into that piece's tiles (another tile
    index: no hazard) when the next row of `piece` is in the same loop (`next` 1), first thing, so the gather
    overlaps this piece's work instead of opening the next piece; the sub-segment's last main-tile piece gathers its
    tail pieces' rows the same way. A tail class (`gathers` None, one-tile buffer, 0/1 trips) finds its rows
    gathered. `down` (DmaTimes): the next expert's down matrix, loaded right after the dh projection, the last read
    of the resident one.

    Dimensions:
        B: the piece's slots; D: hidden size; FC: the chunk's width (w.down [min(P, D), D/128, FC]).
    """
    hbm, w, ws, ps, B, res = loop.hbm, loop.w, loop.ws, loop.ps, loop.B, loop.res
    D, FC = hbm.x.shape[1], w.down.shape[2]

    def own_rows(i):
        load_block([res.dy, res.x], tile, [hbm.dout, hbm.x], hbm.index, grp, B)  # dy: first used

    def next_rows(i):
        load_block([res.dy, res.x], gathers.next_tile, [hbm.dout, hbm.x], hbm.index, gathers.next_group, B)

    if gathers is not None:
        nl.fori_loop(0, gathers.own, own_rows)
        nl.fori_loop(0, gathers.next, next_rows)
        for tail in gathers.tails:
            tail_rows(tail, hbm)
    affinity = tiles.affinities(hbm.weight, grp, B)
    load_feature_major(ws.g, hbm.g_saved, loop.f0, FC, row0, B)
    load_feature_major(ws.u, hbm.u_saved, loop.f0, FC, row0, B)
    feature_major(ws.dyT, res.dy, tile, B, D, ps)
    # The SwiGLU's Scalar activations wait for the gT, uT loads, which at a sub-segment's start queue behind the
    # previous weight-gradient phase's transfers. With `halves` the first piece's x and dy rows were gathered before
    # that phase, so its transposes and dh projection run first and each f-tile's SwiGLU runs just in time inside
    # the SwiGLU backward (ahead of the projection it would hold the projection's evictions in the Scalar queue).
    # Without, that piece gathers its own rows, and the SwiGLU first is faster.
    if not loop.halves:
        swiglu(ws, FC, B)
    project(ws.dh, w.down, ws.dyT, B, D, FC, ps)  # dhT = (dy @ W_down[e])^T
    broadcast_row(ws, hbm.weight, grp, ws.aff_bcast.shape[0], B, ps)
    if down is not None:  # after the piece's last load: the DMA engines serve in order
        tiles.copy_times(down)
    dest = Scratch(hbm.rows, hbm.row_of_slot, grp)
    if dx_in_dw_banks(B, D):  # dx matmuls interleaved with the SwiGLU backward's f-tiles
        swiglu_backward(ws, hbm.d_slot, grp, B, FC, ps, loop.first, (w, ps.dw), loop.halves)
        dx_rows(dest, ws, ps.dw, B, D, loop.first, ps)
    else:
        swiglu_backward(ws, hbm.d_slot, grp, B, FC, ps, loop.first, None, loop.halves)
        dx_block(dest, ws, w, B, D, ps, loop.first)
    for s, _s0, sl in slot_tiles(B):  # in place: the resident dy becomes affinity * dy, what dW_down contracts
        dy = tok(res.dy, tile, s, sl, 0, D)
        nisa.tensor_scalar(dst=dy, data=dy, op0=nl.multiply, operand0=affinity[s])
    token_major(res.dg, tile, ws.dg, B, FC, ps)
    token_major(res.du, tile, ws.du, B, FC, ps)
    token_major(res.h, tile, ws.h, B, FC, ps)


def tail_rows(tail, hbm):
    """`tail.flag` times (0 or 1): gather a tail piece's x and dy rows into its one-tile buffer."""

    def body(i):
        load_block([tail.buffer.dy, tail.buffer.x], None, [hbm.dout, hbm.x], hbm.index, tail.group, tail.B)

    nl.fori_loop(0, tail.flag, body)


def backward_pieces(piece, begin, end, loop, ahead=None):
    """Rows [begin, end) of `piece` (registers), all of loop.B slots: a compiled loop whose body (one piece) is traced
    once. `ahead`: rows begin, begin + 1, already loaded (else loaded here). Each piece copies its two rows on the
    Scalar Engine (GpSimd's in-order queue holds the previous piece's row scatter)."""
    C = piece.shape[1]

    def body(rows):
        down = None if loop.down is None else DmaTimes(loop.down, register(entry(rows, PieceCol.DOWN)))
        tile, gathers = None, None
        if loop.indexed:  # the own / next flags and the next row's slot group and tile
            tile = entry(rows, PieceCol.TILE)
            tails = []
            for t in range(len(loop.tails)):
                col = PieceCol.TAILS + 2 * t
                tails.append(TailGather(register(entry(rows, col)), entry(rows, col + 1), *loop.tails[t]))
            gathers = Gathers(register(entry(rows, PieceCol.OWN)), register(entry(rows, PieceCol.NEXT)),
                              entry(rows, PieceCol.GROUP, 1, C), entry(rows, PieceCol.TILE, 1, C), tails)
        backward_block(loop, entry(rows, PieceCol.GROUP), entry(rows, PieceCol.ROW), tile, gathers, down)

    piece_loop(piece, begin, end, ahead, nisa.engine.scalar, body)


def sub_segments(chunk, begin, end, sub_table, piece, prefetch=None, nxt=None, ahead=None, halves=False):
    """The segment's sub-segments (rows [begin, end) of `sub_table`) against one resident F chunk: each runs its
    pieces class by class (compiled loops over rows of `piece`), then its weight-gradient phase. `prefetch` (the HBM
    weights, when F is one chunk): the position's last sub-segment (LOAD 1) loads the next position's expert `nxt`
    into chunk.w in parts spread over its weight-gradient phase, which does not read it; the next expert's down
    matrix is loaded by the position's last piece after its dh projection, while its SwiGLU backward and dx keep the
    Tensor Engine busy.

    `ahead` (when F is one chunk, an Ahead): the sub-segment's `sub_table` row and its first two class-0 `piece`
    rows, loaded by the core's previous sub-segment (the first by the caller). Each sub-segment loads the next run
    one's row at its start and, after its pieces, that one's class-0 rows, before its weight-gradient phase: issued
    after the phase's stores, whose descriptors wait for their evictions, they would wait for the whole phase.
    `halves`: as in `backward_block`."""
    widths, res, tails, ws = chunk.widths, chunk.res, chunk.tails, chunk.ws
    TS = layout.tile_slots(widths[0])
    down = None if prefetch is None else weight_parts(prefetch, nxt, chunk.w, (DOWN,))
    tail_sets = []
    for B in layout.tail_widths(widths):
        tail_sets.append((tails[len(tail_sets)], B))

    def sub(j):
        if ahead is None:
            row = load_rows(sub_table, 0, j)  # the sub-segment's entries in one DMA
        else:
            row = take_ahead(ahead.sub, sub_table, col=SubCol.NEXT_ROW)  # then the core's next run sub-segment's
        cont = register(entry(row, SubCol.CONT))
        tile_begin, tile_end = register(entry(row, SubCol.TILE_BEGIN)), register(entry(row, SubCol.TILE_END))
        tail_bounds = []
        for k in range(len(widths)):  # full KB blocks, then the tail's KB/2, ..., G pieces (0 or 1 each)
            col = SubCol.HEAD + 2 * k
            p_begin, p_end = register(entry(row, col)), register(entry(row, col + 1))
            target, indexed = res, True
            if widths[k] < TS:  # a tail class narrower than a tile: its own one-tile buffer
                target, indexed = tails[len(tail_bounds)], False
                tail_bounds.append((p_begin, p_end))
            loop = BwdLoop(chunk.hbm, chunk.w, ws.cut(widths[k]), chunk.ps, widths[k], chunk.f0, chunk.first, target,
                           indexed, halves, tail_sets, down)
            backward_pieces(piece, p_begin, p_end, loop, ahead.pieces if ahead is not None and k == 0 else None)
        if ahead is not None:  # the next run sub-segment's first class-0 rows (its row is in ahead.sub by now)
            load_rows(piece, 0, entry(ahead.sub, SubCol.HEAD), 2, ahead.pieces)

        # the dW phase's DMAs read their expert rows (and the prefetch its expert) from a tile of their own, so the
        # next sub-segment's table rows load while those DMAs are still in flight; copied by the Vector Engine, whose
        # queue holds the pieces' evictions the phase waits for anyway (on GpSimd the copy, and so the phase's first
        # matmuls, would queue behind the last piece's row scatter)
        ids = ws.dw_ids  # write row, add row, cont, first tile; the prefetched expert
        nisa.tensor_copy(dst=ids[0:1, 0:DW_IDS_EXPERT], src=row[0:1, 0:DW_IDS_EXPERT], engine=nisa.engine.vector)
        if prefetch is not None:
            nisa.tensor_copy(dst=entry(ids, DW_IDS_EXPERT), src=nxt, engine=nisa.engine.vector)

        def early(i):  # the other half of the resident tiles is free: the weight-gradient phase reads this half
            load_block([res.dy, res.x], entry(row, SubCol.EARLY_TILE), [chunk.hbm.dout, chunk.hbm.x],
                       chunk.hbm.index, entry(row, SubCol.EARLY_GROUP), widths[0])

        nl.fori_loop(0, register(entry(row, SubCol.EARLY)), early)
        fetch = None
        if prefetch is not None:  # the next position's weights, in parts, during the weight-gradient phase
            fetch = DmaTimes(weight_parts(prefetch, entry(ids, DW_IDS_EXPERT), chunk.w, (GATE, UP)),
                             register(entry(row, SubCol.LOAD)))
        phase = DwPhase(chunk.grads, res, tails, ws.stage, chunk.ps.dw, chunk.f0, chunk.w.down.shape[2])
        weight_grads(phase, MainTiles(entry(ids, SubCol.TILE_FIRST), tile_begin, tile_end), tail_bounds,
                     DwTargets(entry(ids, SubCol.WRITE), entry(ids, SubCol.ADD), cont), fetch)

    nl.fori_loop(begin, end, sub)


def backward_segments(pid, S, hbm, piece, seg_table, seg_count, sub_table, hbm_w, grads):
    """This core's expert segments, backward. Per segment position (one expert) and F chunk: load the chunk of the
    expert's weights once, then run the position's sub-segments (one unless the expert has more tiles than fit
    SBUF)."""
    x_pad = hbm.x
    io, D, F = x_pad.dtype, x_pad.shape[1], hbm_w.down.shape[2]
    widths = piece_classes(hbm.index, seg_table)
    FC, NT = layout.fit_backward(D, F, io, widths)
    sets = layout.stage_sets(D, F, FC, NT, io, widths)
    ws = bwd_workspace(widths[0], D, FC, io, hbm.rows.dtype, FC < F, sets)
    res = resident(layout.tile_slots(widths[0]), NT, D, FC, io)
    tails = []
    for B in layout.tail_widths(widths):
        tails.append(resident(B, 1, D, FC, io))
    ps = PsumPool(io)
    ps.dw = []  # the pieces' dx accumulates there too (`dx_in_dw_banks`): the banks are idle while pieces run
    for _ in range(DW_BANKS):
        ps.dw.append(nl.ndarray((P, MOVING_FMAX), dtype=F32, buffer=nl.psum, name="psum_dw"))

    weights, ahead = None, None
    if FC == F:
        # one chunk: position 0's weights here, each later position's prefetched by the one before it; the table
        # rows run ahead: position 0's seg_table row, its first sub_table row and that one's first class-0 piece
        # rows here, each later one's by the position / sub-segment before it (`sub_segments`)
        seg_ahead = nl.ndarray((1, seg_table.shape[1]), dtype=I32, buffer=nl.sbuf)
        nisa.dma_copy(dst=seg_ahead, src=seg_table[pid * S:pid * S + 1, 0:seg_table.shape[1]])
        weights = backward_weights(hbm_w, entry(seg_ahead, SegCol.EXPERT), 0, F)
        ahead = Ahead(load_rows(sub_table, 0, entry(seg_ahead, SegCol.SUB_BEGIN)),
                      nl.ndarray((1, 2 * piece.shape[1]), dtype=I32, buffer=nl.sbuf))
        load_rows(piece, 0, entry(ahead.sub, SubCol.HEAD), 2, ahead.pieces)

    def segment(s):
        if FC == F:
            row = take_ahead(seg_ahead, seg_table, col=SegCol.NEXT_ROW)  # then the core's next position's
        else:
            row = load_rows(seg_table, pid * S, s)  # the position's entries in one DMA
        e = entry(row, SegCol.EXPERT)
        sub_begin, sub_end = register(entry(row, SegCol.SUB_BEGIN)), register(entry(row, SegCol.SUB_END))
        if FC == F:
            chunk = BwdChunk(hbm, weights, ws, res, tails, ps, grads, widths, 0, True)
            sub_segments(chunk, sub_begin, sub_end, sub_table, piece, hbm_w, entry(row, SegCol.NEXT_EXPERT), ahead,
                         layout.alternates_halves(F, FC, NT, widths))
        for c in range(ntiles(F, FC) if FC < F else 0):  # F chunked: each chunk's weights, then its sub-segments
            f0 = c * FC
            w = backward_weights(hbm_w, e, f0, width(F, FC, c))
            sub_segments(BwdChunk(hbm, w, ws, res, tails, ps, grads, widths, f0, c == 0), sub_begin, sub_end,
                         sub_table, piece)
            w = None  # the chunk's weights are dead: the next chunk's take their SBUF

    nl.fori_loop(0, tiles.count(seg_count), segment)
    weights = None  # dead after the last position (the loop body's cell holds it): the combine takes its SBUF


def zero_experts(grads, zero_rows_table, zero_count, pid):
    """Zero dW[e] of every gradient for the rows e this core lists in `zero_rows_table` (its empty experts and its
    dummy row; the same trip count on every core, padded with the dummy)."""
    cols = 1
    for dw in grads:
        cols = max(cols, dw.shape[2])
    zeros = nl.ndarray((P, cols), dtype=grads[0].dtype, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)

    def expert(e):
        for dw in grads:
            R, C = dw.shape[1], dw.shape[2]
            for r0 in range(0, R, P):
                rl = min(P, R - r0)
                nisa.dma_copy(dst=dw.ap(pattern=[[C, rl], [1, C]], offset=r0 * C, scalar_offset=e, indirect_dim=0),
                              src=zeros[0:rl, 0:C])

    listed(zero_rows_table, zero_count, pid, expert)


@nki.jit
def moe_blockwise_bwd(x_pad, dout_pad, token_index, slot_weight, piece, seg_table, seg_count, sub_table, zero_rows,
                      zero_count, row_of_slot, top_k, g_saved, u_saved, w_down, w_gate, w_up):
    """Blockwise expert MLP backward (from the forward's saved gT, uT: no recompute); launch as `[lnc]`.

    Dimensions:
        T, D: tokens, hidden size; E, F: experts and their intermediate size
        G, NG: slot granule and slot groups (NS = NG * G slots); L: piece classes
        S: segment positions per core; J: sub-segments per position; Z: dW rows per core in zero_rows
        nT, TT: token tiles (a multiple of LNC) and tokens per tile

    Args:
        x_pad, dout_pad: [T+1, D] inputs and output gradient, row T zeros; io dtype.
        token_index, slot_weight, piece, seg_table, seg_count, row_of_slot, top_k: as in `moe_blockwise_fwd`.
        sub_table: [LNC * S * J, SubCol.HEAD + 2L] int32, one row per sub-segment (`columns.SubCol`), then per piece
            class the [begin, end) rows of `piece`. The counts (sub-segments, tiles, pieces) and the flags CONT, LOAD
            and EARLY are the same on both cores.
        zero_rows: [LNC * Z, 1] int32, per core the dW rows it zero-fills (empty experts, its dummy).
        zero_count: [1, 1] int32, rows zero-filled per core (the same on every core).
        g_saved, u_saved: [F, NS] from `moe_blockwise_fwd`; io dtype.
        w_down: [E, D, F]; w_gate, w_up: [E, F, D] (torchtitan layouts, io dtype).

    Returns:
        dx [nT, TT, D] (io dtype), d_slot_weight [NG, G] fp32, dw_gate [E + LNC, F, D], dw_up [E + LNC, F, D],
        dw_down [E + LNC, D, F] (io dtype; rows E.. are the cores' dummies: the host drops them).
    """
    pid = nl.program_id(0)
    lnc = nl.num_programs(0)
    expect(x_pad, "x_pad", "[T+1, D]", (None, None), x_pad.dtype)
    io, D = x_pad.dtype, x_pad.shape[1]
    expect(dout_pad, "dout_pad", "[T+1, D] (x_pad's shape and dtype)", x_pad.shape, io)
    T = x_pad.shape[0] - 1
    L = expect_plan(token_index, slot_weight, piece, seg_table, seg_count, row_of_slot, top_k, T, lnc)
    expect(sub_table, "sub_table", f"[LNC * S * J, {SubCol.HEAD} + 2L] (L of seg_table)", (None, SubCol.HEAD + 2 * L),
           I32)
    expect_per_core(zero_rows, zero_count, ("zero_rows", "zero_count"), lnc)
    expect(w_gate, "w_gate", "[E, F, D] (D of x_pad, io dtype)", (None, None, D), io)
    E, F = w_gate.shape[0], w_gate.shape[1]
    expect(w_up, "w_up", "[E, F, D] (w_gate's shape)", (E, F, D), io)
    expect(w_down, "w_down", "[E, D, F]", (E, D, F), io)
    ng, G = token_index.shape
    expect(g_saved, "g_saved", "[F, NS]", (F, ng * G), io)
    expect(u_saved, "u_saved", "[F, NS]", (F, ng * G), io)
    S = seg_table.shape[0] // lnc
    nT, TT = token_tiles(T, lnc)
    FC = layout.fit_backward(D, F, io, layout.piece_widths(G * 2 ** (L - 1), L))[0]
    dx_scratch = nl.ndarray((layout.assignment_rows(T, top_k, ng * G, lnc), D), dtype=F32 if FC < F else io,
                            buffer=nl.shared_hbm, name="dx_rows")
    d_slot = nl.ndarray((ng, G), dtype=F32, buffer=nl.shared_hbm)
    grads = ExpertWeights(gate=nl.ndarray((E + lnc, F, D), dtype=io, buffer=nl.shared_hbm),
                          up=nl.ndarray((E + lnc, F, D), dtype=io, buffer=nl.shared_hbm),
                          down=nl.ndarray((E + lnc, D, F), dtype=io, buffer=nl.shared_hbm))
    zeros = nl.ndarray((P, G), dtype=F32, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)
    zero_row_share(d_slot, zeros, pid, lnc)  # padding slots keep the zeros, the segment owners overwrite the rest
    zeros = None
    zero_experts(grads, zero_rows, zero_count, pid)
    if lnc > 1:
        nisa.core_barrier(data=d_slot, cores=(0, 1))
    hbm = KernelHbm(x=x_pad, index=token_index, weight=slot_weight, rows=dx_scratch, row_of_slot=row_of_slot,
                    g_saved=g_saved, u_saved=u_saved, dout=dout_pad, d_slot=d_slot)
    backward_segments(pid, S, hbm, piece, seg_table, seg_count, sub_table,
                      ExpertWeights(gate=w_gate, up=w_up, down=w_down), grads)
    zero_padded_tokens(dx_scratch, T, top_k, pid, lnc)
    if lnc > 1:
        nisa.core_barrier(data=dx_scratch, cores=(0, 1))
    dx = nl.ndarray((nT, TT, D), dtype=io, buffer=nl.shared_hbm)
    combine(dx, dx_scratch, top_k, pid, lnc)
    return dx, d_slot, grads.gate, grads.up, grads.down
