"""Blockwise MoE: plan invariants, reference vs dense oracle vs Hugging Face, NKI kernels (emulated) vs reference."""

import math

import numpy as np
import pytest
import torch

from workbench.core.moe_blocks import kernel_block_size
from workbench.kernels import (
    blockwise_moe,
    blockwise_moe_auto,
    blockwise_moe_nki,
    dense_moe_oracle,
    max_blocks,
    plan_blocks,
    route,
)
from workbench.kernels.nki_api import REAL_NKI


def make_case(T, K, E, D, F, dtype=torch.float32, ids=None, seed=0):
    """Random x, routing and weights scaled so activations are O(1); ids overrides the router's choice."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    weights, topk = route(torch.randn(T, E, generator=g), K)
    if ids is not None:
        topk = torch.as_tensor(ids, dtype=torch.long).view(T, K)
    w_gate = torch.randn(E, F, D, generator=g) * D ** -0.5
    w_up = torch.randn(E, F, D, generator=g) * D ** -0.5
    w_down = torch.randn(E, D, F, generator=g) * F ** -0.5
    leaves = [t.to(dtype).requires_grad_() for t in (x, weights, w_gate, w_up, w_down)]
    return leaves[0], topk, *leaves[1:]


def outputs_and_grads(fn, case, **kwargs):
    x, ids, w, wg, wu, wd = case
    out = fn(x, ids, w, wg, wu, wd, **kwargs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return (out, *torch.autograd.grad(out, (x, w, wg, wu, wd), grad_out))


def reference_via_fp32(case, **kwargs):
    """`outputs_and_grads(blockwise_moe, case)` computed in fp32 from the same inputs and output gradient (both
    exact in fp32), rounded to the case's dtype: the exact answer, where a bf16 CPU backward of the reference takes
    ~30 s at D = 4096."""
    x, ids, w, wg, wu, wd = case
    up = [t.detach().float().requires_grad_() for t in (x, w, wg, wu, wd)]
    out = blockwise_moe(up[0], ids, *up[1:], **kwargs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(x.dtype).float()
    return tuple(t.to(x.dtype) for t in (out, *torch.autograd.grad(out, up, grad_out)))


NAMES = ("out", "dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down")


def nki_at(lnc, monkeypatch):
    """`blockwise_moe_nki` with the compiler's LNC set to `lnc` (the kernels launch on that many cores)."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(lnc))
    return blockwise_moe_nki


def assert_match(got, want, rtol):
    """Max error relative to the reference's max magnitude, per tensor."""
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        err = (a.float() - b.float()).abs().max().item()
        scale = max(b.float().abs().max().item(), 1e-6)
        assert err <= rtol * scale, f"{name}: max error {err:.3g} > {rtol} * {scale:.3g}"


# (T, K, E, D, F, block_size, ids): every edge case the blockwise layout has to get right.
EDGE_CASES = {
    "t1": (1, 2, 4, 8, 12, 4, None),
    "tk_not_multiple_of_block": (7, 2, 4, 8, 12, 3, None),
    "empty_experts": (6, 1, 8, 8, 12, 4, [1, 1, 5, 5, 5, 1]),
    "expert_with_one_token": (5, 2, 4, 8, 12, 4, [0, 1, 1, 2, 1, 2, 2, 3, 1, 2]),
    "all_on_one_expert": (9, 1, 4, 8, 12, 4, [2] * 9),
    "block_of_128": (10, 3, 4, 8, 8, 128, None),
    "two_sub_tiles_and_multi_tile_D_F": (9, 2, 3, 136, 130, 256, None),
    # 150 / 70 / 30 / 50 slots: full 128-blocks plus 32-, 64- and 64+32-slot tail pieces
    "full_blocks_and_tail_pieces": (150, 2, 4, 16, 24, 128, [0, 1] * 70 + [0, 2] * 30 + [0, 3] * 50),
    "tail_pieces_of_256_blocks": (150, 2, 4, 16, 24, 256, [0, 1] * 70 + [0, 2] * 30 + [0, 3] * 50),
}


@pytest.mark.parametrize("name", EDGE_CASES)
def test_reference_matches_dense_oracle(name):
    T, K, E, D, F, bs, ids = EDGE_CASES[name]
    case = make_case(T, K, E, D, F, ids=ids)
    assert_match(outputs_and_grads(blockwise_moe, case, block_size=bs), outputs_and_grads(dense_moe_oracle, case),
                 rtol=1e-5)


def test_reference_portable_bmm_path_matches_grouped_mm(monkeypatch):
    """fp32 on CUDA / under torch.compile takes the per-block bmm path instead of torch._grouped_mm."""
    from workbench.kernels import moe_reference

    T, K, E, D, F, bs, ids = EDGE_CASES["empty_experts"]
    case = make_case(T, K, E, D, F, ids=ids)
    want = outputs_and_grads(blockwise_moe, case, block_size=bs)
    monkeypatch.setattr(moe_reference, "_grouped_mm_supported", lambda x: False)
    assert_match(outputs_and_grads(blockwise_moe, case, block_size=bs), want, rtol=1e-5)


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("name", EDGE_CASES)
def test_nki_kernels_match_reference_fp32(name, lnc, monkeypatch):
    """Through the emulator here; through the real nki.simulate where `nki` imports (see nki_api)."""
    T, K, E, D, F, bs, ids = EDGE_CASES[name]
    case = make_case(T, K, E, D, F, ids=ids)
    assert_match(outputs_and_grads(nki_at(lnc, monkeypatch), case, block_size=bs),
                 outputs_and_grads(blockwise_moe, case, block_size=bs), rtol=1e-5)


