"""Host-side layout of the NKI MoE kernels: tile sizes, the SBUF and PSUM budgets, and what fits at which shapes.

Everything here is plain Python on sizes, run both by the host (`nki_moe.tables`, `kernels.buffers`) and by the
kernels while they trace, so the host plans the tables by the same figures the kernels allocate by.
"""

from __future__ import annotations

from typing import NamedTuple

from workbench.kernels.nki_api import nl

P = nl.tile_size.pmax  # 128 partitions
MOVING_FMAX = nl.tile_size.gemm_moving_fmax  # 512: moving free size, also one fp32 PSUM bank
F32 = nl.float32
I32 = nl.int32
# SBUF bytes per partition a kernel may allocate: `nl.tile_size.total_available_sbuf_size` (212,464 B on trn2: the
# raw 224 KiB less the compiler's reservations; tile_size page, and the figure nki-library's memory manager
# allocates within). Sizing against the raw 224 KiB would fail to allocate on hardware.
SBUF_BYTES = nl.tile_size.total_available_sbuf_size
# kept free in the backward's budget for the small tiles a block allocates on top of its workspace (int32 [1, 1]
# table entries and slot-index / affinity columns: < 100 bytes per partition)
SMALL_TILES_BYTES = 1024
# PSUM banks each piece pool rotates through (`tiles.PsumPool`): with two, the Tensor Engine fills one bank while
# another engine evicts the other, instead of waiting for the eviction (8 banks: "up to eight outstanding matmul
# accumulation groups", Trainium2 architecture guide). 2 + 2 banks in both kernels; the backward's other 4 hold the
# weight gradients (and, during its pieces, dx: `dx_in_dw_banks`), and its d_affinity row accumulates in the next
# accumulator in turn, so the pieces keep both transpose banks
TRANSPOSE_BANKS = 2
ACC_BANKS = 2
# The backward's weight-gradient phase: groups of DW_GROUP_BANKS output bands [<=128, <=512] accumulate together;
# DW_SETS groups rotate through DW_SETS * DW_GROUP_BANKS banks, so the Tensor Engine fills one group's banks while
# the Scalar and Vector Engines evict the previous group's (one bank each) instead of waiting for every eviction
DW_GROUP_BANKS = 2
DW_SETS = 2
DW_BANKS = DW_GROUP_BANKS * DW_SETS
DW_ROW_BANKS = DW_GROUP_BANKS  # a weight-gradient output row is written in segments of this many banks (1024 columns)
# Stage buffers (SBUF) the evicted dW bands wait in for their DMA to HBM, in rotation: DW_SETS, and more in the SBUF
# the resident tiles leave over, up to DW_STAGE_BYTES per partition (`stage_sets`), so an eviction does not wait for
# a store that the HBM link has queued behind other transfers. They never take SBUF from the resident tiles
# (`fit_backward` sizes those with DW_SETS).
DW_STAGE_BYTES = 12 * 1024
# piece classes narrower than a resident tile, each with its own one-tile buffer (`tail_widths`): at most 64 and 32
# (the slot granule is 32 whenever a block has tails)
TAIL_BUFFERS = 2
# The forward's resident weights get at most this much; the rest holds one block's workspace (x tiles, xT, ...).
RESIDENT_WEIGHT_BYTES = 144 * 1024


def ntiles(n, size):
    return (n + size - 1) // size


def width(n, size, j):
    """Length of tile j when range(n) is cut into tiles of `size` (the last one may be shorter)."""
    return min(size, n - j * size)


# -- F chunks: how much of an expert's weights is resident at once -------------------------------------------------
def resident_bytes(D, FC, itemsize, n_mats):
    """Bytes/partition of n_mats resident [D, FC] expert matrices (either layout: [D/128, FC] or [FC/128, D])."""
    return n_mats * max(ntiles(D, P) * FC, ntiles(FC, P) * D) * itemsize


