"""Integration: the native path trains for real (torchtitan Trainer, FSDP2 over gloo, 1 and 2 ranks), writes the run
folder, checkpoints, and resumes exactly, including after SIGKILL. Two agents (`--nnodes=2`, c10d rendezvous on
127.0.0.1) against one: tests/test_trn2_sbatch.py, through the Slurm script that launches them."""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import psutil
import pytest

from tests.run_helpers import (
    FIRST_12_OF_30,
    cached_run,
    kill_run_when,
    losses_by_step,
    read_metrics,
    run_train,
)
from workbench.run.run_folder import step_dirs

pytestmark = pytest.mark.slow
DENSE, MOE = "configs/cpu_dense.toml", "configs/cpu_moe.toml"


def assert_learns(run_dir: Path, steps: int = 12) -> list[float]:
    losses = [losses_by_step(run_dir)[s] for s in range(1, steps + 1)]
    assert all(math.isfinite(x) for x in losses)
    first5, last5 = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last5 <= first5 - 1.0, f"loss did not fall by 1.0: first-5 mean {first5:.3f}, last-5 mean {last5:.3f}"
    return losses


@pytest.mark.parametrize("config", [DENSE, MOE])
def test_native_trains_12_steps(config, tmp_path_factory):
    """2 ranks (the shared launches); 1 rank runs the same model on every step and is held to its golden curve."""
    run_dir, stdout = cached_run(tmp_path_factory, config, "--model.backend", "native", *FIRST_12_OF_30, nproc=2)
    assert_learns(run_dir)
    # run folder contract
    assert (run_dir / "config.toml").is_file()
    rec = read_metrics(run_dir)[-1]
    for key in ("step", "loss", "tokens_per_second", "mfu", "peak_memory_bytes", "backend"):
        assert key in rec
    assert rec["backend"] == "native" and 0 < rec["mfu"] < 1 and rec["peak_memory_bytes"] > 0
    # rank 0 prints one progress line per step and a summary; the other rank stays quiet
    assert stdout.count("step 12/12") == 1 and "done: native" in stdout


COMMON = ("--model.backend", "native", "--checkpoint.enable", "true", "--checkpoint.interval", "5",
          "--lr_scheduler.total_steps", "30")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, dict]:
    """The reference records by step: the shared 2-rank launch, 12 steps of the same 30-step lr schedule as COMMON
    (saving checkpoints changes no number, so the launch without them serves)."""
    run_dir, _ = cached_run(tmp_path_factory, DENSE, "--model.backend", "native", *FIRST_12_OF_30, nproc=2)
    return {m["step"]: m for m in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[Path, int, int]:
    """A 2-rank 12-step launch (checkpoints every 5 steps) SIGKILLed, torchrun and both ranks at once, once step 6
    is logged: (its dump folder, the last step it logged, its newest complete checkpoint). Tests resume copies."""
    outdir = tmp_path_factory.mktemp("killed")
    run_dir = outdir / "cpu_dense"
    victims = kill_run_when(DENSE, *COMMON, "--job.dump_folder", str(outdir), "--training.steps", "12", nproc=2,
                            timeout=300, ready=lambda: ((run_dir / "metrics.jsonl").is_file()
                                                        and max(losses_by_step(run_dir), default=0) >= 6))
    time.sleep(0.5)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in victims)
    killed_at = max(losses_by_step(run_dir))
    return outdir, killed_at, max(step_dirs(run_dir / "checkpoint", complete=True))  # committed: checksums written


def test_sigkill_loses_at_most_one_interval(uninterrupted, killed, tmp_path):
    """The same command relaunched after a SIGKILL continues from the newest complete checkpoint, exactly."""
    src, killed_at, resume_from = killed
    assert 6 <= killed_at < 12, killed_at
    assert killed_at - resume_from < 5  # at most one interval lost
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    proc = run_train(DENSE, *COMMON, "--job.dump_folder", str(tmp_path), "--training.steps", "12", nproc=2)
    assert f"steps {resume_from + 1}-12" in proc.stdout
    after = losses_by_step(tmp_path / "cpu_dense")
    for step in range(resume_from + 1, 13):
        assert abs(after[step] - uninterrupted[step]["loss"]) <= 1e-6, (step, after[step], uninterrupted[step])


def test_resume_two_ranks_to_one_to_two_keeps_the_batch_and_the_counts(uninterrupted, killed, tmp_path):
    """The killed 2-rank run (local batch 2) resumed on 1 rank with the same command, then on 2 again: the
    checkpoint's global batch of 4 rows is kept (2 accumulation steps on 1 rank, said at launch), the data position
    is global, so every step sees the uninterrupted run's rows (only the order of fp32 reductions differs), and
    n_tokens_seen counts every rank's tokens across both resumes."""
    src, _, resume_from = killed
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    mid = min(resume_from + 2, 11)
    one = run_train(DENSE, *COMMON, "--job.dump_folder", str(tmp_path), "--training.steps", str(mid), nproc=1)
    assert (f"workbench: resuming with the checkpoint's global batch of 4 rows: 1 data-parallel rank(s) x local batch "
            f"2 x 2 accumulation step(s) (step {resume_from} trained with 2 data-parallel rank(s) x local batch 2 x 1 "
            "accumulation step(s)).") in one.stdout
    assert f"steps {resume_from + 1}-{mid}" in one.stdout
    two = run_train(DENSE, *COMMON, "--job.dump_folder", str(tmp_path), "--training.steps", str(mid + 1), nproc=2)
    assert f"steps {mid + 1}-{mid + 1}" in two.stdout and "resuming with" not in two.stdout  # the config's batch
    records = {m["step"]: m for m in read_metrics(tmp_path / "cpu_dense")}
    for step in range(resume_from + 1, mid + 2):
        assert abs(records[step]["loss"] - uninterrupted[step]["loss"]) <= 1e-4, (step, records[step])
        assert records[step]["n_tokens_seen"] == uninterrupted[step]["n_tokens_seen"] == step * 4 * 128
