"""A trn2 time model over the emulator's counters and instruction trace.

Two models, one set of rates (NeuronCore-v3 / Trainium2, each cited in `SOURCES`; a rate no doc states is marked
an assumption there, a constant fitted to a published timing is marked FITTED):

`schedule(c)`, the dependency model (`c` recorded with `counters(trace=True)`): each launch's instruction trace
replayed on each core's in-order queues. An instruction starts when its queue is free and its operands are ready:
read-after-write, write-after-write and write-after-read through the boxes of SBUF / PSUM / HBM tensors and the
registers it touches (so reusing one workspace tile or one PSUM bank serialises, and a bank or buffer in rotation
does not), and a core barrier waits for every core's earlier instructions. Each core keeps its own record of
accesses, cleared at each barrier: between barriers the cores touch disjoint parts of shared HBM (the emulator's
race check refuses a launch where they do not), so one core's accesses never order the other's. Queues: Tensor,
Vector, Scalar and GpSimd engines, the register sequencer, two hardware DGE instances and the core's 16 DMA engines.
A DMA first generates its descriptors (hardware DGE, ~600 ns; an indirect gather/scatter on GpSimd, software DGE),
then moves its bytes on min(16, partitions / 8) engines (fixed cost + bytes at 23 B/ns each) and through the core's
share of HBM bandwidth. The DMA engines and the HBM link are booked by time (`_Booked`): a transfer takes the first
idle gap at or after its descriptors exist, so a load ready early is not held behind a store the program issued
before it but whose operands came later (descriptors reach the engines' rings in time order; serving them in
program order would serialise every DMA of a kernel). A DMA that waits on another DMA's completion
pays the ~1.3 us semaphore latency. A compiled loop's branch costs every engine `branch_s`. The result: the
launches' makespans (the headline `model_ms` of the MoE cost report), each engine's busy and waiting time, and the
stalls by waiting source line and what it waited for. Not modelled: the compiler's reordering inside a basic block
(the replay keeps program order per queue), the DMA queue assignment (a DMA takes the DGE instance free first), HBM
bank conflicts, bandwidth shared between concurrent transfers (a transfer booked first holds an engine or the HBM
link for its whole length: a small transfer behind a big one waits for all of it).

`model(c)`, the throughput model (the bracket): per engine, the sum of its instructions' costs.

    tensor   per nc_matmul max(N, 64) cycles (N: moving free size), x4 for fp32 operands; a PE transpose is a
             matmul against an identity of the partition size (x2 for fp32: NeuronCore-v3's transpose mode);
             at 2.4 GHz. A full [128 x 128] x [128 x N] matmul is then 2*128*128*N FLOPs in N cycles: 79 TFLOPS.
    vector   per instruction (tensor inputs x N) cycles / the performance-mode speedup (bf16, SBUF) + a fixed
             tensor-access overhead, N = elements per partition, at 0.96 GHz; scalar (activation) the same
             without performance modes at 1.2 GHz; gpsimd like scalar (an assumption: no documented cost model).
    dma      per physical core max(HBM bytes / its share of the chip's HBM bandwidth,
             the transfers on its 16 DMA engines: per transfer a fixed cost on each engine it uses + bytes at
             23 GB/s per engine, spread over the 16).
    register / control / sync: 0 s in this model (the dependency model charges them).

Bounds: `overlap_s` = the busiest engine of the busiest core (every engine runs concurrently and nothing waits),
`serial_s` = the largest per-core sum over engines (nothing overlaps). Both leave out latency (DGE, semaphores),
so a latency-bound kernel's dependency time can exceed `serial_s`. Instructions that record no work descriptor are
counted in `unmodeled` and cost nothing, so a caller can tell that the model saw all of a kernel or not.

Any kernel run under `counters()` can be fed through either: this project's MoE kernels
(benchmarks/nki_moe_cost.py), or another kernel's counters (e.g. AWS's nki-library kernels on this emulator).
Nothing here was measured on Trainium.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import NamedTuple

DOCS = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest"
URL_TRN2_NKI = f"{DOCS}/nki/about/trainium2_arch.html"  # Trainium2 Architecture Guide for NKI
URL_TRN1_NKI = f"{DOCS}/nki/about/trainium_inferentia2_arch.html"  # Trainium/Inferentia2 Architecture Guide for NKI
URL_NC_V3 = f"{DOCS}/about-neuron/arch/neuron-hardware/neuron-core-v3.html"
URL_TRN2_CHIP = f"{DOCS}/about-neuron/arch/neuron-hardware/trainium2.html"
URL_DMA = f"{DOCS}/nki/about/nki-dma-overview.html"
URL_DMA_BW = f"{DOCS}/nki/deep-dives/nki-dma-bandwidth-guide.html"
URL_DGE = f"{DOCS}/nki/api/generated/nki.isa.dma_copy.html"
URL_MATMUL = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.nc_matmul.html"
URL_MATMUL_COST = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.26.1/nki/api/generated/nki.isa.nc_matmul.html"


# -- work descriptors (recorded by nki_emulator.isa for each traced instruction; static, hashable) ---------------------
class Matmul(NamedTuple):
    """nc_matmul: stationary [k, m], moving [k, n]; fp32: both operands fp32; `tile`: the PE tile of a tiled
    matmul, (start_row, row_size, start_column, column_size), () for the whole array."""

    k: int
    m: int
    n: int
    fp32: bool
    tile: tuple = ()


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
    `partitions` SBUF partitions (the SBUF side; HBM -> HBM: the destination's outer dim, `dma_work`); `rows`: the
    rows of an indirect (vector_offset) gather or scatter, whose descriptors software DGE generates on GpSimd (0:
    hardware DGE)."""

    nbytes: int
    hbm_bytes: int
    partitions: int
    rows: int = 0
    transpose: str = ""  # dma_transpose: "hbm" (HBM -> SBUF, or an indirect gather-transpose), "sbuf" (SBUF -> SBUF)