def f_chunk(D, F, itemsize, n_mats):
    """Forward: FC, the width of the F chunk kept resident: F when all n_mats matrices fit RESIDENT_WEIGHT_BYTES,
    else the widest multiple of 128 that fits (at least 128). Chunks are processed one after the other per expert
    segment; the F-contractions (y, dx, d_affinity) accumulate their partial sums across chunks
    (docs/nki_kernels.md)."""
    if resident_bytes(D, F, itemsize, n_mats) <= RESIDENT_WEIGHT_BYTES or F <= P:
        return F
    FC = P
    for n in range(2, F // P + 1):
        if resident_bytes(D, n * P, itemsize, n_mats) <= RESIDENT_WEIGHT_BYTES:
            FC = n * P
    return FC


# -- token tiles and the token-major scratch ----------------------------------------------------------------------
def token_tiles(T, lnc):
    """(nT, TT): the combine's token tiles and tokens per tile, TT = min(T, 128), nT a multiple of the LNC (the same
    trip count on every core; the host drops the padded tokens' rows)."""
    TT = min(T, P)
    return ntiles(T, TT * lnc) * lnc, TT


def assignment_rows(T, K, NS, lnc):
    """The rows of the kernels' token-major scratch (`y_rows`, `dx_rows`; `row_of_slot` says which slot writes
    which): row t * K + k for assignment (t, k) of every token tile (nT * TT * K rows, the padded tokens' rows
    zero-filled), then one row per padding or no-op slot (NS - T * K of them), rounded up to whole token tiles of
    TT * K rows (the combine reads tile t at `scalar_offset=t`)."""
    nT, TT = token_tiles(T, lnc)
    return ntiles(nT * TT * K + NS - T * K, TT * K) * TT * K


# -- piece classes and resident tiles ------------------------------------------------------------------------------
def tile_slots(KB):
    """TS, the slots per resident backward tile: 128, or the whole block when blocks are smaller."""
    return min(P, KB)


def piece_widths(KB, L):
    """B of each of the L piece classes: KB, KB/2, ..., KB >> (L - 1)."""
    widths = []
    for k in range(L):
        widths.append(KB >> k)
    return widths


def tail_widths(widths):
    """The piece classes narrower than a resident tile (each has its own one-tile buffer)."""
    tails = []
    for B in widths:
        if B < tile_slots(widths[0]):
            tails.append(B)
    return tails


def tiles_needed(widths):
    """Resident tiles a sub-segment needs at least: one full block and the main-buffer tail classes' tiles."""
    TS = tile_slots(widths[0])
    n = 0
    for B in widths:
        if B >= TS:
            n += B // TS
    return n


def alternates_halves(F, FC, NT, widths):
    """Whether the backward's sub-segments alternate between two halves of its NT resident main tiles, each
    gathering the next one's first full block into the other half before its weight-gradient phase: when F is one
    chunk (FC == F) and half the tiles still hold a sub-segment (`tiles_needed`). The host plans the tables by it
    (`tables.tiles_per_sub`), the kernel orders a piece's work by it (`backward.backward_block`)."""
    return FC == F and NT // 2 >= tiles_needed(widths)


# -- the backward's SBUF budget ------------------------------------------------------------------------------------
class BwdWorkspace(NamedTuple):
    """The backward's per-block SBUF workspace: each field one tile (or, from `bwd_workspace_shapes`, its (shape,
    dtype)). Two are updated in place: `dh` holds dhT, then affinity * dhT; `out_rows` the dx rows of the piece on
    their way to the slot scratch. `partial` only when F is chunked (else None)."""

    dyT: object
    g: object  # the saved gT, uT
    u: object
    dh: object
    silu: object
    dsilu: object
    h: object
    dg: object
    du: object
    h_dh: object  # h * dh of one f-tile, summed over partitions into d_affinity
    aff_bcast: object  # the piece's slot weights, copied to every partition
    d_aff: object  # d_affinity of the piece's slots
    d_aff_prev: object  # F chunked: d_affinity summed over the earlier chunks
    aff_row: object  # the piece's slot weights, one row
    out_rows: object
    ones: object
    stage: object  # dW bands on their way to HBM
    dw_ids: object  # the dW phase's table entries and prefetched expert (`backward.sub_segments`)
    partial: object  # F chunked: later chunks add to the partial sums already in the slot scratch

    def cut(self, B):
        """The workspace cut to a B-slot piece (B <= KB, the workspace's block): every per-slot tile sliced to B."""
        fields = []
        for name in self._fields:
            t = getattr(self, name)
            if name in BWD_PER_SLOT_3D:
                t = t[0:t.shape[0], 0:t.shape[1], 0:B]
            elif name in BWD_PER_SLOT_2D:
                t = t[0:t.shape[0], 0:B]
            fields.append(t)
        return BwdWorkspace(*fields)


BWD_PER_SLOT_3D = ("g", "u", "silu", "dsilu", "h", "dyT", "dh", "dg", "du")  # [parts, tiles, KB] feature-major
BWD_PER_SLOT_2D = ("h_dh", "aff_bcast", "d_aff", "d_aff_prev", "aff_row")  # [parts, KB]


def bwd_workspace_shapes(KB, D, FC, io_dtype, slot_dtype, chunked, stage_sets=DW_SETS):
    """The (shape, dtype) of each tile of the backward's per-block SBUF workspace (`BwdWorkspace`): one source for
    the allocation and the SBUF budget of `backward_layout`. Elementwise math runs in the io dtype, as the torch
    reference does it."""
    dp, fp, nD, nF = min(P, D), min(P, FC), ntiles(D, P), ntiles(FC, P)
    feature = ((fp, nF, KB), io_dtype)
    row_io, row_f32 = ((1, KB), io_dtype), ((1, KB), F32)
    return BwdWorkspace(
        dyT=((dp, nD, KB), io_dtype), g=feature, u=feature, dh=feature, silu=feature, dsilu=feature, h=feature,
        dg=feature, du=feature, h_dh=((fp, KB), io_dtype), aff_bcast=((fp, KB), io_dtype), d_aff=row_f32,
        d_aff_prev=row_f32, aff_row=row_io, out_rows=((P, D), slot_dtype), ones=((P, P), io_dtype),
        stage=((P, stage_sets * DW_GROUP_BANKS * MOVING_FMAX), io_dtype), dw_ids=((1, 5), I32),
        partial=((P, D), F32) if chunked else None)


def shape_bytes(shapes):
    """Bytes per partition of the (shape, dtype) pairs in `shapes` (None entries: nothing)."""
    total = 0
    for spec in shapes:
        if spec is not None:
            shape, dtype = spec
            n = dtype.itemsize
            for d in shape[1:]:
                n *= d
            total += n
    return total


def res_tile_bytes(D, FC, itemsize):
    """Bytes/partition of one resident tile: x and affinity * dy (D wide), dg, du and h (FC wide)."""
    return (2 * D + 3 * FC) * itemsize


def fit_backward(D, F, io_dtype, widths):
    """(FC, NT) of the backward, (0, 0) when nothing fits (see `backward_layout`)."""
    KB = widths[0]
    need = tiles_needed(widths)
    tails = len(tail_widths(widths))
    chunks = [F]
    for n in range(F // P, 0, -1):
        if n * P < F:
            chunks.append(n * P)
    for FC in chunks:
        ws = bwd_workspace_shapes(KB, D, FC, io_dtype, F32 if FC < F else io_dtype, FC < F)
        free = SBUF_BYTES - SMALL_TILES_BYTES - resident_bytes(D, FC, io_dtype.itemsize, 3) - shape_bytes(ws)
        NT = free // res_tile_bytes(D, FC, io_dtype.itemsize) - tails
        if NT >= need:
            return FC, NT
    return 0, 0


def stage_sets(D, F, FC, NT, io_dtype, widths):
    """The weight-gradient phase's stage buffer sets: DW_SETS plus what the SBUF left by the resident tiles holds
    ((FC, NT) from `fit_backward`), at most DW_STAGE_BYTES per partition in all."""
    KB, it = widths[0], io_dtype.itemsize
    ws = bwd_workspace_shapes(KB, D, FC, io_dtype, F32 if FC < F else io_dtype, FC < F)
    tiles = (NT + len(tail_widths(widths))) * res_tile_bytes(D, FC, it)
    left = SBUF_BYTES - SMALL_TILES_BYTES - resident_bytes(D, FC, it, 3) - shape_bytes(ws) - tiles
    per_set = DW_GROUP_BANKS * MOVING_FMAX * it
    return max(DW_SETS, min(DW_STAGE_BYTES // per_set, DW_SETS + left // per_set))


def backward_layout(D, F, io_dtype, widths):
    """(FC, NT) of the backward: the F chunk kept resident (F itself when it fits) and how many resident TS-slot
    tiles an expert sub-segment may fill, so that the three resident matrices of a chunk, the block workspace, the
    tail buffers and NT tiles fit SBUF_BYTES per partition (widest chunk first). The host splits experts with more
    tiles into sub-segments (`tables.KernelPlan`).

    Raises:
        ValueError: not even the narrowest chunk fits with one sub-segment's tiles.
    """
    FC, NT = fit_backward(D, F, io_dtype, widths)
    if NT == 0:
        raise ValueError(f"the NKI MoE backward does not fit SBUF at D={D}, F={F}, {widths[0]}-slot blocks in "
                         f"{io_dtype}: use a smaller model.moe_block_size")
    return FC, NT


# -- the forward's SBUF budget -------------------------------------------------------------------------------------
def forward_layout(widths, D, F, FC, itemsize):
    """(weight sets, x per class) of the forward. Two weight sets (the next position's expert loads into one while
    the pieces read the other) when F is one chunk and they fit SBUF_BYTES with one block's workspace (x tiles, xT,
    gT, uT, silu, hT, the y rows) and the small tiles; then x tiles per piece class (so the classes' first gathers
    can all be issued when a position starts) when those fit as well."""
    if FC < F:
        return 1, False
    KB = widths[0]
    fits = []
    for sets, classes in ((2, widths), (2, [KB]), (1, widths)):
        x_tiles = 0
        for B in classes:
            x_tiles += ntiles(B, P)
        workspace = (x_tiles * D + ntiles(D, P) * KB + 4 * ntiles(F, P) * KB + D) * itemsize
        fits.append(sets * resident_bytes(D, F, itemsize, 3) + workspace + SMALL_TILES_BYTES <= SBUF_BYTES)
    if fits[0] or fits[1]:
        return 2, fits[0]
    return 1, fits[2]
