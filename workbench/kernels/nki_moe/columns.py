"""The columns of the int32 tables the host hands the kernels (`tables.KernelPlan` builds them, the kernels read
them): one name per column, so neither side indexes a table by number.

`piece` [M + 2, PieceCol.COLS]: one row per piece (B slots of one expert), grouped by class, core and position;
`seg_table` [LNC * S, SegCol.HEAD + 2L]: one row per core and segment position (one expert);
`sub_table` [LNC * S * J, SubCol.HEAD + 2L]: one row per sub-segment (an expert's pieces whose resident tiles fit
SBUF at once). What each column holds: docs/nki_kernels.md ("Design").
"""

from __future__ import annotations

from .layout import TAIL_BUFFERS, piece_widths


class PieceCol:
    """Columns of `piece`."""

    GROUP = 0  # first slot group (a row of the [NG, G] slot tables)
    ROW = 1  # first slot row, GROUP * G (a column of the saved [F, NS] gT / uT)
    TILE = 2  # backward: the first resident tile the piece fills
    OWN = 3  # backward: 1 on the first piece of a main-tile class loop, which gathers its own x and dy rows
    NEXT = 4  # backward: 1 where the next row is in the same class loop (the piece gathers that one's rows)
    FETCH = 5  # forward: FETCH + m (m = GATE, UP, DOWN) is 1 on the piece that loads matrix m of the next position
    DOWN = 8  # backward: 1 on the position's last piece, which loads the next expert's down matrix
    TAILS = 9  # backward: TAILS + 2t is 1 where the piece gathers tail buffer t's rows, TAILS + 2t + 1 their group
    COLS = TAILS + 2 * TAIL_BUFFERS


class SegCol:
    """Columns of `seg_table` before the per-class piece bounds (class k: [begin, end) rows of `piece` at HEAD + 2k,
    HEAD + 2k + 1)."""

    EXPERT = 0
    SUB_BEGIN = 1  # [begin, end) rows of `sub_table`
    SUB_END = 2
    NEXT_EXPERT = 3  # the expert of the core's next position (its own at the last): both kernels prefetch it
    SET = 4  # forward: the position's weight set (s % 2)
    NEXT_SET = 5  # forward: the next position's weight set
    NEXT_ROW = 6  # the row of the core's next position (loaded ahead)
    HEAD = 7


class SubCol:
    """Columns of `sub_table` before the per-class piece bounds (as in `seg_table`, from HEAD on)."""

    WRITE = 0  # the dW row it writes (its expert, or the core's dummy E + core)
    ADD = 1  # the dW row it adds into with dma_compute (a continuation sub-segment's expert, else the dummy)
    CONT = 2  # 1: a continuation sub-segment (adds into rows written before)
    TILE_FIRST = 3  # its resident main tiles [first, end), as first, first + 1 (the loop's begin), end
    TILE_BEGIN = 4
    TILE_END = 5
    LOAD = 6  # 1 on the position's last sub-segment, which loads the next expert's gate and up matrices
    EARLY = 7  # 1: it gathers the first full block of the core's next sub-segment before its weight-gradient phase
    EARLY_GROUP = 8  # that block's slot group and first tile
    EARLY_TILE = 9
    NEXT_ROW = 10  # the row of the core's next run sub-segment (loaded ahead)
    HEAD = 11


# `dw_ids`, the weight-gradient phase's own copy of its table entries: SubCol.WRITE .. SubCol.TILE_FIRST, then the
# prefetched expert
DW_IDS_EXPERT = SubCol.TILE_FIRST + 1


def entry(tile, col, row=0, cols=0):
    """[1, 1] view of column `col` of table row `row` in an int32 SBUF tile holding consecutive table rows of
    `cols` columns each (a scalar offset, or the source of a register)."""
    c = row * cols + col
    return tile[0:1, c:c + 1]


def piece_classes(token_index, seg_table):
    """B of each piece class: KB, KB/2, ..., G (G = token_index.shape[1], one class per column pair of seg_table
    from SegCol.HEAD on)."""
    L = (seg_table.shape[1] - SegCol.HEAD) // 2
    return piece_widths(token_index.shape[1] * 2 ** (L - 1), L)
