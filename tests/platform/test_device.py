"""workbench.platform.device: `job.device` failures are one line with exit code 2, before any process group: a forced
neuron or cuda device that this host lacks, and auto on a host whose Neuron device files exist while torch_neuronx
does not import (`python -m workbench.train`, as a user starts it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.run_helpers import ROOT

DENSE = "configs/cpu_dense.toml"


def _train_module(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench.train", "--job.config_file", DENSE, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("device", ["neuron", "cuda"])
def test_forced_missing_device_is_one_line_exit_2(device, tmp_path):
    import os

    # Neither device for the launch, whatever this host has: an empty CUDA_VISIBLE_DEVICES hides every GPU from
    # torch, and a torch_neuronx first on the path that fails to import stands for a host without TorchNeuron.
    (tmp_path / "torch_neuronx.py").write_text("raise ImportError('no TorchNeuron in this test')\n")
    pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": pythonpath}
    proc = _train_module("--job.device", device, env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"workbench: device error: job.device={device}")
    assert ("torch_neuronx does not import" in lines[0]) if device == "neuron" else ("--job.device" in lines[0])


def test_auto_on_a_host_with_neuron_device_files_refuses_cpu(tmp_path):
    import os

    for i in range(2):
        (tmp_path / f"neuron{i}").touch()
    proc = _train_module(env={**os.environ, "WORKBENCH_DEV_DIR": str(tmp_path)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"this host has Neuron devices ({tmp_path}/neuron0, ... 2 in all)" in proc.stderr
