"""On-chip and HBM memory of the NKI emulator: the buffers, one allocation's storage, the on-chip budget by
liveness, and poison (elements no instruction wrote).

Everything is stored in torch CPU tensors of the declared dtype, so a bfloat16 tile really holds bfloat16 values
(every store rounds to nearest-even through `Tensor.copy_`). Each storage also carries an "initialised" mask:
NKI allocations are not initialised ("note that memory allocation does not initialize",
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/about/tiling-overview.html). An element no
instruction wrote is *poison*: hardware reads whatever is there, so reading it is not an error; every result it
contributes to is poison too (`tensors.Tensor.read_data` gives the mask, each instruction propagates it), and only
poison that reaches a kernel output or a value used as an index, offset or loop bound raises `uninitialized-read`,
naming the allocation it came from and the line that allocated it.

On-chip capacity is tracked per kernel call: a storage counts while any view of it is alive (CPython
reference counting frees it deterministically when the kernel drops its last reference).
"""

from __future__ import annotations

import contextlib
import heapq
import math
import weakref

import torch

from . import dtypes
from .errors import violation
from .launch import call_site, current

DOCS = "https://awsdocs-neuron.readthedocs-hosted.com/en"
URL_TILING = f"{DOCS}/latest/nki/about/tiling-overview.html"
URL_MEMORY = f"{DOCS}/latest/nki/about/memory-hierarchy-overview.html"
URL_TRN2 = f"{DOCS}/latest/nki/about/trainium2_arch.html"
URL_TILE_SIZE = f"{DOCS}/v2.33.0/nki/api/nki.language.tile_size.html"
URL_NKI_TENSOR = f"{DOCS}/v2.33.0/nki/api/generated/nki.language.NkiTensor.html"
URL_AP = f"{DOCS}/latest/nki/deep-dives/nki-aps.html"
URL_AP_CAST = f"{URL_AP}#reinterpret-cast-with-ap"
URL_LNC = f"{DOCS}/v2.33.1/nki/get-started/about/lnc.html"

# Hardware numbers (NeuronCore-v3 / Trainium2). 128 partitions; PSUM is 2 MiB = 128 x 16 KiB organised in
# 8 banks of 2 KiB (512 fp32) per partition; SBUF is 28 MiB = 128 x 224 KiB on NeuronCore-v3 (Trainium2
# Architecture Guide for NKI), of which a kernel may allocate `nl.tile_size.total_available_sbuf_size` per
# partition (tile_size page: "Usable SBUF free dimension per partition, in bytes"): 224 KiB less the compiler's
# reservations, 212,464 B, the value nki-library's memory manager allocates within (bwmm_bwd_dropless.py
# MAX_AVAILABLE_SBUF_SIZE = 224 * 1024 - 16384 - 8 - 520; the page itself prints no number). The capacity rule
# enforces the usable figure: a kernel sized against the raw 224 KiB can fail to allocate on hardware.
PMAX = 128
PSUM_BANK_BYTES = 2048
PSUM_PARTITION_BYTES = 8 * PSUM_BANK_BYTES
SBUF_RAW_PARTITION_BYTES = 224 * 1024
SBUF_PARTITION_BYTES = SBUF_RAW_PARTITION_BYTES - 16384 - 8 - 520  # usable: 212,464 B
GEMM_STATIONARY_FMAX = 128
GEMM_MOVING_FMAX = 512

PSUM_BANKS = 8

FLOAT_DTYPES = dtypes.FLOAT




class Buffer:
    """A memory kind: `nl.sbuf`, `nl.psum`, `nl.hbm`, `nl.shared_hbm`."""

    def __init__(self, name: str):
        self.name = name

    @property
    def on_chip(self) -> bool:
        return self.name in ("sbuf", "psum")

    def __repr__(self) -> str:
        return f"nl.{self.name}"


SBUF, PSUM, HBM, SHARED_HBM = Buffer("sbuf"), Buffer("psum"), Buffer("hbm"), Buffer("shared_hbm")


