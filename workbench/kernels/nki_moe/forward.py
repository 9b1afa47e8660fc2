"""The forward kernel: per piece, gather x rows -> xT -> gT, uT = W_gate/up @ xT (saved for the backward) ->
hT = silu(gT) * uT -> y = h @ W_down^T scaled by the slot weight -> scattered token-major; then the combine."""

from __future__ import annotations

from typing import NamedTuple

from workbench.kernels.nki_api import nisa, nki, nl

from . import layout
from .checks import expect, expect_plan
from .columns import PieceCol, SegCol, entry, piece_classes
from .combine import Scratch, combine, write_rows, zero_padded_tokens
from .layout import F32, I32, MOVING_FMAX, P, ntiles, token_tiles, width
from .mlp import evict_rows, narrow_batches, project
from .tiles import (
    DmaTimes,
    ExpertWeights,
    InSet,
    KernelHbm,
    PsumPool,
    affinities,
    block_columns,
    column_chunks,
    copy_times,
    count,
    f_columns,
    f_rows,
    feature_major,
    load_block,
    load_entry,
    matmul_sum,
    matrix,
    matrix_columns,
    piece_loop,
    register,
    save_feature_major,
    slot_tiles,
    take_ahead,
    token_major,
    whole_matrix_copies,
)


class FwdWorkspace(NamedTuple):
    """The forward's per-block SBUF workspace. `x`, `aff`: per piece class B, the token-major x tiles and slot
    weights of the piece whose rows were gathered last (one set per class, or one set all classes share:
    `layout.forward_layout`); `out_rows` the piece's y rows on their way to the slot scratch; `partial` only when F
    is chunked (later chunks add to the partial sums already in the scratch)."""

    x: dict
    aff: dict
    xT: object
    g: object
    u: object
    silu: object
    h: object
    out_rows: object
    partial: object

    def cut(self, B):
        """The workspace cut to a B-slot piece: its class's x and slot-weight tiles, every per-slot tile sliced."""
        x, aff = [], []
        for s, _s0, sl in slot_tiles(B):
            x.append(self.x[B][s][0:sl, 0:self.x[B][s].shape[1]])
            aff.append(self.aff[B][s][0:sl, 0:1])
        per_slot = []
        for t in (self.xT, self.g, self.u, self.silu, self.h):
            per_slot.append(t[0:t.shape[0], 0:t.shape[1], 0:B])
        return FwdWorkspace(x, aff, *per_slot, self.out_rows, self.partial)


class Prefetch(NamedTuple):
    """The forward pieces' share of the next position's weights: expert `expert` (an int32 SBUF [1, 1] tile) of the
    HBM weights `hbm_w`, into the weight set `into` (ExpertWeights of InSets)."""

    hbm_w: ExpertWeights
    expert: object
    into: ExpertWeights


class FwdLoop(NamedTuple):
    """What every piece of one forward class loop shares: the HBM tensors, the resident F chunk [f0, f0 + FC) of
    the expert's weights (`forward_weights`), the workspace cut to the class's B slots, the PSUM pool, whether
    this is the first F chunk, and the pieces' share of the next position's weights (None: not prefetched)."""

    hbm: KernelHbm
    w: ExpertWeights
    ws: FwdWorkspace
    ps: PsumPool
    B: int
    f0: int
    first: bool
    fetch: Prefetch | None


def block_tiles(KB, cols, dtype, name):
    """One [sl, cols] SBUF tile per 128-token sub-tile of a block (tokens on partitions)."""
    tiles = []
    for _s, _s0, sl in slot_tiles(KB):
        tiles.append(nl.ndarray((sl, cols), dtype=dtype, buffer=nl.sbuf, name=name))
    return tiles


