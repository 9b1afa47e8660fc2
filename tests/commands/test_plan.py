"""workbench.plan: the per-rank memory plan traced from the real model (fake tensors, fake process group).

Validation against real runs: the plan of a one-rank tiny step equals the same step measured with real tensors
over gloo (within 15% overall and per category; benchmarks/plan_validation.py has the full table), a two-rank
case through torchrun, re-planned suggestions, bad input, and every shipped trn2 config fitting 24 GiB per rank
with >= 10% headroom under each backend it names, as its comment quotes.

What a trn2 rank holds beyond a CPU trace: the nki_moe kernels' own HBM tensors (equal to what the real kernels
allocate in the emulator), SDPA's math-path scores where no fused kernel is known, the device runtime's reserve.
The first-launch check (measured peak per rank after steps 1 and 2 against the plan) runs on CPU itself and
through the neuron stand-in; its cuda/neuron branch (torch.<device>.max_memory_allocated) has run nowhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workbench import plan
from workbench.core.config import load_config
from workbench.memory import measure, report, tables, tracer

pytestmark = pytest.mark.machine_cpu_path  # quoted plans are fake-tensor traces: no CPU kernel runs (run_helpers.py)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.flavor", "tiny", "--training.seq_len", "256", "--training.local_batch_size", "2"]
MiB, GiB = 2**20, 2**30


def _close(planned: dict, measured: dict, tol: float = 0.15) -> None:
    assert abs(planned["peak_bytes"] / measured["peak_bytes"] - 1) <= tol, (planned, measured)
    for cat, real in measured["categories"].items():
        if real > 0.02 * measured["peak_bytes"]:  # categories that matter to the peak
            assert abs(planned["categories"][cat] / real - 1) <= tol, (cat, planned["categories"], measured)


def test_plan_matches_real_step_one_rank():
    from benchmarks import plan_validation

    job = load_config(argv=TINY)
    planned = tracer.trace(job, "cpu", 1)
    measured = plan_validation.measure(TINY)
    _close(planned, measured)
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
        meter = measure.AllocatorPeak("cpu", [b.model], b.optimizers)
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


@pytest.mark.slow
def test_plan_matches_real_step_moe_nki_moe():
    """MoE (tiny-moe, bf16 as on the device) through the nki_moe path: blockwise experts, static-shape block plan."""
    from benchmarks import plan_validation

    planned, measured = plan_validation.run_case(1, [*plan_validation.MOE_BF16, *plan_validation.COMMON,
                                                     "--model.backend", "nki_moe"])
    _close(planned, measured)


@pytest.mark.slow
def test_plan_matches_real_step_two_ranks():
    from benchmarks import plan_validation

    planned, measured = plan_validation.run_case(2, [*TINY, "--model.backend", "huggingface_v5"])
    _close(planned, measured)
    assert planned["world_size"] == 2


def test_not_fitting_is_replanned_with_a_working_change(monkeypatch, capsys):
    base = tracer.trace(load_config(argv=TINY), "cpu", 1)["peak_bytes"]
    # A device just too small for the plain loss: the planner must find (by re-planning) what fits. The re-plans
    # run in this process, where the patched device exists.
    monkeypatch.setitem(tables.DEVICES, "trn2", tables.Device("cpu", 0.8 * base))
    monkeypatch.setattr(tracer, "plan_in_subprocess", lambda job, device, world, reserve_gib=None: report.plan(
        job, device, world, suggest=False, reserve_gib=reserve_gib))
    p = report.plan(load_config(argv=TINY), "trn2", 1)
    assert not p["fits"] and p["peak_bytes"] == base
    good = [s for s in p["suggestions"] if s["fits"]]
    assert good and good[-1]["peak_bytes"] < 0.8 * base
    assert "loss_chunks" in p["suggestions"][0]["change"]
    assert "DOES NOT FIT" in report.render(p) and good[-1]["change"] in report.render(p)
    # What to change: the largest category first, the tensors that make it at the peak (the logits' [tokens, vocab]
    # fp32 tensors) and its lever, whose saving is the re-planned peak (the suggestion's trace, reused).
    first = p["advice"][0]
    assert first["category"] == "logits and loss" and first["change"] == p["suggestions"][0]["change"]
    assert first["peak_bytes_after"] == p["suggestions"][0]["peak_bytes"] < p["peak_bytes"]
    assert first["top"][0]["shape"][-1] == 151_936 and first["top"][0]["dtype"] == "float32"
    assert sum(t["bytes"] for t in first["top"]) <= first["bytes"]
    # "other temporaries" is exactly the sum of its parts, and the rendered table shows them
    assert sum(p["other_parts"].values()) == p["categories"]["other temporaries"]
    text = report.render(p)
    for part in tables.OTHER_PARTS:
        assert f"  - {part}" in text
    unit = "GiB" if p["peak_bytes"] >= GiB else "MiB"
    assert f"saves {report.amount(p['peak_bytes'] - first['peak_bytes_after'], unit)} {unit}, re-planned" in text
    err = capsys.readouterr().err
    assert "tracing one training step" in err and "initial_load_model_only" not in err and "DTensor" not in err


def test_bad_input(capsys):
    assert plan.main(["--device", "tpu", *TINY]) == 2
    assert "trn2, h100, h200, cpu" in capsys.readouterr().err
    # Parallel degrees that do not fit --nproc: the training launcher's own message.
    assert plan.main(["--job.config_file", str(ROOT / "configs/trn2_qwen3_30b_a3b.toml"), "--nproc", "3"]) == 2
    assert "Parallel degrees do not fit 3 rank(s)" in capsys.readouterr().err
    assert plan.main(["--model.flavor", "72B"]) == 2
    assert "model.flavor" in capsys.readouterr().err
    assert plan.main(["--reserve-gib", "-1", *TINY]) == 2
    assert "--reserve-gib -1.0: give the device runtime's share in GiB, >= 0." in capsys.readouterr().err


SHIPPED = {  # config -> (backends its header quotes, those re-planned here: ~20-40 s of CPU each; every backend
    # is re-planned in one config at least, nki_moe in the 30B-A3B recipe)
    "trn2_qwen3_8b.toml": (["native"], ["native"]),
    "qwen3_trainium.toml": (["native", "nki_moe", "huggingface_v5"], ["huggingface_v5"]),
    "trn2_qwen3_30b_a3b.toml": (["native", "nki_moe"], ["nki_moe"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(SHIPPED))
def test_shipped_trn2_configs_fit(config):
    """Every backend a shipped config quotes in its header fits 24 GiB with >= 10% headroom, the Neuron runtime's
    share, SDPA's math path and (nki_moe) the kernels' own buffers included; the re-planned ones must equal their
    quotes (python -m workbench.plan re-plans any)."""
    backends, replanned = SHIPPED[config]
    quoted = report.quoted_plans(ROOT / "configs" / config)
    assert sorted(quoted) == sorted(backends)
    for backend in backends:
        assert quoted[backend]["peak_bytes"] <= 0.9 * 24 * 2**30, (backend, quoted[backend])
    for backend in replanned:
        job = load_config(ROOT / "configs" / config, argv=["--model.backend", backend], world_size=64)
        p = tracer.plan_in_subprocess(job, "trn2", 64)
        assert p["fits"] and p["headroom"] >= 0.10, p
        assert quoted[backend]["peak_bytes"] / 2**30 == pytest.approx(p["peak_bytes"] / 2**30, abs=0.01), (
            f"the config's PLAN comment for {backend} is stale: re-plan and update it")
        cats = p["categories"]
        assert cats["device runtime"] == sum(r["bytes"] for r in tables.runtime_reserve("trn2")) > 0
        assert cats["attention scores"] > 0 and p["sdpa"]["kernel"].startswith("math")  # no fused SDPA on neuron
        assert (cats["nki kernel buffers"] > 0) == (backend == "nki_moe")
        assert (p["nki_kernels"] != {}) == (backend == "nki_moe")


MOE_TINY = ["--job.config_file", str(ROOT / "configs/cpu_moe.toml"), "--training.seq_len", "256",
            "--training.local_batch_size", "2", "--model.backend", "nki_moe"]


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


def test_device_runtime_is_its_own_category_from_the_table_or_the_override():
    """trn2's runtime reserve: every item has a source (the microcode figure from the Neuron device-memory page,
    the rest documented assumptions); the plan adds it as "device runtime"; --reserve-gib replaces it."""
    items = tables.runtime_reserve("trn2")
    assert items[0]["source"].startswith(tables.DEVICE_MEMORY_DOC) and items[0]["bytes"] == 2 * 96 * MiB
    assert all(i["source"].startswith("assumption") for i in items[1:])
    assert tables.runtime_reserve("cpu") == []
    job = load_config(argv=TINY)
    p = report.plan(job, "trn2", 1, suggest=False)
    reserve = sum(i["bytes"] for i in items)
    assert p["categories"]["device runtime"] == reserve == 1764 * MiB
    traced = sum(v for k, v in p["categories"].items() if k != "device runtime")
    assert p["peak_bytes"] == traced + reserve
    q = report.plan(job, "trn2", 1, suggest=False, reserve_gib=0.5)
    assert q["categories"]["device runtime"] == GiB // 2 and q["peak_bytes"] == traced + GiB // 2
    assert q["device_runtime"] == [{"what": "device runtime", "bytes": GiB // 2, "source": "--reserve-gib"}]
    assert "device runtime" in report.render(p) and "--reserve-gib" in report.render(p)


def test_allocator_peak_on_cpu_counts_the_c10_allocators_own_events():
    """The CPU branch of the first-launch check: the tensors alive at the start (parameters, gradients, optimizer
    state) plus the running sum of the allocator's allocation/free events, peak taken in order."""
    model = torch.nn.Linear(256, 256)  # 65,792 fp32 parameters
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 256)).sum().backward()
    opt.step()  # AdamW state: exp_avg + exp_avg_sq (+ a 4-byte step per parameter)
    live = 4 * 65_792 * 4 + 2 * 4  # params, grads, two moments; two fp32 step scalars
    meter = measure.AllocatorPeak("cpu", [model], opt)
    meter.start()
    a = torch.ones(1000, 1000)  # 4 MB
    b = torch.ones(500, 1000)  # + 2 MB: 6 MB live
    del a
    c = torch.ones(750, 1000)  # 2 + 3 MB: 5 MB live, below the peak
    del b, c
    assert meter.stop() == live + 6_000_000
    assert "c10 CPU allocator" in meter.source


