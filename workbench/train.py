"""The one entry point for training: `python -m workbench.train` / `train.py`, under torchrun or alone.

    torchrun --nproc_per_node=N train.py --job.config_file configs/X.toml --model.backend B [--section.key v ...]

Order matters and is deliberate, each step done once: read the config -> detect the device it asks for ->
validate the whole config, the device's rules included -> check its input files -> (rank 0) the memory preflight
(`preflight`; a bad key, value, flavor, backend or file fails here with exit code 2, before any process group or
model exists) -> pin the device -> translate into torchtitan's config plus the run's record -> build the trainer
-> train (resuming from the newest DCP checkpoint in the run folder if there is one) -> summary
(`train_in_this_process`).

Every failure the workbench raises or recognises ends the launch with one line and its exit code
(`workbench.core.errors`: 2 config or locked run folder, 3 non-finite loss, 4 checkpoint/disk, 5 stopped by
SIGTERM/SIGINT after saving).

`workbench.train.train(job, nproc=...)` launches the same thing from Python (notebooks): torchrun in a
subprocess, its output streamed, the run folder returned. One spelling on purpose: `workbench.train` is this
module (so `python -m workbench.train` works), and the function in it is `train`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.core.config import JobConfig, help_text, load_config, read_config, validate
from workbench.core.errors import ConfigError, StoppedError, WorkbenchError, announce, recognised
from workbench.core.files import write_atomic
from workbench.platform.dist_utils import StopRequest, rank, say

if TYPE_CHECKING:
    from workbench.data.loader import OpenedMembers
    from workbench.platform.device import DeviceInfo


def train_in_this_process(checked: Preflight) -> Path:
    """Trains in this process (one rank of a torchrun job, or a lone process = world size 1) what `preflight`
    checked, and returns the run folder."""
    from workbench.platform import titan_device

    job, info = checked.job, checked.device
    adjusted = titan_device.pin(info.kind, job.neuron)
    # Single process without torchrun: become a world of one so FSDP/DCP code paths are the same.
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    world_size = int(os.environ["WORLD_SIZE"])

    import torch

    from workbench.run.trainer import WorkbenchTrainer, quiet_titan_logs

    stop = StopRequest()  # from here on SIGTERM/SIGINT finish the step and save (the trainer checks it)
    quiet_titan_logs(job.job.verbose)
    say(f"workbench: backend {job.model.backend}, flavor {job.model.flavor}, dataset {job.training.dataset}, device "
        f"{info.kind} x {world_size} rank(s), run folder {job.run_dir}")
    if adjusted:
        say(f"workbench: neuron adjustments: {', '.join(adjusted)}")
    cfg = checked.titan_config(world_size)
    gc.freeze()  # the collector is off (main); what the imports made lives as long as the process: out of its passes
    trainer = WorkbenchTrainer(cfg, stop)
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return job.run_dir


def check_inputs(job: JobConfig, world_size: int = 1) -> OpenedMembers:
    """Checks the files the run needs (tokenizer, dataset) before any process group starts, says what a mixture
    of datasets will give (`workbench.data.loader.mixture_report`), and returns the members it opened
    (`OpenedMembers`: the run's loader reads them, nothing is opened twice).

    A raw dataset is prepared here on first use (`workbench.data.loader.resolve`: one rank prepares into the cache
    under a lock, the others wait), so an empty or all-bad dataset is refused before any rank trains. Conversations
    are packed here (the index cached for the ranks' loaders, one line on what it holds, refused above
    `training.max_dropped`) and turn `training.document_mask` on: packed conversations never see each other.

    Raises:
        ConfigError: naming the bad path or setting (a DatasetError for a dataset the workbench cannot train on).
    """
    from workbench import data
    from workbench.data.loader import mixture_report, open_members
    from workbench.data.packing import ChatRows

    t = job.training
    try:
        data.tokenizer_dir(job.model.tokenizer_path)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    opened = open_members(t.dataset, job.model.tokenizer_path, t.seq_len, job.job.seed, t.dataset_text_field,
                          t.holdout_docs, t.chat_options(), vocab_size=job.shape.vocab_size)
    for name, rows, _ in opened.members:
        if isinstance(rows, ChatRows):
            say(f"workbench: {rows.describe()}")
            rows.check_dropped(t.max_dropped)
            if not t.document_mask:
                t.document_mask = True
                say(f"workbench: training.document_mask on: {name} holds conversations, packed apart.")
    rows_per_run = t.global_rows(world_size // job.parallelism.tp) * t.steps
    lines, warnings = mixture_report(t.dataset, [rows.total for _, rows, _ in opened.members], rows_per_run,
                                     t.seq_len + 1)
    for line in lines + warnings:
        say(line)
    return opened


def _exit(e: WorkbenchError) -> None:
    """One line for `e` (`errors.announce`), then exit with its code, skipping the interpreter's teardown."""
    # A stop on a signal prints too: torchrun, signalled itself, shows no failure summary then.
    os._exit(announce(e, rank(), also_print=isinstance(e, StoppedError)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Preflight:
    """What `preflight` worked out, carried into the run (`train_in_this_process`) so nothing is done twice."""

    job: JobConfig
    """The validated config."""
    device: DeviceInfo
    """The device detected for `job.device`."""
    opened: OpenedMembers
    """The dataset's members, opened and checked (`check_inputs`); the loader reads them."""
    memory_plan: dict | None = None
    """Rank 0: the memory plan the run's measurement compares with (`memory.preflight.plan_for_run`)."""

    def titan_config(self, world_size: int):
        """torchtitan's config plus the run's record (`build_titan_config`), with what was worked out here: the
        memory plan, the opened dataset (torchtitan pinned to the device first: `titan_device.pin`)."""
        from workbench.run.titan_config import build_titan_config

        return build_titan_config(self.job, self.device.kind, world_size, memory_plan=self.memory_plan,
                                  opened=self.opened)


def preflight(argv: list[str], world_size: int) -> Preflight:
    """Everything checked before any process group starts, each once: the config as written, the device it asks
    for, every rule of the config (the device's included), its input files, and (rank 0) the memory plan.

    Raises:
        ConfigError, FileNotFoundError: the one-line refusals (exit code 2).
    """
    from workbench.platform import device

    job = read_config(argv=argv)  # an unknown key or a value of the wrong type fails here, before torch is imported
    info = device.detect(job.job.device)  # before any process group: a missing device is a DeviceError line
    validate(job, world_size, info.kind)
    checked = Preflight(job, info, check_inputs(job, world_size))
    if rank() == 0:  # the memory plan (on CPU only when a cheap lower bound comes near the RAM)
        from workbench.memory import preflight as memory_preflight

        checked.memory_plan = memory_preflight.plan_for_run(job, world_size, info.kind)
    return checked


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print(help_text())
        return 0
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; 1 for a lone process
    # No cyclic garbage collection in a training process: torchtitan's Trainer switches it off when it starts
    # (GarbageCollection: a collection every `training.gc_freq` steps instead); off from here, the imports and the
    # preflight skip its passes too (torch, torchtitan and datasets allocate many objects while they load).
    gc.disable()
    try:
        checked = preflight(argv, world_size)
    except (ConfigError, FileNotFoundError) as e:
        return announce(recognised(e), rank())
    try:
        train_in_this_process(checked)
    except BaseException as e:  # noqa: BLE001 - a known failure is one line; anything else keeps its traceback
        known = recognised(e)
        if known is None:
            raise
        _exit(known)
    # Everything is written, closed and the process group destroyed. Skip the interpreter's teardown: a C++ thread
    # destructor in the distributed stack occasionally aborts there ("terminate called without an active
    # exception", SIGABRT) after a run that succeeded, which torchrun would report as a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train(job: JobConfig | str | os.PathLike, nproc: int = 1, extra_args: list[str] | None = None,
          stream=None, timeout_s: float | None = None) -> Path:
    """Python API: launches training of `job` on `nproc` ranks (torchrun in a subprocess, `main` in each rank)
    and returns the run folder.

    Args:
        job: a JobConfig (from `workbench.load_config`) or the path of a TOML file.
        nproc: processes (ranks) on this machine.
        extra_args: more `--section.key value` overrides.
        stream: a callable receiving each output line (default: print).
        timeout_s: wall-clock limit; past it the job gets SIGTERM (every rank finishes its step and stops, as on
            Ctrl-C), then SIGKILL 60 s later.

    Raises:
        subprocess.CalledProcessError: training failed (the output was streamed before).
        subprocess.TimeoutExpired: the run outlasted `timeout_s`.
    """
    if not isinstance(job, JobConfig):
        job = load_config(job, argv=extra_args, world_size=nproc)
        extra_args = None
    job.run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = job.run_dir / "launch.toml"
    write_atomic(cfg_path, job.to_toml())
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_free_port()}", "-m", "workbench.train", "--job.config_file", str(cfg_path),
           *(extra_args or [])]
    stream = stream or (lambda line: print(line, end="", flush=True))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    expired = threading.Event()

    def stop() -> None:  # torchrun forwards SIGTERM to its ranks; SIGKILL if they do not stop in time
        expired.set()
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
            return
        proc.kill()

    timer = threading.Timer(timeout_s, stop) if timeout_s else None
    if timer:
        timer.daemon = True
        timer.start()
    try:
        for line in proc.stdout:
            stream(line)
        code = proc.wait()
    finally:
        if timer:
            timer.cancel()
    if expired.is_set():
        raise subprocess.TimeoutExpired(cmd, timeout_s)
    if code != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return job.run_dir


if __name__ == "__main__":
    sys.exit(main())
