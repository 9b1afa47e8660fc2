"""scripts/trn2.sbatch runs as written: its srun/torchrun line as 2 agents on 127.0.0.1 (a local stand-in for srun
starts one task per "node", as Slurm does), and the losses equal the single-agent 2-rank run's."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from run_helpers import ROOT, cached_run, free_port, losses_by_step

SRUN = """#!/bin/bash
# stand-in for Slurm's srun in tests: one task per node, all on this machine
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


@pytest.mark.slow
def test_sbatch_script_as_two_local_agents(tmp_path, tmp_path_factory):
    one_agent, _ = cached_run(tmp_path_factory, "configs/cpu_dense.toml", "--model.backend", "native", nproc=2)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "srun").chmod(0o755)
    shared = tmp_path / "fsx"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_ID": "42",
           "SLURM_SUBMIT_DIR": str(ROOT), "HEAD_NODE": "127.0.0.1", "RDZV_PORT": str(free_port()),
           "NPROC_PER_NODE": "1", "SHARED_DIR": str(shared), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "trn2.sbatch"), "configs/cpu_dense.toml", "native",
                           "--training.steps", "6", "--lr_scheduler.total_steps", "30"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "2 node(s) x 1 ranks, rendezvous 127.0.0.1" in proc.stdout
    assert proc.stdout.count("device cpu x 2 rank(s)") == 1  # one world of 2 ranks over both agents
    two_agents, single = losses_by_step(shared / "cpu_dense"), losses_by_step(one_agent)
    for step in range(1, 7):
        assert abs(two_agents[step] - single[step]) <= 1e-6, (step, two_agents[step], single[step])


def test_sbatch_asks_for_a_warning_signal_early_enough_to_save():
    """Slurm's --signal=TERM@T reaches every process of the step T s before the time limit; torchrun must wait for
    the ranks' save (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and still finish inside those T s."""
    text = (ROOT / "scripts" / "trn2.sbatch").read_text()
    m = re.search(r"^#SBATCH --signal=TERM@(\d+)$", text, re.M)
    wait = re.search(r"^export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=\$\{TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-(\d+)\}$", text, re.M)
    assert m and wait, "trn2.sbatch must request a warning signal and set torchrun's shutdown timeout"
    assert 60 <= int(wait[1]) < int(m[1]), (wait[1], m[1])  # Slurm may signal up to 60 s early: still > 60 s


def test_sbatch_usage_error():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "trn2.sbatch")], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage: sbatch" in proc.stderr
