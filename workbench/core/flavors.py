"""Qwen3 flavors declared as data, and their translation to torchtitan and Hugging Face configs.

A flavor is one `Qwen3Shape`: every number that fixes the architecture. The official shapes are the
published Qwen3 checkpoints (each one's `config.json` on the Hugging Face Hub, e.g. Qwen/Qwen3-0.6B, and torchtitan's
`qwen3_configs`, which tests/test_titan_guards.py compares against); the `tiny*` flavors are ours,
narrow and shallow so a CPU step takes a fraction of a second, but they keep the real 151936-token
vocabulary so the real Qwen3 tokenizer works unchanged.

Two consumers read a shape:
  * `titan_model_config(shape)` -> torchtitan's `Qwen3Model.Config` (native and nki_moe paths);
  * `hf_config(shape)`          -> transformers' `Qwen3Config` / `Qwen3MoeConfig` (huggingface_v5 path,
                                    and the `config.json` written on HF export).
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from workbench.core.errors import FlavorError, HFCheckpointError
from workbench.core.files import read_json
from workbench.core.schema import NULL, AnyOf, Bool, Choice, Int, ListOf, Num, Obj, check

QWEN3_VOCAB = 151936
MAX_LAYERS = 1024  # Qwen3-235B has 94; a deeper shape is refused before anything is estimated or built
_DIM, _HEADS, _FFN = Int(1, 65536), Int(1, 1024), Int(1, 1 << 20)
HF_CONFIG = Obj(
    {"model_type": Choice(("qwen3", "qwen3_moe")), "hidden_size": _DIM, "num_hidden_layers": Int(1, MAX_LAYERS),
     "num_attention_heads": _HEADS, "vocab_size": Int(1, 1 << 24)},
    {"num_key_value_heads": _HEADS, "head_dim": AnyOf((Int(1, 4096), NULL)), "tie_word_embeddings": Bool(),
     "rope_theta": Num(0.0, 1e12, low_open=True),
     "rope_parameters": AnyOf((Obj({}, {"rope_theta": Num(0.0, 1e12, low_open=True)}), NULL)),
     "max_position_embeddings": Int(1, 1 << 24), "intermediate_size": _FFN, "moe_intermediate_size": _FFN,
     "num_experts": Int(1, 4096), "num_local_experts": Int(1, 4096), "num_experts_per_tok": Int(1, 4096),
     "norm_topk_prob": Bool(), "decoder_sparse_step": Int(0, MAX_LAYERS), "mlp_only_layers": ListOf(Int(0))})
"""What the workbench reads of a Qwen3 `config.json`, with types and ranges (a published config passes)."""


@dataclass(frozen=True)
class Qwen3Shape:
    """Architecture numbers of one Qwen3 model.

    Attributes:
        dim: hidden size.
        n_layers: decoder layers.
        n_heads: query heads.
        n_kv_heads: key/value heads (GQA).
        head_dim: per-head width (128 in every official model, not dim / n_heads).
        ffn_dim: dense MLP width (dense models).
        vocab_size: embedding rows.
        tied: lm_head shares the embedding matrix.
        rope_theta: RoPE base.
        max_seq_len: longest sequence RoPE tables are built for.
        num_experts: routed experts per MoE layer (0 = dense model).
        top_k: experts per token.
        moe_ffn_dim: expert MLP width.
        official_params: published parameter count, for the sanity test (0 for our own flavors).
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int = 128
    ffn_dim: int = 0
    vocab_size: int = QWEN3_VOCAB
    tied: bool = False
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960
    num_experts: int = 0
    top_k: int = 0
    moe_ffn_dim: int = 0
    official_params: float = 0.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


