"""workbench.memory.tracer: the per-rank memory plan traced from the real model (fake tensors, fake process group),
against one real step in this process (the tracked peak, and the c10 CPU allocator's own events), the nki_moe
kernels' buffers against the emulator's allocations, and the attention scores SDPA's math path keeps."""

from __future__ import annotations

import pytest
import torch

from tests.run_helpers import ROOT, assert_plan_close
from workbench.core.config import load_config
from workbench.memory import tables, tracer
from workbench.run import peak_memory

pytestmark = pytest.mark.machine_cpu_path  # quoted plans are fake-tensor traces: no CPU kernel runs (run_helpers.py)

TINY = ["--model.flavor", "tiny", "--training.seq_len", "256", "--training.local_batch_size", "2"]
MiB, GiB = 2**20, 2**30
MOE_TINY = ["--job.config_file", str(ROOT / "configs/cpu_moe.toml"), "--training.seq_len", "256",
            "--training.local_batch_size", "2", "--model.backend", "nki_moe"]


def test_plan_matches_real_step_one_rank():
    from benchmarks import plan_validation

    job = load_config(argv=TINY)
    planned = tracer.trace(job, "cpu", 1)
    measured = plan_validation.measure(TINY)
    assert_plan_close(planned, measured)
    # The logits dominate a tiny real-vocabulary model: 512 tokens x 151,936 x fp32 x (logits, log-softmax, grad).
    assert planned["categories"]["logits and loss"] >= 3 * 512 * 151_936 * 4 * 0.99
    assert planned["categories"]["optimizer state"] == pytest.approx(2 * planned["categories"]["sharded parameters"],
                                                                      rel=0.01)


def test_plan_against_the_c10_allocators_own_events_one_rank():
    """An oracle outside the planner: one real steady-state step of the same job (tiny dense, 1 rank, gloo), its
    peak from the c10 CPU allocator's own allocation/free events (torch.profiler) on top of the parameters,
    buffers and optimizer state alive before it (`AllocatorPeak`, what the first-launch check measures). Nothing
    on this side runs the planner's tracker or its categories. Plan / measured was 1.0000036 when written.
    The categories that are plain tensors of the model are checked against their own byte counts."""
    import torch.distributed as dist

    job = load_config(argv=TINY)
    planned = tracer.trace(job, "cpu", 1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        b = tracer.build(job, "cpu", 1, tracer.parallel_dims_for(job, "cpu", 1))
        tracer.warm_optimizer(b)
        model_bytes = sum(t.numel() * t.element_size() for t in (*b.model.parameters(), *b.model.buffers()))
        optimizer_bytes = sum(v.numel() * v.element_size() for opt in b.optimizers.optimizers
                              for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor))
        tokens = torch.randint(0, job.shape.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
        meter = peak_memory.AllocatorPeak("cpu", [b.model], b.optimizers)
        meter.start()
        tracer.training_step(b, tokens, tokens.roll(-1, 1))
        b.optimizers.step()
        b.optimizers.zero_grad(set_to_none=True)
        measured = meter.stop()
    finally:
        dist.destroy_process_group()
    assert abs(planned["peak_bytes"] / measured - 1) <= 0.02, (planned, measured)
    cats = planned["categories"]
    assert cats["sharded parameters"] == model_bytes and cats["optimizer state"] == optimizer_bytes
    # The peak is at the loss, before the backward made any gradient: fp32 logits, their log-softmax and its
    # gradient, [512 tokens, 151,936] each, by hand.
    assert cats["logits and loss"] == 3 * 512 * 151_936 * 4 and cats["gradients"] == 0


def test_nki_moe_kernel_buffers_equal_what_the_kernels_allocate_in_the_emulator(monkeypatch):
    """On trn2 the plan's nki_moe experts allocate, per kernel call, exactly the HBM tensors the real kernels
    allocate: the same step's shapes (T = 2 x 256 tokens, tiny-moe's experts, LNC 2, bf16) run through the real
    kernels in the emulator, whose allocation record is compared tensor by tensor and in bytes."""
    from tests.kernels.test_moe_kernels import make_case
    from workbench.kernels import blockwise_moe_nki
    from workbench.kernels.nki_emulator import counters

    job = load_config(argv=MOE_TINY)
    traced = tracer.trace(job, "trn2", 1)
    kernels = traced["nki_kernels"]
    assert {k: v["calls"] for k, v in kernels.items()} == {"moe_blockwise_fwd": 2, "moe_blockwise_bwd": 2}  # 2 layers
    s = job.shape
    case = make_case(2 * 256, s.top_k, s.num_experts, s.dim, s.moe_ffn_dim, dtype=torch.bfloat16)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(tables.DEVICES["trn2"].lnc))  # the compiler's LNC on trn2
    with counters() as c:
        out = blockwise_moe_nki(*case, block_size=job.model.moe_block_size)
        out.float().sum().backward()
    emulated = [[a.name, list(a.shape), str(a.dtype).removeprefix("torch."), a.output] for a in c.hbm_allocations]
    planned = kernels["moe_blockwise_fwd"]["allocations"] + kernels["moe_blockwise_bwd"]["allocations"]
    assert planned == emulated
    planned_bytes = sum(k["hbm_bytes_per_call"] for k in kernels.values())
    assert planned_bytes == sum(a.nbytes for a in c.hbm_allocations) > 3 * 8 * 64 * 64 * 4  # >= the fp32 dW
    on_cpu = load_config(argv=[*MOE_TINY, "--training.dtype", "bfloat16"])  # bf16: the fake grouped_mm's only dtype
    assert tracer.trace(on_cpu, "cpu", 1)["nki_kernels"] == {}  # off Neuron the torch reference runs: no kernels


def test_attention_without_a_fused_kernel_plans_the_math_scores():
    """On CPU SDPA runs its fused flash kernel (no S x S tensor); on trn2 none is known, so the plan traces the math
    path: every layer keeps its fp32 softmax [B, H, S, S] for backward (no activation checkpointing here)."""
    job = load_config(argv=TINY)
    on_cpu, on_trn2 = tracer.trace(job, "cpu", 1), tracer.trace(job, "trn2", 1)
    assert on_cpu["sdpa"]["kernel"] == "aten._scaled_dot_product_flash_attention_for_cpu"
    assert on_cpu["categories"]["attention scores"] == 0
    assert on_trn2["sdpa"]["kernel"].startswith("math") and "neuron" in on_trn2["sdpa"]["note"]
    s = job.shape
    scores = 2 * s.n_heads * 256 * 256 * 4  # one fp32 [B=2, H, S=256, S]
    assert on_trn2["categories"]["attention scores"] >= s.n_layers * scores
