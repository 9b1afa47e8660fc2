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

# Hardware numbers (NeuronCore-v3 / Trainium2). 128 partitions; PSUM is 2 MiB = 128 x 16 KiB organised in
# 8 banks of 2 KiB (512 fp32) per partition; SBUF is 28 MiB = 128 x 224 KiB on NeuronCore-v3.
PMAX = 128
PSUM_BANK_BYTES = 2048
PSUM_PARTITION_BYTES = 8 * PSUM_BANK_BYTES
SBUF_PARTITION_BYTES = 224 * 1024
GEMM_STATIONARY_FMAX = 128
GEMM_MOVING_FMAX = 512

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
    """Live on-chip bytes per partition for one kernel call (SBUF and PSUM), released by weakref finalizers."""

    def __init__(self):
        self.live = {"sbuf": 0, "psum": 0}

    def claim(self, storage: "_Storage", per_partition: int) -> None:
        kind = storage.buffer.name
        if kind not in self.live:
            return
        cap, url = (PSUM_PARTITION_BYTES, URL_MEMORY) if kind == "psum" else (SBUF_PARTITION_BYTES, URL_TRN2)
        if self.live[kind] + per_partition > cap:
            raise violation(
                f"{kind}-capacity",
                f"allocating {per_partition} B/partition of {kind.upper()} with {self.live[kind]} B already live "
                f"exceeds the {cap} B/partition capacity; free or reuse tiles (allocate inside the loop that uses "
                f"them) or tile smaller",
                url,
            )
        self.live[kind] += per_partition
        weakref.finalize(storage, self._release, kind, per_partition)

    def _release(self, kind: str, per_partition: int) -> None:
        self.live[kind] -= per_partition


_budget = _Budget()  # replaced by `jit` for every kernel call


class _Storage:
    """One allocation: the values, an initialised mask, and (PSUM) a mask of elements last written by nc_matmul."""

    __slots__ = ("data", "init", "mm", "buffer", "name", "__weakref__")

    def __init__(self, data: torch.Tensor, buffer: Buffer, name: str, initialised: bool):
        self.data = data
        self.buffer = buffer
        self.name = name
        self.init = torch.full(data.shape, initialised, dtype=torch.bool)
        self.mm = torch.zeros(data.shape, dtype=torch.bool) if buffer is PSUM else None


def allocate(shape, dtype, buffer: Buffer, name: str = "") -> "Tensor":
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
    fill = float("nan") if dtype in FLOAT_DTYPES else -(2**31)
    storage = _Storage(torch.full(shape, fill, dtype=dtype), buffer, name, initialised=False)
    if buffer.on_chip:
        _budget.claim(storage, math.prod(shape[1:]) * itemsize)
    return Tensor(storage, storage.data, storage.init, storage.mm, root=True)


def _from_array(value, buffer: Buffer, name: str) -> "Tensor":
    data = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else torch.from_numpy(np.array(value))
    if data.dtype not in SUPPORTED_DTYPES:
        hint = " (cast index tensors to int32)" if data.dtype == torch.int64 else ""
        raise NotImplementedError(f"kernel argument {name} has dtype {data.dtype}; emulated: {SUPPORTED_DTYPES}{hint}")
    storage = _Storage(data.contiguous(), buffer, name, initialised=True)
    return Tensor(storage, storage.data, storage.init, storage.mm, root=True)