def test_first_launch_check_skips_a_device_without_allocator_statistics(capsys):
    """torch.neuron exists once torch_neuronx imports (not here): the check says it is skipped and hooks nothing,
    rather than failing the launch."""
    from types import SimpleNamespace

    model = torch.nn.Linear(2, 2)
    trainer = SimpleNamespace(job=load_config(argv=[*TINY, "--job.memory_measure", "always"]), model_parts=[model],
                              device=SimpleNamespace(type="neuron"), optimizers=torch.optim.SGD(model.parameters()))
    measure.check_on_launch(trainer)
    assert "memory check: skipped, torch.neuron lacks one of synchronize" in capsys.readouterr().out
    assert not model._forward_pre_hooks and not trainer.optimizers._optimizer_step_post_hooks


def test_allocator_statistics_come_from_torch_accelerator_when_it_serves_the_device():
    """SDK 2.34: torch.accelerator's memory functions work on Neuron, so the check reads them there; where the current
    accelerator is another device (or none), torch.<kind> (torch.neuron on SDK 2.33) as before. A stand-in `torch`
    namespace (no neuron device here) whose accelerator keeps real byte counts: the window's peak is what it holds."""
    from types import SimpleNamespace

    class Accelerator:  # torch.accelerator's ALLOCATOR_API, counting the bytes "allocated" since the last reset
        def __init__(self, kind):
            self.kind, self.peak, self.calls = kind, 0, []

        def is_available(self):
            return True

        def current_accelerator(self):
            return SimpleNamespace(type=self.kind)

        def synchronize(self):
            self.calls.append("synchronize")

        def reset_peak_memory_stats(self):
            self.calls.append("reset")
            self.peak = 0

        def max_memory_allocated(self):
            return self.peak

        def memory_allocated(self):  # what the step starts with (parameters, optimizer state)
            return GiB

    neuron_module = SimpleNamespace()  # SDK 2.33's torch.neuron without allocator statistics
    for current, module, name in (("neuron", "accelerator", "torch.accelerator"), ("cuda", "neuron", "torch.neuron")):
        fake = SimpleNamespace(accelerator=Accelerator(current), neuron=neuron_module)
        meter = measure.AllocatorPeak("neuron", [], None, torch_module=fake)
        assert meter.module is getattr(fake, module) and meter.name == name
        assert meter.source == f"{name}.max_memory_allocated() after {name}.synchronize()"
    meter = measure.AllocatorPeak("neuron", [], None, torch_module=SimpleNamespace(accelerator=Accelerator("neuron")))
    meter.start()
    meter.module.peak = 3 * GiB  # what the device allocator saw during the window
    assert meter.stop() == 3 * GiB and meter.module.calls == ["synchronize", "reset", "synchronize"]
    assert meter.resident == GiB
    # this host: torch.accelerator has no device, so cpu keeps its own path and neuron finds no torch.neuron
    assert measure.allocator_module("cpu") == (None, "")
    assert measure.allocator_module("neuron") == (None, "torch.neuron")


def test_memory_measure_takes_only_its_values(capsys):
    assert plan.main(["--job.memory_measure", "sometimes", *TINY]) == 2
    assert "job.memory_measure" in capsys.readouterr().err
