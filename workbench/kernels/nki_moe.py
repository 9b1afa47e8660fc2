"""NKI kernels for the blockwise Qwen3-MoE experts (forward and backward), standalone NKI API, LNC 1 or 2.

Same algorithm as `moe_reference.blockwise_moe`; the host (`autograd.py`) builds the block plan and hands the
kernels int32 tables (design, cost numbers, the trn2 time model and the block-size sweep: docs/nki_kernels.md).

Dimensions (one meaning per letter in this file; lowercase fl, dl, sl, cl, rl: the length of one tile of F/FC, D,
slots, columns, rows):
    T: tokens; K: experts per token (top-k); E: experts; D: hidden size
    F: the experts' full intermediate size; FC: the F chunk kept resident (F when it fits SBUF, else a multiple of
        128; F's last chunk may be narrower, so inside a block FC is that chunk's own width)
    G: slot granule (each expert's slots are padded to a multiple of G: 32, or KB when KB is not 32 x 2^k)
    NG: slot groups of G (rows of the [NG, G] slot tables, the cores' no-op areas last); NS = NG * G: slots
    KB: slots of a full kernel block, G * 2^(L-1); L: piece classes; B: slots of one piece (its class: KB >> k)
    TS: slots per resident backward tile, min(128, KB); NT: resident main tiles of a sub-segment
    S: segment positions per core; M: rows of `piece`; J: sub-segments per position (a static bound);
        Z: per-core rows of `zero_rows`
    nT, TT: token tiles of the combine and tokens per tile; LNC: logical cores (`lnc`); P: 128 partitions
    R, C: rows and columns of whatever matrix a generic helper moves

Per piece of B slots of one expert:

    forward   gather x rows -> xT (features on partitions) -> gT, uT = W_gate/up[e] @ xT   (fp32 PSUM)
              gT, uT saved to HBM (io dtype) for the backward
              hT = silu(gT) * uT -> y = h @ W_down[e]^T -> y * affinity -> scattered to y_rows[t * K + k]
              then out[t] = sum_k y_rows[t * K + k] (contiguous loads: `_combine`)
    backward  load the saved gT, uT; hT = silu(gT) * uT; dh = (dy @ W_down[e])^T; d_affinity = sum_f h * dh;
              dh *= affinity; du = dh * silu(g); dg = dh * u * silu'(g); dx_rows = dg @ W_gate[e] + du @ W_up[e];
              x, affinity * dy and the token-major dg, du, h stay resident in SBUF, one TS-slot tile each;
              after the expert's last piece: dW[e] = sum over its tiles of (per-slot grads)^T @ (inputs),
              accumulated in PSUM and written once (io dtype); then dx[t] = sum_k dx_rows[t * K + k]

How the work is laid out (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/get-started/about/lnc.html,
.../nki/deep-dives/nki-loops.html), NKI 0.7.0 (Neuron SDK 2.33):

* **Segments and pieces.** Each expert's slots are padded to a multiple of G (and to at least one TS-slot tile,
  the backward's first); the expert's slot groups run as full blocks of KB slots, then its tail as at most
  one piece each of KB/2, ..., G slots (the binary digits of the leftover group count). One segment per non-empty
  expert, on one core (an expert never spans two cores: one writer of its dW). Core `nl.program_id(0)` runs
  `nl.fori_loop(0, n_positions, segment)` -> load the expert's weights once (a few DMAs of >= 2 KiB per partition)
  -> per piece class k (KB >> k slots) `nl.fori_loop(begin_k, end_k, piece)` over the segment's rows of `piece`.
  All are compiled loops: each body is traced once (one body per piece class), so the program size does not grow
  with T. Runtime addresses use `.ap(scalar_offset=<loop register or int32 SBUF [1, 1] tile>)`.
* **The same trip counts on every core** (LNC page: control flow that differs between the cores is undefined).
  Both cores run the same number of segment positions and, at each position, the same number of pieces of each
  class; where a core has fewer real pieces than the other it runs no-op pieces (zero rows of x, slot weight 0,
  its own scratch slot rows: they contribute exact zeros). The host deals experts to cores sorted by group count,
  so the two experts of a position mostly have equal piece counts (why this and not AWS's shared-count-with-barriers
  pattern: docs/nki_kernels.md). The zero fills and the combine run the same trip count on both cores.
* **Weight gradients in PSUM (backward).** A piece's token-major operands go to resident SBUF tiles (NT tiles of
  TS slots for full blocks and the TS-slot tail, one buffer per smaller tail class) at the tile index the host
  wrote into `piece`. After the segment's pieces, each group of `DW_GROUP_BANKS` output bands [<=128, <=512] of
  dW_gate, dW_up, dW_down accumulates over all of the expert's tiles in PSUM (its first tile opens the group, a
  compiled loop adds the others, 0/1-trip loops the tail buffers; `DW_SETS` groups in rotation), is evicted once (Scalar
  and Vector Engines, a bank each) and written once to dW[e] in the io dtype: no
  fp32 read-modify-write of dW and no zero fill of it (only of empty experts). An expert with more tiles than fit
  SBUF is split by the host into *sub-segments* run one after the other by the same core; sub-segments after the
  first add into dW[e] with `nisa.dma_compute` (`cont` in `sub_table`). Each core has a dummy dW row (E + core)
  that absorbs the writes of its no-op and spare sub-segments; the host drops those rows. When F is one chunk the
  position's last sub-segment loads the core's next expert's weights during its dW phase, which does not read
  them (`next expert` in `seg_table`, `load` in `sub_table`), in parts of ~8 KiB per partition between the dW
  groups (`_weight_parts`).
* **DMA order.** The DMA engines serve their packets in order (DMA overview: one packet per engine per group of
  partitions), so a 9 MiB weight load issued in one piece holds every transfer behind it for ~26 us. The kernels
  spread such loads: the backward's between dW groups, the forward's one matrix per piece (below).
* **Forward software pipeline and weight double buffer.** Each forward piece gathers the next piece's x rows
  (`piece` row j + 1) right after its transposes, so the gather overlaps its matmuls. With x tiles per class (where
  SBUF allows, `forward_layout`) this runs across positions: a class loop's last piece gathers the class's first
  piece at the core's next position, so only position 0's are gathered before the segment loop; with one shared set,
  each class loop's first piece just before the loop. A class loop may gather a piece it does not run (harmless:
  every row of `piece` is a valid piece, and `piece` ends with two padding rows). When F is one chunk and SBUF allows
  (`forward_layout`), the weights are double buffered (`InSet`: set s % 2 of position s, picked at run time from
  `seg_table`): the position's pieces load the next position's gate, up and down matrices into the other set, one
  matrix on each of three pieces spread over the position (`piece` columns 5-7).
* **Backward software pipeline.** In a class loop over resident main tiles, the first piece gathers its own x and
  dy rows and each piece gathers the next one's into that piece's tiles (`piece` columns 3-4, 0/1-trip loops), so
  the gather chain (table row -> index column -> row gather) overlaps a piece instead of opening it. Across
  sub-segments (when F is one chunk and half the resident tiles hold a sub-segment, `autograd.tiles_per_sub`), the
  sub-segments alternate between two halves of the tiles, and each gathers the next one's first full block into the
  other half after its pieces, before its weight-gradient phase floods the DMA queues (`early` in `sub_table`); the
  dW phase's DMAs read their table entries from a tile of their own (`dw_ids`), so the next rows of the tables load
  while those DMAs are in flight.
* **Transposes.** The Tensor Engine transposes (x -> xT, dy -> dyT, dg/du/h back to token-major) go side by side
  into half a PSUM bank (4 bf16 [128, 128]) and leave it in one copy, the Vector and Scalar Engines in turn
  (`_transposes_into`): the eviction's fixed cost is paid once per 4 transposes, and the Tensor Engine fills one
  half while the other is evicted.
* **Narrow pieces.** A piece of B < 128 slots computes y and dx with the weights as the stationary and its B slots
  moving (yT, dxT; `_down_narrow`, `_dx_tile`), then transposes them back: with B slots as the stationary only B of
  the Tensor Engine's 128 columns would work over 512 moving columns per matmul.
* **Table rows** (`_take_ahead`). Each piece copies its two `piece` rows from a tile the previous piece of its
  class loop loaded and loads the next piece's into it (`_pieces`), so a piece's start does not wait for a DMA of
  its rows behind the previous piece's transfers (a tile read as a DMA's runtime offset stays in use until that DMA
  completes). The same one level up: a position loads the core's next position's `seg_table` row at its start
  (column 6; both kernels), and, when F is one chunk, a backward sub-segment loads the core's next run
  sub-segment's `sub_table` row at its start (column 10) and that one's first two class-0 `piece` rows after its
  pieces: issued after the weight-gradient phase, whose stores wait for their evictions on the in-order descriptor
  queues, they would wait for the whole phase (~9 us per position at 30B-A3B). The forward gathers a piece's slot
  weights with its x rows (`ws["aff"]`, copied out by the piece): they do not queue behind its weight prefetch.
* **F chunks.** When an expert's resident matrices (and, backward, the resident tiles) do not fit SBUF (D = 4096),
  the weights are kept resident one F chunk of FC at a time (chunk loop between the segment and piece loops); y,
  dx and d_affinity accumulate their partial sums over chunks in fp32 slot scratch, dW rows/columns of a chunk are
  disjoint.
* **LNC.** Launched as `kernel[lnc]`, lnc the compiler's (`core.neuron_env.logical_nc_config()`); shared HBM
  scratch written by one core and read by the other is fenced by `nisa.core_barrier`.
* **Slot scratch.** Block results go to an io-dtype (bf16 on device) HBM scratch, one row per slot, and the
  combine gathers each token's K rows and sums them in fp32. A scatter-add straight into `out` would avoid the
  scratch but needs a DMA read-modify-write whose two writers (cores, or two k of one token in flight) race.

Layout rules (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/about/tiling-overview.html): the
matmul contraction dim sits on the partition axis (<= 128) of both operands; stationary free <= 128, moving free
<= 512; results accumulate in fp32 PSUM tiles of <= 2 KiB per partition and are evicted to SBUF. Kernel blocks
hold KB <= 256 slots (token sub-tiles of 128 on the partition axis); tail pieces are G..KB/2 slots. Matmul
operands and the SwiGLU's elementwise math use the io dtype (as the torch reference computes them); PSUM
accumulation, the combine's sums and partial sums over F chunks are fp32. The code sticks to the documented NKI
Python subset (plain for loops over range, no comprehensions).

Status: runs here through the CPU emulator (`nki_emulator`); nothing here has run on Trainium yet."""

from __future__ import annotations

from typing import NamedTuple

from workbench.core.errors import check_argument
from workbench.kernels.nki_api import nisa, nki, nl

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
# PSUM banks each piece pool rotates through (`_psum`): with two, the Tensor Engine fills one bank while another
# engine evicts the other, instead of waiting for the eviction (8 banks: "up to eight outstanding matmul
# accumulation groups", Trainium2 architecture guide). 2 + 2 banks in both kernels; the backward's other 4 hold
# the weight gradients (and, during its pieces, dx: `dx_in_dw_banks`), and its d_affinity row accumulates in the
# next accumulator in turn (a bank of its own cost the pieces a transpose bank: backward 6.877 -> 6.850 ms without)
PSUM_BANKS = {"t": 2, "acc": 2}
# The backward's weight-gradient phase: groups of DW_GROUP_BANKS output bands [<=128, <=512] accumulate together;
# DW_SETS groups rotate through DW_SETS * DW_GROUP_BANKS banks, so the Tensor Engine fills one group's banks while
# the Scalar and Vector Engines evict the previous group's (one bank each). With one set of 5 banks evicted by the
# Scalar Engine alone the Tensor Engine waited for every eviction: the phase took the sum of both (T 512, E 16,
# D 2048, F 768, LNC 2: backward 2.38 -> 2.03 ms under the dependency model).
DW_GROUP_BANKS = 2
DW_SETS = 2
DW_BANKS = DW_GROUP_BANKS * DW_SETS
# Stage buffers (SBUF) the evicted dW bands wait in for their DMA to HBM, in rotation: DW_SETS, and more in the SBUF
# the resident tiles leave over, up to DW_STAGE_BYTES per partition (`stage_sets`), so an eviction does not wait for
# a store that the HBM link has queued behind other transfers (T 512, E 16, bf16: backward 1.95 -> 1.88 ms with 6
# instead of 2). They never take SBUF from the resident tiles (`fit_backward` sizes those with DW_SETS).
DW_STAGE_BYTES = 12 * 1024
# seg_table columns before the piece bounds: expert, [begin, end) sub_table rows, next expert, its weight set, the
# next position's weight set (the forward's double buffer), the core's next position's row (loaded ahead)
SEG_HEAD = 7
# sub_table columns before the piece bounds: write row, add row, cont, the sub-segment's main tiles (first, loop
# begin, loop end: [first, end) with begin = first + 1), load, early (the next sub-segment's first main piece
# gathered here: 0 or 1), its slot group and first tile, the core's next run sub-segment's row (loaded ahead)
SUB_HEAD = 11
DW_ROW_BANKS = DW_GROUP_BANKS  # a weight-gradient output row is written in segments of this many banks (1024 columns)
# piece classes narrower than a resident tile, each with its own one-tile buffer (`_tail_widths`): at most 64 and 32
# (the slot granule is 32 whenever a block has tails)
TAIL_BUFFERS = 2
# `piece` columns: slot group, slot row, resident tile, own, next, the forward's gate / up / down loads, the
# backward's down load (PIECE_DOWN), per tail buffer a gather flag and slot group (from PIECE_TAILS on)
PIECE_DOWN, PIECE_TAILS = 8, 9
PIECE_COLS = PIECE_TAILS + 2 * TAIL_BUFFERS


def _ntiles(n, size):
    return (n + size - 1) // size


def _width(n, size, j):
    """Length of tile j when range(n) is cut into tiles of `size` (the last one may be shorter)."""
    return min(size, n - j * size)


