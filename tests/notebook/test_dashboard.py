"""The notebook dashboard's reading of metrics.jsonl without a notebook: only this launch's records (a resumed run
appends to the file, a fresh run replaces it), lines still being written, and the "resumed" wording."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.run_helpers import ROOT
from workbench.notebook.dashboard import Dashboard, live_frontend

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)


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
    append(metrics, record(3))  # the new file is now the one being read: only the new record is new
    assert board.poll() == 1 and [r["step"] for r in board.records] == [1, 2, 3]
    assert board.poll() == 0


def test_no_steps_logged(tmp_path):
    board = Dashboard(tmp_path, total_steps=3, title="empty", live=False)
    assert board.poll() == 0
    assert re.fullmatch(r"empty: no steps logged \(FAILED after \d+ s\)\.", board.summary_text(ok=False))


def test_medians_defaults_and_repeated_steps(tmp_path):
    """Records without mfu / peak memory (written before those fields existed) count as 0; the medians pick the
    middle of several distinct values; a step logged twice keeps its last record; wall time is this launch's."""
    metrics = tmp_path / "metrics.jsonl"
    board = Dashboard(tmp_path, total_steps=9, title="t", live=False)
    assert list(board.frame().columns) == ["loss", "tokens_per_second"] and board.frame().empty
    rows = [(1, 900.0, 0.9), (2, 100.0, 0.01), (3, 300.0, 0.03), (4, 200.0, 0.02), (5, 500.0, 0.05), (6, 400.0, 0.04)]
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0 * s, "tokens_per_second": t, "mfu": m}) + "\n"
                               for s, t, m in rows) + json.dumps({"step": 6, "loss": 0.5, "tokens_per_second": 1.0})
                       + "\n")
    assert board.poll() == 7
    text = board.summary_text()
    # steps 2-6 (+ the repeated 6, mfu 0): tok/s sorted 1, 100, 200, 300, 400, 500 -> index 3 = 300; mfu sorted
    # 0, .01, .02, .03, .04, .05 -> index 3 = 3.00%
    assert "median 300 tok/s · median MFU 3.00% · " in text and re.search(r" · [0-5] s wall$", text), text
    assert board._status_html(board.records[-1]).startswith("<code>step 6/9 · loss 0.5000 · 1 tok/s · MFU 0.00% · "
                                                            "0.00 GiB")
    assert board.frame().loc[6, "loss"] == 0.5 and list(board.frame().index) == [1, 2, 3, 4, 5, 6]
    one = Dashboard(tmp_path / "one", total_steps=1, live=False)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "metrics.jsonl").write_text(record(1, tps=123.0))
    assert one.poll() == 1 and "median 123 tok/s" in one.summary_text()  # a single step is its own median


