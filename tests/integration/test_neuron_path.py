"""The Neuron code path, exercised offline: what can be proven without a Trainium (the device checks:
tests/platform/test_device.py).

* `[neuron] apply = "always"` runs `workbench/platform/neuron_adjustments.py` through the real launch path on 2 gloo
  ranks, with the process group registered under the configured name ("neuron", tests/neuron_standin.py): the losses
  equal the plain CPU run's to 1e-6, its first-launch memory check gathers both ranks' peaks (within 0.5% of the
  plan), and switching the SUM reduction off makes FSDP hand PREMUL_SUM to that process group, which rejects it.

Not proven here: that TorchNeuron's own "neuron" backend, SDPA dispatch, memory statistics or timeouts behave as
the docs say; only that the workbench's side of each adjustment is wired and numerically neutral.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.run_helpers import FIRST_12_OF_30, ROOT, cached_run, check_memory_report, free_port, losses_by_step

DENSE = "configs/cpu_dense.toml"


def _standin_run(out, *args: str, log=None) -> subprocess.CompletedProcess:
    import os

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "tests.neuron_standin", "--job.config_file", str(ROOT / DENSE),
           "--neuron.apply", "always", "--job.dump_folder", str(out), *args]
    env = {**os.environ, "WORKBENCH_STANDIN_LOG": str(log)} if log else None
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
def test_neuron_adjustments_on_gloo_equal_plain_cpu(tmp_path, tmp_path_factory):
    """Also the first-launch memory check through the stand-in (the same launch: measuring steps 1 and 2 changes no
    number): every rank's peak is gathered; the ranks are symmetric, so they agree within 1%, and step 2 is within
    0.5% of the plan, as on plain CPU (tests/integration/test_memory_plan.py)."""
    plain_dir, _ = cached_run(tmp_path_factory, DENSE, "--model.backend", "native", *FIRST_12_OF_30, nproc=2)
    log = tmp_path / "standin"
    proc = _standin_run(tmp_path, "--training.steps", "4", "--lr_scheduler.total_steps", "30",
                        "--job.memory_measure", "always", log=log)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "neuron adjustments: process group neuron, FSDP SUM reduction, SDPA OVERRIDEABLE" in proc.stdout
    for rank in (0, 1):  # both ranks really built their process group through the "neuron" registration
        assert (tmp_path / f"standin.{rank}").read_text().startswith("neuron stand-in (gloo) created")
    plain, adjusted = losses_by_step(plain_dir), losses_by_step(tmp_path / "cpu_dense")
    assert sorted(adjusted) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert abs(adjusted[step] - plain[step]) <= 1e-6, (step, adjusted[step], plain[step])
    step2 = check_memory_report(tmp_path / "cpu_dense", proc.stdout, 2)["steps"][1]
    assert min(step2["measured_bytes"]) >= 0.99 * step2["max_bytes"]
    assert step2["measured_over_plan"] == pytest.approx(1.0, abs=0.005), step2


@pytest.mark.slow
def test_without_sum_reduction_the_process_group_sees_premul_sum(tmp_path):
    proc = _standin_run(tmp_path, "--training.steps", "1", "--neuron.force_sum_reduction", "false")
    assert proc.returncode != 0
    assert "PREMUL_SUM" in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
