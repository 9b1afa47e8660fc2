"""Path 2: torchtitan's own Qwen3 (dense and MoE), parallelized by torchtitan (FSDP2 / TP / EP)."""

from __future__ import annotations

from dataclasses import replace

from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.models.qwen3 import parallelize_qwen3
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from workbench.backends.attention import use_block_causal_sdpa
from workbench.backends.moe_experts import use_fallback_experts
from workbench.core import flavors
from workbench.core.config import JobConfig


def model_config(job: JobConfig, shape: flavors.Qwen3Shape):
    """torchtitan Qwen3Model.Config for the job (attention backend, MoE balancing and experts impl from [model];
    with `training.document_mask`, SDPA takes the block-causal mask: `attention.BlockCausalSDPA`)."""
    cfg = flavors.titan_model_config(
        shape, attn_backend=job.model.attn_backend, moe_load_balance_coeff=job.model.moe_load_balance_coeff
    )
    use_fallback_experts(cfg, job.model.moe_experts_impl)
    if job.training.document_mask:
        use_block_causal_sdpa(cfg)
    return cfg


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


class HFAdapter:
    """torchtitan Qwen3 state-dict keys <-> Hugging Face Qwen3 keys, wrapping torchtitan's `Qwen3StateDictAdapter`.

    The HF side is the published on-disk layout: separate q/k/v projections and per-expert
    `mlp.experts.E.{gate,up,down}_proj.weight`. torchtitan's adapter does the renaming and the expert
    stacking/splitting; the model's fused QKV is split/merged by its own state-dict hooks, so the titan side
    here is `model.state_dict()` (wq/wk/wv), not the parameters.

    Both directions work on any subset of keys (the HF loader converts one layer at a time). That is why the
    wrapped adapter is built from an *untied* config: torchtitan's tied `from_hf` insists on seeing the
    embedding in every call. Tying is instead expressed by `to_hf` never emitting `lm_head.weight` (published
    tied checkpoints have none), and the loader fills the tied lm_head through the shared parameter.
    """

    def __init__(self, shape: flavors.Qwen3Shape):
        self.tied = shape.tied
        untied = flavors.titan_model_config(replace(shape, tied=False))
        self._titan = Qwen3StateDictAdapter(untied, hf_assets_path=None)

    def to_hf(self, state_dict: dict) -> dict:
        """titan keys -> HF keys (experts split per expert; tied lm_head dropped; buffers HF lacks dropped)."""
        hf = self._titan.to_hf(state_dict)
        if self.tied:
            hf.pop("lm_head.weight", None)
        return hf

    def from_hf(self, hf_state_dict: dict) -> dict:
        """HF keys -> titan keys; every expert of a layer must be in the same call (they are stacked)."""
        return self._titan.from_hf(dict(hf_state_dict))


def hf_adapter(shape: flavors.Qwen3Shape) -> HFAdapter:
    """How this backend's state-dict keys map to Hugging Face keys (used by `workbench.hf_weights`)."""
    return HFAdapter(shape)
