"""workbench.run.checkpoint: the checks of a step folder and the choice of the checkpoint to resume from, in-process
on real DCP step folders (written by DCP through the workbench's checksumming writer, committed by
`commit_checksums`): which one is "the newest" among several, every size/metadata refusal with its exact message,
checksums that name a changed file, the train state, the purge, and DCP's pickles read through an allowlist (a
crafted one never runs). The same refusals through a launch and every command: tests/integration/."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

from tests.run_helpers import PicklePayload, free_port
from workbench.core import errors
from workbench.core.errors import CheckpointError
from workbench.run import checkpoint, run_folder
from workbench.run.checkpoint import (
    check_checkpoint,
    commit_checksums,
    load_dcp,
    newest_complete,
    read_metadata,
    stale_checkpoints,
    verify_checkpoint,
)
from workbench.run.run_folder import step_dirs

# DCP in one process without a process group (what this file wants) warns that it assumes so
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def save_step(folder: Path, step: int, complete: bool = True) -> Path:
    """A DCP checkpoint of two small tensors in `folder/step-N` (no checksums.json unless `complete`)."""
    path = folder / f"step-{step}"
    sums: dict = {}
    g = torch.Generator().manual_seed(step)
    state = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}
    metadata = dcp.save(state, storage_writer=checkpoint.checksumming_writer(str(path), sums))
    if complete:
        commit_checksums(path, sums, metadata)
    return path


def shard(path: Path) -> Path:
    return next(p for p in sorted(path.iterdir()) if p.suffix == ".distcp")


@pytest.fixture
def steps(tmp_path) -> Path:
    """Complete saves at steps 2, 9, 10 (10 sorts before 9 as text) and an unfinished one at 12."""
    folder = tmp_path / "run" / "checkpoint"
    for s in (2, 9, 10):
        save_step(folder, s)
    save_step(folder, 12, complete=False)
    return folder


def test_newest_of_several_is_the_highest_complete_step(steps):
    assert newest_complete(steps) == 10
    assert sorted(run_folder.step_dirs(steps)) == [2, 9, 10, 12]
    assert sorted(run_folder.step_dirs(steps, complete=True)) == [2, 9, 10]
    assert run_folder.step_dir(steps.parent, "checkpoint", None) == steps / "step-10"
    assert run_folder.step_dir(steps.parent, "checkpoint", 9) == steps / "step-9"
    with pytest.raises(FileNotFoundError, match=r"No checkpoint for step 12 in .*; available steps: 2, 9, 10\.$"):
        run_folder.step_dir(steps.parent, "checkpoint", 12)
    (steps / "step-7.tmp").mkdir()  # not a step folder
    (steps / "notes-3").mkdir()
    assert sorted(run_folder.step_dirs(steps)) == [2, 9, 10, 12]


def test_no_checkpoint_folder():
    assert newest_complete("/no/such/folder") is None and run_folder.step_dirs("/no/such/folder") == {}
    with pytest.raises(FileNotFoundError, match="No DCP checkpoint in .*--checkpoint.enable true"):
        run_folder.step_dir(Path("/no/such"), "checkpoint", None)


def test_a_whole_checkpoint_passes_every_check(steps):
    step = steps / "step-10"
    assert check_checkpoint(step) is None and verify_checkpoint(step) is None
    sums = json.loads((step / "checksums.json").read_text())
    assert sums["hash"] == "xxh3_64" and sorted(sums["files"]) == sorted(p.name for p in step.iterdir()
                                                                          if p.name != "checksums.json")
    for name, entry in sums["files"].items():
        assert entry["bytes"] == (step / name).stat().st_size > 0
        assert entry["xxh3_64"] == checkpoint.file_checksum(step / name)


def test_checkpoint_file_size_checks(steps):
    step = steps / "step-10"
    f = shard(step)
    size = f.stat().st_size
    data = f.read_bytes()
    f.write_bytes(data[:-1])
    assert check_checkpoint(step) == f"{f} is truncated ({size - 1:,} of {size:,} bytes)"
    f.write_bytes(data + b"\0")
    assert check_checkpoint(step) == f"{f} has {size + 1:,} bytes, {size:,} were written"
    f.write_bytes(data[:-1])
    assert verify_checkpoint(step) == f"{f} is truncated ({size - 1:,} of {size:,} bytes)"  # sizes before hashing
    f.write_bytes(data)
    assert check_checkpoint(step) is None
    f.unlink()
    assert check_checkpoint(step) == f"{f} is missing"


def test_unfinished_or_unreadable_bookkeeping(steps):
    assert check_checkpoint(steps / "step-12") == f"{steps / 'step-12' / 'checksums.json'} is missing (the save did " \
                                                  "not finish)"
    step = steps / "step-9"
    (step / "checksums.json").write_text("{not json")
    assert check_checkpoint(step) == (f"{step / 'checksums.json'} is not JSON (Expecting property name enclosed in "
                                      "double quotes at line 1, column 2)")
    (step / "checksums.json").write_text("{}")
    assert check_checkpoint(step) == f"{step / 'checksums.json'}: files is missing"


def test_metadata_problems(steps):
    step = steps / "step-10"
    sums = json.loads((step / "checksums.json").read_text())
    f = shard(step)
    del sums["files"][f.name]  # a shard the metadata names but checksums.json does not list
    (step / "checksums.json").write_text(json.dumps(sums))
    assert check_checkpoint(step) == f"{f} has no checksum"
    f.unlink()
    assert check_checkpoint(step) == f"{f} is missing"
    garbage = b"x" * (step / ".metadata").stat().st_size  # right size, not a pickle
    (step / ".metadata").write_bytes(garbage)
    assert check_checkpoint(step) == f"{step / '.metadata'} does not match its checksum (bytes changed after the " \
                                     "save); it was not read"  # hashed before it is parsed
    sums["files"][".metadata"]["xxh3_64"] = xxhash.xxh3_64_hexdigest(garbage)
    (step / "checksums.json").write_text(json.dumps(sums))
    assert check_checkpoint(step) == f"{step / '.metadata'} is unreadable (UnpicklingError)"
    sums["files"].pop(".metadata")
    (step / "checksums.json").write_text(json.dumps(sums))
    assert check_checkpoint(step) == f"{step / '.metadata'} has no checksum; it was not read"


def test_flipped_byte_of_the_right_size_needs_the_checksum(steps):
    step = steps / "step-10"
    f = shard(step)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    assert check_checkpoint(step) is None  # sizes agree
    assert verify_checkpoint(step) == f"{f} does not match its checksum (bytes changed after the save)"
    assert checkpoint.verify_files(step, checkpoint.read_checksums(step), ["nope.distcp"]) is not None


def test_metadata_reads_back_what_dcp_wrote(steps):
    md = checkpoint.read_metadata(steps / "step-2")
    assert md == pickle.loads((steps / "step-2" / ".metadata").read_bytes())
    assert checkpoint.shape_mismatches({"w": torch.zeros(64, 32), "b": torch.zeros(32)}, md) == []
    assert checkpoint.shape_mismatches({"n": 3, "w": torch.zeros(32, 64), "x": torch.zeros(1)}, md) == [
        "w: expected (32, 64), found (64, 32)", "x: expected (1,), found no such key"]
    many = {f"k{i}": torch.zeros(1) for i in range(5)}
    assert len(checkpoint.shape_mismatches(many, md)) == 3 and len(checkpoint.shape_mismatches(many, md, 5)) == 5


def manager(folder: Path, on_corrupt: str = "fallback") -> checkpoint.WorkbenchCheckpointManager:
    """The resume logic of the checkpointer alone: its folder and config, none of torchtitan's state."""
    m = object.__new__(checkpoint.WorkbenchCheckpointManager)
    m.folder, m.wb_config = str(folder), SimpleNamespace(on_corrupt=on_corrupt)
    return m