class Budget:
    """On-chip memory (SBUF and PSUM) of one core, allocated by liveness the way the compiler allocates it.

    A tile occupies its bytes per partition from its allocation to the last instruction that uses it, in program
    (trace) order; a tile that an instruction inside a dynamic loop body uses but that was allocated outside that
    loop stays live to the loop's last instruction (the body reruns). Which Python names still refer to a tile
    does not matter: nki-library keeps lists of dead tiles and relies on the compiler reusing their space.
    Capacity is therefore checked when the kernel has been traced (`peak`), not at the allocation.

    PSUM is 8 banks of 2 KiB per partition and a PSUM tile is bank-aligned (psum_bank_fmax: one tile per bank),
    so every live PSUM tile takes a whole bank however small it is: at most 8 live PSUM tiles per core.
    """

    def __init__(self):
        self.event = 0  # instructions traced on this core so far: the program-order clock of liveness
        self.tiles: list[list] = []  # [kind, bytes/partition, alloc event, last use, name, site, loop depth at
        #                               allocation, (unused), placement] per allocation, in allocation order
        # storage -> its record; weak: a tile no Python name holds any more is dead for the program too, and holding
        # it would keep every tile a long loop allocated in memory (GBs); not by id(): ids are reused
        self.index = weakref.WeakKeyDictionary()
        self.carried: dict[int, list] = {}  # loop depth -> tiles used inside that loop but allocated outside it

    def allocate(self, storage: _Storage, per_partition: int, address=None) -> None:
        """Record an allocation at the current point of the program (`nl.ndarray` in SBUF/PSUM); `address` is
        the (partitions, bytes) range of an explicitly placed tile."""
        kind = storage.buffer.name
        if kind == "psum":
            per_partition = PSUM_BANK_BYTES * math.ceil(per_partition / PSUM_BANK_BYTES)  # whole banks
        depth = len(current().trace[current().core])
        self.index[storage] = record = [kind, per_partition, self.event, self.event, storage.name,
                                        call_site(), depth, None, address]
        self.tiles.append(record)

    def advance(self, depth: int) -> None:
        """Start the next instruction, traced inside `depth` nested dynamic loops."""
        self.close_loops(depth)
        self.event += 1

    def close_loops(self, depth: int) -> None:
        """Loops deeper than `depth` have ended (a loop's traced body is closed, or an instruction is traced
        outside them): the tiles they carried live to the last instruction traced before now, not into the next
        loop at the same depth."""
        for d in [d for d in self.carried if d > depth]:
            for tile in self.carried.pop(d):
                tile[3] = max(tile[3], self.event)

    def use(self, storage: _Storage, depth: int) -> None:
        """The instruction traced now (inside `depth` nested dynamic loops) reads or writes `storage`."""
        tile = self.index.get(storage)
        if tile is not None:
            tile[3] = max(tile[3], self.event)
            if depth > tile[6]:  # live through the outermost loop entered since its allocation
                self.carried.setdefault(tile[6] + 1, []).append(tile)

    @property
    def peak(self) -> dict:
        """Most live bytes per partition of each memory over the program; raises `<kind>-capacity` past it."""
        self.advance(0)  # the kernel has ended: so have its loops
        peaks = {}
        for kind, cap, url in (("sbuf", SBUF_PARTITION_BYTES, URL_TILE_SIZE),
                               ("psum", PSUM_PARTITION_BYTES, URL_MEMORY)):
            # a tile allocated after instruction c exists from c + 0.5 to its last use (an unused one just at
            # c + 0.5, where it meets every other allocation made before the next instruction)
            tiles = sorted((t for t in self.tiles if t[0] == kind), key=lambda t: t[2])
            live, ends, peak = 0, [], 0  # ends: heap of (last use, bytes) of the live tiles
            placed = []  # explicitly placed tiles still live: (last use, partitions and bytes, name, site)
            for t in tiles:
                start = t[2] + 0.5
                while ends and ends[0][0] < start:
                    live -= heapq.heappop(ends)[1]
                live += t[1]
                heapq.heappush(ends, (max(t[3], start), t[1], f"{t[4] or 'tile'} at {t[5]}"))
                if t[8] is not None and t[3] > t[2]:  # a placed tile no instruction uses touches no address:
                    # nki-library's allocator opens a scope, reserves tiles it never uses, closes it and places the
                    # next tile on the same bytes, all between two instructions
                    placed = [p for p in placed if p[0] >= start]
                    _check_overlap(t, placed, kind)
                    placed.append((max(t[3], start), t[8], t[4], t[5]))
                if live > cap:
                    banks = f" ({(live - t[1]) // PSUM_BANK_BYTES} of {PSUM_BANKS} banks in use; each PSUM tile " \
                        "takes a whole 2 KiB bank)" if kind == "psum" else ""
                    raise violation(
                        f"{kind}-capacity",
                        f"allocating {t[1]} B/partition of {kind.upper()} ({t[4] or 'tile'} at {t[5]}) with "
                        f"{live - t[1]} B still in use by tiles used later ({_largest(ends, t)}) exceeds the {cap} "
                        f"B/partition capacity{banks}; finish with tiles before allocating more, reuse tiles or tile "
                        "smaller", url)
                peak = max(peak, live)
            peaks[kind] = peak
        return peaks