def test_a_truncated_or_rewritten_file_restarts_the_records(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(record(1) + record(2))
    board = Dashboard(tmp_path, total_steps=5, live=False)
    metrics.write_text(metrics.read_text() + record(3))
    assert board.poll() == 1 and [r["step"] for r in board.records] == [3]
    with open(metrics, "r+") as f:  # rewritten in place (same inode), shorter than what was read
        f.truncate(0)
        f.write(record(1, loss=9.0))
    assert board.poll() == 1 and [(r["step"], r["loss"]) for r in board.records] == [(1, 9.0)]
    with open(metrics, "r+") as f:  # rewritten in place, as long as before, another first record
        f.write(record(1, loss=8.0) + record(2) + record(3) + record(4))
    assert board.poll() == 4 and [(r["step"], r["loss"]) for r in board.records][0] == (1, 8.0)
    assert [r["step"] for r in board.records] == [1, 2, 3, 4]


def test_wording_after_step_one_failed_and_unknown_backend(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(record(1))
    board = Dashboard(tmp_path, total_steps=4, title="r", live=False)
    append(metrics, json.dumps({"step": 2, "loss": 2.0, "tokens_per_second": 10.0}) + "\n")
    assert board.poll() == 1
    assert "steps 2–2 of 4 (resumed after step 1) · " in board.summary_text()  # resumed from a step-1 checkpoint
    assert board.summary_text(ok=False).startswith("r: FAILED · backend ? · ")
    assert board._status_html(board.records[-1]).startswith("<code>step 2/4 (resumed after step 1) · loss 2.0000 · "
                                                            "10 tok/s · MFU 0.00% · 0.00 GiB")
    assert re.fullmatch(r"e: no steps logged \(finished after \d+ s\)\.",
                        Dashboard(tmp_path / "e", total_steps=1, title="e", live=False).summary_text())


def test_status_names_the_phase_after_a_step_and_the_device_in_the_title(tmp_path):
    """After a step that saves a checkpoint, and after the last one when the run exports, the live status says so
    (those phases print no step line for seconds); the title's "auto" device becomes the one the trainer reports."""
    metrics = tmp_path / "metrics.jsonl"
    board = Dashboard(tmp_path, total_steps=8, live=False, checkpoint_steps={4, 8}, export=True,
                      title="cpu_dense.toml · native · tiny · shakespeare · 8 steps · auto · 1 rank(s)")
    board("workbench: backend native, flavor tiny, dataset shakespeare, device cpu x 1 rank(s), run folder /x\n")
    assert board.title == "cpu_dense.toml · native · tiny · shakespeare · 8 steps · cpu · 1 rank(s)"
    metrics.write_text("".join(record(s) for s in (1, 2, 3, 4)))
    board("step 4/8\n")
    assert board._status_html(board.records[-1]).endswith("<br><b>saving checkpoint step 4…</b>")
    append(metrics, record(5))
    board.poll()
    assert "<br>" not in board._status_html(board.records[-1])
    append(metrics, "".join(record(s) for s in (6, 7, 8)))
    board.poll()
    assert board._status_html(board.records[-1]).endswith(
        "<b>saving checkpoint step 8 · exporting Hugging Face weights…</b>")


def test_a_mixture_plots_each_members_loss(tmp_path):
    """metrics.jsonl of a mixture: the loss figure has the pooled loss and one dashed line per member."""
    lines = [json.dumps({**json.loads(record(s, 5.0 - s)), "loss /d/web.jsonl": 5.2 - s, "loss /d/code.jsonl": 4.8 - s,
                         "rows /d/web.jsonl": 2 * s, "rows /d/code.jsonl": 2 * s}) + "\n" for s in (1, 2, 3)]
    board = Dashboard(tmp_path, total_steps=3, title="mix", live=False)
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    assert board.poll() == 3
    ax_loss = board.figure().axes[0]
    assert [line.get_label() for line in ax_loss.lines] == ["all", "web.jsonl", "code.jsonl"]
    assert list(ax_loss.lines[1].get_ydata()) == [4.2, 3.2, 2.2] and ax_loss.lines[2].get_linestyle() == "--"
    assert [t.get_text() for t in ax_loss.get_legend().get_texts()] == ["all", "web.jsonl", "code.jsonl"]


def _record(step: int, loss: float) -> str:
    return json.dumps({"step": step, "loss": loss, "tokens_per_second": 100.0 + step, "mfu": 0.01,
                       "peak_memory_bytes": 2**30, "backend": "native"}) + "\n"


def test_dashboard_tails_metrics_and_degrades_to_static(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORKBENCH_DASHBOARD", raising=False)
    assert live_frontend() is False  # plain Python: nobody to show widgets to
    monkeypatch.setenv("WORKBENCH_DASHBOARD", "live")
    assert live_frontend() is True
    monkeypatch.setenv("WORKBENCH_DASHBOARD", "static")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(_record(1, 99.0))  # an earlier launch in the same run folder: ignored
    with Dashboard(tmp_path, total_steps=3, title="t") as dash:
        assert dash.live is False
        with open(metrics, "a") as f:
            f.write(_record(1, 12.0) + _record(2, 11.0)[:20])  # step 2 half written
        dash("step 1/3 ...\n")
        assert [r["step"] for r in dash.records] == [1]
        with open(metrics, "a") as f:
            f.write(_record(2, 11.0)[20:] + _record(3, 10.0))
        dash("step 3/3 ...\n")
    assert [r["loss"] for r in dash.records] == [12.0, 11.0, 10.0]
    out = capsys.readouterr().out
    assert "t: finished" in out and "loss 12.0000 → 10.0000" in out and "steps 1–3 of 3" in out
    assert "step 1/3" not in out  # static mode does not echo the training output


def test_dashboard_follows_a_replaced_or_truncated_metrics_file(tmp_path, capsys, monkeypatch):
    """Re-run in the same folder: the trainer replaces metrics.jsonl at its first step; the dashboard
    must read the new file from its start, also when the new inode number equals the old one or the new file
    has already outgrown the old read position; a truncation in place likewise."""
    monkeypatch.setenv("WORKBENCH_DASHBOARD", "static")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(_record(s, 20.0 - s) for s in range(1, 9)))  # the previous run: 8 steps
    dash = Dashboard(tmp_path, total_steps=8, title="rerun")
    dash("building model\n")
    assert dash.records == []
    metrics.unlink()  # what workbench.run.trainer does on a fresh run
    metrics.write_text(_record(1, 12.0))
    dash("step 1/8\n")
    assert [r["loss"] for r in dash.records] == [12.0]
    # replaced by a file longer than the read position (9 records) whose first record differs
    metrics.unlink()
    metrics.write_text("".join(_record(s, 30.0 - s) for s in range(1, 10)))
    dash("step 9\n")
    assert [r["step"] for r in dash.records] == list(range(1, 10)) and dash.records[0]["loss"] == 29.0
    metrics.write_text(_record(1, 5.0))  # truncated in place (same inode)
    dash("again\n")
    assert [r["loss"] for r in dash.records] == [5.0]
    dash.close()
    assert "rerun: finished" in capsys.readouterr().out


def test_dashboard_shows_the_resumed_step_range(tmp_path, capsys, monkeypatch):
    """A resumed run appends to metrics.jsonl: only its own steps count, and the summary says it resumed."""
    monkeypatch.setenv("WORKBENCH_DASHBOARD", "static")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(_record(s, 20.0 - s) for s in range(1, 5)))
    with Dashboard(tmp_path, total_steps=8, title="resume") as dash:
        with open(metrics, "a") as f:
            f.write("".join(_record(s, 20.0 - s) for s in range(5, 9)))
        dash("step 8/8\n")
    assert [r["step"] for r in dash.records] == [5, 6, 7, 8]
    assert "steps 5–8 of 8 (resumed after step 4)" in capsys.readouterr().out


def _run_like_a_frontend(source: str, cwd: Path, timeout: float = 120) -> list[dict]:
    """Executes `source` in a real IPython kernel and returns the outputs a frontend would save for the cell.

    A small frontend over jupyter_client (not nbclient: its emulation of Output widgets occasionally never
    returns from a cell that closes widgets under nbclient 0.11, which is not what this test is about). It applies
    what JupyterLab applies: `update_display_data` replaces the outputs with that display id, `clear_output`
    clears, and outputs captured by an `ipywidgets.Output` (its `msg_id` set to the cell's) go to that widget,
    not to the cell.
    """
    from jupyter_client.manager import start_new_kernel

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(cwd))
    outputs: list[dict] = []
    capturing: set[str] = set()  # Output widgets currently capturing this cell's output
    try:
        msg_id = kc.execute(source)
        while True:
            msg = kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                break
            if kind in ("comm_open", "comm_msg"):
                state = content.get("data", {}).get("state", {})
                if "msg_id" in state:
                    (capturing.add if state["msg_id"] == msg_id else capturing.discard)(content["comm_id"])
                continue
            if kind == "error":
                raise AssertionError("the cell failed:\n" + "\n".join(content["traceback"]))
            if capturing and kind in ("stream", "display_data", "clear_output"):
                continue  # inside `with output_widget:`: shown in the widget, not saved with the cell
            if kind == "clear_output":
                outputs.clear()
            elif kind == "update_display_data":
                did = content.get("transient", {}).get("display_id")
                for o in outputs:
                    if o.get("display_id") == did:
                        o["data"] = content["data"]
            elif kind in ("display_data", "execute_result"):
                outputs.append({"data": content["data"], "display_id": content.get("transient", {}).get("display_id")})
            elif kind == "stream":
                outputs.append({"data": {"text/plain": content["text"]}})
        reply = kc.get_shell_msg(timeout=timeout)
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return outputs