def test_stale_checkpoints_are_judged_against_the_newest_complete_one(tmp_path):
    for step, complete in ((2, True), (6, True), (7, False), (8, True), (9, False)):
        (tmp_path / f"step-{step}").mkdir()
        if complete:
            (tmp_path / f"step-{step}" / "checksums.json").write_text("{}")
    # the partial 7 is older than the newest complete (8): a leftover; the partial 9 may be a save in flight
    assert [p.name for p in checkpoint.stale_checkpoints(tmp_path, 2)] == ["step-2", "step-7"]
    assert [p.name for p in checkpoint.stale_checkpoints(tmp_path, 0)] == ["step-7"]


def test_stale_checkpoints_without_a_complete_one(tmp_path):
    save_step(tmp_path, 3, complete=False)  # a save in flight, or a killed one: nothing newer proves it stale
    assert checkpoint.stale_checkpoints(tmp_path, 2) == [] and checkpoint.stale_checkpoints(tmp_path, 0) == []


def test_resume_takes_the_newest_verified_step(steps, capsys):
    assert manager(steps)._find_load_step() == 10
    assert manager(steps)._find_load_step(str(steps)) == 10  # its own folder named explicitly: the same checks
    out = capsys.readouterr().out
    assert "checkpoint step 12 is unusable" in out and "did not finish" in out and "resuming from step 10" in out
    f = shard(steps / "step-10")
    f.write_bytes(f.read_bytes()[:-8])
    assert manager(steps)._find_load_step() == 9
    assert f"checkpoint step 10 is unusable: {f} is truncated" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match=r"checkpoint step 10 is unusable: .* is truncated") as e:
        manager(steps, on_corrupt="error")._find_load_step()
    assert e.value.fix == (f"move {steps / 'step-10'} away to resume from an older checkpoint, or set "
                           "--checkpoint.on_corrupt fallback.")


