"""The memory preflight of a launch (rank 0, before any process group): refuse a config whose plan does not fit
(`check_fits`; on CPU only when a cheap lower bound comes near the RAM), and hand the run the plan its in-run
measurement compares with (`plan_for_run`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from workbench.core import flavors
from workbench.core.config import JobConfig
from workbench.core.errors import ConfigError
from workbench.core.files import read_json, write_atomic
from workbench.core.units import GiB
from workbench.memory import report, tables, tracer
from workbench.run.peak_memory import measures_on_launch

DEVICE_OF_KIND = {"neuron": "trn2", "cuda": "h100", "cpu": "cpu"}


def launch_device(device_kind: str) -> str:
    """The --device a launch on `device_kind` is planned for: the GPU by its name (an H200 has 141 GB, not an
    H100's 80), else `DEVICE_OF_KIND`."""
    if device_kind == "cuda":
        import torch

        if "H200" in torch.cuda.get_device_name(0):
            return "h200"
    return DEVICE_OF_KIND.get(device_kind, "cpu")


def plan_launch(job: JobConfig, world_size: int, device_kind: str, cache_dir: Path | None = None) -> dict:
    """The memory plan of a launch of `job` on `world_size` ranks of `device_kind` (with suggestions), from a
    subprocess, cached by a hash of the resolved config, world size and device. On cuda the capacity is the GPU's
    (`launch_device`: an H200's or else an H100's), on neuron a trn2 rank's.

    Raises:
        RuntimeError: the planner failed.
    """
    device = launch_device(device_kind)
    key = hashlib.sha256(f"{job.to_toml()}|{world_size}|{device}".encode()).hexdigest()[:16]
    cache = (cache_dir or Path.home() / ".cache" / "workbench" / "plans") / f"{key}.json"
    if cache.is_file():
        try:
            return read_json(cache)
        except (OSError, ValueError):
            pass  # a damaged cache entry: planned again
    p = tracer.plan_in_subprocess(job, device, world_size, suggest=True)
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(cache, json.dumps(p))
    return p


def check_fits(job: JobConfig, world_size: int, device_kind: str, cache_dir: Path | None = None) -> dict | None:
    """Plans `job` before launch (`plan_launch`) and refuses a plan over the rank's memory; returns the plan, or None
    where none was made.

    On CPU a launch is planned only when its lower bound (`cpu_floor_bytes`) is over 1/8 of the host RAM per rank
    (the tiny CPU runs are not slowed by a plan), and refused at once, unplanned, when that bound alone exceeds it.

    Raises:
        ConfigError: the plan does not fit, with the numbers and the suggested changes (exit code 2).
    """
    if not job.job.memory_check:
        return None
    if device_kind == "cpu":
        floor, ram = cpu_floor_bytes(job), tables.capacity("cpu", world_size)
        if floor > ram:  # certain without a trace (which would take minutes at such sizes)
            raise ConfigError(
                f"this launch needs at least {floor / GiB:.1f} GiB per rank (fp32 weights + the logits of "
                f"{job.training.local_batch_size} x {job.training.seq_len} tokens), and each of the {world_size} "
                f"rank(s) has {ram / GiB:.1f} GiB of this host's RAM: lower --training.local_batch_size (raise "
                "--training.gradient_accumulation_steps to keep the batch) or set --training.loss_chunks 8 "
                "(skip the check with --job.memory_check false).")
        if floor < ram / 8:
            return None
    try:
        p = plan_launch(job, world_size, device_kind, cache_dir)
    except RuntimeError as e:
        print(f"workbench: {e}\nworkbench: launching anyway", file=sys.stderr)
        return None
    if not p["fits"]:
        raise ConfigError("the memory plan does not fit (skip with --job.memory_check false):\n" + report.render(p))
    return p


def plan_for_run(job: JobConfig, world_size: int, device_kind: str, cache_dir: Path | None = None) -> dict | None:
    """The launch's preflight (rank 0): `check_fits`, then the plan the run's in-run measurement compares with
    (`RunRecord.memory_plan`): `check_fits`'s own, or planned now when the run measures (`job.memory_measure`)
    and `check_fits` did not plan. None when the run measures nothing (or planning failed: the measurement then
    reports the peaks alone).

    Raises:
        ConfigError: see `check_fits`.
    """
    planned = check_fits(job, world_size, device_kind, cache_dir)
    if not measures_on_launch(job, device_kind):
        return None
    if planned is None:
        try:
            planned = plan_launch(job, world_size, device_kind, cache_dir)
        except RuntimeError as e:
            print(f"workbench: memory check without a plan: {e}", file=sys.stderr)
    return planned


def cpu_floor_bytes(job: JobConfig) -> int:
    """A lower bound of a CPU rank's peak: fp32 weights plus one fp32 logits tensor of a micro-batch (per loss
    chunk). Cheap: the parameters are counted by formula (`flavors.param_counts`), no model is built."""
    t = job.training
    logits = t.local_batch_size * t.seq_len * job.shape.vocab_size * 4 // max(t.loss_chunks, 1)
    return 4 * flavors.param_counts(job.shape)["total"] + logits