@pytest.mark.slow  # starts a notebook kernel
def test_live_dashboard_in_a_kernel(tmp_path):
    """The live widgets path, in a real kernel (forced live), fed from a growing metrics.jsonl."""
    metrics = tmp_path / "metrics.jsonl"
    src = (f"import json, os\nos.environ['WORKBENCH_DASHBOARD'] = 'live'\n"
           f"from workbench.notebook import Dashboard\n"
           f"d = Dashboard({str(tmp_path)!r}, total_steps=2, title='live', refresh_s=0)\n"
           f"assert d.live\n"
           f"for s in (1, 2):\n"
           f"    open({str(metrics)!r}, 'a').write(json.dumps(dict(step=s, loss=12.0 - s, tokens_per_second=50.0,"
           f" mfu=0.01, peak_memory_bytes=1, backend='native')) + '\\n')\n"
           f"    d(f'step {{s}}/2\\n')\n"
           f"assert d._widgets['image'].value[:4] == b'\\x89PNG'\n"
           f"d.close()\n"
           f"from tqdm.auto import tqdm\n"
           f"from workbench.notebook import transient_progress\n"
           f"with transient_progress('bars done'):\n"
           f"    for _ in tqdm(range(3), desc='bench bar'): pass\n")
    saved = _run_like_a_frontend(src, tmp_path)
    text = "".join(str(v) for o in saved for k, v in o["data"].items() if k.startswith("text/"))
    assert "live: finished" in text and "steps 1–2 of 2" in text and "bars done" in text
    assert any("image/png" in o["data"] for o in saved)
    # The widgets were replaced in place: the saved outputs hold no dead widget views or their text.
    dumped = json.dumps([o["data"] for o in saved], ensure_ascii=False)
    for stale in ("application/vnd.jupyter.widget-view+json", "VBox(children", "waiting for the first step", "0%|"):
        assert stale not in dumped, stale


@pytest.mark.slow  # starts a notebook kernel
def test_frontend_detection_in_a_real_kernel():
    """Interactive frontends send allow_stdin and store_history; nbclient (papermill) and nbval do not."""
    from jupyter_client.manager import start_new_kernel

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORKBENCH_DASHBOARD", None)
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(ROOT / "notebooks"))
    try:
        def detected(**kw) -> str:
            msg_id = kc.execute("from workbench.notebook import live_frontend; print(live_frontend())", **kw)
            text = ""
            while True:
                msg = kc.get_iopub_msg(timeout=60)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                if msg["msg_type"] == "stream":
                    text += msg["content"]["text"]
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    return text.strip()

        assert detected(allow_stdin=True, store_history=True) == "True"  # JupyterLab, Notebook, VS Code
        assert detected(allow_stdin=False, store_history=True) == "False"  # nbclient: papermill, nbconvert
        assert detected(allow_stdin=True, store_history=False) == "False"  # nbval
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