def _operand_facts(t):
    """(itemsize, in PSUM, innermost stride 1, in SBUF) of an on-chip view."""
    from .memory import PSUM, SBUF

    data = getattr(t, "_data", None)
    contiguous = data is None or data.dim() == 0 or data.stride()[-1] == 1 or data.shape[-1] == 1
    return t.dtype.itemsize, t.buffer is PSUM, contiguous, t.buffer is SBUF


def matmul_work(stationary, moving, tile=()) -> Matmul:
    import torch

    (k, m), (_, n) = stationary.shape, moving.shape
    return Matmul(k, m, n, stationary.dtype == torch.float32, tuple(tile))


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


def dma_work(dst, *srcs, transpose: str = "") -> Dma:
    """A DMA writing dst from srcs (dma_compute: several sources); `transpose`: see `Dma`."""
    from .memory import HBM, SBUF, SHARED_HBM

    def nbytes(t):
        return math.prod(t.shape) * t.dtype.itemsize

    ends = (dst, *srcs)
    moved = sum(nbytes(s) for s in srcs)
    hbm = sum(nbytes(t) for t in ends if t.buffer in (HBM, SHARED_HBM))
    sbuf = next((t for t in ends if t.buffer is SBUF), None)
    rows = max((t.pattern[0][1] for t in ends if getattr(t, "vector_offset", None) is not None), default=0)
    # SBUF side: its partitions (an int-indexed partition: 1); HBM -> HBM: the destination's outer dim, spread
    # over the engines like partitions (assumption: the DMA overview says only "depending on the shape")
    parts = sbuf.shape[0] if sbuf is not None and sbuf.shape else 1 if sbuf is not None else dst.shape[0]
    return Dma(moved, hbm, parts, rows, transpose)


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
    dma_engine_bytes_per_s: float = 23e9
    dma_partitions_per_engine: int = 8
    dma_fixed_s: float = 9e-9  # FITTED (to the DMA overview's two profiles, docs/nki_kernels.md "Calibration")
    dge_hw_s: float = 0.6e-6
    dge_instances: int = 2
    dge_sw_s: float = 0.6e-6
    dge_sw_row_cycles: int = 16
    dma_semaphore_s: float = 1.3e-6
    sequencer_s: float = 50e-9
    branch_s: float = 50e-9
    performance_modes: bool = True  # NeuronCore-v3's Vector Engine bf16 performance modes
    pe_tiles_concurrent: bool = True  # assumption: matmuls on disjoint PE tiles run at the same time
    dma_transpose_hbm_efficiency: float = 0.9  # of the DMA engines' rate, HBM -> SBUF transpose ("up to 90%")
    dma_transpose_sbuf_efficiency: float = 0.5  # SBUF -> SBUF transpose ("up to 50%")

    @property
    def hbm_bytes_per_s(self) -> float:
        """One physical core's share of the chip's HBM bandwidth."""
        return self.hbm_bytes_per_s_chip / self.cores_per_chip


