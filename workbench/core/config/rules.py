"""The rules that join sections: each backend's, and the detected device's.

A backend's rules are plain functions of config values, here rather than in the backend modules (which import torch,
torchtitan and the kernels): validating a TOML imports no torch.
"""

from __future__ import annotations

from workbench.core.config.sections import JobConfig
from workbench.core.errors import ConfigError
from workbench.core.moe_blocks import kernel_block_size

FSDP_ONLY_BACKENDS = frozenset({"huggingface_v5"})
"""Paths without tensor parallelism (transformers' modeling: FSDP only, `check_huggingface_v5`)."""
NKI_KERNEL_BACKENDS = frozenset({"nki_moe"})
"""Paths whose experts run the NKI kernels on the neuron device (the torch reference elsewhere)."""


def check_huggingface_v5(job: JobConfig) -> None:
    """transformers' modeling: FSDP only, its own MoE block and attention."""
    m, par = job.model, job.parallelism
    if par.tp > 1 or par.ep > 1:
        raise ConfigError(f"huggingface_v5 supports FSDP (dp_shard / dp_replicate) only; got tp={par.tp}, ep={par.ep}: "
                          "set tp = ep = 1, or use --model.backend native.")
    if m.hf_moe_implementation != "hf":
        raise ConfigError(
            f"model.hf_moe_implementation={m.hf_moe_implementation!r} is not implemented: huggingface_v5 trains "
            "transformers' own Qwen3MoeSparseMoeBlock. Set model.hf_moe_implementation = \"hf\", or use "
            "--model.backend native for torchtitan's MoE."
        )
    if m.attn_backend != "sdpa":
        raise ConfigError("model.attn_backend applies to native/nki_moe; huggingface_v5 uses transformers' sdpa.")


def check_native(job: JobConfig) -> None:
    """None beyond the sections' own: native takes every [model] and [parallelism] option (tp, ep, attention
    backends, expert implementations)."""


def check_nki_moe(job: JobConfig) -> None:
    """A MoE model, a block size the NKI kernels take, blockwise experts, no expert parallelism."""
    from workbench.core import flavors

    m = job.model
    if not job.shape.is_moe:
        moe = [n for n, s in flavors.FLAVORS.items() if s.is_moe]
        raise ConfigError(
            f"model.backend=nki_moe replaces MoE expert layers, but flavor {m.flavor or m.hf_checkpoint!r} is dense. "
            f"Use a MoE flavor ({', '.join(moe)}) or --model.backend native."
        )
    # Checked on every device (a config that trains here must launch on trn2): the blocks
    # `kernel_block_size` splits into kernel blocks, the kernels' own rule.
    try:
        kernel_block_size(m.moe_block_size)
    except ValueError:
        raise ConfigError(f"model.moe_block_size={m.moe_block_size}: the NKI kernels take a block of at most 128 "
                          "slots or a multiple of 128 (docs/nki_kernels.md); 256 suits Qwen3-30B-A3B.") from None
    if m.moe_experts_impl != "grouped_mm":
        raise ConfigError(f"model.moe_experts_impl={m.moe_experts_impl!r} applies to native/huggingface_v5; nki_moe "
                          "computes its experts blockwise. Leave it at grouped_mm, or use --model.backend native.")
    if job.parallelism.ep > 1:
        raise ConfigError(f"parallelism.ep={job.parallelism.ep}: expert parallelism is only wired for the native "
                          "backend; set ep = 1 for nki_moe.")


BACKEND_RULES = {"huggingface_v5": check_huggingface_v5, "native": check_native, "nki_moe": check_nki_moe}
"""Backend name -> its config rules (run by `validate` after the model section's own checks); raise ConfigError
naming the fix."""


def check_device(cfg: JobConfig, device_kind: str) -> None:
    """The settings the detected device cannot run, refused before any process group (`validate` with the device).

    Raises:
        ConfigError: naming the setting, the device and the fix.
    """
    if cfg.model.attn_backend != "sdpa" and device_kind not in ("cuda", "neuron"):
        raise ConfigError(f"model.attn_backend={cfg.model.attn_backend!r} runs on CUDA and Neuron only "
                          f"(torchtitan's {cfg.model.attn_backend} attention); this device is {device_kind}: set "
                          "--model.attn_backend sdpa (block-causal with training.document_mask too).")


def resolved_dtype(cfg: JobConfig, device_kind: str) -> str:
    """training.dtype with 'auto' resolved for the device."""
    if cfg.training.dtype != "auto":
        return cfg.training.dtype
    return "float32" if device_kind == "cpu" else "bfloat16"
