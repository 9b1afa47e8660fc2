"""Path 2: torchtitan's own Qwen3 (dense and MoE), parallelized by torchtitan (FSDP2 / TP / EP)."""

from __future__ import annotations

from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.models.qwen3 import parallelize_qwen3
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from workbench import flavors
from workbench.config import JobConfig


def model_config(job: JobConfig, shape: flavors.Qwen3Shape):
    """torchtitan Qwen3Model.Config for the job (attention backend and MoE balancing from [model])."""
    return flavors.titan_model_config(
        shape, attn_backend=job.model.attn_backend, moe_load_balance_coeff=job.model.moe_load_balance_coeff
    )


def model_spec(job: JobConfig, flavor: str, shape: flavors.Qwen3Shape) -> ModelSpec:
    return ModelSpec(
        name="qwen3",
        flavor=flavor,
        model=model_config(job, shape),
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=None,
        post_optimizer_build_fn=register_moe_load_balancing_hook,
        state_dict_adapter=Qwen3StateDictAdapter,
    )
