"""Packed documents that never see each other: block-causal attention built from per-document positions.

A training row can pack several documents. The loader marks them by their RoPE positions, which restart at 0 at
each document's first token (`training.document_mask`; chat data always); a row's padded tail is one more
document. `document_boundaries` turns a batch's positions into explicit boundaries of fixed capacity (the same
shapes whatever the number of documents, so nothing recompiles per batch), and every attention kernel takes its
mask from them, on every backend and device (docs/attention.md says what is verified where):

    mask_kind  the model's attention                              what `attention_masks` builds
    dense      native/nki_moe `model.attn_backend = "sdpa"`       [B, 1, S, S], same document and key <= query,
                                                                  additive (0 / -inf) in the compute dtype
               (`BlockCausalSDPA`); huggingface_v5 (transformers'
               sdpa given the mask as an explicit 4-D mask)
    flex       torchtitan's FlexAttention (CUDA, Neuron)          BlockMask of a mask_mod over the document ids
    varlen     torchtitan's VarlenAttention (CUDA, Neuron)        VarlenMetadata, cu_seqlens of length B * S + 1
    None       torchtitan's SDPA (isolation off)                  nothing: SDPA's is_causal, as without packing

The trainer (`WorkbenchTrainer.post_dataloading_process`), the memory plan's traced step and the parity harness
all call `attention_masks`, so what is tested here is what trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torchtitan.models.common.attention import (
    FlexAttention,
    ScaledDotProductAttention,
    VarlenAttention,
    VarlenMetadata,
    create_attention_mask,
)

from workbench.backends.config_swap import swap_configs


@dataclass(frozen=True)
class Documents:
    """The documents of a batch of packed rows, in tensors whose shapes depend on [B, S] only.

    Attributes:
        ids: int32 [B, S]: each token's document within its row (0 = the row's first).
        cu_seqlens: int32 [B * S + 1]: where each document starts in the flattened batch, in order, then B * S
            repeated to the end (a row of S tokens holds at most S documents: one slot per token plus the end).
        max_seqlen: S, the longest a document can be (static: no device-to-host read).
    """

    ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


def document_boundaries(positions: torch.Tensor) -> Documents:
    """The documents of a batch from its RoPE positions ([B, S] or [S]): a document starts where its position
    is 0, and at every row's first token. Static shapes and no data-dependent ops (no `nonzero`)."""
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    B, S = positions.shape
    starts = positions == 0
    starts[:, 0] = True
    ids = torch.cumsum(starts, dim=1, dtype=torch.int32) - 1
    per_row = ids[:, -1] + 1
    first = torch.cumsum(per_row, 0, dtype=torch.int32) - per_row  # the global index of each row's first document
    T = B * S
    offsets = torch.arange(T, dtype=torch.int32, device=positions.device).view(B, S)
    cu_seqlens = torch.full((T + 1,), T, dtype=torch.int32, device=positions.device)
    # every document start writes its offset at its global index; other tokens write T into the last slot (T)
    index = torch.where(starts, ids + first[:, None], T).flatten().long()
    cu_seqlens.scatter_(0, index, torch.where(starts, offsets, T).flatten())
    return Documents(ids, cu_seqlens, S)


def block_causal_mask(docs: Documents, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """[B, 1, S, S]: query q may attend key k iff both are in the same document and k <= q.

    Args:
        dtype: bool (True = attend), or the attention's compute dtype: then additive, 0 or -inf. SDPA turns a bool
            mask into exactly that on every call, i.e. per layer, each copy kept for backward; built once in the
            compute dtype, one mask serves every layer.
    """
    ids = docs.ids
    S = ids.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=ids.device).tril()
    allowed = ((ids[:, :, None] == ids[:, None, :]) & causal).unsqueeze(1)
    if dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill_(~allowed, float("-inf"))


def document_mask_mod(docs: Documents):
    """FlexAttention's mask_mod of `block_causal_mask`, reading the document ids."""
    ids = docs.ids

    def block_causal(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx)

    return block_causal


