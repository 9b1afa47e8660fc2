"""The notebooks and their tooling: papermill runs of every notebook, the batch runner's checks, the dashboard.

* a training notebook runs headlessly through the batch runner (= papermill) with non-default parameters from the
  command line (2 ranks: torchrun launched from the notebook), and its saved copy is what a reader should see
  (nbval executes every notebook with its defaults);
* the runner refuses an unknown parameter name (listing the valid ones), a wrong type and a value the
  workbench rejects (a bad flavor: the workbench's ConfigError text) before any kernel starts, and a notebook
  that fails while running makes the batch exit non-zero with the error printed;
* the dashboard follows a growing metrics.jsonl, and degrades to a static figure + summary without a frontend.

nbval (`pytest --nbval-lax ... notebooks/`) is configured separately; see notebooks/README.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from workbench.notebook import runner
from workbench.notebook.__main__ import NBVAL_MARK, clean_notebook
from workbench.notebook.dashboard import Dashboard, live_frontend

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = [p.stem for p in runner.discover()]


def cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python -m workbench.notebook ...` from the repository root."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "workbench.notebook", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def outputs_text(path: Path) -> str:
    """All text an executed notebook shows (streams, text/plain results, error values)."""
    nb = nbformat.read(str(path), as_version=4)
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif out.output_type == "error":
                parts.append(f"{out.ename}: {out.evalue}")
            elif "text/plain" in out.get("data", {}):
                parts.append(out.data["text/plain"])
    return "\n".join(parts)


def has_image(path: Path) -> bool:
    nb = nbformat.read(str(path), as_version=4)
    return any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


# ------------------------------------------------------------------------------------------------
# The notebooks as committed
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_clean_and_parameterized(name):
    """A `parameters` cell of plain literals; no outputs except the nbval-checked cells; the project kernel."""
    path = ROOT / "notebooks" / f"{name}.ipynb"
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "qwen3-workbench"  # opens on "Qwen3 workbench" in JupyterLab
    declared = runner.declared_parameters(path)
    assert declared, "no parameters"
    for d in declared.values():
        assert d.default is not None or d.source == "None", f"{d.name} = {d.source} is not a plain literal"
    for cell in nb.cells:
        if cell.cell_type == "code":
            if NBVAL_MARK not in cell.source:
                assert not cell.outputs and cell.execution_count is None, f"stored outputs in:\n{cell.source}"
            else:  # nbval compares only cells that were "run": outputs and an execution count
                assert cell.outputs and cell.execution_count, (
                    f"checked cell without its expected output:\n{cell.source}")


def test_every_notebook_that_trains_or_measures_takes_a_dataset():
    """`dataset` (a plain literal, `training.dataset` syntax) in every notebook that trains or measures data: 01-06
    train (05 also measures held-out perplexity), 08 prepares and counts, 09 fine-tunes on conversations (the bundled
    chat set by default); 00 and 07 read no data."""
    declared = {name: runner.declared_parameters(ROOT / "notebooks" / f"{name}.ipynb") for name in NOTEBOOKS}
    takes = {name for name, params in declared.items() if "dataset" in params}
    assert takes == set(NOTEBOOKS) - {"00_setup", "07_memory_plan"}
    assert all(declared[name]["dataset"].default == ("chitchat" if name == "09_chat_sft" else "shakespeare")
               for name in takes)


def test_clean_keeps_only_checked_outputs(tmp_path):
    nb = new_notebook(cells=[new_code_cell("1 + 1"), new_code_cell(f"{NBVAL_MARK}\n2 + 2")])
    for i, c in enumerate(nb.cells):
        c.execution_count = i + 1
        c.outputs = [nbformat.v4.new_output("execute_result", {"text/plain": str(2 * (i + 1))}, execution_count=i + 1)]
    path = tmp_path / "x.ipynb"
    nbformat.write(nb, str(path))
    assert clean_notebook(path)
    cells = nbformat.read(str(path), as_version=4).cells
    assert cells[0].outputs == [] and cells[0].execution_count is None
    assert cells[1].outputs[0].data["text/plain"] == "4"
    assert cells[1].execution_count == cells[1].outputs[0].execution_count == 2  # fixed: its position
    assert not clean_notebook(path)  # idempotent


def test_param_counts_formula_matches_flavors():
    """The notebooks' flavor table counts parameters by formula (no torchtitan import in the kernel)."""
    from workbench.core import flavors
    from workbench.notebook.reports import param_counts

    for name in ("tiny", "tiny-moe", "0.6B", "30B-A3B"):
        assert param_counts(flavors.get_shape(name)) == flavors.count_params(flavors.get_shape(name)), name


# ------------------------------------------------------------------------------------------------
# Batch runner: errors before anything runs
# ------------------------------------------------------------------------------------------------