@pytest.mark.skipif(REAL_NKI, reason="with the real nki, kernels run under nki.simulate, fed fp32 numpy only")
@pytest.mark.parametrize("T,K,E,D,F,bs,lnc", [(12, 2, 4, 16, 24, 4, 1), (10, 2, 3, 32, 40, 8, 2),
                                              (6, 2, 4, 136, 24, 256, 2), (150, 2, 4, 32, 40, 128, 2)])
def test_nki_kernels_match_reference_bf16(T, K, E, D, F, bs, lnc, monkeypatch):
    case = make_case(T, K, E, D, F, dtype=torch.bfloat16)
    assert_match(outputs_and_grads(nki_at(lnc, monkeypatch), case, block_size=bs),
                 outputs_and_grads(blockwise_moe, case, block_size=bs), rtol=2e-2)


@pytest.mark.parametrize("bs", [128, 384])
def test_nki_kernels_128_experts_large_blocks_lnc2(bs, monkeypatch):
    """E = 128 (30B-A3B's expert count) with 128..512-slot blocks (384 = 3 x 128 kernel blocks per plan block)
    at LNC 2: ~80 expert segments split over two cores (512 runs in the 30B-A3B shape test)."""
    case = make_case(16, 8, 128, 8, 16, seed=bs)
    assert_match(outputs_and_grads(nki_at(2, monkeypatch), case, block_size=bs),
                 outputs_and_grads(blockwise_moe, case, block_size=bs), rtol=1e-5)


SBUF_PARTITION = 212_464  # trn2 usable SBUF bytes per partition (the emulator's sbuf-capacity limit)


@pytest.mark.skipif(REAL_NKI, reason="with the real nki, kernels run under nki.simulate, fed fp32 numpy only")
@pytest.mark.parametrize("F,dtype,lnc,bs", [(768, torch.float32, 1, 64), (768, torch.float32, 2, 64),
                                            (768, torch.bfloat16, 2, 256), (1536, torch.bfloat16, 2, 128)])
def test_nki_kernels_d4096_tile_f_to_fit_sbuf(F, dtype, lnc, bs, monkeypatch):
    """D = 4096 (F = 768: Qwen3-30B-A3B-style experts at twice the width; F = 1536: 235B-A22B): the backward's five
    resident matrices do not fit whole (240 KiB/partition in bf16), so the kernels keep one F chunk resident at a
    time and accumulate dx / y / d_affinity partial sums across chunks. Forward + all five grads vs the reference,
    and the emulator's SBUF high-water mark stays under the usable 212,464 B/partition. In fp32 (not a trn2 run:
    trn2 trains in bf16) 128-slot blocks no longer fit the usable SBUF (test_sbuf_fit.py), so those cases use 64."""
    from workbench.kernels.nki_emulator import counters

    case = make_case(6, 2, 3, 4096, F, dtype=dtype, seed=F)
    with counters() as c:
        got = outputs_and_grads(nki_at(lnc, monkeypatch), case, block_size=bs)
    assert_match(got, reference_via_fp32(case, block_size=bs), rtol=1e-5 if dtype == torch.float32 else 2e-2)
    assert 0 < c.sbuf_peak <= SBUF_PARTITION, c.sbuf_peak


@pytest.mark.skipif(REAL_NKI, reason="the emulator's SBUF accounting is what is under test")
def test_untiled_backward_at_d4096_overflows_sbuf(monkeypatch):
    """Without F chunks (the three matrices resident whole, with their resident tiles) the D = 4096 backward is
    stopped by the emulator's SBUF accounting, not by anything in the kernel."""
    from workbench.kernels import nki_moe
    from workbench.kernels.nki_emulator import NkiRuleError

    def untiled(D, F, io, widths):
        return F, nki_moe.tiles_needed(widths)

    monkeypatch.setattr(nki_moe.layout, "fit_backward", untiled)
    x, ids, w, wg, wu, wd = make_case(2, 1, 1, 4096, 768, dtype=torch.bfloat16)
    out = blockwise_moe_nki(x, ids, w, wg, wu, wd, block_size=128)  # LNC 1; the forward fits whole (144 KiB)
    with pytest.raises(NkiRuleError, match=r"\[sbuf-capacity\]"):
        out.sum().backward()


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("name", ["two_sub_tiles_and_multi_tile_D_F", "tk_not_multiple_of_block", "empty_experts",
                                  "full_blocks_and_tail_pieces"])
