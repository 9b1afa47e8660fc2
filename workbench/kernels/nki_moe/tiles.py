"""Tile views and data movement the forward and the backward share: table rows, resident expert matrices, row
gathers, saved feature-major columns, the PSUM pool, Tensor Engine transposes and the tiled matmul loop."""

from __future__ import annotations

from typing import NamedTuple

from workbench.kernels.nki_api import nisa, nl

from .columns import entry
from .layout import ACC_BANKS, F32, I32, MOVING_FMAX, TRANSPOSE_BANKS, P, ntiles, width


class KernelHbm(NamedTuple):
    """The HBM tensors the pieces read and write: the padded token rows, the [NG, G] slot tables, the token-major
    slot scratch and the saved gT / uT [F, NS]; the backward's also the padded output gradient and the slot
    weights' gradient (None in the forward)."""

    x: object  # [T+1, D] hidden states, row T zeros (read by padding slots)
    index: object  # token_index [NG, G]
    weight: object  # slot_weight [NG, G]
    rows: object  # the token-major slot scratch (`combine.write_rows`)
    row_of_slot: object  # [NG, G]
    g_saved: object
    u_saved: object
    dout: object = None  # [T+1, D] output gradient, row T zeros
    d_slot: object = None  # [NG, G] fp32 gradient of the slot weights


# -- table rows ----------------------------------------------------------------------------------------------------
def load_entry(table, row0, col, reg):
    """int32 SBUF [1, 1] <- table[row0 + reg, col] of an [R, C] int32 HBM table (reg: a loop register)."""
    tile = nl.ndarray((1, 1), dtype=I32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=table.ap(pattern=[[1, 1], [1, 1]], offset=row0 * table.shape[1] + col,
                                         scalar_offset=reg, indirect_dim=0))
    return tile


def load_rows(table, row0, reg, rows=1, tile=None):
    """int32 SBUF [1, rows * C] <- rows row0 + reg .. row0 + reg + rows - 1 of an [R, C] int32 HBM table (reg: a loop
    register), in one DMA (into `tile` when given, else a new tile): entry (r, c) at column r * C + c (`entry`)."""
    C = table.shape[1]
    if tile is None:
        tile = nl.ndarray((1, rows * C), dtype=I32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=table.ap(pattern=[[C, 1], [1, rows * C]], offset=row0 * C, scalar_offset=reg,
                                         indirect_dim=0))
    return tile


def take_ahead(ahead, table, rows=1, row0=0, reg=None, col=None, engine=nisa.engine.gpsimd):
    """Table rows loaded one step ahead: returns a copy of `ahead` (the rows the previous step loaded into it,
    copied by `engine` into a tile of the step's own), then loads the next step's `rows` rows of `table` into `ahead`
    (`load_rows`), from row row0 + `reg` (a loop register) or row0 + the entry in column `col` of the copy. A step's
    rows then never wait for a DMA behind its predecessor's transfers: `ahead` is free to reload once copied, and
    the copy stays in use as long as the step's DMAs read it as offsets."""
    taken = nl.ndarray(ahead.shape, dtype=I32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=taken, src=ahead, engine=engine)
    load_rows(table, row0, reg if col is None else entry(taken, col), rows, ahead)
    return taken


def register(tile):
    reg = nisa.register_alloc()
    nisa.register_load(reg, tile)
    return reg


def count(counter):
    """A [1, 1] int32 HBM count (segment positions, rows to zero-fill: the same on every core) as a register."""
    tile = nl.ndarray((1, 1), dtype=I32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=counter[0:1, 0:1])
    return register(tile)


def listed(table, counter, pid, body):
    """Compiled loop over the first `counter` entries of this core's part of a per-core [LNC * n, 1] int32 table
    (`zero_rows`: n = Z): body(entry as an int32 SBUF [1, 1] tile)."""
    n = table.shape[0] // nl.num_programs(0)

    def each(i):
        body(load_entry(table, pid * n, 0, i))

    nl.fori_loop(0, count(counter), each)


