"""Entry checks of the kernels' arguments: one line naming the argument, what it must be and what it was."""

from __future__ import annotations

from workbench.core.errors import check_argument

from .columns import PieceCol, SegCol
from .layout import F32, I32


def expect(t, name, dims, shape, dtype):
    """Entry check of one kernel argument: its dtype and shape (`shape`: one size per dim, None where any size goes;
    `dims` the shape in the package's letters, for the message)."""
    ok = t.dtype == dtype and len(t.shape) == len(shape)
    if ok:
        for i in range(len(shape)):
            ok = ok and (shape[i] is None or t.shape[i] == shape[i])
    check_argument(ok, name, f"{name} must be {dims} {dtype}, got {tuple(t.shape)} {t.dtype}: pass the tables of "
                   "tables.KernelPlan and the weights in the layouts the kernel's docstring gives")


def expect_plan(token_index, slot_weight, piece, seg_table, seg_count, row_of_slot, top_k, T, lnc):
    """Entry checks of the host tables both kernels take (`tables.KernelPlan`); returns L, the piece classes."""
    expect(token_index, "token_index", "[NG, G]", (None, None), I32)
    expect(slot_weight, "slot_weight", "[NG, G] (token_index's shape)", token_index.shape, F32)
    expect(piece, "piece", f"[M, {PieceCol.COLS}]", (None, PieceCol.COLS), I32)
    expect(seg_table, "seg_table", f"[LNC * S, {SegCol.HEAD} + 2L]", (None, None), I32)
    L = (seg_table.shape[1] - SegCol.HEAD) // 2
    check_argument(L >= 1 and seg_table.shape[1] == SegCol.HEAD + 2 * L and seg_table.shape[0] % lnc == 0,
                   "seg_table", f"seg_table must be [LNC * S, {SegCol.HEAD} + 2L] with L >= 1 at LNC {lnc}, got "
                   f"{tuple(seg_table.shape)}")
    expect(seg_count, "seg_count", "[1, 1]", (1, 1), I32)
    expect(row_of_slot, "row_of_slot", "[NG, G] (token_index's shape)", token_index.shape, I32)
    NS = token_index.shape[0] * token_index.shape[1]
    check_argument(isinstance(top_k, int) and 1 <= top_k and T * top_k <= NS, "top_k",
                   f"top_k must be an int K >= 1 with T * K <= NS ({T} tokens, {NS} slots), got {top_k!r}")
    return L


def expect_per_core(rows, count, names, lnc):
    """Entry checks of a per-core list (`zero_rows` [LNC * n, 1]) and its [1, 1] count, `names`."""
    expect(rows, names[0], "[LNC * n, 1]", (None, 1), I32)
    check_argument(rows.shape[0] % lnc == 0, names[0],
                   f"{names[0]} must be [LNC * n, 1] at LNC {lnc}, got {tuple(rows.shape)}")
    expect(count, names[1], "[1, 1]", (1, 1), I32)
