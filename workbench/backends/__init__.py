"""The three training paths, each a function from the job config to a torchtitan `ModelSpec`.

    native          torchtitan's Qwen3 (dense and MoE)                          backends/native.py
    huggingface_v5  transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM        backends/huggingface_v5.py
    nki_moe         native Qwen3-MoE with experts computed blockwise (NKI)      backends/nki_moe.py

Everything else (launcher, TOML, data, optimizer, checkpoints, HF export) is shared. Each backend module
satisfies `BackendModule`; its config rules are plain functions in `config.BACKEND_RULES` (validating a TOML imports
no backend, hence no torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from workbench.core.config import BACKENDS, JobConfig
from workbench.core.errors import ConfigError

if TYPE_CHECKING:
    from workbench.core.flavors import Qwen3Shape


@runtime_checkable
class BackendModule(Protocol):
    """What a backend module provides (tests/core/test_config.py checks each one)."""

    def model_config(self, job: JobConfig, shape: Qwen3Shape) -> Any:
        """The torchtitan-protocol model config (`build()`, `init_weights`) of the job's model."""

    def model_spec(self, job: JobConfig, flavor: str, shape: Qwen3Shape) -> Any:
        """torchtitan's `ModelSpec`: that model config plus parallelize function and state-dict adapter."""

    def hf_adapter(self, shape: Qwen3Shape) -> Any:
        """The state-dict key mapping: `to_hf(state_dict)` and `from_hf(hf_state_dict)` (used by
        `workbench.hf_weights`)."""


def get(name: str) -> BackendModule:
    """The backend module for `name`."""
    if name not in BACKENDS:
        raise ConfigError(f"Unknown backend {name!r}; choose one of {', '.join(BACKENDS)}.")
    return importlib.import_module(f"workbench.backends.{name}")  # one module per backend, named after it


def hf_adapter(name: str, shape: Qwen3Shape) -> Any:
    """The HF key mapping of backend `name` for `shape` (`BackendModule.hf_adapter`)."""
    return get(name).hf_adapter(shape)


def model_spec(job: JobConfig):
    """torchtitan ModelSpec of the job's backend and flavor."""
    return get(job.model.backend).model_spec(job, job.flavor_name, job.shape)
