"""`model.moe_experts_impl`: the fallbacks without torch._grouped_mm equal grouped_mm (outputs and gradients, fp32)."""

from __future__ import annotations

import pytest
import torch

import workbench
from workbench.backends.moe_experts import HF_EXPERTS, FallbackGroupedExperts, grouped_mm

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["batched_mm", "loop"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 7, 0], [2, 2, 2, 2]], ids=["uneven", "one-group", "even"])
def test_grouped_mm_fallback_equals_grouped_mm(impl, counts):
    g = torch.Generator().manual_seed(0)
    rows, groups, d, f = sum(counts) + 2, len(counts), 8, 12  # 2 rows past the last group, as padding leaves them
    A = torch.randn(rows, d, generator=g, requires_grad=True)
    B_t = torch.randn(groups, d, f, generator=g, requires_grad=True)
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    w = torch.randn(rows, f, generator=g)

    ref = torch._grouped_mm(A, B_t, offs=offs)
    ref_grads = torch.autograd.grad((ref[: sum(counts)] * w[: sum(counts)]).sum(), (A, B_t))
    out = grouped_mm(A, B_t, offs, impl)
    grads = torch.autograd.grad((out[: sum(counts)] * w[: sum(counts)]).sum(), (A, B_t))

    n = sum(counts)
    torch.testing.assert_close(out[:n], ref[:n], **TOL)
    assert out[n:].abs().max() == 0  # rows outside every group stay zero
    # (torch._grouped_mm's CPU backward writes non-zero gradients into those rows although no output depends on
    # them, so they are not compared; torchtitan never passes such rows without expert parallelism)
    torch.testing.assert_close(grads[0][:n], ref_grads[0][:n], **TOL)
    assert grads[0][n:].abs().max() == 0
    torch.testing.assert_close(grads[1], ref_grads[1], **TOL)


def _logits_and_grads(backend: str, impl: str):
    torch.manual_seed(0)
    job = workbench.load_config("configs/cpu_moe.toml", model={"backend": backend, "moe_experts_impl": impl})
    model = workbench.load_model(job, backend=backend)
    if backend == "native":  # the swap really happened (grouped_mm keeps torchtitan's own class)
        assert any(isinstance(m, FallbackGroupedExperts) for m in model.modules()) == (impl != "grouped_mm")
    else:
        assert model.hf.config._experts_implementation == HF_EXPERTS[impl]
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    logits.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and "expert" in n}
    assert grads, "no expert parameter received a gradient"
    return logits.detach(), grads


@pytest.mark.parametrize("backend", ["native", "huggingface_v5"])
@pytest.mark.parametrize("impl", ["batched_mm", "loop"])
def test_model_fallback_experts_equal_grouped_mm(backend, impl):
    """The whole tiny-moe model: logits and every expert-weight gradient equal the grouped_mm model's."""
    ref_logits, ref_grads = _logits_and_grads(backend, "grouped_mm")
    logits, grads = _logits_and_grads(backend, impl)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_nki_moe_rejects_experts_impl():
    with pytest.raises(workbench.core.errors.ConfigError, match="nki_moe computes its experts blockwise"):
        workbench.load_config("configs/cpu_moe.toml", model={"backend": "nki_moe", "moe_experts_impl": "loop"})
