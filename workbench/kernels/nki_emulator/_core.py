"""Core of the NKI emulator: memories, tensors, views, access patterns, rule checks and `jit`.

Everything is stored in torch CPU tensors of the declared dtype, so a bfloat16 tile really holds bfloat16 values
(every store rounds to nearest-even through `Tensor.copy_`). Each storage also carries an "initialised" mask:
NKI allocations are not initialised ("note that memory allocation does not initialize",
https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/about/tiling-overview.html), so reading an element
that no instruction wrote raises instead of silently returning garbage.

On-chip capacity is tracked per kernel call: a storage counts while any view of it is alive (CPython
reference counting frees it deterministically when the kernel drops its last reference).
"""

from __future__ import annotations

import functools
import math
import os
import weakref
from typing import Any

import numpy as np
import torch

DOCS = "https://awsdocs-neuron.readthedocs-hosted.com/en"
URL_TILING = f"{DOCS}/latest/nki/about/tiling-overview.html"
URL_MEMORY = f"{DOCS}/latest/nki/about/memory-hierarchy-overview.html"
URL_TRN2 = f"{DOCS}/latest/nki/about/trainium2_arch.html"
URL_TILE_SIZE = f"{DOCS}/v2.33.0/nki/api/nki.language.tile_size.html"
URL_NKI_TENSOR = f"{DOCS}/v2.33.0/nki/api/generated/nki.language.NkiTensor.html"
URL_AP = f"{DOCS}/latest/nki/deep-dives/nki-aps.html"
URL_LNC = f"{DOCS}/v2.33.1/nki/get-started/about/lnc.html"

# Hardware numbers (NeuronCore-v3 / Trainium2). 128 partitions; PSUM is 2 MiB = 128 x 16 KiB organised in
# 8 banks of 2 KiB (512 fp32) per partition; SBUF is 28 MiB = 128 x 224 KiB on NeuronCore-v3.
PMAX = 128
PSUM_BANK_BYTES = 2048
PSUM_PARTITION_BYTES = 8 * PSUM_BANK_BYTES
SBUF_PARTITION_BYTES = 224 * 1024
GEMM_STATIONARY_FMAX = 128
GEMM_MOVING_FMAX = 512

PSUM_BANKS = 8

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class NkiRuleError(RuntimeError):
    """A kernel broke a documented NKI/NeuronCore rule; the message names the rule, the fix and the doc page."""

    def __init__(self, rule: str, detail: str, url: str):
        self.rule = rule
        super().__init__(f"[{rule}] {detail} (see {url})")


def violation(rule: str, detail: str, url: str) -> NkiRuleError:
    return NkiRuleError(rule, detail, url)


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


class _Budget:
    """Live on-chip bytes per partition of one core (SBUF and PSUM), released by weakref finalizers.

    PSUM is 8 banks of 2 KiB per partition and a PSUM tile is bank-aligned (psum_bank_fmax: one tile per bank),
    so every live PSUM tile takes a whole bank however small it is: at most 8 live PSUM tiles per core.
    """

    def __init__(self):
        self.live = {"sbuf": 0, "psum": 0}
        self.peak = {"sbuf": 0, "psum": 0}  # high-water mark of live bytes/partition (Counters.sbuf_peak)

    def claim(self, storage: _Storage, per_partition: int) -> _Claim | None:
        """Count the allocation; it stays live while the returned claim (held by the kernel's views) is alive."""
        kind = storage.buffer.name
        if kind not in self.live:
            return None
        if kind == "psum":
            per_partition = PSUM_BANK_BYTES * math.ceil(per_partition / PSUM_BANK_BYTES)  # whole banks
        cap, url = (PSUM_PARTITION_BYTES, URL_MEMORY) if kind == "psum" else (SBUF_PARTITION_BYTES, URL_TRN2)
        if self.live[kind] + per_partition > cap:
            banks = f" ({self.live[kind] // PSUM_BANK_BYTES} of {PSUM_BANKS} banks in use; each PSUM tile takes a " \
                "whole 2 KiB bank)" if kind == "psum" else ""
            raise violation(
                f"{kind}-capacity",
                f"allocating {per_partition} B/partition of {kind.upper()} with {self.live[kind]} B already live "
                f"exceeds the {cap} B/partition capacity{banks}; free or reuse tiles (allocate inside the loop that "
                f"uses them) or tile smaller",
                url,
            )
        self.live[kind] += per_partition
        self.peak[kind] = max(self.peak[kind], self.live[kind])
        claim = _Claim()
        weakref.finalize(claim, self._release, kind, per_partition)
        return claim

    def _release(self, kind: str, per_partition: int) -> None:
        self.live[kind] -= per_partition


