"""Engine overhead: the workbench's native path vs plain torchtitan, same model, data and config, side by side.

    .venv/bin/python benchmarks/engine_overhead.py [--config configs/cpu_moe.toml] [--steps 20] [--warmup-steps 3]
                                                   [--rounds 2] [--nproc 1] [--out outputs/engine_overhead]
                                                   [--section.key value ...]

Both sides train the same resolved config under torchrun: `python -m workbench.train` (WorkbenchTrainer: run folder,
metrics.jsonl, progress lines, profiler hooks, MFU) and `python -m torchtitan.train --module benchmarks.titan_config`
(torchtitan's Trainer with the identical Trainer.Config; see titan_config.py). Rounds alternate the order (A B, B A,
...) so drift in machine load hits both sides alike.

Step time is measured the same way for both, outside either engine, when each step's log line arrives from rank 0
(one line per step, flushed), so a step is the whole loop iteration, logging included:
  * wall: time between consecutive step lines;
  * cpu: CPU seconds (user + system) the job's processes (torchrun and every rank) used in between. Waiting for a
    core does not count, but spinning OpenMP threads and cache contention still carry the neighbours' load into it.
The first `warmup_steps` steps are dropped. Printed: median and p10/p90 per engine and the ratios
workbench / torchtitan (goal <= 1.02). On a busy machine, raise --rounds and --steps; the spread shows the noise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: import workbench and benchmarks from this checkout

from benchmarks.titan_config import ENV  # noqa: E402

STEP_LINES = {"workbench": re.compile(r"^step\s+(\d+)/\d+\s"), "torchtitan": re.compile(r"step:\s*(\d+)\s+loss:")}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(engine: str, toml: Path, nproc: int) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                f"--master_port={_free_port()}"]
    if engine == "workbench":
        return [*launcher, "-m", "workbench.train", "--job.config_file", str(toml)]
    return [*launcher, "-m", "torchtitan.train", "--module", "benchmarks.titan_config", "--config", "workbench_job"]


def _cpu_seconds(root: psutil.Process) -> float:
    """User + system CPU seconds of `root` (torchrun's agent) and its descendants (the ranks) so far."""
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def step_times(engine: str, toml: Path, nproc: int, log: Path) -> pd.DataFrame:
    """Runs one engine to completion; returns per step (from step 2) its wall and CPU seconds."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", ENV: str(toml)}
    marks: dict[int, tuple[float, float]] = {}  # step -> (wall clock, CPU seconds) when its line arrived
    with open(log, "w") as f:
        proc = subprocess.Popen(_command(engine, toml, nproc), cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        root = psutil.Process(proc.pid)
        for line in proc.stdout:
            now = time.perf_counter()
            f.write(line)
            m = STEP_LINES[engine].search(line)
            if m and int(m[1]) not in marks:
                marks[int(m[1])] = (now, _cpu_seconds(root))
    if proc.wait() != 0:
        raise RuntimeError(f"{engine} run failed (exit {proc.returncode}); its output is in {log}.")
    rows = [{"step": s, "wall_s": marks[s][0] - marks[s - 1][0], "cpu_s": marks[s][1] - marks[s - 1][1]}
            for s in sorted(marks) if s - 1 in marks]
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", default="configs/cpu_moe.toml", help="workbench TOML (default cpu_moe)")
    parser.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    parser.add_argument("--warmup-steps", type=int, default=3, help="leading steps not timed (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per engine, alternating order (default 2)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per run (default 1)")
    parser.add_argument("--out", default="outputs/engine_overhead", help="run folders and logs")
    args, overrides = parser.parse_known_args(argv)

    from workbench.core.config import load_config

    out = Path(args.out).resolve()
    runs: list[pd.DataFrame] = []
    for r in range(args.rounds):
        order = ["workbench", "torchtitan"] if r % 2 == 0 else ["torchtitan", "workbench"]
        for engine in order:
            job = load_config(ROOT / args.config, argv=[
                *overrides, "--model.backend", "native", "--training.steps", str(args.steps),
                "--checkpoint.enable", "false", "--checkpoint.export_hf", "false", "--profiling.enable", "false",
                "--job.dump_folder", str(out), "--job.experiment_name", f"{engine}_{r}"])
            job.run_dir.mkdir(parents=True, exist_ok=True)
            (job.run_dir / "metrics.jsonl").unlink(missing_ok=True)
            toml = job.run_dir / "launch.toml"
            toml.write_text(job.to_toml())
            print(f"round {r + 1}/{args.rounds}: {engine} ...", flush=True)
            steps = step_times(engine, toml, args.nproc, out / f"{engine}_{r}.log")
            runs.append(steps[steps.step > args.warmup_steps].assign(engine=engine, round=r))

    timed = pd.concat(runs)
    table = timed.groupby("engine", sort=False)[["wall_s", "cpu_s"]].describe(percentiles=[0.1, 0.5, 0.9])
    table = table.loc[:, (slice(None), ["count", "10%", "50%", "90%"])]
    print(table.to_string(float_format=lambda v: f"{v:.4f}"))
    per_round = timed.groupby(["round", "engine"], sort=False)[["wall_s", "cpu_s"]].median().unstack("engine")
    print("median per round (the spread between rounds is the noise floor):")
    print(per_round.to_string(float_format=lambda v: f"{v:.4f}"))
    medians = timed.groupby("engine")[["wall_s", "cpu_s"]].median()
    for kind in ("wall_s", "cpu_s"):
        ratio = medians.loc["workbench", kind] / medians.loc["torchtitan", kind]
        print(f"engine overhead ({kind[:-2]}): workbench / torchtitan median step = {ratio:.3f}x (goal <= 1.02x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
