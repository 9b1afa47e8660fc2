"""Runs that cannot be destroyed: one launch per run folder (flock), checksummed checkpoints, a clean stop
on SIGTERM/SIGINT, and one line with a documented exit code for every failure the workbench knows.

Unit tests run the real pieces in this process or a small child process; the launches are real torchrun over gloo
(configs/cpu_dense.toml, few steps; the stop test and the second-launch test share one launch)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.run_helpers import ROOT, cached_run, free_port, losses_by_step, read_metrics, run_train, train_cmd
from workbench.core import errors
from workbench.run.checkpoint import checksumming_writer, commit_checksums, verify_checkpoint
from workbench.run.metrics import trim_metrics
from workbench.run.run_folder import LOCK_FILE, RunLock, step_dirs

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)

DENSE = "configs/cpu_dense.toml"
COMMON = ("--model.backend", "native", "--checkpoint.enable", "true", "--lr_scheduler.total_steps", "12")


@pytest.fixture(scope="module")
def reference_12(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """12 uninterrupted steps on 2 ranks, checkpoints at 4, 8, 12 (shared with test_checkpoint_recovery.py)."""
    run_dir, _ = cached_run(tmp_path_factory, DENSE, *COMMON, "--checkpoint.interval", "4", "--training.steps", "12",
                            nproc=2)
    return run_dir, losses_by_step(run_dir)


def _child(code: str) -> subprocess.Popen:
    """A Python child running `code` with the workbench importable; stdout is a pipe."""
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def tail(proc, n: int = 3) -> str:
    return "\n".join(proc.stderr.strip().splitlines()[-n:])


def root_cause(proc) -> str:
    """The root-cause block of torchrun's failure summary (its last block)."""
    return proc.stderr.split("Root Cause (first observed failure):")[-1]


# ---- one run per folder: the lock ---------------------------------------------------------------------------------

def test_lock_refuses_a_second_holder_and_takes_over_a_stale_one(tmp_path):
    run = tmp_path / "run"
    holder = _child(f"from workbench.run.run_folder import RunLock; RunLock({str(run)!r}).acquire(); print('held', "
                    "flush=True); import time; time.sleep(60)")
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(errors.RunLockedError) as refused:
        RunLock(run).acquire()
    assert re.fullmatch(rf"workbench: run folder locked: {run} is in use by another launch \(host \S+, pid "
                        rf"{holder.pid}, started [^)]+\); .* Fix: .*another folder \(--job.experiment_name\).",
                        refused.value.one_line()), refused.value.one_line()
    assert refused.value.exit_code == 2
    holder.kill()  # kill -9: no clean-up, its record stays in the lock file
    holder.wait()
    lock = RunLock(run)
    previous = lock.acquire()
    assert previous["pid"] == holder.pid  # the stale holder, named for the take-over warning
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (run / LOCK_FILE).read_text() == ""  # a clean exit leaves no stale record
    assert RunLock(run).acquire() is None


def test_lock_refuses_a_folder_it_cannot_create(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(errors.RunFolderError, match="cannot create the run folder .*file/run: Not a directory"):
        RunLock(tmp_path / "file" / "run").acquire()


# ---- checkpoints verified: checksums.json --------------------------------------------------------------------------

def _save(path: Path) -> None:
    """A real DCP save through the checksumming writer (a world of one), then the commit."""
    import torch.distributed.checkpoint as dcp

    sums: dict = {}
    state = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(7)}
    metadata = dcp.save(state, storage_writer=checksumming_writer(str(path), sums), no_dist=True)
    commit_checksums(path, sums, metadata)


def test_checksums_name_the_changed_file(tmp_path):
    step = tmp_path / "step-2"
    _save(step)
    sums = json.loads((step / "checksums.json").read_text())["files"]
    assert sorted(sums) == [".metadata", "__0_0.distcp"]
    assert all(sums[f]["bytes"] == (step / f).stat().st_size for f in sums)
    assert verify_checkpoint(step) is None
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 100] = os.urandom(100)  # the damage: 100 random bytes, size unchanged
    shard.write_bytes(bytes(data))
    assert verify_checkpoint(step) == f"{shard} does not match its checksum (bytes changed after the save)"
    shard.write_bytes(bytes(data[: middle]))
    assert verify_checkpoint(step) == f"{shard} is truncated ({middle:,} of {len(data):,} bytes)"
    shard.unlink()
    assert verify_checkpoint(step) == f"{shard} is missing"
    (step / "checksums.json").unlink()
    assert verify_checkpoint(step) == f"{step / 'checksums.json'} is missing (the save did not finish)"
    assert step_dirs(tmp_path, complete=True) == {}


