"""What kernel launches did, counted: instructions per engine (static and executed), DMAs, PE FLOPs, loop trips,
on-chip peaks, HBM allocations and, on request, each core's instruction trace (`timing.schedule` replays it)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class HbmAllocation:
    """One HBM tensor a kernel call allocated (`nl.ndarray` in nl.hbm / nl.shared_hbm). output: its position among
    the kernel's outputs (it outlives the call), or None: scratch, freed when the call ends."""

    name: str
    shape: tuple
    dtype: torch.dtype
    buffer: str
    output: int | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Counters:
    """What the kernels launched inside `with counters() as c:` did (all launches summed).

    static: engine -> instructions in the traced program (one launch: max over its cores);
    executed: engine -> instructions executed by all cores, every dynamic-loop iteration counted;
    dma_sizes: one (bytes, bytes_per_partition, src_name, dst_name) per executed DMA;
    pe_flops: 2*K*M*N per executed nc_matmul plus 2*P*P*F per Tensor Engine transpose (a matmul against identity
    on the PE array; that part alone is pe_transpose_flops);
    loop_trips: "file:line" of a compiled loop -> iterations run (all cores);
    loop_trips_per_core: "file:line" of a compiled loop -> [iterations on core 0, core 1, ...] (entries that differ
    are a loop whose trip counts diverged between the cores: the `lnc-divergent-control` rule stops such a launch);
    sbuf_peak / psum_peak: the most on-chip bytes per partition live at once on any core (max over launches);
    gathered_rows: source tensor name -> rows read by indirect row gathers (`vector_offset` DMAs);
    hbm_allocations: every HBM tensor the launches allocated, in order (`HbmAllocation`; a shared_hbm tensor once,
    an nl.hbm one per core that allocates it);
    padding_rows: source name -> those of them that were entirely zero. "Padding slots computed" is
    padding_rows[x] for the gather that feeds a kernel's compute its input rows x: padding slots read a zero row
    (a real token whose row is exactly zero would count too; the MoE cost report cross-checks the host plan);
    work: (core, engine, op, work descriptor) -> instructions executed; the descriptor (timing.Matmul, Transpose,
    Elementwise, Dma; None where an instruction records none) is what `timing.model` turns into engine time;
    trace: with `counters(trace=True)`, one entry per launch: per core, the executed instructions in program order,
    each `(engine, op, work, site, accesses)`, accesses `(storage key, "r"|"w", row0, row1, col0, col1)` (the box
    it touched: see `Launch.touch`); a compiled loop's branch is `("control", loop, None, site, ())` per
    iteration. What `timing.schedule` replays on per-engine queues; None when not asked for.
    """

    static: dict = field(default_factory=dict)
    executed: dict = field(default_factory=dict)
    dma_count: int = 0
    dma_bytes: int = 0
    dma_sizes: list = field(default_factory=list)
    pe_flops: int = 0
    pe_transpose_flops: int = 0
    loop_trips: dict = field(default_factory=dict)
    loop_trips_per_core: dict = field(default_factory=dict)
    launches: int = 0
    sbuf_peak: int = 0
    psum_peak: int = 0
    gathered_rows: dict = field(default_factory=dict)
    padding_rows: dict = field(default_factory=dict)
    work: dict = field(default_factory=dict)
    hbm_allocations: list = field(default_factory=list)
    trace: list | None = None

    @property
    def static_total(self) -> int:
        return sum(self.static.values())

    @property
    def executed_total(self) -> int:
        return sum(self.executed.values())


active_counters: list[Counters] = []


@contextlib.contextmanager
def counters(trace: bool = False):
    """Collect `Counters` over every kernel launch inside the block (nesting allowed: all active ones count);
    `trace`: also record each launch's instruction trace (`Counters.trace`, for `timing.schedule`)."""
    c = Counters(trace=[] if trace else None)
    active_counters.append(c)
    try:
        yield c
    finally:
        active_counters.remove(c)


def bump(d: dict, key, n=1):
    d[key] = d.get(key, 0) + n


# -- registers -------------------------------------------------------------------------------------------------------


def merge(into: Counters, add: Counters) -> None:
    for d_into, d_add in ((into.static, add.static), (into.executed, add.executed), (into.loop_trips, add.loop_trips),
                          (into.gathered_rows, add.gathered_rows), (into.padding_rows, add.padding_rows),
                          (into.work, add.work)):
        for k, v in d_add.items():
            bump(d_into, k, v)
    for site, trips in add.loop_trips_per_core.items():
        old = into.loop_trips_per_core.get(site, [])
        n = max(len(old), len(trips))
        old, trips = old + [0] * (n - len(old)), list(trips) + [0] * (n - len(trips))
        into.loop_trips_per_core[site] = [a + b for a, b in zip(old, trips, strict=True)]
    into.dma_count += add.dma_count
    into.dma_bytes += add.dma_bytes
    into.dma_sizes.extend(add.dma_sizes)
    into.hbm_allocations.extend(add.hbm_allocations)
    into.pe_flops += add.pe_flops
    into.pe_transpose_flops += add.pe_transpose_flops
    into.launches += add.launches
    into.sbuf_peak = max(into.sbuf_peak, add.sbuf_peak)
    if into.trace is not None and add.trace is not None:
        into.trace.append(add.trace)
    into.psum_peak = max(into.psum_peak, add.psum_peak)
