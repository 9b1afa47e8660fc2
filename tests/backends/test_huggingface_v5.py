"""huggingface_v5: transformers' Qwen3 / Qwen3-MoE inside torchtitan's Trainer.

In-process: init covers every parameter and buffer deterministically, the HF key mapping writes what
`save_pretrained` writes, FLOPs match torchtitan's, unsupported options fail with a fix. Its launches (both CPU
configs learn, an exact resume, the export loads in transformers): tests/integration/test_training.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from workbench.platform import titan_device

titan_device.pin("cpu")

from workbench.backends import huggingface_v5 as hfv5  # noqa: E402
from workbench.core import flavors  # noqa: E402  (after the device is pinned)
from workbench.core.config import load_config  # noqa: E402
from workbench.core.errors import ConfigError  # noqa: E402
from workbench.model import materialize  # noqa: E402

DENSE, MOE = "configs/cpu_dense.toml", "configs/cpu_moe.toml"
BACKEND = ("--model.backend", "huggingface_v5")
SMALL_VOCAB = 512  # unit tests: the real 151936-row vocabulary only costs time here


def small(flavor: str, **changes) -> flavors.Qwen3Shape:
    return replace(flavors.get_shape(flavor), vocab_size=SMALL_VOCAB, **changes)


def build(job, shape: flavors.Qwen3Shape):
    """The huggingface_v5 model of `shape` as every path builds it: CPU, fp32, seeded init, eval mode."""
    return materialize(hfv5.model_config(job, shape), job.job.seed).eval()


def job_for(shape_flavor: str = "tiny", **model):
    return load_config(None, model={"flavor": shape_flavor, "backend": "huggingface_v5", **model},
                       training={"seq_len": 64})


# ------------------------------------------------------------------------------------------------
# In-process
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", ["tiny", "tiny-moe"])
def test_init_is_complete_and_deterministic(flavor):
    shape = small(flavor)
    a, b = (build(job_for(flavor), shape) for _ in range(2))
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # same seed, same weights
    buffers_a, buffers_b = dict(a.named_buffers()), dict(b.named_buffers())
    assert {k for k in buffers_a if k.endswith("inv_freq")} == {"hf.model.rotary_emb.inv_freq",
                                                               "hf.model.rotary_emb.original_inv_freq"}
    expected = 1.0 / shape.rope_theta ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim)
    for k in buffers_a:  # RoPE tables recomputed after to_empty (not left as garbage), identically
        assert torch.equal(buffers_a[k], buffers_b[k]) and torch.allclose(buffers_a[k], expected)
    assert all(torch.isfinite(p).all() for p in a.parameters())
    assert a.hf.lm_head.weight is a.hf.model.embed_tokens.weight  # tied flavors stay tied after to_empty
    logits = a(torch.randint(0, SMALL_VOCAB, (2, 16)))
    assert logits.shape == (2, 16, SMALL_VOCAB)


def test_init_names_a_tensor_it_cannot_initialise():
    model = build(job_for(), small("tiny"))
    model.hf.model.layers[0].extra = torch.nn.Module()
    model.hf.model.layers[0].extra.scale = torch.nn.Parameter(torch.empty(3))  # no transformers init rule
    with pytest.raises(RuntimeError, match=r"layers\.0\.extra\.scale"):
        model.init_weights()


@pytest.mark.parametrize("flavor,tied", [("tiny", True), ("tiny-moe", True), ("tiny-moe", False)])
def test_adapter_writes_what_save_pretrained_writes(flavor, tied, tmp_path):
    from safetensors.torch import load_file

    shape = small(flavor, tied=tied)
    model = build(job_for(flavor), shape)
    adapter = hfv5.hf_adapter(shape)
    hf_sd = adapter.to_hf(model.state_dict())
    model.hf.save_pretrained(tmp_path)  # transformers' own writer, default (published) format
    saved = load_file(tmp_path / "model.safetensors")
    assert set(hf_sd) == set(saved)
    assert all(torch.equal(hf_sd[k], saved[k]) for k in saved)
    # back: the published per-expert layout, and transformers' fused layout, both land on our keys
    back = adapter.from_hf(saved)
    in_memory = {k: v for k, v in model.hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    fused = adapter.from_hf(in_memory)
    ours = {k: v for k, v in model.state_dict().items() if not (tied and k == "hf.lm_head.weight")}
    for converted in (back, fused):
        assert set(converted) == set(ours) and all(torch.equal(converted[k], ours[k]) for k in ours)


@pytest.mark.parametrize("flavor", ["tiny-moe", "0.6B", "30B-A3B"])
def test_params_and_flops_match_torchtitan(flavor):
    shape = flavors.get_shape(flavor)
    with torch.device("meta"):
        ours = hfv5.HFQwen3.Config(shape=shape).build()
        titan_cfg = flavors.titan_model_config(shape)
        titan = titan_cfg.build()
    assert hfv5.nparams_and_flops(ours, shape, 4096) == titan_cfg.get_nparams_and_flops(titan, 4096)


def test_titan_moe_swap_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="hf_moe_implementation"):
        hfv5.model_spec(job_for("tiny-moe", hf_moe_implementation="titan"), "tiny-moe", small("tiny-moe"))


# ------------------------------------------------------------------------------------------------
# torchrun, 2 ranks