def test_trim_metrics_drops_steps_after_the_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": s}) + "\n" for s in range(1, 8)))
    assert trim_metrics(tmp_path, 4) == 3
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert trim_metrics(tmp_path, 4) == 0


# ---- the stop request: SIGTERM/SIGINT once = finish and save; a second one = at once ------------------------------

STOPPER = """
import sys, time
from workbench.platform.dist_utils import StopRequest
stop = StopRequest(same_within_s=1.0)
print('ready', flush=True)
while True:
    time.sleep(0.05)
    if stop.requested and not getattr(stop, 'said', False):
        stop.said = True
        print('requested', stop.name, flush=True)
"""


def test_second_signal_stops_at_once_and_a_repeat_counts_once():
    proc = _child(STOPPER)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # Slurm signals every process and torchrun forwards: the same request twice
    assert proc.stdout.readline().strip() == "requested SIGTERM"
    time.sleep(1.5)
    assert proc.poll() is None, "a repeat within 1 s must not stop the process"
    proc.send_signal(signal.SIGINT)  # a second, later signal: at once
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, err)
    assert err.strip().splitlines()[-1] == ("workbench: stopped: a second SIGINT: stopped at once; nothing was saved "
                                             "after the newest checkpoint. Fix: relaunch the same command to resume "
                                             "from the newest checkpoint.")


def test_ctrl_c_twice_under_torchrun_is_sigint_130():
    """torchrun forwards the first Ctrl-C as SIGINT and relays the second as SIGTERM (its agent's default shutdown
    signal): the stop is reported as what the user sent, SIGINT, with the README's code 130."""
    proc = _child(STOPPER)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "requested SIGINT"
    time.sleep(1.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.strip().splitlines()[-1].startswith("workbench: stopped: a second SIGINT: stopped at once;")


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


def test_undecodable_file_is_a_located_bad_row(tmp_path, monkeypatch):
    """Bytes that are not UTF-8 are a bad row, skipped and located in the launcher's check (before any process
    group); `prepare --strict` refuses them in one line (tests/test_data.py)."""
    from workbench.core.config import load_config
    from workbench.data.loader import resolve
    from workbench.data.prepared import Prepared
    from workbench.train import check_inputs

    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("To be, or not to be.")
    (data / "b.txt").write_bytes(b"plain start " + bytes(range(128, 256)) * 40)
    check_inputs(load_config(ROOT / DENSE, ["--training.dataset", str(data), "--training.holdout_docs", "0"]))
    m = Prepared(resolve(str(data))).manifest
    assert (m["documents"], m["bad_rows"], m["bad_examples"]) == (1, 1, [f"{data / 'b.txt'}:1 (not UTF-8 (byte 12))"])


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


# ---- values checked ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lr", ["0", "-0.01", "-1e-12", "nan"])
def test_non_positive_lr_is_refused(lr):
    from workbench.core.config import load_config

    with pytest.raises(errors.ConfigError, match=rf"optimizer.lr must be positive; got {re.escape(str(float(lr)))}\."):
        load_config(ROOT / DENSE, ["--optimizer.lr", lr])
    assert load_config(ROOT / DENSE, ["--optimizer.lr", "1e-30"]).optimizer.lr == 1e-30  # the edge: any positive lr


@pytest.mark.parametrize("holdout", [0, 1])
def test_a_dataset_without_text_is_refused_whatever_holdout_docs(tmp_path, holdout, monkeypatch):
    from workbench.core.config import load_config
    from workbench.train import check_inputs

    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("")
    (data / "b.txt").write_text(" <|endoftext|>\n<|endoftext|> ")
    (data / "c.txt").write_text("\n")
    job = load_config(ROOT / DENSE, ["--training.dataset", str(data), "--training.holdout_docs", str(holdout)])
    with pytest.raises(errors.DatasetError) as refused:
        check_inputs(job)
    assert refused.value.one_line() == (
        f"workbench: config error: training.dataset={str(data)!r}: its {3 - holdout} training document(s) hold no "
        "text (empty, whitespace or <|endoftext|> only). Fix: point --training.dataset at files with text.")
    (data / "a.txt").write_text("Now is the winter of our discontent")
    check_inputs(job)  # one document with text is enough


def test_undecodable_text_names_the_file_and_offset(tmp_path):
    from workbench.data.prepare import prepare

    f = tmp_path / "latin1.txt"
    f.write_bytes("naïve café".encode("latin-1"))
    with pytest.raises(errors.DatasetError) as refused:
        prepare(str(f), tmp_path / "p", strict=True, progress=False)
    assert f"bad row {f}:1: not UTF-8 (byte 2) (prepare --strict)" in refused.value.one_line()
