"""Emulated `NkiTensor` views and access patterns over the emulator's storages (`memory`), and `nl.ndarray`."""

from __future__ import annotations

import math

import numpy as np
import torch

from . import dtypes
from .errors import violation
from .launch import current, require
from .loops import VirtualRegister
from .memory import (
    FLOAT_DTYPES,
    HBM,
    PMAX,
    PSUM,
    PSUM_BANK_BYTES,
    PSUM_PARTITION_BYTES,
    SBUF,
    SBUF_PARTITION_BYTES,
    SHARED_HBM,
    URL_AP,
    URL_AP_CAST,
    URL_MEMORY,
    URL_NKI_TENSOR,
    URL_TILE_SIZE,
    URL_TILING,
    Buffer,
    _check_owner,
    _moved,
    _poison,
    _Storage,
    _taint,
    _uninitialized,
)


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
    launch = require("nl.ndarray", URL_NKI_TENSOR)
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

    def first_partition(self) -> int:
        """The partition of an on-chip view's first row (dim 0 of its allocation is the partition dim)."""
        return self._data.storage_offset() // self._storage.data.stride(0)

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
    def _access(self, kind: str, traced: str | None = None) -> None:
        """Note a read ("r") or write ("w") of the view: in the time model's trace as `traced` (default: kind), and
        for the race check."""
        _check_owner(self._storage)
        launch = current()
        if launch is not None and (launch.accesses is not None or (launch.lnc > 1 and self._storage.shared)):
            pattern = list(zip(self._data.stride(), self._data.shape, strict=True)) or [(1, 1)]
            launch.touch(self._storage, traced or kind, self._data.storage_offset(), pattern, None)
            if launch.lnc > 1 and self._storage.shared:
                launch.record(self._storage, kind, self._data.storage_offset(), pattern, None)

    def read(self) -> torch.Tensor:
        """The values, for a use that cannot carry poison (an index, offset, register or loop bound): an unwritten
        element raises `uninitialized-read`. Traced as kind "o" (`timing`: a DMA reads its offsets when its
        descriptors are made)."""
        self._access("r", "o")
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
            if name == "scalar_offset" and isinstance(off, VirtualRegister):
                continue
            # an offset is an int32 SBUF tile or an access pattern over one (nki-library's MoE forward passes
            # token_indices.ap(...) as vector_offset); a gather-transpose's row indices are uint32
            # (nki.isa.dma_transpose: "indices.dtype is np.uint32")
            ok = (torch.int32, torch.uint32) if name == "vector_offset" else (torch.int32,)
            if off is not None and (not isinstance(off, View) or off.buffer is not SBUF or off.dtype not in ok):
                raise violation("offset-tile", f"{name} must be an int32 SBUF tile, got {off!r}", URL_AP)
        if isinstance(scalar_offset, Tensor) and tuple(scalar_offset.shape) != (1, 1):
            raise violation("scalar-offset-shape", f"scalar_offset must be a (1, 1) int32 SBUF tile (or a "
                            f"VirtualRegister), got shape {scalar_offset.shape}", URL_AP)
        if vector_offset is not None and (root.buffer not in (HBM, SHARED_HBM) or indirect_dim != 0):
            raise violation("vector-offset", f"vector_offset (indirect rows) is only supported on HBM tensors with "
                            f"indirect_dim=0; got {root.buffer} with indirect_dim={indirect_dim}", URL_AP)
        if not 0 <= indirect_dim < root.ndim:
            raise ValueError(f"indirect_dim {indirect_dim} outside [0, {root.ndim})")
        if vector_offset is not None:
            have, want = math.prod(vector_offset.shape), pattern[0][1]
            # uint32 indices (a gather-transpose's) may outnumber the rows: "indices.shape[0] * indices.shape[1]
            # must be >= src.shape[0]" (dma_transpose page); int32 row indices give one value per row
            if have < want or (have > want and vector_offset.dtype != torch.uint32):
                raise violation("offset-tile", f"vector_offset has {have} values but the outer pattern dim "
                                f"iterates {want} times", URL_AP)
        self.pattern, self.offset = pattern, int(offset)
        self.column_major = False  # a gather-transpose reads its [128, n] indices column by column
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

    def __getitem__(self, index) -> AccessPattern:
        """A basic slice of the view: per pattern dim a `start:stop[:step]` slice (or `nl.ds`), an int, or `...`; the
        result is the access pattern of the elements picked (nki-library slices `TensorView(...).get_view()`
        results, mlp_tkg_gate_up_projection.py:212). An int drops its dim, except the partition dim of an on-chip
        view, which keeps one partition."""
        index = _expand_ellipsis(index if isinstance(index, tuple) else (index,), len(self.pattern))
        if len(index) > len(self.pattern):
            raise IndexError(f"{len(index)} indices for the {len(self.pattern)}-dim access pattern {self.pattern}")
        index = tuple(index) + (slice(None),) * (len(self.pattern) - len(index))
        offset, pattern = self.offset, []
        for k in range(len(self.pattern)):
            (step, n), ix = self.pattern[k], index[k]
            if isinstance(ix, int) and not isinstance(ix, bool):
                if not -n <= ix < n:
                    raise IndexError(f"index {ix} out of range for dim {k} of size {n} of {self}")
                start, count, stride = ix % n, 1, 1
            elif isinstance(ix, slice):
                start, stop, stride = ix.indices(n)
                count = max(0, -(-(stop - start) // stride))
            else:
                raise NotImplementedError(f"access pattern index {ix!r}: only ints, slices and ... are emulated")
            if k == 0 and self.vector_offset is not None and (start, count, stride) != (0, n, 1):
                raise NotImplementedError("slicing the indirect (vector_offset) dim of an access pattern")
            offset += start * step
            if not isinstance(ix, int) or (k == 0 and self.root.buffer.on_chip):
                pattern.append((step * stride, count))
        ap = AccessPattern(self.root, pattern, offset, self.scalar_offset, self.vector_offset, self.indirect_dim,
                           self.view_dtype)
        ap.column_major = self.column_major
        return ap
    dtype = property(lambda self: self.root.dtype if self.view_dtype is None else self.view_dtype)
    buffer = property(lambda self: self.root.buffer)

    def __repr__(self) -> str:
        cast = "" if self.view_dtype is None else f", dtype={self.view_dtype}"
        return f"AccessPattern({self.root!r}, pattern={self.pattern}, offset={self.offset}{cast})"

    def _flat_index(self, kind: str, skip: bool = False, traced: str | None = None):
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
            if isinstance(off, VirtualRegister):
                values = torch.tensor([off.runtime_value()], dtype=torch.int64)
            elif name == "vector_offset" and self.column_major:  # "flat_indices = indices.T.flatten()"
                values = off.read().reshape(off.shape).to(torch.int64).T.reshape(-1)[:self.pattern[0][1]]
            else:
                values = off.read().reshape(-1).to(torch.int64)[:self.pattern[0][1]]
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
        launch = current()
        if launch is not None:
            box = race = (int(start), self.pattern, outer)
            if self.view_dtype is not None:
                box, race = self._tensor_patterns(flat)
            launch.touch(self.root._storage, traced or kind, *box)  # the time model's trace
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
        """The viewed values for an index/offset use: an unwritten element raises `uninitialized-read` (traced as
        kind "o", as Tensor.read)."""
        flat, _ = self._flat_index("r", traced="o")
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


def note_uses(run) -> None:
    """Advance the core's program clock by one instruction and mark the on-chip tiles it touches as used now.

    `run` is the instruction's closure; its cells hold the operand views (also inside lists/tuples, and the
    offset tiles of access patterns)."""
    launch = require("an NKI instruction", URL_NKI_TENSOR)
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