class _Storage:
    """One allocation: the values, an initialised mask, and (PSUM) a mask of elements last written by nc_matmul."""

    __slots__ = ("data", "init", "mm", "buffer", "name", "core", "shared", "origin", "poison_from", "derived",
                 "__weakref__")

    def __init__(self, data: torch.Tensor, buffer: Buffer, name: str, initialised: bool):
        self.data = data
        self.buffer = buffer
        self.name = name
        # Poison bookkeeping: `origin` names this allocation and its line (its never-written elements are poison
        # from it); `derived` (made at the first poisoned write) marks elements an instruction wrote as poison, and
        # `poison_from` the allocations that poison came from. Only poison paths pay for it.
        self.origin = None if initialised else (
            f"{name or 'unnamed'} ({buffer}, {tuple(data.shape)} {str(data.dtype).removeprefix('torch.')}) "
            f"allocated at {call_site()}")
        self.poison_from: list[str] = []
        self.derived: torch.Tensor | None = None
        # owner core of private memories (SBUF, PSUM, nl.hbm); None for shared HBM (kernel args, nl.shared_hbm)
        launch = current()
        self.shared = buffer is SHARED_HBM or launch is None
        self.core = None if self.shared else launch.core
        self.init = torch.full(data.shape, initialised, dtype=torch.bool)
        self.mm = torch.zeros(data.shape, dtype=torch.bool) if buffer is PSUM else None


def _check_owner(storage: _Storage) -> None:
    """SBUF, PSUM and nl.hbm are private to the core that allocated them (per-core memories under LNC)."""
    launch = current()
    if launch is not None and storage.core is not None and storage.core != launch.core:
        raise violation("lnc-private-memory", f"core {launch.core} touches {storage.buffer} tensor "
                        f"{storage.name or '?'} of core {storage.core}: each physical core has its own SBUF/PSUM "
                        "(and nl.hbm is private); exchange data through nl.shared_hbm and a core_barrier", URL_LNC)


def _poison(storage: _Storage, init: torch.Tensor, derived_at):
    """The poison mask of elements `init` of `storage` that an instruction reads (None when all were written).

    Records where that poison came from for the instruction's writes (`_taint`): the storage's own allocation for
    elements never written, its `poison_from` for elements an instruction wrote as poison (`derived_at(mask)`
    selects the read elements of a storage-shaped mask)."""
    if bool(init.all()):
        return None
    poison = ~init
    launch = current()
    if launch is not None:
        launch.taint.extend(s for s in _sources(storage, poison, derived_at) if s not in launch.taint)
    return poison


def _moved(storage: _Storage, init: torch.Tensor, derived_at) -> None:
    """A data movement reads elements `init` of `storage`: where it moves poison, its write finds out (the moved
    written-mask) and only then are the sources looked up (`_taint`), so a clean movement costs no extra check."""
    launch = current()
    if launch is not None:
        launch.moved.append((storage, init, derived_at))


def _sources(storage: _Storage, poison: torch.Tensor, derived_at=None) -> list[str]:
    """The allocations the `poison` elements of `storage` came from."""
    derived = None if storage.derived is None else (derived_at(storage.derived) if derived_at else storage.derived)
    own = derived is None or bool((poison & ~derived).any())
    via = derived is not None and bool((poison & derived).any())
    return ([storage.origin] if own and storage.origin else []) + (storage.poison_from if via else [])


