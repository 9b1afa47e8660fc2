"""scripts/trn2.sbatch runs as written: its srun/torchrun line as 2 agents on 127.0.0.1 (a local stand-in for srun
starts one task per "node", as Slurm does), and the losses equal the single-agent 2-rank run's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.run_helpers import FIRST_12_OF_30, ROOT, cached_run, free_port, losses_by_step

SRUN = """#!/bin/bash
# stand-in for Slurm's srun in tests: one task per node, all on this machine. It takes exactly the flags
# trn2.sbatch must pass and refuses anything else (exit 2), and does what they ask: --ntasks-per-node=1 starts one
# task per node; --kill-on-bad-exit=1 stops the other tasks as soon as one exits non-zero, and returns its code.
want=("--ntasks-per-node=1" "--kill-on-bad-exit=1")
got=()
while [[ "$1" == -* ]]; do got+=("$1"); shift; done
if [[ "${got[*]}" != "${want[*]}" ]]; then
    echo "srun stand-in: flags '${got[*]}', expected exactly '${want[*]}'" >&2
    exit 2
fi
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!); done
rc=0
while ((${#pids[@]})); do
    wait -n -p done_pid "${pids[@]}"; code=$?
    pids=($(for p in "${pids[@]}"; do [[ $p != "$done_pid" ]] && echo "$p"; done))
    if ((code != 0 && rc == 0)); then
        rc=$code
        for p in "${pids[@]}"; do pkill -TERM -P "$p" 2>/dev/null; kill -TERM "$p" 2>/dev/null; done
    fi
done
exit $rc
"""


def srun_standin(tmp_path) -> Path:
    """A bin folder whose `srun` is the stand-in (put it first on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "srun").chmod(0o755)
    return bin_dir


def test_srun_standin_takes_only_the_flags_trn2_sbatch_passes(tmp_path):
    """The stand-in is strict: a flag trn2.sbatch drops or adds is refused; with its flags, each node's task runs
    once (SLURM_NODEID 0 and 1), and a task that fails stops the other at once and sets the exit code."""
    srun = str(srun_standin(tmp_path) / "srun")
    env = {**os.environ, "SLURM_NNODES": "2"}

    def run(*args):
        return subprocess.run([srun, *args], env=env, capture_output=True, text=True, timeout=60)

    for flags in ([], ["--ntasks-per-node=1"], ["--ntasks-per-node=2", "--kill-on-bad-exit=1"],
                  ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "--exclusive"]):
        proc = run(*flags, "true")
        assert proc.returncode == 2 and "srun stand-in: flags" in proc.stderr, (flags, proc.stderr)
    flags = ["--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    proc = run(*flags, "bash", "-c", 'echo "node $SLURM_NODEID"')
    assert proc.returncode == 0 and sorted(proc.stdout.split("\n")) == ["", "node 0", "node 1"]
    t0 = time.monotonic()
    proc = run(*flags, "bash", "-c", 'if [ "$SLURM_NODEID" = 1 ]; then exit 3; fi; sleep 30')
    assert proc.returncode == 3 and time.monotonic() - t0 < 20  # the sleeping task was stopped


def test_sbatch_passes_its_srun_flags(tmp_path):
    """trn2.sbatch's own srun line against the strict stand-in, its command replaced by a PYTHON that only prints
    its arguments (what each node would launch): every node runs torchrun with the rendezvous and the config."""
    bin_dir = srun_standin(tmp_path)
    python = tmp_path / "python"
    python.write_text('#!/bin/bash\necho "node $SLURM_NODEID: $*"\n')
    python.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_ID": "7",
           "SLURM_SUBMIT_DIR": str(ROOT), "HEAD_NODE": "10.0.0.1", "RDZV_PORT": "29400", "NPROC_PER_NODE": "64",
           "SHARED_DIR": str(tmp_path / "fsx"), "PYTHON": str(python)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "trn2.sbatch"), "configs/trn2_qwen3_8b.toml", "native",
                           "--training.steps", "6"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launched = sorted(line for line in proc.stdout.splitlines() if line.startswith("node "))
    want = ("-m torch.distributed.run --nnodes=2 --nproc_per_node=64 --rdzv_backend=c10d "
            "--rdzv_endpoint=10.0.0.1:29400 --rdzv_id=qwen3-7 train.py --job.config_file configs/trn2_qwen3_8b.toml "
            f"--model.backend native --job.dump_folder {tmp_path / 'fsx'} --training.steps 6")
    assert launched == [f"node 0: {want}", f"node 1: {want}"]


@pytest.mark.slow
def test_sbatch_script_as_two_local_agents(tmp_path, tmp_path_factory):
    one_agent, _ = cached_run(tmp_path_factory, "configs/cpu_dense.toml", "--model.backend", "native", *FIRST_12_OF_30,
                              nproc=2)
    bin_dir = srun_standin(tmp_path)
    shared = tmp_path / "fsx"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_ID": "42",
           "SLURM_SUBMIT_DIR": str(ROOT), "HEAD_NODE": "127.0.0.1", "RDZV_PORT": str(free_port()),
           "NPROC_PER_NODE": "1", "SHARED_DIR": str(shared), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "trn2.sbatch"), "configs/cpu_dense.toml", "native",
                           "--training.steps", "4", "--lr_scheduler.total_steps", "30"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "2 node(s) x 1 ranks, rendezvous 127.0.0.1" in proc.stdout
    assert proc.stdout.count("device cpu x 2 rank(s)") == 1  # one world of 2 ranks over both agents
    two_agents, single = losses_by_step(shared / "cpu_dense"), losses_by_step(one_agent)
    assert sorted(two_agents) == [1, 2, 3, 4]  # the equality holds from step 1: 4 steps show it
    for step in range(1, 5):
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