def fwd_workspace(widths, D, FC, io_dtype, slot_dtype, chunked, per_class):
    """The forward's workspace (`widths`: the piece classes, KB first); every tile a block needs, allocated once
    per kernel and reused by every piece (a compiled loop body is traced once: one fixed buffer per tile)."""
    KB = widths[0]
    dp, fp, nD, nF = min(P, D), min(P, FC), ntiles(D, P), ntiles(FC, P)
    x, aff = {}, {}
    shared = None if per_class else (block_tiles(KB, D, io_dtype, "x_tok"), block_tiles(KB, 1, F32, "aff_next"))
    for B in widths:
        x[B] = block_tiles(B, D, io_dtype, "x_tok") if per_class else shared[0]
        aff[B] = block_tiles(B, 1, F32, "aff_next") if per_class else shared[1]
    return FwdWorkspace(
        x=x, aff=aff,
        xT=nl.ndarray((dp, nD, KB), dtype=io_dtype, buffer=nl.sbuf, name="xT"),
        g=nl.ndarray((fp, nF, KB), dtype=io_dtype, buffer=nl.sbuf, name="gT"),
        u=nl.ndarray((fp, nF, KB), dtype=io_dtype, buffer=nl.sbuf, name="uT"),
        silu=nl.ndarray((fp, nF, KB), dtype=io_dtype, buffer=nl.sbuf, name="siluT"),
        h=nl.ndarray((fp, nF, KB), dtype=io_dtype, buffer=nl.sbuf, name="hT"),
        out_rows=nl.ndarray((P, D), dtype=slot_dtype, buffer=nl.sbuf, name="out_rows"),
        partial=nl.ndarray((P, D), dtype=F32, buffer=nl.sbuf, name="partial") if chunked else None)


def forward_weights(hbm_w, e, f0, FC, into=None):
    """The F chunk [f0, f0 + FC) of expert e, resident for the forward: gate and up F on columns ([min(P, D),
    D/128, FC] of W^T: the stationary of gT, uT = W @ xT), down F on rows ([min(P, FC), FC/128, D] of W_down^T: the
    moving of y = h @ W_down^T). `hbm_w`: the forward's transposed [E, D, F], [E, D, F], [E, F, D] arguments;
    `into`: ExpertWeights of InSets to load into (the weight double buffer), else new tiles."""
    into = into or ExpertWeights(None, None, None)
    return ExpertWeights(gate=f_columns(hbm_w.gate, e, f0, FC, into.gate), up=f_columns(hbm_w.up, e, f0, FC, into.up),
                         down=f_rows(hbm_w.down, e, f0, FC, into.down))


def weight_sets(D, F, dtype):
    """The forward's weight double buffer: gate, up [min(P, D), 2, D/128 * F] and down [min(P, F), 2, F/128 * D]
    tiles (two experts' whole matrices each; `in_set` picks one)."""
    gate = nl.ndarray((min(P, D), 2, ntiles(D, P) * F), dtype=dtype, buffer=nl.sbuf, name="w_gate_sets")
    up = nl.ndarray((min(P, D), 2, ntiles(D, P) * F), dtype=dtype, buffer=nl.sbuf, name="w_up_sets")
    down = nl.ndarray((min(P, F), 2, ntiles(F, P) * D), dtype=dtype, buffer=nl.sbuf, name="w_down_sets")
    return ExpertWeights(gate, up, down)


def in_set(sets, pick, D, F):
    """The weight set `pick` (an int32 SBUF [1, 1] tile) of `weight_sets`, as InSets."""
    return ExpertWeights(gate=InSet(sets.gate, pick, F), up=InSet(sets.up, pick, F), down=InSet(sets.down, pick, D))


