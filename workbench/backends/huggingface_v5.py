"""Path 1: transformers' own `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`, trained by torchtitan's Trainer.

The modeling code is transformers 5.x, unchanged: attention through its "sdpa" function, the MoE layer is its
`Qwen3MoeSparseMoeBlock` (softmax router over all experts, top-k, renormalised; experts computed by the
"grouped_mm" experts implementation, see `EXPERTS_IMPLEMENTATION`). Only the seams torchtitan needs are ours:

  * `HFQwen3` — a torchtitan `BaseModel` holding the transformers model under the attribute `hf`, so every
    state-dict key is `"hf." + <the Hugging Face key>`. `forward(tokens, positions)` returns logits [B, S, V].
    `init_weights` re-runs transformers' own per-module init (`_init_weights`) after `to_empty()` and then
    proves that no parameter or buffer was left out (RoPE `inv_freq` included, the silent bug of older HF
    backends): everything is first filled with NaN and checked afterwards.
  * `parallelize` — FSDP2 over every decoder layer plus the root (embedding, final norm, lm_head: one group,
    so a tied embedding stays one shared parameter), mixed-precision params from
    `training.mixed_precision_param`, optional activation checkpointing / torch.compile per decoder layer.
  * `HFv5StateDictAdapter` — HF keys <-> our keys: strips/adds the "hf." prefix, drops/restores a tied
    `lm_head.weight`, and converts transformers' fused in-memory experts (`mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I]) to/from the published per-expert keys (`mlp.experts.N.gate_proj.weight`
    ...), which is what `save_pretrained` writes and what the native backend's adapter reads.

Packed documents (`training.document_mask`): transformers' sdpa gets the block-causal mask as an explicit 4-D
boolean mask (`workbench.backends.attention`), which transformers uses as given (it never infers packing from
`position_ids` then).

Devices: CPU (gloo) and CUDA use the same code. Neuron (TorchNeuron): transformers' sdpa path is plain
`torch.nn.functional.scaled_dot_product_attention` and `torch._grouped_mm` is listed as supported; written from
the docs, unverified (no Trainium here). Flex attention is never used.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from workbench.backends.moe_experts import HF_EXPERTS
from workbench.core import flavors
from workbench.core.config import JobConfig

PREFIX = "hf."
"""Attribute of `HFQwen3` holding the transformers model, as a state-dict key prefix."""

ATTN_IMPLEMENTATION = "sdpa"
"""transformers' attention function: plain SDPA (is_causal for our packed causal rows) on every device."""

EXPERTS_IMPLEMENTATION = "grouped_mm"
"""transformers' experts kernel for `Qwen3MoeExperts`. "grouped_mm" rather than "eager" on CPU too: it is
transformers' own default, it runs one `torch._grouped_mm` per projection instead of a Python loop over the
experts that received tokens (measured on tiny-moe fwd+bwd: 9.4 ms vs 11.7 ms per step, bit-identical logits),
its tokens-per-expert count has no host sync (histc), and it is the same kernel torchtitan's native MoE calls,
which keeps the two paths numerically close."""


# --------------------------------------------------------------------------------------------
# The transformers model
# --------------------------------------------------------------------------------------------


