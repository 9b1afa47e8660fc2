"""Python API for notebooks: a ready-to-run model from a config (and HF weights), and its HF export.

    model = load_model("configs/cpu_dense.toml")                          # seeded random init
    model = load_model(None, hf_checkpoint="path/to/Qwen3-0.6B")          # published weights, shape from config.json
    logits = model(input_ids)                                             # [B, S, vocab]
    export_hf(model, "out/")                                              # config.json + safetensors + tokenizer

Models are built on CPU in fp32 and put in eval mode (the reference numerics; move them with `.to()`).
Any backend works: its ModelSpec's model config is built on meta, materialised on CPU and initialised (seeded).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path

import torch

from workbench.core import flavors
from workbench.core.config import BACKEND_RULES, DEFAULT_BACKEND, JobConfig, load_config
from workbench.core.errors import ConfigError


def _job(config: JobConfig | str | os.PathLike | None, backend: str, hf_checkpoint) -> JobConfig:
    """A private copy of the job config with the backend and checkpoint of this call."""
    if config is None:
        job = JobConfig()
    elif isinstance(config, JobConfig):
        job = copy.deepcopy(config)
    else:
        job = load_config(config)
    job.model.backend = backend
    if hf_checkpoint is not None:
        job.model.hf_checkpoint = str(hf_checkpoint)
    if not job.model.flavor and not job.model.hf_checkpoint:
        raise ConfigError(f"load_model needs a flavor (model.flavor, one of {', '.join(flavors.FLAVORS)}) "
                          "or hf_checkpoint=DIR to take the shape from its config.json.")
    BACKEND_RULES[backend](job)  # e.g. nki_moe on a dense model; parallel degrees do not apply here
    return job


def _pin_device(job: JobConfig) -> None:
    """torchtitan must be pinned to a device before it is imported (on CPU: the CPU adjustments)."""
    from workbench.platform import device, titan_device

    titan_device.pin(titan_device.pinned_kind() or device.detect(job.job.device).kind)


def materialize(model_config, seed: int | None, parallelize: Callable | None = None) -> torch.nn.Module:
    """The one model builder: a torchtitan-protocol model config built on the meta device, parallelized there
    (optional), materialised on CPU, seeded and initialised by the model's own `init_weights`.

    Every backend's model config follows torchtitan's protocol (huggingface_v5 wraps transformers' model in one),
    so this serves all three, the planner (which traces it under fake tensors) and the tests.

    Args:
        model_config: the ModelSpec's `model` (`backends.model_spec(job).model`).
        seed: seeds torch's RNG right before the init; None leaves it as it is.
        parallelize: applied to the meta model (FSDP/TP wrap), as torchtitan's Trainer does before `to_empty`.
    """
    with torch.device("meta"):
        model = model_config.build()
    if parallelize is not None:
        model = parallelize(model)
    model.to_empty(device="cpu")
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def build_model(job: JobConfig) -> torch.nn.Module:
    """The job's model with seeded random weights, fp32 on CPU, in eval mode (no checkpoint is read).

    Every backend's ModelSpec holds a torchtitan-protocol model config (huggingface_v5 wraps transformers'
    model in one), so one builder serves all three. The model carries `workbench_info` (backend, shape, config,
    tokenizer) for HF load and export.
    """
    from workbench import backends, hf_weights

    _pin_device(job)
    spec = backends.model_spec(job)
    model = materialize(spec.model, job.job.seed).float().eval()
    model.workbench_info = hf_weights.ModelInfo(job.model.backend, job.shape, spec.model, job.model.tokenizer_path)
    return model


def load_model(config: JobConfig | str | os.PathLike | None = None, backend: str | None = None,
               hf_checkpoint: str | os.PathLike | None = None, step: int | None = None) -> torch.nn.Module:
    """A model whose `forward(input_ids)` returns logits [B, S, vocab]: fp32, CPU, eval mode.

    Args:
        config: a JobConfig (`workbench.load_config`), a TOML path, a run folder (its config.toml and the weights of
            its DCP checkpoint), or None (then `hf_checkpoint` gives the shape).
        backend: "native", "huggingface_v5" or "nki_moe"; None = native (a run folder: the run's own).
        hf_checkpoint: a Hugging Face directory (config.json + *.safetensors) to load; overrides
            `model.hf_checkpoint` of the config. Its config.json must agree with `model.flavor` if both are set.
        step: a run folder's checkpoint step; None = the newest.

    Raises:
        ConfigError: neither a flavor nor a checkpoint.
        NotImplementedError: an unsupported backend.
        workbench.core.errors.HFCheckpointError: a checkpoint that cannot be loaded (the message names the fix).
        workbench.core.errors.CheckpointError: a run folder's checkpoint is damaged, or asks to run code
            (`UnsafeCheckpointError`: refused unrun).
    """
    from workbench import hf_weights

    if isinstance(config, (str, os.PathLike)) and Path(config).is_dir():
        return load_run(Path(config), backend, step)[0]
    job = _job(config, backend or DEFAULT_BACKEND, hf_checkpoint)
    model = build_model(job)
    if job.model.hf_checkpoint:
        hf_weights.load_into_model(model, job.model.hf_checkpoint)
    return model


def load_run(run: Path, backend: str | None = None, step: int | None = None, step_dir: Path | None = None):
    """A run folder's model with the weights of one DCP checkpoint (hashed and allowlisted before any is parsed).

    Args:
        run: the run folder (its `config.toml` fixes the model and backend).
        backend: None or the run's own backend (a DCP checkpoint loads into the backend that wrote it).
        step: the checkpoint step (None = the newest complete one); ignored when `step_dir` is given.
        step_dir: a `step-N/` directory of this run to load instead.

    Returns:
        (model, the run's JobConfig, the step directory loaded).

    Raises:
        ConfigError: another backend, or no such checkpoint (the message lists the steps there are).
    """
    from workbench.run.checkpoint import load_dcp_model_state
    from workbench.run.run_folder import read_config
    from workbench.run.run_folder import step_dir as find_step_dir

    job = read_config(run)
    if backend not in (None, job.model.backend):
        raise ConfigError(f"{run} was trained with backend {job.model.backend!r}; its DCP checkpoint loads into that "
                          f"backend, not {backend!r}. Export it (python -m workbench.hf_export --run {run} --out DIR) "
                          f"and load DIR with hf_checkpoint=DIR to change backends.")
    if step_dir is None:
        try:
            step_dir = find_step_dir(run, job.checkpoint.folder, step)
        except FileNotFoundError as e:
            raise ConfigError(f"{e} Or use its Hugging Face export ({run / 'hf'}) if it has one.") from None
    model = build_model(job)
    load_dcp_model_state(model, step_dir)
    return model, job, step_dir


def export_hf(model: torch.nn.Module, out_dir: str | os.PathLike, *, dtype: str | torch.dtype | None = None,
              overwrite: bool = False, tokenizer_path: str | None = None) -> Path:
    """Writes a model from `load_model` as a Hugging Face directory (config.json, safetensors, tokenizer).

    Args:
        model: the model.
        out_dir: the directory to create (refused if it exists, unless `overwrite`).
        dtype: "float32" / "bfloat16" / "float16"; None = the model's dtype.
        overwrite: replace an existing directory (atomically).
        tokenizer_path: tokenizer directory to copy; None = the model's `model.tokenizer_path`.
    """
    from workbench import hf_weights

    return hf_weights.export_model(model, out_dir, dtype=dtype, overwrite=overwrite, tokenizer_path=tokenizer_path)


__all__ = ["load_model", "load_run", "build_model", "materialize", "export_hf"]