class _Claim:
    """Liveness token of one on-chip allocation. Views the kernel holds reference it; the copies of views that
    recorded instructions keep (dynamic-loop bodies) do not, so a tile the kernel drops frees its space even while
    a traced loop body still uses it: the compiler reuses space by liveness within the body the same way."""

    __slots__ = ("__weakref__",)


class _Storage:
    """One allocation: the values, an initialised mask, and (PSUM) a mask of elements last written by nc_matmul."""

    __slots__ = ("data", "init", "mm", "buffer", "name", "core", "shared", "__weakref__")

    def __init__(self, data: torch.Tensor, buffer: Buffer, name: str, initialised: bool):
        self.data = data
        self.buffer = buffer
        self.name = name
        # owner core of private memories (SBUF, PSUM, nl.hbm); None for shared HBM (kernel args, nl.shared_hbm)
        launch = _runtime.current()
        self.shared = buffer is SHARED_HBM or launch is None
        self.core = None if self.shared else launch.core
        self.init = torch.full(data.shape, initialised, dtype=torch.bool)
        self.mm = torch.zeros(data.shape, dtype=torch.bool) if buffer is PSUM else None


def allocate(shape, dtype, buffer: Buffer, name: str = "") -> Tensor:
    """`nl.ndarray`: allocate an uninitialised tensor, checking the tile rules for on-chip memories."""
    shape = tuple(int(s) for s in shape)
    if dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(f"dtype {dtype} is outside the emulated subset {SUPPORTED_DTYPES}")
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
    fill = float("nan") if dtype in FLOAT_DTYPES else -(2**31)
    storage = _Storage(torch.full(shape, fill, dtype=dtype), buffer, name, initialised=False)
    if buffer is SHARED_HBM:
        launch.shared.append(storage)
    if not buffer.on_chip:
        launch.hbm.append(storage)
    claim = None
    if buffer.on_chip:
        claim = launch.budgets[launch.core].claim(storage, math.prod(shape[1:]) * itemsize)
    return Tensor(storage, storage.data, storage.init, storage.mm, root=True, claim=claim)


def _from_array(value, buffer: Buffer, name: str) -> Tensor:
    data = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else torch.from_numpy(np.array(value))
    if data.dtype not in SUPPORTED_DTYPES:
        hint = " (cast index tensors to int32)" if data.dtype == torch.int64 else ""
        raise NotImplementedError(f"kernel argument {name} has dtype {data.dtype}; emulated: {SUPPORTED_DTYPES}{hint}")
    storage = _Storage(data.contiguous(), buffer, name, initialised=True)
    return Tensor(storage, storage.data, storage.init, storage.mm, root=True)


class Tensor:
    """Emulated `NkiTensor`: a view (basic slicing) of one storage. dim 0 is the partition dim on chip."""

    def __init__(self, storage: _Storage, data: torch.Tensor, init: torch.Tensor, mm, root: bool, claim=None):
        self._storage, self._data, self._init, self._mm, self._root = storage, data, init, mm, root
        self._claim = claim

    def detached(self) -> Tensor:
        """The same view without the liveness claim (what a recorded instruction keeps)."""
        return Tensor(self._storage, self._data, self._init, self._mm, self._root)

    shape = property(lambda self: tuple(self._data.shape))
    dtype = property(lambda self: self._data.dtype)
    buffer = property(lambda self: self._storage.buffer)
    ndim = property(lambda self: self._data.dim())

    def __repr__(self) -> str:
        return f"Tensor({self._storage.name or '?'}, shape={self.shape}, dtype={self.dtype}, {self.buffer})"

    def __getitem__(self, index) -> Tensor:
        index = index if isinstance(index, tuple) else (index,)
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
                if dim == 0 and self.buffer.on_chip:
                    raise violation(
                        "partition-view", f"integer index on the partition dim of {self} would drop it; slice it "
                        f"instead (e.g. t[{ix}:{ix}+1])", URL_NKI_TENSOR)
                norm.append(int(ix))
            else:
                raise NotImplementedError(f"index {ix!r}: only ints and slices are emulated")
        idx = tuple(norm)
        mm = None if self._mm is None else self._mm[idx]
        return Tensor(self._storage, self._data[idx], self._init[idx], mm, root=False, claim=self._claim)

    def ap(self, pattern, offset: int = 0, scalar_offset=None, vector_offset=None, indirect_dim: int = 0,
           dtype=None) -> AccessPattern:
        """Access pattern view (`NkiTensor.ap`), allowed on the tensor returned by `nl.ndarray` only."""
        if not self._root:
            raise violation("ap-on-view", f"cannot specify an access pattern on an already indexed tensor {self}; "
                            "call .ap on the nl.ndarray itself", URL_AP)
        if dtype is not None:
            raise NotImplementedError("ap(dtype=...) reinterpret casts are outside the emulated subset")
        return AccessPattern(self, pattern, offset, scalar_offset, vector_offset, indirect_dim)

    # -- element access used by the instructions -------------------------------------------------------------
    def _access(self, kind: str) -> None:
        _check_owner(self._storage)
        launch = _runtime.current()
        if launch is not None and launch.lnc > 1 and self._storage.shared:
            pattern = list(zip(self._data.stride(), self._data.shape, strict=True)) or [(1, 1)]
            launch.record(self._storage, kind, self._data.storage_offset(), pattern, None)

    def read(self) -> torch.Tensor:
        self._access("r")
        if not bool(self._init.all()):
            _uninitialized(self._storage, f"{self} is read before every element was written (NKI allocations are "
                           "not initialised)")
        return self._data.clone()

    def write(self, value: torch.Tensor, by_matmul: bool = False) -> None:
        self._access("w")
        self._data.copy_(value.reshape(self.shape))  # copy_ casts: fp32 -> bf16 rounds to nearest-even
        self._init.fill_(True)
        if self._mm is not None:
            self._mm.fill_(by_matmul)

    def written_by_matmul(self) -> bool:
        return self._mm is not None and bool(self._mm.all())