def hf_causal_lm(hf_cfg, *, experts_implementation: str = EXPERTS_IMPLEMENTATION):
    """Builds transformers' `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` from a config, fp32 parameters (random
    init on a real device, none on the meta device; reduced precision comes from FSDP's mixed-precision policy).

    Args:
        hf_cfg: `Qwen3Config` / `Qwen3MoeConfig` (e.g. `flavors.hf_config(shape)` or `AutoConfig.from_pretrained`).
            Not modified: `_from_config` mutates its argument, so it gets a deep copy.
        experts_implementation: transformers' experts kernel for MoE models ("grouped_mm", "eager", ...).
    """
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    cfg = copy.deepcopy(hf_cfg)
    if cfg.model_type == "qwen3_moe":
        return Qwen3MoeForCausalLM._from_config(
            cfg, attn_implementation=ATTN_IMPLEMENTATION, experts_implementation=experts_implementation,
            dtype=torch.float32,
        )
    if cfg.model_type == "qwen3":
        return Qwen3ForCausalLM._from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32)
    raise ValueError(f"huggingface_v5 builds Qwen3 only; got a config with model_type={cfg.model_type!r}.")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP parameters), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def init_hf_weights(hf_model: nn.Module) -> None:
    """Initialises every parameter and buffer of a materialised (e.g. after `to_empty`) transformers model.

    Uses transformers' own per-module rule (`_init_weights`: normal(0, initializer_range) for linears,
    embeddings, experts and router, ones for RMSNorm, RoPE `inv_freq` recomputed from the config), so the
    distribution is transformers'; determinism comes from the global (and, under FSDP, DTensor) RNG seeded by
    the trainer. Works on FSDP-sharded (DTensor) parameters.

    Raises:
        RuntimeError: a parameter or buffer that transformers' init did not write (it would otherwise hold
            whatever `to_empty` left in memory and make runs silently non-deterministic).
    """
    tensors = dict(hf_model.named_parameters())
    tensors.update(hf_model.named_buffers())
    tensors = {k: t for k, t in tensors.items() if t.is_floating_point()}  # Qwen3 holds no integer state
    for t in tensors.values():
        _local(t).fill_(float("nan"))  # poison: anything init does not write stays NaN
    for module in hf_model.modules():
        hf_model._init_weights(module)
    from torch._subclasses.fake_tensor import is_fake

    # Under fake tensors (workbench.plan) there are no values to check.
    missed = [name for name, t in tensors.items() if not is_fake(_local(t)) and torch.isnan(_local(t)).any()]
    if missed:
        raise RuntimeError(
            f"transformers' _init_weights left {len(missed)} tensor(s) uninitialised: {', '.join(missed[:8])}. "
            "Its rules do not cover their module type: initialise them in init_hf_weights "
            "(workbench/backends/huggingface_v5.py) after the _init_weights pass."
        )


class HFQwen3(BaseModel):
    """torchtitan model wrapping transformers' Qwen3 causal LM (attribute `hf`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        shape: flavors.Qwen3Shape
        """Architecture (translated with `flavors.hf_config`)."""
        experts_implementation: str = EXPERTS_IMPLEMENTATION
        """transformers' experts kernel for MoE flavors."""
        document_mask: bool = False
        """Packed documents never see each other: forward takes the block-causal mask (`attention.mask_kind`)."""

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            return nparams_and_flops(model, self.shape, seq_len)

    _skip_lm_head: bool = False
    """Set by torchtitan's Trainer with a chunked loss (`training.loss_chunks`): forward returns the final hidden
    states and `ChunkedLossWrapper` applies `lm_head` per sequence chunk (torchtitan's Decoder has the same flag)."""

    def __init__(self, config: Config):
        super().__init__()
        self.shape = config.shape
        self.hf = hf_causal_lm(flavors.hf_config(config.shape), experts_implementation=config.experts_implementation)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.hf.model.layers

    @property
    def lm_head(self) -> nn.Module:
        """transformers' output projection (what torchtitan's ChunkedLossWrapper applies per chunk)."""
        return self.hf.lm_head

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                attention_masks: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """Logits [B, S, vocab] of transformers' forward.

        Args:
            tokens: token ids [B, S].
            positions: RoPE positions [B, S] or [S] (default 0..S-1).
            attention_masks: bool [B, 1, S, S] (`attention.block_causal_mask`), handed to transformers as its 4-D
                attention mask; None: plain causal within each row.
        """
        if kwargs:
            raise TypeError(f"huggingface_v5 forward takes tokens, positions, attention_masks; got {sorted(kwargs)}.")
        if positions is not None and positions.dim() == 1:
            positions = positions.unsqueeze(0)
        args = dict(input_ids=tokens, position_ids=positions, attention_mask=attention_masks, use_cache=False)
        if self._skip_lm_head:
            return self.hf.model(**args).last_hidden_state
        return self.hf(**args).logits

    def verify_module_protocol(self) -> None:
        """transformers' submodules are plain `nn.Module`s by design (not torchtitan `Module`s); their
        initialisation is `init_states` below, which checks coverage itself."""

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        """Initialises every parameter and buffer (called by the trainer after `to_empty`).

        Args:
            buffer_device: unused; transformers' buffers (RoPE tables) live with the parameters.
        """
        del buffer_device
        _retie_embeddings(self.hf)
        init_hf_weights(self.hf)


def _retie_embeddings(hf_model: nn.Module) -> None:
    """Re-ties lm_head to the embedding when the config says so.

    `to_empty()` from the meta device gives every module a new Parameter of its own, which silently unties a
    tied lm_head (two matrices, trained apart). Under FSDP2 the shared parameter survives `to_empty`, and this
    is a no-op.
    """
    embedding = hf_model.model.embed_tokens.weight
    if not hf_model.config.tie_word_embeddings or hf_model.lm_head.weight is embedding:
        return
    if _local(embedding) is not embedding:
        raise RuntimeError(
            "FSDP holds the tied embedding and lm_head as two parameters; shard both in one group (the root) "
            "so they stay one parameter (see _apply_fsdp)."
        )
    hf_model.lm_head.weight = embedding