def piece_loop(piece, begin, end, ahead, engine, body):
    """Compiled loop over rows [begin, end) of `piece` (registers): body(rows), rows an int32 SBUF tile holding the
    piece's row and the next one (`entry(rows, col, 1, piece.shape[1])`), copied out of `ahead` (rows begin,
    begin + 1, loaded by the caller; None: loaded here) by `engine` while the next piece's two rows load into it
    (`take_ahead`): so a piece starts without a DMA of its own rows behind the previous piece's transfers (`piece`
    ends with two padding rows for the last piece's look-ahead)."""
    if ahead is None:
        ahead = load_rows(piece, 0, begin, 2)

    def each(j):
        body(take_ahead(ahead, piece, 2, 1, j, engine=engine))

    nl.fori_loop(begin, end, each)


def block_column(table, grp, s0, sl, dtype, tile=None):
    """SBUF [sl, 1] (`tile` when given, else a new tile) <- slots s0 .. s0 + sl of a piece starting at slot group
    grp, from an [NG, G] HBM slot table (read on across the following groups: a piece's B / G groups are
    consecutive rows); one value per partition."""
    if tile is None:
        tile = nl.ndarray((sl, 1), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=table.ap(pattern=[[1, sl], [1, 1]], offset=s0, scalar_offset=grp, indirect_dim=0))
    return tile


class DmaTimes(NamedTuple):
    """DMAs issued `times` times (a 0/1 register): a prefetch that only some pieces or sub-segments run."""

    pairs: list  # (dst, src) pairs
    times: object


def copy_times(dmas):
    """`dmas.times` times: the DMAs dst <- src of `dmas.pairs`."""

    def body(i):
        for pair in dmas.pairs:
            nisa.dma_copy(dst=pair[0], src=pair[1])

    nl.fori_loop(0, dmas.times, body)


# -- resident expert matrices --------------------------------------------------------------------------------------
GATE, UP, DOWN = 0, 1, 2  # positions of the fields of ExpertWeights


class ExpertWeights(NamedTuple):
    """The gate, up and down matrices: the kernels' HBM arguments (all E experts; the forward takes them
    transposed), the resident SBUF F chunk of one expert (in the layout each kernel's matmuls need), or the
    backward's weight gradients [E + LNC, ...]."""

    gate: object
    up: object
    down: object


class InSet(NamedTuple):
    """One of two expert matrices kept in one SBUF tile [rp, 2, n * C] (each laid out [rp, n, C] as
    `load_expert_matrix` writes it), picked at run time: `pick` an int32 SBUF [1, 1] tile holding 0 or 1. The
    forward's weight double buffer: the pieces read one set while the next expert's weights load into the other."""

    tile: object
    pick: object
    C: int


def matrix(w, parts, j, c0, cols):
    """[parts, cols] of row tile j, columns c0.., of a resident expert matrix: an SBUF tile [rp, n, C] or an InSet."""
    if isinstance(w, InSet):
        t = w.tile
        return t.ap(pattern=[[t.shape[1] * t.shape[2], parts], [1, cols]], offset=j * w.C + c0, scalar_offset=w.pick,
                    indirect_dim=1)
    return w[0:parts, j, c0:c0 + cols]


def matrix_rows(w, parts, j0, n, C):
    """[parts, n, C]: row tiles j0 .. j0 + n - 1 of a resident expert matrix (an SBUF tile or an InSet)."""
    if isinstance(w, InSet):
        t = w.tile
        return t.ap(pattern=[[t.shape[1] * t.shape[2], parts], [C, n], [1, C]], offset=j0 * C, scalar_offset=w.pick,
                    indirect_dim=1)
    return w[0:parts, j0:j0 + n, 0:C]


