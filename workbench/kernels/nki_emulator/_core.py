"""Core of the NKI emulator: memories, tensors, views, access patterns, rule checks and `jit`.

Everything is stored in torch CPU tensors of the declared dtype, so a bfloat16 tile really holds bfloat16 values
(every store rounds to nearest-even through `Tensor.copy_`). Each storage also carries an "initialised" mask:
NKI allocations are not initialised ("note that memory allocation does not initialize",
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/about/tiling-overview.html). An element no
instruction wrote is *poison*: hardware reads whatever is there, so reading it is not an error; every result it
contributes to is poison too (`read_data` gives the mask, each instruction propagates it), and only poison that
reaches a kernel output or a value used as an index, offset or loop bound raises `uninitialized-read`, naming
the allocation it came from and the line that allocated it.

On-chip capacity is tracked per kernel call: a storage counts while any view of it is alive (CPython
reference counting frees it deterministically when the kernel drops its last reference).
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import math
import weakref
from typing import Any

import numpy as np
import torch

from workbench.core.neuron_env import lnc_is_set, logical_nc_config, unbracketed_lnc

from . import _runtime, _subset, dtypes, version
from ._rules import violation

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
        depth = len(_runtime.current().trace[_runtime.current().core])
        self.index[storage] = record = [kind, per_partition, self.event, self.event, storage.name,
                                        _runtime.call_site(), depth, None, address]
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
            f"allocated at {_runtime.call_site()}")
        self.poison_from: list[str] = []
        self.derived: torch.Tensor | None = None
        # owner core of private memories (SBUF, PSUM, nl.hbm); None for shared HBM (kernel args, nl.shared_hbm)
        launch = _runtime.current()
        self.shared = buffer is SHARED_HBM or launch is None
        self.core = None if self.shared else launch.core
        self.init = torch.full(data.shape, initialised, dtype=torch.bool)
        self.mm = torch.zeros(data.shape, dtype=torch.bool) if buffer is PSUM else None


def allocate(shape, dtype, buffer: Buffer, name: str = "", address=None) -> Tensor:
    """`nl.ndarray`: allocate an uninitialised tensor, checking the tile rules for on-chip memories."""
    shape = tuple(int(s) for s in shape)
    if address is not None:
        address = _placement(shape, dtype, buffer, address)
    dtypes.check_stored(dtype, f"nl.ndarray {name or ''}")
    if not isinstance(buffer, Buffer):
        raise TypeError(f"buffer must be nl.sbuf, nl.psum, nl.hbm or nl.shared_hbm, got {buffer!r}")
    if any(s <= 0 for s in shape) or not shape:
        raise ValueError(f"tensor shape must be non-empty with positive sizes, got {shape}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if buffer.on_chip:
        if len(shape) < 2:
            raise violation(
                "tile-rank", f"{buffer} tensor {name or ''} shape {shape} needs a partition dim and at least one "
                "free dim; use shape (P, F)", URL_NKI_TENSOR)
        if shape[0] > PMAX:
            raise violation(
                "partition-dim-limit",
                f"{buffer} tile shape {shape}: partition dim {shape[0]} exceeds nl.tile_size.pmax={PMAX}; "
                "split the tensor into tiles of at most 128 partitions",
                URL_TILING,
            )
        free_bytes = math.prod(shape[1:]) * itemsize
        if buffer is PSUM and free_bytes > PSUM_BANK_BYTES:
            raise violation(
                "psum-bank-size",
                f"PSUM tile shape {shape} ({dtype}) uses {free_bytes} B per partition; one PSUM tile must fit a "
                f"{PSUM_BANK_BYTES} B bank (psum_bank_fmax=512 fp32); tile the free dim to <= 512 fp32",
                URL_TILE_SIZE,
            )
    launch = _runtime.require("nl.ndarray", URL_NKI_TENSOR)
    if buffer is SHARED_HBM:
        # One tensor for all cores: the n-th shared_hbm allocation of every core is the same storage.
        n = launch.shared_next[launch.core]
        launch.shared_next[launch.core] += 1
        if n < len(launch.shared):
            storage = launch.shared[n]
            if tuple(storage.data.shape) != shape or storage.data.dtype != dtype or storage.name != name:
                raise violation("lnc-shared-alloc", f"core {launch.core}'s shared_hbm allocation #{n} "
                                f"({name!r}, {shape}, {dtype}) differs from core 0's ({storage.name!r}, "
                                f"{tuple(storage.data.shape)}, {storage.data.dtype}); allocate shared HBM tensors "
                                "in the same order on every core", URL_MEMORY)
            return Tensor(storage, storage.data, storage.init, storage.mm, root=True)
    fill = float("nan") if dtype in FLOAT_DTYPES else False if dtype is torch.bool else torch.iinfo(dtype).min
    data = torch.full(shape, 0x7F, dtype=torch.uint8).view(dtype) if dtype is dtypes.E4M3 else \
        torch.full(shape, fill, dtype=dtype)  # e4m3: its NaN pattern
    storage = _Storage(data, buffer, name, initialised=False)
    if buffer is SHARED_HBM:
        launch.shared.append(storage)
    if not buffer.on_chip:
        launch.hbm.append(storage)
    if buffer.on_chip:
        launch.budgets[launch.core].allocate(storage, math.prod(shape[1:]) * itemsize, address)
    return Tensor(storage, storage.data, storage.init, storage.mm, root=True)


def _placement(shape, dtype, buffer: Buffer, address) -> tuple[int, int, int, int]:
    """Check `address=(start_partition, byte_offset)` of an explicitly placed tile; return its partition and byte
    ranges (p0, p1, b0, b1)."""
    if not buffer.on_chip:
        raise violation("tile-address", f"address= places SBUF/PSUM tiles; {buffer} tensors have no on-chip "
                        "address", URL_NKI_TENSOR)
    p0, b0 = (int(a) for a in address)
    p1, b1 = p0 + shape[0], b0 + math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
    cap = SBUF_PARTITION_BYTES if buffer is SBUF else PSUM_PARTITION_BYTES
    if p0 < 0 or p1 > PMAX or b0 < 0 or b1 > cap:
        raise violation("tile-address", f"tile {shape} at address {tuple(address)} spans partitions [{p0}, {p1}) "
                        f"and bytes [{b0}, {b1}); {buffer} has {PMAX} partitions of {cap} B", URL_NKI_TENSOR)
    return p0, p1, b0, b1


def _from_array(value, buffer: Buffer, name: str) -> Tensor:
    data = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else torch.from_numpy(np.array(value))
    if data.dtype is dtypes.E4M3:
        raise NotImplementedError(f"kernel argument {name} is a torch float8_e4m3fnuz tensor: the emulator stores "
                                  "nl.float8_e4m3 (IEEE e4m3, max 240) in that torch type as IEEE bit patterns, so "
                                  "fnuz values would be misread; pass float32/bfloat16 and cast in the kernel")
    if data.dtype not in dtypes.STORED:
        hint = " (cast index tensors to int32)" if data.dtype == torch.int64 else ""
        raise NotImplementedError(f"kernel argument {name} has dtype {data.dtype}; emulated: {dtypes.STORED}{hint}")
    storage = _Storage(data.contiguous(), buffer, name, initialised=True)
    return Tensor(storage, storage.data, storage.init, storage.mm, root=True)


class Tensor:
    """Emulated `NkiTensor`: a view (basic slicing) of one storage. dim 0 is the partition dim on chip."""

    def __init__(self, storage: _Storage, data: torch.Tensor, init: torch.Tensor, mm, root: bool):
        self._storage, self._data, self._init, self._mm, self._root = storage, data, init, mm, root

    partitionless = False  # set on views that int-indexed away the partition dim of an on-chip tile

    def detached(self) -> Tensor:
        """A copy of the view (what a recorded instruction keeps)."""
        return Tensor(self._storage, self._data, self._init, self._mm, self._root)

    shape = property(lambda self: tuple(self._data.shape))
    dtype = property(lambda self: self._data.dtype)
    buffer = property(lambda self: self._storage.buffer)
    ndim = property(lambda self: self._data.dim())

    def __repr__(self) -> str:
        return f"Tensor({self._storage.name or '?'}, shape={self.shape}, dtype={self.dtype}, {self.buffer})"

    def __getitem__(self, index) -> Tensor:
        index = _expand_ellipsis(index if isinstance(index, tuple) else (index,), self.ndim)
        if len(index) > self.ndim:
            raise violation("index-bounds", f"{len(index)} indices for a {self.ndim}-d tensor {self}", URL_NKI_TENSOR)
        norm = []
        for dim, ix in enumerate(index):
            size = self.shape[dim]
            if isinstance(ix, slice):
                start = 0 if ix.start is None else int(ix.start)
                stop = size if ix.stop is None else int(ix.stop)
                step = 1 if ix.step is None else int(ix.step)
                if not (0 <= start < stop <= size) or step <= 0:
                    raise violation(
                        "index-bounds",
                        f"slice {start}:{stop}:{step} on dim {dim} of {self} is empty or outside [0, {size})",
                        URL_NKI_TENSOR,
                    )
                norm.append(slice(start, stop, step))
            elif isinstance(ix, (int, np.integer)):
                if not 0 <= int(ix) < size:
                    raise violation("index-bounds", f"index {ix} on dim {dim} of {self} outside [0, {size})",
                                    URL_NKI_TENSOR)
                norm.append(int(ix))
            else:
                raise NotImplementedError(f"index {ix!r}: only ints and slices are emulated")
        idx = tuple(norm)
        mm = None if self._mm is None else self._mm[idx]
        view = Tensor(self._storage, self._data[idx], self._init[idx], mm, root=False)
        # An int index on the partition dim of an on-chip tile (nki-library's `block_expert[0, 0]` as a DMA
        # endpoint) leaves a view without partitions: DMAs may move it, compute engines refuse it (partition-view).
        view.partitionless = self.partitionless or (self.buffer.on_chip and isinstance(idx[0], int))
        return view

    def reshape(self, shape) -> Tensor:
        """`NkiTensor.reshape`: the same elements in row-major order under a new shape (a view, no copy).

        On chip the partition dim stays (a reshape cannot move elements between partitions); the result of
        reshaping a whole tensor is again a whole tensor, so `.ap()` may follow (nki-library does
        `block_to_expert.reshape((N, 1)).ap(...)`).
        """
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if math.prod(shape) != math.prod(self.shape):
            raise ValueError(f"cannot reshape {self} ({math.prod(self.shape)} elements) to {shape}")
        if self.buffer.on_chip and shape[0] != self.shape[0]:
            raise NotImplementedError(f"reshape of on-chip {self} to {shape} changes the partition dim; only free "
                                      f"dims are reshaped here ({URL_NKI_TENSOR})")
        try:
            data, init = self._data.view(shape), self._init.view(shape)
        except RuntimeError:
            raise NotImplementedError(f"reshape of the strided view {self} to {shape} is not a view of its memory; "
                                      "reshape the whole tensor") from None
        mm = None if self._mm is None else self._mm.view(shape)
        return Tensor(self._storage, data, init, mm, root=self._root)

    def ap(self, pattern, offset: int = 0, scalar_offset=None, vector_offset=None, indirect_dim: int = 0,
           dtype=None) -> AccessPattern:
        """Access pattern view (`NkiTensor.ap`), allowed on the tensor returned by `nl.ndarray` only."""
        if not self._root:
            raise violation("ap-on-view", f"cannot specify an access pattern on an already indexed tensor {self}; "
                            "call .ap on the nl.ndarray itself", URL_AP)
        view = None if dtype is None or dtype == self.dtype else dtype  # ap(dtype=own dtype): the plain pattern
        return AccessPattern(self, pattern, offset, scalar_offset, vector_offset, indirect_dim, view)

    # -- element access used by the instructions -------------------------------------------------------------
    def _access(self, kind: str) -> None:
        _check_owner(self._storage)
        launch = _runtime.current()
        if launch is not None and (launch.accesses is not None or (launch.lnc > 1 and self._storage.shared)):
            pattern = list(zip(self._data.stride(), self._data.shape, strict=True)) or [(1, 1)]
            launch.touch(self._storage, kind, self._data.storage_offset(), pattern, None)  # the time model's trace
            if launch.lnc > 1 and self._storage.shared:
                launch.record(self._storage, kind, self._data.storage_offset(), pattern, None)

    def read(self) -> torch.Tensor:
        """The values, for a use that cannot carry poison (an index, offset, register or loop bound): an unwritten
        element raises `uninitialized-read`."""
        self._access("r")
        if not bool(self._init.all()):
            _uninitialized(self._storage, f"{self} is used as an index, offset or loop bound before every element "
                           "was written (NKI allocations are not initialised)", ~self._init, self._derived)
        return dtypes.values(self._data.clone())

    def read_data(self):
        """(values, poison mask or None when every element was written) for an instruction computing on them."""
        self._access("r")
        return dtypes.values(self._data.clone()), _poison(self._storage, self._init, self._derived)

    def read_moved(self):
        """(stored data, initialised mask) for a pure data movement: the bits as stored (an e4m3 carrier is not
        decoded, so a same-dtype move copies every byte, NaN patterns included; `dtypes.cast` decodes it for a
        store of another dtype). Moving unwritten elements is not an error, they arrive unwritten
        (`write(init=...)`), and computing on them later raises `uninitialized-read`."""
        self._access("r")
        _moved(self._storage, self._init, self._derived)
        return self._data.clone(), self._init.clone()

    def _derived(self, derived: torch.Tensor) -> torch.Tensor:
        """This view of the storage's `derived` mask (laid out like `init`)."""
        return derived.as_strided(self._init.size(), self._init.stride(), self._init.storage_offset())

    def write(self, value: torch.Tensor, by_matmul: bool = False, keep=None, init=None) -> None:
        """Store `value` (cast to the dtype); `keep` (oob_mode.skip) limits which elements are written, `init`
        (a data movement) says which of them carry initialised data."""
        self._access("w")
        init = None if init is None else init.reshape(self.shape)
        if init is not None:  # unwritten source elements carry no value: store 0 so the cast cannot object
            value = torch.where(init, value.reshape(self.shape), torch.zeros((), dtype=value.dtype))
        value = dtypes.cast(value.reshape(self.shape), self.dtype)  # fp32 -> bf16 rounds to nearest-even
        written = torch.ones(self.shape, dtype=torch.bool) if init is None else init
        derived = _taint(self._storage, None if init is None else written)
        keep = None if keep is None else keep.reshape(self.shape)  # oob_mode.skip: skipped elements keep their value
        if derived is not None:
            view = self._derived(derived)
            view.copy_(~written if keep is None else torch.where(keep, ~written, view))
        if keep is None:
            self._data.copy_(value)
            self._init.copy_(written)
            if self._mm is not None:
                self._mm.fill_(by_matmul)
            return
        _bits(self._data).copy_(torch.where(keep, _bits(value), _bits(self._data)))
        self._init.copy_(torch.where(keep, written, self._init))
        if self._mm is not None:
            self._mm.copy_(torch.where(keep, by_matmul, self._mm))

    def written_by_matmul(self) -> bool:
        return self._mm is not None and bool(self._mm.all())


