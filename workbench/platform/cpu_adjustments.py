"""Every adjustment torchtitan needs to train on CPU, in one place, applied only when the device is CPU.

`workbench.platform.titan_device.pin("cpu")` calls `apply()` (1-4) and `WorkbenchTrainer.train` calls
`end_of_training_without_sleep` (5); nothing else in the workbench patches a dependency.
Each adjustment is small, idempotent and says which behaviour of torchtitan 0.3.0 it works around:

1. Device selection. `torchtitan.tools.utils` decides `device_type` at import and falls back to "cuda"
   without an accelerator; modules then copy `device_type` / `device_module` by name. We rebind them in
   `torchtitan.tools.utils` and in every torchtitan module already imported, and provide a `device_module`
   for CPU with the memory API torchtitan's metrics expect (peak = process RSS high-water mark).
2. FSDP2 gradient reduction. torchtitan sets `gradient_divide_factor=1`, which FSDP2 turns into
   `ReduceOp.PREMUL_SUM` — unsupported by gloo. Forcing plain SUM for comms is numerically the same
   (factor 1: nothing to divide).
3. MoE experts in fp32. torchtitan's `GroupedExperts.forward` hard-casts inputs and weights to bf16 (a GPU
   choice); bf16 on these CPUs is ~40x slower than fp32 and breaks fp32 parity tests. On CPU the experts
   run in the activation dtype instead, through the same `torch._grouped_mm` seam.
4. The MoE router's `torch.autocast(dtype=float32)` is a no-op on CPU that warns on every call (CPU autocast only
   knows bf16/fp16); the warning is silenced.
5. The end of training. `Trainer.train` ends with a fixed `time.sleep(2)` on rank 0 "for other ranks to complete".
   `WorkbenchTrainer.train` calls `end_of_training_without_sleep` on CPU, which makes that sleep a no-op and then
   has every rank meet at a barrier: rank 0 waits for the slowest rank, not 2 s more (a CPU launch is seconds long).
"""

from __future__ import annotations

import resource
import sys
import time
import types
import warnings

import torch
import torch.nn.functional as F

_applied = False


class _CpuMemoryStats:
    """Peak-memory interface of `torch.cuda` answered from the process RSS (bytes)."""

    @staticmethod
    def rss_peak_bytes() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _make_cpu_device_module() -> types.ModuleType:
    """A stand-in for `torch.cuda` exposing what torchtitan calls, backed by torch.cpu + RSS."""
    import psutil

    mod = types.ModuleType("workbench_cpu_device")
    props = types.SimpleNamespace(name="cpu", total_memory=psutil.virtual_memory().total)
    mod.is_available = lambda: True
    mod.device_count = lambda: 1
    mod.current_device = lambda: 0
    mod.set_device = lambda *_a, **_k: None
    mod.synchronize = lambda *_a, **_k: None
    mod.empty_cache = lambda: None
    mod.reset_peak_memory_stats = lambda *_a, **_k: None  # RSS high-water mark cannot be reset
    mod.get_device_name = lambda *_a, **_k: "cpu"
    mod.get_device_properties = lambda *_a, **_k: props

    def memory_stats(*_a, **_k) -> dict[str, int]:
        peak = _CpuMemoryStats.rss_peak_bytes()
        return {
            "active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0, "num_ooms": 0,
        }

    mod.memory_stats = memory_stats
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    # Anything else (streams, events, ...) falls back to torch.cpu.
    mod.__getattr__ = lambda name: getattr(torch.cpu, name)  # type: ignore[attr-defined]
    return mod


def _pin_device_to_cpu() -> None:
    import torchtitan.tools.utils as tt_utils

    cpu_module = _make_cpu_device_module()
    originals = (tt_utils.device_type, tt_utils.device_module, tt_utils.get_local_device)
    replacements = {
        "device_type": "cpu",
        "device_module": cpu_module,
        "get_local_device": lambda: torch.device("cpu"),
    }
    for name, value in replacements.items():
        setattr(tt_utils, name, value)
    # Modules imported before us copied the old values by name: rebind those copies too.
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("torchtitan.") or mod is None or mod is tt_utils:
            continue
        for name, value in replacements.items():
            if name in vars(mod) and vars(mod)[name] in originals:
                setattr(mod, name, value)


def force_sum_fsdp_reduction() -> None:
    """FSDP2 reduce-scatter with ReduceOp.SUM (also used by `neuron_adjustments`)."""
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed._composable.fsdp import FSDPModule

    original = tt_fsdp.disable_fsdp_gradient_division
    if getattr(original, "_workbench_cpu", False):
        return

    def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    disable_fsdp_gradient_division._workbench_cpu = True  # type: ignore[attr-defined]
    tt_fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division


def _grouped_experts_in_activation_dtype() -> None:
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import GroupedExperts

    if getattr(GroupedExperts.forward, "_workbench_cpu", False):
        return

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        dtype = x_RD.dtype
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        gate = self._grouped_mm(A=x_RD, B_t=w1.to(dtype).transpose(-2, -1), offs=offsets_E)
        up = self._grouped_mm(A=x_RD, B_t=w3.to(dtype).transpose(-2, -1), offs=offsets_E)
        return self._grouped_mm(A=F.silu(gate) * up, B_t=w2.to(dtype).transpose(-2, -1), offs=offsets_E)

    forward._workbench_cpu = True  # type: ignore[attr-defined]
    GroupedExperts.forward = forward


def end_of_training_without_sleep(train) -> None:
    """Runs `train()` (torchtitan's `Trainer.train`) with its closing 2 s sleep made a no-op, then a barrier over
    the default process group (adjustment 5). `torchtitan.trainer` is loaded by then: the trainer subclasses it."""
    import torch.distributed as dist
    import torchtitan.trainer as titan_trainer

    if not getattr(titan_trainer.time, "_workbench_cpu", False):
        no_sleep = types.ModuleType("time")
        no_sleep.__getattr__ = lambda name: getattr(time, name)  # type: ignore[attr-defined]  # perf_counter etc.
        no_sleep.sleep = lambda _seconds: None  # type: ignore[attr-defined]
        no_sleep._workbench_cpu = True  # type: ignore[attr-defined]
        titan_trainer.time = no_sleep
    train()
    if dist.is_initialized():
        dist.barrier()


def apply(force_sum: bool = True) -> None:
    """Applies every CPU adjustment (idempotent).

    Args:
        force_sum: adjustment 2. False when `neuron_adjustments` also applies (the offline check of the Neuron
            path): then its own `neuron.force_sum_reduction` switch alone decides, as it would on the device.
    """
    global _applied
    if _applied:
        return
    _pin_device_to_cpu()
    if force_sum:
        force_sum_fsdp_reduction()
    _grouped_experts_in_activation_dtype()
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    _applied = True
