"""The backward's weight-gradient phase: after a sub-segment's pieces, dW_gate, dW_up and dW_down of its expert
accumulate in PSUM over the resident tiles the pieces filled, and each output row is evicted once and written once
(a continuation sub-segment adds into the rows its predecessors wrote)."""

from __future__ import annotations

from typing import NamedTuple

from workbench.kernels.nki_api import nisa, nl

from .layout import DW_GROUP_BANKS, DW_ROW_BANKS, DW_SETS, MOVING_FMAX, P, ntiles, width
from .tiles import DOWN, GATE, UP, DmaTimes, copy_times, expert_window, tok

X, DY, DG, DU, H = 0, 1, 2, 3, 4  # positions of the fields of Resident


class Resident(NamedTuple):
    """One backward buffer set: NT tiles of TS slots (tokens on partitions) of x and dy ([TS, NT, D]) and of dg, du,
    h ([TS, NT, FC]), filled by an expert's pieces, read by its weight-gradient phase. `dy` holds dy, then (scaled
    in place by the piece) affinity * dy, the operand dW_down contracts."""

    x: object
    dy: object
    dg: object
    du: object
    h: object


def resident(TS, NT, D, FC, io_dtype):
    """A Resident buffer set of NT tiles of TS slots."""
    return Resident(x=nl.ndarray((TS, NT, D), dtype=io_dtype, buffer=nl.sbuf, name="x_res"),
                    dy=nl.ndarray((TS, NT, D), dtype=io_dtype, buffer=nl.sbuf, name="dy_res"),
                    dg=nl.ndarray((TS, NT, FC), dtype=io_dtype, buffer=nl.sbuf, name="dg_res"),
                    du=nl.ndarray((TS, NT, FC), dtype=io_dtype, buffer=nl.sbuf, name="du_res"),
                    h=nl.ndarray((TS, NT, FC), dtype=io_dtype, buffer=nl.sbuf, name="h_res"))


class DwRow(NamedTuple):
    """One output row (band) of a weight gradient over one F chunk: dW[grad][row : row + rows, col : col + width]
    (relative to the chunk's window) = lhs[:, lhs_col : lhs_col + rows]^T @ rhs[:, rhs_col : rhs_col + width],
    summed over the resident tiles; lhs, rhs: positions in Resident (X, DY, DG, DU, H)."""

    grad: int
    lhs: int
    lhs_col: int
    rows: int
    rhs: int
    rhs_col: int
    width: int
    row: int
    col: int


class DwPhase(NamedTuple):
    """What the weight-gradient phase of one sub-segment works with: the gradients (ExpertWeights of [E + LNC, ...]
    HBM tensors), the resident main tiles and the tail buffers (Resident sets), the stage tile (evicted bands on
    their way to HBM), the weight-gradient PSUM banks, and the F chunk [f0, f0 + FC)."""

    grads: object
    res: Resident
    tails: list
    stage: object
    banks: list
    f0: int
    FC: int


class MainTiles(NamedTuple):
    """The sub-segment's resident main tiles [first, end): `first` an int32 SBUF [1, 1] tile (it opens each PSUM
    accumulation), `begin` (= first + 1) and `end` registers (a compiled loop adds the others)."""

    first: object
    begin: object
    end: object


class DwTargets(NamedTuple):
    """The dW rows a sub-segment writes: `write` and `add` int32 SBUF [1, 1] tiles (an expert, or the core's dummy
    row), `cont` a 0/1 register (1: add the staged rows into row `add` with dma_compute)."""

    write: object
    add: object
    cont: object


def dw_rows(D, FC):
    """The output rows of one F chunk's weight gradients: dW_gate / dW_up [FC, D] in rows of <= 128 (lhs dg / du,
    rhs x), dW_down [D, FC] (lhs affinity * dy, rhs h); a row wider than DW_ROW_BANKS PSUM banks is split into
    segments of that many."""
    seg = DW_ROW_BANKS * MOVING_FMAX
    rows = []
    for grad in (GATE, UP):
        for i in range(ntiles(FC, P)):
            for c0 in range(0, D, seg):
                rows.append(DwRow(grad, DG if grad == GATE else DU, i * P, width(FC, P, i), X, c0, min(seg, D - c0),
                                  i * P, c0))
    for j in range(ntiles(D, P)):
        for c0 in range(0, FC, seg):
            rows.append(DwRow(DOWN, DY, j * P, width(D, P, j), H, c0, min(seg, FC - c0), j * P, c0))
    return rows


def dw_groups(rows):
    """Consecutive rows packed into groups of at most DW_GROUP_BANKS PSUM banks (one bank per 512 columns)."""
    groups, group, banks = [], [], 0
    for row in rows:
        n = ntiles(row.width, MOVING_FMAX)
        if banks + n > DW_GROUP_BANKS:
            groups.append(group)
            group, banks = [], 0
        group.append(row)
        banks += n
    groups.append(group)
    return groups


