"""workbench.bench: statistics of a run, failure isolation and the report files, and the real three-path matrix."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from tests.run_helpers import ROOT
from workbench import bench


def _write_run(run_dir: Path, step_times: list[float], tokens_per_step: int = 256, backend: str = "native") -> None:
    """A run folder as the trainer writes it: metrics.jsonl (rank 0) + summary.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step, t in enumerate(step_times, start=1):
            f.write(json.dumps({"step": step, "loss": 12.0 - step, "tokens_per_second": tokens_per_step / t,
                                "mfu": 0.01 / t, "step_time_s": t, "peak_memory_bytes": step * 2**30,
                                "backend": backend}) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"init_seconds": 3.5}))


def test_summarize_run_skips_warmup_steps(tmp_path):
    _write_run(tmp_path, [9.0, 4.0, 1.0, 2.0, 1.0, 3.0, 1.0])
    row = bench.summarize_run(tmp_path, warmup_steps=2, nproc=2)
    timed = [1.0, 2.0, 1.0, 3.0, 1.0]
    assert row["step_time_median_s"] == 1.0
    # p90 by hand (linear between order statistics): sorted 1, 1, 1, 2, 3; rank 0.9 x 4 = 3.6 -> 2 + 0.6 x (3 - 2)
    assert row["step_time_p90_s"] == pytest.approx(2.6, abs=1e-12) and sorted(timed)[3:] == [2.0, 3.0]
    assert row["tokens_per_s"] == 256.0 and row["tokens_per_s_all_ranks"] == 512.0
    assert row["mfu"] == 0.01
    assert row["first_step_s"] == 9.0 and row["init_s"] == 3.5
    assert row["peak_memory_gib"] == 7.0 and row["final_loss"] == 5.0
    assert (row["steps"], row["timed_steps"]) == (7, 5)
    # A run no longer than the warm-up is timed on its last step.
    assert bench.summarize_run(tmp_path, warmup_steps=10, nproc=1)["timed_steps"] == 1
    last = bench.summarize_run(tmp_path, warmup_steps=7, nproc=1)  # exactly as long as the warm-up
    assert (last["timed_steps"], last["step_time_median_s"]) == (1, 1.0)


def test_bench_figures_by_hand_on_a_known_run(tmp_path):
    """Every summary figure against a hand computation on records whose medians and maxima differ from the first,
    last, mean or warm-up values (an even count of timed steps: the median is the mean of the middle two)."""
    run = tmp_path / "run"
    run.mkdir()
    records = [  # step, loss, tokens/s, mfu, step time, peak bytes
        (1, 11.0, 50.0, 0.001, 20.0, 3 * 2**30), (2, 10.0, 400.0, 0.009, 0.5, 2**30),
        (3, 9.5, 100.0, 0.002, 2.0, 2**30), (4, 9.0, 300.0, 0.006, 0.8, 2**29),
        (5, 8.0, 200.0, 0.004, 1.0, 2**30), (6, 7.5, 250.0, 0.005, 1.2, 2**31)]
    with open(run / "metrics.jsonl", "w") as f:
        for step, loss, tps, mfu, t, peak in records:
            f.write(json.dumps({"step": step, "loss": loss, "tokens_per_second": tps, "mfu": mfu, "step_time_s": t,
                                "peak_memory_bytes": peak}) + "\n")
    row = bench.summarize_run(run, warmup_steps=2, nproc=4)
    # timed: steps 3-6; tokens/s 100, 300, 200, 250 -> sorted 100, 200, 250, 300 -> median (200 + 250) / 2
    assert row["tokens_per_s"] == 225.0 and row["tokens_per_s_all_ranks"] == 900.0
    assert row["step_time_median_s"] == pytest.approx((1.0 + 1.2) / 2)  # sorted 0.8, 1.0, 1.2, 2.0
    assert row["step_time_p90_s"] == pytest.approx(1.2 + 0.7 * (2.0 - 1.2))  # rank 0.9 x 3 = 2.7
    assert row["mfu"] == pytest.approx((0.004 + 0.005) / 2)
    assert row["peak_memory_gib"] == 3.0  # the highest of every step, warm-up included
    assert row["first_step_s"] == 20.0 and row["final_loss"] == 7.5 and (row["steps"], row["timed_steps"]) == (6, 4)
    assert math.isnan(row["init_s"])  # no summary.json
    # a resumed run's records start after step 1: no first-step time
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "tokens_per_second": 1.0,
                                                           "mfu": 0.1, "step_time_s": 1.0, "peak_memory_bytes": 1})
                                               + "\n" for s in (5, 6)))
    assert math.isnan(bench.summarize_run(run, warmup_steps=0, nproc=1)["first_step_s"])


def test_speed_vs_native_by_hand(tmp_path, monkeypatch):
    """native at 256 tokens per 1 s step, huggingface_v5 at 256 per 4 s: 0.25 of native (and native 1.0)."""
    import workbench.train

    def fake_train(job, nproc, stream, timeout_s=None):
        _write_run(job.run_dir, [1.0] * 4 if job.model.backend == "native" else [4.0] * 4, backend=job.model.backend)
        return job.run_dir

    monkeypatch.setattr(workbench.train, "train", fake_train)
    df = bench.run_matrix(ROOT / "configs/cpu_dense.toml", ["huggingface_v5", "native"], steps=4, out=tmp_path,
                          show_progress=False, warmup_steps=1).set_index("backend")
    assert df.loc["huggingface_v5", "tokens_per_s"] == 64.0 and df.loc["native", "tokens_per_s"] == 256.0
    assert df.loc["huggingface_v5", "speed_vs_native"] == 0.25 and df.loc["native", "speed_vs_native"] == 1.0


