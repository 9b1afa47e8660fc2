"""A profiled training run (torchrun, tiny-moe): the trace, the per-step breakdown and a real MFU (our FLOPs per token
over the measured CPU peak). The pieces in process: tests/run/test_profiling.py."""

from __future__ import annotations

import pandas as pd
import pytest

from tests.run_helpers import read_metrics, run_train
from workbench.core import flavors
from workbench.run import profiling

pytestmark = [pytest.mark.slow, pytest.mark.machine_cpu_path]  # no launch here is held to a stored number


def test_profiled_training_run_writes_trace_breakdown_and_a_real_mfu(outdir):
    run_train("configs/cpu_moe.toml", "--training.steps", "4", "--job.dump_folder", str(outdir),
              "--profiling.enable", "true", "--profiling.start_step", "3", "--profiling.steps", "2")
    run = outdir / "cpu_moe"
    folder = run / "profiling"
    trace = profiling.load_trace(folder / "trace_rank0.json.gz")
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"ProfilerStep#3", "ProfilerStep#4", "data", "forward", "backward", "optimizer"} <= names
    breakdown = pd.read_csv(folder / "breakdown_rank0.csv")
    assert list(breakdown.step) == [3, 4]
    assert (breakdown.forward_ms > 0).all() and (breakdown.backward_ms > 0).all()
    assert (breakdown.step_ms >= breakdown[["data_ms", "forward_ms", "backward_ms", "optimizer_ms"]].sum(axis=1)).all()
    # MFU = our FLOPs per token x tokens/s / the measured CPU peak (not torchtitan's A100 fallback).
    fpt = profiling.flops_per_token(flavors.get_shape("tiny-moe"), 128)
    for m in read_metrics(run):
        assert 0 < m["mfu"] < 1
        assert m["tflops"] == pytest.approx(fpt * m["tokens_per_second"] / 1e12, rel=1e-6)