TRN2 = Rates()

# One NeuronCore-v2 and its share of a Trainium1 chip: only for calibrating against AWS's trn1 tutorials
# (benchmarks/nki_calibration.py); each figure that differs from TRN2 is cited in `TRN1_SOURCES`.
TRN1 = Rates(tensor_hz=2.8e9, pe_bf16_flops=92e12, fp32_transpose_factor=4, vector_hz=1.12e9, scalar_hz=1.4e9,
             gpsimd_hz=1.4e9, hbm_bytes_per_s_chip=820e9, cores_per_chip=2, dma_engine_bytes_per_s=17e9,
             dge_hw_s=0.0, performance_modes=False)

# Where each rate comes from (URL, what it says); "assumption" where no doc states the trn2 figure.
SOURCES = {
    "tensor_hz": (URL_TRN2_NKI, "Compute Engine Specifications: Tensor 2.4 GHz"),
    "matmul_min_cycles": (URL_MATMUL_COST, "nc_matmul 'Estimated instruction cost' (pages for Inf2, Trn1, Trn2): "
                          "max(min(64, N_stationary), N_moving) Tensor Engine cycles for bf16/fp16/tf32/fp8, 4x that "
                          "for fp32; nc_transpose on the Tensor Engine: max(P, min(64, F))"),
    "pe_tiles_concurrent": (URL_MATMUL, "PE tiling 'allow[s] multiple nc_matmul instructions with a stationary tile "
                            "size smaller than [128, 128] to run in parallel'; assumption: fully in parallel, each "
                            "at its own max(min(64, N_stationary), N_moving) (no cycle figure is published); False: "
                            "serialised, as without tiling"),
    "dma_transpose_hbm_efficiency": (URL_TRN2_NKI, "HBM2SBUF DMA transpose 'can achieve up to 90% DMA throughput "
                                     "utilization given hardware-friendly tensor access patterns'; assumption: the "
                                     "indirect gather-transpose (software DGE) moves its bytes at the same rate"),
    "dma_transpose_sbuf_efficiency": (URL_TRN2_NKI, "SBUF2SBUF transpose 'can achieve up to 50% of DMA throughput "
                                      "on Trainium2'"),
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
    "dma_partitions_per_engine": (URL_DMA, "each of the 16 engines covers 8 partitions of a 128-partition "
                                  "transfer"),
    "dma_engine_bytes_per_s": (URL_DMA_BW, "23 B/ns per DMA engine on trn2 (the DMA overview's 27.2 GB/s is the "
                               "theoretical figure); with it the overview's two profiles fit one fixed cost"),
    "dma_fixed_s": (URL_DMA, "FITTED: the overview's profiles, 32 KiB on one engine in 1,416 ns and 2 KiB per engine "
                    "on 16 engines in 97 ns, give 23.3 B/ns and ~9 ns per packet; 9 ns with the 23 B/ns above"),
    "dge_hw_s": (URL_TRN2_NKI, "~600 ns per hardware-DGE DMA instruction (descriptor generation before the engines "
                 "move bytes); assumption: it also occupies its DGE instance for that time (not pipelined)"),
    "dge_instances": (URL_TRN2_NKI, "two hardware DGE instances per NeuronCore-v3 (trn2-readiness 7.4)"),
    "dge_sw_s": (URL_DGE, "software DGE (indirect gathers/scatters) generates descriptors on GpSimd; assumption: "
                 "the hardware DGE's 600 ns per instruction plus `dge_sw_row_cycles` GpSimd cycles per row (no doc "
                 "gives a software-DGE cost)"),
    "dge_sw_row_cycles": (URL_DGE, "assumption: 16 GpSimd cycles per descriptor row"),
    "dma_semaphore_s": (URL_TRN2_NKI, "~1,300 ns semaphore-to-start latency across DMA engines: charged when a DMA "
                        "waits on another DMA's completion (assumption: not when a compute engine waits on a DMA)"),
    "performance_modes": (URL_TRN2_NKI, "Vector Engine Performance Mode: tensor_copy / tensor_scalar up to 4x, "
                          "tensor_tensor 2x for bf16 (the costs in `vector_cycles`)"),
    "sequencer_s": ("assumption", "register instructions (register_load / move / store) take 50 ns on the "
                    "sequencer that runs them; no doc gives a figure"),
    "branch_s": ("assumption", "a compiled loop's compare-and-branch takes 50 ns on every engine's instruction "
                 "stream (each engine runs the loop); no doc gives a figure"),
}