def flex_block_mask(docs: Documents, block_size: int | tuple[int, int] = 128):
    """FlexAttention's BlockMask of the documents: torchtitan's compiled `create_attention_mask` on a device, as
    torchtitan builds its own; eager on CPU, where flex runs forward only (checks, never training)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, S = docs.ids.shape
    create = create_block_mask if docs.ids.device.type == "cpu" else create_attention_mask
    return create(document_mask_mod(docs), B, None, S, S, device=docs.ids.device, BLOCK_SIZE=block_size)


def varlen_metadata(docs: Documents) -> VarlenMetadata:
    """torchtitan's VarlenMetadata of fixed capacity: cu_seqlens of length B * S + 1 and max_seqlen S, in place of
    torchtitan's per-batch `create_varlen_metadata_for_document` (one length per batch's document count and a
    host read of the longest document)."""
    return VarlenMetadata(cu_seq_q=docs.cu_seqlens, cu_seq_k=docs.cu_seqlens, max_q=docs.max_seqlen,
                          max_k=docs.max_seqlen)


class BlockCausalSDPA(ScaledDotProductAttention):
    """torchtitan's SDPA inner attention given an explicit mask (`block_causal_mask`, built once per batch and
    shared by every layer); without one, plain causal. It keeps torchtitan's SDPA backend list, so the Neuron
    adjustment (SDPBackend.OVERRIDEABLE first) and the memory plan's math path apply to it as to the plain one."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: torch.Tensor | None = None, scale: float | None = None, enable_gqa: bool = False,
                **kwargs) -> torch.Tensor:
        if attention_masks is None:
            return super().forward(q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa)
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        with sdpa_kernel(self.sdpa_backends, set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks, scale=scale,
                                                 enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def use_block_causal_sdpa(model_cfg) -> int:
    """Swaps every torchtitan SDPA inner attention of a model config for `BlockCausalSDPA` (in place); flex and
    varlen take masks already. Returns how many were swapped."""
    return swap_configs(model_cfg, ScaledDotProductAttention.Config, BlockCausalSDPA.Config)


def mask_kind(model_config) -> str | None:
    """"dense", "flex", "varlen" or None (plain causal): the mask the model built from `model_config` takes."""
    attention = getattr(model_config, "first_attention", None)
    if attention is None:  # huggingface_v5: transformers' attention, given an explicit 4-D mask when isolating
        return "dense" if getattr(model_config, "document_mask", False) else None
    inner = attention.inner_attention
    if isinstance(inner, BlockCausalSDPA.Config):
        return "dense"
    if isinstance(inner, FlexAttention.Config):
        return "flex"
    if isinstance(inner, VarlenAttention.Config):
        return "varlen"
    return None


def attention_masks(model_config, positions: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> Any:
    """The `attention_masks` forward argument for a batch's positions, from `document_boundaries`; None when the
    model's attention is plain causal (or no positions are given). `dtype`: the attention's compute dtype (the
    dense mask is additive in it)."""
    kind = mask_kind(model_config)
    if kind is None or positions is None:
        return None
    docs = document_boundaries(positions)
    if kind == "dense":
        return block_causal_mask(docs, dtype)
    if kind == "flex":
        return flex_block_mask(docs, model_config.first_attention.inner_attention.block_size)
    return varlen_metadata(docs)


def forward_kwargs(model_config, positions: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Keyword arguments of a model forward on packed rows: positions (RoPE) and their attention masks."""
    if positions is None:
        return {}
    masks = attention_masks(model_config, positions, dtype)
    return {"positions": positions} if masks is None else {"positions": positions, "attention_masks": masks}


__all__ = ["Documents", "document_boundaries", "block_causal_mask", "document_mask_mod", "flex_block_mask",
           "varlen_metadata", "BlockCausalSDPA", "use_block_causal_sdpa", "mask_kind", "attention_masks",
           "forward_kwargs"]
