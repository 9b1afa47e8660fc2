"""The notebooks as committed and as a user runs them.

* every notebook is committed clean (a `parameters` cell of plain literals, no outputs but the nbval-checked
  cells, the project kernel), and `clean` keeps only those cells;
* a training notebook runs headlessly through the batch runner (= papermill) with non-default parameters from the
  command line (2 ranks: torchrun launched from the notebook), and its saved copy is what a reader should see
  (nbval executes every notebook with its defaults).

nbval (`pytest --nbval-lax ... notebooks/`) is configured separately; see notebooks/README.md. The tooling in
process: tests/notebook/ (the runner's refusals, the dashboard, the kernel, the reports).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from tests.notebook.helpers import cli, has_image, outputs_text
from workbench.notebook import runner
from workbench.notebook.__main__ import NBVAL_MARK, clean_notebook

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = [p.stem for p in runner.discover()]


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


# ------------------------------------------------------------------------------------------------
# A training notebook through the batch runner
# ------------------------------------------------------------------------------------------------


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