# Official shapes: Qwen3 model cards / config.json of the published checkpoints.
FLAVORS: dict[str, Qwen3Shape] = {
    "0.6B": Qwen3Shape(1024, 28, 16, 8, ffn_dim=3072, tied=True, official_params=0.596e9),
    "1.7B": Qwen3Shape(2048, 28, 16, 8, ffn_dim=6144, tied=True, official_params=1.72e9),
    "4B": Qwen3Shape(2560, 36, 32, 8, ffn_dim=9728, tied=True, official_params=4.02e9),
    "8B": Qwen3Shape(4096, 36, 32, 8, ffn_dim=12288, official_params=8.19e9),
    "14B": Qwen3Shape(5120, 40, 40, 8, ffn_dim=17408, official_params=14.77e9),
    "32B": Qwen3Shape(5120, 64, 64, 8, ffn_dim=25600, official_params=32.76e9),
    "30B-A3B": Qwen3Shape(
        2048, 48, 32, 4, num_experts=128, top_k=8, moe_ffn_dim=768, official_params=30.53e9
    ),
    "235B-A22B": Qwen3Shape(
        4096, 94, 64, 4, num_experts=128, top_k=8, moe_ffn_dim=1536, rope_theta=5_000_000.0,
        official_params=235.09e9,
    ),
    # CPU flavors: ~0.1M (dense) / ~0.2M (MoE) non-embedding parameters; the 151936x64 embedding
    # (9.7M, tied) dominates. They exist to exercise every code path in well under a second per step.
    "tiny": Qwen3Shape(64, 2, 4, 2, head_dim=16, ffn_dim=192, tied=True, max_seq_len=4096),
    "tiny-moe": Qwen3Shape(
        64, 2, 4, 2, head_dim=16, tied=True, max_seq_len=4096, num_experts=8, top_k=2, moe_ffn_dim=64
    ),
}

NOT_QWEN3 = {
    "72B": "Qwen3 has no 72B model (72B is Qwen2/Qwen2.5). The largest dense Qwen3 is 32B; "
    "the MoE models are 30B-A3B and 235B-A22B.",
}


def get_shape(flavor: str) -> Qwen3Shape:
    """Looks up a flavor by name, with an error that lists the real ones."""
    if flavor in FLAVORS:
        return FLAVORS[flavor]
    known = ", ".join(FLAVORS)
    hint = NOT_QWEN3.get(flavor.upper())
    if hint is None:
        lowered = {name.lower(): name for name in FLAVORS}
        close = difflib.get_close_matches(flavor.lower(), list(lowered), n=1)
        hint = f"Did you mean {lowered[close[0]]!r}?" if close else ""
    raise FlavorError(f"Unknown Qwen3 flavor {flavor!r}. {hint} Valid flavors: {known}.".replace("  ", " "))


# --------------------------------------------------------------------------------------------
# torchtitan
# --------------------------------------------------------------------------------------------


def titan_model_config(
    shape: Qwen3Shape,
    *,
    attn_backend: str = "sdpa",
    moe_load_balance_coeff: float | None = 0.0,
):
    """Builds torchtitan's `Qwen3Model.Config` for a shape.

    Uses torchtitan's own Qwen3 layer builders (the same ones behind its registered flavors), so the
    modules, init and state-dict keys are exactly torchtitan's.

    Args:
        shape: the architecture.
        attn_backend: "sdpa" (plain causal attention; works on CPU, CUDA and Neuron), "flex" or
            "varlen" (torchtitan's masked backends; CUDA and Neuron, masks from `backends.attention`).
        moe_load_balance_coeff: torchtitan's aux-loss-free expert-bias update rate (torchtitan uses 1e-3);
            0/None disables it: Qwen3 / Hugging Face routing, the workbench default.
    """
    from torchtitan.models import qwen3 as tq
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention

    rope = CosSinRoPE.Config(dim=shape.head_dim, max_seq_len=shape.max_seq_len, theta=shape.rope_theta)
    # torchtitan refuses "sdpa" for language models because its loaders emit per-document positions
    # (block-causal masks). Our loader packs documents GPT-style into plain causal rows, for which SDPA's
    # is_causal is exact, and which Hugging Face's modeling code computes identically; with
    # training.document_mask the backend swaps in SDPA given the block-causal mask (backends.attention).
    builder_backend = "flex" if attn_backend == "sdpa" else attn_backend
    common = dict(
        n_layers=shape.n_layers, dim=shape.dim, n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads,
        head_dim=shape.head_dim, attn_backend=builder_backend, rope=rope, fuse_qkv=True,
    )
    if shape.is_moe:
        layers = tq._build_qwen3_moe_layers(
            moe_hidden_dim=shape.moe_ffn_dim, num_experts=shape.num_experts, top_k=shape.top_k,
            moe_comm_backend="standard", **common,
        )
        for layer in layers:
            layer.moe.load_balance_coeff = moe_load_balance_coeff or None
    else:
        layers = tq._build_qwen3_layers(hidden_dim=shape.ffn_dim, **common)
    if attn_backend == "sdpa":
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()

    return tq.Qwen3Model.Config(
        vocab_size=shape.vocab_size,
        dim=shape.dim,
        norm=tq._qwen3_norm(shape.dim),
        enable_weight_tying=shape.tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=shape.vocab_size, embedding_dim=shape.dim,
            # Tied: the lm_head init writes the shared matrix; initialising twice would double-draw.
            param_init=tq._EMBEDDING_SKIP_INIT if shape.tied else tq._EMBEDDING_INIT,
        ),
        lm_head=Linear.Config(in_features=shape.dim, out_features=shape.vocab_size, param_init=tq._LINEAR_INIT),
        layers=layers,
    )