def test_nki_kernels_f_chunked_match_reference_fp32(name, lnc, monkeypatch):
    """Forced F chunks at small shapes (chunks of 128 and a short last one when F = 130; one chunk per f-tile
    otherwise): the partial-sum paths (y, dx, d_affinity, dW row/column windows) within 1e-5 of the reference."""
    from workbench.kernels import nki_moe

    monkeypatch.setattr(nki_moe.layout, "RESIDENT_WEIGHT_BYTES", 1)
    T, K, E, D, F, bs, ids = EDGE_CASES[name]
    case = make_case(T, K, E, D, F, ids=ids)
    assert_match(outputs_and_grads(nki_at(lnc, monkeypatch), case, block_size=bs),
                 outputs_and_grads(blockwise_moe, case, block_size=bs), rtol=1e-5)


@pytest.mark.parametrize("bs,tiles,lnc,halves", [(128, 1, 1, True), (128, 1, 2, False), (128, 1, 2, True),
                                                 (256, 3, 2, True)])
def test_nki_kernels_sub_segments_match_reference_fp32(bs, tiles, lnc, halves, monkeypatch):
    """Experts with more resident tiles than the backward holds run as sub-segments (forced here by capping the
    tiles per sub-segment): the first writes dW[e], the later ones add into it with dma_compute, the other core
    runs no-op sub-segments into its dummy row; with `halves` they alternate between two halves of the resident
    tiles, each gathering the next one's first block early. All five grads within 1e-5 of the reference."""
    from workbench.kernels import autograd

    monkeypatch.setattr(autograd, "tiles_per_sub", lambda *args: (tiles, halves))
    T = 300 if bs == 128 else 540
    ids = [[0, 1 + t % 3] for t in range(T)]  # expert 0: T slots (2 full blocks + a tail), 1..3: T / 3 each
    case = make_case(T, 2, 4, 16, 24, ids=ids)
    assert_match(outputs_and_grads(nki_at(lnc, monkeypatch), case, block_size=bs),
                 outputs_and_grads(blockwise_moe, case, block_size=bs), rtol=1e-5)


@pytest.mark.parametrize("dtype,lnc", [(torch.bfloat16, 2), (torch.float32, 1)])
def test_saved_for_backward_lists_what_the_forward_kernel_saves(dtype, lnc, monkeypatch):
    """`autograd.saved_for_backward` (what the memory plan counts) names exactly the tensors, shapes and dtypes the
    forward kernel hands the backward."""
    from workbench.kernels import autograd

    seen = {}
    forward = autograd.HOST_KERNELS.forward

    def spy(*args):
        outs = forward(*args)
        seen["saved"] = outs[1:]
        return outs

    monkeypatch.setattr(autograd, "HOST_KERNELS", autograd.Kernels(spy, autograd.HOST_KERNELS.backward))
    T, K, E, D, F, bs, ids = EDGE_CASES["tail_pieces_of_256_blocks"]
    x, ids, w, wg, wu, wd = make_case(T, K, E, D, F, dtype=dtype, ids=ids)
    nki_at(lnc, monkeypatch)(x, ids, w, wg, wu, wd, block_size=bs)
    got = [(name, tuple(t.shape), t.dtype) for name, t in zip(("g_saved", "u_saved"), seen["saved"], strict=True)]
    assert got == autograd.saved_for_backward(T, K, E, F, bs, lnc, dtype)


@pytest.mark.skipif(REAL_NKI, reason="the emulator's counters are what is under test")
@pytest.mark.parametrize("lnc", [1, 2])
def test_emulator_counts_padding_slots_computed(lnc, monkeypatch):
    """Expert 0 gets 3 tokens, expert 1 gets 2, blocks of 4: the kernels compute 2 blocks = 8 slots of which
    1 + 2 = 3 are padding (they read x_pad's zero row). The emulator counts that itself from the backward's row
    gathers (x_pad and dout_pad each once per block); the forward's gathers also read the rows its software pipeline
    prefetches for pieces a class loop then does not run (each class's first row, the row after its last)."""
    from workbench.kernels.nki_emulator import counters

    x, ids, w, wg, wu, wd = make_case(5, 1, 2, 8, 12, ids=[0, 0, 0, 1, 1])
    with counters() as cf:
        out = nki_at(lnc, monkeypatch)(x, ids, w, wg, wu, wd, block_size=4)
    with counters() as cb:
        out.sum().backward()
    assert cf.gathered_rows["arg0"] > 8 and cf.padding_rows["arg0"] >= 3
    assert (cb.gathered_rows["arg0"], cb.padding_rows["arg0"]) == (8, 3)
    assert (cb.gathered_rows["arg1"], cb.padding_rows["arg1"]) == (8, 3)


@pytest.mark.parametrize("bs,lnc,tiles,halves", [(128, 2, None, False), (256, 2, None, False), (128, 1, None, False),
                                                 (8, 2, None, False), (256, 2, 3, False), (128, 2, 2, False),
                                                 (128, 1, 1, False), (128, 2, 2, True), (256, 2, 3, True),
                                                 (128, 1, 1, True)])