def matrix_columns(w):
    """C, the columns of a resident expert matrix (an SBUF tile [rp, n, C] or an InSet)."""
    return w.C if isinstance(w, InSet) else w.shape[2]


def matrix_copies(w, e, r0, R, c0, C, tile, per):
    """The (SBUF dst, HBM src) DMAs of `load_expert_matrix` into `tile`, each at most `per` full 128-row tiles,
    the remainder rows last."""
    Ct = w.shape[2]
    rp = min(P, R)
    nfull = R // rp
    rem = R - nfull * rp
    pairs = []
    for j0 in range(0, nfull, per):
        n = min(per, nfull - j0)
        pairs.append((matrix_rows(tile, rp, j0, n, C), w.ap(pattern=[[Ct, rp], [rp * Ct, n], [1, C]],
                                                         offset=(r0 + j0 * rp) * Ct + c0, scalar_offset=e,
                                                         indirect_dim=0)))
    if rem > 0:
        src = w.ap(pattern=[[Ct, rem], [1, C]], offset=(r0 + nfull * rp) * Ct + c0, scalar_offset=e, indirect_dim=0)
        pairs.append((matrix(tile, rem, nfull, 0, C), src))
    return pairs


def whole_matrix_copies(w, e, tile, per):
    """`matrix_copies` of all of expert e's [E, R, C] matrix w (one F chunk: either layout) into `tile`, `per`
    row tiles per DMA (None: all in one)."""
    R, C = w.shape[1], w.shape[2]
    return matrix_copies(w, e, 0, R, 0, C, tile, per or R)


def load_expert_matrix(w, e, r0, R, c0, C, tile=None):
    """SBUF [min(P, R), ceil(R / P), C] <- w[e, r0:r0+R, c0:c0+C] of an [E, Rt, Ct] HBM tensor: row r of the
    window at [r % P, r // P, :] (into `tile` when given, an SBUF tile or an InSet, else a new tile).

    One DMA moves all full 128-row tiles (C * itemsize * R // 128 bytes per partition: 24 KiB for a whole
    30B-A3B expert matrix, or for a 384-wide F chunk at D = 4096), a second one the remainder rows. `e` is an
    int32 SBUF [1, 1] tile (runtime).
    """
    if tile is None:
        tile = nl.ndarray((min(P, R), ntiles(R, min(P, R)), C), dtype=w.dtype, buffer=nl.sbuf, name="w_resident")
    for pair in matrix_copies(w, e, r0, R, c0, C, tile, R):
        nisa.dma_copy(dst=pair[0], src=pair[1])
    return tile


def f_columns(w, e, f0, FC, tile=None):
    """Layout "F on columns" of an [E, D, F] HBM matrix: columns [f0, f0 + FC) of expert e, resident as
    [min(P, D), D/128, FC] (D on partitions: the operand of a contraction over D)."""
    return load_expert_matrix(w, e, 0, w.shape[1], f0, FC, tile)


def f_rows(w, e, f0, FC, tile=None):
    """Layout "F on rows" of an [E, F, D] HBM matrix: rows [f0, f0 + FC) of expert e, resident as
    [min(P, FC), FC/128, D] (F on partitions: the operand of a contraction over F)."""
    return load_expert_matrix(w, e, f0, FC, 0, w.shape[2], tile)


def expert_window(w, e, r0, rows, c0, cols):
    """HBM view w[e, r0:r0+rows, c0:c0+cols] of an [E, R, C] tensor."""
    Ct = w.shape[2]
    return w.ap(pattern=[[Ct, rows], [1, cols]], offset=r0 * Ct + c0, scalar_offset=e, indirect_dim=0)


# -- token rows: gathers and token-major views ---------------------------------------------------------------------
def slot_tiles(B):
    """(s, s0, sl) of each 128-slot sub-tile of a B-slot piece: its index, first slot and slots."""
    out = []
    for s in range(ntiles(B, P)):
        out.append((s, s * P, width(B, P, s)))
    return out


