"""workbench.notebook.runner (`python -m workbench.notebook run`): the batch runner refuses an unknown parameter name
(listing the valid ones), a wrong type and a value the workbench rejects before any kernel starts, takes a
parameters file per notebook, and a notebook that fails while running makes the batch exit non-zero with the error
printed. A training notebook run through it with non-default parameters: tests/integration/test_notebooks.py."""

from __future__ import annotations

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from tests.notebook.helpers import cli
from workbench.notebook import runner

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)


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