# -- data movement -----------------------------------------------------------------------------------------------------
def _load_entry(table, row0, col, reg):
    """int32 SBUF [1, 1] <- table[row0 + reg, col] of an [R, C] int32 HBM table (reg: a loop register)."""
    tile = nl.ndarray((1, 1), dtype=I32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=table.ap(pattern=[[1, 1], [1, 1]], offset=row0 * table.shape[1] + col,
                                         scalar_offset=reg, indirect_dim=0))
    return tile


def _row(table, row0, reg, rows=1, tile=None):
    """int32 SBUF [1, rows * C] <- rows row0 + reg .. row0 + reg + rows - 1 of an [R, C] int32 HBM table (reg: a loop
    register), in one DMA (into `tile` when given, else a new tile): entry (r, c) at column r * C + c (a [1, 1] slice
    is a scalar offset or a register's source)."""
    C = table.shape[1]
    if tile is None:
        tile = nl.ndarray((1, rows * C), dtype=I32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=table.ap(pattern=[[C, 1], [1, rows * C]], offset=row0 * C, scalar_offset=reg,
                                         indirect_dim=0))
    return tile


def _take_ahead(ahead, table, rows=1, row0=0, reg=None, col=None, engine=nisa.engine.gpsimd):
    """Table rows loaded one step ahead: returns a copy of `ahead` (the rows the previous step loaded into it,
    copied by `engine` into a tile of the step's own), then loads the next step's `rows` rows of `table` into `ahead`
    (`_row`), from row row0 + `reg` (a loop register) or row0 + the entry in column `col` of the copy. A step's
    rows then never wait for a DMA behind its predecessor's transfers: `ahead` is free to reload once copied, and
    the copy stays in use as long as the step's DMAs read it as offsets."""
    taken = nl.ndarray(ahead.shape, dtype=I32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=taken, src=ahead, engine=engine)
    _row(table, row0, reg if col is None else taken[0:1, col:col + 1], rows, ahead)
    return taken


def _register(tile):
    reg = nisa.register_alloc()
    nisa.register_load(reg, tile)
    return reg


def _block_column(table, grp, s0, sl, dtype, tile=None):
    """SBUF [sl, 1] (`tile` when given, else a new tile) <- slots s0 .. s0 + sl of a piece starting at slot group
    grp, from an [NG, G] HBM slot table (read on across the following groups: a piece's B / G groups are
    consecutive rows); one value per partition."""
    if tile is None:
        tile = nl.ndarray((sl, 1), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=table.ap(pattern=[[1, sl], [1, 1]], offset=s0, scalar_offset=grp, indirect_dim=0))
    return tile


class InSet(NamedTuple):
    """One of two expert matrices kept in one SBUF tile [rp, 2, n * C] (each laid out [rp, n, C] as
    `_load_expert_matrix` writes it), picked at run time: `pick` an int32 SBUF [1, 1] tile holding 0 or 1. The
    forward's weight double buffer: the pieces read one set while the next expert's weights load into the other."""

    tile: object
    pick: object
    C: int


def _matrix(w, parts, j, c0, cols):
    """[parts, cols] of row tile j, columns c0.., of a resident expert matrix: an SBUF tile [rp, n, C] or an InSet."""
    if isinstance(w, InSet):
        t = w.tile
        return t.ap(pattern=[[t.shape[1] * t.shape[2], parts], [1, cols]], offset=j * w.C + c0, scalar_offset=w.pick,
                    indirect_dim=1)
    return w[0:parts, j, c0:c0 + cols]


def _matrix_rows(w, parts, j0, n, C):
    """[parts, n, C]: row tiles j0 .. j0 + n - 1 of a resident expert matrix (an SBUF tile or an InSet)."""
    if isinstance(w, InSet):
        t = w.tile
        return t.ap(pattern=[[t.shape[1] * t.shape[2], parts], [C, n], [1, C]], offset=j0 * C, scalar_offset=w.pick,
                    indirect_dim=1)
    return w[0:parts, j0:j0 + n, 0:C]


def _whole_matrix_copies(w, e, tile, per):
    """`_matrix_copies` of all of expert e's [E, R, C] matrix w (one F chunk: either layout) into `tile`, `per`
    row tiles per DMA (None: all in one)."""
    R, C = w.shape[1], w.shape[2]
    return _matrix_copies(w, e, 0, R, 0, C, tile, per or R)


def _columns(w):
    """C, the columns of a resident expert matrix (an SBUF tile [rp, n, C] or an InSet)."""
    return w.C if isinstance(w, InSet) else w.shape[2]


def _load_expert_matrix(w, e, r0, R, c0, C, tile=None):
    """SBUF [min(P, R), ceil(R / P), C] <- w[e, r0:r0+R, c0:c0+C] of an [E, Rt, Ct] HBM tensor: row r of the
    window at [r % P, r // P, :] (into `tile` when given, an SBUF tile or an InSet, else a new tile).

    One DMA moves all full 128-row tiles (C * itemsize * R // 128 bytes per partition: 24 KiB for a whole
    30B-A3B expert matrix, or for a 384-wide F chunk at D = 4096), a second one the remainder rows. `e` is an
    int32 SBUF [1, 1] tile (runtime).
    """
    if tile is None:
        tile = nl.ndarray((min(P, R), _ntiles(R, min(P, R)), C), dtype=w.dtype, buffer=nl.sbuf, name="w_resident")
    for pair in _matrix_copies(w, e, r0, R, c0, C, tile, R):
        nisa.dma_copy(dst=pair[0], src=pair[1])
    return tile


def _matrix_copies(w, e, r0, R, c0, C, tile, per):
    """The (SBUF dst, HBM src) DMAs of `_load_expert_matrix` into `tile`, each at most `per` full 128-row tiles,
    the remainder rows last."""
    Ct = w.shape[2]
    rp = min(P, R)
    nfull = R // rp
    rem = R - nfull * rp
    pairs = []
    for j0 in range(0, nfull, per):
        n = min(per, nfull - j0)
        pairs.append((_matrix_rows(tile, rp, j0, n, C), w.ap(pattern=[[Ct, rp], [rp * Ct, n], [1, C]],
                                                         offset=(r0 + j0 * rp) * Ct + c0, scalar_offset=e,
                                                         indirect_dim=0)))
    if rem > 0:
        src = w.ap(pattern=[[Ct, rem], [1, C]], offset=(r0 + nfull * rp) * Ct + c0, scalar_offset=e, indirect_dim=0)
        pairs.append((_matrix(tile, rem, nfull, 0, C), src))
    return pairs


def _expert_window(w, e, r0, rows, c0, cols):
    """HBM view w[e, r0:r0+rows, c0:c0+cols] of an [E, R, C] tensor."""
    Ct = w.shape[2]
    return w.ap(pattern=[[Ct, rows], [1, cols]], offset=r0 * Ct + c0, scalar_offset=e, indirect_dim=0)


# -- expert weights: one record, two resident layouts ------------------------------------------------------------------
class ExpertWeights(NamedTuple):
    """The gate, up and down matrices: the kernels' HBM arguments (all E experts; the forward takes them
    transposed), the resident SBUF F chunk of one expert (in the layout each kernel's matmuls need, see
    `_forward_weights` / `_backward_weights`), or the backward's weight gradients [E + LNC, ...]."""

    gate: object
    up: object
    down: object


def _f_columns(w, e, f0, FC, tile=None):
    """Layout "F on columns" of an [E, D, F] HBM matrix: columns [f0, f0 + FC) of expert e, resident as
    [min(P, D), D/128, FC] (D on partitions: the operand of a contraction over D)."""
    return _load_expert_matrix(w, e, 0, w.shape[1], f0, FC, tile)


def _f_rows(w, e, f0, FC, tile=None):
    """Layout "F on rows" of an [E, F, D] HBM matrix: rows [f0, f0 + FC) of expert e, resident as
    [min(P, FC), FC/128, D] (F on partitions: the operand of a contraction over F)."""
    return _load_expert_matrix(w, e, f0, FC, 0, w.shape[2], tile)


# -- F chunks and SBUF budgets: how much of an expert's weights (and, backward, tiles) is resident at once ---------
# The forward's resident weights get at most this much; the rest holds one block's workspace (x tiles, xT, ...).
RESIDENT_WEIGHT_BYTES = 144 * 1024


def _resident_bytes(D, FC, itemsize, n_mats):
    """Bytes/partition of n_mats resident [D, FC] expert matrices (either layout: [D/128, FC] or [FC/128, D])."""
    return n_mats * max(_ntiles(D, P) * FC, _ntiles(FC, P) * D) * itemsize


