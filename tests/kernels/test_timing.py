"""The trn2 time model over the emulator's counters (nki_emulator.timing) and the MoE layer's roofline (moe_cost).

Each instruction's modeled cost is checked against the cited rate written out by hand; the model's bounds, per-core
split and refusals on kernels whose counters are known exactly.
"""

import numpy as np
import pytest

from workbench.kernels import nki_emulator as nki
from workbench.kernels.nki_emulator import counters, timing
from workbench.kernels.nki_emulator.timing import (
    TRN1,
    TRN2,
    Dma,
    Elementwise,
    Matmul,
    Transpose,
    instruction_seconds,
    model,
)

nl, nisa = nki.language, nki.isa


def test_tensor_engine_cost_is_moving_columns_at_2_4_ghz():
    # a full [128 x 128] x [128 x 512] bf16 matmul: 512 cycles, i.e. 2*128*128*512 FLOPs at 78.6 TFLOPS
    full = instruction_seconds("tensor", "nc_matmul", Matmul(128, 128, 512, False))
    assert full == pytest.approx(512 / 2.4e9)
    assert 2 * 128 * 128 * 512 / full == pytest.approx(78.64e12, rel=1e-3)
    # under-filled arrays cost the same columns; short moving tiles the 64-cycle initiation interval; fp32 4x
    assert instruction_seconds("tensor", "nc_matmul", Matmul(32, 16, 512, False)) == full
    assert instruction_seconds("tensor", "nc_matmul", Matmul(128, 128, 32, False)) == pytest.approx(64 / 2.4e9)
    assert instruction_seconds("tensor", "nc_matmul", Matmul(128, 128, 512, True)) == pytest.approx(4 * full)
    # a PE transpose of [p, f] streams the [p, p] identity: p columns (fp32: x2, the v3 transpose mode)
    assert instruction_seconds("tensor", "nc_transpose", Transpose(128, 96, False)) == pytest.approx(128 / 2.4e9)
    assert instruction_seconds("tensor", "nc_transpose", Transpose(128, 96, True)) == pytest.approx(256 / 2.4e9)


def test_vector_scalar_and_dma_costs():
    fp32_tt = Elementwise(inputs=2, partitions=128, free=256, bf16=False, psum=0, contiguous=True, sbuf_inputs=2)
    assert instruction_seconds("vector", "tensor_tensor", fp32_tt) == pytest.approx((2 * 256 + 60) / 0.96e9)
    bf16_tt = fp32_tt._replace(bf16=True)  # both inputs bf16 in SBUF: 2x
    assert instruction_seconds("vector", "tensor_tensor", bf16_tt) == pytest.approx((256 + 60) / 0.96e9)
    copy = Elementwise(1, 128, 512, True, 0, True, 1)  # bf16 SBUF -> SBUF contiguous: 4x
    assert instruction_seconds("vector", "tensor_copy", copy) == pytest.approx((128 + 60) / 0.96e9)
    assert instruction_seconds("vector", "tensor_copy", copy._replace(psum=1)) == pytest.approx((256 + 60) / 0.96e9)
    assert instruction_seconds("scalar", "activation", copy) == pytest.approx((512 + 60) / 1.2e9)  # no perf modes
    # NeuronCore-v2 (trn1, calibration only): 1.12 GHz Vector Engine, no performance modes; bn_aggr 13 N / 3
    assert instruction_seconds("vector", "tensor_copy", copy, TRN1) == pytest.approx((512 + 60) / 1.12e9)
    assert instruction_seconds("vector", "bn_aggr", copy._replace(free=96), TRN1) == pytest.approx(
        (13 * 32 + 60) / 1.12e9)
    # 128 partitions use all 16 DMA engines: a fixed cost on each plus the bytes at 16 x 23 GB/s
    dma = Dma(nbytes=128 * 4096, hbm_bytes=128 * 4096, partitions=128)
    assert instruction_seconds("dma", "dma_copy", dma) == pytest.approx((16 * 9e-9 + 128 * 4096 / 23e9) / 16)
    assert instruction_seconds("dma", "dma_copy", dma._replace(partitions=1)) == pytest.approx(
        (9e-9 + 128 * 4096 / 23e9) / 16)


def test_instruction_without_a_descriptor_is_refused():
    with pytest.raises(TypeError, match="no time model for nc_matmul on tensor"):
        instruction_seconds("tensor", "nc_matmul", (128, 128, 512))


