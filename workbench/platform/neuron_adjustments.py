"""Every adjustment torchtitan 0.3.0 needs on the TorchNeuron `neuron` device, in one place, each one switchable.

The counterpart of `workbench/platform/cpu_adjustments.py`. `workbench.platform.titan_device.pin` applies it when
`[neuron] apply` says so: `auto` (default) on the neuron device only; `always` also on cpu/cuda, which is how the
test suite runs this exact code path offline (a 2-rank gloo job whose process group is registered under the name the
config asks for; see tests/integration/test_neuron_path.py). Nothing here has run on a Trainium; each item says what
it rests on.

1. Process group (`neuron.process_group`, default "neuron"). torchtitan picks its backend from
   `torch.distributed.Backend.default_device_backend_map[device_type]`; we map the device to the configured
   backend and refuse one that is not registered. TorchNeuron registers "neuron" when `torch_neuronx` is imported:
   https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/guides/torch-distributed.html
2. FSDP2 reduce-scatter with SUM (`neuron.force_sum_reduction`). torchtitan sets a gradient divide factor of 1,
   which FSDP2 turns into `ReduceOp.PREMUL_SUM`; the collectives TorchNeuron documents are the plain reductions
   (API compatibility guide linked from the page above), PREMUL_SUM is not listed. SUM with factor 1 is the same
   number (nothing to divide), so forcing it is safe everywhere.
3. SDPA backend list (`neuron.sdpa_overrideable`). torchtitan's `ScaledDotProductAttention` restricts SDPA to
   CUDNN / FLASH / MATH. Out-of-tree (PrivateUse1) devices register their fused attention under
   `SDPBackend.OVERRIDEABLE` (https://docs.pytorch.org/docs/stable/backends.html#torch.nn.attention.SDPBackend);
   without it Neuron could only run MATH (an S x S score tensor per head). We put OVERRIDEABLE first and keep the
   rest, so CPU/CUDA dispatch is unchanged. The SDPA of packed documents (`backends.attention.BlockCausalSDPA`,
   a subclass) reads the same list. Flex and varlen attention need nothing here: `model.attn_backend` flex/varlen
   run torchtitan's modules as AWS's TorchTitan Neuron recipes do (torch-neuronx v2.34.0 release notes; unverified).
4. Timeouts (`neuron.init_timeout_s`, `neuron.step_timeout_s`). neuronx-cc compiles the graphs during start-up and
   the first step, on every rank; torchtitan's 300 s collective timeouts can expire meanwhile. `comm_timeouts`
   gives `workbench.run.trainer` the values (torchtitan switches to the step timeout after step 1 by itself).
5. Memory statistics after a device synchronize (`neuron.sync_memory_stats`). Execution is asynchronous; the
   Neuron memory-profiling guide synchronizes (`torch.neuron.synchronize()`) before reading statistics, which
   torchtitan's `DeviceMemoryMonitor.get_peak_stats` does not.
6. Logical NeuronCore degree. `NEURON_LOGICAL_NC_CONFIG`, read by `workbench.core.neuron_env.runtime_lnc`
   (unset: 2 on the neuron device, trn2's default, per
   https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-features/logical-neuroncore-config.html;
   1 elsewhere), is shown in the start-up line; the NKI kernels launch on the same value: their launch grid must
   match it (compiler error NCC_EVRF066 otherwise).
"""

from __future__ import annotations

from workbench.core.config import Neuron
from workbench.core.neuron_env import runtime_lnc

DEFAULT_TIMEOUT_S = 300  # torchtitan's own default, kept off Neuron

_applied: dict[str, bool] = {}
lnc: int | None = None
"""The logical NeuronCore degree read by `apply` (None until applied)."""


def applies(cfg: Neuron, device_kind: str) -> bool:
    """Whether the adjustments apply to a run on `device_kind` under `[neuron] apply`."""
    return cfg.apply == "always" or (cfg.apply == "auto" and device_kind == "neuron")


def comm_timeouts(cfg: Neuron, device_kind: str) -> tuple[int, int]:
    """(start-up + first step, later steps) collective timeouts in seconds."""
    if applies(cfg, device_kind):
        return cfg.init_timeout_s, cfg.step_timeout_s
    return DEFAULT_TIMEOUT_S, DEFAULT_TIMEOUT_S


def _use_process_group(name: str, device_kind: str) -> None:
    import torch.distributed as dist

    if name.lower() not in dist.Backend.backend_list:
        raise ValueError(
            f"neuron.process_group={name!r} is not a registered torch.distributed backend (registered: "
            f"{', '.join(b for b in dist.Backend.backend_list if b != 'undefined')}). TorchNeuron registers 'neuron' "
            "when torch_neuronx imports; check the install with `python -m workbench.doctor`."
        )
    dist.Backend.default_device_backend_map[device_kind] = name.lower()


def _sdpa_with_overrideable() -> None:
    from torch.nn.attention import SDPBackend
    from torchtitan.models.common.attention import ScaledDotProductAttention

    # A class attribute torchtitan reads in __init__ when it is non-empty: set before the model is built.
    ScaledDotProductAttention.sdpa_backends = [
        SDPBackend.OVERRIDEABLE, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH,
    ]


def _synchronize_before_memory_stats() -> None:
    import torchtitan.components.metrics as tt_metrics
    import torchtitan.tools.utils as tt_utils

    original = tt_metrics.DeviceMemoryMonitor.get_peak_stats
    if getattr(original, "_workbench_neuron", False):
        return

    def get_peak_stats(self):
        tt_utils.device_module.synchronize()  # torch.neuron on Neuron (the module torchtitan picked for the device)
        return original(self)

    get_peak_stats._workbench_neuron = True  # type: ignore[attr-defined]
    tt_metrics.DeviceMemoryMonitor.get_peak_stats = get_peak_stats


def apply(cfg: Neuron, device_kind: str) -> list[str]:
    """Applies the switched-on adjustments (idempotent; call after torchtitan's device is pinned).

    Returns:
        The names of the adjustments applied, for the start-up line.
    """
    global lnc
    from workbench.platform import cpu_adjustments

    done = []
    _use_process_group(cfg.process_group, device_kind)
    done.append(f"process group {cfg.process_group}")
    if cfg.force_sum_reduction:
        cpu_adjustments.force_sum_fsdp_reduction()
        done.append("FSDP SUM reduction")
    if cfg.sdpa_overrideable:
        _sdpa_with_overrideable()
        done.append("SDPA OVERRIDEABLE")
    if cfg.sync_memory_stats:
        _synchronize_before_memory_stats()
        done.append("synchronized memory stats")
    lnc = runtime_lnc(on_neuron=device_kind == "neuron")
    done.append(f"LNC {lnc}")
    done.append(f"timeouts {cfg.init_timeout_s}/{cfg.step_timeout_s} s")
    return done