def test_resume_refuses_a_folder_of_unusable_checkpoints(tmp_path):
    """Saves that never finished (a double Ctrl-C during the first save) leave nothing to resume: refused (never a
    silent restart from step 1), the fix saying exactly what to run; after it, the relaunch starts afresh. A finished
    checkpoint that is damaged: refused, nothing deleted."""
    folder = tmp_path / "checkpoint"
    save_step(folder, 3, complete=False)
    save_step(folder, 5, complete=False)
    with pytest.raises(CheckpointError, match=r"no usable checkpoint in .* \(step 5: .*finish\); step 3: .*: no save "
                                              "there finished, so there is nothing to resume") as e:
        manager(folder)._find_load_step()
    command = f"rm -r {folder / 'step-5'} {folder / 'step-3'}"
    assert e.value.fix == (f"to start from step 1, delete the unfinished saves ({command}) and relaunch the same "
                           "command; or restore a finished checkpoint there.")
    subprocess.run(command.split(), check=True)
    assert manager(folder)._find_load_step() == -1  # what the relaunch then does: a fresh start
    save_step(folder, 3, complete=False)
    f = shard(save_step(folder, 4))
    f.write_bytes(f.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"no usable checkpoint in .* \(step 4: .*truncated .*; step 3: .*finish"
                                              r"\)\); nothing was deleted\.$") as e:
        manager(folder)._find_load_step()
    assert e.value.fix == f"restore a checkpoint there, or move {tmp_path} away to start from scratch."
    assert manager(tmp_path / "empty")._find_load_step() == -1


def _fresh_load_on_two_ranks(r: int, folder: str, port: int) -> None:
    """One gloo rank of `test_a_fresh_run_looks_for_checkpoints_on_every_rank_or_none`."""

    import torch.distributed as dist
    from torchtitan.components.checkpointer import dcp as titan_dcp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    if r == 1:  # the slower rank: it looks at the checkpoint folder 2 s after rank 0 did
        exists = titan_dcp.filesystem.exists
        titan_dcp.filesystem.exists = lambda path: (time.sleep(2), exists(path))[1]
    m = object.__new__(checkpoint.WorkbenchCheckpointManager)
    m.folder, m.enable, m.load_only, m.keep_latest_k, m.interval = folder, True, False, 2, 2
    m.wb_config = SimpleNamespace(on_corrupt="fallback", refuse_low_disk=False, total_steps=4)
    m.initial_load_model_only, m.initial_load_in_hf, m.initial_load_in_hf_quantized = True, False, False
    m.initial_load_path, m.sd_adapter = None, None
    m.states = {checkpoint.MODEL: SimpleNamespace(model=[torch.nn.Linear(4, 4)])}
    assert m.load() is False  # a fresh start on both ranks, the disk check after it
    dist.barrier()
    dist.destroy_process_group()


def test_a_fresh_run_looks_for_checkpoints_on_every_rank_or_none(tmp_path):
    """torchtitan's `load` checks the folder per rank. The disk check after it used to create the folder on rank 0:
    a slow rank 1 then saw it, searched it alone and took rank 0's disk-check broadcast for the list of steps
    (TypeError, seen in CI). Loading now creates nothing."""
    import torch.multiprocessing as mp


    mp.spawn(_fresh_load_on_two_ranks, args=(str(tmp_path / "checkpoint"), free_port()), nprocs=2)
    assert not (tmp_path / "checkpoint").exists()


# ---- what a step folder holds besides the weights: the train state, checksums, pickles -------------------------------