def column_chunks(D):
    """(c, c0, cl) of each <= 512-column chunk of D columns (one PSUM bank of fp32 each)."""
    out = []
    for c in range(ntiles(D, MOVING_FMAX)):
        out.append((c, c * MOVING_FMAX, width(D, MOVING_FMAX, c)))
    return out


def gather_into(dst, src, index):
    """dst [rows, C] with row i = src[index[i], :] (indirect DMA; `index` an int32 SBUF [rows, 1] tile)."""
    rows, cols = dst.shape[0], src.shape[1]
    nisa.dma_copy(dst=dst, src=src.ap(pattern=[[cols, rows], [1, cols]], offset=0, vector_offset=index,
                                      indirect_dim=0))


def tok(tiles, tile, s, parts, c0, cols):
    """[parts, cols] at columns c0.. of token sub-tile s of a block: a workspace tile (`tiles` a list) or a resident
    tile of a buffer [TS, NT, width]: tile (tile + s), `tile` an int32 SBUF [1, 1] tile or loop register holding the
    runtime tile index, or None (tile s)."""
    if isinstance(tiles, list):
        return tiles[s][0:parts, c0:c0 + cols]
    if tile is None:
        return tiles[0:parts, s, c0:c0 + cols]
    NT, w = tiles.shape[1], tiles.shape[2]
    return tiles.ap(pattern=[[NT * w, parts], [1, cols]], offset=s * w + c0, scalar_offset=tile, indirect_dim=1)


def block_columns(table, grp, B, dtype):
    """`block_column` of each 128-slot sub-tile of a B-slot piece starting at slot group grp."""
    out = []
    for _s, s0, sl in slot_tiles(B):
        out.append(block_column(table, grp, s0, sl, dtype))
    return out


def load_block(dsts, tile, srcs, token_index, grp, B, index=None):
    """Gather the block's rows of each [T+1, D] HBM tensor in `srcs` into its token-major tiles in `dsts` (see
    `tok`; padding slots read the zero row T). `index`: the sub-tiles' token index columns (`block_columns`),
    when the caller loaded them already."""
    for s, s0, sl in slot_tiles(B):
        rows = block_column(token_index, grp, s0, sl, I32) if index is None else index[s]
        for i in range(len(srcs)):
            gather_into(tok(dsts[i], tile, s, sl, 0, srcs[i].shape[1]), srcs[i], rows)


def affinities(slot_weight, grp, B, into=None):
    """The slot weights of a piece (slot group grp), one fp32 [sl, 1] column per 128-slot sub-tile: into the tiles
    `into` (a list), else new ones."""
    out = []
    for s, s0, sl in slot_tiles(B):
        out.append(block_column(slot_weight, grp, s0, sl, F32, None if into is None else into[s][0:sl, 0:1]))
    return out


# -- saved gT / uT: feature-major columns of an [F, NS] HBM tensor -----------------------------------------------
def saved_columns(saved, f0, fl, row0, B):
    """HBM view saved[f0 : f0 + fl, row0 : row0 + B] of an [F, NS] tensor (row0 an int32 SBUF [1, 1] tile)."""
    NS = saved.shape[1]
    return saved.ap(pattern=[[NS, fl], [1, B]], offset=f0 * NS, scalar_offset=row0, indirect_dim=1)


def saved_tiles(saved, tiles, f0, FC, row0, B):
    """[(HBM view, tile view)] pairs covering saved[f0 : f0 + FC, row0 : row0 + B] of an [F, NS] tensor and the
    feature-major tile [min(P, FC), FC/128, B]: one pair for all whole 128-row tiles, one for a remainder."""
    NS = saved.shape[1]
    fp = min(P, FC)
    nfull = FC // fp
    if nfull > 1:
        pairs = [(saved.ap(pattern=[[NS, fp], [fp * NS, nfull], [1, B]], offset=f0 * NS, scalar_offset=row0,
                           indirect_dim=1), tiles[0:fp, 0:nfull, 0:B])]
    else:
        pairs = [(saved_columns(saved, f0, fp, row0, B), tiles[0:fp, 0, 0:B])]
    rem = FC - nfull * fp
    if rem > 0:
        pairs.append((saved_columns(saved, f0 + nfull * fp, rem, row0, B), tiles[0:rem, nfull, 0:B]))
    return pairs


