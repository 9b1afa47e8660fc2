"""What the trainer reads beyond torchtitan's config: the workbench's own facts about one run (`RunRecord`).

torchtitan's `Trainer.Config` holds the model, data, optimizer, parallelism and checkpoint settings the trainer
builds from; the record holds the rest, worked out once from the validated `JobConfig` (`RunRecord.of`): the
backend and model shape, the batch settings a resume may change, the HF weights in and out, the profiled steps, the
resolved config written as `config.toml`, and whether (and against which memory plan) the run measures its peaks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workbench.core.config import JobConfig, Profiling, Training

if TYPE_CHECKING:
    from workbench.core.flavors import Qwen3Shape


@dataclass
class RunRecord:
    """One run's facts beyond torchtitan's config (`WorkbenchTrainer.Config.run`)."""

    backend: str = "native"
    shape: Qwen3Shape | None = None
    training: Training = field(default_factory=Training)
    """The [training] section (a copy): its batch settings; a resume keeps the checkpoint's global batch unless one
    is set here (`trainer.resume_batch`), and writes what it keeps back into it."""
    profiling: Profiling = field(default_factory=Profiling)
    hf_checkpoint: str = ""
    """Published weights loaded before the first step (`model.hf_checkpoint`; "" = none)."""
    tokenizer_path: str = ""
    export_hf: bool = False
    export_dtype: str = "bfloat16"
    resolved: dict[str, Any] = field(default_factory=dict)
    """Every section as resolved (`JobConfig.to_dict`), written as `config.toml` with `training` in place."""
    measure_memory: bool = False
    """Measure every rank's peak after steps 1 and 2 (`run.peak_memory`, `job.memory_measure`)."""
    memory_plan: dict | None = None
    """The memory plan the measurement compares with (rank 0; None elsewhere or when none was made)."""

    @classmethod
    def of(cls, job: JobConfig, device_kind: str, memory_plan: dict | None = None) -> RunRecord:
        """The record of a launch of the validated `job` on `device_kind`, with the preflight's plan (rank 0)."""
        from workbench.run.peak_memory import measures_on_launch

        return cls(backend=job.model.backend, shape=job.shape, training=dataclasses.replace(job.training),
                   profiling=job.profiling, hf_checkpoint=job.model.hf_checkpoint,
                   tokenizer_path=job.model.tokenizer_path, export_hf=job.checkpoint.export_hf,
                   export_dtype=job.checkpoint.export_dtype, resolved=job.to_dict(),
                   measure_memory=measures_on_launch(job, device_kind), memory_plan=memory_plan)

    def config_toml(self) -> str:
        """The resolved config as TOML, with the [training] section as this run uses it."""
        import tomli_w

        return tomli_w.dumps({**self.resolved, "training": dataclasses.asdict(self.training)})
