"""workbench.run.peak_memory: the first-launch check's measurement: the c10 CPU allocator's events on the CPU, the
device allocator's statistics through torch.accelerator or torch.<device>, and a device without them skipped."""

from __future__ import annotations

import pytest
import torch

from workbench.core.config import load_config
from workbench.run import peak_memory

pytestmark = pytest.mark.machine_cpu_path  # quoted plans are fake-tensor traces: no CPU kernel runs (run_helpers.py)

TINY = ["--model.flavor", "tiny", "--training.seq_len", "256", "--training.local_batch_size", "2"]
GiB = 2**30


def test_allocator_peak_on_cpu_counts_the_c10_allocators_own_events():
    """The CPU branch of the first-launch check: the tensors alive at the start (parameters, gradients, optimizer
    state) plus the running sum of the allocator's allocation/free events, peak taken in order."""
    model = torch.nn.Linear(256, 256)  # 65,792 fp32 parameters
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 256)).sum().backward()
    opt.step()  # AdamW state: exp_avg + exp_avg_sq (+ a 4-byte step per parameter)
    live = 4 * 65_792 * 4 + 2 * 4  # params, grads, two moments; two fp32 step scalars
    meter = peak_memory.AllocatorPeak("cpu", [model], opt)
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

    from workbench.run.record import RunRecord

    model = torch.nn.Linear(2, 2)
    run = RunRecord.of(load_config(argv=[*TINY, "--job.memory_measure", "always"]), "neuron")
    trainer = SimpleNamespace(run=run, model_parts=[model],
                              device=SimpleNamespace(type="neuron"), optimizers=torch.optim.SGD(model.parameters()))
    peak_memory.check_on_launch(trainer)
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
        meter = peak_memory.AllocatorPeak("neuron", [], None, torch_module=fake)
        assert meter.module is getattr(fake, module) and meter.name == name
        assert meter.source == f"{name}.max_memory_allocated() after {name}.synchronize()"
    meter = peak_memory.AllocatorPeak("neuron", [], None,
                                      torch_module=SimpleNamespace(accelerator=Accelerator("neuron")))
    meter.start()
    meter.module.peak = 3 * GiB  # what the device allocator saw during the window
    assert meter.stop() == 3 * GiB and meter.module.calls == ["synchronize", "reset", "synchronize"]
    assert meter.resident == GiB
    # this host: torch.accelerator has no device, so cpu keeps its own path and neuron finds no torch.neuron
    assert peak_memory.allocator_module("cpu") == (None, "")
    assert peak_memory.allocator_module("neuron") == (None, "torch.neuron")