def test_unknown_parameter_name_lists_valid_names(tmp_path):
    proc = cli("run", "02_native", "-p", "stepz", "3", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert "unknown parameter 'stepz'" in proc.stderr
    assert "Did you mean 'steps'?" in proc.stderr
    assert "Valid parameters: config, backend, flavor" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing executed


def test_unknown_parameter_for_the_whole_set(tmp_path):
    """Over several notebooks a name must be declared by at least one of them (a typo cannot slip through)."""
    proc = cli("run", "-p", "seq_lne", "32", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "unknown parameter 'seq_lne'" in proc.stderr and "Did you mean 'seq_len'?" in proc.stderr


def test_bad_flavor_fails_with_the_workbench_error(tmp_path):
    proc = cli("run", "02_native", "-p", "flavor", "72B", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert "ConfigError" in proc.stderr
    assert "Qwen3 has no 72B model" in proc.stderr and "Valid flavors:" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_workbench_rejections_and_types(tmp_path):
    out = str(tmp_path / "out")
    dense_nki = cli("run", "03", "-p", "flavor", "tiny", "--out", out)
    assert dense_nki.returncode == 2 and "nki_moe replaces MoE expert layers" in dense_nki.stderr
    wrong_type = cli("run", "02", "-p", "steps", "ten", "--out", out)
    assert wrong_type.returncode == 2 and "parameter 'steps' expects int" in wrong_type.stderr
    bad_override = cli("run", "02", "-p", "overrides", "{training.stepz: 3}", "--out", out)
    assert bad_override.returncode == 2 and "Did you mean 'training.steps'?" in bad_override.stderr
    no_notebook = cli("run", "07_nothing", "--out", out)
    assert no_notebook.returncode == 2 and "Available: 00_setup" in no_notebook.stderr
    mixture = cli("run", "08", "-p", "dataset", "/d/web.jsonl:0.7,/d/code.jsonl:0.3", "--out", out)
    assert mixture.returncode == 2 and ("mixtures are not shown here; pass one member, e.g. dataset='/d/web.jsonl'"
                                        in mixture.stderr), mixture.stderr


def test_params_file_per_notebook_section(tmp_path):
    (tmp_path / "p.yaml").write_text("steps: 3\n02_native:\n  nproc: 2\n  flavr: tiny\n")
    proc = cli("run", "02", "03", "-f", str(tmp_path / "p.yaml"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "02_native: unknown parameter 'flavr'" in proc.stderr
    paths = runner.discover(["02", "00"])
    chosen = runner.resolve_parameters(paths, {"steps": "3", "device": "cpu"}, {"02_native": {"nproc": 2}})
    assert chosen[paths[0]] == {"steps": 3, "nproc": 2}  # "3" (YAML string) -> int, like the default
    assert chosen[paths[1]] == {"device": "cpu"}


# ------------------------------------------------------------------------------------------------
# Batch runner: execution
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # starts a notebook kernel
def test_failing_notebook_exits_nonzero_and_prints_error(tmp_path):
    nb = new_notebook(cells=[new_code_cell("answer = 41", metadata={"tags": ["parameters"]}),
                             new_code_cell("raise ValueError(f'no good: {answer}')")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "99_fails.ipynb"
    nbformat.write(nb, str(path))
    proc = cli("run", str(path), "-p", "answer", "42", "--out", str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "FAILED 99_fails: ValueError: no good: 42" in proc.stderr
    summary = (tmp_path / "out" / "summary.csv").read_text()
    assert "99_fails,failed" in summary


@pytest.mark.slow
def test_notebook_with_non_default_parameters(tmp_path, monkeypatch):
    """Command-line parameters reach the notebook: another flavor and dataset, fewer steps, FSDP over 2 ranks. And
    what only the batch runner's saved copy shows (nbval runs every notebook with its defaults, and checks each training
    notebook's steps, backend and falling loss): the dashboard degraded to its static figure, the summary line, no
    dead widgets. The dashboard code is the same in the three training notebooks: one run covers it."""
    own = tmp_path / "own.jsonl"  # the dataset parameter: data of one's own
    own.write_text("".join(json.dumps({"text": f"Note {i}: the tide came in over the flats. " * 4}) + "\n"
                           for i in range(20)))
    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(tmp_path / "cache"))
    proc = cli("run", "02_native", "-p", "flavor", "tiny-moe", "-p", "steps", "3", "-p", "seq_len", "32",
               "-p", "nproc", "2", "-p", "overrides", "{optimizer.lr: 1e-3}", "-p", "dataset", str(own),
               "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "outputs" / "nb02_native"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    resolved = (run_dir / "config.toml").read_text()
    assert 'flavor = "tiny-moe"' in resolved and "seq_len = 32" in resolved and "lr = 0.001" in resolved
    assert f'dataset = "{own}"' in resolved
    text = outputs_text(tmp_path / "02_native.ipynb")
    assert "2 rank(s)" in text and " · own.jsonl · 3 steps · cpu · " in text  # the dataset in the title
    assert {r["backend"] for r in records} == {"native"} and (tmp_path / "summary.csv").is_file()
    assert "finished · backend" in text and "✗" not in text
    assert re.search(r"✓\s+loss decreased \(last < first\)", text), text
    assert has_image(tmp_path / "02_native.ipynb")  # the dashboard's final static figure
    assert "application/vnd.jupyter.widget-view+json" not in (tmp_path / "02_native.ipynb").read_text()
    nb = nbformat.read(str(tmp_path / "02_native.ipynb"), as_version=4)
    injected = [c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected and 'flavor = "tiny-moe"' in injected[0].source


# ------------------------------------------------------------------------------------------------
# Dashboard
# ------------------------------------------------------------------------------------------------


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


def test_kernel_registration_never_takes_over_another_clones_kernel(tmp_path, monkeypatch):
    """`make setup` registers qwen3-workbench; a second clone's setup warns (naming the old Python) and keeps it."""
    from workbench.notebook.kernel import NAME, register, registered_python

    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("JUPYTER_PATH", "")
    warnings = []
    assert register(echo=lambda *_: None, warn=warnings.append) and registered_python() == Path(sys.executable)
    spec = tmp_path / "data" / "kernels" / NAME / "kernel.json"
    other = tmp_path / "other-clone" / ".venv" / "bin" / "python"
    other.parent.mkdir(parents=True)
    other.write_text("")  # another clone's interpreter, still there
    spec.write_text(json.dumps({"argv": [str(other), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                                "display_name": "Qwen3 workbench", "language": "python"}))
    assert not register(echo=lambda *_: None, warn=warnings.append)
    assert registered_python() == other and str(other) in warnings[0] and "--replace" in warnings[0]
    assert register(replace=True, echo=lambda *_: None) and registered_python() == Path(sys.executable)
    other.unlink()  # a deleted clone's kernel is taken over without asking
    spec.write_text(spec.read_text().replace(sys.executable, str(other)))
    assert register(echo=lambda *_: None, warn=warnings.append) and len(warnings) == 1
    assert registered_python() == Path(sys.executable)


def test_bench_table_is_readable():
    """Short headers with units, MFU in percent, 4 significant digits, "—" with a footnote for a missing value, no
    index (bench.csv keeps full precision)."""
    import pandas as pd

    from workbench.notebook.reports import bench_table

    df = pd.DataFrame({"backend": ["native", "nki_moe"], "status": ["ok", "failed"], "tokens_per_s": [401.98765, None],
                       "step_time_median_s": [0.3188812, None], "mfu": [0.0623456, None], "error": ["", "boom"]})
    t = bench_table(df)
    assert list(t.frame.columns) == ["backend", "status", "tok/s", "step median (s)", "MFU (%)", "error"]
    assert t.frame.iloc[0].tolist() == ["native", "ok", "402.0", "0.3189", "6.235", ""]
    assert t.frame.iloc[1].tolist() == ["nki_moe", "failed", "—", "—", "—", "boom"]
    assert any(n.startswith("—: no value") for n in t.footnotes)
    assert "nan" not in repr(t).lower() and "NaN" not in t._repr_html_()


def test_display_helpers_round_label_and_check():
    """One presentation: significant digits with separators, one memory unit per value, MFU as %, checks as ✓/✗ rows
    with the measured value and the tolerance; the text form (what nbval compares) has no index and no addresses."""
    from workbench.notebook.display import Table, checks, memory, number, percent

    assert [number(x) for x in (1773260800, 11.934203147888184, 0.0144, 109608.11688241182, None, float("nan"))] == \
        ["1,773,260,800", "11.93", "0.01440", "109,608", "—", "—"]
    assert memory(1773260800) == "1.65 GiB" and memory(3 * 2**20) == "3.00 MiB" and percent(0.0144) == "1.44 %"
    c = checks([("loss decreased", True, "11.93 → 10.5", "lower"), ("steps logged", False, 7, 8)])
    assert c.frame.values.tolist() == [["✓", "loss decreased", "11.93 → 10.5", "lower"],
                                       ["✗", "steps logged", "7", "8"]]
    t = Table.of([("a long path " * 10, 1.5)], ["what", "value (s)"], footnotes=["note"])
    assert repr(t).splitlines()[-1] == "note" and "a long path " * 10 in repr(t)  # not cut at 50 characters
    assert "<th" in t._repr_html_() and " at 0x" not in repr(t)


def test_measured_on_h200_is_labelled_or_says_not_measured(tmp_path):
    """06 shows docs/measured_on_h200.md labelled as measured on one H200, or one line when it does not exist."""
    from workbench.notebook.reports import measured_on_h200

    absent = measured_on_h200(ROOT / "docs" / "no_such_file.md").data
    assert absent.startswith("**Measured on one NVIDIA H200:** not measured yet") and "\n" not in absent
    table = tmp_path / "measured_on_h200.md"
    table.write_text("Measured 2026-12-04, torch 2.14.0\n\n| backend | tok/s |\n|---|---|\n| native | 1000 |\n")
    shown = measured_on_h200(table).data
    assert shown.startswith("**Measured on one NVIDIA H200**") and "| native | 1000 |" in shown
