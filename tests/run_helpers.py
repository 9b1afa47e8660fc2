"""Helpers for tests that launch real training runs (torchrun over gloo) and read their run folders.

A module of its own (not conftest.py): notebooks/ has a conftest.py too, and `from conftest import` would be
ambiguous.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from workbench.run_folder import read_metrics  # noqa: F401  (re-exported for the tests)

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def train_cmd(config: str, *args: str, nproc: int = 1, extra_torchrun: tuple[str, ...] = ()) -> list[str]:
    """The article's launch line (torchrun ... train.py --job.config_file ...) for this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *extra_torchrun,
            str(ROOT / "train.py"), "--job.config_file", str(ROOT / config), *args]


def run_train(config: str, *args: str, nproc: int = 1, timeout: int = 600, check: bool = True,
              extra_torchrun: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Runs a training job to completion; on failure the assertion shows its output."""
    if "--master_port" not in " ".join(extra_torchrun) and "--rdzv" not in " ".join(extra_torchrun):
        extra_torchrun = (*extra_torchrun, f"--master_port={free_port()}")
    proc = subprocess.run(train_cmd(config, *args, nproc=nproc, extra_torchrun=extra_torchrun), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, (f"training failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}\n"
                                      f"{proc.stderr[-6000:]}")
    return proc


def kill_run_when(config: str, *args: str, ready, nproc: int = 1, timeout: float = 300,
                  env: dict[str, str] | None = None) -> list[int]:
    """Launches a training job like `run_train`, polls `ready()` until it holds (or the run ends, or `timeout`
    seconds pass), then SIGKILLs torchrun and every rank at once: no clean-up, what a crash or the OOM killer does.

    Returns:
        The killed pids (torchrun first), all reaped or gone.
    """
    import signal
    import time

    import psutil

    proc = subprocess.Popen(train_cmd(config, *args, nproc=nproc, extra_torchrun=(f"--master_port={free_port()}",)),
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.05)
    # torchrun starts each rank in its own session: kill the whole tree explicitly.
    victims = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    return victims


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """step -> loss; a resumed run appends to the same file, the latest record of a step wins."""
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SESSION_RUNS: dict[tuple, tuple[Path, str]] = {}


def cached_run(tmp_path_factory, config: str, *args: str, nproc: int = 1) -> tuple[Path, str]:
    """Runs a training job once per test session; returns (run folder, rank-0 stdout), shared by several tests."""
    key = (config, args, nproc)
    if key not in _SESSION_RUNS:
        out = tmp_path_factory.mktemp("shared_run")
        proc = run_train(config, *args, "--job.dump_folder", str(out), nproc=nproc)
        (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
        _SESSION_RUNS[key] = (run_dir, proc.stdout)
    return _SESSION_RUNS[key]
