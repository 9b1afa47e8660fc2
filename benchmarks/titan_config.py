"""A torchtitan config registry for plain torchtitan, built from a workbench job: the baseline of engine_overhead.py.

    WORKBENCH_JOB_TOML=run/launch.toml torchrun --nproc_per_node=N -m torchtitan.train \
        --module benchmarks.titan_config --config workbench_job

`workbench_job()` returns torchtitan's own `Trainer.Config` with every field the workbench's native path would use
(`workbench.run.titan_config.build_titan_config`: the same model spec, i.e. torchtitan's Qwen3 with the job's
flavor, the same data loader, optimizer, schedule, parallelism and seed), but torchtitan's `Trainer` and
`MetricsProcessor` instead of the workbench's subclasses. So the two runs differ only in the engine layer the
workbench adds.
"""

from __future__ import annotations

import dataclasses
import os

ENV = "WORKBENCH_JOB_TOML"


def workbench_job():
    """torchtitan `Trainer.Config` of the job in $WORKBENCH_JOB_TOML (a resolved workbench TOML)."""
    from workbench.core.config import load_config
    from workbench.platform import device, titan_device

    if ENV not in os.environ:
        raise RuntimeError(f"Set {ENV} to a workbench TOML (benchmarks/engine_overhead.py does this).")
    job = load_config(os.environ[ENV])
    kind = device.detect(job.job.device).kind
    titan_device.pin(kind)  # torchtitan on CPU needs the workbench's CPU adjustments (as the native path has them)

    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.trainer import Trainer

    from workbench.run.titan_config import build_titan_config

    ours = build_titan_config(job, kind, int(os.environ.get("WORLD_SIZE", "1")))
    config = Trainer.Config(**{f.name: getattr(ours, f.name) for f in dataclasses.fields(Trainer.Config) if f.init})
    config.metrics = MetricsProcessor.Config(log_freq=job.metrics.log_freq, disable_color_printing=True)
    return config
