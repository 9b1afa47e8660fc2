"""The workbench's job config: one TOML file, typed sections, `--section.key value` overrides, validation.

torchtitan 0.3.0 configures jobs with Python registries instead of TOML, so this module is our own layer:
it reads the TOML the article shows (its field names accepted as written), lets every field be overridden on
the command line, validates everything *before* any process group starts, and `workbench.run.trainer`
translates the result into torchtitan's `Trainer.Config`.

Layout::

    [job] [model] [optimizer] [lr_scheduler] [training] [parallelism] [checkpoint] [profiling] [metrics]

The article's spellings map onto canonical fields (see `ALIASES`): `job.model_parallel_size` is the FSDP
shard degree (`parallelism.dp_shard`), `job.enable_checkpoint` -> `checkpoint.enable`,
`job.checkpoint_folder` -> `checkpoint.folder`, `training.batch_size` -> `training.local_batch_size`.

    sections.py   one dataclass per [section] with its own check; JobConfig, all of them; the article's ALIASES
    rules.py      the rules that join sections: each backend's (BACKEND_RULES), the device's (check_device)
    load.py       read_config (TOML + overrides), validate, load_config (both)
    cli.py        --section.key arguments, the --help text
"""

from workbench.core.config.cli import help_text, parse_cli
from workbench.core.config.load import load_config, read_config, valid_keys, validate
from workbench.core.config.rules import (
    BACKEND_RULES,
    FSDP_ONLY_BACKENDS,
    NKI_KERNEL_BACKENDS,
    check_device,
    resolved_dtype,
)
from workbench.core.config.sections import (
    ALIASES,
    BACKENDS,
    DEFAULT_BACKEND,
    MIN_PACK_WINDOW,
    SECTIONS,
    BackendName,
    Checkpoint,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Neuron,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
)

__all__ = [
    "ALIASES", "BACKENDS", "BACKEND_RULES", "DEFAULT_BACKEND", "FSDP_ONLY_BACKENDS", "MIN_PACK_WINDOW",
    "NKI_KERNEL_BACKENDS", "SECTIONS", "BackendName", "Checkpoint", "Job", "JobConfig", "LRScheduler", "Metrics",
    "Model", "Neuron", "Optimizer", "Parallelism", "Profiling", "Training", "check_device", "help_text",
    "load_config", "parse_cli", "read_config", "resolved_dtype", "valid_keys", "validate",
]
