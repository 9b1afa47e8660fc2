"""The kernels' int32 tables, built on the host from the slot plan (`moe_reference.plan_blocks`): which expert
each core runs at each position, its sub-segments and pieces, and the rows and flags the kernels' software
pipelines read (`columns`: what each column holds). Built with static-shaped tensor ops only (no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from workbench.core.moe_blocks import kernel_block_size
from workbench.kernels.moe_reference import BlockPlan, plan_blocks

from . import layout
from .columns import PieceCol, SegCol, SubCol

TAIL_GRANULE = 32  # slots: each expert is padded to a multiple of this, not of the block


def slot_granule(kb: int) -> int:
    """G: each expert's slots are padded to a multiple of G. 32 when the kernel block KB is 32 x a power of two
    (its tail then runs as pieces of KB/2, ..., 32 slots), else KB itself (no tail pieces)."""
    r = kb // TAIL_GRANULE
    if kb % TAIL_GRANULE == 0 and r & (r - 1) == 0:
        return TAIL_GRANULE
    return kb


def tiles_per_sub(kb: int, hidden: int, ffn: int, dtype: torch.dtype) -> tuple[int, bool]:
    """(tiles, halves): the resident 128-slot tiles one expert sub-segment may fill at these shapes (the plan splits
    experts with more), and whether sub-segments alternate between two halves of the NT tiles the backward holds
    (`layout.backward_layout`): then each sub-segment gathers the next one's first block into the other half before
    its weight-gradient phase. Halves when F is one chunk and half the tiles still hold one full block and the
    main tail classes; else (tiles, halves) = (NT, False)."""
    widths = layout.piece_widths(kb, (kb // slot_granule(kb)).bit_length())
    FC, NT = layout.backward_layout(hidden, ffn, dtype, widths)
    if layout.alternates_halves(ffn, FC, NT, widths):
        return NT // 2, True
    return NT, False


@dataclass(frozen=True)
class KernelPlan:
    """The block plan in the kernels' int32 tables (`columns`; the kernels: `forward.moe_blockwise_fwd`,
    `backward.moe_blockwise_bwd`), for `lnc` cores.

    The plan's slots come in groups of G (`plan.block_size`), each expert padded to a multiple of G and to at least
    one resident tile (min(128, KB) slots); each expert's groups run as full kernel blocks of KB = G * 2^(L-1)
    slots, then a tail of at most one piece of each of KB/2, ..., G slots (the binary digits of its remaining group
    count), so padding is each expert's rounding up to G (or to one tile).

    Every core runs the same compiled control flow (the LNC page: control flow that differs between the cores is
    undefined). The non-empty experts, sorted by group count, are dealt to the cores in rounds (round s: position s
    of every core, the larger expert alternating between cores 0 and 1). An expert whose pieces need more resident
    tiles than the backward holds (`tiles_per_sub`) runs as several *sub-segments* on its core, the later ones
    adding into its dW. At each position both cores run the same number of sub-segments and, in each, the same
    number of pieces of each width class, the core with fewer real ones topping up with no-op pieces (they read the
    zero row of x, slot weight 0, and write only that core's `noop area` slot rows) and no-op sub-segments (their dW
    goes to the core's dummy row E + core). Experts of equal group count have equal piece counts, so sorting makes
    most positions need none. Built with static-shaped tensor ops only (no host sync), so the kernels' input shapes
    depend on (T, K, E, block size, lnc, tiles per sub-segment) alone.

    `from_plan` builds it in parts: full blocks and tail pieces per expert (`_pieces_per_expert`), the experts split
    across the cores (`_deal_to_cores`), sub-segments and their piece counts (`_sub_segments`), then the tables
    (`_piece_table`, `_segment_tables`, `_zero_fill`, `_row_table`). Letters as in the `nki_moe` package.
    """

    token_index: torch.Tensor  # [NG + lnc * KB/G, G]; the last lnc * KB/G groups: one KB-slot no-op area per core
    piece: torch.Tensor  # [M + 2, 13]: first slot group, first slot row, first resident tile, own, next (the
    #                      backward's row gathers), gate / up / down (the forward's weight prefetch), down (the
    #                      backward's: `_down_flags`), per tail buffer a flag and a slot group (the backward's tail
    #                      gathers: `_tail_gathers`); per class, core, position; then two padding rows
    seg_table: torch.Tensor  # [lnc * S, 7 + 2L]: expert, [begin, end) sub_table rows, next expert, weight set,
    #                          next weight set, the core's next position's row, [begin, end) piece rows/class
    seg_count: torch.Tensor  # [1, 1]: positions run, the same on every core
    sub_table: torch.Tensor  # [lnc * S * J, 11 + 2L]: write row, add row, cont, main tiles (first, first + 1,
    #                          end), load, early, its group and tile, the core's next run sub-segment's row,
    #                          [begin, end) piece rows/class
    zero_rows: torch.Tensor  # [lnc * Z, 1]: dW rows each core zero-fills (its dummy E + core, its empty experts)
    zero_count: torch.Tensor  # [1, 1]: rows zero-filled per core, the same on every core
    row_of_slot: torch.Tensor  # [NG + lnc * KB/G, G]: the token-major scratch row each slot writes (`_row_table`)
    top_k: int
    num_tokens: int
    num_experts: int
    lnc: int
    kb: int

    @classmethod
    def build(cls, topk_ids_TK: torch.Tensor, num_experts: int, block_size: int, lnc: int,
              tiles: int | None = None, halves: bool = False):
        """(slot plan at granule G, kernel plan) for the model's `block_size` (kernel block `kernel_block_size`);
        `tiles`, `halves`: as `tiles_per_sub` gives them (tiles None: one sub-segment per expert)."""
        kb = kernel_block_size(block_size)
        G = slot_granule(kb)
        plan = plan_blocks(topk_ids_TK, num_experts, G, min_blocks=layout.tile_slots(kb) // G)
        return plan, cls.from_plan(plan, num_experts, lnc, kb, tiles, halves)

    @classmethod
    def from_plan(cls, plan: BlockPlan, num_experts: int, lnc: int, kb: int | None = None,
                  tiles: int | None = None, halves: bool = False) -> KernelPlan:
        """The kernels' tables for a slot plan at granule G (`plan.block_size`).

        Args:
            plan: `plan_blocks` at granule G, each expert padded to one resident tile (`BlockPlan`).
            num_experts: E.
            lnc: logical cores the kernels launch on.
            kb: KB, slots of a full kernel block: G times a power of two (None: G).
            tiles: resident tiles the backward holds per sub-segment (`tiles_per_sub`; None: one sub-segment per
                expert).
            halves: sub-segments alternate between main tiles [0, tiles) and [tiles, 2 * tiles) (the backward
                holds both), each gathering the next one's first full block before its weight-gradient phase.

        Raises:
            ValueError: KB is not G times a power of two, fewer experts than cores, `tiles` cannot hold one
                full block and the tails, or halves without `tiles`.
        """
        G = plan.block_size
        kb = G if kb is None else kb
        per_block = kb // G  # slot groups per full block
        if kb % G or per_block & (per_block - 1):
            raise ValueError(f"kernel block {kb} must be the slot granule {G} times a power of two")
        E = num_experts
        if lnc > E:
            raise ValueError(f"{E} experts on {lnc} logical cores: the NKI kernels give each core whole experts and "
                             f"need at least one per core; run at NEURON_LOGICAL_NC_CONFIG=1")
        L = per_block.bit_length()
        TS = layout.tile_slots(kb)
        # resident main tiles per piece of each class (0: a tail class narrower than a tile, with its own buffer)
        tiles_k = [B // TS if B >= TS else 0 for B in layout.piece_widths(kb, L)]
        NG = plan.max_blocks
        # full blocks per sub-segment: the sub-segment's main tiles (its full blocks, the main tail classes) fit
        blocks_per_sub = NG if tiles is None else (tiles - sum(tiles_k[1:])) // tiles_k[0]
        if blocks_per_sub < 1:
            raise ValueError(f"{tiles} resident tiles per sub-segment cannot hold one {kb}-slot block and the tails: "
                             "use a smaller model.moe_block_size")
        if halves and tiles is None:
            raise ValueError("halves needs the resident tiles per sub-segment (`tiles_per_sub`)")
        experts = _pieces_per_expert(plan, E, per_block, L)
        cores = _deal_to_cores(experts.groups_E, lnc)
        subs = _sub_segments(experts, cores, blocks_per_sub, max(1, NG // per_block), tiles_k)
        runs = _run_order(cores, subs, tiles if halves else 0)
        noop_group = NG + per_block * torch.arange(lnc, device=cores.own.device)  # each core's KB-slot no-op area
        columns, sub_cols, next_group = _piece_table(experts, cores, subs, runs, tiles_k, noop_group, NG, per_block,
                                                     G)
        seg_table, sub_table = _segment_tables(E, cores, subs, runs, sub_cols, next_group, L)
        positions = -(-cores.nseg // lnc)
        rows = columns[PieceCol.GROUP].shape[0]
        fetch = _prefetch_flags(rows, seg_table, positions, lnc, L)
        for m in range(3):
            columns[PieceCol.FETCH + m] = fetch[:, m]
        columns[PieceCol.DOWN] = _down_flags(rows, subs, sub_cols, int(positions))[:, 0]
        tails = _tail_gathers(columns[PieceCol.GROUP], subs, sub_cols, tiles_k)
        for c in range(tails.shape[1]):
            columns[PieceCol.TAILS + c] = tails[:, c]
        piece = torch.stack([c.long() for c in _in_order(columns, PieceCol.COLS)], 1).to(torch.int32)
        zero_rows, zero_count = _zero_fill(experts.groups_E, lnc)
        T = plan.slot_of_assignment_TK.shape[0]
        token_index = F.pad(plan.token_index_N.view(NG, G), (0, 0, 0, lnc * per_block), value=T)  # no-op areas
        return cls(
            token_index=token_index.to(torch.int32),
            piece=piece,
            seg_table=seg_table,
            seg_count=(-(-cores.nseg // lnc)).view(1, 1).to(torch.int32),
            sub_table=sub_table,
            zero_rows=zero_rows,
            zero_count=zero_count,
            row_of_slot=_row_table(plan, lnc, per_block),
            top_k=plan.slot_of_assignment_TK.shape[1],
            num_tokens=T,
            num_experts=E,
            lnc=lnc,
            kb=kb,
        )

    def forward_tables(self) -> tuple[torch.Tensor, ...]:
        """piece, seg_table, seg_count: the forward kernel's arguments after token_index and slot_weight."""
        return (self.piece, self.seg_table, self.seg_count)

    def backward_tables(self) -> tuple[torch.Tensor, ...]:
        """piece, seg_table, seg_count, sub_table, zero_rows, zero_count: the backward kernel's arguments after
        token_index and slot_weight."""
        return (self.piece, self.seg_table, self.seg_count, self.sub_table, self.zero_rows, self.zero_count)

    def tables(self) -> tuple[torch.Tensor, ...]:
        """Every table either kernel takes (`forward_tables` + sub_table, zero_rows, zero_count), in that order."""
        return self.forward_tables() + self.backward_tables()[3:]

    def slot_weights(self, slot_weight_N: torch.Tensor) -> torch.Tensor:
        """The plan's [N] slot weights padded with the no-op areas' zeros (differentiable: grads slice back)."""
        return F.pad(slot_weight_N, (0, self.token_index.numel() - slot_weight_N.numel()))

    def pieces(self) -> list[tuple[int, int, int]]:
        """(core, slots, first slot row) of every piece the kernels run, no-op pieces included (their rows lie in
        the last lnc * KB slot rows); host-side, for tests and the cost report."""
        L = (self.seg_table.shape[1] - SegCol.HEAD) // 2
        S = self.seg_table.shape[0] // self.lnc
        out = []
        for c in range(self.lnc):
            for s in range(int(self.seg_count[0, 0])):
                row = self.seg_table[c * S + s]
                for k in range(L):
                    for j in range(int(row[SegCol.HEAD + 2 * k]), int(row[SegCol.HEAD + 1 + 2 * k])):
                        out.append((c, self.kb >> k, int(self.piece[j, 1])))
        return out

    def tokens(self, out: torch.Tensor) -> torch.Tensor:
        """[nT, TT, D] kernel output -> [T, D]."""
        return out.reshape(-1, out.shape[-1])[: self.num_tokens]


class _Experts(NamedTuple):
    """Full blocks and tail pieces of each expert (`_pieces_per_expert`)."""

    groups_E: torch.Tensor  # [E] slot groups of G
    real: torch.Tensor  # [NG] bool: the plan's groups that hold an expert's slots
    count_kE: list  # per class k: [E] pieces of KB >> k slots
    first_kE: list  # per class k: [E] the slot group of the expert's first piece of that class


class _Positions(NamedTuple):
    """The experts dealt to the cores (`_deal_to_cores`); [lnc, S] tensors, S positions per core."""

    S: int
    nseg: torch.Tensor  # 0-d: non-empty experts
    live: torch.Tensor  # [lnc, S] bool: the core has an expert of its own at the position
    own: torch.Tensor  # [lnc, S] that expert (meaningless where not live)
    expert: torch.Tensor  # [lnc, S] the expert whose weights the core loads (its own, else a spare)


class _SubSegments(NamedTuple):
    """Sub-segments of every position and the pieces each runs (`_sub_segments`)."""

    J: int  # static bound on sub-segments per expert
    blocks_per_sub: int
    nsub_cs: torch.Tensor  # [lnc, S] real sub-segments of the core's expert (0 where not live)
    nsub_s: torch.Tensor  # [S] sub-segments every core runs at the position
    runs: list  # per class k: [lnc, S, J] real pieces of each core, position, sub-segment
    m: list  # per class k: [S, J] pieces every core runs (real ones, then no-ops)
    ntiles_sj: torch.Tensor  # [S, J] resident main tiles each sub-segment fills
    tile0_k: list  # per class k: [S, J] first main tile of the class inside its sub-segment


class _RunOrder(NamedTuple):
    """The sub-segments in the order every core runs them (`_run_order`), indexed (position, sub-segment) flat."""

    base: torch.Tensor  # [S * J] its first resident main tile: 0, or `half` on every other sub-segment run
    gathered: torch.Tensor  # [S * J] bool: its first full block's rows are gathered by the sub-segment run before it
    early: torch.Tensor  # [S * J] bool: it gathers the first full block of the sub-segment run after it
    next_sj: torch.Tensor  # [S * J] the sub-segment run after it (after the last run one: S * J - 1, a valid row)


def _run_order(cores: _Positions, subs: _SubSegments, half: int) -> _RunOrder:
    """Where each sub-segment's main tiles start and which sub-segment gathers whose first block.

    With `half` > 0 the sub-segments run alternate between resident main tiles [0, half) and [half, 2 * half): the
    weight-gradient phase of one reads only its own half, so the one before it gathers the next sub-segment's first
    full block (when it has one) into the other half first, and that gather overlaps the phase instead of opening
    the next sub-segment (`backward.sub_segments`). `half` 0: every sub-segment from tile 0, no early gathers.
    """
    S, J = subs.m[0].shape
    dev = subs.nsub_s.device
    positions = -(-cores.nseg // cores.live.shape[0])
    run = ((torch.arange(J, device=dev)[None, :] < subs.nsub_s[:, None])
           & (torch.arange(S, device=dev)[:, None] < positions)).reshape(-1)
    r = run.long().cumsum(0) - 1  # run ordinal
    sj = torch.arange(S * J, device=dev)
    later = torch.where(run, sj, S * J).flip(0).cummin(0).values.flip(0)  # the first run one at or after sj
    next_sj = torch.cat([later[1:], later.new_full((1,), S * J)])
    has_next = next_sj < S * J
    next_sj = next_sj.clamp(max=S * J - 1)
    gathered = run & (r >= 1) & (subs.m[0].reshape(-1) >= 1) & (half > 0)
    return _RunOrder((r.clamp(min=0) % 2) * half, gathered, run & has_next & gathered[next_sj], next_sj)


def _pieces_per_expert(plan: BlockPlan, E: int, per_block: int, L: int) -> _Experts:
    """Each expert's n slot groups as n // (KB/G) full blocks plus a tail of at most one piece of each of KB/2, ...,
    G slots (the binary digits of n % (KB/G)).

    Args:
        plan: the slot plan at granule G (experts' groups consecutive, in expert order).
        E: experts.
        per_block: KB / G, slot groups per full block (a power of two).
        L: piece classes, log2(per_block) + 1.

    Returns:
        Groups per expert, the real groups, and per class the pieces of each expert and the first group of its
        first piece (class 0: the expert's first group; a tail piece follows the full blocks and the larger tail
        pieces).
    """
    NG = plan.max_blocks
    dev = plan.block_to_expert_B.device
    real = torch.arange(NG, device=dev) < plan.num_blocks
    groups_E = torch.zeros(E, dtype=torch.long, device=dev).index_add_(0, plan.block_to_expert_B, real.long())
    start_E = groups_E.cumsum(0) - groups_E
    full_E, tail_E = groups_E // per_block, groups_E % per_block
    count_kE = [full_E] + [((tail_E & (per_block >> k)) > 0).long() for k in range(1, L)]
    first_kE = [start_E] + [start_E + per_block * full_E + (tail_E & ~(2 * (per_block >> k) - 1))
                            for k in range(1, L)]
    return _Experts(groups_E, real, count_kE, first_kE)


def _deal_to_cores(groups_E: torch.Tensor, lnc: int) -> _Positions:
    """Split the experts across the cores: whole experts, sorted by group count (descending, empty ones last), dealt
    in rounds of lnc (round s: position s of every core, core (j + s) % lnc taking the round's j-th largest, so the
    larger expert alternates between the cores).

    Args:
        groups_E: [E] slot groups per expert.
        lnc: logical cores.

    Returns:
        The positions: per core and position its expert (if any) and the expert whose weights it loads there (a
        core without one loads its own first expert, else an empty one: its pieces there are all no-ops).
    """
    E, dev = groups_E.shape[0], groups_E.device
    order = torch.argsort(groups_E, descending=True, stable=True)
    nseg = (groups_E > 0).sum()
    S = -(-E // lnc)
    s_cs = torch.arange(S, device=dev)[None, :].expand(lnc, S)
    c_cs = torch.arange(lnc, device=dev)[:, None].expand(lnc, S)
    rank = s_cs * lnc + (c_cs - s_cs) % lnc
    live = rank < nseg
    own = order[rank.clamp(max=E - 1)]
    spare = torch.where(live[:, :1], own[:, :1], order[nseg.clamp(max=E - 1)])
    return _Positions(S, nseg, live, own, torch.where(live, own, spare))


def _sub_segments(experts: _Experts, cores: _Positions, blocks_per_sub: int, max_full: int,
                  tiles_k: list) -> _SubSegments:
    """Split each expert's pieces into sub-segments of at most `blocks_per_sub` full blocks (the tails go to its
    last one), and give every core the same sub-segment and piece counts at each position (the larger of the cores'
    counts; the core with fewer tops up with no-ops).

    Args:
        experts: the pieces of each expert.
        cores: the experts dealt to the cores.
        blocks_per_sub: full blocks a sub-segment's resident tiles hold.
        max_full: static bound on an expert's full blocks (NG // (KB/G), at least 1).
        tiles_k: resident main tiles per piece of each class (0 for a tail class with its own buffer).

    Returns:
        The sub-segments, their pieces per class and the first resident tile of each class inside them.
    """
    live, own = cores.live, cores.own
    J = -(-max_full // blocks_per_sub)
    nsub_E = ((experts.count_kE[0] + blocks_per_sub - 1) // blocks_per_sub).clamp(min=1)
    j_J = torch.arange(J, device=own.device)
    nsub_cs = torch.where(live, nsub_E[own], 0)
    full = experts.count_kE[0][own][..., None]
    runs = [torch.where(live[..., None], (full - blocks_per_sub * j_J).clamp(0, blocks_per_sub), 0)]
    last = j_J == (nsub_cs[..., None] - 1)
    runs += [torch.where(live[..., None] & last, count[own][..., None], 0) for count in experts.count_kE[1:]]
    m = [run.max(0).values for run in runs]
    ntiles_sj = sum(mk * tk for mk, tk in zip(m, tiles_k, strict=True))
    tile0_k = [ntiles_sj * 0]
    for k in range(1, len(m)):
        tile0_k.append(tile0_k[-1] + m[k - 1] * tiles_k[k - 1])
    return _SubSegments(J, blocks_per_sub, nsub_cs, nsub_cs.max(0).values.clamp(min=1), runs, m, ntiles_sj, tile0_k)


def _piece_table(experts: _Experts, cores: _Positions, subs: _SubSegments, runs: _RunOrder, tiles_k: list,
                 noop_group: torch.Tensor, NG: int, per_block: int, G: int) -> tuple[torch.Tensor, list, torch.Tensor]:
    """The `piece` table: per class k, per core, one row per piece slot of a static bound (class 0: the most full
    blocks an expert can have; a tail class: one per sub-segment a core can run), in run order (position,
    sub-segment). A row past a sub-segment's real pieces is a no-op piece in the core's own no-op area.

    Args:
        experts, cores, subs, runs: the pieces, the positions, the sub-segments and their run order.
        tiles_k: resident main tiles per piece of each class.
        noop_group: [lnc] the first slot group of each core's KB-slot no-op area.
        NG: the plan's slot groups; per_block: KB / G; G: the slot granule.

    Returns:
        The columns GROUP, ROW, TILE, OWN and NEXT of `piece` ([M + 2] each, by `PieceCol`; OWN: 1 where the
        backward piece gathers its own rows (the first of a main-tile class loop), NEXT: 1 where the next row is in
        the same main-tile class loop (the backward piece gathers its rows); the last two rows padding rows in core
        0's no-op area: the forward gathers the rows of `piece` row j + 1 while it computes row j, and each piece
        loads rows j + 1, j + 2 ahead), per class two [lnc, S * J] columns: each sub-segment's [begin, end) rows of
        `piece`, and [lnc, S * J] the slot group of the first full block of the sub-segment run after each (what an
        early gather reads).
    """
    lnc, S, J = cores.live.shape[0], cores.S, subs.J
    dev = noop_group.device
    rows_k = [max(1, NG // per_block)] + [S * min(J, lnc)] * (len(tiles_k) - 1)
    groups, tile_col, first_col, next_col, sub_cols = [], [], [], [], []
    base = 0
    for k in range(len(tiles_k)):
        m_flat = subs.m[k].reshape(-1)  # (position, sub-segment) in run order
        end_q = m_flat.cumsum(0)
        beg_q = end_q - m_flat
        q = torch.arange(rows_k[k], device=dev)
        sj = torch.searchsorted(end_q, q, right=True).clamp(max=S * J - 1)
        s_q, j_q = sj // J, sj % J
        t_q = q - beg_q[sj]  # index of the row's piece among those of its sub-segment
        for c in range(lnc):
            e_q = cores.expert[c, s_q]
            is_real = cores.live[c, s_q] & (t_q < subs.runs[k][c, s_q, j_q])
            offset = per_block * (j_q * subs.blocks_per_sub + t_q) if k == 0 else 0
            groups.append(torch.where(is_real, experts.first_kE[k][e_q] + offset, noop_group[c]))
            tile_col.append(subs.tile0_k[k].reshape(-1)[sj] + runs.base[sj] + t_q * tiles_k[k] if tiles_k[k]
                            else torch.zeros_like(q))
            # the backward's software pipeline over a main-tile class loop (one sub-segment's pieces of the class):
            # its first piece gathers its own rows (unless the sub-segment before gathered a full block's early),
            # each piece the next one's while it computes
            main = tiles_k[k] > 0
            early = runs.gathered[sj] if k == 0 else torch.zeros_like(q, dtype=torch.bool)
            first_col.append(((q == beg_q[sj]) & (q < end_q[sj]) & main & ~early).long())
            next_col.append(((q + 1 < end_q[sj]) & main).long())
        if k == 0:  # the first full block of the sub-segment run after each, per core
            first_of = beg_q[runs.next_sj].clamp(max=rows_k[0] - 1)
            next_group = torch.stack([groups[c][first_of] for c in range(lnc)])
        cbase = base + rows_k[k] * torch.arange(lnc, device=dev)[:, None]
        sub_cols += [cbase + beg_q[None, :], cbase + end_q[None, :]]
        base += lnc * rows_k[k]
    group = torch.cat(groups + [noop_group[:1]] * 2)  # + the padding rows the last rows' prefetches read
    for col in (tile_col, first_col, next_col):
        col.append(torch.zeros(2, dtype=col[0].dtype, device=dev))
    columns = {PieceCol.GROUP: group, PieceCol.ROW: group * G, PieceCol.TILE: torch.cat(tile_col),
               PieceCol.OWN: torch.cat(first_col), PieceCol.NEXT: torch.cat(next_col)}
    return columns, sub_cols, next_group


def _in_order(columns: dict, n: int) -> list:
    """The columns 0 .. n - 1 of a table, given by their names (`columns`: column index -> values)."""
    missing = sorted(set(range(n)) - set(columns))
    if missing:
        raise AssertionError(f"table columns {missing} were never built")
    return [columns[c] for c in range(n)]


def _segment_tables(E: int, cores: _Positions, subs: _SubSegments, runs: _RunOrder, sub_cols: list,
                    next_group: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`seg_table` and `sub_table`. A sub-segment writes dW of its expert (the first) or adds into it (the later
    ones, `cont` 1); a no-op or spare sub-segment writes and adds into its core's dummy row E + core.

    Args:
        E: experts; cores, subs, runs: the positions, the sub-segments and their run order.
        sub_cols: per class the [begin, end) `piece` rows of each sub-segment (`_piece_table`).
        next_group: [lnc, S * J] the slot group of the next run sub-segment's first full block (`_piece_table`).
        L: piece classes.

    Returns:
        seg_table [lnc * S, 7 + 2L] (expert, [begin, end) sub_table rows, the expert whose weights both kernels
        prefetch during the position: the core's next position's, its own at the last; the forward's weight set
        of the position (s % 2) and of the next (1 - s % 2); the row of the core's next position (both kernels
        load it ahead; at the core's last position a valid row never run); per class the position's
        [begin, end) piece rows: from its first sub-segment's begin to its last one's end) and sub_table
        [lnc * S * J, 11 + 2L] (write row, add row, cont, resident main tiles [first, end) as first, first + 1,
        end, load: 1 on the position's last sub-segment, which loads the next expert's weights during its
        weight-gradient phase; early: 1 where it gathers the next run sub-segment's first full block, that block's
        slot group and first tile (`_run_order`); the row of the core's next run sub-segment (after the core's
        last, some valid row: the backward loads the next row ahead); per class [begin, end) piece rows), int32.
    """
    live, own, S, J = cores.live, cores.own, cores.S, subs.J
    lnc, dev = live.shape[0], live.device
    dummy = E + torch.arange(lnc, device=dev)[:, None, None]
    core_S = (torch.arange(lnc, device=dev) * S)[:, None]  # each core's first seg_table row
    j_J = torch.arange(J, device=dev)
    first_sub = live[..., None] & (j_J == 0)
    cont_sub = live[..., None] & (j_J >= 1) & (j_J < subs.nsub_cs[..., None])
    own3 = own[..., None].expand(lnc, S, J)
    load = (j_J == (subs.nsub_s - 1)[:, None]).long()  # [S, J]: the position's last sub-segment (every core's)
    base = runs.base.view(1, S, J).expand(lnc, S, J)
    per_sj = [runs.early.long(), runs.base[runs.next_sj]]  # the early gather: flag, first tile (its group per core)
    sub_head = {SubCol.WRITE: torch.where(first_sub, own3, dummy), SubCol.ADD: torch.where(cont_sub, own3, dummy),
                SubCol.CONT: (j_J >= 1).long().expand(lnc, S, J), SubCol.TILE_FIRST: base,
                SubCol.TILE_BEGIN: base + 1, SubCol.TILE_END: base + subs.ntiles_sj[None],
                SubCol.LOAD: load[None].expand(lnc, S, J), SubCol.EARLY: per_sj[0].view(1, S, J).expand(lnc, S, J),
                SubCol.EARLY_GROUP: next_group.view(lnc, S, J),
                SubCol.EARLY_TILE: per_sj[1].view(1, S, J).expand(lnc, S, J),
                SubCol.NEXT_ROW: core_S[..., None] * J + runs.next_sj.view(1, S, J)}  # the core's next run one
    sub_table = torch.stack(_in_order(sub_head, SubCol.HEAD) + [col.view(lnc, S, J) for col in sub_cols], 3)
    sub_begin = (torch.arange(lnc * S, device=dev) * J).view(lnc, S)
    last_sub = (subs.nsub_s - 1)[None, :, None].expand(lnc, S, 1)
    nxt = torch.cat([cores.expert[:, 1:], cores.expert[:, -1:]], 1)  # the core's next position's expert
    pick = (torch.arange(S, device=dev) % 2)[None].expand(lnc, S)  # the forward's weight set, alternating
    next_pos = core_S + (torch.arange(S, device=dev) + 1).clamp(max=S - 1)[None]  # the core's next position's row
    seg_head = {SegCol.EXPERT: cores.expert, SegCol.SUB_BEGIN: sub_begin,
                SegCol.SUB_END: sub_begin + subs.nsub_s[None, :], SegCol.NEXT_EXPERT: nxt, SegCol.SET: pick,
                SegCol.NEXT_SET: 1 - pick, SegCol.NEXT_ROW: next_pos}
    seg_cols = _in_order(seg_head, SegCol.HEAD)
    seg_cols += [col.view(lnc, S, J)[:, :, 0] if i % 2 == 0 else col.view(lnc, S, J).gather(2, last_sub)[..., 0]
                 for i, col in enumerate(sub_cols)]
    return (torch.stack(seg_cols, 2).reshape(lnc * S, SegCol.HEAD + 2 * L).to(torch.int32),
            sub_table.reshape(lnc * S * J, SubCol.HEAD + 2 * L).to(torch.int32))


def _prefetch_flags(rows: int, seg_table: torch.Tensor, positions, lnc: int, L: int) -> torch.Tensor:
    """`piece`'s forward columns FETCH + m (m = gate, up, down) [rows, 3] int32: 1 on the piece that loads that
    matrix of its core's next position's expert into the other weight set. A position's n pieces (class by class,
    in run order) share the three loads: matrix m on its piece floor(m * n / 3), so the DMA engines, which serve
    their packets in order, carry one matrix at a time between the pieces' own transfers. None at a core's last
    position run (`positions`)."""
    S = seg_table.shape[0] // lnc
    bounds = seg_table[:, SegCol.HEAD:].view(lnc * S, L, 2).long()  # per class [begin, end) piece rows
    n_k = bounds[..., 1] - bounds[..., 0]
    ends = n_k.cumsum(1)
    n = ends[:, -1]
    m = torch.arange(3, device=seg_table.device)
    o = m[None, :] * n[:, None] // 3  # [lnc * S, 3]: the piece (its ordinal in the position) loading matrix m
    k = (o[:, :, None] >= ends[:, None, :]).sum(2).clamp(max=L - 1)  # its class
    row = bounds[..., 0].gather(1, k) + o - (ends - n_k).gather(1, k)
    live = ((torch.arange(lnc * S, device=seg_table.device) % S + 1 < positions) & (n > 0))[:, None].expand(-1, 3)
    flags = torch.zeros(rows, 3, dtype=torch.int32, device=seg_table.device)
    flags[row[live], m.expand(lnc * S, 3)[live]] = 1
    return flags


def _down_flags(rows: int, subs: _SubSegments, sub_cols: list, positions: int) -> torch.Tensor:
    """`piece`'s backward column DOWN [rows, 1] int32: 1 on the last piece every core runs in each position's last
    sub-segment (`load` in sub_table: the one that prefetches the next position's weights). That piece's dh
    projection is the position's last read of the resident down matrix, so it loads the next expert's right after
    it, while its own SwiGLU backward and dx keep the Tensor Engine busy, instead of in the HBM-bound
    weight-gradient phase beside the gate and up matrices (`backward.backward_block`).

    Args:
        rows: rows of `piece`.
        subs: the sub-segments (`_sub_segments`); sub_cols: per class the [begin, end) `piece` rows of each
            (`_piece_table`), [lnc, S * J] each.
        positions: positions run (`seg_count`).
    """
    J, L = subs.m[0].shape[1], len(subs.m)
    sj = torch.arange(positions, device=sub_cols[0].device) * J + subs.nsub_s[:positions] - 1  # last sub-segments
    last, runs = _last_piece_rows(subs, sub_cols, range(L), sj)
    if not bool(runs.all()):
        raise AssertionError("a position's last sub-segment runs no piece")
    flags = torch.zeros(rows, 1, dtype=torch.int32, device=sj.device)
    flags[last.reshape(-1)] = 1
    return flags


def _last_piece_rows(subs: _SubSegments, sub_cols: list, classes, sj: torch.Tensor):
    """The `piece` row of the last piece each sub-segment `sj` runs among `classes` (the classes run in order).

    Returns:
        rows [lnc, len(sj)] (per core; where none runs, a row of another sub-segment) and whether one runs,
        [len(sj)] bool (every core runs the same pieces: `subs.m`).
    """
    runs = torch.stack([subs.m[k].reshape(-1)[sj] for k in classes], 1) > 0  # [len(sj), classes]
    last = runs.shape[1] - 1 - runs.flip(1).long().argmax(1)
    ends = torch.stack([sub_cols[2 * k + 1][:, sj] for k in classes], 2)  # [lnc, len(sj), classes]
    return ends.gather(2, last[None, :, None].expand(ends.shape[0], -1, 1))[..., 0] - 1, runs.any(1)


def _tail_gathers(group_col: torch.Tensor, subs: _SubSegments, sub_cols: list, tiles_k: list) -> torch.Tensor:
    """`piece`'s backward columns TAILS.. [rows, 2 * layout.TAIL_BUFFERS] int32: per tail buffer (the classes
    narrower than a resident tile, in class order) a flag and a slot group, set on the last main-tile piece of each
    sub-segment that runs a piece of that class: that piece gathers the tail piece's x and dy rows into the tail
    buffer while it computes, as it would the next piece of its own loop, so the tail piece does not open with its
    own gather (on GpSimd's in-order queue behind the main piece's row scatter).

    Args:
        group_col: `piece`'s GROUP column (each row's slot group).
        subs: the sub-segments; sub_cols: per class the [begin, end) `piece` rows of each, [lnc, S * J] each.
        tiles_k: resident main tiles per piece of each class (0: a tail buffer class).
    """
    rows, dev = group_col.shape[0], group_col.device
    lnc, L = sub_cols[0].shape[0], len(tiles_k)
    main = [k for k in range(L) if tiles_k[k] > 0]
    tails = [k for k in range(L) if tiles_k[k] == 0]
    out = torch.zeros(rows, 2 * layout.TAIL_BUFFERS, dtype=torch.int32, device=dev)
    if not tails:
        return out
    gatherer, runs = _last_piece_rows(subs, sub_cols, main, torch.arange(subs.m[0].numel(), device=dev))
    for i in range(len(tails)):
        has = (subs.m[tails[i]].reshape(-1) > 0)[None, :].expand(lnc, -1)
        if bool((has & ~runs[None, :]).any()):
            raise AssertionError("a sub-segment runs a tail piece but no main-tile piece to gather its rows")
        group = group_col[sub_cols[2 * tails[i]].clamp(max=rows - 1)]  # the tail piece's slot group (0/1 per sub)
        out[gatherer[has], 2 * i] = 1
        out[gatherer[has], 2 * i + 1] = group[has].to(torch.int32)
    return out


def _zero_fill(groups_E: torch.Tensor, lnc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dW rows each core zero-fills: its dummy row E + core, then every lnc-th empty expert (padded with the
    dummy), so every core runs the same count.

    Returns:
        zero_rows [lnc * Z, 1] and zero_count [1, 1], int32 (Z = 1 + ceil(E / lnc)).
    """
    E, dev = groups_E.shape[0], groups_E.device
    Z = 1 + -(-E // lnc)
    empty = groups_E == 0
    erank = empty.long().cumsum(0) - 1
    where = torch.where(empty, (erank % lnc) * Z + 1 + erank // lnc, lnc * Z)  # the extra row: a dump
    dummies = (E + torch.arange(lnc, device=dev))[:, None].expand(lnc, Z).reshape(-1)
    zero_rows = torch.cat([dummies, dummies[:1]]).scatter(0, where, torch.arange(E, device=dev))[:-1]
    zero_count = 1 + (empty.sum() + lnc - 1) // lnc
    return zero_rows.view(lnc * Z, 1).to(torch.int32), zero_count.view(1, 1).to(torch.int32)


def _row_table(plan: BlockPlan, lnc: int, per_block: int) -> torch.Tensor:
    """row_of_slot [NG + lnc * KB/G, G] int32: the token-major scratch row of each slot (`layout.assignment_rows`):
    t * K + k for the slot of assignment (t, k); past the nT * TT * K rows of the token tiles, one row each for the
    padding slots and then the cores' no-op areas, in slot order (every row at most once: no two DMAs of the two
    cores write one row)."""
    T, K = plan.slot_of_assignment_TK.shape
    nT, TT = layout.token_tiles(T, lnc)
    G = plan.block_size
    a = F.pad(plan.assignment_of_slot_N, (0, lnc * per_block * G), value=T * K)  # + the no-op areas
    spare = a == T * K
    rows = torch.where(spare, nT * TT * K + torch.cumsum(spare, 0) - 1, a)
    return rows.view(-1, G).to(torch.int32)