def contract(group, res, tile, banks, accumulate):
    """Each row of `group` (one PSUM bank per 512 columns) += lhs^T @ rhs over one resident tile of `res` (tokens on
    partitions)."""
    TS = res.x.shape[0]
    bank = 0
    for row in group:
        lhs = tok(res[row.lhs], tile, 0, TS, row.lhs_col, row.rows)
        for b in range(ntiles(row.width, MOVING_FMAX)):
            bw = width(row.width, MOVING_FMAX, b)
            nisa.nc_matmul(dst=banks[bank][0:row.rows, 0:bw], stationary=lhs,
                           moving=tok(res[row.rhs], tile, 0, TS, row.rhs_col + b * MOVING_FMAX, bw),
                           accumulate=accumulate)
            bank += 1


def contract_loop(group, res, main, begin, end, banks):
    """Compiled loop over [begin, end): main tiles (iteration value = tile index) or a tail buffer (0/1 trips)."""

    def body(t):
        contract(group, res, t if main else None, banks, True)

    nl.fori_loop(begin, end, body)


def dw_window(grads, e, row, f0):
    """HBM view of `row` (a DwRow) of dW[e] (e an int32 SBUF [1, 1] tile): gate/up [F, D] chunk rows start at f0,
    down [D, F] chunk columns."""
    if row.grad == DOWN:
        return expert_window(grads[DOWN], e, row.row, row.rows, f0 + row.col, row.width)
    return expert_window(grads[row.grad], e, f0 + row.row, row.rows, row.col, row.width)


def weight_grads(phase, tiles, tail_bounds, targets, fetch=None):
    """dW of the sub-segment's expert over the F chunk: per group of rows (<= DW_GROUP_BANKS PSUM banks), its first
    main tile opens the PSUM accumulation (`tiles`: MainTiles), a compiled loop adds the others, a 0/1-trip loop
    each tail buffer (`tail_bounds`: per tail buffer its [begin, end) registers); then each row is evicted once
    (Scalar and Vector Engines, a bank each), written to dW[targets.write] in one DMA and, in a continuation
    sub-segment, added into dW[targets.add] by the DMA engines. `fetch` (DmaTimes): the next expert's weights, one
    part after every few groups, so the stores never wait behind the whole load.

    Dimensions:
        D: hidden size (res.x [TS, NT, D]); FC: the chunk's width; grads: ExpertWeights of [E + LNC, ...].
    """
    groups = dw_groups(dw_rows(phase.res.x.shape[2], phase.FC))
    stage = phase.stage
    sets = stage.shape[1] // (DW_GROUP_BANKS * MOVING_FMAX)  # stage buffer sets (`layout.stage_sets`)
    for g in range(len(groups)):
        group, first = groups[g], (g % DW_SETS) * DW_GROUP_BANKS  # this group's banks
        shift = (g % sets) * DW_GROUP_BANKS - first  # its stage columns: bank + shift (in 512s)
        banks = phase.banks[first:first + DW_GROUP_BANKS]
        contract(group, phase.res, tiles.first, banks, False)
        contract_loop(group, phase.res, True, tiles.begin, tiles.end, banks)
        for k in range(len(phase.tails)):
            contract_loop(group, phase.tails[k], False, tail_bounds[k][0], tail_bounds[k][1], banks)
        bank = first
        for row in group:
            for b in range(ntiles(row.width, MOVING_FMAX)):
                bw = width(row.width, MOVING_FMAX, b)
                engine = nisa.engine.scalar if (bank + b) % 2 == 0 else nisa.engine.vector  # two evictions at once
                c0 = (bank + shift + b) * MOVING_FMAX
                nisa.tensor_copy(dst=stage[0:row.rows, c0:c0 + bw], src=phase.banks[bank + b][0:row.rows, 0:bw],
                                 engine=engine)
            c0 = (bank + shift) * MOVING_FMAX
            nisa.dma_copy(dst=dw_window(phase.grads, targets.write, row, phase.f0),
                          src=stage[0:row.rows, c0:c0 + row.width])
            bank += ntiles(row.width, MOVING_FMAX)
        add_into(phase, group, targets, first + shift)
        if fetch is not None:  # the parts due after this group
            for i in range(len(fetch.pairs)):
                if i * len(groups) // len(fetch.pairs) == g:
                    copy_times(DmaTimes([fetch.pairs[i]], fetch.times))


def add_into(phase, group, targets, first):
    """`targets.cont` (0 or 1) times: dW[targets.add] row += the staged row (stage columns from bank `first` on), in
    the DMA engines (`nisa.dma_compute`)."""

    def body(j):
        bank = first
        for row in group:
            window = dw_window(phase.grads, targets.add, row, phase.f0)
            staged = phase.stage[0:row.rows, bank * MOVING_FMAX:bank * MOVING_FMAX + row.width]
            nisa.dma_compute(dst=window, srcs=[window, staged], reduce_op=nl.add)
            bank += ntiles(row.width, MOVING_FMAX)

    nl.fori_loop(0, targets.cont, body)
