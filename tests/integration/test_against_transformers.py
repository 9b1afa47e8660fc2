"""Every backend against the original: transformers' own Qwen3 / Qwen3-MoE logits, through the production loader.

litgpt's `test_against_original_*` pattern: shrink the config, build transformers' model (seeded random init, and
random norm weights: `from_config` leaves them all 1.0, which hides a swapped norm), `save_pretrained` it, load
that directory with `workbench.load_model(..., backend=B, hf_checkpoint=dir)` (the notebooks' and the trainer's
loader, not the parity harness's) and `assert_close` the fp32 logits.
Dense and MoE, tied and untied embeddings; nki_moe replaces MoE layers only, so it has no dense case.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import workbench
from tests.run_helpers import randomize_norms_and_biases
from workbench.core import flavors
from workbench.platform import titan_device

titan_device.pin("cpu")  # the fp32 reference numerics (also on machines with an accelerator)

DENSE = flavors.Qwen3Shape(32, 2, 4, 2, head_dim=8, ffn_dim=48, vocab_size=512, max_seq_len=256)
MOE = flavors.Qwen3Shape(32, 2, 4, 2, head_dim=8, vocab_size=512, max_seq_len=256, num_experts=4, top_k=2,
                         moe_ffn_dim=16)
# fp32: measured max |diff| 0 (dense, and huggingface_v5, which runs transformers' own modules) and <= 9e-8
# (native / nki_moe MoE: grouped vs per-expert expert matmuls sum in another order). 1e-5 leaves 100x; the
# logits have std ~0.11, so a mis-mapped or missing weight is off by ~1e-1.
RTOL = ATOL = 1e-5
CASES = [(backend, kind, tied) for backend in ("native", "huggingface_v5", "nki_moe") for kind in ("dense", "moe")
         for tied in (False, True) if not (backend == "nki_moe" and kind == "dense")]


@pytest.mark.parametrize("backend,kind,tied", CASES, ids=[f"{b}-{k}-{'tied' if t else 'untied'}" for b, k, t in CASES])
def test_logits_match_transformers(backend, kind, tied, tmp_path):
    from transformers import AutoModelForCausalLM

    shape = replace(DENSE if kind == "dense" else MOE, tied=tied)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(flavors.hf_config(shape)).eval()
    drawn = randomize_norms_and_biases(reference)  # no norm weight left at 1.0: a swapped norm changes the logits
    assert {n.split(".")[-2] for n in drawn} == {"input_layernorm", "post_attention_layernorm", "q_norm", "k_norm",
                                                 "norm"}
    assert len(drawn) == 4 * shape.n_layers + 1
    if tied:
        assert reference.lm_head.weight is reference.model.embed_tokens.weight
    reference.save_pretrained(tmp_path)

    model = workbench.load_model(None, backend=backend, hf_checkpoint=tmp_path)
    assert model.workbench_info.backend == backend

    ids = torch.randint(0, shape.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids).logits
        got = model(ids)
    assert got.dtype == torch.float32 and got.shape == want.shape == (2, 24, shape.vocab_size)
    assert want.std() > 1e3 * ATOL  # logits far from zero, so the tolerance is tight relative to them
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