def forward_block(loop, grp, row0, nxt):
    """One piece of loop.B slots starting at slot row0 (= grp * G; grp indexes the [NG, G] slot tables) against the
    resident F chunk. Its x rows are in ws.x already (gathered by the previous piece, or by the loop's prologue);
    once its transposes have read them, it gathers the next piece's (slot group `nxt`) into ws.x, so that gather
    overlaps this piece's matmuls instead of opening the next piece.

    Dimensions:
        B: the piece's slots; D: hidden size; FC: the chunk's width (w.gate [min(P, D), D/128, FC]).
    """
    hbm, w, ws, ps, B = loop.hbm, loop.w, loop.ws, loop.ps, loop.B
    D, FC = hbm.x.shape[1], matrix_columns(w.gate)
    # the index columns of the next piece's gather and of this piece's scatter, loaded first: issued next to the
    # gather or the scatter they would queue behind the piece's weight loads, and the software-DGE queue (GpSimd,
    # in order) with them
    gather_index = block_columns(hbm.index, nxt, B, I32)
    scatter_index = block_columns(hbm.row_of_slot, grp, B, I32)
    affinity = []  # its slot weights, gathered with its x rows: copied out before the next piece's overwrite them
    for s, _s0, sl in slot_tiles(B):
        affinity.append(nl.ndarray((sl, 1), dtype=F32, buffer=nl.sbuf))
        nisa.tensor_copy(dst=affinity[s], src=ws.aff[s], engine=nisa.engine.vector)
    feature_major(ws.xT, ws.x, None, B, D, ps)
    load_block([ws.x], None, [hbm.x], hbm.index, nxt, B, gather_index)  # the next piece's rows (software pipeline)
    affinities(hbm.weight, nxt, B, ws.aff)
    project(ws.g, w.gate, ws.xT, B, D, FC, ps)
    project(ws.u, w.up, ws.xT, B, D, FC, ps, ws)  # with the SwiGLU of each f-tile
    save_feature_major(hbm.g_saved, ws.g, loop.f0, FC, row0, B)  # for the backward: no recompute there
    save_feature_major(hbm.u_saved, ws.u, loop.f0, FC, row0, B)
    dest = Scratch(hbm.rows, hbm.row_of_slot, grp)
    if B < P:  # a narrow piece: the weights stationary, B moving columns
        down_narrow(ws, w.down, affinity[0], B, D, FC, ps)
        write_rows(dest, ws, 0, B, loop.first, scatter_index[0])
        return
    for s, s0, sl in slot_tiles(B):
        for _c, c0, cl in column_chunks(D):
            acc = ps.acc()[0:sl, 0:cl]
            terms = []
            for i in range(ntiles(FC, P)):
                fl = width(FC, P, i)
                terms.append((ws.h[0:fl, i, s0:s0 + sl], matrix(w.down, fl, i, c0, cl)))
            matmul_sum(acc, terms)
            evict_rows(ws, acc, affinity[s], sl, c0, cl)
        write_rows(dest, ws, s0, sl, loop.first, scatter_index[s])


def down_narrow(ws, w_down, affinity, B, D, FC, ps):
    """ws.out_rows[0:B, 0:D] = affinity * (h @ W_down^T) for a piece of B < 128 slots. With hT as the stationary (as
    the 128-slot pieces run it) only B of the Tensor Engine's 128 columns would work, for 512 moving columns per
    matmul; here the weights are stationary ([128, 128] tiles of W_down^T) and hT moves (B columns, at least the
    64-cycle minimum): yT [D, B], a D tile per region of an accumulator bank, evicted into ws.xT (dead after the gate
    and up projections), then transposed back to token-major and scaled by the slots' affinity.

    Dimensions:
        B: the piece's slots (< 128); D: hidden size; FC: the chunk's width (ws.h [min(P, FC), FC/128, B]).
    """
    for run in narrow_batches(D, B):
        j0, n = run
        dl = width(D, P, j0)
        bank = ps.acc()
        for k in range(n):
            terms = []
            for i in range(ntiles(FC, P)):
                fl = width(FC, P, i)
                terms.append((matrix(w_down, fl, i, (j0 + k) * P, dl), ws.h[0:fl, i, 0:B]))
            matmul_sum(bank[0:dl, k * B:(k + 1) * B], terms)
        nisa.tensor_copy(dst=ws.xT[0:dl, j0:j0 + n, 0:B], src=bank[0:dl, 0:n * B], engine=nisa.engine.scalar)
    token_major([ws.out_rows], None, ws.xT, B, D, ps)
    rows = ws.out_rows[0:B, 0:D]
    nisa.tensor_scalar(dst=rows, data=rows, op0=nl.multiply, operand0=affinity)


def fetch_matrices(rows, fetch):
    """The forward piece's share of the next position's weights: per matrix m (gate, up, down), when the piece's
    row in `rows` has 1 in column PieceCol.FETCH + m, that matrix of the next position's expert into the other
    weight set."""
    for m in range(3):
        copy_times(DmaTimes(whole_matrix_copies(fetch.hbm_w[m], fetch.expert, fetch.into[m], None),
                            register(entry(rows, PieceCol.FETCH + m))))