def f_chunk(D, F, itemsize, n_mats):
    """Forward: FC, the width of the F chunk kept resident: F when all n_mats matrices fit RESIDENT_WEIGHT_BYTES,
    else the widest multiple of 128 that fits (at least 128). Chunks are processed one after the other per expert
    segment; the F-contractions (y, dx, d_affinity) accumulate their partial sums across chunks
    (docs/nki_kernels.md)."""
    if _resident_bytes(D, F, itemsize, n_mats) <= RESIDENT_WEIGHT_BYTES or F <= P:
        return F
    FC = P
    for n in range(2, F // P + 1):
        if _resident_bytes(D, n * P, itemsize, n_mats) <= RESIDENT_WEIGHT_BYTES:
            FC = n * P
    return FC


def token_tiles(T, lnc):
    """(nT, TT): the combine's token tiles and tokens per tile, TT = min(T, 128), nT a multiple of the LNC (the same
    trip count on every core; the host drops the padded tokens' rows)."""
    TT = min(T, P)
    return _ntiles(T, TT * lnc) * lnc, TT


def assignment_rows(T, K, NS, lnc):
    """The rows of the kernels' token-major scratch (`y_rows`, `dx_rows`; `row_of_slot` says which slot writes
    which): row t * K + k for assignment (t, k) of every token tile (nT * TT * K rows, the padded tokens' rows
    zero-filled), then one row per padding or no-op slot (NS - T * K of them), rounded up to whole token tiles of
    TT * K rows (the combine reads tile t at `scalar_offset=t`)."""
    nT, TT = token_tiles(T, lnc)
    return _ntiles(nT * TT * K + NS - T * K, TT * K) * TT * K


def tile_slots(KB):
    """TS, the slots per resident backward tile: 128, or the whole block when blocks are smaller."""
    return min(P, KB)


def piece_widths(KB, L):
    """B of each of the L piece classes: KB, KB/2, ..., KB >> (L - 1)."""
    widths = []
    for k in range(L):
        widths.append(KB >> k)
    return widths


def _tail_widths(widths):
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
    (`autograd.tiles_per_sub`), the kernel orders a piece's work by it (`_backward_block`)."""
    return FC == F and NT // 2 >= tiles_needed(widths)


def _res_tile_bytes(D, FC, itemsize):
    """Bytes/partition of one resident tile: x and affinity * dy (D wide), dg, du and h (FC wide)."""
    return (2 * D + 3 * FC) * itemsize


def _bwd_workspace_shapes(KB, D, FC, io_dtype, slot_dtype, chunked, stage_sets=DW_SETS):
    """name -> (shape, dtype) of the backward's per-block SBUF workspace (one source for the allocation and the
    SBUF budget of `backward_layout`). Each name says what the tile holds; two are updated in place: "dh" holds
    dhT, then affinity * dhT; "out_rows" the dx rows of the piece on their way to the slot scratch."""
    dp, fp, nD, nF = min(P, D), min(P, FC), _ntiles(D, P), _ntiles(FC, P)
    feature = ((fp, nF, KB), io_dtype)  # elementwise math in the io dtype, as the torch reference does it
    shapes = {
        "dyT": ((dp, nD, KB), io_dtype),
        "g": feature, "u": feature,  # the saved gT, uT
        "dh": feature, "silu": feature, "dsilu": feature, "h": feature, "dg": feature, "du": feature,
        "h_dh": ((fp, KB), io_dtype),  # h * dh of one f-tile, summed over partitions into d_affinity
        "aff_bcast": ((fp, KB), io_dtype),  # the piece's slot weights, copied to every partition
        "d_aff": ((1, KB), F32),  # d_affinity of the piece's slots
        "d_aff_prev": ((1, KB), F32),  # F chunked: d_affinity summed over the earlier chunks
        "aff_row": ((1, KB), io_dtype),  # the piece's slot weights, one row
        "out_rows": ((P, D), slot_dtype), "ones": ((P, P), io_dtype),
        "stage": ((P, stage_sets * DW_GROUP_BANKS * MOVING_FMAX), io_dtype),  # dW bands on their way to HBM
        "dw_ids": ((1, 5), I32),  # the dW phase's table entries and prefetched expert (`_sub_segments`)
    }
    if chunked:  # F chunked: later chunks add to the partial sums already in the slot scratch
        shapes["partial"] = ((P, D), F32)
    return shapes


def _shape_bytes(shapes):
    total = 0
    for name in shapes:
        shape, dtype = shapes[name]
        n = dtype.itemsize
        for d in shape[1:]:
            n *= d
        total += n
    return total


def fit_backward(D, F, io_dtype, widths):
    """(FC, NT) of the backward, (0, 0) when nothing fits (see `backward_layout`)."""
    KB = widths[0]
    need = tiles_needed(widths)
    tails = len(_tail_widths(widths))
    chunks = [F]
    for n in range(F // P, 0, -1):
        if n * P < F:
            chunks.append(n * P)
    for FC in chunks:
        ws = _bwd_workspace_shapes(KB, D, FC, io_dtype, F32 if FC < F else io_dtype, FC < F)
        free = SBUF_BYTES - SMALL_TILES_BYTES - _resident_bytes(D, FC, io_dtype.itemsize, 3) - _shape_bytes(ws)
        NT = free // _res_tile_bytes(D, FC, io_dtype.itemsize) - tails
        if NT >= need:
            return FC, NT
    return 0, 0


def stage_sets(D, F, FC, NT, io_dtype, widths):
    """The weight-gradient phase's stage buffer sets: DW_SETS plus what the SBUF left by the resident tiles holds
    ((FC, NT) from `fit_backward`), at most DW_STAGE_BYTES per partition in all."""
    KB, it = widths[0], io_dtype.itemsize
    ws = _bwd_workspace_shapes(KB, D, FC, io_dtype, F32 if FC < F else io_dtype, FC < F)
    tiles = (NT + len(_tail_widths(widths))) * _res_tile_bytes(D, FC, it)
    left = SBUF_BYTES - SMALL_TILES_BYTES - _resident_bytes(D, FC, it, 3) - _shape_bytes(ws) - tiles
    per_set = DW_GROUP_BANKS * MOVING_FMAX * it
    return max(DW_SETS, min(DW_STAGE_BYTES // per_set, DW_SETS + left // per_set))


def backward_layout(D, F, io_dtype, widths):
    """(FC, NT) of the backward: the F chunk kept resident (F itself when it fits) and how many resident TS-slot
    tiles an expert sub-segment may fill, so that the three resident matrices of a chunk, the block workspace, the
    tail buffers and NT tiles fit SBUF_BYTES per partition (widest chunk first). The host splits experts with more
    tiles into sub-segments (`autograd.KernelPlan`).

    Raises:
        ValueError: not even the narrowest chunk fits with one sub-segment's tiles.
    """
    FC, NT = fit_backward(D, F, io_dtype, widths)
    if NT == 0:
        raise ValueError(f"the NKI MoE backward does not fit SBUF at D={D}, F={F}, {widths[0]}-slot blocks in "
                         f"{io_dtype}: use a smaller model.moe_block_size")
    return FC, NT


# -- workspace: every SBUF/PSUM tile a block needs, allocated once per kernel and reused by every block ----------------
# A compiled loop body is traced once, so every tile it allocates is one fixed buffer for the whole loop; allocating
# the working tiles up front and reusing them is what keeps the resident weights (and, backward, the resident tiles)
# plus one block inside SBUF, and the PSUM tiles inside the 8 banks.
def _psum_pool(io_dtype, banks):
    """The pieces' PSUM tiles: banks["t"] transpose staging banks, banks["acc"] accumulators (each a whole 2 KiB
    bank); `_psum` hands them out in turn. A transpose staging bank is two regions of
    1 KiB per partition (4 bf16 [128, 128] transposes side by side, `_transposes_into`): the Tensor Engine fills
    one region while the other is evicted."""
    cols = MOVING_FMAX * F32.itemsize // (2 * io_dtype.itemsize)  # io-dtype columns of half a bank
    pool = {"t": [], "acc": [], "turn": {"t": 0, "acc": 0}, "t_cols": cols}
    for _ in range(banks["t"]):
        bank = nl.ndarray((P, 2 * cols), dtype=io_dtype, buffer=nl.psum, name="psum_transpose")
        for k in range(2):
            pool["t"].append(bank[0:P, k * cols:(k + 1) * cols])
    for _ in range(banks["acc"]):
        pool["acc"].append(nl.ndarray((P, MOVING_FMAX), dtype=F32, buffer=nl.psum, name="psum_acc"))
    return pool


def _psum(ps, kind):
    """The next bank ("acc") or transpose slot ("t") in rotation. Rotation happens at trace time: a compiled loop
    body's k-th use is the same bank every iteration, and consecutive uses inside a body take turns."""
    n = ps["turn"][kind]
    ps["turn"][kind] = n + 1
    return ps[kind][n % len(ps[kind])]


def _block_tiles(KB, width, dtype, name):
    """One [sl, width] SBUF tile per 128-token sub-tile of a block (tokens on partitions)."""
    tiles = []
    for s in range(_ntiles(KB, P)):
        tiles.append(nl.ndarray((_width(KB, P, s), width), dtype=dtype, buffer=nl.sbuf, name=name))
    return tiles


def forward_layout(widths, D, F, FC, itemsize):
    """(weight sets, x per class) of the forward. Two weight sets (`_weight_sets`: the next position's expert loads
    into one while the pieces read the other) when F is one chunk and they fit SBUF_BYTES with one block's
    workspace (x tiles, xT, gT, uT, silu, hT, the y rows) and the small tiles; then x tiles per piece class (so the
    classes' first gathers can all be issued when a position starts) when those fit as well."""
    if FC < F:
        return 1, False
    KB = widths[0]
    fits = []
    for sets, classes in ((2, widths), (2, [KB]), (1, widths)):
        x_tiles = 0
        for B in classes:
            x_tiles += _ntiles(B, P)
        workspace = (x_tiles * D + _ntiles(D, P) * KB + 4 * _ntiles(F, P) * KB + D) * itemsize
        fits.append(sets * _resident_bytes(D, F, itemsize, 3) + workspace + SMALL_TILES_BYTES <= SBUF_BYTES)
    if fits[0] or fits[1]:
        return 2, fits[0]
    return 1, fits[2]


def _fwd_workspace(widths, D, FC, io_dtype, slot_dtype, chunked, per_class):
    """The forward's per-block SBUF workspace (`widths`: the piece classes, KB first). chunked: F is split (partial
    sums accumulate in the slot scratch, then fp32); "out_rows" holds the piece's y rows on their way to the slot
    scratch; "x" the token-major x tiles of each piece class (`_ws_view` picks the class's): one set per class
    (`per_class`), so the classes' first gathers can all be issued when a position starts, else
    one set all classes share (see `forward_layout`)."""
    KB = widths[0]
    dp, fp, nD, nF = min(P, D), min(P, FC), _ntiles(D, P), _ntiles(FC, P)
    x, aff = {}, {}
    shared = None if per_class else (_block_tiles(KB, D, io_dtype, "x_tok"), _block_tiles(KB, 1, F32, "aff_next"))
    for B in widths:
        x[B] = _block_tiles(B, D, io_dtype, "x_tok") if per_class else shared[0]
        aff[B] = _block_tiles(B, 1, F32, "aff_next") if per_class else shared[1]
    ws = {
        "x": x,
        "aff": aff,  # the slot weights of the piece whose rows are in "x", gathered with them
        "xT": nl.ndarray((dp, nD, KB), dtype=io_dtype, buffer=nl.sbuf, name="xT"),
        "g": nl.ndarray((fp, nF, KB), dtype=io_dtype, buffer=nl.sbuf, name="gT"),
        "u": nl.ndarray((fp, nF, KB), dtype=io_dtype, buffer=nl.sbuf, name="uT"),
        "silu": nl.ndarray((fp, nF, KB), dtype=io_dtype, buffer=nl.sbuf, name="siluT"),
        "h": nl.ndarray((fp, nF, KB), dtype=io_dtype, buffer=nl.sbuf, name="hT"),
        "out_rows": nl.ndarray((P, D), dtype=slot_dtype, buffer=nl.sbuf, name="out_rows"),
    }
    if chunked:  # F chunked: later chunks add to the partial sums already in the slot scratch
        ws["partial"] = nl.ndarray((P, D), dtype=F32, buffer=nl.sbuf, name="partial")
    return ws


def _bwd_workspace(KB, D, FC, io_dtype, slot_dtype, chunked, stage_sets):
    shapes = _bwd_workspace_shapes(KB, D, FC, io_dtype, slot_dtype, chunked, stage_sets)
    ws = {}
    for name in shapes:
        shape, dtype = shapes[name]
        ws[name] = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf, name=name)
    nisa.memset(dst=ws["ones"], value=1.0)
    return ws


def _resident(TS, NT, D, FC, io_dtype):
    """One backward buffer set: NT tiles of TS slots (tokens on partitions) of x and dy ([TS, NT, D]) and of dg, du,
    h ([TS, NT, FC]), filled by an expert's pieces, read by its weight-gradient phase. "dy" holds dy, then (scaled
    in place by the piece) affinity * dy, the operand dW_down contracts."""
    return {
        "x": nl.ndarray((TS, NT, D), dtype=io_dtype, buffer=nl.sbuf, name="x_res"),
        "dy": nl.ndarray((TS, NT, D), dtype=io_dtype, buffer=nl.sbuf, name="dy_res"),
        "dg": nl.ndarray((TS, NT, FC), dtype=io_dtype, buffer=nl.sbuf, name="dg_res"),
        "du": nl.ndarray((TS, NT, FC), dtype=io_dtype, buffer=nl.sbuf, name="du_res"),
        "h": nl.ndarray((TS, NT, FC), dtype=io_dtype, buffer=nl.sbuf, name="h_res"),
    }


PER_SLOT_3D = ("xT", "g", "u", "silu", "dsilu", "h", "dyT", "dh", "dg", "du")  # [parts, tiles, KB] feature-major
PER_SLOT_2D = ("h_dh", "aff_bcast", "d_aff", "d_aff_prev", "aff_row")  # [parts, KB]


def _ws_view(ws, B):
    """The workspace cut to a B-slot piece (B <= KB, the workspace's block): every per-slot tile sliced to B."""
    v = {}
    for key in ws:
        t = ws[key]
        if isinstance(t, dict):  # one set of token-major sub-tiles per piece class
            t = t[B]
        if isinstance(t, list):  # token-major sub-tiles
            tiles = []
            for s in range(_ntiles(B, P)):
                tiles.append(t[s][0:_width(B, P, s), 0:t[s].shape[1]])
            v[key] = tiles
        elif key in PER_SLOT_3D:
            v[key] = t[0:t.shape[0], 0:t.shape[1], 0:B]
        elif key in PER_SLOT_2D:
            v[key] = t[0:t.shape[0], 0:B]
        else:
            v[key] = t
    return v


def _tok(tiles, tile, s, parts, c0, cols):
    """[parts, cols] at columns c0.. of token sub-tile s of a block: a workspace tile (`tiles` a list) or a resident
    tile of a buffer [TS, NT, width]: tile (tile + s), `tile` an int32 SBUF [1, 1] tile or loop register holding the
    runtime tile index, or None (tile s)."""
    if isinstance(tiles, list):
        return tiles[s][0:parts, c0:c0 + cols]
    if tile is None:
        return tiles[0:parts, s, c0:c0 + cols]
    NT, width = tiles.shape[1], tiles.shape[2]
    return tiles.ap(pattern=[[NT * width, parts], [1, cols]], offset=s * width + c0, scalar_offset=tile,
                    indirect_dim=1)


# -- layout changes (Tensor Engine transposes through PSUM) ------------------------------------------------------------
def _transposes_into(dst, srcs, ps):
    """dst <- the transposes of `srcs` (SBUF [p_i, f] each) side by side, [f, sum p_i] (dst: any SBUF view with f
    partitions and that many elements each, in that order): staged in one PSUM transpose region (`_psum_pool`) and
    evicted by one copy, so the eviction's fixed cost is paid once per region, not per transpose; the Vector Engine
    evicts the even regions of the rotation, the Scalar Engine the odd ones."""
    f = srcs[0].shape[1]
    engine = nisa.engine.vector if ps["turn"]["t"] % 2 == 0 else nisa.engine.scalar
    region = _psum(ps, "t")
    c = 0
    for src in srcs:
        p = src.shape[0]
        nisa.nc_transpose(dst=region[0:f, c:c + p], data=src)
        c += p
    nisa.tensor_copy(dst=dst, src=region[0:f, 0:c], engine=engine)


def _batches(n_full, rem, per):
    """(first, count) runs of at most `per` consecutive 128-wide tiles out of n_full whole ones, then (n_full, 1) for
    a partial last tile (`rem` > 0)."""
    runs = []
    for j0 in range(0, n_full, per):
        runs.append((j0, min(per, n_full - j0)))
    if rem > 0:
        runs.append((n_full, 1))
    return runs


def _feature_major(out, tok, tile, B, width, ps):
    """out [min(P, width), n_tiles, B] <- the block's token-major tiles (`_tok`), features on partitions; the
    transposes of one 128-slot sub-tile go side by side in a PSUM region, several feature tiles per eviction."""
    for s in range(_ntiles(B, P)):
        sl = _width(B, P, s)
        for run in _batches(width // P, width % P, ps["t_cols"] // sl):
            j0, n = run
            fl = _width(width, P, j0)
            srcs = []
            for j in range(j0, j0 + n):
                srcs.append(_tok(tok, tile, s, sl, j * P, fl))
            _transposes_into(out[0:fl, j0:j0 + n, s * P:s * P + sl], srcs, ps)


def _token_major(tok, tile, feature, B, width, ps):
    """Inverse of `_feature_major`: fill the block's token-major tiles from a feature-major one (consecutive feature
    tiles are consecutive columns of a token-major tile: one eviction per PSUM region)."""
    for s in range(_ntiles(B, P)):
        sl = _width(B, P, s)
        for run in _batches(width // P, width % P, ps["t_cols"] // P):
            j0, n = run
            cols = min(width, (j0 + n) * P) - j0 * P
            srcs = []
            for j in range(j0, j0 + n):
                srcs.append(feature[0:_width(width, P, j), j, s * P:s * P + sl])
            _transposes_into(_tok(tok, tile, s, sl, j0 * P, cols), srcs, ps)


# -- expert MLP pieces -------------------------------------------------------------------------------------------------
def _gather_into(dst, src, index):
    """dst [rows, C] with row i = src[index[i], :] (indirect DMA; `index` an int32 SBUF [rows, 1] tile)."""
    rows, cols = dst.shape[0], src.shape[1]
    nisa.dma_copy(dst=dst, src=src.ap(pattern=[[cols, rows], [1, cols]], offset=0, vector_offset=index,
                                      indirect_dim=0))


def _load_block(dsts, tile, srcs, token_index, grp, B):
    """Gather the block's rows of each [T+1, D] HBM tensor in `srcs` into its token-major tiles in `dsts` (see
    `_tok`; padding slots read the zero row T)."""
    for s in range(_ntiles(B, P)):
        sl = _width(B, P, s)
        index = _block_column(token_index, grp, s * P, sl, I32)
        for i in range(len(srcs)):
            _gather_into(_tok(dsts[i], tile, s, sl, 0, srcs[i].shape[1]), srcs[i], index)


def _affinities(slot_weight, grp, B, into=None):
    """The slot weights of a piece (slot group grp), one fp32 [sl, 1] column per 128-slot sub-tile: into the tiles
    `into` (a list), else new ones."""
    out = []
    for s in range(_ntiles(B, P)):
        sl = _width(B, P, s)
        out.append(_block_column(slot_weight, grp, s * P, sl, F32, None if into is None else into[s][0:sl, 0:1]))
    return out


def _project(out, w_res, xT, B, D, n_out, ps, swiglu=None):
    """out ([min(P, n_out), n_tiles, B]) = (x @ W^T)^T; w_res: resident W^T tiles [min(P, D), nD, n_out] (or an
    InSet of them). Evicted from PSUM by the Scalar Engine (the Vector Engine has the elementwise math)."""
    for i in range(_ntiles(n_out, P)):
        fl = _width(n_out, P, i)
        acc = _psum(ps, "acc")[0:fl, 0:B]
        for j in range(_ntiles(D, P)):
            dl = _width(D, P, j)
            nisa.nc_matmul(dst=acc, stationary=_matrix(w_res, dl, j, i * P, fl), moving=xT[0:dl, j, 0:B],
                           accumulate=j > 0)
        nisa.tensor_copy(dst=out[0:fl, i, 0:B], src=acc, engine=nisa.engine.scalar)
        if swiglu is not None:  # the SwiGLU of f-tile i right after its eviction, while the PE projects tile i + 1
            _swiglu_tile(swiglu, i, fl, B)


def _swiglu(ws, FC, B):
    """silu = silu(g) (Scalar Engine), hT = silu * u; backward (ws has "dsilu") also silu'(g). All in the io dtype,
    as the torch reference computes them (bf16 operands give the Vector Engine its performance mode)."""
    for i in range(_ntiles(FC, P)):
        _swiglu_tile(ws, i, _width(FC, P, i), B)


def _swiglu_tile(ws, i, fl, B):
    """`_swiglu` of f-tile i (fl features)."""
    g, silu = ws["g"][0:fl, i, 0:B], ws["silu"][0:fl, i, 0:B]
    nisa.activation(dst=silu, op=nl.silu, data=g)
    if "dsilu" in ws:
        nisa.activation(dst=ws["dsilu"][0:fl, i, 0:B], op=nl.silu_dx, data=g)
    nisa.tensor_tensor(dst=ws["h"][0:fl, i, 0:B], data1=silu, data2=ws["u"][0:fl, i, 0:B], op=nl.multiply)


def _saved_columns(saved, f0, fl, row0, B):
    """HBM view saved[f0 : f0 + fl, row0 : row0 + B] of an [F, NS] tensor (row0 an int32 SBUF [1, 1] tile)."""
    NS = saved.shape[1]
    return saved.ap(pattern=[[NS, fl], [1, B]], offset=f0 * NS, scalar_offset=row0, indirect_dim=1)


def _saved_tiles(saved, tiles, f0, FC, row0, B):
    """[(HBM view, tile view)] pairs covering saved[f0 : f0 + FC, row0 : row0 + B] of an [F, NS] tensor and the
    feature-major tile [min(P, FC), FC/128, B]: one pair for all whole 128-row tiles, one for a remainder."""
    NS = saved.shape[1]
    fp = min(P, FC)
    nfull = FC // fp
    if nfull > 1:
        pairs = [(saved.ap(pattern=[[NS, fp], [fp * NS, nfull], [1, B]], offset=f0 * NS, scalar_offset=row0,
                           indirect_dim=1), tiles[0:fp, 0:nfull, 0:B])]
    else:
        pairs = [(_saved_columns(saved, f0, fp, row0, B), tiles[0:fp, 0, 0:B])]
    rem = FC - nfull * fp
    if rem > 0:
        pairs.append((_saved_columns(saved, f0 + nfull * fp, rem, row0, B), tiles[0:rem, nfull, 0:B]))
    return pairs


def _save_feature_major(saved, tiles, f0, FC, row0, B):
    """saved[f0 : f0 + FC, slots of the piece] <- feature-major tiles [min(P, FC), FC/128, B]."""
    for pair in _saved_tiles(saved, tiles, f0, FC, row0, B):
        nisa.dma_copy(dst=pair[0], src=pair[1])


def _load_feature_major(tiles, saved, f0, FC, row0, B):
    """Inverse of `_save_feature_major`."""
    for pair in _saved_tiles(saved, tiles, f0, FC, row0, B):
        nisa.dma_copy(dst=pair[1], src=pair[0])


def _combine(out, rows, K, pid, lnc):
    """out[t] = sum_k rows[t * K + k]: per token tile, K loads of its tokens' k-th rows (the pieces scattered them
    token-major: `_write_rows`), each one hardware-DGE DMA of TT rows at stride K rows (an indirect gather would
    have GpSimd generate a descriptor per row, ~2.3 us per 128 rows against ~1.4 us of HBM), summed in fp32 PSUM
    by the Tensor Engine (identity^T @ rows accumulates each token's K rows in order, as K fp32 adds would; the
    Vector Engine's fp32 adds took ~4 us per [128, 2048] row block, ~1 ms of each kernel at 30B-A3B). One caveat
    of the matmul: an inf in a loaded row meets the identity's zeros, so its whole column of the tile becomes NaN
    instead of one token's inf (either way the step has overflowed).

    Token tiles are split across the cores, the same number per core (`token_tiles`: one trip count for both
    cores); `out` is [nT, TT, D] (tile t at `scalar_offset=t`).

    Dimensions:
        nT, TT, K: token tiles, tokens per tile, experts per token;
        D: hidden size (D <= 8 PSUM banks of 512 columns); the scratch `rows` has `assignment_rows` rows, whole
        tiles of TT * K.
    """
    nT, TT = out.shape[0], out.shape[1]
    n_rows, D = rows.shape
    nc = _ntiles(D, MOVING_FMAX)
    check_argument(nc <= 8, "rows", f"the combine sums a token tile's {D} columns in 8 PSUM banks of "
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
    for _ in range(nc):
        sums.append(nl.ndarray((TT, MOVING_FMAX), dtype=F32, buffer=nl.psum, name="psum_combine"))
    result = nl.ndarray((TT, D), dtype=out.dtype, buffer=nl.sbuf, name="combined")

    def token_tile(t):
        for k in range(K):
            part = parts[k % 2]
            nisa.dma_copy(dst=part, src=tiles.ap(pattern=[[K * D, TT], [1, D]], offset=k * D, scalar_offset=t,
                                                 indirect_dim=0))
            for c in range(nc):
                c0, cl = c * MOVING_FMAX, _width(D, MOVING_FMAX, c)
                nisa.nc_matmul(dst=sums[c][0:TT, 0:cl], stationary=ident, moving=part[0:TT, c0:c0 + cl],
                               accumulate=k > 0)
        for c in range(nc):
            c0, cl = c * MOVING_FMAX, _width(D, MOVING_FMAX, c)
            engine = nisa.engine.scalar if c % 2 == 0 else nisa.engine.vector
            nisa.tensor_copy(dst=result[0:TT, c0:c0 + cl], src=sums[c][0:TT, 0:cl], engine=engine)
        nisa.dma_copy(dst=out.ap(pattern=[[D, TT], [1, D]], offset=0, scalar_offset=t, indirect_dim=0), src=result)

    nl.fori_loop(pid * per, (pid + 1) * per, token_tile)


def _zero_padded_tokens(rows, T, K, pid, lnc):
    """Zero the scratch rows of the combine's padded tokens, [T * K, nT * TT * K) (no piece writes them; the
    combine reads them), before the combine's barrier: none when the tokens fill whole tiles."""
    nT, TT = token_tiles(T, lnc)
    if nT * TT > T:
        zeros = nl.ndarray((P, rows.shape[1]), dtype=rows.dtype, buffer=nl.sbuf)
        nisa.memset(dst=zeros, value=0.0)
        _zero_rows(rows, zeros, pid, lnc, T * K, nT * TT * K)


def _count(count):
    """A [1, 1] int32 HBM count (segment positions, rows to zero-fill: the same on every core) as a register."""
    tile = nl.ndarray((1, 1), dtype=I32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=count[0:1, 0:1])
    return _register(tile)


def _listed(table, count, pid, body):
    """Compiled loop over the first `count` entries of this core's part of a per-core [LNC * n, 1] int32 table
    (`zero_rows`: n = Z): body(entry as an int32 SBUF [1, 1] tile)."""
    n = table.shape[0] // nl.num_programs(0)

    def each(i):
        body(_load_entry(table, pid * n, 0, i))

    nl.fori_loop(0, _count(count), each)


def _evict_rows(ws, acc, scale, sl, c0, cl):
    """ws["out_rows"][0:sl, c0:c0 + cl] = acc * scale (scale None: acc), evicted from PSUM by the Scalar Engine."""
    rows = ws["out_rows"][0:sl, c0:c0 + cl]
    if scale is None:
        nisa.tensor_copy(dst=rows, src=acc, engine=nisa.engine.scalar)
    else:
        nisa.tensor_scalar(dst=rows, data=acc, op0=nl.multiply, operand0=scale, engine=nisa.engine.scalar)


def _write_rows(dest, ws, s0, sl, first):
    """The scratch rows of the piece's slots [s0, s0 + sl) <- ws["out_rows"][0:sl, :], scattered token-major in one
    DMA (`dest` (scratch, row_of_slot, grp): each slot's row t * K + k, so the combine reads a token tile's rows
    contiguously) for the first F chunk; later chunks add to the partial sums (read-modify-write of the fp32
    scratch; the rows belong to this core's piece)."""
    scratch, row_of_slot, grp = dest
    D = scratch.shape[1]
    where = _block_column(row_of_slot, grp, s0, sl, I32)
    window = scratch.ap(pattern=[[D, sl], [1, D]], offset=0, vector_offset=where, indirect_dim=0)
    rows = ws["out_rows"][0:sl, 0:D]
    if not first:
        partial = ws["partial"][0:sl, 0:D]
        nisa.dma_copy(dst=partial, src=window)
        nisa.tensor_tensor(dst=rows, data1=rows, data2=partial, op=nl.add)
    nisa.dma_copy(dst=window, src=rows)


def _piece_classes(token_index, seg_table, first_class_col):
    """B of each piece class: KB, KB/2, ..., G (G = token_index.shape[1], one class per column pair of seg_table
    from `first_class_col` on)."""
    L = (seg_table.shape[1] - first_class_col) // 2
    return piece_widths(token_index.shape[1] * 2 ** (L - 1), L)


# -- forward -----------------------------------------------------------------------------------------------------------
def _forward_weights(hbm_w, e, f0, FC, into=None):
    """The F chunk [f0, f0 + FC) of expert e, resident for the forward: gate and up F on columns ([min(P, D),
    D/128, FC] of W^T: the stationary of gT, uT = W @ xT), down F on rows ([min(P, FC), FC/128, D] of W_down^T: the
    moving of y = h @ W_down^T). `hbm_w`: the forward's transposed [E, D, F], [E, D, F], [E, F, D] arguments;
    `into`: ExpertWeights of InSets to load into (the weight double buffer), else new tiles."""
    into = into or ExpertWeights(None, None, None)
    return ExpertWeights(gate=_f_columns(hbm_w.gate, e, f0, FC, into.gate), up=_f_columns(hbm_w.up, e, f0, FC, into.up),
                         down=_f_rows(hbm_w.down, e, f0, FC, into.down))


def _weight_sets(D, F, dtype):
    """The forward's weight double buffer: gate, up [min(P, D), 2, D/128 * F] and down [min(P, F), 2, F/128 * D]
    tiles (two experts' whole matrices each; `_in_set` picks one)."""
    gate = nl.ndarray((min(P, D), 2, _ntiles(D, P) * F), dtype=dtype, buffer=nl.sbuf, name="w_gate_sets")
    up = nl.ndarray((min(P, D), 2, _ntiles(D, P) * F), dtype=dtype, buffer=nl.sbuf, name="w_up_sets")
    down = nl.ndarray((min(P, F), 2, _ntiles(F, P) * D), dtype=dtype, buffer=nl.sbuf, name="w_down_sets")
    return ExpertWeights(gate, up, down)


def _in_set(sets, pick, D, F):
    """The weight set `pick` (an int32 SBUF [1, 1] tile) of `_weight_sets`, as InSets."""
    return ExpertWeights(gate=InSet(sets.gate, pick, F), up=InSet(sets.up, pick, F), down=InSet(sets.down, pick, D))


def _forward_block(grp, row0, nxt, hbm, w, ws, ps, B, f0, first):
    """One B-slot piece starting at slot row0 (= grp * G; grp indexes the [NG, G] slot tables) against one F chunk
    [f0, f0 + FC) (w: that chunk of the expert's weights, resident as `_forward_weights` lays them out). Its x rows
    are in ws["x"] already (gathered by the previous piece, or by the loop's prologue); once its transposes have
    read them, it gathers the next piece's (slot group `nxt`) into ws["x"], so that gather overlaps this piece's
    matmuls instead of opening the next piece.

    Dimensions:
        B: the piece's slots; D: hidden size; FC: the chunk's width (w.gate [min(P, D), D/128, FC]).
    """
    D, FC = hbm["x"].shape[1], _columns(w.gate)
    affinity = []  # its slot weights, gathered with its x rows: copied out before the next piece's overwrite them
    for s in range(_ntiles(B, P)):
        affinity.append(nl.ndarray((_width(B, P, s), 1), dtype=F32, buffer=nl.sbuf))
        nisa.tensor_copy(dst=affinity[s], src=ws["aff"][s], engine=nisa.engine.vector)
    _feature_major(ws["xT"], ws["x"], None, B, D, ps)
    _load_block([ws["x"]], None, [hbm["x"]], hbm["index"], nxt, B)  # the next piece's rows (software pipeline)
    _affinities(hbm["weight"], nxt, B, ws["aff"])
    _project(ws["g"], w.gate, ws["xT"], B, D, FC, ps)
    _project(ws["u"], w.up, ws["xT"], B, D, FC, ps, ws)  # with the SwiGLU of each f-tile
    _save_feature_major(hbm["g_saved"], ws["g"], f0, FC, row0, B)  # for the backward: no recompute there
    _save_feature_major(hbm["u_saved"], ws["u"], f0, FC, row0, B)
    if B < P:  # a narrow piece: the weights stationary, B moving columns
        _down_narrow(ws, w.down, affinity[0], B, D, FC, ps)
        _write_rows((hbm["rows"], hbm["row_of_slot"], grp), ws, 0, B, first)
        return
    for s in range(len(ws["x"])):
        sl = _width(B, P, s)
        for c in range(_ntiles(D, MOVING_FMAX)):
            c0, cl = c * MOVING_FMAX, _width(D, MOVING_FMAX, c)
            acc = _psum(ps, "acc")[0:sl, 0:cl]
            for i in range(_ntiles(FC, P)):
                fl = _width(FC, P, i)
                nisa.nc_matmul(dst=acc, stationary=ws["h"][0:fl, i, s * P:s * P + sl],
                               moving=_matrix(w.down, fl, i, c0, cl), accumulate=i > 0)
            _evict_rows(ws, acc, affinity[s], sl, c0, cl)
        _write_rows((hbm["rows"], hbm["row_of_slot"], grp), ws, s * P, sl, first)


def _narrow_batches(D, B):
    """(first, count) runs of D's 128-row tiles whose [<=128, B] fp32 results share one PSUM bank (a piece of B < 128
    slots with the weights stationary: `_down_narrow`, `_dx_tile`)."""
    return _batches(D // P, D % P, MOVING_FMAX // B)


def _down_narrow(ws, w_down, affinity, B, D, FC, ps):
    """ws["out_rows"][0:B, 0:D] = affinity * (h @ W_down^T) for a piece of B < 128 slots. With hT as the stationary
    (as the 128-slot pieces run it) only B of the Tensor Engine's 128 columns would work, for 512 moving columns
    per matmul; here the weights are stationary ([128, 128] tiles of W_down^T) and hT moves (B columns, at least
    the 64-cycle minimum): yT [D, B], a D tile per region of an accumulator bank, evicted into ws["xT"] (dead after
    the gate and up projections), then transposed back to token-major and scaled by the slots' affinity.

    Dimensions:
        B: the piece's slots (< 128); D: hidden size; FC: the chunk's width (ws["h"] [min(P, FC), FC/128, B]).
    """
    for run in _narrow_batches(D, B):
        j0, n = run
        dl = _width(D, P, j0)
        bank = _psum(ps, "acc")
        for k in range(n):
            for i in range(_ntiles(FC, P)):
                fl = _width(FC, P, i)
                nisa.nc_matmul(dst=bank[0:dl, k * B:(k + 1) * B], stationary=_matrix(w_down, fl, i, (j0 + k) * P, dl),
                               moving=ws["h"][0:fl, i, 0:B], accumulate=i > 0)
        nisa.tensor_copy(dst=ws["xT"][0:dl, j0:j0 + n, 0:B], src=bank[0:dl, 0:n * B], engine=nisa.engine.scalar)
    _token_major([ws["out_rows"]], None, ws["xT"], B, D, ps)
    rows = ws["out_rows"][0:B, 0:D]
    nisa.tensor_scalar(dst=rows, data=rows, op0=nl.multiply, operand0=affinity)


def _pieces(piece, begin, end, hbm, w, ws, res, indexed, ps, B, f0, first, fetch=None, ahead=None, halves=False,
            tails=(), down=None):
    """Rows [begin, end) of `piece` (registers), all of one class of B slots, against the resident F chunk `w` of
    the segment's expert: a compiled loop whose body (one B-slot piece) is traced once. `res` None: the forward
    block; else the backward's buffer set for this class (`indexed`: the main tiles, at the tile index in column 2
    of `piece`; else a tail class's one-tile buffer). `ahead`: rows begin, begin + 1, already loaded (else loaded
    here). `halves`: the backward's sub-segments alternate tile halves (`_backward_block`). `fetch`: the forward's
    share of the next position's weights (`_fetch_matrices`). `down`: the backward's next down matrix ((dst, src)
    DMA pairs, loaded by the piece whose column PIECE_DOWN is 1: `_backward_block`). `tails`: the backward's tail
    buffers and their widths, (buffer, B) in class order, whose rows a main-tile piece gathers where its row says so
    (from PIECE_TAILS on)."""

    C = piece.shape[1]
    # the table rows, software-pipelined: each piece copies its rows (its own and the next one's, whose x / dy rows
    # it gathers) from `ahead` and loads the next piece's into it, so a piece starts without a DMA of its own rows
    # behind the previous piece's transfers (`rows` is read as a runtime offset until the piece's last DMA). Both
    # kernels copy on the Scalar Engine: GpSimd's in-order queue holds the previous piece's row scatter (software
    # DGE), which waits for that piece's last eviction (at full scale: forward 3.17 ms, 3.18 on Vector, 3.34 on
    # GpSimd; backward, since its tail pieces' rows are gathered ahead, 6.436 ms, 6.439 on Vector, 6.466 on GpSimd)
    if ahead is None:
        ahead = _row(piece, 0, begin, 2)

    def body(j):
        rows = _take_ahead(ahead, piece, 2, 1, j, engine=nisa.engine.scalar)  # then rows j + 1, j + 2 (2 padding rows)
        grp, row0 = rows[0:1, 0:1], rows[0:1, 1:2]
        if res is None:
            if fetch is not None:  # the forward's share of the next position's weight loads (columns 5-7)
                _fetch_matrices(rows, fetch)
            _forward_block(grp, row0, rows[0:1, C:C + 1], hbm, w, ws, ps, B, f0, first)
        else:
            load_down = None if down is None else (down, _register(rows[0:1, PIECE_DOWN:PIECE_DOWN + 1]))
            tile, gathers = None, None
            if indexed:  # the own / next flags (columns 3, 4) and the next row's slot group and tile
                tile = rows[0:1, 2:3]
                tail_gathers = []
                for t in range(len(tails)):
                    col = PIECE_TAILS + 2 * t
                    tail_gathers.append((_register(rows[0:1, col:col + 1]), rows[0:1, col + 1:col + 2]) + tails[t])
                gathers = (_register(rows[0:1, 3:4]), _register(rows[0:1, 4:5]), rows[0:1, C:C + 1],
                           rows[0:1, C + 2:C + 3], tail_gathers)
            _backward_block(grp, row0, tile, gathers, hbm, w, ws, res, ps, B, f0, first, halves, load_down)

    nl.fori_loop(begin, end, body)


def _fetch_matrices(rows, fetch):
    """The forward piece's share of the next position's weights: per matrix (gate, up, down: `piece` columns 5, 6,
    7 of the piece's row in `rows`, 0 or 1), that matrix of expert `fetch[1]` from the HBM weights `fetch[0]` into
    the weight set `fetch[2]` (InSets of `_weight_sets`)."""
    hbm_w, e, into = fetch
    for m in range(3):
        _copy_times(_whole_matrix_copies(hbm_w[m], e, into[m], None), _register(rows[0:1, 5 + m:6 + m]))


def _forward_segments(pid, S, hbm, piece, seg_table, seg_count, hbm_w):
    """This core's expert segments (its own function so the workspace is freed before the combine). Per segment
    position (one expert) and F chunk: load the chunk of the expert's weights once (resident, reused by every piece
    of the segment), then run the segment's full KB blocks and its tail's KB/2, ..., G pieces (0 or 1 each, plus
    the position's no-op pieces), each class a compiled loop over its rows of `piece`."""
    x_pad = hbm["x"]
    D, F = x_pad.shape[1], hbm_w.gate.shape[2]
    widths = _piece_classes(hbm["index"], seg_table, SEG_HEAD)
    FC = f_chunk(D, F, x_pad.dtype.itemsize, 3)
    sets, per_class = forward_layout(widths, D, F, FC, x_pad.dtype.itemsize)
    ws = _fwd_workspace(widths, D, FC, x_pad.dtype, hbm["rows"].dtype, FC < F, per_class)
    ps = _psum_pool(x_pad.dtype, PSUM_BANKS)
    double = None
    # the seg_table rows run ahead: position 0's here, each later one's loaded when the position before it starts
    # (loaded at its own start, behind the previous position's weight loads, it would hold up its first piece)
    head = nl.ndarray((1, SEG_HEAD + 2 * len(widths)), dtype=I32, buffer=nl.sbuf)
    nisa.dma_copy(dst=head, src=seg_table[pid * S:pid * S + 1, 0:SEG_HEAD + 2 * len(widths)])
    if per_class:
        # each class's first piece of position 0 into the class's own x tiles. From then on a class loop's last
        # piece gathers row `end` of its loop, which is the class's first piece at the core's next position (rows
        # are grouped by class, core, position), and a class that runs no piece leaves those rows in place: so
        # each position finds its first pieces' rows gathered
        for k in range(len(widths)):
            col = SEG_HEAD + 2 * k
            _first_rows(piece, _register(head[0:1, col:col + 1]), hbm, ws, widths[k])
    if sets == 2:  # position 0's weights into its set here; each position loads the next one's into the other set
        double = _weight_sets(D, F, x_pad.dtype)
        _forward_weights(hbm_w, head[0:1, 0:1], 0, F, _in_set(double, head[0:1, 4:5], D, F))

    def segment(s):
        row = _take_ahead(head, seg_table, col=6, engine=nisa.engine.scalar)  # then the next position's (Scalar:
        # GpSimd's queue holds the last piece's row scatter, and the position's weight set is picked by this row)
        bounds = []
        for k in range(len(widths)):
            col = SEG_HEAD + 2 * k
            bounds.append((_register(row[0:1, col:col + 1]), _register(row[0:1, col + 1:col + 2])))
        for c in range(_ntiles(F, FC)):  # one chunk (all of F) unless the matrices do not fit SBUF
            f0 = c * FC
            fetch = None
            if double is None:
                w = _forward_weights(hbm_w, row[0:1, 0:1], f0, _width(F, FC, c))
            else:  # this position's weights were loaded by the previous one; its pieces load the next one's
                w = _in_set(double, row[0:1, 4:5], D, F)
                fetch = (hbm_w, row[0:1, 3:4], _in_set(double, row[0:1, 5:6], D, F))
            for k in range(len(widths)):  # full KB blocks, then the tail's KB/2, ..., G pieces (0 or 1 each)
                if not per_class:  # one set of x tiles for all classes: each class's first rows before its loop
                    _first_rows(piece, bounds[k][0], hbm, ws, widths[k])
                _pieces(piece, bounds[k][0], bounds[k][1], hbm, w, _ws_view(ws, widths[k]), None, False, ps,
                        widths[k], f0, c == 0, fetch)
            w = None  # the chunk's weights are dead: the next chunk's take their SBUF

    nl.fori_loop(0, _count(seg_count), segment)


def _first_rows(piece, begin, hbm, ws, B):
    """The forward's software-pipeline prologue of one class loop (with x tiles per class: of the core's first
    position only): the rows of its first piece (`piece` row `begin`) into the class's x tiles; each piece then
    gathers the next one's. A class that runs no piece reads a valid row all the same (row `begin` exists: another
    class's, position's or core's, or the padding row)."""
    grp = _load_entry(piece, 0, 0, begin)
    _load_block([ws["x"][B]], None, [hbm["x"]], hbm["index"], grp, B)
    _affinities(hbm["weight"], grp, B, ws["aff"][B])


def _zero_saved(saved, first, pid, lnc):
    """Zero slot columns [first, NS) of every [F, NS] tensor of `saved`, each core a contiguous share, in DMAs of
    up to MOVING_FMAX columns covering all whole 128-row tiles of F: the slot groups a piece may not compute (the
    kernel returns these tensors, so every element gets written). `first`: the slots of the ceil(T * K / G) groups
    that every routing fills (each of the T * K assignments has its own slot), so the columns are known when the
    kernel is traced, whatever the routing; the pieces then overwrite the ones they compute, after a core barrier
    (the other core's pieces may compute columns of this core's share)."""
    F, NS = saved[0].shape
    fp, nfull = min(P, F), F // min(P, F)
    rem = F - nfull * fp
    per = _ntiles(NS - first, lnc)
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


# -- entry checks ------------------------------------------------------------------------------------------------------
def _expect(t, name, dims, shape, dtype):
    """Entry check of one kernel argument: its dtype and shape (`shape`: one size per dim, None where any size goes;
    `dims` the shape in this file's letters, for the message)."""
    ok = t.dtype == dtype and len(t.shape) == len(shape)
    if ok:
        for i in range(len(shape)):
            ok = ok and (shape[i] is None or t.shape[i] == shape[i])
    check_argument(ok, name, f"{name} must be {dims} {dtype}, got {tuple(t.shape)} {t.dtype}: pass the tables of "
                   "autograd.KernelPlan and the weights in the layouts the kernel's docstring gives")


def _expect_plan(token_index, slot_weight, piece, seg_table, seg_count, row_of_slot, top_k, T, lnc):
    """Entry checks of the host tables both kernels take (`autograd.KernelPlan`); returns L, the piece classes."""
    _expect(token_index, "token_index", "[NG, G]", (None, None), I32)
    _expect(slot_weight, "slot_weight", "[NG, G] (token_index's shape)", token_index.shape, F32)
    _expect(piece, "piece", f"[M, {PIECE_COLS}]", (None, PIECE_COLS), I32)
    _expect(seg_table, "seg_table", "[LNC * S, 7 + 2L]", (None, None), I32)
    L = (seg_table.shape[1] - SEG_HEAD) // 2
    check_argument(L >= 1 and seg_table.shape[1] == SEG_HEAD + 2 * L and seg_table.shape[0] % lnc == 0, "seg_table",
                   f"seg_table must be [LNC * S, 7 + 2L] with L >= 1 at LNC {lnc}, got {tuple(seg_table.shape)}")
    _expect(seg_count, "seg_count", "[1, 1]", (1, 1), I32)
    _expect(row_of_slot, "row_of_slot", "[NG, G] (token_index's shape)", token_index.shape, I32)
    NS = token_index.shape[0] * token_index.shape[1]
    check_argument(isinstance(top_k, int) and 1 <= top_k and T * top_k <= NS, "top_k",
                   f"top_k must be an int K >= 1 with T * K <= NS ({T} tokens, {NS} slots), got {top_k!r}")
    return L


def _expect_per_core(rows, count, names, lnc):
    """Entry checks of a per-core list (`zero_rows` [LNC * n, 1]) and its [1, 1] count, `names`."""
    _expect(rows, names[0], "[LNC * n, 1]", (None, 1), I32)
    check_argument(rows.shape[0] % lnc == 0, names[0],
                   f"{names[0]} must be [LNC * n, 1] at LNC {lnc}, got {tuple(rows.shape)}")
    _expect(count, names[1], "[1, 1]", (1, 1), I32)


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
        piece: [M + 2, 13] int32, per piece its first slot group, first slot row (group * G) and, for the
            backward, its first resident tile, own (1: the first piece of a main-tile class loop, which gathers its
            own rows) and next (1: the next row is in the same loop, whose rows the piece gathers); for the forward,
            gate, up, down (1: the piece loads that matrix of the next position's expert into the other weight
            set); for the backward, down (1: the position's last piece, which loads the next expert's down matrix
            after its dh projection) and per tail buffer a flag and a slot group (1: the sub-segment's last
            main-tile piece, which gathers that tail piece's rows); rows grouped by class; the last two rows
            padding rows (any valid piece: the forward gathers row j + 1's rows while it computes row j, and each
            piece loads rows j + 1, j + 2 ahead: `_pieces`).
        seg_table: [LNC * S, 7 + 2L] int32; core c's segment position s at row c * S + s: its expert, its
            [begin, end) rows of the backward's `sub_table`, the expert of the core's next position (its own at the
            last: whose weights both kernels prefetch), the position's weight set (s % 2) and the next one's (the
            forward's double buffer), the row of the core's next position (c * S + min(s + 1, S - 1): each
            position loads the next one's row ahead), then per piece class k (KB >> k slots) the [begin, end) rows
            of `piece` (the same count on every core).
        seg_count: [1, 1] int32, segment positions run (the same on every core).
        row_of_slot: [NG, G] int32, the row of the token-major scratch each slot's output goes to: t * K + k for
            the slot of assignment (t, k), a row of its own past the token tiles' rows for a padding or no-op slot
            (`assignment_rows`; every row at most once).
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
    _expect(x_pad, "x_pad", "[T+1, D]", (None, None), x_pad.dtype)
    io, D = x_pad.dtype, x_pad.shape[1]
    T = x_pad.shape[0] - 1
    _expect_plan(token_index, slot_weight, piece, seg_table, seg_count, row_of_slot, top_k, T, lnc)
    _expect(w_gate_t, "w_gate_t", "[E, D, F] (D of x_pad, io dtype)", (None, D, None), io)
    E, F = w_gate_t.shape[0], w_gate_t.shape[2]
    _expect(w_up_t, "w_up_t", "[E, D, F] (w_gate_t's shape)", (E, D, F), io)
    _expect(w_down_t, "w_down_t", "[E, F, D]", (E, F, D), io)
    ng, G = token_index.shape
    S = seg_table.shape[0] // lnc
    nT, TT = token_tiles(T, lnc)
    chunked = f_chunk(D, F, io.itemsize, 3) < F
    y_rows = nl.ndarray((assignment_rows(T, top_k, ng * G, lnc), D), dtype=F32 if chunked else io,
                        buffer=nl.shared_hbm, name="y_rows")
    g_saved = nl.ndarray((F, ng * G), dtype=io, buffer=nl.shared_hbm, name="g_saved")
    u_saved = nl.ndarray((F, ng * G), dtype=io, buffer=nl.shared_hbm, name="u_saved")
    hbm = {"x": x_pad, "index": token_index, "weight": slot_weight, "rows": y_rows, "row_of_slot": row_of_slot,
           "g_saved": g_saved, "u_saved": u_saved}
    _zero_saved((g_saved, u_saved), G * _ntiles(T * top_k, G), pid, lnc)
    if lnc > 1:
        nisa.core_barrier(data=g_saved, cores=(0, 1))  # the zeros land before any piece's columns
    _forward_segments(pid, S, hbm, piece, seg_table, seg_count, ExpertWeights(w_gate_t, w_up_t, w_down_t))
    _zero_padded_tokens(y_rows, T, top_k, pid, lnc)
    if lnc > 1:
        nisa.core_barrier(data=y_rows, cores=(0, 1))  # the combine reads rows the other core wrote
    out = nl.ndarray((nT, TT, D), dtype=io, buffer=nl.shared_hbm)
    _combine(out, y_rows, top_k, pid, lnc)
    return out, g_saved, u_saved


# -- backward ----------------------------------------------------------------------------------------------------------
def _backward_weights(hbm_w, e, f0, FC, into=None):
    """The F chunk [f0, f0 + FC) of expert e, resident for the backward, all in torchtitan's layouts: down F on
    columns ([min(P, D), D/128, FC] of W_down: the stationary of dhT = (dy @ W_down)^T), gate and up F on rows
    ([min(P, FC), FC/128, D]: the moving of dx = dg @ W_gate + du @ W_up). Loaded down first, then gate, up, into
    the tiles of `into` (an ExpertWeights) when given."""
    into = into or ExpertWeights(None, None, None)
    down = _f_columns(hbm_w.down, e, f0, FC, into.down)
    gate = _f_rows(hbm_w.gate, e, f0, FC, into.gate)
    up = _f_rows(hbm_w.up, e, f0, FC, into.up)
    return ExpertWeights(gate=gate, up=up, down=down)


# Bytes per partition of one part of the backward's weight prefetch (`_weight_parts`): the DMA engines serve each
# engine's packets in order (DMA overview: one packet per engine per group of partitions), so one 9 MiB expert load
# would hold every dW store behind it for ~26 us; in parts of this size spread over the weight-gradient phase a
# store waits for at most one part (>= 2 KiB per partition keeps each part an efficient DMA)
WEIGHT_PART_BYTES = 8 * 1024


def _weight_parts(hbm_w, e, into, mats):
    """The DMAs of `_backward_weights(hbm_w, e, 0, F, into)` for the matrices `mats` (positions in ExpertWeights)
    as (dst, src) pairs of about WEIGHT_PART_BYTES per partition each."""
    pairs = []
    for m in mats:
        w = hbm_w[m]
        pairs += _whole_matrix_copies(w, e, into[m], max(1, _ntiles(WEIGHT_PART_BYTES, w.shape[2] * w.dtype.itemsize)))
    return pairs


def _broadcast_row(ws, slot_weight, grp, parts, B, ps):
    """ws["aff_bcast"] [parts, B], every partition a copy of the piece's slot weights (ws["aff_row"] <-
    slot_weight from group grp on): ones[1, parts]^T @ row (PE)."""
    nisa.dma_copy(dst=ws["aff_row"], src=slot_weight.ap(pattern=[[B, 1], [1, B]], offset=0, scalar_offset=grp,
                                                        indirect_dim=0))
    acc = _psum(ps, "acc")[0:parts, 0:B]
    nisa.nc_matmul(dst=acc, stationary=ws["ones"][0:1, 0:parts], moving=ws["aff_row"], accumulate=False)
    nisa.tensor_copy(dst=ws["aff_bcast"], src=acc)


def _swiglu_backward(ws, d_slot, grp, B, FC, ps, first, dx=None, swiglu=False):
    """ws["dg"], ws["du"] (feature-major, io dtype) from dhT (ws["dh"]); writes the affinity grads of the piece's
    slots, d_slot from group grp on.

    d_affinity = sum_f h * dh (a partition sum: ones^T @ (h * dh) on the PE);
    then dh *= affinity (in place), du = dh * silu(g), dg = dh * u * silu'(g) (silu' from the Scalar Engine's
    silu_dx). `dx`: (w, banks) to issue each f-tile's dx matmuls right after its dg, du (`_dx_tile`), so the
    Tensor Engine works on f-tile i while the Vector Engine computes f-tile i + 1. `swiglu`: each f-tile first
    computes its SwiGLU (`_swiglu_tile`: silu, silu', h), just in time, instead of all f-tiles before the loop.

    Dimensions:
        B: the piece's slots; FC: the F chunk's width (the workspace's feature tiles [min(P, FC), FC/128, B]).
    """
    d_aff = _psum(ps, "acc")[0:1, 0:B]
    for i in range(_ntiles(FC, P)):
        fl = _width(FC, P, i)
        dh, dg, h_dh = ws["dh"][0:fl, i, 0:B], ws["dg"][0:fl, i, 0:B], ws["h_dh"][0:fl, 0:B]
        if swiglu:
            _swiglu_tile(ws, i, fl, B)
        nisa.tensor_tensor(dst=h_dh, data1=ws["h"][0:fl, i, 0:B], data2=dh, op=nl.multiply)
        nisa.nc_matmul(dst=d_aff, stationary=ws["ones"][0:fl, 0:1], moving=h_dh, accumulate=i > 0)
        nisa.tensor_tensor(dst=dh, data1=dh, data2=ws["aff_bcast"][0:fl, 0:B], op=nl.multiply)
        nisa.tensor_tensor(dst=ws["du"][0:fl, i, 0:B], data1=dh, data2=ws["silu"][0:fl, i, 0:B], op=nl.multiply)
        nisa.tensor_tensor(dst=dg, data1=dh, data2=ws["u"][0:fl, i, 0:B], op=nl.multiply)
        nisa.tensor_tensor(dst=dg, data1=dg, data2=ws["dsilu"][0:fl, i, 0:B], op=nl.multiply)
        if dx is not None:
            _dx_tile(ws, dx[0], dx[1], i, fl, B)
    nisa.tensor_copy(dst=ws["d_aff"], src=d_aff)
    if not first:  # later F chunks add their partial sum over f
        nisa.dma_copy(dst=ws["d_aff_prev"], src=d_slot.ap(pattern=[[B, 1], [1, B]], offset=0, scalar_offset=grp,
                                                           indirect_dim=0))
        nisa.tensor_tensor(dst=ws["d_aff"], data1=ws["d_aff"], data2=ws["d_aff_prev"], op=nl.add)
    nisa.dma_copy(dst=d_slot.ap(pattern=[[B, 1], [1, B]], offset=0, scalar_offset=grp, indirect_dim=0),
                  src=ws["d_aff"])


def _dx_block(dest, ws, w, B, D, ps, first):
    """The dx rows of the piece = dg @ W_gate[e] + du @ W_up[e] (w: the resident chunk, `_backward_weights`).

    Dimensions:
        B: the piece's slots; D: hidden size; FC: the chunk's width (w.gate [min(P, FC), FC/128, D]).
    """
    FC = w.down.shape[2]
    for s in range(_ntiles(B, P)):
        sl = _width(B, P, s)
        for c in range(_ntiles(D, MOVING_FMAX)):
            c0, cl = c * MOVING_FMAX, _width(D, MOVING_FMAX, c)
            acc = _psum(ps, "acc")[0:sl, 0:cl]
            for i in range(_ntiles(FC, P)):
                fl = _width(FC, P, i)
                nisa.nc_matmul(dst=acc, stationary=ws["dg"][0:fl, i, s * P:s * P + sl],
                               moving=w.gate[0:fl, i, c0:c0 + cl], accumulate=i > 0)
                nisa.nc_matmul(dst=acc, stationary=ws["du"][0:fl, i, s * P:s * P + sl],
                               moving=w.up[0:fl, i, c0:c0 + cl], accumulate=True)
            _evict_rows(ws, acc, None, sl, c0, cl)
        _write_rows(dest, ws, s * P, sl, first)


def dx_in_dw_banks(B, D):
    """Whether a B-slot piece's dx accumulates in the weight-gradient banks (idle while pieces run), all live at
    once (`_dx_tile`): one bank per 128 slots x 512 columns of dx, or for B < 128 one per `_narrow_batches` run."""
    if B < P:
        return len(_narrow_batches(D, B)) <= DW_BANKS
    return _ntiles(B, P) * _ntiles(D, MOVING_FMAX) <= DW_BANKS


def _dx_tile(ws, w, banks, i, fl, B):
    """dx of the piece += dg[f-tile i] @ W_gate[i] + du[f-tile i] @ W_up[i]: every (128-slot, 512-column) block of dx
    in its own PSUM bank of `banks` (f-tile 0 opens them). A piece of B < 128 slots runs with the weights stationary
    (as `_down_narrow`): dxT [D, B], each D tile a region of its `_narrow_batches` run's bank."""
    D = w.gate.shape[2]
    if B < P:
        runs = _narrow_batches(D, B)
        for b in range(len(runs)):
            j0, n = runs[b]
            dl = _width(D, P, j0)
            for k in range(n):
                acc, c0 = banks[b][0:dl, k * B:(k + 1) * B], (j0 + k) * P
                nisa.nc_matmul(dst=acc, stationary=w.gate[0:fl, i, c0:c0 + dl], moving=ws["dg"][0:fl, i, 0:B],
                               accumulate=i > 0)
                nisa.nc_matmul(dst=acc, stationary=w.up[0:fl, i, c0:c0 + dl], moving=ws["du"][0:fl, i, 0:B],
                               accumulate=True)
        return
    for s in range(_ntiles(B, P)):
        sl = _width(B, P, s)
        for c in range(_ntiles(D, MOVING_FMAX)):
            c0, cl = c * MOVING_FMAX, _width(D, MOVING_FMAX, c)
            acc = banks[s * _ntiles(D, MOVING_FMAX) + c][0:sl, 0:cl]
            nisa.nc_matmul(dst=acc, stationary=ws["dg"][0:fl, i, s * P:s * P + sl],
                           moving=w.gate[0:fl, i, c0:c0 + cl], accumulate=i > 0)
            nisa.nc_matmul(dst=acc, stationary=ws["du"][0:fl, i, s * P:s * P + sl],
                           moving=w.up[0:fl, i, c0:c0 + cl], accumulate=True)


def _dx_rows(dest, ws, banks, B, D, first, ps):
    """The piece's dx rows from `banks` (`_dx_tile`) to the scratch: evicted by the Scalar and Vector Engines in
    turn, one DMA per 128 slots (B < 128: dxT evicted into ws["dyT"], dead after the dh projection, and transposed
    back to token-major)."""
    if B < P:
        runs = _narrow_batches(D, B)
        for b in range(len(runs)):
            j0, n = runs[b]
            dl = _width(D, P, j0)
            engine = nisa.engine.scalar if b % 2 == 0 else nisa.engine.vector
            nisa.tensor_copy(dst=ws["dyT"][0:dl, j0:j0 + n, 0:B], src=banks[b][0:dl, 0:n * B], engine=engine)
        _token_major([ws["out_rows"]], None, ws["dyT"], B, D, ps)
        _write_rows(dest, ws, 0, B, first)
        return
    for s in range(_ntiles(B, P)):
        sl = _width(B, P, s)
        for c in range(_ntiles(D, MOVING_FMAX)):
            c0, cl = c * MOVING_FMAX, _width(D, MOVING_FMAX, c)
            engine = nisa.engine.scalar if c % 2 == 0 else nisa.engine.vector
            nisa.tensor_copy(dst=ws["out_rows"][0:sl, c0:c0 + cl],
                             src=banks[s * _ntiles(D, MOVING_FMAX) + c][0:sl, 0:cl], engine=engine)
        _write_rows(dest, ws, s * P, sl, first)


def _backward_block(grp, row0, tile, gathers, hbm, w, ws, res, ps, B, f0, first, halves=False, down=None):
    """One B-slot piece (slot group grp, slot row row0) against one F chunk [f0, f0 + FC) of the segment's expert
    (w: that chunk, resident as `_backward_weights` lays it out). Leaves x, affinity * dy and the token-major dg,
    du, h in the resident tiles from `tile` on (the weight-gradient phase contracts them).

    Software pipeline (main-tile classes; `gathers` (own, next, next group, next tile, tails): registers own, next
    (0 or 1), int32 SBUF [1, 1] tiles and per tail buffer (flag register, slot group tile, buffer, width)): a piece
    gathers its own x and dy rows only when it is the first of its class loop (`own` 1); it gathers the next
    piece's rows into that piece's tiles (another tile index: no hazard) when the next row of `piece` is in the
    same loop (`next` 1), first thing, so the gather overlaps this piece's work instead of opening the next piece;
    the sub-segment's last main-tile piece gathers its tail pieces' rows the same way. A tail class (`gathers` None,
    one-tile buffer, 0/1 trips) finds its rows gathered. `halves`: the sub-segments alternate tile halves, each
    gathering the next one's first block early (`autograd.tiles_per_sub`). `down` ((dst, src) DMA pairs, a 0/1
    register): the next expert's down matrix, loaded (on the position's last piece) right after the dh projection,
    the last read of the resident one.

    Dimensions:
        B: the piece's slots; D: hidden size; FC: the chunk's width (w.down [min(P, D), D/128, FC]).
    """
    D, FC = hbm["x"].shape[1], w.down.shape[2]

    def own_rows(i):
        _load_block([res["dy"], res["x"]], tile, [hbm["dout"], hbm["x"]], hbm["index"], grp, B)  # dy: first used

    def next_rows(i):
        _load_block([res["dy"], res["x"]], gathers[3], [hbm["dout"], hbm["x"]], hbm["index"], gathers[2], B)

    if gathers is not None:
        nl.fori_loop(0, gathers[0], own_rows)
        nl.fori_loop(0, gathers[1], next_rows)
        for tail in gathers[4]:
            _tail_rows(tail, hbm)
    affinity = _affinities(hbm["weight"], grp, B)
    _load_feature_major(ws["g"], hbm["g_saved"], f0, FC, row0, B)
    _load_feature_major(ws["u"], hbm["u_saved"], f0, FC, row0, B)
    _feature_major(ws["dyT"], res["dy"], tile, B, D, ps)
    # The SwiGLU's Scalar activations wait for the gT, uT loads, which at a sub-segment's start queue behind the
    # previous weight-gradient phase's transfers. With `halves` the first piece's x and dy rows were gathered before
    # that phase, so its transposes and dh projection run first and each f-tile's SwiGLU runs just in time inside
    # the SwiGLU backward (ahead of the projection it would hold the projection's evictions in the Scalar queue;
    # 30B-A3B block 128: backward 7.30 -> 7.08 ms against all f-tiles after the projection). Without, that piece
    # gathers its own rows, and the SwiGLU first is faster (block 256: 8.00 ms against 8.09 just in time).
    if not halves:
        _swiglu(ws, FC, B)
    _project(ws["dh"], w.down, ws["dyT"], B, D, FC, ps)  # dhT = (dy @ W_down[e])^T
    _broadcast_row(ws, hbm["weight"], grp, ws["aff_bcast"].shape[0], B, ps)
    if down is not None:  # after the piece's last load: the DMA engines serve in order
        _copy_times(down[0], down[1])
    if dx_in_dw_banks(B, D):  # dx matmuls interleaved with the SwiGLU backward's f-tiles
        _swiglu_backward(ws, hbm["d_slot"], grp, B, FC, ps, first, (w, ps["dw"]), halves)
        _dx_rows((hbm["rows"], hbm["row_of_slot"], grp), ws, ps["dw"], B, D, first, ps)
    else:
        _swiglu_backward(ws, hbm["d_slot"], grp, B, FC, ps, first, None, halves)
        _dx_block((hbm["rows"], hbm["row_of_slot"], grp), ws, w, B, D, ps, first)
    for s in range(_ntiles(B, P)):  # in place: the resident dy becomes affinity * dy, what dW_down contracts
        dy = _tok(res["dy"], tile, s, _width(B, P, s), 0, D)
        nisa.tensor_scalar(dst=dy, data=dy, op0=nl.multiply, operand0=affinity[s])
    _token_major(res["dg"], tile, ws["dg"], B, FC, ps)
    _token_major(res["du"], tile, ws["du"], B, FC, ps)
    _token_major(res["h"], tile, ws["h"], B, FC, ps)


def _tail_rows(tail, hbm):
    """`tail` (flag register, slot group tile, buffer, width) times (0 or 1): gather a tail piece's x and dy rows
    into its one-tile buffer."""

    def body(i):
        _load_block([tail[2]["dy"], tail[2]["x"]], None, [hbm["dout"], hbm["x"]], hbm["index"], tail[1], tail[3])

    nl.fori_loop(0, tail[0], body)


GATE, UP, DOWN = 0, 1, 2  # positions of the fields of ExpertWeights (a DwRow's gradient)


class DwRow(NamedTuple):
    """One output row (band) of a weight gradient over one F chunk: dW[grad][row : row + rows, col : col + width]
    (relative to the chunk's window) = lhs[:, lhs_col : lhs_col + rows]^T @ rhs[:, rhs_col : rhs_col + width],
    summed over the resident tiles; lhs, rhs: names of resident buffers (`_resident`)."""

    grad: int
    lhs: str
    lhs_col: int
    rows: int
    rhs: str
    rhs_col: int
    width: int
    row: int
    col: int


def _dw_rows(D, FC):
    """The output rows of one F chunk's weight gradients: dW_gate / dW_up [FC, D] in rows of <= 128 (lhs dg / du,
    rhs x), dW_down [D, FC] (lhs affinity * dy, rhs h); a row wider than DW_ROW_BANKS PSUM banks is split into
    segments of that many."""
    seg = DW_ROW_BANKS * MOVING_FMAX
    rows = []
    for grad in (GATE, UP):
        for i in range(_ntiles(FC, P)):
            for c0 in range(0, D, seg):
                rows.append(DwRow(grad, "dg" if grad == GATE else "du", i * P, _width(FC, P, i), "x", c0,
                                  min(seg, D - c0), i * P, c0))
    for j in range(_ntiles(D, P)):
        for c0 in range(0, FC, seg):
            rows.append(DwRow(DOWN, "dy", j * P, _width(D, P, j), "h", c0, min(seg, FC - c0), j * P, c0))
    return rows


def _dw_groups(rows):
    """Consecutive rows packed into groups of at most DW_GROUP_BANKS PSUM banks (one bank per 512 columns)."""
    groups, group, banks = [], [], 0
    for row in rows:
        n = _ntiles(row.width, MOVING_FMAX)
        if banks + n > DW_GROUP_BANKS:
            groups.append(group)
            group, banks = [], 0
        group.append(row)
        banks += n
    groups.append(group)
    return groups


def _contract(group, res, tile, ps_dw, accumulate):
    """Each row of `group` (one PSUM bank per 512 columns) += lhs^T @ rhs over one resident tile of `res` (tokens on
    partitions)."""
    TS = res["x"].shape[0]
    bank = 0
    for row in group:
        lhs = _tok(res[row.lhs], tile, 0, TS, row.lhs_col, row.rows)
        for b in range(_ntiles(row.width, MOVING_FMAX)):
            bw = _width(row.width, MOVING_FMAX, b)
            nisa.nc_matmul(dst=ps_dw[bank][0:row.rows, 0:bw], stationary=lhs,
                           moving=_tok(res[row.rhs], tile, 0, TS, row.rhs_col + b * MOVING_FMAX, bw),
                           accumulate=accumulate)
            bank += 1


def _dw_window(grads, e, row, f0):
    """HBM view of `row` (a DwRow) of dW[e] (e an int32 SBUF [1, 1] tile): gate/up [F, D] chunk rows start at f0,
    down [D, F] chunk columns."""
    if row.grad == DOWN:
        return _expert_window(grads[DOWN], e, row.row, row.rows, f0 + row.col, row.width)
    return _expert_window(grads[row.grad], e, f0 + row.row, row.rows, row.col, row.width)


def _weight_grads(grads, res, tails, tail_bounds, tiles, write_row, acc_row, cont, ws, ps_dw, f0, FC, fetch=None):
    """dW of the sub-segment's expert over the F chunk [f0, f0 + FC): per group of rows (<= DW_BANKS PSUM banks),
    its first main tile opens the PSUM accumulation (`tiles`: that tile, an int32 SBUF [1, 1] tile, and registers
    [begin, end) of the others), a compiled loop adds the others, a 0/1-trip loop each tail
    buffer (the sub-segment's tail pieces); then each row is evicted once (Scalar Engine), written to dW[write_row]
    in one DMA and, in a continuation sub-segment (`cont` 1), added into dW[acc_row] by the DMA engines (the host
    points unused rows at this core's dummy). `fetch` ((dst, src) DMA pairs, a 0/1 register): the next expert's
    weights, `load` times, one pair after every few groups, so the stores never wait behind the whole load.

    Dimensions:
        D: hidden size (res["x"] [TS, NT, D]); FC: the chunk's width; grads: ExpertWeights of [E + LNC, ...].
    """
    groups = _dw_groups(_dw_rows(res["x"].shape[2], FC))
    sets = ws["stage"].shape[1] // (DW_GROUP_BANKS * MOVING_FMAX)  # stage buffer sets (`stage_sets`)
    for g in range(len(groups)):
        group, first = groups[g], (g % DW_SETS) * DW_GROUP_BANKS  # this group's banks
        stage = (g % sets) * DW_GROUP_BANKS - first  # its stage columns: bank + stage (in 512s)
        banks = ps_dw[first:first + DW_GROUP_BANKS]
        _contract(group, res, tiles[0], banks, False)
        _contract_loop(group, res, True, tiles[1], tiles[2], banks)
        for k in range(len(tails)):
            _contract_loop(group, tails[k], False, tail_bounds[k][0], tail_bounds[k][1], banks)
        bank = first
        for row in group:
            for b in range(_ntiles(row.width, MOVING_FMAX)):
                bw = _width(row.width, MOVING_FMAX, b)
                engine = nisa.engine.scalar if (bank + b) % 2 == 0 else nisa.engine.vector  # two evictions at once
                c0 = (bank + stage + b) * MOVING_FMAX
                nisa.tensor_copy(dst=ws["stage"][0:row.rows, c0:c0 + bw], src=ps_dw[bank + b][0:row.rows, 0:bw],
                                 engine=engine)
            c0 = (bank + stage) * MOVING_FMAX
            nisa.dma_copy(dst=_dw_window(grads, write_row, row, f0), src=ws["stage"][0:row.rows, c0:c0 + row.width])
            bank += _ntiles(row.width, MOVING_FMAX)
        _add_into(grads, group, acc_row, cont, ws, f0, first + stage)
        if fetch is not None:  # the parts due after this group
            for i in range(len(fetch[0])):
                if i * len(groups) // len(fetch[0]) == g:
                    _copy_times([fetch[0][i]], fetch[1])


def _copy_times(pairs, times):
    """`times` (a 0/1 register) times: the DMAs dst <- src of the (dst, src) `pairs`."""

    def body(i):
        for pair in pairs:
            nisa.dma_copy(dst=pair[0], src=pair[1])

    nl.fori_loop(0, times, body)


def _contract_loop(group, res, main, begin, end, ps_dw):
    """Compiled loop over [begin, end): main tiles (iteration value = tile index) or a tail buffer (0/1 trips)."""

    def body(t):
        _contract(group, res, t if main else None, ps_dw, True)

    nl.fori_loop(begin, end, body)


def _add_into(grads, group, acc_row, cont, ws, f0, first):
    """`cont` (0 or 1) times: dW[acc_row] row += the staged row (stage columns from bank `first` on), in the DMA
    engines (`nisa.dma_compute`)."""

    def body(j):
        bank = first
        for row in group:
            window = _dw_window(grads, acc_row, row, f0)
            staged = ws["stage"][0:row.rows, bank * MOVING_FMAX:bank * MOVING_FMAX + row.width]
            nisa.dma_compute(dst=window, srcs=[window, staged], reduce_op=nl.add)
            bank += _ntiles(row.width, MOVING_FMAX)

    nl.fori_loop(0, cont, body)


def _sub_segments(begin, end, sub_table, piece, hbm, w, ws, res, tails, ps, ps_dw, grads, widths, f0, first,
                  prefetch, nxt, ahead=None, halves=False):
    """The segment's sub-segments (rows [begin, end) of `sub_table`) against one resident F chunk `w`: each runs
    its pieces class by class (compiled loops over rows of `piece`), then its weight-gradient phase. `prefetch`
    (the HBM weights, when F is one chunk): the position's last sub-segment (`load` 1 in sub_table) loads the next
    position's expert `nxt` into `w` in parts spread over its weight-gradient phase, which does not read `w`.

    `ahead` (when F is one chunk: int32 SBUF tiles (sub row, class-0 piece rows)): the sub-segment's `sub_table` row
    and its first two class-0 `piece` rows, loaded by the core's previous sub-segment (the first by the caller).
    Each sub-segment loads the next run one's row (`sub_table` column 10) at its start and, after its pieces, that
    one's class-0 rows, before its weight-gradient phase: issued after the phase's stores, whose descriptors wait
    for their evictions, they would wait for the whole phase. `halves`: as in `_backward_block`."""
    TS = tile_slots(widths[0])
    # the next expert's down matrix: loaded by the position's last piece after its dh projection (`piece` column
    # PIECE_DOWN), while its SwiGLU backward and dx keep the Tensor Engine busy; the gate and up matrices, which dx
    # reads, load during the weight-gradient phase
    down = None if prefetch is None else _weight_parts(prefetch, nxt, w, (DOWN,))

    tail_sets = []
    for B in _tail_widths(widths):
        tail_sets.append((tails[len(tail_sets)], B))

    def sub(j):
        if ahead is None:
            row = _row(sub_table, 0, j)  # the sub-segment's entries in one DMA
        else:
            row = _take_ahead(ahead[0], sub_table, col=10)  # then the core's next run sub-segment's
        cont = _register(row[0:1, 2:3])
        tile_begin, tile_end = _register(row[0:1, 4:5]), _register(row[0:1, 5:6])
        tail_bounds = []
        for k in range(len(widths)):  # full KB blocks, then the tail's KB/2, ..., G pieces (0 or 1 each)
            col = SUB_HEAD + 2 * k
            p_begin, p_end = _register(row[0:1, col:col + 1]), _register(row[0:1, col + 1:col + 2])
            target, indexed = res, True
            if widths[k] < TS:  # a tail class narrower than a tile: its own one-tile buffer
                target, indexed = tails[len(tail_bounds)], False
                tail_bounds.append((p_begin, p_end))
            rows_ahead = ahead[1] if ahead is not None and k == 0 else None
            _pieces(piece, p_begin, p_end, hbm, w, _ws_view(ws, widths[k]), target, indexed, ps, widths[k], f0,
                    first, ahead=rows_ahead, halves=halves, tails=tail_sets, down=down)
        if ahead is not None:  # the next run sub-segment's first class-0 rows (its row is in ahead[0] by now)
            _row(piece, 0, ahead[0][0:1, SUB_HEAD:SUB_HEAD + 1], 2, ahead[1])

        # the dW phase's DMAs read their expert rows (and the prefetch its expert) from a tile of their own, so the
        # next sub-segment's table rows load while those DMAs are still in flight; copied by the Vector Engine, whose
        # queue holds the pieces' evictions the phase waits for anyway (on GpSimd the copy, and so the phase's first
        # matmuls, queued behind the last piece's row scatter: backward 6.581 -> 6.466 ms at full scale)
        ids = ws["dw_ids"]  # write row, add row, cont, first tile; the prefetched expert
        nisa.tensor_copy(dst=ids[0:1, 0:4], src=row[0:1, 0:4], engine=nisa.engine.vector)
        if prefetch is not None:
            nisa.tensor_copy(dst=ids[0:1, 4:5], src=nxt, engine=nisa.engine.vector)

        def early(i):  # the other half of the resident tiles is free: the weight-gradient phase reads this half
            _load_block([res["dy"], res["x"]], row[0:1, 9:10], [hbm["dout"], hbm["x"]], hbm["index"], row[0:1, 8:9],
                        widths[0])

        nl.fori_loop(0, _register(row[0:1, 7:8]), early)
        fetch = None
        if prefetch is not None:  # the next position's weights, in parts, during the weight-gradient phase
            fetch = (_weight_parts(prefetch, ids[0:1, 4:5], w, (GATE, UP)), _register(row[0:1, 6:7]))
        _weight_grads(grads, res, tails, tail_bounds, (ids[0:1, 3:4], tile_begin, tile_end), ids[0:1, 0:1],
                      ids[0:1, 1:2], cont, ws, ps_dw, f0, w.down.shape[2], fetch)

    nl.fori_loop(begin, end, sub)


def _backward_segments(pid, S, hbm, piece, seg_table, seg_count, sub_table, hbm_w, grads):
    """This core's expert segments, backward. Per segment position (one expert) and F chunk: load the chunk of the
    expert's weights once, then run the position's sub-segments (one unless the expert has more tiles than fit
    SBUF)."""
    x_pad = hbm["x"]
    io, D, F = x_pad.dtype, x_pad.shape[1], hbm_w.down.shape[2]
    widths = _piece_classes(hbm["index"], seg_table, SEG_HEAD)
    FC, NT = fit_backward(D, F, io, widths)
    sets = stage_sets(D, F, FC, NT, io, widths)
    ws = _bwd_workspace(widths[0], D, FC, io, hbm["rows"].dtype, FC < F, sets)
    res = _resident(tile_slots(widths[0]), NT, D, FC, io)
    tails = []
    for B in _tail_widths(widths):
        tails.append(_resident(B, 1, D, FC, io))
    ps = _psum_pool(io, PSUM_BANKS)
    ps_dw = []
    for _ in range(DW_BANKS):
        ps_dw.append(nl.ndarray((P, MOVING_FMAX), dtype=F32, buffer=nl.psum, name="psum_dw"))
    ps["dw"] = ps_dw  # the pieces' dx accumulates there too (`dx_in_dw_banks`): the banks are idle while pieces run

    resident, ahead = None, None
    if FC == F:
        # one chunk: position 0's weights here, each later position's prefetched by the one before it; the table
        # rows run ahead: position 0's seg_table row, its first sub_table row and that one's first class-0 piece
        # rows here, each later one's by the position / sub-segment before it (`_sub_segments`)
        seg_ahead = nl.ndarray((1, seg_table.shape[1]), dtype=I32, buffer=nl.sbuf)
        nisa.dma_copy(dst=seg_ahead, src=seg_table[pid * S:pid * S + 1, 0:seg_table.shape[1]])
        resident = _backward_weights(hbm_w, seg_ahead[0:1, 0:1], 0, F)
        ahead = (_row(sub_table, 0, seg_ahead[0:1, 1:2]), nl.ndarray((1, 2 * piece.shape[1]), dtype=I32,
                                                                      buffer=nl.sbuf))
        _row(piece, 0, ahead[0][0:1, SUB_HEAD:SUB_HEAD + 1], 2, ahead[1])

    def segment(s):
        if FC == F:
            row = _take_ahead(seg_ahead, seg_table, col=6)  # then the core's next position's
        else:
            row = _row(seg_table, pid * S, s)  # the position's entries in one DMA
        e = row[0:1, 0:1]
        sub_begin, sub_end = _register(row[0:1, 1:2]), _register(row[0:1, 2:3])
        if FC == F:
            _sub_segments(sub_begin, sub_end, sub_table, piece, hbm, resident, ws, res, tails, ps, ps_dw, grads,
                          widths, 0, True, hbm_w, row[0:1, 3:4], ahead, alternates_halves(F, FC, NT, widths))
        for c in range(_ntiles(F, FC) if FC < F else 0):  # F chunked: each chunk's weights, then its sub-segments
            f0 = c * FC
            w = _backward_weights(hbm_w, e, f0, _width(F, FC, c))
            _sub_segments(sub_begin, sub_end, sub_table, piece, hbm, w, ws, res, tails, ps, ps_dw, grads, widths, f0,
                          c == 0, None, None)
            w = None  # the chunk's weights are dead: the next chunk's take their SBUF

    nl.fori_loop(0, _count(seg_count), segment)
    resident = None  # dead after the last position (the loop body's cell holds it): the combine takes its SBUF


def _zero_rows(t, zeros, pid, lnc, first=0, last=None):
    """Zero this core's contiguous share of rows [first, last) (None: all) of a 2-D HBM tensor (`zeros`: a zeroed
    SBUF tile of t's dtype, at least [min(P, rows), C])."""
    R, C = t.shape
    last = R if last is None else last
    per = _ntiles(last - first, lnc)
    lo = min(last, first + pid * per)
    hi = min(last, lo + per)
    for r0 in range(lo, hi, P):
        rl = min(P, hi - r0)
        nisa.dma_copy(dst=t[r0:r0 + rl, 0:C], src=zeros[0:rl, 0:C])


def _zero_experts(grads, zero_rows, zero_count, pid):
    """Zero dW[e] of every gradient for the rows e this core lists in `zero_rows` (its empty experts and its dummy
    row; the same trip count on every core, padded with the dummy)."""
    width = 1
    for dw in grads:
        width = max(width, dw.shape[2])
    zeros = nl.ndarray((P, width), dtype=grads[0].dtype, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)

    def expert(e):
        for dw in grads:
            R, C = dw.shape[1], dw.shape[2]
            for r0 in range(0, R, P):
                rl = min(P, R - r0)
                nisa.dma_copy(dst=dw.ap(pattern=[[C, rl], [1, C]], offset=r0 * C, scalar_offset=e, indirect_dim=0),
                              src=zeros[0:rl, 0:C])

    _listed(zero_rows, zero_count, pid, expert)


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
        sub_table: [LNC * S * J, 11 + 2L] int32, one row per sub-segment: dW row it writes (its expert, or the
            core's dummy E + core), dW row it adds into (`dma_compute`; the expert for a continuation sub-segment,
            else the dummy), cont (1: the sub-segment adds into rows written before; the same on both cores), its
            resident main tiles as first, first + 1, end (the count the same on both cores; the first 0, or the
            other half's on every other sub-segment when the host alternates halves: `autograd.tiles_per_sub`),
            load (1 on the position's last sub-segment, which loads the position's next expert after its pieces;
            the same on both cores; used when F is one chunk), early (1: gather the first full block of the core's
            next sub-segment into its tiles before the weight-gradient phase; the same on both cores), that
            block's slot group and first tile, the row of the core's next run sub-segment (any valid row after its
            last: loaded ahead, never run), then per piece class the [begin, end) rows of `piece`.
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
    _expect(x_pad, "x_pad", "[T+1, D]", (None, None), x_pad.dtype)
    io, D = x_pad.dtype, x_pad.shape[1]
    _expect(dout_pad, "dout_pad", "[T+1, D] (x_pad's shape and dtype)", x_pad.shape, io)
    T = x_pad.shape[0] - 1
    L = _expect_plan(token_index, slot_weight, piece, seg_table, seg_count, row_of_slot, top_k, T, lnc)
    _expect(sub_table, "sub_table", "[LNC * S * J, 11 + 2L] (L of seg_table)", (None, SUB_HEAD + 2 * L), I32)
    _expect_per_core(zero_rows, zero_count, ("zero_rows", "zero_count"), lnc)
    _expect(w_gate, "w_gate", "[E, F, D] (D of x_pad, io dtype)", (None, None, D), io)
    E, F = w_gate.shape[0], w_gate.shape[1]
    _expect(w_up, "w_up", "[E, F, D] (w_gate's shape)", (E, F, D), io)
    _expect(w_down, "w_down", "[E, D, F]", (E, D, F), io)
    ng, G = token_index.shape
    _expect(g_saved, "g_saved", "[F, NS]", (F, ng * G), io)
    _expect(u_saved, "u_saved", "[F, NS]", (F, ng * G), io)
    S = seg_table.shape[0] // lnc
    nT, TT = token_tiles(T, lnc)
    FC = fit_backward(D, F, io, piece_widths(G * 2 ** (L - 1), L))[0]
    dx_rows = nl.ndarray((assignment_rows(T, top_k, ng * G, lnc), D), dtype=F32 if FC < F else io,
                         buffer=nl.shared_hbm, name="dx_rows")
    d_slot = nl.ndarray((ng, G), dtype=F32, buffer=nl.shared_hbm)
    grads = ExpertWeights(gate=nl.ndarray((E + lnc, F, D), dtype=io, buffer=nl.shared_hbm),
                          up=nl.ndarray((E + lnc, F, D), dtype=io, buffer=nl.shared_hbm),
                          down=nl.ndarray((E + lnc, D, F), dtype=io, buffer=nl.shared_hbm))
    zeros = nl.ndarray((P, G), dtype=F32, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)
    _zero_rows(d_slot, zeros, pid, lnc)  # padding slots keep the zeros, the segment owners overwrite the rest
    zeros = None
    _zero_experts(grads, zero_rows, zero_count, pid)
    if lnc > 1:
        nisa.core_barrier(data=d_slot, cores=(0, 1))
    hbm = {"x": x_pad, "dout": dout_pad, "index": token_index, "weight": slot_weight, "rows": dx_rows,
           "row_of_slot": row_of_slot,
           "d_slot": d_slot, "g_saved": g_saved, "u_saved": u_saved}
    _backward_segments(pid, S, hbm, piece, seg_table, seg_count, sub_table,
                       ExpertWeights(gate=w_gate, up=w_up, down=w_down), grads)
    _zero_padded_tokens(dx_rows, T, top_k, pid, lnc)
    if lnc > 1:
        nisa.core_barrier(data=dx_rows, cores=(0, 1))
    dx = nl.ndarray((nT, TT, D), dtype=io, buffer=nl.shared_hbm)
    _combine(dx, dx_rows, top_k, pid, lnc)
    return dx, d_slot, grads.gate, grads.up, grads.down
