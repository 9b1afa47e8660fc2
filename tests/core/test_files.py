"""workbench.core.files: writes never go through a link planted in a folder from elsewhere."""

from __future__ import annotations

import os

import pytest


def test_run_folder_files_are_never_written_through_a_link(tmp_path):
    """Past the launch's check (a link planted later, a hard link): appends refuse, atomic writes replace the name."""
    from workbench.core import files

    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(precious)
    with pytest.raises(files.LinkError, match="metrics.jsonl is a symbolic link"):
        files.open_for_append(run / "metrics.jsonl")
    (run / "metrics.jsonl").unlink()
    os.link(precious, run / "metrics.jsonl")
    with pytest.raises(OSError, match="has other hard links"):
        files.open_for_append(run / "metrics.jsonl")
    (run / "summary.json").symlink_to(precious)
    files.write_atomic(run / "summary.json", "{}")
    assert precious.read_text() == "keep me" and not (run / "summary.json").is_symlink()
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "summary.json"]  # no temp file left