def nparams_and_flops(model: nn.Module, shape: flavors.Qwen3Shape, seq_len: int) -> tuple[int, int]:
    """(unique parameters, training FLOPs per token) as torchtitan counts them for the same shape.

    torchtitan's protocol asks every model for this pair; rather than keep a second formula here, ask
    torchtitan's own model of the shape (built on meta: no memory). The workbench's MFU uses one formula for
    every backend, `profiling.flops_per_token`, which the trainer sets in place of this value.
    """
    config = flavors.titan_model_config(shape)
    with torch.device("meta"):
        titan = config.build()
    return config.get_nparams_and_flops(titan, seq_len)


# --------------------------------------------------------------------------------------------
# Parallelism
# --------------------------------------------------------------------------------------------


def parallelize(model: HFQwen3, *, parallel_dims, training, parallelism, compile_config, ac_config,
                dump_folder) -> HFQwen3:
    """torchtitan `parallelize_fn`: activation checkpointing, compile, then FSDP2 (decoder layers + root).

    FSDP2 is applied on one rank too (as torchtitan does): it carries the mixed-precision policy.
    """
    if ac_config is not None:
        policy = ac_config.build(dump_folder=dump_folder)
        if type(policy) is SelectiveAC:
            policy = TransformersSelectiveAC(policy.config, dump_folder=dump_folder)
        # torchtitan's policy wraps every child of `<module>.layers`: transformers' Qwen3Model has exactly that.
        policy.apply(model.hf.model)
    if compile_config.enable and "model" in compile_config.components:
        for layer in model.decoder_layers:
            layer.compile(backend=compile_config.backend)
    _apply_fsdp(model, parallel_dims, training, parallelism)
    return model


class TransformersSelectiveAC(SelectiveAC):
    """torchtitan's selective activation checkpointing, except that `topk` outputs are recomputed, not saved.

    transformers' MoE router renormalises its top-k weights in place (`router_top_value /= ...sum()`), and SAC
    refuses a cached tensor that was mutated ("Tensor cached during selective activation checkpoint has been
    mutated"). Recomputing topk from the same saved inputs selects the same experts.
    """

    def get_save_ops(self) -> set:
        return {op for op in super().get_save_ops() if op != torch.ops.aten.topk.default}


def _apply_fsdp(model: HFQwen3, parallel_dims, training, parallelism) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.distributed import fsdp as titan_fsdp

    mesh = _fsdp_mesh(parallel_dims, parallelism)
    mp = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        cast_forward_inputs=False,
    )
    reshard = titan_fsdp.get_fsdp_reshard_after_forward_policy(parallelism.fsdp_reshard_after_forward, False)
    for layer in model.decoder_layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    # Root group: embedding, final norm, lm_head. A tied lm_head shares the embedding's Parameter, which FSDP2
    # accepts only inside one group, so they are not split into groups of their own.
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # Through the module attribute: workbench.platform.cpu_adjustments wraps it on CPU (gloo needs plain SUM reduction).
    titan_fsdp.disable_fsdp_gradient_division(model)


def _fsdp_mesh(parallel_dims, parallelism):
    """The data-parallel mesh FSDP2 shards over (2-D for HSDP); it exists at size 1 too.

    Parameters stay plain tensors until `fully_shard` (no SPMD-type annotations: transformers' modules have no
    torchtitan sharding configs), so FSDP gets the DP submesh itself rather than the full SPMD mesh + dims.
    The DP shard axis is called "fsdp" under torchtitan's partial_dtensor backend, "dp_shard" otherwise.
    """
    shard = "fsdp" if parallelism.spmd_backend == "partial_dtensor" else "dp_shard"
    return parallel_dims.get_mesh(["dp_replicate", shard] if parallel_dims.dp_replicate_enabled else [shard])


# --------------------------------------------------------------------------------------------
# State-dict interchange
# --------------------------------------------------------------------------------------------