def forward_pieces(piece, begin, end, loop):
    """Rows [begin, end) of `piece` (registers), all of loop.B slots: a compiled loop whose body (one piece) is traced
    once. Each piece copies its two `piece` rows (its own and the next one's, whose x rows it gathers) on the
    Scalar Engine: GpSimd's in-order queue holds the previous piece's row scatter (software DGE), which waits for
    that piece's last eviction."""
    C = piece.shape[1]

    def body(rows):
        if loop.fetch is not None:  # the piece's share of the next position's weight loads
            fetch_matrices(rows, loop.fetch)
        forward_block(loop, entry(rows, PieceCol.GROUP), entry(rows, PieceCol.ROW), entry(rows, PieceCol.GROUP, 1, C))

    piece_loop(piece, begin, end, None, nisa.engine.scalar, body)


def forward_segments(pid, S, hbm, piece, seg_table, seg_count, hbm_w):
    """This core's expert segments (its own function so the workspace is freed before the combine). Per segment
    position (one expert) and F chunk: load the chunk of the expert's weights once (resident, reused by every piece
    of the segment), then run the segment's full KB blocks and its tail's KB/2, ..., G pieces (0 or 1 each, plus
    the position's no-op pieces), each class a compiled loop over its rows of `piece`."""
    x_pad = hbm.x
    D, F = x_pad.shape[1], hbm_w.gate.shape[2]
    widths = piece_classes(hbm.index, seg_table)
    FC = layout.f_chunk(D, F, x_pad.dtype.itemsize, 3)
    sets, per_class = layout.forward_layout(widths, D, F, FC, x_pad.dtype.itemsize)
    ws = fwd_workspace(widths, D, FC, x_pad.dtype, hbm.rows.dtype, FC < F, per_class)
    # the Vector Engine evicts every transpose: the Scalar Engine evicts the projections' accumulators (`project`),
    # and a transpose eviction queued between two of those holds up the next projection. The forward has no
    # weight-gradient banks, so their PSUM holds more accumulators: a projection waits less for an eviction
    ps = PsumPool(x_pad.dtype, evict=(nisa.engine.vector,), acc_banks=layout.ACC_BANKS + layout.DW_BANKS)
    double = None
    # the seg_table rows run ahead: position 0's here, each later one's loaded when the position before it starts
    # (loaded at its own start, behind the previous position's weight loads, it would hold up its first piece)
    head = nl.ndarray((1, SegCol.HEAD + 2 * len(widths)), dtype=layout.I32, buffer=nl.sbuf)
    nisa.dma_copy(dst=head, src=seg_table[pid * S:pid * S + 1, 0:SegCol.HEAD + 2 * len(widths)])
    if per_class:
        # each class's first piece of position 0 into the class's own x tiles. From then on a class loop's last
        # piece gathers row `end` of its loop, which is the class's first piece at the core's next position (rows
        # are grouped by class, core, position), and a class that runs no piece leaves those rows in place: so
        # each position finds its first pieces' rows gathered
        for k in range(len(widths)):
            first_rows(piece, register(entry(head, SegCol.HEAD + 2 * k)), hbm, ws, widths[k])
    if sets == 2:  # position 0's weights into its set here; each position loads the next one's into the other set
        double = weight_sets(D, F, x_pad.dtype)
        forward_weights(hbm_w, entry(head, SegCol.EXPERT), 0, F, in_set(double, entry(head, SegCol.SET), D, F))

    def segment(s):
        row = take_ahead(head, seg_table, col=SegCol.NEXT_ROW, engine=nisa.engine.scalar)  # then the next
        # position's (Scalar: GpSimd's queue holds the last piece's row scatter, and the position's weight set is
        # picked by this row)
        bounds = []
        for k in range(len(widths)):
            col = SegCol.HEAD + 2 * k
            bounds.append((register(entry(row, col)), register(entry(row, col + 1))))
        for c in range(ntiles(F, FC)):  # one chunk (all of F) unless the matrices do not fit SBUF
            f0 = c * FC
            fetch = None
            if double is None:
                w = forward_weights(hbm_w, entry(row, SegCol.EXPERT), f0, width(F, FC, c))
            else:  # this position's weights were loaded by the previous one; its pieces load the next one's
                w = in_set(double, entry(row, SegCol.SET), D, F)
                fetch = Prefetch(hbm_w, entry(row, SegCol.NEXT_EXPERT), in_set(double, entry(row, SegCol.NEXT_SET),
                                                                               D, F))
            for k in range(len(widths)):  # full KB blocks, then the tail's KB/2, ..., G pieces (0 or 1 each)
                if not per_class:  # one set of x tiles for all classes: each class's first rows before its loop
                    first_rows(piece, bounds[k][0], hbm, ws, widths[k])
                loop = FwdLoop(hbm, w, ws.cut(widths[k]), ps, widths[k], f0, c == 0, fetch)
                forward_pieces(piece, bounds[k][0], bounds[k][1], loop)
            w = None  # the chunk's weights are dead: the next chunk's take their SBUF

    nl.fori_loop(0, count(seg_count), segment)