def test_every_rate_names_its_source():
    import dataclasses

    for f in dataclasses.fields(timing.Rates):  # every rate: a cited page, or marked an assumption
        url, what = timing.SOURCES[f.name]
        assert (url.startswith("https://awsdocs-neuron.readthedocs-hosted.com/") or url == "assumption") and what
    assumptions = [k for k, (url, what) in timing.SOURCES.items() if "assumption" in url + what]
    assert {"pe_tiles_concurrent", "gpsimd_hz", "access_overhead_cycles", "cores_per_chip", "dge_sw_s",
            "sequencer_s", "branch_s"} <= set(assumptions)
    assert "FITTED" in timing.SOURCES["dma_fixed_s"][1]
    # the trn1 rates (calibration only) differ from trn2's exactly where TRN1_SOURCES cites the NeuronCore-v2 figure
    changed = {f.name for f in dataclasses.fields(timing.Rates)
               if getattr(timing.TRN1, f.name) != getattr(timing.TRN2, f.name)}
    assert changed == set(timing.TRN1_SOURCES)
    assert all(url.startswith("https://awsdocs-neuron.readthedocs-hosted.com/") for url, _ in
               timing.TRN1_SOURCES.values())


def _kernel(lnc_work):
    """Core c: lnc_work[c] matmuls [128x128]x[128x512] bf16 and one [128, 1024] bf16 HBM -> SBUF load."""

    @nki.jit
    def kernel(a, w):
        pid = nl.program_id(0)
        st = nl.ndarray((128, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
        mv = nl.ndarray((128, 1024), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=st, src=w)
        nisa.dma_copy(dst=mv, src=a)
        acc = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        for _ in range(lnc_work[pid]):
            nisa.nc_matmul(dst=acc, stationary=st, moving=mv[0:128, 0:512], accumulate=False)
        res = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=acc)
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        if pid == 0:
            nisa.dma_copy(dst=out, src=res)
        return out

    return kernel


def test_model_over_a_kernel_per_core_bounds(monkeypatch):
    import torch

    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with counters() as c:
        _kernel((3, 1))[2](torch.ones(128, 1024, dtype=torch.bfloat16), torch.ones(128, 128, dtype=torch.bfloat16))
    t = model(c)
    assert len(t.per_core) == 2
    mm = 512 / 2.4e9
    assert t.per_core[0]["tensor"] == pytest.approx(3 * mm) and t.per_core[1]["tensor"] == pytest.approx(mm)
    evict = (512 + 60) / 0.96e9  # PSUM fp32 -> SBUF fp32: one input, no performance mode
    assert t.per_core[0]["vector"] == pytest.approx(evict) == t.per_core[1]["vector"]
    # HBM bytes per core: 256 KiB + 32 KiB loaded by each, 256 KiB stored by core 0
    loads = 128 * 1024 * 2 + 128 * 128 * 2
    assert t.hbm_bytes == 2 * loads + 128 * 512 * 4
    assert t.hbm_s[0] == pytest.approx((loads + 128 * 512 * 4) / (2.9e12 / 8))
    assert t.per_core[0]["dma"] == max(t.hbm_s[0], t.dma_queue_s[0])
    assert t.engines["tensor"] == pytest.approx(3 * mm)  # the busiest core
    assert t.overlap_s == max(t.engines.values())
    assert t.serial_s == pytest.approx(max(sum(core.values()) for core in t.per_core))
    assert t.serial_s > t.overlap_s and t.bound in ("tensor", "dma", "dma-queues")
    assert t.unmodeled == {}


def _noop():
    pass


def test_instructions_without_work_are_counted_unmodeled(monkeypatch):
    from workbench.kernels.nki_emulator import launch

    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")

    def custom_op():  # an instruction added to the emulator without a work descriptor
        launch.emit("gpsimd", "custom_op", _noop)

    @nki.jit
    def kernel(x):
        custom_op()
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    with counters() as c:
        kernel(np.ones((4, 8), np.float32))
    t = model(c)
    assert t.unmodeled == {("gpsimd", "custom_op"): 1} and t.per_core[0]["gpsimd"] == 0.0


def test_moe_roofline_at_qwen3_30b_a3b():
    from workbench.kernels.moe_cost import roofline

    r = roofline(tokens=4096, top_k=8, experts=128, hidden=2048, ffn=768, lnc=2, io_bytes=2)
    assert r.pe_flops == 9 * 2 * 4096 * 8 * 2048 * 768  # 927.7 GFLOP
    assert r.pe_s == pytest.approx(927.7e9 / 158e12, rel=1e-3)  # 5.87 ms at 2 x 79 TFLOPS
    weights = 128 * 2048 * 768 * 3  # elements of the three matrices
    # bf16 weights read forward and backward, bf16 dW written once (what the kernels write), 5 token rows of bf16
    assert r.hbm_bytes == 3 * 2 * weights + 5 * 4096 * 2048 * 2  # 3.71 GB
    assert r.hbm_s == pytest.approx(r.hbm_bytes / 0.725e12) and r.hbm_s * 1e3 == pytest.approx(5.11, abs=0.01)
    assert r.seconds == r.pe_s and r.bound == "pe"
    assert TRN2.hbm_bytes_per_s * 2 == pytest.approx(0.725e12)


# -- the dependency model (timing.schedule) ---------------------------------------------------------------------------
def _chain_kernel(n):
    """n rounds of: load a [128, 512] bf16 tile, matmul it, evict the single PSUM accumulator, store (one buffer
    each: every round waits for the previous one's eviction and store)."""

    @nki.jit
    def kernel(a, w):
        st = nl.ndarray((128, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=st, src=w)
        mv = nl.ndarray((128, 512), dtype=nl.bfloat16, buffer=nl.sbuf)
        acc = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        res = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        out = nl.ndarray((n, 128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        for i in range(n):
            nisa.dma_copy(dst=mv, src=a[i])
            nisa.nc_matmul(dst=acc, stationary=st, moving=mv, accumulate=False)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=out[i], src=res)
        return out

    return kernel


def test_schedule_follows_dependencies_and_latencies(monkeypatch):
    """One round by hand: DGE 600 ns then the load (16 engines, the core's HBM share); the matmul after the load;
    the eviction after the matmul; the store (DGE, transfer) after the eviction. Rounds serialise through the
    single buffers (WAR on the PSUM bank and `res`), so three rounds take well over twice one round."""
    import torch

    from workbench.kernels.nki_emulator.timing import schedule

    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    r = TRN2

    def xfer(nbytes):
        return max(r.dma_fixed_s + nbytes / (16 * r.dma_engine_bytes_per_s), nbytes / r.hbm_bytes_per_s)

    w = torch.ones(128, 128, dtype=torch.bfloat16)
    runs = {}
    for n in (1, 3):
        with counters(trace=True) as c:
            _chain_kernel(n)(torch.ones(n, 128, 512, dtype=torch.bfloat16), w)
        runs[n] = schedule(c)
    mm = 512 / 2.4e9
    evict = (512 + 60) / 0.96e9
    # the weight and the first tile load on the two DGE instances in parallel, sharing the core's HBM bandwidth;
    # the matmul waits for both
    first = r.dge_hw_s + max(xfer(128 * 512 * 2), (128 * 128 + 128 * 512) * 2 / r.hbm_bytes_per_s)
    one = first + mm + evict + r.dge_hw_s + xfer(128 * 512 * 4)
    assert runs[1].seconds == pytest.approx(one, rel=0.02)
    assert runs[1].busy["tensor"] == pytest.approx(mm) and runs[1].busy["vector"] == pytest.approx(evict)
    # later rounds: the next load may start early (its buffer's only reader, the matmul, is done; the DMA engines
    # and the HBM link are booked by time, so it is not held behind the previous store) but the eviction waits for
    # the previous store to free `res` (WAR): each later round adds eviction + DGE + store to the chain
    store = r.dge_hw_s + xfer(128 * 512 * 4)
    assert runs[3].seconds == pytest.approx(one + 2 * (evict + store), rel=0.02)
    assert runs[3].seconds < 2.5 * runs[1].seconds
    stalls = runs[3].top_stalls(3)
    assert {s["engine"] for s in stalls} <= {"tensor", "vector", "dma"}
    assert stalls[0]["site"].startswith("test_timing.py:")
    shares = runs[3].shares()
    assert 0 < shares["tensor"]["busy"] < 0.1 and shares["tensor"]["waiting"] > 4 * shares["tensor"]["busy"]


def test_schedule_needs_the_trace():
    from workbench.kernels.nki_emulator.timing import schedule

    with counters() as c:
        pass
    with pytest.raises(ValueError, match="counters\\(trace=True\\)"):
        schedule(c)


def test_dma_overview_profiles_calibrate_the_engine_rate():
    """The DMA overview's profiles (trn2): one dma_copy of bf16 [4, 4096] (32 KiB) on one engine takes 1,416 ns; a
    bf16 [128, 128] copy spreads 2 KiB over each of 16 engines and takes 97 ns. The model's engine time (the
    fitted fixed cost, 23 B/ns) is within 2% of both (docs/nki_kernels.md, calibration)."""
    one = TRN2.dma_fixed_s + 4 * 4096 * 2 / TRN2.dma_engine_bytes_per_s
    spread = TRN2.dma_fixed_s + 128 * 128 * 2 / 16 / TRN2.dma_engine_bytes_per_s
    assert one == pytest.approx(1416e-9, rel=0.02) and spread == pytest.approx(97e-9, rel=0.02)


def test_dma_resources_are_booked_by_time():
    """A DMA engine or the HBM link serves a transfer in the first idle gap long enough at or after the time it is
    described, not after every transfer booked before it in program order; touching intervals merge; forgetting
    the past keeps later gaps."""
    from workbench.kernels.nki_emulator.timing import _Booked

    b = _Booked()
    b.book(10.0, 12.0)  # a store issued first, described late
    assert b.fit(1.0, 2.0) == 1.0  # a load described at 1 fits before it
    assert b.fit(9.0, 2.0) == 12.0  # one that would overlap it waits for its end
    b.book(1.0, 3.0)
    b.book(3.0, 4.0)
    assert (b.starts, b.ends) == ([1.0, 10.0], [4.0, 12.0])
    assert b.fit(4.0, 6.0) == 4.0 and b.fit(4.0, 6.5) == 12.0
    b.forget_before(5.0)
    assert b.fit(5.0, 5.0) == 5.0 and b.end() == 12.0


def _interleaved_stores(rows):
    """Each core copies `rows` rows of x to the same rows of a shared output, the cores' rows interleaved (core c:
    rows c, c + LNC, ...): one load and one store per row, through one SBUF row."""

    @nki.jit
    def kernel(x):
        pid, lnc = nl.program_id(0), nl.num_programs(0)
        out = nl.ndarray((rows * lnc, x.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((1, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
        for i in range(rows):
            r = i * lnc + pid
            nisa.dma_copy(dst=t, src=x[r:r + 1, 0:x.shape[1]])
            nisa.dma_copy(dst=out[r:r + 1, 0:x.shape[1]], src=t)
        return out

    return kernel


def test_one_cores_accesses_never_order_the_others(monkeypatch):
    """Within a barrier phase the two cores touch disjoint rows of shared HBM, so each core's timeline is its own:
    at LNC 2 (interleaved rows, more accesses per tensor than the replay keeps before it merges old ones) the
    launch takes exactly as long as one core doing its half alone (LNC 1). Before 2026-12-05 the merged box of
    core 0's rows held back core 1's rows inside its span: the MoE backward 4.04 -> 2.52 ms at T 1024, E 32."""
    import torch

    from workbench.kernels.nki_emulator.timing import _PRUNE, schedule

    rows = _PRUNE  # 2 x _PRUNE accesses of `out` per core (its writes and the loads' reads of `t`)
    x = torch.ones(2 * rows, 64, dtype=torch.bfloat16)
    spans = {}
    for lnc in (1, 2):
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(lnc))
        with counters(trace=True) as c:
            out = _interleaved_stores(rows)[lnc](x)
        spans[lnc] = schedule(c).seconds
        assert torch.equal(out, x[: rows * lnc])
    assert spans[2] == pytest.approx(spans[1], rel=1e-9)


def _offset_then_vector_work(x, where):
    """Load 2 MiB from x at a runtime row offset read from an SBUF tile, rewrite that tile (Vector), then fill a
    [128, 8192] fp32 tile on the Vector Engine (longer than the load)."""
    idx = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=where)
    big = nl.ndarray((128, 8192), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=big, src=x.ap(pattern=[[8192, 128], [1, 8192]], offset=0, scalar_offset=idx, indirect_dim=0))
    nisa.memset(dst=idx, value=0, engine=nisa.engine.vector)  # the next offset: WAR on idx
    other = nl.ndarray((128, 8192), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=other, value=1.0, engine=nisa.engine.vector)
    out = nl.ndarray((128, 8), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=big[0:128, 0:8])
    return out


def test_a_dma_frees_its_offset_once_its_descriptors_exist(monkeypatch):
    """A DMA's descriptors hold the addresses its offsets gave (DGE reference: a descriptor "tells the hardware
    the source address, destination address, transfer shape, and stride pattern"), so rewriting the offset tile
    waits for the descriptors (one DGE), not for the 2 MiB transfer: the Vector fill overlaps the load."""
    import torch

    from workbench.kernels.nki_emulator.timing import schedule

    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    r = TRN2
    x = torch.arange(3 * 128, dtype=torch.bfloat16)[:, None].expand(-1, 8192).contiguous()
    with counters(trace=True) as c:
        out = nki.jit(_offset_then_vector_work)(x, torch.tensor([[128]], dtype=torch.int32))
    assert torch.equal(out, x[128:256, :8])
    s = schedule(c)
    idx_loaded = r.dge_hw_s + r.dma_fixed_s + 4 / r.dma_engine_bytes_per_s
    described = idx_loaded + r.dma_semaphore_s + r.dge_hw_s  # the load waits for idx's DMA, then one DGE
    transfer = 128 * 8192 * 2 / r.hbm_bytes_per_s
    vector = s.busy["vector"]  # the two memsets, back to back
    assert vector > transfer  # so the fill ends last: when it starts tells when idx was free
    assert s.seconds == pytest.approx(described + vector, rel=0.02)


def _calibration():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "nki_calibration.py"
    spec = importlib.util.spec_from_file_location("nki_calibration", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_matmul_tutorial_kernels_compute_the_product_and_the_loads_overlap():
    """benchmarks/nki_calibration.py's four kernels (AWS's matmul tutorial, written from its description) at a small
    shape: each result equals lhsT^T @ rhs (checked inside `run`), the blocked versions move fewer bytes so the
    model's DMA-bound v2 is the slowest, and the Tensor-bound v4 stays within 20% of its PE time (the replay
    overlaps its loads with its matmuls; at this shape the first loads, 16% here, are not hidden; at AWS's shape
    it is 1%)."""
    mod = _calibration()
    K, M, N = 1024, 2048, 1024  # --small
    runs = {name: mod.run(f"matmul_{name}", small=True) for name in ("v2", "v3", "v4", "v5")}
    pe_ms = (K // 128) * (M // 128) * (N // 512) * 4 * 512 / TRN2.tensor_hz * 1e3
    assert runs["v2"]["bound"].startswith("dma") and runs["v4"]["bound"] == "tensor"
    assert runs["v2"]["model_ms"] > max(runs[v]["model_ms"] for v in ("v3", "v4"))
    assert pe_ms <= runs["v4"]["model_ms"] < 1.2 * pe_ms
    assert runs["v4"]["capacity_lifted"] and not runs["v2"]["capacity_lifted"]


def test_trn1_tutorial_kernels_compute_their_references_at_neuroncore_v2_rates():
    """The LayerNorm and Mamba tutorials' kernels (written from their descriptions) at --small shapes under the trn1
    rates: each result equals its torch reference (checked inside `run`); LayerNorm v2's bn_stats / bn_aggr and
    one fused tensor_scalar beat v1's reduces; Mamba v1 is Vector-bound at the documented cost of its instructions
    (per tile and state, 4 tensor_tensor and one scan of 2 N cycles each, N = seq_len, plus the access overhead, at
    1.12 GHz), hand-counted here: the replay adds only the first loads and the stores."""
    mod = _calibration()
    ln = {v: mod.run(f"layernorm_{v}", small=True) for v in ("v1", "v2")}
    assert ln["v2"]["model_ms"] < 0.9 * ln["v1"]["model_ms"] and ln["v2"]["bound"] == "vector"
    mamba = mod.run("mamba_v1_L512", small=True)  # channels 256 (2 tiles), state 16, seq_len 1024
    vector_ms = 2 * 16 * 5 * (2 * 1024 + 60) / TRN1.vector_hz * 1e3
    assert mamba["bound"] == "vector" and vector_ms <= mamba["model_ms"] < 1.1 * vector_ms
