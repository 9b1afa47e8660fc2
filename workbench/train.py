"""The one entry point for training: `python -m workbench.train` / `train.py`, under torchrun or alone.

    torchrun --nproc_per_node=N train.py --job.config_file configs/X.toml --model.backend B [--section.key v ...]

Order matters and is deliberate: parse and validate the whole config (a bad key, flavor or backend fails here,
with exit code 2, before any process group or model exists) -> pick and pin the device -> write the resolved
config into the run folder -> build torchtitan's Trainer -> train (resuming from the newest DCP checkpoint in
the run folder if there is one) -> summary.

`workbench.train.train(job, nproc=...)` is the same thing from Python (notebooks): it launches torchrun in a
subprocess, streams its output, and returns the run folder. One spelling on purpose: `workbench.train` is this
module (so `python -m workbench.train` works), and the function in it is `train`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from workbench.config import ConfigError, JobConfig, help_text, load_config
from workbench.dist_utils import rank

EXIT_CONFIG_ERROR = 2  # also a checkpoint written for another model; 3 = non-finite loss, 4 = checkpoint/disk


def run(job: JobConfig, info=None) -> Path:
    """Trains in this process (one rank of a torchrun job, or a lone process = world size 1).

    Args:
        job: the validated config.
        info: the device found by `device.detect` (detected here when None).
    """
    from workbench import device

    info = info or device.detect(job.job.device)
    adjusted = device.prepare(info.kind, job.neuron)
    # Single process without torchrun: become a world of one so FSDP/DCP code paths are the same.
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    world_size = int(os.environ["WORLD_SIZE"])

    import torch

    from workbench import flavors
    from workbench.trainer import WorkbenchTrainer, build_titan_config, quiet_titan_logs, say

    run_dir = job.run_dir
    if rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(job.to_toml())
        # The architecture itself, so the run folder stays self-describing even if hf_checkpoint moves.
        (run_dir / "shape.json").write_text(json.dumps(flavors.describe(job.shape), indent=2))
    quiet_titan_logs(job.job.verbose)
    say(f"workbench: backend {job.model.backend}, flavor {job.model.flavor}, device {info.kind} x {world_size} "
        f"rank(s), run folder {run_dir}")
    if adjusted:
        say(f"workbench: neuron adjustments: {', '.join(adjusted)}")
    cfg = build_titan_config(job, info.kind, world_size)
    if info.kind == "cpu":
        cfg.comm.trace_buf_size = 0  # NCCL flight recorder: nothing to record on gloo
    trainer = WorkbenchTrainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return run_dir


def preflight(job: JobConfig) -> None:
    """Checks the files the run needs (tokenizer, dataset) before any process group starts.

    Raises:
        ConfigError: naming the bad path or setting.
    """
    from workbench import data

    try:
        data.tokenizer_dir(job.model.tokenizer_path)
        sources = data.document_sources(job.training.dataset, job.training.dataset_text_field)
    except (FileNotFoundError, KeyError) as e:
        raise ConfigError(str(e).strip('"')) from None
    if len(sources) <= job.training.holdout_docs:
        raise ConfigError(
            f"training.holdout_docs={job.training.holdout_docs} leaves no training documents ({len(sources)} in "
            f"{job.training.dataset!r}); set --training.holdout_docs 0."
        )


def _report(e) -> int:
    """One readable line for a failure the workbench knows (ConfigError, RunError), then exit with its code."""
    code = getattr(e, "exit_code", EXIT_CONFIG_ERROR)
    _announce(e.one_line() if hasattr(e, "one_line") else f"workbench: config error: {e}", code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # same reason as after a successful run: skip the distributed stack's teardown


def _announce(line: str, code: int) -> None:
    """Shows `line` once, at the end of the output, instead of a traceback per rank.

    Every rank got the same error (the decisions behind them are collective or deterministic). Under torchrun the
    line goes into each rank's torchelastic error file, whose `py_callstack` torchrun prints in its failure summary
    (the last lines of its output): rank 0's, dated a second earlier so that torchrun names it the root cause,
    holds the line and the fix; the other ranks' point at it. The ranks' exit code (2 config, 3 non-finite loss,
    4 checkpoint/disk) shows as `exitcode` there; torchrun itself exits 1. Alone (no torchrun), rank 0 prints
    the line on stderr.
    """
    first = rank() == 0
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        text = line if first else f"stopped with rank 0's error (the root cause below), exit code {code}"
        when = str(int(time.time()) - (1 if first else 0))
        Path(error_file).write_text(json.dumps(
            {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": when}}}))
    elif first:
        print(line, file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print(help_text())
        return 0
    from workbench import device

    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; 1 for a lone process
    try:
        job = load_config(argv=argv, world_size=world_size)
        preflight(job)
    except (ConfigError, FileNotFoundError) as e:
        _announce(f"workbench: config error: {e}", EXIT_CONFIG_ERROR)
        return EXIT_CONFIG_ERROR
    try:  # before any process group exists: a missing device is one line, not a traceback per rank
        info = device.detect(job.job.device)
    except device.DeviceError as e:
        _announce(f"workbench: device error: {e}", EXIT_CONFIG_ERROR)
        return EXIT_CONFIG_ERROR
    if rank() == 0:  # memory plan (cuda/neuron; CPU warns only), before any PG
        from workbench import plan

        try:
            plan.preflight(job, world_size, info.kind)
        except ConfigError as e:
            _announce(f"workbench: config error: {e}", EXIT_CONFIG_ERROR)
            return EXIT_CONFIG_ERROR
    from workbench.checkpoint import RunError  # torch-heavy: after the config is known to be good

    try:
        run(job, info)
    except (ConfigError, RunError) as e:
        return _report(e)
    # Everything is written, closed and the process group destroyed. Skip the interpreter's teardown: a C++ thread
    # destructor in the distributed stack occasionally aborts there ("terminate called without an active
    # exception", SIGABRT) after a run that succeeded, which torchrun would report as a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train(job: JobConfig | str | os.PathLike, nproc: int = 1, extra_args: list[str] | None = None,
          stream=None) -> Path:
    """Python API: trains `job` with `nproc` ranks (torchrun in a subprocess) and returns the run folder.

    Args:
        job: a JobConfig (from `workbench.load_config`) or the path of a TOML file.
        nproc: processes (ranks) on this machine.
        extra_args: more `--section.key value` overrides.
        stream: a callable receiving each output line (default: print).

    Raises:
        subprocess.CalledProcessError: training failed (the output was streamed before).
    """
    if not isinstance(job, JobConfig):
        job = load_config(job, argv=extra_args, world_size=nproc)
        extra_args = None
    job.run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = job.run_dir / "launch.toml"
    cfg_path.write_text(job.to_toml())
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", "-m", "workbench.train", "--job.config_file", str(cfg_path),
           *(extra_args or [])]
    stream = stream or (lambda line: print(line, end="", flush=True))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        stream(line)
    if proc.wait() != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return job.run_dir


if __name__ == "__main__":
    sys.exit(main())