def test_a_failing_path_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    """run_matrix with the launcher stubbed: one path crashes, one does not apply, one succeeds."""
    import workbench.train

    def fake_train(job, nproc, stream, timeout_s=None):
        if job.model.backend == "huggingface_v5":
            stream("Traceback (most recent call last):\n")
            stream("RuntimeError: boom in the HF path\n")
            stream("E1202 torchrun: exitcode 1\n")
            raise subprocess.CalledProcessError(1, ["torchrun"])
        stream("step 1/3  loss 11.9\n")
        _write_run(job.run_dir, [5.0, 1.0, 1.0], backend=job.model.backend)
        return job.run_dir

    monkeypatch.setattr(workbench.train, "train", fake_train)
    df = bench.run_matrix(ROOT / "configs/cpu_dense.toml", steps=3, out=tmp_path, show_progress=False)
    by = df.set_index("backend")
    assert list(df.backend) == ["huggingface_v5", "native", "nki_moe"]
    assert by.loc["huggingface_v5", "status"] == "failed"
    assert by.loc["huggingface_v5", "error"] == "RuntimeError: boom in the HF path"
    assert by.loc["nki_moe", "status"] == "skipped" and "dense" in by.loc["nki_moe", "error"]  # not MoE
    assert by.loc["native", "status"] == "ok" and by.loc["native", "speed_vs_native"] == 1.0
    assert by.loc["native", "time_to_first_step_s"] >= 0
    for name in ("bench.csv", "bench.md", "bench.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "boom in the HF path" in (tmp_path / "bench.md").read_text()
    assert len(pd.read_csv(tmp_path / "bench.csv")) == 3


def test_nki_moe_row_carries_the_modeled_trn2_layer_time(tmp_path, monkeypatch):
    """On a MoE config the nki_moe row gets the time model's trn2 MoE-layer figures (the real emulator run at
    cpu_moe's shapes, under a second), labelled as a model in bench.md; the other rows stay empty there."""
    import workbench.train
    from workbench.core.config import load_config
    from workbench.kernels.moe_cost import trn2_moe_layer

    def fake_train(job, nproc, stream, timeout_s=None):
        _write_run(job.run_dir, [5.0, 1.0, 1.0], backend=job.model.backend)
        return job.run_dir

    monkeypatch.setattr(workbench.train, "train", fake_train)
    df = bench.run_matrix(ROOT / "configs/cpu_moe.toml", ["native", "nki_moe"], steps=3, out=tmp_path,
                          show_progress=False).set_index("backend")
    want = trn2_moe_layer(load_config(ROOT / "configs/cpu_moe.toml", argv=["--training.steps", "3"]))
    assert df.loc["nki_moe", "trn2_moe_layer_model_ms"] == want["model_ms"] >= want["model_ms_overlap"] > 0
    assert df.loc["nki_moe", "trn2_moe_layer_serial_ms"] == want["model_ms_serial"] >= want["model_ms_overlap"]
    assert df.loc["nki_moe", "trn2_moe_layer_roofline_ms"] == want["roofline_ms"] > 0
    assert df.loc[["native"], bench.MODEL_COLUMNS].isna().all(axis=None)
    assert "**Modeled, not measured:**" in (tmp_path / "bench.md").read_text()


def test_the_command_line_runs_the_matrix_and_says_where_it_wrote(tmp_path, monkeypatch, capsys):
    """`python -m workbench.bench` end to end with the launcher stubbed (the real three-path launches are
    tests/integration/test_accelerator_check.py's: the same `run_backend`)."""
    import workbench.train

    def fake_train(job, nproc, stream, timeout_s=None):
        _write_run(job.run_dir, [5.0, 1.0, 2.0, 1.0], backend=job.model.backend)
        return job.run_dir

    monkeypatch.setattr(workbench.train, "train", fake_train)
    code = bench.main(["--job.config_file", str(ROOT / "configs/cpu_moe.toml"), "--steps", "4", "--warmup-steps", "1",
                       "--out", str(tmp_path), "--backends", "native,nki_moe"])
    out = capsys.readouterr().out
    assert code == 0 and f"wrote {tmp_path / 'bench.csv'}, bench.md, bench.png" in out
    df = pd.read_csv(tmp_path / "bench.csv")
    assert list(df.backend) == ["native", "nki_moe"] and (df.status == "ok").all()
    assert (df.step_time_median_s == 1.0).all() and (df.tokens_per_s == 256.0).all()
    assert (tmp_path / "bench.png").stat().st_size > 0 and "| native | ok |" in (tmp_path / "bench.md").read_text()
    assert bench.main(["--job.config_file", str(ROOT / "configs/cpu_moe.toml"), "--backends", "nope",
                       "--out", str(tmp_path)]) == 2
