"""The in-run memory measurement: after steps 1 and 2 of a launch, every rank's measured peak against the memory
plan the launch's preflight made (`check_on_launch`, called by `WorkbenchTrainer` before its first step; the plan's
numbers come as data in `RunRecord.memory_plan`).
"""

from __future__ import annotations

import json
from pathlib import Path

from workbench.core.config import JobConfig
from workbench.core.files import write_atomic
from workbench.core.units import GiB, MiB
from workbench.platform.dist_utils import say

CHECK_STEPS = 2
"""The first-launch check measures this launch's first steps: step 1 (AdamW creates its state in it) and step 2
(steady state, what the plan traces)."""


ALLOCATOR_API = ("synchronize", "reset_peak_memory_stats", "max_memory_allocated", "memory_allocated")
"""What `AllocatorPeak` calls on torch.accelerator / torch.cuda / torch.neuron (the check is skipped, saying so,
where one is missing)."""


def allocator_module(kind: str, torch_module=None):
    """(module, its name) whose ALLOCATOR_API reads device `kind`'s allocator; (None, ...) on cpu or when missing.

    `torch.accelerator` (device-generic, torch >= 2.9) when the current accelerator is `kind` and has the API: the
    torch-neuronx v2.34.0 release notes say its memory functions work on Neuron from SDK 2.34. Else `torch.<kind>`:
    torch.cuda, or torch.neuron (SDK 2.33, once torch_neuronx imports). `torch_module` replaces `torch` (tests)."""
    if kind == "cpu":
        return None, ""
    if torch_module is None:
        import torch as torch_module
    acc = getattr(torch_module, "accelerator", None)
    current = acc.current_accelerator() if acc is not None and acc.is_available() else None
    if current is not None and current.type == kind and all(hasattr(acc, f) for f in ALLOCATOR_API):
        return acc, "torch.accelerator"
    return getattr(torch_module, kind, None), f"torch.{kind}"