def _taint(storage: _Storage, written: torch.Tensor | None):
    """Record a write into `storage`: where it stores poison (`written` False; None: a write of computed values
    with no poison) the running instruction's poison sources become the storage's. Returns the storage's `derived`
    mask for the caller to update at the written elements (None while no poison was ever written there). Every
    write ends the instruction's reading, so the instruction's sources are cleared."""
    launch = current()
    if launch is None:
        return storage.derived
    if written is not None and not bool(written.all()):
        for source, init, derived_at in launch.moved:
            if not bool(init.all()):
                launch.taint.extend(s for s in _sources(source, ~init, derived_at) if s not in launch.taint)
        storage.poison_from.extend(s for s in launch.taint if s not in storage.poison_from)
        if storage.derived is None:
            storage.derived = torch.zeros(storage.init.shape, dtype=torch.bool)
    launch.taint.clear()
    launch.moved.clear()
    return storage.derived


def poison_report(storage: _Storage, poison: torch.Tensor | None = None, derived_at=None) -> str:
    """Where the poison in `storage` (the elements `poison`, default all) came from, for `uninitialized-read`."""
    poison = ~storage.init if poison is None else poison
    sources = _sources(storage, poison, derived_at) or ["an unknown allocation"]
    return "poison (never written, or computed from elements never written) from " + "; ".join(sources)


def _uninitialized(storage: _Storage, detail: str, poison: torch.Tensor, derived_at) -> None:
    """Raise `uninitialized-read`, or under LNC > 1 on shared HBM defer it to the next barrier.

    Cores run one at a time, so reading what the other core writes later in the same epoch finds it unwritten
    here. Deferring lets the epoch finish: the race check at the barrier then names both instructions
    (`lnc-race`); if there was no race the deferred error is raised there (or as soon as the garbage read makes
    anything else fail).
    """
    launch = current()
    detail = f"{detail}: {poison_report(storage, poison, derived_at)}"
    error = violation("uninitialized-read", detail, URL_TILING)
    if launch is None or launch.lnc == 1 or not storage.shared:
        raise error
    if launch.pending is None:
        launch.pending = violation(
            "uninitialized-read", f"{detail}; under LNC {launch.lnc} the emulator runs core 0 up to its next "
            "core_barrier before core 1: if another core writes these elements, a nisa.core_barrier must separate "
            "the write from this read", URL_TILING)


def _largest(ends, new) -> str:
    """The tiles in use besides `new`, for a capacity error: the 4 largest by bytes, alike tiles (one allocation
    site) together: "name at site N B" or "name at site N x B"."""
    groups: dict = {}
    for _, size, name in ends:
        count, total = groups.get(name, (0, 0))
        groups[name] = (count + 1, total + size)
    key = f"{new[4] or 'tile'} at {new[5]}"
    count, total = groups[key]
    groups[key] = (count - 1, total - new[1])
    top = sorted((g for g in groups.items() if g[1][0] > 0), key=lambda g: -g[1][1])[:4]
    return ", ".join(f"{name} {total} B" if count == 1 else f"{name} {count} x {total // count} B"
                     for name, (count, total) in top)


def _check_overlap(tile, placed, kind: str) -> None:
    """Two explicitly placed tiles live at the same time must not share a partition and a byte."""
    p0, p1, b0, b1 = tile[8]
    for _, (q0, q1, c0, c1), name, site in placed:
        if p0 < q1 and q0 < p1 and b0 < c1 and c0 < b1:
            raise violation("tile-address", f"{kind.upper()} tile {tile[4] or '?'} ({tile[5]}) at partitions "
                            f"[{p0}, {p1}) bytes [{b0}, {b1}) overlaps {name or '?'} ({site}) at [{q0}, {q1}) "
                            f"[{c0}, {c1}), which is still used later", URL_NKI_TENSOR)


@contextlib.contextmanager
def capacity_lifted():
    """Count SBUF/PSUM peaks without stopping at the capacity rules, so that a kernel over them still yields its
    counters; the caller compares `Counters.sbuf_peak` / `psum_peak` with the capacities itself (the conformance
    command's counters of AWS's kernels)."""
    global SBUF_PARTITION_BYTES, PSUM_PARTITION_BYTES
    saved = SBUF_PARTITION_BYTES, PSUM_PARTITION_BYTES
    SBUF_PARTITION_BYTES = PSUM_PARTITION_BYTES = 1 << 40
    try:
        yield
    finally:
        SBUF_PARTITION_BYTES, PSUM_PARTITION_BYTES = saved
