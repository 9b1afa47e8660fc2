"""Every command-line tool reports bad input the same way: one line from `errors.announce`, exit code 2."""

from __future__ import annotations

import pytest

from tests.run_helpers import ROOT
from workbench.core import errors


def _bench(tmp):
    from workbench import bench

    return bench.main(["--job.config_file", str(tmp / "absent.toml")])


def _compare(tmp):
    from workbench import compare

    return compare.main([str(tmp), str(tmp)])


def _doctor(tmp):
    from workbench import doctor

    return doctor.main(["--job.config_file", str(ROOT / "configs/cpu_dense.toml"), "--training.stepz", "3"])


def _hf_export(tmp):
    from workbench import hf_export

    return hf_export.main(["--run", str(tmp / "no_run"), "--out", str(tmp / "out")])


def _plan(tmp):
    from workbench import plan

    return plan.main(["--device", "tpu", "--job.config_file", str(ROOT / "configs/cpu_dense.toml")])


def _notebook(tmp):
    from workbench.notebook.__main__ import main

    return main(["run", str(tmp / "99_absent.ipynb")])


@pytest.mark.parametrize("tool, says", [
    (_bench, "absent.toml"),
    (_compare, "is not a checkpoint"),
    (_doctor, "Did you mean 'training.steps'?"),
    (_hf_export, "no_run"),
    (_plan, "Unknown --device 'tpu'"),
    (_notebook, "99_absent"),
])
def test_tools_report_bad_input_as_one_config_error_line(tool, says, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert tool(tmp_path) == errors.EXIT_CONFIG == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("workbench: config error: ") and says in lines[0], lines


def test_recognised_maps_known_failures_to_their_exit_codes(tmp_path):
    import errno

    assert errors.recognised(FileNotFoundError("no such file: x")).exit_code == errors.EXIT_CONFIG
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "f"))
    assert errors.recognised(full).exit_code == errors.EXIT_CHECKPOINT
    assert errors.recognised(errors.DeviceError("no neuron")).kind == "device error"
    assert errors.recognised(ValueError("anything else")) is None  # its traceback shows
