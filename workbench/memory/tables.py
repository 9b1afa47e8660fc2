"""The memory plan's tables: each device's memory per rank and its runtime's reserve (`DEVICES`, `capacity`,
`runtime_reserve`), and the categories a plan files every byte under (`CATEGORIES`).

Part of the memory plan (`workbench.plan`, whose docstring tells the whole story): tables <- tracer <- report <-
gate, measure.
"""

from __future__ import annotations

import dataclasses
import os

from workbench.core.errors import ConfigError
from workbench.core.units import GiB, MiB

DEVICE_MEMORY_DOC = ("https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/neuron-runtime/explore/"
                     "device-memory.html")
NO_DOCUMENTED_SIZE = "no size on the page (Neuron device memory deep dive, v2.33.0)"

TRN2_RUNTIME = (  # (what, bytes per rank, source): HBM the Neuron runtime holds outside the traced tensors
    ("microcode", 2 * 96 * MiB, f"{DEVICE_MEMORY_DOC}, Overview, model code: 'a micro-code overhead of 96MB per "
     "physical Neuron Core'; an LNC=2 rank is 2 physical cores"),
    ("NEFF code and constants", 740 * MiB, "assumption: the same page's OOM example shows 932 MB of model code "
     "on one HBM (24 GiB: one LNC=2 rank's), the 2 x 96 MB microcode included; the rest depends on the graphs"),
    ("shared scratchpad", 512 * MiB, "assumption: one page. The page (Scratchpad): the runtime allocates the "
     "shared scratchpad in pages of NEURON_SCRATCHPAD_PAGE_SIZE, 512 MB by default; how many pages a model "
     "needs is known only after compiling"),
    ("DMA rings", 64 * MiB, f"assumption, {NO_DOCUMENTED_SIZE}: IO, spill, collectives and runtime rings; its "
     "OOM example shows < 1 MB per NEFF"),
    ("collectives", 256 * MiB, f"assumption, {NO_DOCUMENTED_SIZE}: 'memory overhead used to orchestrate "
     "collective communication'"),
)
"""A device profile adds 'around 2 GB' of profile buffers (same page, Profile Buffers): plan it with --reserve-gib."""
CUDA_RUNTIME = (
    ("CUDA context, library workspaces, NCCL buffers", 1 * GiB, "assumption: outside the caching allocator that "
     "torch.cuda.max_memory_allocated reports; no documented size (driver, cuBLAS/cuDNN and NCCL versions)"),
)


@dataclasses.dataclass(frozen=True)
class Device:
    """A --device choice: the device kind whose rules apply, the memory of one rank (0: host RAM / ranks), the
    runtime's share of it (what, bytes, source) and the logical core count the NKI kernels launch with there."""

    kind: str
    capacity: float
    runtime: tuple[tuple[str, int, str], ...] = ()
    lnc: int = 1


DEVICES: dict[str, Device] = {
    "trn2": Device("neuron", 24 * GiB, TRN2_RUNTIME, lnc=2),  # trn2.48xlarge at LNC=2: 96 GiB per chip / 4
    "h100": Device("cuda", 80e9, CUDA_RUNTIME),
    "h200": Device("cuda", 141e9, CUDA_RUNTIME),
    "cpu": Device("cpu", 0.0),
}

FUSED_SDPA: dict[str, str | None] = {
    # device kind -> the fused SDPA kernel known to exist there (its memory is what the CPU trace's fused kernel
    # takes: no S x S scores), or None: SDPA is traced on its math path.
    "cpu": "aten._scaled_dot_product_flash_attention_for_cpu",
    "cuda": "flash / cuDNN attention (traced as the CPU flash kernel: O(S) memory, no S x S scores)",
    "neuron": None,
}
NO_FUSED_SDPA = ("no fused SDPA kernel is known on the neuron device: TorchNeuron documents none, and "
                 "neuron.sdpa_overrideable only lets one dispatch through SDPBackend.OVERRIDEABLE (torchtitan's "
                 "SDPA wrapper allows CUDNN/FLASH/MATH only); planned as SDPA's math path (fp32 S x S scores)")

CATEGORIES = ("sharded parameters", "gradients", "optimizer state", "all-gathered parameters", "activations",
              "attention scores", "attention mask", "logits and loss", "nki kernel buffers", "other temporaries",
              "device runtime")
OTHER_PARTS = {  # the parts of "other temporaries": the tracker's reference types
    "backward temporaries": "Temp", "unsharded gradients": "Unsharded Grad", "reduce-scatter buffers": "Reduce Scatter",
    "inputs": "Inputs",
}
REF_CATEGORY = {  # the tracker's reference type (value) -> the plan's category, or the part of "other temporaries"
    "Sharded Param": "sharded parameters", "Buffer": "sharded parameters", "Sharded Grad": "gradients",
    "OptState": "optimizer state", "Unsharded Param": "all-gathered parameters",
    "All Gather": "all-gathered parameters",
    "Activation": "activations", "Attention scores": "attention scores", "Attention mask": "attention mask",
    "Logits": "logits and loss",
    "NKI kernels": "nki kernel buffers", **{ref: part for part, ref in OTHER_PARTS.items()},
}
LARGE = 0.10
"""A category (or part of "other temporaries") with at least this share of the peak gets its top tensors and lever."""
STATE = "state"
"""The origin of tensors no operator of the traced step made: parameters, gradients, optimizer state, inputs."""
TOP_TENSORS = 3
"""Tensor groups listed per large category."""
HEADROOM = 0.10
"""Suggestions aim for a peak with at least this fraction of the capacity left free."""


def capacity(device: str, ranks_per_host: int) -> float:
    """Bytes of memory one rank has on `device` (CPU: the host's RAM shared by its ranks)."""
    if device not in DEVICES:
        raise ConfigError(f"Unknown --device {device!r}; choose one of {', '.join(DEVICES)}.")
    if DEVICES[device].capacity == 0:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(ranks_per_host, 1)
    return DEVICES[device].capacity


def runtime_reserve(device: str, reserve_gib: float | None = None) -> list[dict]:
    """The device runtime's share of a rank's memory, item by item with its source (`Device.runtime`);
    `reserve_gib` replaces the table with one figure."""
    if reserve_gib is not None:
        if reserve_gib < 0:
            raise ConfigError(f"--reserve-gib {reserve_gib}: give the device runtime's share in GiB, >= 0.")
        return [{"what": "device runtime", "bytes": int(reserve_gib * GiB), "source": "--reserve-gib"}]
    return [{"what": w, "bytes": b, "source": src} for w, b, src in DEVICES[device].runtime]