def save_feature_major(saved, tiles, f0, FC, row0, B):
    """saved[f0 : f0 + FC, slots of the piece] <- feature-major tiles [min(P, FC), FC/128, B]."""
    for pair in saved_tiles(saved, tiles, f0, FC, row0, B):
        nisa.dma_copy(dst=pair[0], src=pair[1])


def load_feature_major(tiles, saved, f0, FC, row0, B):
    """Inverse of `save_feature_major`."""
    for pair in saved_tiles(saved, tiles, f0, FC, row0, B):
        nisa.dma_copy(dst=pair[1], src=pair[0])


def zero_row_share(t, zeros, pid, lnc, first=0, last=None):
    """Zero this core's contiguous share of rows [first, last) (None: all) of a 2-D HBM tensor (`zeros`: a zeroed
    SBUF tile of t's dtype, at least [min(P, rows), C])."""
    R, C = t.shape
    last = R if last is None else last
    per = ntiles(last - first, lnc)
    lo = min(last, first + pid * per)
    hi = min(last, lo + per)
    for r0 in range(lo, hi, P):
        rl = min(P, hi - r0)
        nisa.dma_copy(dst=t[r0:r0 + rl, 0:C], src=zeros[0:rl, 0:C])


# -- PSUM and the Tensor Engine ------------------------------------------------------------------------------------
class PsumPool:
    """The pieces' PSUM tiles, handed out in rotation: TRANSPOSE_BANKS transpose-staging banks, each two regions of
    1 KiB per partition (4 bf16 [128, 128] transposes side by side, `transposes_into`: the Tensor Engine fills one
    region while the other is evicted), and `acc_banks` accumulators (a whole 2 KiB bank each). Rotation happens at
    trace time: a compiled loop body's k-th use is the same bank every iteration, and consecutive uses inside a
    body take turns. `dw`: the backward's weight-gradient banks (its pieces' dx accumulates there too). `evict`:
    the engines that evict the transpose regions, in turn."""

    def __init__(self, io_dtype, evict=(nisa.engine.vector, nisa.engine.scalar), acc_banks=ACC_BANKS):
        self.t_cols = MOVING_FMAX * F32.itemsize // (2 * io_dtype.itemsize)  # io-dtype columns of half a bank
        self.regions = []
        self.accs = []
        self.turns = [0, 0]  # transpose regions, accumulators handed out so far
        self.dw = None
        self.evict = evict
        for _ in range(TRANSPOSE_BANKS):
            bank = nl.ndarray((P, 2 * self.t_cols), dtype=io_dtype, buffer=nl.psum, name="psum_transpose")
            for k in range(2):
                self.regions.append(bank[0:P, k * self.t_cols:(k + 1) * self.t_cols])
        for _ in range(acc_banks):
            self.accs.append(nl.ndarray((P, MOVING_FMAX), dtype=F32, buffer=nl.psum, name="psum_acc"))

    def region(self):
        """The next transpose region in rotation."""
        n = self.turns[0]
        self.turns[0] = n + 1
        return self.regions[n % len(self.regions)]

    def acc(self):
        """The next accumulator bank in rotation."""
        n = self.turns[1]
        self.turns[1] = n + 1
        return self.accs[n % len(self.accs)]


PE_TILE = 32  # the narrowest PE column tile (NeuronCore-v3: 4 x 32)


