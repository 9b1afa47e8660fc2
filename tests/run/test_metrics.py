"""workbench.run.metrics: the run's metrics.jsonl read, and trimmed to a checkpoint on resume."""

from __future__ import annotations

import json

import pytest

from tests.run_helpers import read_metrics
from workbench.core.errors import RunFolderError
from workbench.run import metrics
from workbench.run.metrics import trim_metrics


def test_trim_metrics_drops_steps_after_the_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": s}) + "\n" for s in range(1, 8)))
    assert trim_metrics(tmp_path, 4) == 3
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert trim_metrics(tmp_path, 4) == 0


def test_read_and_trim_metrics(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        metrics.read_metrics(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'metrics.jsonl'} does not exist: the run logged no step (see its log), "
                            f"or {tmp_path} is not a run folder.")
    assert metrics.read_metrics(tmp_path, missing_ok=True) == [] and metrics.trim_metrics(tmp_path, 3) == 0
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in (1, 2, 3, 4, 5)) + "\n")
    inode = path.stat().st_ino
    assert metrics.trim_metrics(tmp_path, 5) == 0 and path.stat().st_ino == inode  # nothing to drop: untouched
    assert metrics.trim_metrics(tmp_path, 3) == 2  # an interrupted launch logged 4 and 5 past its checkpoint
    assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temp file left


def test_a_torn_last_metrics_line_is_left_out_and_trimmed_on_resume(tmp_path):
    """A crash mid-append leaves half a line: readers skip it, the resume's trim removes it (nothing else)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [1, 2, 3]
    assert metrics.trim_metrics(tmp_path, 3) == 1
    assert path.read_text() == "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3))
    path.write_text(path.read_text() + "not json\n" + json.dumps({"step": 4}) + "\n")  # damage inside the file
    with pytest.raises(RunFolderError, match=r"metrics.jsonl:4 is not a metrics record") as e:
        metrics.trim_metrics(tmp_path, 3)
    assert "Fix: delete that line" in e.value.one_line()