def first_rows(piece, begin, hbm, ws, B):
    """The forward's software-pipeline prologue of one class loop (with x tiles per class: of the core's first
    position only): the rows of its first piece (`piece` row `begin`) into the class's x tiles; each piece then
    gathers the next one's. A class that runs no piece reads a valid row all the same (row `begin` exists: another
    class's, position's or core's, or the padding row)."""
    grp = load_entry(piece, 0, PieceCol.GROUP, begin)
    load_block([ws.x[B]], None, [hbm.x], hbm.index, grp, B)
    affinities(hbm.weight, grp, B, ws.aff[B])


def zero_saved(saved, first, pid, lnc):
    """Zero slot columns [first, NS) of every [F, NS] tensor of `saved`, each core a contiguous share, in DMAs of
    up to MOVING_FMAX columns covering all whole 128-row tiles of F: the slot groups a piece may not compute (the
    kernel returns these tensors, so every element gets written). `first`: the slots of the ceil(T * K / G) groups
    that every routing fills (each of the T * K assignments has its own slot), so the columns are known when the
    kernel is traced, whatever the routing; the pieces then overwrite the ones they compute, after a core barrier
    (the other core's pieces may compute columns of this core's share)."""
    F, NS = saved[0].shape
    fp, nfull = min(P, F), F // min(P, F)
    rem = F - nfull * fp
    per = ntiles(NS - first, lnc)
    lo = min(NS, first + pid * per)
    hi = min(NS, lo + per)
    zeros = nl.ndarray((fp, nfull, MOVING_FMAX), dtype=saved[0].dtype, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)
    for c0 in range(lo, hi, MOVING_FMAX):
        cl = min(MOVING_FMAX, hi - c0)
        for t in saved:
            nisa.dma_copy(dst=t.ap(pattern=[[NS, fp], [fp * NS, nfull], [1, cl]], offset=c0),
                          src=zeros[0:fp, 0:nfull, 0:cl])
            if rem > 0:
                nisa.dma_copy(dst=t.ap(pattern=[[NS, rem], [1, cl]], offset=nfull * fp * NS + c0),
                              src=zeros[0:rem, 0, 0:cl])


