"""The three training paths, each a function from the job config to a torchtitan `ModelSpec`.

    native          torchtitan's Qwen3 (dense and MoE)                          backends/native.py
    huggingface_v5  transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM        backends/huggingface_v5.py
    nki_moe         native Qwen3-MoE with experts computed blockwise (NKI)      backends/nki_moe.py

Everything else (launcher, TOML, data, optimizer, checkpoints, HF export) is shared.
"""

from __future__ import annotations

import importlib

from workbench.config import BACKENDS, JobConfig
from workbench.errors import ConfigError


def get(name: str):
    """The backend module for `name` (its config rules are `config.BACKEND_RULES[name]`)."""
    if name not in BACKENDS:
        raise ConfigError(f"Unknown backend {name!r}; choose one of {', '.join(BACKENDS)}.")
    return importlib.import_module(f"workbench.backends.{name}")  # one module per backend, named after it


def model_spec(job: JobConfig):
    """torchtitan ModelSpec of the job's backend and flavor."""
    return get(job.model.backend).model_spec(job, job.flavor_name, job.shape)