_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class HFv5StateDictAdapter(StateDictAdapter):
    """Our keys ("hf." + transformers' in-memory keys) <-> the Hugging Face checkpoint format.

    `to_hf` writes what `save_pretrained` writes: no `lm_head.weight` when tied, experts per expert.
    `from_hf` accepts per-expert (published) or fused (`save_original_format=False`) expert keys, and never
    adds a tied `lm_head.weight`: the tied lm_head *is* the embedding parameter, filled through it.
    Both directions work on any subset of keys that holds all of one layer's experts (`workbench.hf_weights` converts
    one module at a time). Expert tensors must be full tensors (gather FSDP shards first); every other entry
    is only renamed, DTensors included.
    """

    def __init__(self, model_config: HFQwen3.Config, hf_assets_path: str | None = None):
        super().__init__(model_config, hf_assets_path)
        self.shape = model_config.shape

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        hf_sd: dict[str, Any] = {}
        for key, value in state_dict.items():
            if not key.startswith(PREFIX):
                raise KeyError(f"{key!r} is not a huggingface_v5 state-dict key (they start with {PREFIX!r}).")
            hf_key = key[len(PREFIX):]
            if hf_key == "lm_head.weight" and self.shape.tied:
                continue  # published tied checkpoints have no lm_head
            fused = _FUSED_EXPERTS.match(hf_key)
            if fused:
                hf_sd.update(_split_experts(fused.group(1), fused.group(2), _full(value, key)))
            else:
                hf_sd[hf_key] = value
        return hf_sd

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        per_expert: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
        for key, value in hf_state_dict.items():
            m = _PER_EXPERT.match(key)
            if m:
                per_expert.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = value
            else:
                sd[PREFIX + key] = value
        for prefix, projections in per_expert.items():
            sd.update({PREFIX + k: v for k, v in _merge_experts(prefix, projections, self.shape.num_experts).items()})
        return sd


def _full(value: torch.Tensor, key: str) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        raise NotImplementedError(
            f"{key} is an FSDP shard (DTensor); splitting experts needs the full tensor. Gather first with "
            "torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options="
            "StateDictOptions(full_state_dict=True))."
        )
    return value


def _split_experts(prefix: str, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' fused experts -> published per-expert 2-D weights (views; gate rows first in gate_up_proj)."""
    if name == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": value[e] for e in range(value.shape[0])}
    gate, up = value.chunk(2, dim=1)
    out = {}
    for e in range(value.shape[0]):
        out[f"{prefix}.{e}.gate_proj.weight"] = gate[e]
        out[f"{prefix}.{e}.up_proj.weight"] = up[e]
    return out


def _merge_experts(prefix: str, projections: dict[str, dict[int, torch.Tensor]], num_experts: int) -> dict:
    """Published per-expert weights of one layer -> transformers' fused `gate_up_proj` and `down_proj`."""
    stacked = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        got = projections.get(name, {})
        if sorted(got) != list(range(num_experts)):
            raise KeyError(
                f"{prefix}.N.{name}.weight: expected experts 0..{num_experts - 1}, found {sorted(got)}; the "
                "checkpoint does not match the model's num_experts."
            )
        stacked[name] = torch.stack([got[e] for e in range(num_experts)])
    return {
        f"{prefix}.gate_up_proj": torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1),
        f"{prefix}.down_proj": stacked["down_proj"],
    }


def hf_adapter(shape: flavors.Qwen3Shape) -> HFv5StateDictAdapter:
    """The HF <-> huggingface_v5 key mapping for a shape (used by `workbench.hf_weights` for load/export)."""
    return HFv5StateDictAdapter(HFQwen3.Config(shape=shape))


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def model_config(job: JobConfig, shape: flavors.Qwen3Shape) -> HFQwen3.Config:
    """The torchtitan model config for a job (validated by `config.check_huggingface_v5`)."""
    return HFQwen3.Config(shape=shape, experts_implementation=HF_EXPERTS[job.model.moe_experts_impl],
                          document_mask=job.training.document_mask)


def model_spec(job: JobConfig, flavor: str, shape: flavors.Qwen3Shape) -> ModelSpec:
    """torchtitan ModelSpec of this path (DCP checkpoints and resume need nothing else)."""
    return ModelSpec(
        name="qwen3_hf",
        flavor=flavor,
        model=model_config(job, shape),
        parallelize_fn=parallelize,
        pipelining_fn=None,
        post_optimizer_build_fn=None,  # no torchtitan MoE here: no expert-bias hook
        state_dict_adapter=HFv5StateDictAdapter,
    )


__all__ = [
    "HFQwen3", "HFv5StateDictAdapter", "hf_adapter", "hf_causal_lm", "init_hf_weights", "nparams_and_flops",
    "parallelize", "model_config", "model_spec", "PREFIX", "EXPERTS_IMPLEMENTATION",
]