@nki.jit
def moe_blockwise_fwd(x_pad, token_index, slot_weight, piece, seg_table, seg_count, row_of_slot, top_k, w_gate_t,
                      w_up_t, w_down_t):
    """Blockwise expert MLP forward; launch as `moe_blockwise_fwd[lnc](...)`.

    Slots come in groups of G (each expert's slots padded to a multiple of G, and to at least one TS-slot tile);
    an expert's groups are computed as full blocks of KB = G * 2^(L-1) slots, then its tail as at most one piece
    each of KB/2, ..., G slots.

    Dimensions:
        T, D: tokens, hidden size; E, F: experts and their intermediate size; K: experts per token
        G, NG: slot granule and slot groups (NS = NG * G slots); L: piece classes (KB = G * 2^(L-1))
        M: piece rows; S: segment positions per core
        nT, TT: token tiles (a multiple of LNC) and tokens per tile

    Args:
        x_pad: [T+1, D] hidden states, row T zeros (read by padding slots); io dtype (bf16 on device).
        token_index: [NG, G] int32 slot -> token (T on padding slots); row g = slot group g (the last ones: the
            cores' no-op areas).
        slot_weight: [NG, G] fp32 routing affinity per slot (0 on padding).
        piece: [M + 2, PieceCol.COLS] int32, one row per piece (`columns.PieceCol`), grouped by class; the last two
            rows padding rows (any valid piece: the forward gathers row j + 1's rows while it computes row j, and
            each piece loads rows j + 1, j + 2 ahead).
        seg_table: [LNC * S, SegCol.HEAD + 2L] int32; core c's segment position s at row c * S + s
            (`columns.SegCol`), then per piece class k (KB >> k slots) the [begin, end) rows of `piece` (the same
            count on every core).
        seg_count: [1, 1] int32, segment positions run (the same on every core).
        row_of_slot: [NG, G] int32, the row of the token-major scratch each slot's output goes to: t * K + k for
            the slot of assignment (t, k), a row of its own past the token tiles' rows for a padding or no-op slot
            (`layout.assignment_rows`; every row at most once).
        top_k: K, an int.
        w_gate_t, w_up_t: [E, D, F] (gate/up weights transposed); w_down_t: [E, F, D] (down transposed); io dtype.

    Returns:
        out: [nT, TT, D] io dtype, sum over k of affinity * expert_mlp(x);
        g_saved, u_saved: [F, NS] io dtype, gT = W_gate x and uT = W_up x of every slot (feature-major; zeros
            on padding and no-op slots and on the groups no piece computes): saved for the backward, which then
            needs neither the gate/up recompute nor the transposed gate/up weights. Live from forward to backward.
    """
    pid = nl.program_id(0)
    lnc = nl.num_programs(0)
    expect(x_pad, "x_pad", "[T+1, D]", (None, None), x_pad.dtype)
    io, D = x_pad.dtype, x_pad.shape[1]
    T = x_pad.shape[0] - 1
    expect_plan(token_index, slot_weight, piece, seg_table, seg_count, row_of_slot, top_k, T, lnc)
    expect(w_gate_t, "w_gate_t", "[E, D, F] (D of x_pad, io dtype)", (None, D, None), io)
    E, F = w_gate_t.shape[0], w_gate_t.shape[2]
    expect(w_up_t, "w_up_t", "[E, D, F] (w_gate_t's shape)", (E, D, F), io)
    expect(w_down_t, "w_down_t", "[E, F, D]", (E, F, D), io)
    ng, G = token_index.shape
    S = seg_table.shape[0] // lnc
    nT, TT = token_tiles(T, lnc)
    chunked = layout.f_chunk(D, F, io.itemsize, 3) < F
    y_rows = nl.ndarray((layout.assignment_rows(T, top_k, ng * G, lnc), D), dtype=F32 if chunked else io,
                        buffer=nl.shared_hbm, name="y_rows")
    g_saved = nl.ndarray((F, ng * G), dtype=io, buffer=nl.shared_hbm, name="g_saved")
    u_saved = nl.ndarray((F, ng * G), dtype=io, buffer=nl.shared_hbm, name="u_saved")
    hbm = KernelHbm(x=x_pad, index=token_index, weight=slot_weight, rows=y_rows, row_of_slot=row_of_slot,
                    g_saved=g_saved, u_saved=u_saved)
    zero_saved((g_saved, u_saved), G * ntiles(T * top_k, G), pid, lnc)
    if lnc > 1:
        nisa.core_barrier(data=g_saved, cores=(0, 1))  # the zeros land before any piece's columns
    forward_segments(pid, S, hbm, piece, seg_table, seg_count, ExpertWeights(w_gate_t, w_up_t, w_down_t))
    zero_padded_tokens(y_rows, T, top_k, pid, lnc)
    if lnc > 1:
        nisa.core_barrier(data=y_rows, cores=(0, 1))  # the combine reads rows the other core wrote
    out = nl.ndarray((nT, TT, D), dtype=io, buffer=nl.shared_hbm)
    combine(out, y_rows, top_k, pid, lnc)
    return out, g_saved, u_saved
