"""workbench.run.run_folder: one launch per run folder (the lock: a second holder refused, a stale one taken over),
and the one disk rule for checkpoints (`checkpoint_space`), used by doctor, plan and the checkpointer."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from tests.run_helpers import python_child
from workbench.core import errors
from workbench.run import run_folder
from workbench.run.run_folder import LOCK_FILE, RunLock, checkpoint_space


def test_peak_copies_and_bytes_still_needed(tmp_path):
    folder = tmp_path / "run" / "checkpoint"
    for _ in range(20):  # the disk is shared with the other test worker: compare at a moment its free bytes held
        before = shutil.disk_usage(tmp_path).free
        fresh = checkpoint_space(folder, 1000, keep_latest_k=0, steps=30, interval=10)
        if shutil.disk_usage(tmp_path).free == before:
            break
    assert fresh.where == tmp_path  # not created yet: the nearest existing folder's file system is asked
    assert (fresh.copies, fresh.need_bytes) == (4, 4000)  # keep all: steps 10, 20, 30 + the last step's (bound)
    assert fresh.free_bytes == before and fresh.fits

    for step in (10, 20):  # two checkpoints of 600 bytes already on disk
        (folder / f"step-{step}").mkdir(parents=True)
        (folder / f"step-{step}" / "shard").write_bytes(b"x" * 600)
    resumed = checkpoint_space(folder, 600, keep_latest_k=2, steps=50, interval=10, done_steps=20)
    assert resumed.where == folder
    # keep_latest_k old ones beside the one being written; what is on disk already counts
    assert (resumed.copies, resumed.need_bytes) == (3, 3 * 600 - 1200)
    assert checkpoint_space(folder, 600, 0, 50, 10, 20).copies == 2 + 3 + 1  # keep all: on disk + still to come
    assert not checkpoint_space(folder, 10**18, 1, 50, 10, 20).fits  # an exabyte checkpoint fits nowhere


def test_lock_refuses_a_second_holder_and_takes_over_a_stale_one(tmp_path):
    run = tmp_path / "run"
    holder = python_child(f"from workbench.run.run_folder import RunLock; RunLock({str(run)!r}).acquire(); "
                          "print('held', flush=True); import time; time.sleep(60)")
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


def test_step_dir_without_checkpoints_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        run_folder.step_dir(tmp_path, "checkpoint", None)
    assert str(e.value) == (f"No DCP checkpoint in {tmp_path / 'checkpoint'}: train with --checkpoint.enable true "
                            "(and --checkpoint.interval N) to write one.")


@pytest.mark.parametrize("name", [".lock", "summary.json", "checkpoint"])
def test_a_link_in_a_run_folder_is_refused_and_its_target_untouched(tmp_path, name):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(precious)
    with pytest.raises(errors.RunFolderError) as refused:
        RunLock(run).acquire()
    assert refused.value.one_line().startswith(f"workbench: run folder error: {run / name} is a symbolic link; the "
                                               "workbench never writes through one")
    assert refused.value.exit_code == errors.EXIT_CHECKPOINT and precious.read_text() == "keep me"