class AccessPattern:
    """`t.ap(pattern=[[step, num], ...], offset, scalar_offset|vector_offset, indirect_dim)` on a root tensor.

    Semantics (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/deep-dives/nki-aps.html): the tensor is
    flattened; element (i0, i1, ...) of the view is flat[offset + sum_k i_k * step_k]. `scalar_offset` (a 1-element
    SBUF int tile, read at execution time) adds value * stride(indirect_dim) of the tensor to the start.
    `vector_offset` (an SBUF int tile with one value per outer iteration) replaces the outermost term i0 * step0
    by value[i0] * stride(indirect_dim): a row gather/scatter. Out-of-range indices raise (oob_mode.error).
    """

    def __init__(self, root: Tensor, pattern, offset, scalar_offset, vector_offset, indirect_dim):
        pattern = [(int(s), int(n)) for s, n in pattern]
        if scalar_offset is not None and vector_offset is not None:
            raise ValueError("at most one of scalar_offset and vector_offset can be given")
        if any(n <= 0 for _, n in pattern):
            raise violation("index-bounds", f"access pattern {pattern} has an empty dimension", URL_AP)
        if root.buffer.on_chip:
            free = math.prod(root.shape[1:])
            if pattern[0][0] != free or pattern[0][1] > root.shape[0]:
                raise violation(
                    "ap-partition-contiguity",
                    f"on {root.buffer} the first pattern entry must walk partitions contiguously: step {free} "
                    f"(the free size) and count <= {root.shape[0]}, got {pattern[0]}",
                    URL_AP,
                )
        for name, off in (("scalar_offset", scalar_offset), ("vector_offset", vector_offset)):
            if name == "scalar_offset" and isinstance(off, _runtime.VirtualRegister):
                continue
            if off is not None and (not isinstance(off, Tensor) or off.buffer is not SBUF or off.dtype != torch.int32):
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
        self.root, self.pattern, self.offset = root, pattern, int(offset)
        self.scalar_offset, self.vector_offset, self.indirect_dim = scalar_offset, vector_offset, indirect_dim

    def detached(self) -> AccessPattern:
        ap = object.__new__(AccessPattern)
        ap.__dict__.update(self.__dict__)
        ap.root = self.root.detached()
        if isinstance(self.scalar_offset, Tensor):
            ap.scalar_offset = self.scalar_offset.detached()
        if self.vector_offset is not None:
            ap.vector_offset = self.vector_offset.detached()
        return ap

    shape = property(lambda self: tuple(n for _, n in self.pattern))
    dtype = property(lambda self: self.root.dtype)
    buffer = property(lambda self: self.root.buffer)

    def __repr__(self) -> str:
        return f"AccessPattern({self.root!r}, pattern={self.pattern}, offset={self.offset})"

    def _flat_index(self, kind: str) -> torch.Tensor:
        _check_owner(self.root._storage)
        shape = self.root.shape
        stride = math.prod(shape[self.indirect_dim + 1:])
        start = torch.tensor(self.offset, dtype=torch.int64)
        terms = [torch.arange(n, dtype=torch.int64) * s for s, n in self.pattern]
        outer = None
        for name, off in (("scalar_offset", self.scalar_offset), ("vector_offset", self.vector_offset)):
            if off is None:
                continue
            if isinstance(off, _runtime.VirtualRegister):
                values = torch.tensor([off.runtime_value()], dtype=torch.int64)
            else:
                values = off.read().reshape(-1).to(torch.int64)
            if bool(((values < 0) | (values >= shape[self.indirect_dim])).any()):
                raise violation("index-bounds", f"{name} values {values.tolist()} outside [0, "
                                f"{shape[self.indirect_dim]}) on dim {self.indirect_dim} of {self.root} "
                                "(oob_mode.error)", URL_AP)
            if name == "scalar_offset":
                start = start + values[0] * stride
            else:
                terms[0] = outer = values * stride
        flat = start
        for k, term in enumerate(terms):
            flat = flat.unsqueeze(-1) + term.reshape([1] * k + [-1])
        numel = math.prod(shape)
        if bool(((flat < 0) | (flat >= numel)).any()):
            raise violation("index-bounds", f"{self} addresses elements outside the {numel}-element tensor", URL_AP)
        launch = _runtime.current()
        if launch is not None and launch.lnc > 1 and self.root._storage.shared:
            launch.record(self.root._storage, kind, int(start), self.pattern, outer)
        return flat

    def read(self) -> torch.Tensor:
        flat = self._flat_index("r")
        if not bool(self.root._storage.init.reshape(-1)[flat].all()):
            _uninitialized(self.root._storage, f"{self} reads elements never written")
        return self.root._storage.data.reshape(-1)[flat].clone()

    def write(self, value: torch.Tensor, by_matmul: bool = False) -> None:
        flat = self._flat_index("w")
        storage = self.root._storage
        storage.data.view(-1)[flat] = value.reshape(flat.shape).to(storage.data.dtype)
        storage.init.view(-1)[flat] = True
        if storage.mm is not None:
            storage.mm.view(-1)[flat] = by_matmul


