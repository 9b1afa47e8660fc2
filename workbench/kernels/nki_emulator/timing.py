"""A trn2 time model over the emulator's counters: how long a kernel's instructions would keep each engine busy.

Every instruction the emulator executes records a *work* descriptor next to its engine (static shapes, dtypes and
memories of its operands: `Matmul`, `Transpose`, `Elementwise`, `Dma`), per core, in `Counters.work`. `model(c)`
turns those records into engine busy times with NeuronCore-v3 / Trainium2 rates, each cited from AWS's docs
(`TRN2`, `SOURCES`; a rate no doc states is marked as an assumption there):

    tensor   per nc_matmul max(N, 64) cycles (N: moving free size), x4 for fp32 operands; a PE transpose is a
             matmul against an identity of the partition size (x2 for fp32: NeuronCore-v3's transpose mode);
             at 2.4 GHz. A full [128 x 128] x [128 x N] matmul is then 2*128*128*N FLOPs in N cycles: 79 TFLOPS.
    vector   per instruction (tensor inputs x N) cycles / the performance-mode speedup (bf16, SBUF) + a fixed
             tensor-access overhead, N = elements per partition, at 0.96 GHz; scalar (activation) the same
             without performance modes at 1.2 GHz; gpsimd like scalar (an assumption: no documented cost model).
    dma      per physical core max(HBM bytes / its share of the chip's HBM bandwidth,
             the transfers on its 16 DMA engines: per transfer a fixed cost on each engine it uses + bytes at
             27.2 GB/s per engine, spread over the 16).
    register / control / sync (sequencer instructions, loop branches, barriers): not modelled (0 s; counted).

Bounds: `overlap_s` = the busiest engine of the busiest core (every engine runs concurrently and nothing waits),
`serial_s` = the largest per-core sum over engines (nothing overlaps). A real kernel lands in between. The model
is throughput only: no dependency latency, no DMA queue ordering, no semaphore waits, nothing measured on
Trainium. Instructions that record no work descriptor (an API added without one) are counted in `unmodeled`
and cost nothing, so a caller can tell that the model saw all of a kernel or not.

Any kernel run under `counters()` can be fed through it: `model(c)` for this project's MoE kernels
(benchmarks/nki_moe_cost.py), or for another kernel's counters (e.g. AWS's nki-library kernels on this emulator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

DOCS = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest"
URL_TRN2_NKI = f"{DOCS}/nki/about/trainium2_arch.html"  # Trainium2 Architecture Guide for NKI
URL_TRN1_NKI = f"{DOCS}/nki/about/trainium_inferentia2_arch.html"  # Trainium/Inferentia2 Architecture Guide for NKI
URL_NC_V3 = f"{DOCS}/about-neuron/arch/neuron-hardware/neuron-core-v3.html"
URL_TRN2_CHIP = f"{DOCS}/about-neuron/arch/neuron-hardware/trainium2.html"
URL_DMA = f"{DOCS}/nki/about/nki-dma-overview.html"


# -- work descriptors (recorded by nki_emulator.isa for each traced instruction; static, hashable) ---------------------
class Matmul(NamedTuple):
    """nc_matmul: stationary [k, m], moving [k, n]; fp32: both operands fp32."""

    k: int
    m: int
    n: int
    fp32: bool


class Transpose(NamedTuple):
    """Tensor Engine nc_transpose of [p, f] (a matmul against a [p, p] identity)."""

    p: int
    f: int
    fp32: bool


class Elementwise(NamedTuple):
    """A Vector/Scalar/GpSimd instruction: `inputs` tensor operands streamed per partition, N = `free` elements per
    partition over `partitions` lanes; `bf16`: every operand 16-bit; `psum`: operands in PSUM; `contiguous`: the
    innermost free dim of every operand has stride 1; `sbuf_inputs`: tensor inputs in SBUF."""

    inputs: int
    partitions: int
    free: int
    bf16: bool
    psum: int
    contiguous: bool
    sbuf_inputs: int


class Dma(NamedTuple):
    """One DMA transfer: `nbytes` moved, `hbm_bytes` of them read or written in HBM (x2 for HBM -> HBM), over
    `partitions` SBUF partitions (the SBUF side; 1 for HBM -> HBM)."""

    nbytes: int
    hbm_bytes: int
    partitions: int


def _operand_facts(t):
    """(itemsize, in PSUM, innermost stride 1, in SBUF) of an on-chip view."""
    from ._core import PSUM, SBUF

    data = getattr(t, "_data", None)
    contiguous = data is None or data.dim() == 0 or data.stride()[-1] == 1 or data.shape[-1] == 1
    return t.dtype.itemsize, t.buffer is PSUM, contiguous, t.buffer is SBUF


def matmul_work(stationary, moving) -> Matmul:
    import torch

    (k, m), (_, n) = stationary.shape, moving.shape
    return Matmul(k, m, n, stationary.dtype == torch.float32)


def transpose_work(data) -> Transpose:
    import torch

    p, f = data.shape[0], math.prod(data.shape[1:])
    return Transpose(p, f, data.dtype == torch.float32)


def elementwise_work(dst, *inputs) -> Elementwise:
    """Work of an instruction writing `dst` from tensor operands `inputs` (scalars and per-partition operands are
    not streamed)."""
    facts = [_operand_facts(t) for t in (dst, *inputs)]
    return Elementwise(inputs=max(1, len(inputs)), partitions=dst.shape[0], free=math.prod(dst.shape[1:]),
                       bf16=all(f[0] == 2 for f in facts), psum=sum(f[1] for f in facts),
                       contiguous=all(f[2] for f in facts), sbuf_inputs=sum(f[3] for f in facts[1:]))


def dma_work(dst, *srcs) -> Dma:
    """A DMA writing dst from srcs (dma_compute: several sources)."""
    from ._core import HBM, SBUF, SHARED_HBM

    def nbytes(t):
        return math.prod(t.shape) * t.dtype.itemsize

    ends = (dst, *srcs)
    moved = sum(nbytes(s) for s in srcs)
    hbm = sum(nbytes(t) for t in ends if t.buffer in (HBM, SHARED_HBM))
    sbuf = next((t for t in ends if t.buffer is SBUF), None)
    return Dma(moved, hbm, sbuf.shape[0] if sbuf is not None and sbuf.shape else 1)  # int-indexed partition: 1


# -- rates -------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rates:
    """One physical NeuronCore-v3 and its share of a Trainium2 chip (sources: `SOURCES`)."""

    tensor_hz: float = 2.4e9
    matmul_min_cycles: int = 64
    fp32_matmul_factor: int = 4
    fp32_transpose_factor: int = 2
    pe_bf16_flops: float = 79e12
    vector_hz: float = 0.96e9
    scalar_hz: float = 1.2e9
    gpsimd_hz: float = 1.2e9
    access_overhead_cycles: int = 60
    hbm_bytes_per_s_chip: float = 2.9e12
    cores_per_chip: int = 8
    dma_engines: int = 16
    dma_engine_bytes_per_s: float = 27.2e9
    dma_partitions_per_engine: int = 8
    dma_fixed_s: float = 0.21e-6

    @property
    def hbm_bytes_per_s(self) -> float:
        """One physical core's share of the chip's HBM bandwidth."""
        return self.hbm_bytes_per_s_chip / self.cores_per_chip


TRN2 = Rates()

# Where each rate comes from (URL, what it says); "assumption" where no doc states the trn2 figure.
SOURCES = {
    "tensor_hz": (URL_TRN2_NKI, "Compute Engine Specifications: Tensor 2.4 GHz"),
    "matmul_min_cycles": (URL_TRN1_NKI, "MultiplyMoving initiation interval ~max(N, MM_INIT_LATENCY), 64 cycles on "
                          "NeuronCore-v2; assumption: the same on NeuronCore-v3"),
    "fp32_matmul_factor": (URL_TRN2_NKI, "79 BF16 vs 20 FP32 dense TFLOPS per NeuronCore-v3 (and the v2 guide: "
                           "'roughly 4x higher' for FP32)"),
    "fp32_transpose_factor": (URL_TRN2_NKI, "NeuronCore-v3 transpose mode: '2x speedup in FP32 transpose'"),
    "pe_bf16_flops": (URL_NC_V3, "79 BF16/FP16/TF32 TFLOPS per NeuronCore-v3 Tensor Engine"),
    "vector_hz": (URL_TRN2_NKI, "Compute Engine Specifications: Vector 0.96 GHz"),
    "scalar_hz": (URL_TRN2_NKI, "Compute Engine Specifications: Scalar 1.2 GHz"),
    "gpsimd_hz": (URL_TRN2_NKI, "Compute Engine Specifications: GpSimd 1.2 GHz; assumption: N cycles per "
                  "instruction like ScalarE (the guides give no GpSimd cost model)"),
    "vector_cycles": (URL_TRN1_NKI, "VectorE cost: ~N cycles with one input tile, ~2N with two (N elements per "
                      "partition); NeuronCore-v3 performance mode (trn2 guide): tensor_copy / tensor_scalar 4x for "
                      "bf16 SBUF contiguous, 2x bf16 with PSUM or strided; tensor_tensor 2x for bf16 SBUF inputs"),
    "access_overhead_cycles": (URL_TRN1_NKI, "tensor access request static overhead ~60 cycles (NeuronCore-v2); "
                               "assumption: the same on v3, and never hidden (the guide says engines hide some)"),
    "hbm_bytes_per_s_chip": (URL_TRN2_CHIP, "96 GiB of device memory with 2.9 TB/sec of bandwidth"),
    "cores_per_chip": (URL_TRN2_CHIP, "eight NeuronCore-v3 per Trainium2 chip; assumption: HBM bandwidth shared "
                       "evenly, so an LNC=2 rank gets 2/8"),
    "dma_engines": (URL_DMA, "each NeuronCore (v2-v4) is paired with 16 DMA engines; each engine covers 8 "
                    "partitions of a 128-partition transfer"),
    "dma_engine_bytes_per_s": (URL_DMA, "theoretical bandwidth of 27.2 GB/s per DMA engine (NeuronCore-v2, -v3)"),
    "dma_fixed_s": (URL_DMA, "derived: example 1's profile shows one engine moving 32 KiB in 1416 ns; 32 KiB at "
                    "27.2 GB/s is 1205 ns, leaving ~0.21 us fixed cost per transfer per engine (assumption: for "
                    "every transfer size)"),
}

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")


def _elementwise_cycles(op: str, w: Elementwise, r: Rates, performance_modes: bool) -> float:
    """VectorE cost model: inputs x N cycles, divided by the NeuronCore-v3 performance-mode speedup."""
    speedup = 1
    if performance_modes and w.bf16:
        if op in ("tensor_copy", "tensor_scalar"):
            speedup = 4 if (w.contiguous and w.psum == 0) else 2
        elif op == "tensor_tensor" and w.sbuf_inputs == w.inputs:
            speedup = 2
    return w.inputs * w.free / speedup + r.access_overhead_cycles


def instruction_seconds(engine: str, op: str, work, r: Rates = TRN2) -> float:
    """Busy time of one instruction on its engine (DMA: on its core's DMA engines, ignoring HBM)."""
    if isinstance(work, Matmul):
        return max(work.n, r.matmul_min_cycles) * (r.fp32_matmul_factor if work.fp32 else 1) / r.tensor_hz
    if isinstance(work, Transpose):  # stationary = data [p, f], moving = identity [p, p]
        return max(work.p, r.matmul_min_cycles) * (r.fp32_transpose_factor if work.fp32 else 1) / r.tensor_hz
    if isinstance(work, Elementwise):
        hz = {"vector": r.vector_hz, "scalar": r.scalar_hz, "gpsimd": r.gpsimd_hz}[engine]
        return _elementwise_cycles(op, work, r, engine == "vector") / hz
    if isinstance(work, Dma):
        engines = min(r.dma_engines, -(-work.partitions // r.dma_partitions_per_engine))
        return (engines * r.dma_fixed_s + work.nbytes / r.dma_engine_bytes_per_s) / r.dma_engines
    raise TypeError(f"no time model for {op} on {engine}: work descriptor {work!r}")


@dataclass
class Timing:
    """The model's result for one set of counters (seconds)."""

    per_core: list[dict] = field(default_factory=list)  # core -> engine -> busy seconds
    hbm_s: list[float] = field(default_factory=list)  # core -> HBM bytes / its share of the bandwidth
    dma_queue_s: list[float] = field(default_factory=list)  # core -> its DMA engines' busy time
    hbm_bytes: int = 0
    unmodeled: dict = field(default_factory=dict)  # (engine, op) -> executed instructions without a descriptor

    @property
    def engines(self) -> dict:
        """engine -> busy seconds of the busiest core."""
        return {e: max((c.get(e, 0.0) for c in self.per_core), default=0.0) for e in ENGINES}

    @property
    def overlap_s(self) -> float:
        return max(self.engines.values(), default=0.0)

    @property
    def serial_s(self) -> float:
        return max((sum(c.values()) for c in self.per_core), default=0.0)

    @property
    def bound(self) -> str:
        """The busiest engine ("dma" when the DMA time is its HBM share's, "dma-queues" when the transfers' own
        cost dominates)."""
        engines = self.engines
        name = max(engines, key=engines.get)
        if name == "dma" and max(self.dma_queue_s, default=0) > max(self.hbm_s, default=0):
            return "dma-queues"
        return name


SEQUENCER = ("register", "control", "sync")  # engine sequencer instructions: not modelled


def model(counters, rates: Rates = TRN2) -> Timing:
    """The engine busy times of everything recorded in `counters` (a `Counters` from `nki_emulator.counters()`)."""
    cores = 1 + max((core for core, *_ in counters.work), default=0)
    t = Timing(per_core=[{e: 0.0 for e in ENGINES} for _ in range(cores)], hbm_s=[0.0] * cores,
               dma_queue_s=[0.0] * cores)
    hbm = [0] * cores
    for (core, engine, op, work), n in counters.work.items():
        if engine in SEQUENCER:
            continue
        if work is None:
            t.unmodeled[(engine, op)] = t.unmodeled.get((engine, op), 0) + n
            continue
        seconds = n * instruction_seconds(engine, op, work, rates)
        if engine == "dma":
            t.dma_queue_s[core] += seconds
            hbm[core] += n * work.hbm_bytes
        else:
            t.per_core[core][engine] += seconds
    for core in range(cores):
        t.hbm_s[core] = hbm[core] / rates.hbm_bytes_per_s
        t.per_core[core]["dma"] = max(t.hbm_s[core], t.dma_queue_s[core])
    t.hbm_bytes = sum(hbm)
    return t
