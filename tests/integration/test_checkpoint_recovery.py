"""Crashes and corrupt files (issues 13, 24): resume from the newest verified checkpoint (flipped bytes, truncated or
missing files), a folder of unusable checkpoints refused, saves that cannot hurt older ones, a non-finite stop, and
one readable error per failure, with real torchrun over gloo and a real full filesystem."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import xxhash

from tests.run_helpers import kill_run_when, losses_by_step, run_train
from workbench.run.checkpoint import check_checkpoint, newest_complete, verify_checkpoint

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)

DENSE = "configs/cpu_dense.toml"
# The lr schedule is fixed to 12 steps, so that runs of any length (and any checkpoint interval) follow one curve.
COMMON = ("--model.backend", "native", "--checkpoint.enable", "true", "--lr_scheduler.total_steps", "12")


def copy_checkpoints(src_run: Path, dst_run: Path, steps: list[int]) -> Path:
    (dst_run / "checkpoint").mkdir(parents=True)
    for s in steps:
        shutil.copytree(src_run / "checkpoint" / f"step-{s}", dst_run / "checkpoint" / f"step-{s}")
    return dst_run / "checkpoint"


def last_lines(proc: subprocess.CompletedProcess, n: int) -> str:
    return "\n".join((proc.stderr.strip().splitlines())[-n:])


# ---- cheap checks (no training) -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_check_checkpoint_reads_the_dcp_metadata(reference_12, tmp_path):
    ckpt = copy_checkpoints(reference_12[0], tmp_path / "run", [4])
    step = ckpt / "step-4"
    assert verify_checkpoint(step) is None
    metadata = step / ".metadata"
    size = metadata.stat().st_size
    with open(metadata, "ab") as f:
        f.write(b"x")
    assert check_checkpoint(step) == f"{metadata} has {size + 1:,} bytes, {size:,} were written"

    def rewrite(data: bytes) -> None:  # a .metadata whose checksums.json entry agrees in size and hash
        metadata.write_bytes(data)
        sums = json.loads((step / "checksums.json").read_text())
        sums["files"][".metadata"] = {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
        (step / "checksums.json").write_text(json.dumps(sums))

    md = pickle.loads(metadata.read_bytes()[:-1])  # metadata that names a file the checkpoint lacks
    first = next(iter(md.storage_data))
    info = md.storage_data[first]
    md.storage_data[first] = type(info)("__7_0.distcp", info.offset, info.length)
    rewrite(pickle.dumps(md))
    assert check_checkpoint(step) == f"{step / '__7_0.distcp'} is missing"
    rewrite(b"not a pickle")
    assert check_checkpoint(step) == f"{metadata} is unreadable (UnpicklingError)"


# ---- acceptance: flipped bytes in the newest shard -> named, resume from step 4, the same losses -------------------

@pytest.mark.slow
def test_flipped_bytes_resume_from_the_previous_step(reference_12, tmp_path):
    ref_dir, ref = reference_12
    ckpt = copy_checkpoints(ref_dir, tmp_path / "cpu_dense", [4, 8])  # a run stopped after its step-8 save ...
    shard = ckpt / "step-8" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())  # ... whose step-8 shard then got 100 random bytes in the middle
    middle = len(data) // 2
    data[middle:middle + 100] = os.urandom(100)
    shard.write_bytes(bytes(data))
    proc = run_train(DENSE, *COMMON, "--checkpoint.interval", "4", "--training.steps", "12",
                     "--job.dump_folder", str(tmp_path), nproc=2)
    assert f"checkpoint step 8 is unusable: {shard} does not match its checksum" in proc.stdout
    assert "resuming from step 4" in proc.stdout and "steps 5-12" in proc.stdout
    resumed = losses_by_step(tmp_path / "cpu_dense")
    assert sorted(resumed) == list(range(5, 13))
    diff = max(abs(resumed[s] - ref[s]) for s in range(5, 13))
    print(f"flipped-bytes resume: max |loss - reference| over steps 5-12 = {diff:.3g}")
    assert diff <= 1e-6
    assert verify_checkpoint(ckpt / "step-8") is None  # re-saved whole, not mixed with the damaged file


@pytest.mark.slow
def test_a_folder_of_unusable_checkpoints_is_refused(reference_12, tmp_path):
    ckpt = copy_checkpoints(reference_12[0], tmp_path / "cpu_dense", [4, 8])
    for step in (4, 8):  # every step's commit point gone (the issue removed every .metadata)
        (ckpt / f"step-{step}" / "checksums.json").unlink()
    proc = run_train(DENSE, *COMMON, "--checkpoint.interval", "4", "--training.steps", "12",
                     "--job.dump_folder", str(tmp_path), nproc=2, check=False)
    tail = last_lines(proc, 4)
    assert "exitcode  : 4" in proc.stderr and f"workbench: checkpoint error: no usable checkpoint in {ckpt} (step 8:" \
        in tail and "nothing was deleted" in tail, proc.stderr[-3000:]
    assert "step 1/12" not in proc.stdout and sorted(p.name for p in ckpt.iterdir()) == ["step-4", "step-8"]
    assert not (tmp_path / "cpu_dense" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_checkpoint_of_another_model_is_a_config_error(reference_12, tmp_path):
    copy_checkpoints(reference_12[0], tmp_path / "cpu_dense", [4])
    proc = run_train(DENSE, *COMMON, "--model.flavor", "tiny-moe", "--training.steps", "12",
                     "--job.dump_folder", str(tmp_path), nproc=1, check=False)
    assert proc.returncode != 0
    tail = last_lines(proc, 4)
    assert "exitcode  : 2" in proc.stderr and "workbench: config error: checkpoint" in tail, tail
    assert re.search(r"layers\.\d+\.\S+: expected \(.*\), found (\(.*\)|no such key)", tail), tail
    assert "Traceback" not in proc.stdout and "[rank0]" not in proc.stderr


# ---- non-finite loss: one line, exit code 3, nothing of that state saved ------------------------------------------

@pytest.mark.slow
def test_diverging_run_stops_with_one_line(tmp_path):
    proc = run_train(DENSE, *COMMON, "--optimizer.lr", "1e4", "--checkpoint.interval", "1", "--training.steps", "8",
                     "--job.dump_folder", str(tmp_path), nproc=2, check=False)
    assert proc.returncode != 0
    both = proc.stdout + proc.stderr
    m = re.search(r"workbench: non-finite loss: step (\d+): loss (\S+), grad norm (\S+);", both)
    assert m, both[-3000:]
    step = int(m.group(1))
    ckpt = tmp_path / "cpu_dense" / "checkpoint"
    assert newest_complete(ckpt) == step - 1 and not (ckpt / f"step-{step}").exists()
    assert f"the last checkpoint kept is {ckpt}/step-{step - 1}" in both and "Fix: lower --optimizer.lr" in both
    # once, at the end of torchrun's output (its failure summary), with the distinct exit code; no rank tracebacks
    assert both.count("workbench: non-finite loss") == 1 and m.group(0) in last_lines(proc, 3)
    assert proc.stderr.count("exitcode  : 3") == 2 and "[rank0]" not in both and "[rank1]" not in both


# ---- saves that cannot hurt older checkpoints: full disk, kill -9 mid-save ----------------------------------------

@pytest.fixture
def small_fs(tmp_path):
    """A real 400 MB filesystem (tmpfs): room for two checkpoints of the tiny model (158 MB each), not three."""
    mnt = tmp_path / "small_fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400m", f"wb-{uuid.uuid4().hex[:8]}", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_full_disk_keeps_older_checkpoints(small_fs):
    args = (*COMMON, "--checkpoint.interval", "2", "--training.steps", "6", "--job.dump_folder", str(small_fs))
    proc = run_train(DENSE, *args, nproc=2, check=False)
    both = proc.stdout + proc.stderr
    ckpt = small_fs / "cpu_dense" / "checkpoint"
    assert "workbench: warning: " in proc.stdout and "a save will fail with a full disk" in proc.stdout
    assert proc.returncode != 0 and "exitcode  : 4" in proc.stderr, both[-3000:]
    assert "saving step 6" in last_lines(proc, 3) and "the disk is full" in both and "step 4 is intact" in both
    assert both.count("workbench: checkpoint error") == 1 and "[rank0]" not in both
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4"]  # the partial step 6 is gone
    assert check_checkpoint(ckpt / "step-2") is None and check_checkpoint(ckpt / "step-4") is None
    # The relaunch loads step 4 (intact), then refuses before its first save when asked to.
    proc = run_train(DENSE, *args, "--checkpoint.refuse_low_disk", "true", nproc=2, check=False)
    assert proc.returncode != 0 and "exitcode  : 4" in proc.stderr
    assert "GiB free" in last_lines(proc, 3) and "refuse_low_disk false" in last_lines(proc, 3)
    assert "step 5/6" not in proc.stdout


@pytest.mark.slow
def test_kill_during_save_keeps_older_checkpoints(reference_12, tmp_path):
    run_dir = tmp_path / "cpu_dense"
    ckpt = run_dir / "checkpoint"
    args = (*COMMON, "--checkpoint.interval", "2", "--training.steps", "6", "--job.dump_folder", str(tmp_path))
    env = {**os.environ, "WORKBENCH_TEST_SAVE_DELAY_S": "3"}  # every save pauses 3 s before its .metadata
    step4 = ckpt / "step-4"
    # inside the step-4 save: both shard files written, the commit (.metadata) not yet
    kill_run_when(DENSE, *args, nproc=2, env=env, timeout=400,
                  ready=lambda: (ckpt / "step-2" / ".metadata").is_file() and len(list(step4.glob("*.distcp"))) == 2)
    assert not (step4 / ".metadata").exists(), "the kill did not land inside the step-4 save"
    assert check_checkpoint(ckpt / "step-2") is None
    # The relaunch ignores the partial step 4 and continues from step 2 on the reference curve.
    proc = run_train(DENSE, *args[:-4], "--training.steps", "4", "--job.dump_folder", str(tmp_path), nproc=2)
    assert "steps 3-4" in proc.stdout
    after = losses_by_step(run_dir)
    for step in (3, 4):
        assert abs(after[step] - reference_12[1][step]) <= 1e-6, (step, after[step], reference_12[1][step])
    assert check_checkpoint(ckpt / "step-2") is None and check_checkpoint(ckpt / "step-4") is None