def count_params(shape: Qwen3Shape) -> dict[str, int]:
    """Parameter counts of the torchtitan model built on the meta device (no memory used).

    Returns:
        {"total": all unique parameters, "embedding": embedding rows, "active": parameters touched per
        token (MoE: top_k of num_experts experts)}.
    """
    import torch

    with torch.device("meta"):
        model = titan_model_config(shape).build()
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".inner_experts." in n)
    active = total - expert + (expert * shape.top_k // shape.num_experts if shape.is_moe else 0)
    return {"total": total, "embedding": shape.vocab_size * shape.dim, "active": active}


def param_counts(shape) -> dict[str, int]:
    """Parameter counts of a Qwen3 shape, by formula (no model is built, torch is not imported).

    Same keys and numbers as `count_params` (which builds the torchtitan model on the meta device; a test checks
    they agree for every flavor): total, embedding, active (MoE: top_k of the experts).
    """
    d, hd = shape.dim, shape.head_dim
    attn = d * shape.n_heads * hd * 2 + d * shape.n_kv_heads * hd * 2 + 2 * hd  # q, o, k, v + q_norm, k_norm
    norms = 2 * d  # attention_norm, ffn_norm
    if shape.is_moe:
        experts = 3 * shape.num_experts * d * shape.moe_ffn_dim
        mlp, router = experts, d * shape.num_experts
    else:
        experts, mlp, router = 0, 3 * d * shape.ffn_dim, 0
    embedding = shape.vocab_size * d
    total = embedding * (1 if shape.tied else 2) + d + shape.n_layers * (attn + norms + mlp + router)
    per_layer_inactive = experts - (experts * shape.top_k // shape.num_experts if shape.is_moe else 0)
    return {"total": total, "embedding": embedding, "active": total - shape.n_layers * per_layer_inactive}


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------


def hf_config(shape: Qwen3Shape, **overrides: Any):
    """transformers' config object for a shape (`Qwen3Config` or `Qwen3MoeConfig`)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    kw: dict[str, Any] = dict(
        vocab_size=shape.vocab_size, hidden_size=shape.dim, num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_seq_len, rms_norm_eps=1e-6, tie_word_embeddings=shape.tied,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        attention_bias=False, hidden_act="silu", torch_dtype="float32",
    )
    if shape.is_moe:
        kw.update(
            intermediate_size=shape.moe_ffn_dim * shape.top_k, moe_intermediate_size=shape.moe_ffn_dim,
            num_experts=shape.num_experts, num_experts_per_tok=shape.top_k, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
        )
        kw.update(overrides)
        return Qwen3MoeConfig(**kw)
    kw.update(intermediate_size=shape.ffn_dim)
    kw.update(overrides)
    return Qwen3Config(**kw)


def shape_from_hf_config(cfg: dict[str, Any], where: str = "config.json") -> Qwen3Shape:
    """Reads a Qwen3 shape out of a `config.json` dict (v4 and v5 key spellings).

    Raises:
        ValueError: model_type is not qwen3 / qwen3_moe, a key of the wrong type or range (`HF_CONFIG`: the
            message names `where` and the key), or the config uses features our models lack.
    """
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if isinstance(cfg, dict) and model_type not in ("qwen3", "qwen3_moe"):
        raise ValueError(
            f"{where} has model_type={model_type!r}; the workbench trains Qwen3 only "
            "(model_type 'qwen3' or 'qwen3_moe')."
        )
    check(cfg, HF_CONFIG, where)
    needed = ("moe_intermediate_size", "num_experts_per_tok") if model_type == "qwen3_moe" else ("intermediate_size",)
    for key in needed:
        if key not in cfg:
            raise ValueError(f"{where}: {key} is missing")
    if model_type == "qwen3_moe" and "num_experts" not in cfg and "num_local_experts" not in cfg:
        raise ValueError(f"{where}: num_experts is missing")
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    kw = dict(
        dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        vocab_size=cfg["vocab_size"], tied=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=float(theta), max_seq_len=cfg.get("max_position_embeddings", 40960),
    )
    if model_type == "qwen3_moe":
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError(
                "This Qwen3-MoE config mixes dense and MoE layers (mlp_only_layers / decoder_sparse_step); "
                "only all-MoE models (every published Qwen3-MoE) are supported."
            )
        if not cfg.get("norm_topk_prob", True):
            raise ValueError("norm_topk_prob=false is not supported (published Qwen3-MoE models use true).")
        kw.update(
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts")),
            top_k=cfg["num_experts_per_tok"], moe_ffn_dim=cfg["moe_intermediate_size"],
        )
    else:
        kw.update(ffn_dim=cfg["intermediate_size"])
    if kw["n_heads"] % kw["n_kv_heads"]:
        raise ValueError(f"{where}: num_attention_heads ({kw['n_heads']}) is not a multiple of num_key_value_heads "
                         f"({kw['n_kv_heads']}), which grouped-query attention needs")
    if model_type == "qwen3_moe" and kw["top_k"] > kw["num_experts"]:
        raise ValueError(f"{where}: num_experts_per_tok ({kw['top_k']}) is over num_experts ({kw['num_experts']})")
    return Qwen3Shape(**kw)


def flavor_of(shape: Qwen3Shape) -> str | None:
    """The registered flavor name whose architecture equals `shape`, if any."""
    for name, known in FLAVORS.items():
        if _same_arch(known, shape):
            return name
    return None


def read_hf_shape(checkpoint_dir: str | Path) -> Qwen3Shape:
    """The shape described by `<checkpoint_dir>/config.json` (clear errors for a missing/odd file)."""
    d = Path(checkpoint_dir)
    cfg_file = d / "config.json"
    if not d.is_dir():
        raise FileNotFoundError(
            f"model.hf_checkpoint={str(d)!r} is not a directory (expected config.json + *.safetensors).")
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{str(d)!r} has no config.json; a Hugging Face checkpoint directory needs one.")
    try:
        return shape_from_hf_config(read_json(cfg_file), str(cfg_file))
    except OSError as e:  # a FIFO or device named config.json, unreadable bytes
        raise HFCheckpointError(f"{cfg_file} cannot be read: {e}.") from None


def resolve(flavor: str, hf_checkpoint: str = "") -> tuple[str, Qwen3Shape]:
    """(flavor name, shape) for a job: from the flavor, from the checkpoint's config.json, or both (must agree).

    A checkpoint whose shape is no registered flavor (e.g. a tiny test model) gets the name "custom".
    """
    if not hf_checkpoint:
        return flavor, get_shape(flavor)
    shape = read_hf_shape(hf_checkpoint)
    if flavor:
        expected = get_shape(flavor)
        if not _same_arch(expected, shape):
            diff = {k: (v, getattr(shape, k)) for k, v in describe(expected).items()
                    if k != "max_seq_len" and getattr(shape, k) != v}
            raise ValueError(
                f"model.flavor={flavor!r} disagrees with {hf_checkpoint}/config.json on "
                + ", ".join(f"{k} (flavor {a}, checkpoint {b})" for k, (a, b) in diff.items())
                + ". Remove model.flavor to take the checkpoint's shape."
            )
        return flavor, replace(shape, official_params=expected.official_params)
    return flavor_of(shape) or "custom", shape


def _same_arch(a: Qwen3Shape, b: Qwen3Shape) -> bool:
    return replace(a, official_params=0.0, max_seq_len=0) == replace(b, official_params=0.0, max_seq_len=0)


def describe(shape: Qwen3Shape) -> dict[str, Any]:
    """Plain dict of a shape (for tables and the resolved config)."""
    return {k: v for k, v in asdict(shape).items() if k != "official_params"}


__all__ = [
    "FLAVORS", "Qwen3Shape", "get_shape", "titan_model_config", "count_params",
    "hf_config", "shape_from_hf_config", "flavor_of", "describe", "read_hf_shape", "resolve",
]