URL_TRN1_CHIP = f"{DOCS}/about-neuron/arch/neuron-hardware/trainium.html"
TRN1_SOURCES = {
    "tensor_hz": (URL_TRN1_NKI, "engine table: Tensor 2.8 GHz (NeuronCore-v2)"),
    "pe_bf16_flops": (URL_TRN1_NKI, "BF16/FP16/TF32/cFP8 at a maximum throughput of 92 TFLOPS, 23 TFLOPS FP32"),
    "fp32_transpose_factor": (URL_TRN1_NKI, "assumption: a PE transpose is a matmul, fp32 at the matmul's 4x "
                              "(the 2x FP32 transpose mode is NeuronCore-v3's, Trainium2 guide)"),
    "vector_hz": (URL_TRN1_NKI, "engine table: Vector 1.12 GHz"),
    "scalar_hz": (URL_TRN1_NKI, "engine table: Scalar 1.4 GHz"),
    "gpsimd_hz": (URL_TRN1_NKI, "engine table: GpSimd 1.4 GHz"),
    "hbm_bytes_per_s_chip": (URL_TRN1_NKI, "2 HBM stacks ... bandwidth of 820 GB/s (per Trainium device)"),
    "cores_per_chip": (URL_TRN1_CHIP, "two NeuronCore-v2 per Trainium chip; assumption: HBM shared evenly"),
    "dma_engine_bytes_per_s": (URL_DMA_BW, "TRN1: 17 B/ns per engine, 16 engines, 272 GB/s per NeuronCore (the "
                               "architecture guide's 27 GiB/s per engine is the peak)"),
    "dge_hw_s": (URL_DGE, "assumption: 0 on NeuronCore-v2: descriptor-generation engines are NeuronCore-v3's; a "
                 "trn1 DMA's descriptors are built by the compiler ahead of time"),
    "performance_modes": (URL_TRN2_NKI, "the Vector Engine's bf16 performance modes are introduced with "
                          "NeuronCore-v3 (Trainium2 guide); none on v2"),
}

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "dma")


def _elementwise_cycles(op: str, w: Elementwise, r: Rates, performance_modes: bool) -> float:
    """VectorE cost model: inputs x N cycles, divided by the NeuronCore-v3 performance-mode speedup; bn_aggr
    13 N / 3 (its ISA page: 13 * (N / 3) Vector Engine cycles)."""
    if op == "bn_aggr":
        return 13 * w.free / 3 + r.access_overhead_cycles
    speedup = 1
    if performance_modes and w.bf16:
        if op in ("tensor_copy", "tensor_scalar"):
            speedup = 4 if (w.contiguous and w.psum == 0) else 2
        elif op == "tensor_tensor" and w.sbuf_inputs == w.inputs:
            speedup = 2
    return w.inputs * w.free / speedup + r.access_overhead_cycles