class Tensor:
    """Emulated `NkiTensor`: a view (basic slicing) of one storage. dim 0 is the partition dim on chip."""

    def __init__(self, storage: _Storage, data: torch.Tensor, init: torch.Tensor, mm, root: bool):
        self._storage, self._data, self._init, self._mm, self._root = storage, data, init, mm, root

    shape = property(lambda self: tuple(self._data.shape))
    dtype = property(lambda self: self._data.dtype)
    buffer = property(lambda self: self._storage.buffer)
    ndim = property(lambda self: self._data.dim())

    def __repr__(self) -> str:
        return f"Tensor({self._storage.name or '?'}, shape={self.shape}, dtype={self.dtype}, {self.buffer})"

    def __getitem__(self, index) -> "Tensor":
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
        return Tensor(self._storage, self._data[idx], self._init[idx], mm, root=False)

    def ap(self, pattern, offset: int = 0, scalar_offset=None, vector_offset=None, indirect_dim: int = 0,
           dtype=None) -> "AccessPattern":
        """Access pattern view (`NkiTensor.ap`), allowed on the tensor returned by `nl.ndarray` only."""
        if not self._root:
            raise violation("ap-on-view", f"cannot specify an access pattern on an already indexed tensor {self}; "
                            "call .ap on the nl.ndarray itself", URL_AP)
        if dtype is not None:
            raise NotImplementedError("ap(dtype=...) reinterpret casts are outside the emulated subset")
        return AccessPattern(self, pattern, offset, scalar_offset, vector_offset, indirect_dim)

    # -- element access used by the instructions -------------------------------------------------------------
    def read(self) -> torch.Tensor:
        if not bool(self._init.all()):
            raise violation("uninitialized-read", f"{self} is read before every element was written "
                            "(NKI allocations are not initialised)", URL_TILING)
        return self._data.clone()

    def write(self, value: torch.Tensor, by_matmul: bool = False) -> None:
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
            if off is not None and (not isinstance(off, Tensor) or off.buffer is not SBUF or off.dtype != torch.int32):
                raise violation("offset-tile", f"{name} must be an int32 SBUF tile, got {off!r}", URL_AP)
        if not 0 <= indirect_dim < root.ndim:
            raise ValueError(f"indirect_dim {indirect_dim} outside [0, {root.ndim})")
        if vector_offset is not None and math.prod(vector_offset.shape) != pattern[0][1]:
            raise violation("offset-tile", f"vector_offset has {math.prod(vector_offset.shape)} values but the "
                            f"outer pattern dim iterates {pattern[0][1]} times", URL_AP)
        self.root, self.pattern, self.offset = root, pattern, int(offset)
        self.scalar_offset, self.vector_offset, self.indirect_dim = scalar_offset, vector_offset, indirect_dim

    shape = property(lambda self: tuple(n for _, n in self.pattern))
    dtype = property(lambda self: self.root.dtype)
    buffer = property(lambda self: self.root.buffer)

    def __repr__(self) -> str:
        return f"AccessPattern({self.root!r}, pattern={self.pattern}, offset={self.offset})"

    def _flat_index(self) -> torch.Tensor:
        shape = self.root.shape
        stride = math.prod(shape[self.indirect_dim + 1:])
        start = torch.tensor(self.offset, dtype=torch.int64)
        terms = [torch.arange(n, dtype=torch.int64) * s for s, n in self.pattern]
        for name, off in (("scalar_offset", self.scalar_offset), ("vector_offset", self.vector_offset)):
            if off is None:
                continue
            values = off.read().reshape(-1).to(torch.int64)
            if bool(((values < 0) | (values >= shape[self.indirect_dim])).any()):
                raise violation("index-bounds", f"{name} values {values.tolist()} outside [0, "
                                f"{shape[self.indirect_dim]}) on dim {self.indirect_dim} of {self.root} "
                                "(oob_mode.error)", URL_AP)
            if name == "scalar_offset":
                start = start + values[0] * stride
            else:
                terms[0] = values * stride
        flat = start
        for k, term in enumerate(terms):
            flat = flat.unsqueeze(-1) + term.reshape([1] * k + [-1])
        numel = math.prod(shape)
        if bool(((flat < 0) | (flat >= numel)).any()):
            raise violation("index-bounds", f"{self} addresses elements outside the {numel}-element tensor", URL_AP)
        return flat

    def read(self) -> torch.Tensor:
        flat = self._flat_index()
        if not bool(self.root._storage.init.reshape(-1)[flat].all()):
            raise violation("uninitialized-read", f"{self} reads elements never written", URL_TILING)
        return self.root._storage.data.reshape(-1)[flat].clone()

    def write(self, value: torch.Tensor, by_matmul: bool = False) -> None:
        flat = self._flat_index()
        storage = self.root._storage
        storage.data.view(-1)[flat] = value.reshape(flat.shape).to(storage.data.dtype)
        storage.init.view(-1)[flat] = True
        if storage.mm is not None:
            storage.mm.view(-1)[flat] = by_matmul


View = (Tensor, AccessPattern)


# -- kernel entry point --------------------------------------------------------------------------------------------
def jit(func=None, **options):
    """Emulated `nki.jit` (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.jit.html).

    Call the kernel with torch tensors or numpy arrays (they become HBM tensors).

    Returns torch tensors when any argument was a torch tensor, numpy arrays otherwise (bfloat16 outputs come back
    as float32 numpy, numpy having no bfloat16). `options` (e.g. platform_target) are accepted and ignored.
    """
    if func is None:
        return lambda f: jit(f, **options)

    @functools.wraps(func)
    def run(*args, **kwargs):
        global _budget
        as_torch = any(isinstance(a, torch.Tensor) for a in args)
        saved, _budget = _budget, _Budget()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tile-sized ops: intra-op threading only adds overhead
        try:
            hbm_args = [
                _from_array(a, HBM, f"arg{i}") if isinstance(a, (torch.Tensor, np.ndarray)) else a
                for i, a in enumerate(args)
            ]
            result = func(*hbm_args, **kwargs)
            outs = result if isinstance(result, tuple) else (result,)
            converted = tuple(_to_output(o, as_torch) for o in outs)
        finally:
            _budget = saved
            torch.set_num_threads(threads)
        return converted if isinstance(result, tuple) else converted[0]

    run.__wrapped_kernel__ = func
    return run


def _to_output(t: Any, as_torch: bool):
    if not isinstance(t, Tensor) or t.buffer.on_chip:
        raise violation("kernel-output", f"kernels return HBM tensors (nl.shared_hbm), got {t!r}", URL_MEMORY)
    value = t.read()  # raises if the kernel left part of an output unwritten
    if as_torch:
        return value
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy()


def simulate(kernel):
    """Emulated `nki.simulate(kernel)(*numpy_arrays)`: runs the kernel on the CPU emulator.

    Mirrors https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.simulate.html.
    """
    return lambda *args, **kwargs: kernel(*args, **kwargs)
