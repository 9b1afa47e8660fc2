"""The one disk rule for checkpoints (`run_folder.checkpoint_space`), used by doctor, plan and the checkpointer."""

from __future__ import annotations

import shutil

from workbench.run.run_folder import checkpoint_space


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
