"""Runs that cannot be destroyed, through real torchrun launches over gloo (configs/cpu_dense.toml, few steps): a
clean stop on SIGTERM that saves the step while a second launch into the same folder is refused, and one line with
a documented exit code for a failure in a launch. The pieces alone: tests/run/test_run_folder.py (the lock),
tests/run/test_checkpoint.py (checksums), tests/platform/test_dist_utils.py (the stop request)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import psutil
import pytest

from tests.run_helpers import ROOT, free_port, losses_by_step, read_metrics, run_train, train_cmd
from workbench.run.checkpoint import verify_checkpoint
from workbench.run.run_folder import LOCK_FILE, step_dirs

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)

DENSE = "configs/cpu_dense.toml"
COMMON = ("--model.backend", "native", "--checkpoint.enable", "true", "--lr_scheduler.total_steps", "12")


def tail(proc, n: int = 3) -> str:
    return "\n".join(proc.stderr.strip().splitlines()[-n:])


def root_cause(proc) -> str:
    """The root-cause block of torchrun's failure summary (its last block)."""
    return proc.stderr.split("Root Cause (first observed failure):")[-1]


# ---- launches: SIGTERM at step 5 (interval 4) while a second launch into the same folder is refused ----------------

@pytest.mark.slow
def test_sigterm_saves_the_step_and_a_second_launch_is_refused(tmp_path, reference_12):
    ref_dir, ref = reference_12
    args = (*COMMON, "--checkpoint.interval", "4", "--training.steps", "12", "--job.dump_folder", str(tmp_path))
    run_dir = tmp_path / "cpu_dense"
    first = subprocess.Popen(train_cmd(DENSE, *args, nproc=2, extra_torchrun=(f"--master_port={free_port()}",)),
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs: dict[str, str] = {}
    reader = threading.Thread(target=lambda: outs.update(zip(("out", "err"), first.communicate(), strict=True)))
    reader.start()
    lock = run_dir / LOCK_FILE
    deadline = time.time() + 300
    while time.time() < deadline and first.poll() is None and not any(
            m["step"] >= 5 for m in read_metrics(run_dir, missing_ok=True)):
        time.sleep(0.05)
    # Freeze the first launch's ranks (SIGSTOP) while the second launch tries the folder: the first still holds the
    # lock, whatever the machine's speed (it used to finish its steps before the second got that far on a fast one).
    ranks = [psutil.Process(c.pid) for c in psutil.Process(first.pid).children(recursive=True)]
    assert ranks and first.poll() is None, "the first launch ended before step 5"
    for r in ranks:
        r.suspend()
    try:
        second = run_train(DENSE, *args, "--optimizer.lr", "1e-3", nproc=2, check=False)
    finally:
        for r in ranks:
            r.resume()
    first.send_signal(signal.SIGTERM)  # to torchrun, as `kill PID`, Slurm or a scheduler would
    reader.join()
    # The second launch: refused in one line naming the holder, the root cause of torchrun's summary, exit code 2.
    holder = json.loads(lock.read_text() or "{}")
    assert "exitcode  : 2" in second.stderr and "[rank0]" not in second.stderr, tail(second, 30)
    assert f"workbench: run folder locked: {run_dir} is in use by another launch (host " in root_cause(second)
    # The first: finished its step, saved it, one line with the step and how to resume; rank exit code 5.
    saved = max(step_dirs(run_dir / "checkpoint", complete=True))
    assert 5 <= saved < 8, saved  # step 5 or the one running when the signal came, not the interval's 8
    line = (f"workbench: stopped: SIGTERM after step {saved}: checkpoint step {saved} is saved in "
            f"{run_dir}/checkpoint/step-{saved}. Resume: relaunch the same command: it continues after step {saved}.")
    assert outs["err"].count(line) == 1, outs["err"][-3000:]
    assert "Traceback" not in outs["err"].split(line)[0]  # no rank traceback before it (torchrun's own may follow)
    assert verify_checkpoint(run_dir / "checkpoint" / f"step-{saved}") is None and not holder
    assert "lr = 0.003" in (run_dir / "config.toml").read_text()  # the refused launch wrote nothing
    # The resume is exact and no step is logged twice; keep_latest_k = 2 leaves 2 checkpoints, also after the last
    # step's save (torchtitan purges after interval saves only: 3 were left).
    run_train(DENSE, *args, "--checkpoint.keep_latest_k", "2", nproc=2)
    steps = [m["step"] for m in read_metrics(run_dir)]
    assert steps == list(range(1, 13)), steps
    resumed = losses_by_step(run_dir)
    diff = max(abs(resumed[s] - ref[s]) for s in range(saved + 1, 13))
    print(f"SIGTERM stop: saved step {saved}; resumed steps {saved + 1}-12, max |loss - reference| = {diff:.3g}")
    assert diff <= 1e-6
    assert sorted(step_dirs(run_dir / "checkpoint")) == [8, 12]


# ---- every error one line: through torchrun, with its exit code --------------------------------------------------

def _one_line_failure(proc, code: int, start: str) -> str:
    """Asserts the launch failed with exit code `code`, `start...` as torchrun's root cause (not a pointer to
    another rank) and no rank traceback (torchrun's own ChildFailedError traceback stays); returns that line."""
    assert proc.returncode != 0 and f"exitcode  : {code}" in proc.stderr, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [ln for ln in root_cause(proc).splitlines() if start in ln]
    assert lines, tail(proc, 20)
    assert "Traceback" not in proc.stdout and "[rank0]" not in proc.stderr and "[rank1]" not in proc.stderr, \
        proc.stderr[-4000:]
    return lines[0].split("traceback : ")[-1].strip()


@pytest.mark.parametrize("damage", ["config", "truncated"])
@pytest.mark.slow
def test_unloadable_hf_checkpoint_is_one_line(tmp_path, damage):
    from workbench.model import export_hf, load_model

    hf = tmp_path / "hf"
    export_hf(load_model(ROOT / DENSE, backend="native"), hf, dtype="float32")
    if damage == "config":  # weights that do not match their config.json
        cfg = json.loads((hf / "config.json").read_text())
        cfg["intermediate_size"] *= 2
        (hf / "config.json").write_text(json.dumps(cfg))
    else:
        weights = hf / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = run_train(DENSE, "--model.hf_checkpoint", str(hf), "--model.flavor", "", "--training.steps", "2",
                     "--job.dump_folder", str(tmp_path / "out"), nproc=1, check=False)
    line = _one_line_failure(proc, 2, "workbench: config error:")
    assert ("expected" in line and "mlp" in line) if damage == "config" else "truncated" in line, line


@pytest.mark.slow
def test_unwritable_dump_folder_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "wb-ro", str(ro)], capture_output=True, text=True)
    target, reason = (ro, "Read-only file system") if r.returncode == 0 else (tmp_path / "file", "Not a directory")
    if r.returncode:  # not root here: a file in the way of the folder instead of a read-only mount
        target.write_text("x")
    try:
        proc = run_train(DENSE, "--training.steps", "2", "--job.dump_folder", str(target), nproc=2, check=False)
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
    line = _one_line_failure(proc, 4, "workbench: run folder error:")
    assert f"cannot create the run folder {target}/cpu_dense: {reason}. Fix: point --job.dump_folder" in line