View = (Tensor, AccessPattern)


def _check_owner(storage: _Storage) -> None:
    """SBUF, PSUM and nl.hbm are private to the core that allocated them (per-core memories under LNC)."""
    launch = _runtime.current()
    if launch is not None and storage.core is not None and storage.core != launch.core:
        raise violation("lnc-private-memory", f"core {launch.core} touches {storage.buffer} tensor "
                        f"{storage.name or '?'} of core {storage.core}: each physical core has its own SBUF/PSUM "
                        "(and nl.hbm is private); exchange data through nl.shared_hbm and a core_barrier", URL_LNC)


def _uninitialized(storage: _Storage, detail: str) -> None:
    """Raise `uninitialized-read`, or under LNC > 1 on shared HBM defer it to the next barrier.

    Cores run one at a time, so reading what the other core writes later in the same epoch finds it unwritten
    here. Deferring lets the epoch finish: the race check at the barrier then names both instructions
    (`lnc-race`); if there was no race the deferred error is raised there (or as soon as the garbage read makes
    anything else fail).
    """
    launch = _runtime.current()
    error = violation("uninitialized-read", detail, URL_TILING)
    if launch is None or launch.lnc == 1 or not storage.shared:
        raise error
    if launch.pending is None:
        launch.pending = violation(
            "uninitialized-read", f"{detail}; under LNC {launch.lnc} the emulator runs core 0 up to its next "
            "core_barrier before core 1: if another core writes these elements, a nisa.core_barrier must separate "
            "the write from this read", URL_TILING)


# -- kernel entry point --------------------------------------------------------------------------------------------
class Kernel:
    """An emulated `@nki.jit` kernel: `kernel[lnc](*args)` launches on an LNC grid; `kernel(*args)` at the LNC of
    NEURON_LOGICAL_NC_CONFIG (1 when unset), as the NKI LNC page describes.

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
            lnc = self.lnc if self.lnc is not None else _env_lnc()
            results = _runtime.run_launch(lnc, lambda: self.func(*hbm_args, **kwargs))
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


def _env_lnc() -> int:
    """LNC of a launch without brackets: NEURON_LOGICAL_NC_CONFIG when set, else 1 (the LNC page and NCC_EVRF066)."""
    value = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1")
    if value not in ("1", "2"):
        raise violation("lnc-grid", f"NEURON_LOGICAL_NC_CONFIG={value!r}: the LNC degree is 1 or 2", URL_LNC)
    return int(value)


def jit(func=None, **options):
    """Emulated `nki.jit` (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.jit.html)."""
    if func is None:
        return lambda f: jit(f, **options)
    return Kernel(func, options)


def _to_output(t: Any, as_torch: bool):
    if not isinstance(t, Tensor) or t.buffer is not SHARED_HBM:
        raise violation("kernel-output", f"kernels return tensors allocated in nl.shared_hbm (outputs live in shared "
                        f"HBM, visible to every core of the LNC), got {t!r}", URL_MEMORY)
    value = t._data.clone()
    if not bool(t._init.all()):
        raise violation("uninitialized-read", f"kernel output {t} is returned before every element was written",
                        URL_TILING)
    if as_torch:
        return value
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy()


def simulate(kernel):
    """Emulated `nki.simulate(kernel)(*numpy_arrays)`: runs the kernel on the CPU emulator.

    Mirrors https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.simulate.html.
    """
    return lambda *args, **kwargs: kernel(*args, **kwargs)


from . import _runtime, _subset  # noqa: E402 - these import names defined above