def instruction_seconds(engine: str, op: str, work, r: Rates = TRN2) -> float:
    """Busy time of one instruction on its engine (DMA: on its core's DMA engines, ignoring HBM)."""
    if isinstance(work, Matmul):  # max(min(64, N_stationary), N_moving) cycles (nc_matmul page)
        cycles = max(min(r.matmul_min_cycles, work.m), work.n)
        return cycles * (r.fp32_matmul_factor if work.fp32 else 1) / r.tensor_hz
    if isinstance(work, Transpose):  # max(P, min(64, F)) cycles (nc_transpose page): data [P, F] stationary
        cycles = max(work.p, min(r.matmul_min_cycles, work.f))
        return cycles * (r.fp32_transpose_factor if work.fp32 else 1) / r.tensor_hz
    if isinstance(work, Elementwise):
        hz = {"vector": r.vector_hz, "scalar": r.scalar_hz, "gpsimd": r.gpsimd_hz}[engine]
        return _elementwise_cycles(op, work, r, r.performance_modes and engine == "vector") / hz
    if isinstance(work, Dma):
        engines = min(r.dma_engines, -(-work.partitions // r.dma_partitions_per_engine))
        return (engines * r.dma_fixed_s + work.nbytes / dma_engine_rate(work, r)) / r.dma_engines
    raise TypeError(f"no time model for {op} on {engine}: work descriptor {work!r}")


def dma_engine_rate(work: Dma, r: Rates) -> float:
    """Bytes per second of one DMA engine for this transfer: the engines' rate, times the documented utilization of a
    DMA transpose (Trainium2 guide: HBM -> SBUF "up to 90% DMA throughput utilization", SBUF -> SBUF "up to 50%")."""
    if work.transpose == "hbm":
        return r.dma_engine_bytes_per_s * r.dma_transpose_hbm_efficiency
    if work.transpose == "sbuf":
        return r.dma_engine_bytes_per_s * r.dma_transpose_sbuf_efficiency
    return r.dma_engine_bytes_per_s


def pe_share(work, r: Rates) -> float:
    """The share of the PE array an instruction holds: a tiled matmul its tile's (when tiles run concurrently,
    `Rates.pe_tiles_concurrent`), anything else all of it."""
    if not (isinstance(work, Matmul) and work.tile and r.pe_tiles_concurrent):
        return 1.0
    return work.tile[1] * work.tile[3] / (128 * 128)


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
        seconds = n * instruction_seconds(engine, op, work, rates) * pe_share(work, rates)
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


# -- the dependency model: the trace replayed on per-engine in-order queues ------------------------------------------
QUEUES = ("tensor", "vector", "scalar", "gpsimd", "register")  # in-order instruction queues of one core
COMPUTE = ("tensor", "vector", "scalar", "gpsimd")
_PRUNE = 512  # accesses kept per storage before the oldest are merged into one (conservative) range


@dataclass
class Schedule:
    """`schedule(counters)`: the launches replayed one after the other (seconds).

    seconds: the sum of the launches' makespans (slowest core of each); busy / waiting: engine -> seconds summed
    over cores and launches (waiting: the engine idle while its next instruction waits for an operand, a DGE, a
    barrier); core_seconds: sum over launches of makespan x cores (the denominator of the shares); dma busy is
    engine-seconds of the core's 16 DMA engines / 16; stalls: (engine, waiting site, what it waited for) ->
    seconds; launches: each launch's makespan."""

    seconds: float = 0.0
    busy: dict = field(default_factory=lambda: {e: 0.0 for e in ENGINES})
    waiting: dict = field(default_factory=lambda: {e: 0.0 for e in ENGINES})
    core_seconds: float = 0.0
    stalls: dict = field(default_factory=dict)
    launches: list = field(default_factory=list)

    def shares(self) -> dict:
        """engine -> {"busy": share of the cores' time, "waiting": share}."""
        d = self.core_seconds or 1.0
        return {e: {"busy": round(self.busy[e] / d, 4), "waiting": round(self.waiting[e] / d, 4)} for e in ENGINES}

    def top_stalls(self, n: int = 5) -> list:
        """The n largest stall causes: [{"engine", "site", "waits_for", "ms"}]."""
        top = sorted(self.stalls.items(), key=lambda kv: -kv[1])[:n]
        return [{"engine": e, "site": site, "waits_for": cause, "ms": round(t * 1e3, 4)} for (e, site, cause), t in top]


class _Booked:
    """A resource booked by time (one DMA engine, or the core's share of the HBM link): its busy intervals, sorted
    and disjoint. A transfer takes the first idle gap of its length at or after the time it may start, so a
    transfer described early is not held behind one the program issued before it but that was described later
    (the replay visits instructions in program order; descriptors reach the engines' rings in time order)."""

    __slots__ = ("starts", "ends")

    def __init__(self):
        self.starts: list[float] = []
        self.ends: list[float] = []

    def fit(self, t0: float, d: float) -> float:
        """The earliest start >= t0 of an idle gap at least d long."""
        i, t = bisect.bisect_right(self.ends, t0), t0
        while i < len(self.starts) and self.starts[i] < t + d:
            t = max(t, self.ends[i])
            i += 1
        return t

    def book(self, s: float, e: float) -> None:
        """Mark [s, e) busy (free by `fit`), merged with touching neighbours."""
        i = bisect.bisect_left(self.starts, s)
        if i > 0 and self.ends[i - 1] >= s:
            i -= 1
            s = self.starts[i]
            e = max(e, self.ends[i])
            del self.starts[i], self.ends[i]
        while i < len(self.starts) and self.starts[i] <= e:
            e = max(e, self.ends[i])
            del self.starts[i], self.ends[i]
        self.starts.insert(i, s)
        self.ends.insert(i, e)

    def forget_before(self, t: float) -> None:
        """Merge the intervals that end at or before t into one (no later transfer can start before t)."""
        i = bisect.bisect_right(self.ends, t)
        if i > 1:
            self.starts[: i] = [self.starts[0]]
            self.ends[: i] = [self.ends[i - 1]]

    def end(self) -> float:
        return self.ends[-1] if self.ends else 0.0


class _Core:
    """One core's queues during a replay."""

    def __init__(self, r: Rates):
        self.free = {q: 0.0 for q in QUEUES}
        # the PE array in 4 x 4 cells of 32 x 32 PEs: when each is free again (a tiled matmul holds only its tile's
        # cells); `pe_issue`: the start of the Tensor Engine's last instruction (its queue issues in order)
        self.pe = [0.0] * 16
        self.pe_issue = 0.0
        self.dge = [0.0] * r.dge_instances
        self.dma = [_Booked() for _ in range(r.dma_engines)]
        self.hbm = _Booked()
        self.end = 0.0  # latest completion so far
        self.issued = 0  # DMAs replayed (the booked resources are pruned every `_PRUNE` of them)
        # storage key -> [(box, end, engine, site)] of this core's writes / reads since the last core barrier. Per
        # core: within a barrier phase the cores touch disjoint parts of shared HBM (the emulator's race check
        # stops a launch where they do not), so one core's accesses never order the other's; a merged (pruned)
        # box of one core's rows must not hold back the other core's rows inside its span
        self.writes: dict = {}
        self.reads: dict = {}


def _overlaps(entries, box, best, cause, label):
    """The latest end among `entries` whose box overlaps `box` (rows r0..r1, columns c0..c1), and its cause
    (label, producer engine, its site)."""
    r0, r1, c0, c1 = box
    for er0, er1, ec0, ec1, end, engine, site in entries:
        if end > best and er0 <= r1 and r0 <= er1 and ec0 <= c1 and c0 <= ec1:
            best, cause = end, (label, engine, site)
    return best, cause


def _note(c: _Core, table, key, box, end, engine, site):
    entries = table.setdefault(key, [])
    entries.append((*box, end, engine, site))
    if len(entries) > _PRUNE:
        # first drop what can no longer delay anything: an entry that ends by the time every queue of this core
        # (and its DGEs) is free again cannot hold back a later instruction, which starts no earlier than that
        horizon = min(min(c.free.values()), min(c.dge))
        entries[:] = [e for e in entries if e[4] > horizon]
    if len(entries) > _PRUNE:  # merge the oldest half: a wider box, the latest end (can only delay, never hasten)
        old = entries[: _PRUNE // 2]
        entries[: _PRUNE // 2] = [(min(e[0] for e in old), max(e[1] for e in old), min(e[2] for e in old),
                                   max(e[3] for e in old), max(e[4] for e in old), old[-1][5], old[-1][6])]


def _stall(out, engine, site, cause, seconds) -> None:
    what = cause if isinstance(cause, str) else "?" if cause is None else f"{cause[0]} {cause[1]} at {cause[2]}"
    key = (engine, site, what)
    out.stalls[key] = out.stalls.get(key, 0.0) + seconds
    out.waiting[engine] += seconds


def schedule(counters, rates: Rates = TRN2) -> Schedule:
    """Replay the instruction trace of every launch in `counters` (recorded with `counters(trace=True)`) on each
    core's in-order queues (module docstring: the rules) and return the timeline's figures."""
    if counters.trace is None:
        raise ValueError("schedule() needs the instruction trace: collect with nki_emulator.counters(trace=True)")
    out = Schedule()
    for launch in counters.trace:
        span = _replay(launch, rates, out)
        out.launches.append(span)
        out.seconds += span
        out.core_seconds += span * len(launch)
    return out


def _replay(cores_trace, r: Rates, out: Schedule) -> float:
    """One launch: the cores run concurrently between core barriers; returns its makespan."""
    cores = [_Core(r) for _ in cores_trace]
    pos = [0] * len(cores)
    while True:
        ended = True
        for k, trace in enumerate(cores_trace):
            i = pos[k]
            while i < len(trace) and not (trace[i][0] == "sync" and trace[i][1] == "core_barrier"):
                _issue(cores[k], trace[i], r, out)
                i += 1
            pos[k] = i + 1
            ended = ended and i >= len(trace)
        if ended:
            break
        t = max(c.end for c in cores)  # the barrier: every core's earlier instructions complete first
        for c in cores:
            for q in QUEUES:
                if c.free[q] < t:
                    if q in ENGINES:
                        _stall(out, q, "core_barrier", "the other core", t - c.free[q])
                    c.free[q] = t
            c.pe = [max(x, t) for x in c.pe]
            c.pe_issue = max(c.pe_issue, t)
            c.dge = [max(x, t) for x in c.dge]
            for b in (*c.dma, c.hbm):  # nothing after the barrier moves before it
                if b.end() < t:
                    b.book(b.end(), t)
            c.end = t
            c.writes.clear()  # everything before the barrier has ended by t, when every queue starts again
            c.reads.clear()
    return max(c.end for c in cores)


def _issue(c: _Core, ins, r: Rates, out: Schedule) -> None:
    engine, op, work, site, accesses = ins
    if engine == "control":  # every engine's stream runs the branch
        for q in COMPUTE:
            c.free[q] += r.branch_s
            out.busy[q] += r.branch_s
        c.pe = [x + r.branch_s for x in c.pe]
        return
    ready, cause = 0.0, None
    for key, kind, *box in accesses:
        ready, cause = _overlaps(c.writes.get(key, ()), box, ready, cause, "WAW" if kind == "w" else "RAW")
        if kind == "w":
            ready, cause = _overlaps(c.reads.get(key, ()), box, ready, cause, "WAR")
    consumed = None  # when the offsets ("o" reads) are consumed: the instruction's end, a DMA's descriptors
    if engine == "dma":
        end, consumed = _dma(c, work, r, ready, cause, site, out)
    elif engine == "tensor" and work is not None:
        end = _tensor(c, work, r, ready, cause, site, out)
    else:
        q = engine if engine in QUEUES else "register"
        seconds = r.sequencer_s if q == "register" or work is None else instruction_seconds(engine, op, work, r)
        start = max(c.free[q], ready)
        if start > c.free[q] and q in ENGINES:
            _stall(out, q, site, cause, start - c.free[q])
        end = c.free[q] = start + seconds
        if q in ENGINES:
            out.busy[q] += seconds
    c.end = max(c.end, end)
    for key, kind, *box in accesses:
        done = consumed if kind == "o" and consumed is not None else end
        _note(c, c.writes if kind == "w" else c.reads, key, box, done, engine, site)


def _cells(tile: tuple) -> list:
    """The 32 x 32 cells of the PE array a PE tile (start_row, row_size, start_column, column_size) covers."""
    out = []
    for i in range(tile[0] // 32, (tile[0] + tile[1]) // 32):
        for j in range(tile[2] // 32, (tile[2] + tile[3]) // 32):
            out.append(4 * i + j)
    return out


def _tensor(c: _Core, work, r: Rates, ready: float, cause, site: str, out: Schedule) -> float:
    """A Tensor Engine instruction: issued in order, it starts once its operands are ready and the PE cells it
    uses are free. A tiled matmul (when tiles run concurrently) holds only its tile's cells, so matmuls on disjoint
    tiles overlap; anything else holds the whole array. Busy time counts the array's share in use."""
    seconds = instruction_seconds("tensor", "", work, r)
    share = pe_share(work, r)
    cells = _cells(work.tile) if share < 1.0 else range(16)
    free = max(c.pe_issue, max(c.pe[i] for i in cells))
    start = max(free, ready)
    if start > free:
        _stall(out, "tensor", site, cause, start - free)
    end = start + seconds
    for i in cells:
        c.pe[i] = end
    c.pe_issue = start
    c.free["tensor"] = max(c.pe)
    out.busy["tensor"] += seconds * share
    return end


def _dma(c: _Core, w: Dma, r: Rates, ready: float, cause, site: str, out: Schedule) -> tuple[float, float]:
    """Descriptor generation (hardware DGE instance, or software DGE on GpSimd for indirect transfers), then the
    transfer on the core's DMA engines and its HBM share. Returns (completion time, descriptors made): the
    descriptors hold the addresses its offsets gave, so the offsets are free to change from then on."""
    if cause is not None and cause[1] == "dma":  # a DMA started by another DMA's completion semaphore
        ready += r.dma_semaphore_s
    if w.rows:  # software DGE: an instruction in GpSimd's in-order queue
        start = max(c.free["gpsimd"], ready)
        if start > c.free["gpsimd"]:
            _stall(out, "gpsimd", site, cause, start - c.free["gpsimd"])
        seconds = r.dge_sw_s + w.rows * r.dge_sw_row_cycles / r.gpsimd_hz
        c.free["gpsimd"] = described = start + seconds
        out.busy["gpsimd"] += seconds
    else:
        i = min(range(len(c.dge)), key=c.dge.__getitem__)
        start = max(c.dge[i], ready)
        if start > c.dge[i]:
            _stall(out, "dma", site, cause, (start - c.dge[i]) / len(c.dge))  # a DGE queue idle, waiting
        c.dge[i] = described = start + r.dge_hw_s
    # the transfer: its share on each of k engines (the k whose idle gaps open first) and its bytes through the
    # core's HBM share, each booked at the first idle gap at or after `described`
    k = min(r.dma_engines, -(-w.partitions // r.dma_partitions_per_engine))
    seconds = r.dma_fixed_s + w.nbytes / (k * dma_engine_rate(w, r))
    starts = sorted((b.fit(described, seconds), i) for i, b in enumerate(c.dma))[:k]
    end = starts[-1][0] + seconds
    for t, i in starts:
        c.dma[i].book(t, t + seconds)
    if w.hbm_bytes:
        h = w.hbm_bytes / r.hbm_bytes_per_s
        t = c.hbm.fit(described, h)
        c.hbm.book(t, t + h)
        end = max(end, t + h)
    c.issued += 1
    if c.issued % _PRUNE == 0:  # no later transfer is described before the DGE queues' earliest free time
        horizon = min(min(c.dge), c.free["gpsimd"])
        for b in (*c.dma, c.hbm):
            b.forget_before(horizon)
    out.busy["dma"] += k * seconds / r.dma_engines
    return end, described
