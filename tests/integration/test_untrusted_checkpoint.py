"""A checkpoint from elsewhere never runs code (issue 33): DCP's pickles are read through an allowlist on every entry
point (resume, hf_export, compare, notebook 05's compare, load_model of a run folder), and `.metadata` is hashed
before it is parsed. The allowlist itself (BYTE_IO entries with weights_only, the dataloader's pickle, the metadata's
globals): tests/run/test_checkpoint.py.

Each crafted pickle tries to create a marker file; the tests assert the marker never appears and the one-line
refusal names the file and the class. The run folders are copies of the shared 12-step reference launch (the one
test_checkpoint_recovery.py and test_run_safety.py use); the only launch here is one resume that must stop before
training."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import xxhash

from tests.run_helpers import PicklePayload, run_train
from workbench import compare, hf_export
from workbench.core import errors
from workbench.model import load_model
from workbench.run.checkpoint import check_checkpoint, read_metadata

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)

DENSE = "configs/cpu_dense.toml"
COMMON = ("--model.backend", "native", "--checkpoint.enable", "true", "--lr_scheduler.total_steps", "12")


def crafted_run(reference: Path, tmp_path: Path, *, update_checksum: bool = True) -> tuple[Path, Path]:
    """A copy of the reference run folder (config.toml + step-4) whose `.metadata` is a payload; its checksums.json
    entry updated to match (or not). Returns (run folder, marker path)."""
    run = tmp_path / "cpu_dense"
    (run / "checkpoint").mkdir(parents=True)
    shutil.copy(reference / "config.toml", run / "config.toml")
    step = Path(shutil.copytree(reference / "checkpoint" / "step-4", run / "checkpoint" / "step-4"))
    marker = tmp_path / "MARKER"
    data = pickle.dumps(PicklePayload(marker))
    (step / ".metadata").write_bytes(data)
    sums = json.loads((step / "checksums.json").read_text())
    sums["files"][".metadata"] = {"bytes": len(data),
                                  "xxh3_64": xxhash.xxh3_64_hexdigest(data if update_checksum else b"")}
    (step / "checksums.json").write_text(json.dumps(sums))
    return run, marker


def assert_refused(line: str, run: Path) -> None:
    assert "unsafe checkpoint" in line and "builtins.exec" in line, line
    assert str(run / "checkpoint" / "step-4" / ".metadata") in line, line
    assert len(line.strip().splitlines()) == 1, line


# ---- every entry point ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_resume_refuses_a_crafted_metadata_before_training(reference_12, tmp_path):
    run, marker = crafted_run(reference_12[0], tmp_path)
    proc = run_train(DENSE, *COMMON, "--checkpoint.interval", "4", "--training.steps", "12",
                     "--job.dump_folder", str(tmp_path), check=False)
    assert proc.returncode != 0 and not marker.exists()
    assert "exitcode  : 4" in proc.stderr and "Traceback" not in proc.stderr.split("Root Cause")[-1]
    assert_refused(proc.stderr.split("traceback : ")[-1].splitlines()[0], run)
    assert not (run / "metrics.jsonl").exists()  # not one step trained


@pytest.mark.slow
def test_hf_export_compare_and_load_model_refuse_a_crafted_metadata(reference_12, tmp_path, capsys):
    run, marker = crafted_run(reference_12[0], tmp_path)
    assert hf_export.main(["--run", str(run), "--out", str(tmp_path / "hf")]) == errors.EXIT_CHECKPOINT
    assert_refused(capsys.readouterr().err, run)
    assert not (tmp_path / "hf").exists()
    assert compare.main([str(run), str(run), "--out", str(tmp_path / "cmp")]) == errors.EXIT_CHECKPOINT
    assert_refused(capsys.readouterr().err, run)
    # notebook 05 with checkpoint_a / checkpoint_b set: the same `compare.compare` call, in this process
    with pytest.raises(errors.UnsafeCheckpointError) as e:
        compare.compare(run / "checkpoint" / "step-4", run)
    assert_refused(e.value.one_line(), run)
    with pytest.raises(errors.UnsafeCheckpointError) as e:
        load_model(run)
    assert_refused(e.value.one_line(), run)
    assert not marker.exists()


@pytest.mark.slow
def test_a_metadata_that_does_not_match_its_checksum_is_never_parsed(reference_12, tmp_path):
    run, marker = crafted_run(reference_12[0], tmp_path, update_checksum=False)
    step = run / "checkpoint" / "step-4"
    assert check_checkpoint(step) == (f"{step / '.metadata'} does not match its checksum (bytes changed after the "
                                      "save); it was not read")
    with pytest.raises(errors.CheckpointError, match="does not match its checksum"):
        load_model(run)
    assert not marker.exists()


@pytest.mark.slow
def test_a_real_checkpoint_loads_through_the_allowlist(reference_12):
    """The run folder's own checkpoint: every class of its metadata is allowlisted and load_model reads it."""
    md = read_metadata(reference_12[0] / "checkpoint" / "step-12")
    assert len(md.state_dict_metadata) > 10
    model = load_model(reference_12[0], step=12)
    assert model.workbench_info.backend == "native"