def _expand_ellipsis(index: tuple, ndim: int) -> tuple:
    """`t[..., 0:4]`: `...` stands for as many full slices as leave one index per dim (numpy/NKI indexing)."""
    if not any(ix is Ellipsis for ix in index):
        return index
    if sum(ix is Ellipsis for ix in index) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    k = index.index(Ellipsis)
    return index[:k] + (slice(None),) * (ndim - len(index) + 1) + index[k + 1:]


class AccessPattern:
    """`t.ap(pattern=[[step, num], ...], offset, scalar_offset|vector_offset, indirect_dim, dtype)` on a root tensor.

    Semantics (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/deep-dives/nki-aps.html): the tensor is
    flattened; element (i0, i1, ...) of the view is flat[offset + sum_k i_k * step_k]. `scalar_offset` (a 1-element
    SBUF int tile, read at execution time) adds value * stride(indirect_dim) of the tensor to the start.
    `vector_offset` (an SBUF int tile with one value per outer iteration) replaces the outermost term i0 * step0
    by value[i0] * stride(indirect_dim): a row gather/scatter. Out-of-range indices raise (oob_mode.error).

    `dtype` other than the tensor's is a reinterpret cast (same page, "Reinterpret Cast with ap": "Since both the
    pattern and the offset are in terms of number of elements, not bytes, the count must be computed
    accordingly"; its example views a (128, 256) int32 tile as bf16 with pattern [[512, 128], [1, 512]]): the
    tensor's bytes, flattened, are elements of `dtype`, and the pattern, the offset and the partition step count
    those elements. The bytes move unchanged (a view of the stored bytes; little-endian, the byte order in which
    the host reads a device buffer back, e.g. nki-library's test viewing 4 fp8 output bytes as one fp32). A view
    element is initialised when every tensor element whose bytes it covers is. Refused (`ap-reinterpret`): bool
    on either side, and a tensor (on chip: a partition) whose bytes are not a whole number of `dtype` elements.
    Not emulated (NotImplementedError): a reinterpret cast with a scalar/vector offset (whether `indirect_dim`'s
    stride counts old or new elements is not stated), and a narrower view writing only part of an element no
    instruction wrote (initialisation is tracked per element of the tensor's dtype, not per byte).
    """

    def __init__(self, root: Tensor, pattern, offset, scalar_offset, vector_offset, indirect_dim, view_dtype=None):
        pattern = [(int(s), int(n)) for s, n in pattern]
        if scalar_offset is not None and vector_offset is not None:
            raise ValueError("at most one of scalar_offset and vector_offset can be given")
        if any(n <= 0 for _, n in pattern):
            raise violation("index-bounds", f"access pattern {pattern} has an empty dimension", URL_AP)
        self.root, self.view_dtype = root, view_dtype
        if view_dtype is not None:
            self._check_reinterpret(scalar_offset, vector_offset)
        if root.buffer.on_chip:
            free = math.prod(root.shape[1:]) * self._ratio[0] // self._ratio[1]  # in elements of the view's dtype
            if pattern[0][0] != free or pattern[0][1] > root.shape[0]:
                raise violation(
                    "ap-partition-contiguity",
                    f"on {root.buffer} the first pattern entry must walk partitions contiguously: step {free} "
                    f"(the free size{' in ' + str(self.dtype) + ' elements' if view_dtype is not None else ''}) "
                    f"and count <= {root.shape[0]}, got {pattern[0]}",
                    URL_AP,
                )
        for name, off in (("scalar_offset", scalar_offset), ("vector_offset", vector_offset)):
            if name == "scalar_offset" and isinstance(off, _runtime.VirtualRegister):
                continue
            # an offset is an int32 SBUF tile or an access pattern over one (nki-library's MoE forward passes
            # token_indices.ap(...) as vector_offset)
            if off is not None and (not isinstance(off, View) or off.buffer is not SBUF or off.dtype != torch.int32):
                raise violation("offset-tile", f"{name} must be an int32 SBUF tile, got {off!r}", URL_AP)
        if isinstance(scalar_offset, Tensor) and tuple(scalar_offset.shape) != (1, 1):
            raise violation("scalar-offset-shape", f"scalar_offset must be a (1, 1) int32 SBUF tile (or a "
                            f"VirtualRegister), got shape {scalar_offset.shape}", URL_AP)
        if vector_offset is not None and (root.buffer not in (HBM, SHARED_HBM) or indirect_dim != 0):
            raise violation("vector-offset", f"vector_offset (indirect rows) is only supported on HBM tensors with "
                            f"indirect_dim=0; got {root.buffer} with indirect_dim={indirect_dim}", URL_AP)
        if not 0 <= indirect_dim < root.ndim:
            raise ValueError(f"indirect_dim {indirect_dim} outside [0, {root.ndim})")
        if vector_offset is not None and math.prod(vector_offset.shape) != pattern[0][1]:
            raise violation("offset-tile", f"vector_offset has {math.prod(vector_offset.shape)} values but the "
                            f"outer pattern dim iterates {pattern[0][1]} times", URL_AP)
        self.pattern, self.offset = pattern, int(offset)
        self.scalar_offset, self.vector_offset, self.indirect_dim = scalar_offset, vector_offset, indirect_dim

    def _check_reinterpret(self, scalar_offset, vector_offset) -> None:
        root, dtype = self.root, self.view_dtype
        dtypes.check_stored(dtype, f"ap(dtype={dtype})")
        if torch.bool in (dtype, root.dtype):
            raise violation("ap-reinterpret", f"ap(dtype={dtype}) on a {root.dtype} tensor: bool holds only 0/1, "
                            "so arbitrary bytes have no bool meaning; reinterpret as uint8", URL_AP_CAST)
        old, new = self._ratio
        numel = math.prod(root.shape)
        unit = math.prod(root.shape[1:]) if root.buffer.on_chip else numel
        if unit * old % new:
            where = "one partition holds" if root.buffer.on_chip else "the tensor holds"
            raise violation("ap-reinterpret", f"ap(dtype={dtype}) on {root}: {where} {unit * old} bytes, not a whole "
                            f"number of {new}-byte {dtype} elements", URL_AP_CAST)
        if scalar_offset is not None or vector_offset is not None:
            raise NotImplementedError(f"ap(dtype={dtype}) with a scalar_offset/vector_offset: a reinterpret cast "
                                      "with a runtime offset is outside the emulated subset (whether the stride of "
                                      f"indirect_dim counts {root.dtype} or {dtype} elements is not stated; {URL_AP})")

    _ratio = property(lambda self: (self.root.dtype.itemsize, self.dtype.itemsize))  # (tensor's, view's) bytes

    def detached(self) -> AccessPattern:
        ap = object.__new__(AccessPattern)
        ap.__dict__.update(self.__dict__)
        ap.root = self.root.detached()
        if isinstance(self.scalar_offset, View):
            ap.scalar_offset = self.scalar_offset.detached()
        if self.vector_offset is not None:
            ap.vector_offset = self.vector_offset.detached()
        return ap

    shape = property(lambda self: tuple(n for _, n in self.pattern))
    dtype = property(lambda self: self.root.dtype if self.view_dtype is None else self.view_dtype)
    buffer = property(lambda self: self.root.buffer)

    def __repr__(self) -> str:
        cast = "" if self.view_dtype is None else f", dtype={self.view_dtype}"
        return f"AccessPattern({self.root!r}, pattern={self.pattern}, offset={self.offset}{cast})"

    def _flat_index(self, kind: str, skip: bool = False):
        """Flat element indices of the view (in elements of its dtype), and (oob_mode.skip) which of them take part
        in the transfer.

        With skip=False an out-of-range offset raises (oob_mode.error) and the mask is None. With skip=True a
        scalar offset out of range skips the whole transfer and a vector offset out of range skips its row
        ("silently skip the runtime out-of-bounds access", nki.isa.oob_mode)."""
        _check_owner(self.root._storage)
        shape = self.root.shape
        stride = math.prod(shape[self.indirect_dim + 1:])
        start = torch.tensor(self.offset, dtype=torch.int64)
        terms = [torch.arange(n, dtype=torch.int64) * s for s, n in self.pattern]
        outer = keep = None
        for name, off in (("scalar_offset", self.scalar_offset), ("vector_offset", self.vector_offset)):
            if off is None:
                continue
            if isinstance(off, _runtime.VirtualRegister):
                values = torch.tensor([off.runtime_value()], dtype=torch.int64)
            else:
                values = off.read().reshape(-1).to(torch.int64)
            bad = (values < 0) | (values >= shape[self.indirect_dim])
            if bool(bad.any()) and not skip:
                raise violation("index-bounds", f"{name} values {values.tolist()} outside [0, "
                                f"{shape[self.indirect_dim]}) on dim {self.indirect_dim} of {self.root} "
                                "(oob_mode.error)", URL_AP)
            if skip:
                rows = ~bad if name == "vector_offset" else (~bad).expand(self.pattern[0][1])
                keep = rows if keep is None else keep & rows
                values = torch.where(bad, 0, values)
            if name == "scalar_offset":
                start = start + values[0] * stride
            else:
                terms[0] = outer = values * stride
        flat = start
        for k, term in enumerate(terms):
            flat = flat.unsqueeze(-1) + term.reshape([1] * k + [-1])
        numel = math.prod(shape) * self._ratio[0] // self._ratio[1]
        if keep is not None:  # skipped rows address nothing: park them on element 0, masked out below
            keep = keep.reshape([-1] + [1] * (flat.dim() - 1)).expand(flat.shape)
            flat = torch.where(keep, flat, 0)
        if bool(((flat < 0) | (flat >= numel)).any()):
            raise violation("index-bounds", f"{self} addresses elements outside the {numel}-element tensor", URL_AP)
        launch = _runtime.current()
        if launch is not None:
            box = race = (int(start), self.pattern, outer)
            if self.view_dtype is not None:
                box, race = self._tensor_patterns(flat)
            launch.touch(self.root._storage, kind, *box)  # the time model's trace
            if launch.lnc > 1 and self.root._storage.shared:
                launch.record(self.root._storage, kind, *race)
        return flat, keep

    def _covered(self, flat: torch.Tensor) -> torch.Tensor:
        """The tensor elements (flat, in its own dtype) whose bytes each view element covers: shape
        flat.shape + (max(1, view itemsize // tensor itemsize),). Itemsizes are powers of two, so a narrower view
        element lies inside one tensor element."""
        old, new = self._ratio
        return (flat * new // old).unsqueeze(-1) + torch.arange(max(1, new // old), dtype=torch.int64)

    def _tensor_patterns(self, flat: torch.Tensor):
        """The (start, pattern, outer) of a reinterpreting view in the tensor's own elements for the time model's
        trace (a box) and for the LNC race log (exact elements): the view's pattern rescaled when it is whole
        tensor elements (both); else the contiguous range of the elements it covers (the box, conservative) and
        those elements as explicit offsets (`outer`) of a one-entry pattern (the race log)."""
        old, new = self._ratio
        if new >= old:  # each view element covers new // old consecutive tensor elements
            k = new // old
            exact = self.offset * k, [(s * k, n) for s, n in self.pattern] + [(1, k)], None
            return exact, exact
        k = old // new
        (inner_step, inner_n), rest = self.pattern[-1], self.pattern[:-1]
        if self.offset % k == 0 and inner_step == 1 and inner_n % k == 0 and all(s % k == 0 for s, _ in rest):
            exact = self.offset // k, [(s // k, n) for s, n in rest] + [(1, inner_n // k)], None
            return exact, exact
        covered = torch.unique(self._covered(flat))
        lo, hi = int(covered[0]), int(covered[-1])
        return (lo, [(1, hi - lo + 1)], None), (0, [(0, len(covered))], covered)

    def _stored(self, flat: torch.Tensor) -> torch.Tensor:
        """The stored data at the view's elements `flat`, in the view's dtype (a reinterpret cast views the bytes)."""
        data = self.root._storage.data.reshape(-1)
        if self.view_dtype is not None:
            data = data.view(torch.uint8).view(self.view_dtype)
        return data[flat].clone()

    def _init_at(self, flat: torch.Tensor) -> torch.Tensor:
        """Which view elements are initialised: all the tensor elements they cover are."""
        init = self.root._storage.init.reshape(-1)
        return init[flat] if self.view_dtype is None else init[self._covered(flat)].all(-1)

    def _derived_at(self, flat: torch.Tensor):
        """Selects the view elements' part of a storage-shaped mask (`_sources`' derived_at)."""
        if self.view_dtype is None:
            return lambda d: d.reshape(-1)[flat]
        covered = self._covered(flat)
        return lambda d: d.reshape(-1)[covered].any(-1)

    def read(self):
        """The viewed values for an index/offset use: an unwritten element raises `uninitialized-read`."""
        flat, _ = self._flat_index("r")
        init = self._init_at(flat)
        if not bool(init.all()):
            _uninitialized(self.root._storage, f"{self} is used as an index or offset before every element was "
                           "written", ~init, self._derived_at(flat))
        return dtypes.values(self._stored(flat))

    def read_data(self):
        """(values, poison mask or None) for an instruction computing on them (see Tensor.read_data)."""
        flat, _ = self._flat_index("r")
        return dtypes.values(self._stored(flat)), _poison(self.root._storage, self._init_at(flat),
                                                          self._derived_at(flat))

    def read_moved(self, skip: bool = False):
        """(stored data, initialised mask, transferred mask or None) for a pure data movement (see
        Tensor.read_moved)."""
        flat, keep = self._flat_index("r", skip)
        init = self._init_at(flat)
        _moved(self.root._storage, init if keep is None else init | ~keep, self._derived_at(flat))
        return self._stored(flat), init, keep

    def write(self, value: torch.Tensor, by_matmul: bool = False, keep=None, skip: bool = False, init=None) -> None:
        flat, own = self._flat_index("w", skip)
        keep = own if keep is None else keep.reshape(flat.shape) if own is None else keep.reshape(flat.shape) & own
        storage = self.root._storage
        value = value.reshape(flat.shape)
        written = torch.ones(flat.shape, dtype=torch.bool) if init is None else init.reshape(flat.shape)
        if init is not None:
            value = torch.where(written, value, torch.zeros((), dtype=value.dtype))
        value = dtypes.cast(value, self.dtype)
        if keep is not None:
            flat, value, written = flat[keep], value[keep], written[keep]
        if self.view_dtype is not None:
            self._write_bytes(flat.reshape(-1), value.reshape(-1), written.reshape(-1), by_matmul, init is None)
            return
        derived = _taint(storage, None if init is None else written)
        if derived is not None:
            derived.view(-1)[flat] = ~written
        _bits(storage.data).view(-1)[flat] = _bits(value)
        storage.init.view(-1)[flat] = written
        if storage.mm is not None:
            storage.mm.view(-1)[flat] = by_matmul

    def _write_bytes(self, flat, value, written, by_matmul: bool, computed: bool) -> None:
        """A write through a reinterpreting view: store the bytes, then mark each tensor element it covers
        initialised when all of its bytes are (written now without poison, or written before)."""
        storage = self.root._storage
        old, new = self._ratio
        if new >= old:  # each view element covers whole tensor elements
            touched = self._covered(flat).reshape(-1)
            ok = written.repeat_interleave(new // old)
        else:
            covered = self._covered(flat).reshape(-1)
            touched, inverse = torch.unique(covered, return_inverse=True)
            whole = torch.bincount(inverse[_first(flat)], minlength=len(touched)) == old // new
            ok = torch.bincount(inverse, weights=(~written).double(), minlength=len(touched)) == 0
            partial = ~whole & ~storage.init.reshape(-1)[touched]
            if bool(partial.any()):
                raise NotImplementedError(
                    f"{self} writes only some bytes of {int(partial.sum())} {storage.data.dtype} element(s) of "
                    f"{self.root} that no instruction wrote: the emulator tracks initialisation per "
                    f"{storage.data.dtype} element, so a partly written one is outside the emulated subset; write "
                    "whole elements")
        derived = _taint(storage, None if computed else ok)
        if derived is not None:
            derived.view(-1)[touched] = ~ok
        _bits(storage.data.view(-1).view(torch.uint8).view(self.view_dtype)).view(-1)[flat] = _bits(value)
        storage.init.view(-1)[touched] = ok
        if storage.mm is not None:
            storage.mm.view(-1)[touched] = by_matmul


def _first(flat: torch.Tensor) -> torch.Tensor:
    """Positions of the first occurrence of each distinct value of `flat` (a pattern may address an element twice)."""
    order = torch.argsort(flat, stable=True)
    keep = torch.ones(len(flat), dtype=torch.bool)
    keep[1:] = flat[order][1:] != flat[order][:-1]
    return order[keep]


View = (Tensor, AccessPattern)

_SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32, dtypes.E4M3: torch.uint8,
           torch.float8_e5m2: torch.uint8, torch.float8_e4m3fn: torch.uint8}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same bits under a dtype torch can scatter into and select from (no index_put for uint16/uint32; the
    float8 types are moved as bytes)."""
    return t.view(_SIGNED[t.dtype]) if t.dtype in _SIGNED else t


def _check_owner(storage: _Storage) -> None:
    """SBUF, PSUM and nl.hbm are private to the core that allocated them (per-core memories under LNC)."""
    launch = _runtime.current()
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
    launch = _runtime.current()
    if launch is not None:
        launch.taint.extend(s for s in _sources(storage, poison, derived_at) if s not in launch.taint)
    return poison


def _moved(storage: _Storage, init: torch.Tensor, derived_at) -> None:
    """A data movement reads elements `init` of `storage`: where it moves poison, its write finds out (the moved
    written-mask) and only then are the sources looked up (`_taint`), so a clean movement costs no extra check."""
    launch = _runtime.current()
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
    launch = _runtime.current()
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
    launch = _runtime.current()
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


def note_uses(run) -> None:
    """Advance the core's program clock by one instruction and mark the on-chip tiles it touches as used now.

    `run` is the instruction's closure; its cells hold the operand views (also inside lists/tuples, and the
    offset tiles of access patterns)."""
    launch = _runtime.require("an NKI instruction", URL_NKI_TENSOR)
    budget, depth = launch.budgets[launch.core], len(launch.trace[launch.core])
    budget.advance(depth)
    todo = []
    for cell in run.__closure__ or ():
        try:
            todo.append(cell.cell_contents)
        except ValueError:  # an unassigned cell
            continue
    while todo:
        value = todo.pop()
        if isinstance(value, (list, tuple)):
            todo.extend(value)
        elif isinstance(value, AccessPattern):
            todo.extend((value.root, value.scalar_offset, value.vector_offset))
        elif isinstance(value, Tensor) and value.buffer.on_chip:
            budget.use(value._storage, depth)


# -- kernel entry point --------------------------------------------------------------------------------------------
class Kernel:
    """An emulated `@nki.jit` kernel: `kernel[lnc](*args)` launches on an LNC grid; `kernel(*args)` at the LNC of
    NEURON_LOGICAL_NC_CONFIG (1 when unset), as the NKI LNC page describes. From NKI 0.7.0 that LNC must equal the
    compiler's (`core.neuron_env.logical_nc_config()`: NEURON_LOGICAL_NC_CONFIG, 2 on trn2 when unset), else
    `lnc-degree` (NCC_EVRF066), checked before the kernel runs.

    Call it with torch tensors or numpy arrays (they become shared HBM tensors). Returns torch tensors when any
    argument was a torch tensor, numpy arrays otherwise (bfloat16 outputs come back as float32 numpy, numpy having
    no bfloat16). `options` (e.g. platform_target) are accepted and ignored. The first call checks the kernel's
    source (and the helpers it calls) against the NKI Python subset (`_subset.py`).
    """

    def __init__(self, func, options: dict, lnc: int | None = None):
        functools.update_wrapper(self, func)
        self.func, self.options, self.lnc = func, options, lnc
        self.__wrapped_kernel__ = func

    def __getitem__(self, grid) -> Kernel:
        lnc = grid[0] if isinstance(grid, tuple) and len(grid) == 1 else grid
        if isinstance(lnc, bool) or not isinstance(lnc, int) or lnc not in (1, 2):
            raise violation("lnc-grid", f"launch grid {grid!r}: launch kernel[lnc] with lnc 1 or 2 (trn2 runs LNC=2 "
                            "by default, NEURON_LOGICAL_NC_CONFIG)", URL_LNC)
        return Kernel(self.func, self.options, lnc)

    def __call__(self, *args, **kwargs):
        _subset.check_kernel(self.func)
        as_torch = any(isinstance(a, torch.Tensor) for a in args)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tile-sized ops: intra-op threading only adds overhead
        try:
            hbm_args = [
                _from_array(a, SHARED_HBM, f"arg{i}") if isinstance(a, (torch.Tensor, np.ndarray)) else a
                for i, a in enumerate(args)
            ]
            lnc = self.lnc if self.lnc is not None else unbracketed_lnc()
            _check_compiler_lnc(lnc, self.lnc is None)
            results = _runtime.run_launch(lnc, lambda: self.func(*hbm_args, **kwargs), Budget)
            result = results[0]
            outs = result if isinstance(result, tuple) else (result,)
            for k, other in enumerate(results[1:], start=1):
                other = other if isinstance(other, tuple) else (other,)
                if len(other) != len(outs) or any(a is not b and getattr(a, "_storage", 0) is not
                                                  getattr(b, "_storage", 1) for a, b in zip(outs, other, strict=False)):
                    raise violation("kernel-output", f"core {k} returned different tensors than core 0: every core "
                                    "must return the same shared HBM outputs", URL_MEMORY)
            converted = tuple(_to_output(o, as_torch) for o in outs)
        finally:
            torch.set_num_threads(threads)
        return converted if isinstance(result, tuple) else converted[0]


URL_EVRF066 = f"{DOCS}/latest/compiler/error-codes/EVRF066.html"


def _check_compiler_lnc(lnc: int, implicit: bool) -> None:
    """NKI 0.7.0: "the compiler now validates that the kernel and compiler LNC degrees match" (migration guide)."""
    if not version.at_least("0.7.0"):
        return
    compiler = logical_nc_config()
    if lnc != compiler:
        how = "kernel(...) without brackets runs at NEURON_LOGICAL_NC_CONFIG, 1 when unset" if implicit else \
            f"launched as kernel[{lnc}]"
        source = f"NEURON_LOGICAL_NC_CONFIG={compiler}" if lnc_is_set() else \
            "NEURON_LOGICAL_NC_CONFIG unset: trn2's default"
        raise violation("lnc-degree", f"the kernel runs at LNC {lnc} ({how}) but the compiler at LNC {compiler} "
                        f"({source}): launch it as kernel[{compiler}], or export NEURON_LOGICAL_NC_CONFIG={lnc} so "
                        "both agree", URL_EVRF066)


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


def jit(func=None, **options):
    """Emulated `nki.jit` (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.jit.html)."""
    if func is None:
        return lambda f: jit(f, **options)
    return Kernel(func, options)


def _to_output(t: Any, as_torch: bool):
    if not isinstance(t, Tensor) or t.buffer is not SHARED_HBM:
        raise violation("kernel-output", f"kernels return tensors allocated in nl.shared_hbm (outputs live in shared "
                        f"HBM, visible to every core of the LNC), got {t!r}", URL_MEMORY)
    value = dtypes.values(t._data.clone())  # float8_e4m3 outputs come back as their float32 values
    if not bool(t._init.all()):
        bad = int((~t._init).sum())
        raise violation("uninitialized-read", f"kernel output {t} holds {bad} of {t._init.numel()} elements that are "
                        f"{poison_report(t._storage, ~t._init, t._derived)}; write every output element (padding "
                        "rows included)",
                        URL_TILING)
    if as_torch:
        return value
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy()


def simulate(kernel):
    """Emulated `nki.simulate(kernel)(*numpy_arrays)`: runs the kernel on the CPU emulator.

    Mirrors https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.simulate.html.
    """
    return lambda *args, **kwargs: kernel(*args, **kwargs)