def test_kernel_plan_same_trip_counts_on_both_cores(bs, lnc, tiles, halves):
    """Each non-empty expert is one segment on one core (one dW writer); its slots, padded to the 32-slot granule
    and to one resident tile, are covered exactly once by full KB blocks plus at most one tail piece of each of
    KB/2 .. 32 slots. An expert with more resident tiles than `tiles` runs as several sub-segments, the first
    writing dW[e], the later ones adding into it. Every core runs the same number of segment positions, of
    sub-segments per position and, per sub-segment and width class, of pieces: the extra ones are no-op pieces
    inside that core's own no-op area and no-op sub-segments writing its dummy dW row. Sorting experts by size keeps
    them few; the cores' real slot groups balance to within one segment. With `halves`, the sub-segments a core
    runs alternate between main tiles [0, tiles) and [tiles, 2 * tiles), and each gathers the next one's first full
    block (when it has one) early: that piece does not gather its own rows."""
    from workbench.kernels import nki_moe
    from workbench.kernels.nki_moe import PieceCol, SegCol, SubCol
    from workbench.kernels.nki_moe.tables import KernelPlan

    T, K, E = 400, 4, 8
    _, ids, *_ = make_case(T, K, E, 4, 4, seed=bs)
    ids[:, 0] = 5  # uneven experts: 5 gets > 512 slots (several sub-segments under a tile cap), ...
    ids = torch.where(ids == 7, 6, ids)  # ... 7 none (an empty expert), ...
    ids[0, 3] = 7 if bs == 8 else ids[0, 3]  # ... or, at bs 8, one token (padded to one whole resident tile)
    plan, kp = KernelPlan.build(ids, E, bs, lnc, tiles, halves)
    G, ng = plan.block_size, plan.max_blocks
    r = kp.kb // G
    ts = nki_moe.tile_slots(kp.kb)
    L = (kp.seg_table.shape[1] - SegCol.HEAD) // 2
    widths = nki_moe.piece_widths(kp.kb, L)
    assert G == min(32, bs) and kp.kb == kernel_block_size(bs)
    assert kp.token_index.shape == (ng + lnc * r, G) and (kp.token_index[ng:] == T).all()
    counts_E = torch.bincount(ids.reshape(-1), minlength=E)
    S = kp.seg_table.shape[0] // lnc
    positions = int(kp.seg_count[0, 0])
    assert positions == -(-int((counts_E > 0).sum()) // lnc)
    seen = torch.zeros(ng * G, dtype=torch.long)
    real_groups, noop_pieces, writers, adders, subs_of = [0] * lnc, 0, {}, {}, {}
    order = [[] for _ in range(lnc)]  # per core, its sub-segments in run order: (sub row, first full block's row)
    for s in range(positions):
        seg = [kp.seg_table[c * S + s] for c in range(lnc)]
        # the same number of sub-segments on every core
        assert len({int(row[SegCol.SUB_END] - row[SegCol.SUB_BEGIN]) for row in seg}) == 1
        for c in range(lnc):
            row = seg[c]
            e = int(row[SegCol.EXPERT])
            # the weights both kernels prefetch: the core's next position's expert (its own at the last), the
            # forward into the other of its two weight sets
            assert int(row[SegCol.NEXT_EXPERT]) == int(kp.seg_table[c * S + min(s + 1, S - 1), SegCol.EXPERT])
            assert (int(row[SegCol.SET]), int(row[SegCol.NEXT_SET])) == (s % 2, 1 - s % 2)
            assert int(row[SegCol.NEXT_ROW]) == c * S + min(s + 1, S - 1)  # the row the backward loads ahead
            run = [q for k in range(L) for q in range(int(row[SegCol.HEAD + 2 * k]), int(row[SegCol.HEAD + 1 + 2 * k]))]
            # the forward's gate / up / down loads, spread over the pieces
            loads = kp.piece[run, PieceCol.FETCH:PieceCol.FETCH + 3].long()
            assert loads.sum(0).tolist() == ([1, 1, 1] if s + 1 < positions else [0, 0, 0])
            if s + 1 < positions:
                assert [int(loads[:, m].argmax()) for m in range(3)] == [m * len(run) // 3 for m in range(3)]
            # the backward's next down matrix: loaded by the last piece the position runs (its last sub-segment's
            # last class with pieces), every position (the last reloads its own expert)
            assert kp.piece[run, PieceCol.DOWN].tolist() == [0] * (len(run) - 1) + [1]
            for j in range(int(row[SegCol.SUB_BEGIN]), int(row[SegCol.SUB_END])):
                sub = kp.sub_table[j]
                others = [kp.sub_table[int(seg[o][SegCol.SUB_BEGIN]) + j - int(row[SegCol.SUB_BEGIN])]
                          for o in range(lnc)]
                H = SubCol.HEAD
                # cont, tiles, load, early, pieces per class: the same on each core
                assert len({tuple(int(v) for v in o[SubCol.CONT:SubCol.EARLY + 1])
                            + tuple(int(o[H + 1 + 2 * k] - o[H + 2 * k]) for k in range(L)) for o in others}) == 1
                write, add, cont, t0, t_begin, t_end, load = (int(v) for v in sub[SubCol.WRITE:SubCol.LOAD + 1])
                n_tiles = t_end - t0
                assert t_begin == t0 + 1 and t0 == (tiles * (len(order[c]) % 2) if halves else 0)
                assert cont == (j > int(row[SegCol.SUB_BEGIN])) and (tiles is None or n_tiles <= tiles)
                # the position's last sub-segment loads the next weights
                assert load == (j == int(row[SegCol.SUB_END]) - 1)
                has_block = int(sub[H + 1]) > int(sub[H])
                order[c].append((sub, int(sub[H]) if has_block else None, j))
                gathered = halves and len(order[c]) > 1 and has_block
                real = False
                tile_next = t0
                for k in range(L):
                    begin, end = int(sub[H + 2 * k]), int(sub[H + 1 + 2 * k])
                    for q in range(begin, end):
                        g, r0, tile, own, nxt = (int(v) for v in kp.piece[q, PieceCol.GROUP:PieceCol.NEXT + 1])
                        width = widths[k]
                        assert r0 == g * G
                        if width >= ts:  # resident main tiles, in order, no-op pieces too
                            assert tile == tile_next
                            tile_next += width // ts
                        # the backward's gathers: the loop's first piece its own rows, each piece the next one's
                        # while the next row is in the loop (main tiles only: a tail class's rows are gathered by
                        # the sub-segment's last main-tile piece, below)
                        early = gathered and k == 0
                        assert (own, nxt) == ((q == begin and not early, q + 1 < end) if width >= ts else (0, 0))
                        if g >= ng:  # a no-op piece: this core's own area
                            assert g == ng + c * r
                            noop_pieces += 1
                            continue
                        real = True
                        assert (plan.block_to_expert_B[g:g + width // G] == e).all()
                        seen[r0:r0 + width] += 1
                        real_groups[c] += width // G
                assert tile_next == t_end and n_tiles >= 1
                # the tail gathers (per tail buffer a flag and a slot group): on the last main-tile
                # piece run, one per tail piece the sub-segment runs, with that piece's slot group
                bounds = [(int(sub[H + 2 * k]), int(sub[H + 1 + 2 * k])) for k in range(L)]
                mains = [b for k, b in enumerate(bounds) if widths[k] >= ts and b[1] > b[0]]
                tails_run = [b for k, b in enumerate(bounds) if widths[k] < ts]
                rows = [q for b in bounds for q in range(*b)]
                for t in range(len(tails_run)):
                    b, e_ = tails_run[t]
                    want = {mains[-1][1] - 1: int(kp.piece[b, PieceCol.GROUP])} if e_ > b else {}
                    col = PieceCol.TAILS + 2 * t
                    got = {q: int(kp.piece[q, col + 1]) for q in rows if int(kp.piece[q, col])}
                    assert got == want and e_ - b <= 1
                if real:
                    subs_of.setdefault(e, []).append((c, write, add))
                else:  # a no-op or spare sub-segment: its dW goes to the core's dummy row
                    assert write == add == E + c
    for c in range(lnc):  # the early gathers: each sub-segment the next one's first full block, into its tiles
        for i in range(len(order[c])):
            sub, nxt = order[c][i][0], order[c][i + 1] if i + 1 < len(order[c]) else (None, None, None)
            # the row it loads ahead: the core's next run sub-segment's (after the last, some valid row)
            after = int(sub[SubCol.NEXT_ROW])
            assert after == nxt[2] if nxt[2] is not None else 0 <= after < kp.sub_table.shape[0]
            early = halves and nxt[1] is not None
            assert int(sub[SubCol.EARLY]) == early
            if early:
                assert (int(sub[SubCol.EARLY_GROUP]), int(sub[SubCol.EARLY_TILE])) == (
                    int(kp.piece[nxt[1], PieceCol.GROUP]), int(nxt[0][SubCol.TILE_FIRST]))
    if halves:
        assert sum(int(sub[SubCol.EARLY]) for c in range(lnc) for sub, *_ in order[c]) >= 2
    for e, subs in subs_of.items():  # one core; the first sub-segment writes dW[e], the later ones add into it
        assert len({c for c, _, _ in subs}) == 1
        c = subs[0][0]
        assert [(w, a) for _, w, a in subs] == [(e, E + c)] + [(E + c, e)] * (len(subs) - 1)
        writers[e], adders[e] = c, len(subs) - 1
    if tiles is not None:
        assert max(adders.values()) >= 1  # the cap really split an expert
    real_slots = int(torch.maximum((counts_E + G - 1) // G * G, torch.where(counts_E > 0, ts, 0)).sum())
    assert int(seen.sum()) == real_slots and int(seen.max()) == 1  # each real slot group exactly once
    assert seen[:real_slots].all() and not seen[real_slots:].any()
    if lnc == 1:
        assert noop_pieces == 0
    else:
        assert abs(real_groups[0] - real_groups[1]) <= 2 * int(((counts_E + G - 1) // G).max())
    # zero fill: each core its dummy row and a share of the empty experts, each empty expert once
    Z = kp.zero_rows.shape[0] // lnc
    zeroed = [kp.zero_rows[c * Z:c * Z + int(kp.zero_count[0, 0]), 0].tolist() for c in range(lnc)]
    assert all(E + c in zeroed[c] and set(zeroed[c]) <= {E + c} | set(range(E)) for c in range(lnc))
    empties = sorted(e for rows in zeroed for e in set(rows) if e < E)
    assert empties == sorted(torch.nonzero(counts_E == 0).flatten().tolist())
    # the forward zero-fills the saved gT/uT from group ceil(T * K / G) on (known when traced): every group before
    # it holds real slots, whatever the routing
    assert real_slots >= -(-T * K // G) * G
    # the token-major scratch rows: each slot's own row, t * K + k for a real slot, past the token tiles' rows for a
    # padding or no-op slot; no row twice (no two DMAs, of one core or of two, write one row)
    nT, TT = nki_moe.token_tiles(T, lnc)
    assert nT % lnc == 0 and nT * TT >= T  # the combine's token tiles split evenly
    rows = kp.row_of_slot.reshape(-1).long()
    assert kp.row_of_slot.shape == kp.token_index.shape and kp.top_k == K
    assert rows.unique().numel() == rows.numel() and int(rows.max()) < nki_moe.assignment_rows(T, K, rows.numel(), lnc)
    real = plan.slot_of_assignment_TK.reshape(-1)
    assert torch.equal(rows[real], torch.arange(T * K))
    spare = torch.ones(rows.numel(), dtype=torch.bool)
    spare[real] = False
    assert (rows[spare] >= nT * TT * K).all()


def test_backward_layout_and_tile_cap_refusals():
    """A shape whose backward does not fit SBUF even in 128-wide F chunks, and a tile cap below one full block plus
    the main-buffer tails, are refused with the fix named."""
    from workbench.kernels import nki_moe
    from workbench.kernels.nki_moe.tables import KernelPlan

    with pytest.raises(ValueError, match="does not fit SBUF at D=16384.*smaller model.moe_block_size"):
        nki_moe.backward_layout(16384, 768, torch.float32, nki_moe.piece_widths(256, 4))
    ids = torch.zeros(4, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="2 resident tiles per sub-segment cannot hold one 256-slot block"):
        KernelPlan.build(ids, 2, 256, 1, tiles=2)


def test_kernel_plan_needs_an_expert_per_core():
    from workbench.kernels.nki_moe.tables import KernelPlan

    ids = torch.zeros(4, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="1 experts on 2 logical cores.*NEURON_LOGICAL_NC_CONFIG=1"):
        KernelPlan.build(ids, 1, 32, 2)
    assert KernelPlan.build(ids, 1, 32, 1)[1].seg_count.item() == 1


def test_logical_nc_config(monkeypatch):
    from workbench.core.neuron_env import lnc_is_set, logical_nc_config, runtime_lnc, unbracketed_lnc

    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    assert logical_nc_config() == 2 and logical_nc_config(default=1) == 1  # unset: trn2's 2 (or the default)
    assert not lnc_is_set() and unbracketed_lnc() == 1  # unset: kernel(...) runs at LNC 1
    assert runtime_lnc(on_neuron=True) == 2 and runtime_lnc(on_neuron=False) == 1
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert logical_nc_config() == 1
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "3")
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG='3'.*supports 1 or 2"):
        logical_nc_config()


@pytest.mark.parametrize("bs", [2, 5, 16])
def test_plan_invariants(bs):
    T, K, E = 11, 3, 6
    _, ids, *_ = make_case(T, K, E, 4, 4, seed=bs)
    plan = plan_blocks(ids, E, bs)
    counts = torch.bincount(ids.view(-1), minlength=E)
    assert plan.max_blocks == max_blocks(T, K, E, bs) <= math.ceil(T * K / bs) + E
    assert plan.num_blocks.item() == sum(math.ceil(c / bs) for c in counts.tolist())
    # every assignment sits in exactly one slot, inside a block of its expert
    slots = plan.slot_of_assignment_TK.view(-1)
    assert torch.equal(torch.sort(slots).values, torch.sort(slots.unique()).values) and slots.numel() == T * K
    assert torch.equal(plan.assignment_of_slot_N[slots], torch.arange(T * K))
    assert torch.equal(plan.block_to_expert_B[slots // bs], ids.view(-1))
    assert torch.equal(plan.token_index_N[slots], torch.arange(T).repeat_interleave(K))
    padding = torch.ones(plan.num_slots, dtype=torch.bool)
    padding[slots] = False
    assert (plan.token_index_N[padding] == T).all() and (plan.assignment_of_slot_N[padding] == T * K).all()
    assert (plan.block_to_expert_B.diff() >= 0).all()


def test_route_torchtitan_semantics_with_expert_bias():
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 10.0])  # forces expert 5 into every token's top-k
    weights, ids = route(logits, 2, expert_bias_E=bias)
    scores = torch.softmax(logits, -1)
    assert (ids == 5).any(-1).all() and weights.dtype == torch.float32
    chosen = scores.gather(-1, ids)  # weights come from the unbiased scores
    torch.testing.assert_close(weights, chosen / (chosen.sum(-1, keepdim=True) + 1e-20))


def test_hf_qwen3_moe_block_parity():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    E, K, H, I = 6, 2, 16, 12  # noqa: E741 - Qwen3-MoE's moe_intermediate_size, named as in the paper
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                            norm_topk_prob=True, hidden_act="silu")
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 7, H, requires_grad=True)
    grad_out = torch.randn(2, 7, H)
    hf_out = block(x)
    hf_grads = torch.autograd.grad(hf_out, (x, *block.parameters()), grad_out)

    gate_up, down, router = (p.detach().clone().requires_grad_() for p in block.parameters())
    ours_x = x.detach().clone().requires_grad_()
    x_TD = ours_x.view(-1, H)
    weights, ids = route(x_TD @ router.T, K, norm_topk_prob=True)
    out = blockwise_moe(x_TD, ids, weights, gate_up[:, :I], gate_up[:, I:], down, block_size=4).view(2, 7, H)
    grads = torch.autograd.grad(out, (ours_x, gate_up, down, router), grad_out)
    torch.testing.assert_close(out, hf_out, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("x", "gate_up_proj", "down_proj", "gate.weight"), grads, hf_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_auto_uses_reference_off_neuron_and_block_size_rules():
    case = make_case(4, 2, 3, 8, 8)
    torch.testing.assert_close(blockwise_moe_auto(*case, block_size=4), blockwise_moe(*case, block_size=4))
    assert [kernel_block_size(b) for b in (1, 100, 128, 256, 768, 1024)] == [1, 100, 128, 256, 256, 256]
    with pytest.raises(ValueError, match="multiple of 128"):
        kernel_block_size(200)


@pytest.mark.skipif(not REAL_NKI, reason="needs the real `nki` package (AWS Neuron pip index) for nki.simulate")
def test_kernels_under_real_nki_simulate():
    import nki

    from workbench.kernels import nki_moe
    from workbench.kernels.moe_reference import slot_weights
    from workbench.kernels.nki_moe.tables import KernelPlan

    x, ids, w, wg, wu, wd = (t.detach() for t in make_case(9, 2, 4, 136, 130))
    plan = plan_blocks(ids, 4, 8)
    kp = KernelPlan.from_plan(plan, 4, lnc=1)
    weight = kp.slot_weights(slot_weights(w, plan)).float().view(kp.token_index.shape)
    x_pad = torch.nn.functional.pad(x, (0, 0, 0, 1))
    args = [x_pad, kp.token_index, weight, *kp.forward_tables(), kp.row_of_slot, kp.top_k, wg.transpose(1, 2),
            wu.transpose(1, 2), wd.transpose(1, 2)]
    out = nki.simulate(nki_moe.moe_blockwise_fwd[1])(*(np.ascontiguousarray(a.numpy()) if isinstance(a, torch.Tensor)
                                                       else a for a in args))[0]
    np.testing.assert_allclose(out.reshape(-1, 136)[:9], blockwise_moe(x, ids, w, wg, wu, wd, block_size=8).numpy(),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(REAL_NKI, reason="the cost report reads the emulator's counters")
def test_cost_report_padding_comes_from_the_emulator(capsys):
    """benchmarks/nki_moe_cost.py at toy scale: its padding_fraction is the emulator's count (it exits if the count
    disagrees with the host plan), and the padded slots it reports are whole-block rounding of each expert."""
    import importlib.util
    import json
    from pathlib import Path

    from workbench.kernels import nki_moe

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "nki_moe_cost.py"
    spec = importlib.util.spec_from_file_location("nki_moe_cost", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--tokens", "64", "--experts", "4", "--top-k", "2", "--hidden", "128", "--ffn", "128", "--lnc", "2",
              "--block-size", "32", "--dtype", "float32", "--what-if"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["nki_version"] == "0.7.0" and result["divergent_loops"] == 0 and result["lnc"] == 2
    assert result["slots_computed"] == 64 * 2 + result["padding_slots_computed"]
    assert result["padding_fraction"] == round(result["padding_slots_computed"] / result["slots_computed"], 4)
    assert 0 < result["sbuf_peak_bytes"] <= result["sbuf_usable_bytes"] == 212_464
    # the expert-weight DMAs are found by argument name: each direction loads every expert's three matrices
    # ([128, 128] fp32 here, 1.5 MiB in all) at least once (the report rounds to 1 MiB steps)
    assert result["weight_gib"] * 2**30 >= 2 * 3 * 4 * 128 * 128 * 4
    # the trn2 time models: the dependency model (fwd then bwd), its ratio to the roofline, the throughput bracket
    # (at toy scale the DGE / semaphore latencies the bracket leaves out put the dependency model above it)
    assert 0 < result["model_ms_overlap"] <= result["model_ms_serial"] < result["model_ms"]
    assert result["model_ms"] == pytest.approx(result["model_ms_fwd"] + result["model_ms_bwd"], rel=1e-3)
    assert result["roofline_ms"] == max(result["pe_floor_ms"], result["hbm_floor_ms"])
    assert result["roofline_ratio"] == pytest.approx(result["model_ms"] / result["roofline_ms"], rel=2e-3)
    assert result["bound"] in ("tensor", "vector", "scalar", "gpsimd", "dma") and result["unmodeled_instructions"] == 0
    shares = result["engine_shares"]
    assert set(shares) == {"tensor", "vector", "scalar", "gpsimd", "dma"}
    assert all(0 <= v["busy"] and 0 <= v["waiting"] and v["busy"] + v["waiting"] <= 1.0001 for v in shares.values())
    assert result["top_stalls"] and all(s["ms"] > 0 for s in result["top_stalls"])
    kernel_files = {p.name for p in Path(nki_moe.__file__).parent.glob("*.py")}
    assert any(s["site"].split(":")[0] in kernel_files for s in result["top_stalls"])
    # --what-if: the same traces with one group of costs removed; with everything but the Tensor Engine free, the
    # replay collapses to the Tensor Engine's own work, the throughput bracket's Tensor figure
    what_if = result["what_if"]
    assert what_if["as modeled"]["model_ms"] == result["model_ms"]
    assert what_if["only the Tensor Engine"]["model_ms"] == pytest.approx(result["model_ms_engines"]["tensor"],
                                                                          rel=0.02)
    assert what_if["DMA free"]["model_ms"] < result["model_ms"]  # toy shapes: DMA latencies dominate
    assert all(v["roofline_ratio"] == pytest.approx(v["model_ms"] / result["roofline_ms"], rel=2e-3)
               for v in what_if.values())
    # the sensitivity range: each marked assumption at its low and high end; an end at the modeled value replays
    # the modeled time, a slower Vector Engine or a larger DMA fixed cost never shortens it
    sens = result["sensitivity"]
    assert set(sens) == {"concurrent PE tiles", "DMA transpose cost", "DMA fixed cost", "Vector rate"}
    assert sens["concurrent PE tiles"]["model_ms"][1] == sens["Vector rate"]["model_ms"][1] == result["model_ms"]
    assert sens["Vector rate"]["model_ms"][0] >= result["model_ms"] >= sens["DMA fixed cost"]["model_ms"][0]
    assert sens["DMA fixed cost"]["model_ms"][1] >= result["model_ms"]
    ratios = [x for v in sens.values() for x in v["roofline_ratio"]]
    assert result["roofline_ratio_range"] == [min(ratios), max(ratios)]
    assert min(ratios) <= result["roofline_ratio"] <= max(ratios)


@pytest.mark.skipif(REAL_NKI, reason="stands torch.library.custom_op in for torch_neuronx.nki_op over the emulator")
@pytest.mark.parametrize("lnc", [1, 2])
def test_neuron_custom_op_path_over_the_emulator(monkeypatch, lnc):
    """`blockwise_moe_nki`'s on-Neuron branch itself (`neuron_moe_op()` called with the padded input, the plan's
    tables and the weights; `register_autograd`'s padded-row and gradient bookkeeping), with the device check forced
    true, torch.library.custom_op standing in for torch_neuronx.nki_op (same decorator / register_autograd API) and
    the emulator running the kernels: output and all five grads match the reference, and the host path
    (`BlockwiseMoEFunction`) is never taken. What it cannot check: torch_neuronx itself and the device."""
    import sys
    import types

    from workbench.kernels import autograd

    fake = types.ModuleType("torch_neuronx")
    fake.nki_op = torch.library.custom_op
    monkeypatch.setitem(sys.modules, "torch_neuronx", fake)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(lnc))
    monkeypatch.setattr(autograd, "nki_on_device", lambda x: True)  # as for a tensor on a Neuron device

    def host_path(*args, **kwargs):
        raise AssertionError("blockwise_moe_nki took the host path with the device check true")

    monkeypatch.setattr(autograd.BlockwiseMoEFunction, "apply", host_path)
    if lnc == 1:
        autograd.neuron_moe_op.cache_clear()  # registers the two ops once per process
    T, K, E, D, F, bs, ids = EDGE_CASES["full_blocks_and_tail_pieces"]
    case = make_case(T, K, E, D, F, ids=ids)
    calls = autograd.neuron_moe_op.cache_info()
    got = outputs_and_grads(autograd.blockwise_moe_auto, case, block_size=bs)  # the training entry point
    after = autograd.neuron_moe_op.cache_info()
    assert after.hits + after.misses == calls.hits + calls.misses + 1  # the custom op computed it
    assert_match(got, outputs_and_grads(blockwise_moe, case, block_size=bs), rtol=1e-5)


def test_training_entry_point_off_neuron_is_the_torch_reference(monkeypatch):
    """`blockwise_moe_auto` on a CPU tensor: the torch reference, neither the custom op nor the emulated kernels."""
    from workbench.kernels import autograd

    def kernels(*args, **kwargs):
        raise AssertionError("blockwise_moe_auto ran the NKI kernels for a CPU tensor")

    monkeypatch.setattr(autograd.BlockwiseMoEFunction, "apply", kernels)
    monkeypatch.setattr(autograd, "neuron_moe_op", kernels)
    T, K, E, D, F, bs, ids = EDGE_CASES["full_blocks_and_tail_pieces"]
    case = make_case(T, K, E, D, F, ids=ids)
    assert_match(outputs_and_grads(autograd.blockwise_moe_auto, case, block_size=bs),
                 outputs_and_grads(blockwise_moe, case, block_size=bs), rtol=0)