def matmul(dst, stationary, moving, accumulate):
    """dst (PSUM) = (or +=) stationary^T @ moving. A matmul of at most 32 moving columns against a wider stationary
    runs as column tiles of 32 side by side in the PE array: each costs max(min(64, 32), N) = 32 cycles where the
    whole one costs max(min(64, M), N) = 64 (nc_matmul page), and the tiles run in parallel; tile c's result lands
    in PSUM partitions [32c, 32c + 32), the rows of dst it computes (as nki-library's column-tiled kernels place
    them)."""
    k, m, n = stationary.shape[0], stationary.shape[1], moving.shape[1]
    if n > PE_TILE or m <= PE_TILE:
        nisa.nc_matmul(dst=dst, stationary=stationary, moving=moving, accumulate=accumulate)
        return
    for c0 in range(0, m, PE_TILE):
        cw = min(PE_TILE, m - c0)
        nisa.nc_matmul(dst=dst[c0:c0 + cw, 0:n], stationary=stationary[0:k, c0:c0 + cw], moving=moving,
                       accumulate=accumulate, tile_position=(0, c0), tile_size=(P, PE_TILE))


def matmul_sum(dst, terms):
    """dst (PSUM) = the sum over `terms` ((stationary, moving) pairs) of stationary^T @ moving, in order: the
    first opens the accumulation group, the others add to it (`matmul`)."""
    for k in range(len(terms)):
        matmul(dst, terms[k][0], terms[k][1], k > 0)


def transposes_into(dst, srcs, ps):
    """dst <- the transposes of `srcs` (SBUF [p_i, f] each) side by side, [f, sum p_i] (dst: any SBUF view with f
    partitions and that many elements each, in that order): staged in one PSUM transpose region (`PsumPool`) and
    evicted by one copy, so the eviction's fixed cost is paid once per region, not per transpose; the pool's
    `evict` engines take the regions in turn."""
    f = srcs[0].shape[1]
    engine = ps.evict[ps.turns[0] % len(ps.evict)]
    region = ps.region()
    c = 0
    for src in srcs:
        p = src.shape[0]
        nisa.nc_transpose(dst=region[0:f, c:c + p], data=src)
        c += p
    nisa.tensor_copy(dst=dst, src=region[0:f, 0:c], engine=engine)


def batches(n_full, rem, per):
    """(first, count) runs of at most `per` consecutive 128-wide tiles out of n_full whole ones, then (n_full, 1) for
    a partial last tile (`rem` > 0)."""
    runs = []
    for j0 in range(0, n_full, per):
        runs.append((j0, min(per, n_full - j0)))
    if rem > 0:
        runs.append((n_full, 1))
    return runs


def feature_major(out, tokens, tile, B, cols, ps):
    """out [min(P, cols), n_tiles, B] <- the block's token-major tiles (`tok`), features on partitions; the
    transposes of one 128-slot sub-tile go side by side in a PSUM region, several feature tiles per eviction."""
    for s, s0, sl in slot_tiles(B):
        for run in batches(cols // P, cols % P, ps.t_cols // sl):
            j0, n = run
            fl = width(cols, P, j0)
            srcs = []
            for j in range(j0, j0 + n):
                srcs.append(tok(tokens, tile, s, sl, j * P, fl))
            transposes_into(out[0:fl, j0:j0 + n, s0:s0 + sl], srcs, ps)


def token_major(tokens, tile, feature, B, cols, ps):
    """Inverse of `feature_major`: fill the block's token-major tiles from a feature-major one (consecutive feature
    tiles are consecutive columns of a token-major tile: one eviction per PSUM region)."""
    for s, s0, sl in slot_tiles(B):
        for run in batches(cols // P, cols % P, ps.t_cols // P):
            j0, n = run
            span = min(cols, (j0 + n) * P) - j0 * P
            srcs = []
            for j in range(j0, j0 + n):
                srcs.append(feature[0:width(cols, P, j), j, s0:s0 + sl])
            transposes_into(tok(tokens, tile, s, sl, j0 * P, span), srcs, ps)
