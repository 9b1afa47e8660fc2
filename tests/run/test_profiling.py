"""workbench.run.profiling: the FLOP formula (hand count, ~6N rule), peak FLOP/s, trace analysis, and a profiled run."""

from __future__ import annotations

import gzip
import json

import pandas as pd
import pytest
import torch
from torch.profiler import record_function

from workbench.core import flavors
from workbench.core.config import Profiling
from workbench.run import profiling

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)

# ------------------------------------------------------------------------------------------------
# FLOPs per token
# ------------------------------------------------------------------------------------------------


def test_flops_per_token_hand_count_tiny():
    # tiny: dim 64, 2 layers, 4 heads / 2 kv heads of 16, ffn 192, vocab 151936 (tied: lm_head still a matmul).
    # per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12288; mlp 3*64*192 = 36864  -> 49152, x2 = 98304
    # lm_head 64*151936 = 9723904                                                      -> N = 9822208
    # 6N = 58933248; causal attention 12*2*4*16*128/2 = 98304                          -> 59031552
    shape = flavors.get_shape("tiny")
    assert profiling.matmul_params(shape) == {"attention": 24576, "mlp": 73728, "lm_head": 9723904}
    assert profiling.flops_per_token(shape, 128) == 59031552
    assert profiling.flops_per_token(shape, 128, causal=False) == 59031552 + 98304


def test_flops_per_token_hand_count_tiny_moe():
    # tiny-moe: mlp = top_k 2 x 3*64*64 (experts) + 64*8 (router) = 25088 per layer; attention as tiny.
    shape = flavors.get_shape("tiny-moe")
    n = 2 * (12288 + 25088) + 9723904
    assert profiling.flops_per_token(shape, 128) == 6 * n + 98304


def test_flops_per_token_follows_the_6n_rule_for_8b():
    shape = flavors.get_shape("8B")
    # Published rule: ~6 x parameters per token (attention adds ~7% at 4096 tokens, the embedding lookup is free).
    assert profiling.flops_per_token(shape, 4096) == pytest.approx(6 * shape.official_params, rel=0.05)
    # Exactly 6 x (all parameters - embedding) up to the norms, with attention switched off (seq_len 0).
    counts = flavors.count_params(shape)
    assert profiling.flops_per_token(shape, 0) == pytest.approx(6 * (counts["total"] - counts["embedding"]), rel=1e-4)


def test_flops_per_token_moe_counts_active_experts_only():
    shape = flavors.get_shape("30B-A3B")
    counts = flavors.count_params(shape)  # "active": top_k of num_experts experts
    assert profiling.flops_per_token(shape, 0) == pytest.approx(6 * (counts["active"] - counts["embedding"]), rel=1e-3)
    assert profiling.flops_per_token(shape, 0) < 0.2 * 6 * counts["total"]


# ------------------------------------------------------------------------------------------------
# Peak FLOP/s
# ------------------------------------------------------------------------------------------------


def test_neuron_peak_is_per_logical_core(monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert profiling.peak_flops("neuron", "bfloat16") == 158e12  # trn2 default LNC=2: 2 x 79
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert profiling.peak_flops("neuron", "bfloat16") == 79e12


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12),
                                        ("NVIDIA H100 PCIe", 756e12), ("NVIDIA A100-SXM4-80GB", 312e12)])
def test_gpu_peaks_by_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)
    assert profiling.peak_flops("cuda", "bfloat16") == peak


def test_cpu_peak_is_measured_once_per_core_and_scaled_by_threads(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(profiling, "measure_matmul_peak", lambda dtype: calls.append(dtype) or 50e9)
    threads = torch.get_num_threads()
    assert profiling.peak_flops("cpu", "float32") == 50e9 * threads
    assert profiling.peak_flops("cpu", "float32") == 50e9 * threads
    assert calls == ["float32"]  # the second call read the cache
    assert torch.get_num_threads() == threads  # measured on one thread, pool size restored
    assert list(json.loads((tmp_path / "workbench" / "cpu_peak_flops.json").read_text()).values()) == [50e9]


# ------------------------------------------------------------------------------------------------
# Trace analysis and the profiler hook (no training)
# ------------------------------------------------------------------------------------------------


def _x(name: str, ts: float, dur: float, cat: str = "user_annotation") -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 1, "tid": 1}


def test_step_breakdown_of_a_synthetic_trace():
    events = [_x("ProfilerStep#7", 0, 10_000), _x("data", 0, 500), _x("forward", 500, 3000),
              _x("backward", 3500, 5000), _x("optimizer", 8500, 1000),
              # overlapping collectives inside backward: counted once (union), not twice
              _x("c10d::allreduce_", 4000, 1000, "cpu_op"), _x("gloo:all_reduce", 4500, 1000, "cpu_op"),
              _x("ProfilerStep#8", 20_000, 2_000), _x("forward", 20_000, 2_000)]
    df = profiling.step_breakdown({"traceEvents": events})
    first = df.iloc[0]
    assert list(df.step) == [7, 8]
    assert (first.step_ms, first.data_ms, first.forward_ms, first.backward_ms, first.optimizer_ms) == (10, .5, 3, 5, 1)
    assert first.other_ms == pytest.approx(0.5)
    assert first.communication_ms == pytest.approx(1.5)
    assert df.iloc[1].forward_ms == 2 and df.iloc[1].other_ms == 0


def test_step_profiler_writes_trace_and_tables(tmp_path):
    cfg = Profiling(enable=True, start_step=2, steps=2, folder="profiling")
    prof = profiling.StepProfiler(cfg, tmp_path, "cpu", last_step=4)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters())
    profiling.label_calls(opt, "step", "optimizer")
    batches = profiling.Labelled(iter([torch.randn(8, 32) for _ in range(4)]), "data")
    for step in range(1, 5):
        with prof.step(step):
            x = next(batches)
            with record_function("forward"):
                loss = model(x).square().mean()
            with record_function("backward"):
                loss.backward()
            opt.step()
            opt.zero_grad()
    folder = tmp_path / "profiling"
    with gzip.open(folder / "trace_rank0.json.gz", "rt") as f:
        assert json.load(f)["traceEvents"]
    breakdown = pd.read_csv(folder / "breakdown_rank0.csv")
    assert list(breakdown.step) == [2, 3]  # step 1 was the warm-up, step 4 outside the window
    assert (breakdown[["data_ms", "forward_ms", "backward_ms", "optimizer_ms"]] > 0).all().all()
    assert "aten::addmm" in set(pd.read_csv(folder / "top_ops_rank0.csv").op)
    assert json.loads((folder / "profile_rank0.json").read_text())["peak_memory_bytes"] > 0
    assert (folder / "breakdown_rank0.md").read_text().startswith("| step | step_ms |")


# ------------------------------------------------------------------------------------------------
# A profiled training run
