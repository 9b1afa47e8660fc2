"""Swapping one module config for another inside a torchtitan model config: the one way a backend changes a module
of torchtitan's Qwen3 (nki_moe's blockwise experts, `model.moe_experts_impl`'s fallback experts)."""

from __future__ import annotations

import dataclasses


def swap_configs(model_cfg, old_cls: type, new_cls: type, **extra) -> int:
    """Replaces every `old_cls` config in `model_cfg` (torchtitan's `traverse`) by a `new_cls` config with the same
    init fields plus `extra`, in place.

    Returns:
        How many were replaced.
    """
    swapped = 0
    for _, sub, parent, attr in list(model_cfg.traverse(old_cls)):
        fields = {f.name: getattr(sub, f.name) for f in dataclasses.fields(sub) if f.init}
        new = new_cls(**fields, **extra)
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
        swapped += 1
    return swapped
