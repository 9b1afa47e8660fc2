"""The notebook dashboard's reading of metrics.jsonl without a notebook: only this launch's records (a resumed run
appends to the file, a fresh run replaces it), lines still being written, and the "resumed" wording."""

from __future__ import annotations

import json
import re
from pathlib import Path

from workbench.notebook.dashboard import Dashboard


def record(step: int, loss: float = 5.0, tps: float = 100.0) -> str:
    return json.dumps({"step": step, "loss": loss, "tokens_per_second": tps, "mfu": 0.01, "step_time_s": 1.0,
                       "peak_memory_bytes": 2**30, "backend": "native"}) + "\n"


def append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_a_resumed_launch_reads_only_its_own_steps_and_says_so(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(record(s) for s in range(1, 5)))  # the earlier launch, up to its checkpoint at 4
    board = Dashboard(tmp_path, total_steps=10, title="run", live=False)
    assert board.poll() == 0 and board.records == []
    append(metrics, record(5, 4.0, 300.0) + record(6, 3.5, 100.0) + record(7, 3.0, 200.0)[:20])  # 7: half written
    assert board.poll() == 2 and [r["step"] for r in board.records] == [5, 6]
    append(metrics, record(7, 3.0, 200.0)[20:])
    assert board.poll() == 1 and [r["step"] for r in board.records] == [5, 6, 7]
    status = board._status_html(board.records[-1])
    assert status.startswith("<code>step 7/10 (resumed after step 4) · loss 3.0000 · 200 tok/s · MFU 1.00% · 1.00 GiB")
    text = board.summary_text()
    # medians skip the launch's first step (warm-up): tok/s of steps 6, 7 -> sorted 100, 200 -> upper middle 200
    assert re.fullmatch(r"run: finished · backend native · steps 5–7 of 10 \(resumed after step 4\) · loss 4\.0000 → "
                        r"3\.0000 · median 200 tok/s · median MFU 1\.00% · \d+ s wall", text), text
    assert list(board.frame().index) == [5, 6, 7]


def test_a_fresh_launch_is_not_resumed_and_a_replaced_file_restarts_the_records(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(record(s, tps=999.0) for s in range(1, 9)))  # an old run in a reused folder
    board = Dashboard(tmp_path, total_steps=3, title="fresh", live=False)
    metrics.unlink()  # the fresh run starts a new file
    metrics.write_text(record(1) + record(2))
    assert board.poll() == 2 and [r["step"] for r in board.records] == [1, 2]
    assert "resumed" not in board._status_html(board.records[-1]) and "resumed" not in board.summary_text()
    assert "steps 1–2 of 3 · " in board.summary_text() and "median 100 tok/s" in board.summary_text()


def test_no_steps_logged(tmp_path):
    board = Dashboard(tmp_path, total_steps=3, title="empty", live=False)
    assert board.poll() == 0
    assert re.fullmatch(r"empty: no steps logged \(FAILED after \d+ s\)\.", board.summary_text(ok=False))