def test_the_train_state_is_committed_with_the_step_and_read_only_when_it_matches(tmp_path):
    record = {"global_batch_size": 4, "local_batch_size": 2, "data_parallel_ranks": 2, "gradient_accumulation_steps": 1}
    path = tmp_path / "step-3"
    sums: dict = {}
    metadata = dcp.save({"w": torch.ones(3)}, storage_writer=checkpoint.checksumming_writer(str(path), sums))
    commit_checksums(path, sums, metadata, {checkpoint.TRAIN_STATE: json.dumps(record).encode()})
    assert checkpoint.read_train_state(path) == record and verify_checkpoint(path) is None
    (path / checkpoint.TRAIN_STATE).write_text(json.dumps({**record, "global_batch_size": 8}))  # not what was saved
    assert checkpoint.read_train_state(path) is None and "train_state.json" in verify_checkpoint(path)
    assert checkpoint.read_train_state(save_step(tmp_path, 4)) is None  # a step saved without one


def test_checksums_name_the_changed_file(tmp_path):
    step = save_step(tmp_path, 2)
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


def test_purge_keeps_complete_checkpoints_only(tmp_path):
    for step, complete in ((2, True), (4, False), (6, True), (8, True), (10, False)):
        (tmp_path / f"step-{step}").mkdir()
        if complete:
            (tmp_path / f"step-{step}" / "checksums.json").write_text("{}")
    # keep 2 complete (6, 8); the partial 4 goes, the partial 10 may be a save in flight and stays
    assert [p.name for p in stale_checkpoints(tmp_path, 2)] == ["step-2", "step-4"]
    assert [p.name for p in stale_checkpoints(tmp_path, 3)] == ["step-4"]
    assert newest_complete(tmp_path) == 8


def _save(tmp_path: Path, state: dict) -> Path:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    return tmp_path / "ckpt"


def test_byte_io_entries_load_weights_only(tmp_path):
    marker = tmp_path / "MARKER"
    ckpt = _save(tmp_path, {"w": torch.ones(3), "train_state": {"step": 7, "betas": (0.9, 0.95)}})
    state = {"w": torch.zeros(3), "train_state": {"step": 0, "betas": None}}
    load_dcp(state, ckpt)  # plain values load through weights_only
    assert state["train_state"] == {"step": 7, "betas": (0.9, 0.95)} and torch.equal(state["w"], torch.ones(3))

    ckpt = _save(tmp_path, {"train_state": {"step": PicklePayload(marker)}})
    with pytest.raises(errors.UnsafeCheckpointError, match=r"entry train_state.step\) tries to load builtins.exec"):
        load_dcp({"train_state": {"step": 0}}, ckpt)
    assert not marker.exists()


def test_a_pickled_dataloader_state_must_hold_builtins_only(tmp_path):
    """torchtitan unpickles the dataloader's bytes itself: they are checked before it sees them."""
    marker = tmp_path / "MARKER"
    ckpt = _save(tmp_path, {"dataloader": {"dp_rank_0": pickle.dumps({"epoch": 1, "carry": [1, 2]})}})
    state = {"dataloader": {"dp_rank_0": b""}}
    load_dcp(state, ckpt)
    assert pickle.loads(state["dataloader"]["dp_rank_0"]) == {"epoch": 1, "carry": [1, 2]}
    ckpt = _save(tmp_path, {"dataloader": {"dp_rank_0": pickle.dumps(PicklePayload(marker))}})
    with pytest.raises(errors.UnsafeCheckpointError, match="dp_rank_0.*builtins.exec"):
        load_dcp({"dataloader": {"dp_rank_0": b""}}, ckpt)
    assert not marker.exists()


def test_metadata_allowlist_refuses_any_other_global(tmp_path):
    marker = tmp_path / "MARKER"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(PicklePayload(marker)))
    with pytest.raises(errors.UnsafeCheckpointError, match=r"\.metadata tries to load builtins\.exec"):
        read_metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(io.BytesIO(b"x")))  # harmless, but not DCP metadata
    with pytest.raises(errors.UnsafeCheckpointError, match="_io.BytesIO"):
        read_metadata(tmp_path)
    assert not marker.exists()


def test_dcp_metadata_naming_a_file_outside_its_step_is_refused_before_dcp_opens_it(tmp_path):
    """A `.metadata` whose storage entry points at ../../x (its checksum updated to match): refused by the cheap
    check, before DCP's reader would open <step>/../../x."""
    step = save_step(tmp_path / "checkpoint", 2)
    metadata = read_metadata(step)
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data[index] = type(info)("../../secret", info.offset, info.length)
    data = pickle.dumps(metadata)
    (step / ".metadata").write_bytes(data)
    sums = json.loads((step / "checksums.json").read_text())
    sums["files"][".metadata"] = {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
    (step / "checksums.json").write_text(json.dumps(sums))
    assert check_checkpoint(step) == (f"{step / '.metadata'} names a file outside its step folder ('../../secret'); "
                                      "nothing was read")