class AllocatorPeak:
    """Peak bytes of the tensors this rank holds during a window, from the device's own allocator.

    cuda / neuron: the caching allocator's peak (`max_memory_allocated` after `synchronize()`, peak reset at the
    window's start) through `torch.accelerator` where it serves the device (Neuron from SDK 2.34), else
    `torch.cuda` / `torch.neuron` (`allocator_module`). The Neuron allocator is asynchronous: its memory-profiling
    guide says to synchronize before reading any statistic
    (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/guides/memory-profiling-guide.html).
    cpu: there are no allocator statistics, so the c10 CPU allocator's own allocation events (torch.profiler with
    profile_memory: the bytes of every allocation and free while it records) are summed in order on top of the
    tensors alive at the start (parameters, buffers, gradients, optimizer state).
    """

    def __init__(self, kind: str, model_parts, optimizers, torch_module=None):
        self.kind, self.model_parts, self.optimizers = kind, model_parts, optimizers
        self.module, self.name = allocator_module(kind, torch_module)
        self.profiler = None
        self.base = 0
        self.resident = 0  # bytes held when the window opened (parameters, optimizer state, ...)

    @property
    def source(self) -> str:
        if self.module is None:
            return "c10 CPU allocator events (torch.profiler profile_memory) + live parameters/optimizer state"
        return f"{self.name}.max_memory_allocated() after {self.name}.synchronize()"

    def start(self) -> None:
        if self.module is not None:
            self.module.synchronize()
            self.module.reset_peak_memory_stats()
            self.resident = int(self.module.memory_allocated())
            return
        import torch

        self.base = self.resident = self._live_bytes()
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()

    def stop(self) -> int:
        """The window's peak (bytes)."""
        if self.module is not None:
            self.module.synchronize()
            return int(self.module.max_memory_allocated())
        self.profiler.__exit__(None, None, None)
        events = [e for e in self.profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
        level = peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            level += e.nbytes()
            peak = max(peak, level)
        self.profiler = None
        return self.base + peak

    def _live_bytes(self) -> int:
        """Bytes of the distinct storages behind the parameters, buffers, gradients and optimizer state."""
        import torch
        from torch.distributed.tensor import DTensor

        tensors = [t for m in self.model_parts for t in (*m.parameters(), *m.buffers())]
        tensors += [p.grad for m in self.model_parts for p in m.parameters() if p.grad is not None]
        for opt in getattr(self.optimizers, "optimizers", [self.optimizers]):  # torchtitan's container holds several
            tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        storages = {}
        for t in tensors:
            local = t.to_local() if isinstance(t, DTensor) else t
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return sum(storages.values())


def measures_on_launch(job: JobConfig, device_kind: str) -> bool:
    """Whether a launch compares the plan with the measured peaks (`job.memory_measure`)."""
    measure = job.job.memory_measure
    return measure == "always" or (measure == "auto" and device_kind != "cpu" and job.job.memory_check)


def check_on_launch(trainer) -> None:
    """The first-launch check: after steps 1 and 2 of this launch, every rank's peak (`AllocatorPeak`) against the
    plan, in `<run>/memory_check.json` and a progress line (`RunRecord.measure_memory`; `WorkbenchTrainer` calls
    this before its first step).

    A step's window opens at the model's forward (after torchtitan's zero_grad and the data) and closes after the
    optimizer step (before the metrics log, which resets the peak statistics). The plan's tensors (its peak less
    the device runtime, which no allocator sees) are compared with the largest rank's peak. The plan is the one the
    launch's preflight made on rank 0 (`RunRecord.memory_plan`; `workbench.memory.preflight.plan_for_run`).
    """
    import torch
    import torch.distributed as dist

    run, kind = trainer.run, trainer.device.type
    if not run.measure_memory:
        return
    if kind == "cpu" and run.profiling.enable:
        say("memory check: skipped on CPU while [profiling] is on (one torch.profiler at a time)")
        return
    meter = AllocatorPeak(kind, trainer.model_parts, trainer.optimizers)
    if kind != "cpu" and not all(hasattr(meter.module, f) for f in ALLOCATOR_API):
        say(f"memory check: skipped, {meter.name} lacks one of {', '.join(ALLOCATOR_API)}")
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    planned = run.memory_plan if rank == 0 else None
    steps = list(range(trainer.step, min(trainer.step + CHECK_STEPS, trainer.config.training.steps + 1)))
    report = {"device": kind, "world_size": world, "source": meter.source, "steps": []}
    if planned is not None:
        runtime = planned["categories"].get("device runtime", 0)
        cats = planned["categories"]
        report["plan"] = {"peak_bytes": planned["peak_bytes"], "tensor_bytes": planned["peak_bytes"] - runtime,
                          "device_runtime_bytes": runtime, "capacity_bytes": planned["capacity_bytes"],
                          "device": planned["device"], "sdpa": planned.get("sdpa", {}).get("kernel"),
                          # what a steady-state step starts with: its parameters and optimizer state (the
                          # gradients were freed by zero_grad), comparable with `AllocatorPeak.resident`
                          "resident_bytes": cats["sharded parameters"] + cats["optimizer state"],
                          "categories": cats}
    open_window = [False]

    def before_forward(*_):
        if steps and not open_window[0] and trainer.step == steps[0]:
            meter.start()
            open_window[0] = True

    def after_optimizer_step(*_):
        if not open_window[0]:
            return
        open_window[0] = False
        step = steps.pop(0)
        # MiB as fp32: a dtype every backend's all_gather takes (a byte count needs int64 or fp64)
        mine = torch.tensor([meter.stop() / MiB, meter.resident / MiB], dtype=torch.float32, device=trainer.device)
        every = [torch.zeros_like(mine) for _ in range(world)]
        if world > 1:
            dist.all_gather(every, mine)
        else:
            every = [mine]
        if rank == 0:
            _report_step(report, step, [int(float(t[0]) * MiB) for t in every], Path(trainer.config.dump_folder),
                         resident=[int(float(t[1]) * MiB) for t in every])

    trainer.model_parts[0].register_forward_pre_hook(before_forward, prepend=True)  # before FSDP's all-gather
    trainer.optimizers.register_step_post_hook(after_optimizer_step)


def _report_step(report: dict, step: int, measured: list[int], run_dir: Path, resident: list[int] | None = None
                 ) -> None:
    """Rank 0: add one step's per-rank peaks (and what each rank held when the step began, `resident`) to the
    report, rewrite memory_check.json, print the line."""
    top = max(range(len(measured)), key=measured.__getitem__)
    entry = {"step": step, "measured_bytes": measured, "max_bytes": measured[top], "max_rank": top}
    if resident is not None:
        entry["resident_bytes"] = resident[top]
    line = f"memory step {step}: measured peak {measured[top] / GiB:.2f} GiB (rank {top} of {len(measured)})"
    if "plan" in report:
        plan_ = report["plan"]
        entry["measured_over_plan"] = measured[top] / plan_["tensor_bytes"]
        if resident is not None and plan_.get("resident_bytes"):
            entry["resident_over_plan"] = resident[top] / plan_["resident_bytes"]
        line += (f", plan {plan_['tensor_bytes'] / GiB:.2f} GiB of tensors ({plan_['device']}): measured/plan "
                 f"{entry['measured_over_plan']:.3f}; the plan's peak with the device runtime "
                 f"{plan_['peak_bytes'] / GiB:.2f} of {plan_['capacity_bytes'] / GiB:.0f} GiB")
    report["steps"].append(entry)
    write_atomic(run_dir / "memory_check.json", json.dumps(report, indent=1))
    say(line)
