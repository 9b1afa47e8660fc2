"""Emulated `nki.isa` (nisa): the instructions `workbench.kernels.nki_moe` uses, with their documented rules.

Each instruction checks memory kinds, shapes and dtypes first (raising `NkiRuleError` naming the rule), then
computes like the engine does: Vector/Scalar engines cast inputs to fp32, compute in fp32 and cast on store;
the Tensor Engine multiplies in fp32 and accumulates in fp32 PSUM. Options a kernel here does not use raise
NotImplementedError instead of being silently ignored.
"""

from __future__ import annotations

import contextlib
import math

import torch

from . import (
    constants,  # noqa: F401 - nki.isa.constants
    dtypes,
    version,
)
from . import language as nl
from .constants import dge_mode, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd  # noqa: F401 - nisa.*
from .constants import engine as engine_enum  # nc_transpose's parameter shadows the name
from .errors import violation
from .launch import URL_BARRIER, call_site, current, require
from .launch import emit as emit_instruction
from .loops import VirtualRegister
from .memory import (
    DOCS,
    FLOAT_DTYPES,
    GEMM_MOVING_FMAX,
    GEMM_STATIONARY_FMAX,
    PMAX,
    PSUM,
    SBUF,
    SHARED_HBM,
    URL_NKI_TENSOR,
    URL_TRN2,
)
from .tensors import AccessPattern, Tensor, View, note_uses
from .timing import dma_work, elementwise_work, matmul_work, transpose_work

API = f"{DOCS}/v2.33.0/nki/api/generated"
URL_MATMUL = f"{API}/nki.isa.nc_matmul.html"
URL_TRANSPOSE = f"{DOCS}/latest/nki/api/generated/nki.isa.nc_transpose.html"
URL_DMA = f"{DOCS}/latest/nki/api/generated/nki.isa.dma_copy.html"
URL_TENSOR_TENSOR = f"{API}/nki.isa.tensor_tensor.html"
URL_TENSOR_SCALAR = f"{API}/nki.isa.tensor_scalar.html"
URL_ACTIVATION = f"{API}/nki.isa.activation.html"
URL_TENSOR_COPY = f"{DOCS}/latest/nki/api/generated/nki.isa.tensor_copy.html"
URL_MEMSET = f"{API}/nki.isa.memset.html"
URL_DMA_COMPUTE = f"{DOCS}/latest/nki/api/generated/nki.isa.dma_compute.html"
URL_ACTIVATION_LATEST = f"{DOCS}/latest/nki/api/generated/nki.isa.activation.html"
URL_REGISTER_ALLOC = f"{DOCS}/latest/nki/api/generated/nki.isa.register_alloc.html"
URL_ACTIVATION_REDUCE = f"{API}/nki.isa.activation_reduce.html"
URL_TENSOR_SCALAR_REDUCE = f"{API}/nki.isa.tensor_scalar_reduce.html"


# Engine selectors (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.29.1/nki/api/generated/nki.isa.engine.html):
# nisa.vector_engine etc. are the members of nisa.engine.
unknown_engine, tensor_engine, vector_engine = engine.unknown, engine.tensor, engine.vector
scalar_engine, gpsimd_engine, sync_engine = engine.scalar, engine.gpsimd, engine.sync


_TARGET = [nc_version.gen3]  # the NeuronCore generation being emulated (`targeting`)


def get_nc_version() -> nc_version:
    """The NeuronCore generation the kernel is compiled for: trn2's NeuronCore-v3 (gen3) unless `targeting` says
    otherwise."""
    return _TARGET[-1]


@contextlib.contextmanager
def targeting(generation: nc_version):
    """Emulate another NeuronCore generation's per-generation rules (e.g. gen2: no 32-wide PE tiles) inside the
    block; the rates of the time model are chosen separately (`timing.TRN1`)."""
    _TARGET.append(generation)
    try:
        yield
    finally:
        _TARGET.pop()


def emit(engine_name: str, op: str, run, work=None) -> None:
    """Issue an instruction: note the tiles it uses (on-chip liveness), then run or record it (launch.emit) with
    its work descriptor for the time model (`timing.py`; None: not modelled, counted as such)."""
    note_uses(run)
    emit_instruction(engine_name, op, run, work)


# -- shared checks ---------------------------------------------------------------------------------------------------
def _view(t, what: str, op: str):
    if not isinstance(t, View):
        raise TypeError(f"{op}: {what} must be an NKI tensor or access pattern, got {type(t).__name__}")
    return t


def _on_chip(t, what: str, op: str, url: str) -> None:
    _view(t, what, op)
    if getattr(t, "partitionless", False):
        raise violation("partition-view", f"{op}: {what} {t} was indexed with an integer on the partition dim, so "
                        "it has no partitions for a compute engine; slice it instead (e.g. t[0:1, ...])",
                        URL_NKI_TENSOR)
    if not t.buffer.on_chip:
        raise violation("engine-buffer", f"{op}: {what} is in {t.buffer}; compute engines only access SBUF/PSUM, "
                        "so dma_copy it into an SBUF tile first", url)


def _per_partition(t) -> tuple[int, int]:
    return t.shape[0], math.prod(t.shape[1:])


def _same_layout(op: str, url: str, **tiles) -> None:
    """Operands must have the same partition size and the same number of elements per partition."""
    layouts = {name: _per_partition(t) for name, t in tiles.items()}
    if len(set(layouts.values())) > 1:
        raise violation("elementwise-shape", f"{op}: operands differ in (partitions, elements per partition): "
                        f"{layouts}", url)


def _data(t) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fp32 values, poison mask or None) of an operand an engine computes on: unwritten elements are poison, not
    an error (hardware reads whatever is there); the instruction makes the results they feed poison (`_clean`)."""
    value, poison = t.read_data()
    return value.float(), poison


def _clean(dst, *masks) -> torch.Tensor | None:
    """The written-mask (`write(init=)`) of a result in dst's shape whose element is poison where an input's is:
    each mask is either in dst's layout (same element count) or one value per partition (a (P, 1) operand, or a
    reduction over the free dims), broadcast along the free dims. None when no input held poison."""
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    out = torch.zeros(dst.shape, dtype=torch.bool)
    for m in masks:
        out |= m.reshape(dst.shape) if m.numel() == out.numel() else m.reshape([dst.shape[0]] + [1] * (out.dim() - 1))
    return ~out


def _check_operand(value, data, what: str, op: str, url: str) -> None:
    """A scalar float or a per-partition (P, 1) vector broadcast along the free dims."""
    if isinstance(value, (int, float)):
        return
    _on_chip(value, what, op, url)
    if _per_partition(value) != (data.shape[0], 1):  # a (P, 1) tile or a (P,) view of one column
        raise violation("operand-shape", f"{op}: {what} must be a float or a ({data.shape[0]}, 1) tile, got shape "
                        f"{value.shape}", url)


def _operand(value, data) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The operand's value at execution time, broadcastable against `data`, and its poison mask (per partition)."""
    if isinstance(value, (int, float)):
        return torch.as_tensor(float(value), dtype=torch.float32), None
    v, poison = _data(value)
    return v.reshape([data.shape[0]] + [1] * (len(data.shape) - 1)), poison


def _engine(engine_, default: str) -> str:
    """The counter name of the engine an instruction runs on ("vector", ...); `unknown` picks `default`."""
    if engine_ is None or engine_ is engine.unknown:
        return default
    if not isinstance(engine_, engine):
        raise TypeError(f"engine must be a nisa.engine member (e.g. nisa.vector_engine), got {engine_!r}")
    return engine_.value


def _arith(op, name: str, url: str):
    if op not in nl.ARITHMETIC:
        raise NotImplementedError(f"{name}: op {op!r} outside the emulated subset {nl.ARITHMETIC} ({url})")
    if op in nl.ARITHMETIC_UNARY:  # abs etc. between two tensors: no page says what that computes
        raise NotImplementedError(f"{name}: the unary ALU op {op!r} is emulated only as a tensor_scalar / "
                                  f"tensor_scalar_reduce op with operand None or 0 ({nl.URL_ALU_OPS})")
    return op.fn


def _scalar_op(op, operand, reverse, name: str, url: str):
    """(fn(x, operand), operand) of one tensor_scalar-style op: a binary ALU op, or a unary one (nl.abs), which
    applies to data alone; its operand "Must be None or 0 when op0 is a unary operator (e.g., nl.abs)"
    (tensor_scalar / tensor_scalar_reduce pages), and with one input there is nothing to reverse."""
    if op not in nl.ARITHMETIC_UNARY:
        return _arith(op, name, url), operand
    if not (operand is None or (isinstance(operand, (int, float)) and float(operand) == 0.0)) or reverse:
        raise violation("unary-operand", f"{name}: {op!r} is a unary ALU op: its operand must be None or 0 and "
                        f"reverse False, got operand {operand!r}, reverse {reverse!r}", nl.URL_ALU_OPS)
    fn = op.fn
    return (lambda x, _: fn(x)), 0.0


# -- Tensor Engine -----------------------------------------------------------------------------------------------------
def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=None, name=None):
    """dst (PSUM, fp32) = stationary.T @ moving, or += when accumulate=True (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.nc_matmul.html).

    `tile_position` / `tile_size` (PE tiling, `_pe_tile`): the matmul runs on a (row_size, column_size) tile of the
    128 x 128 PE array at (start_row, start_column), so matmuls on disjoint tiles may run in parallel; the result is
    the same stationary.T @ moving, written where `dst` points."""
    op, url = "nc_matmul", URL_MATMUL
    if is_stationary_onezero or is_moving_onezero or perf_mode not in (None, matmul_perf_mode.none):
        raise NotImplementedError("nc_matmul: onezero/perf modes are outside the emulated subset")
    if is_transpose:  # the PE transpose: stationary.T @ identity, bit-accurate, in dst's dtype (nc_transpose page)
        accumulate = False
    for what, t, want in (("stationary", stationary, SBUF), ("moving", moving, SBUF), ("dst", dst, PSUM)):
        _view(t, what, op)
        if t.buffer is not want:
            raise violation("matmul-operand-buffer", f"nc_matmul reads stationary/moving from SBUF and writes dst "
                            f"to PSUM; {what} is in {t.buffer}", url)
    for what, t in (("stationary", stationary), ("moving", moving), ("dst", dst)):
        if len(t.shape) != 2:
            raise NotImplementedError(f"nc_matmul: only 2-D operands are emulated; {what} has shape {t.shape}")
    (k_s, m), (k_m, n) = stationary.shape, moving.shape
    if k_s != k_m:
        raise violation("matmul-contraction", f"stationary {stationary.shape} and moving {moving.shape} must have "
                        "the same partition (contraction) size", url)
    if k_s > PMAX:
        raise violation("matmul-stationary-size", f"contraction (partition) size {k_s} exceeds {PMAX}", url)
    if m > GEMM_STATIONARY_FMAX:
        raise violation("matmul-stationary-size", f"stationary free size {m} exceeds gemm_stationary_fmax="
                        f"{GEMM_STATIONARY_FMAX}; split the output partitions into tiles of <= 128", url)
    if n > GEMM_MOVING_FMAX:
        raise violation("matmul-moving-size", f"moving free size {n} exceeds gemm_moving_fmax={GEMM_MOVING_FMAX}; "
                        "split the moving free dim into chunks of <= 512", url)
    for what, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype not in FLOAT_DTYPES:
            raise violation("matmul-input-dtype", f"{what} dtype {t.dtype} is not a matmul input type", url)
    if (stationary.dtype == torch.float32) != (moving.dtype == torch.float32):
        raise violation("matmul-dtype-mix", f"stationary is {stationary.dtype} and moving is {moving.dtype}: fp32 "
                        "matmul operands cannot be mixed with bf16/fp16 ones; cast both to the same kind", url)
    if dst.dtype != torch.float32 and not is_transpose:
        raise violation("matmul-psum-dtype", f"matmul results accumulate in fp32 PSUM; dst dtype is {dst.dtype}, "
                        "allocate it with dtype=nl.float32", url)
    if tuple(dst.shape) != (m, n):
        raise violation("matmul-output-shape", f"dst shape {dst.shape} != (stationary free, moving free) = "
                        f"{(m, n)}", url)
    tile = _pe_tile(tile_position, tile_size, k_s, m)
    _row_tile_partitions(tile, (("stationary", stationary), ("moving", moving)))

    def run():
        if is_transpose:  # a data movement: unwritten stationary elements arrive unwritten
            value, init, _ = _read_moved(stationary)
            dst.write(value.reshape(k_s, m).T.contiguous(), by_matmul=True, init=init.reshape(k_s, m).T.contiguous())
            current().stats.pe_flops += 2 * k_s * m * n
            return
        (s, s_poison), (mv, m_poison) = _data(stationary), _data(moving)
        result = s.T @ mv
        poison = None if s_poison is None and m_poison is None else _matmul_poison(s, s_poison, mv, m_poison)
        # accumulate=None (NKI 0.3 has no such parameter; 0.4+ default): continue the accumulation group when
        # every dst element was last written by nc_matmul, else open one (overwrite). Interpretation: nki-library's
        # kernels accumulate over H tiles into freshly allocated PSUM with no accumulate argument.
        if accumulate or (accumulate is None and isinstance(dst, Tensor) and dst.written_by_matmul()):
            if not (isinstance(dst, Tensor) and dst.written_by_matmul()):
                raise violation("matmul-accumulate-init", "accumulate=True onto PSUM elements not written by a "
                                "previous nc_matmul (uninitialised or written by another engine is undefined on "
                                "NeuronCore-v3); open each accumulation group with accumulate=False", url)
            previous, p_poison = _data(dst)
            result = result + previous.reshape(m, n)
            poison = poison if p_poison is None else p_poison.reshape(m, n) | (False if poison is None else poison)
        dst.write(result, by_matmul=True, init=None if poison is None else ~poison)
        current().stats.pe_flops += 2 * k_s * m * n

    emit("tensor", op, run, matmul_work(stationary, moving, tile))


PE_TILE_SIZES = (32, 64, 128)  # "2x 64 row tiles (NeuronCore-v2 or newer), or 4x 32 row tiles (NeuronCore-v3 or newer)"


def _pe_tile(position, size, rows: int, cols: int) -> tuple:
    """The PE tile (start_row, row_size, start_column, column_size) of a tiled nc_matmul, () when untiled, checked
    against the nc_matmul page (v2.33.0, "Tiling mode"; the "Estimated instruction cost" section of v2.26.1 lists
    the same requirements): both or neither of tile_position / tile_size; each a (row, column) pair of ints; sizes
    of 32, 64 or 128 (32 only from NeuronCore-v3 on); each start a multiple of its size and inside the 128 x 128
    array; the stationary tile (`rows` contraction partitions x `cols` free) no larger than the tile."""
    if not position and not size:
        return ()
    if not position or not size:
        raise violation("matmul-tiling", f"tile_position={position!r} and tile_size={size!r}: both must be set to "
                        "enable PE tiling (neither: the full array)", URL_MATMUL)
    pairs = (("tile_position", position), ("tile_size", size))
    for what, pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in pair):
            raise violation("matmul-tiling", f"{what} must be a (row, column) pair of ints, got {pair!r}", URL_MATMUL)
    (row0, col0), (row_size, col_size) = position, size
    for what, n in (("row size", row_size), ("column size", col_size)):
        if n not in PE_TILE_SIZES:
            raise violation("matmul-tiling", f"tile_size {what} {n}: the PE array tiles into 2 x 64 or 4 x 32 (or "
                            "the whole 128)", URL_MATMUL)
        if n == 32 and get_nc_version() < nc_version.gen3:
            raise violation("matmul-tiling", f"tile_size {what} 32: 4 x 32 tiles need NeuronCore-v3 or newer; "
                            f"{get_nc_version().name} tiles into 2 x 64 at most", URL_MATMUL)
    for what, start, n in (("start_row", row0, row_size), ("start_column", col0, col_size)):
        if start < 0 or start % n or start + n > 128:
            raise violation("matmul-tiling", f"tile_position {what} {start} must be a multiple of its tile size {n} "
                            "with the tile inside the 128 x 128 array", URL_MATMUL)
    if rows > row_size or cols > col_size:
        raise violation("matmul-tiling", f"the stationary tile [{rows}, {cols}] (contraction partitions, free) "
                        f"exceeds tile_size {tuple(size)}: it must fit the PE tile", URL_MATMUL)
    return (row0, row_size, col0, col_size)


def _row_tile_partitions(tile: tuple, operands) -> None:
    """A row tile's operands lie on the SBUF partitions that feed its PE rows: partition p feeds PE row p (the
    Trainium2 guide, "Double FP8 Matmul Performance": "each partition feeding data into each row of processing
    elements inside the TensorE"), so a tile of row_size rows at start_row r contracts partitions [r, r + row_size)
    (the nc_matmul page: tile_position (64, 0), tile_size (64, 128) is "the bottom half of the systolic array")."""
    if not tile or tile[1] == PMAX:
        return
    row0, rows = tile[0], tile[1]
    for what, t in operands:
        if isinstance(t, AccessPattern):
            raise NotImplementedError("nc_matmul: row-tiled access-pattern operands are outside the emulated subset")
        first = t.first_partition()
        if first < row0 or first + t.shape[0] > row0 + rows:
            raise violation("matmul-tiling", f"{what} {t} is on partitions [{first}, {first + t.shape[0]}); the row "
                            f"tile at start_row {row0} is fed by partitions [{row0}, {row0 + rows}) (partition p "
                            "feeds PE row p)", URL_TRN2)


def _matmul_poison(s, s_poison, mv, m_poison) -> torch.Tensor:
    """Which elements of out = s.T @ mv are poison: out[i, j] = sum_k s[k, i] * mv[k, j], so a poison s[k, i]
    poisons out[i, j] unless mv[k, j] is an exact (written) zero, and likewise for a poison mv[k, j]. So the padding
    columns of a token tile stay in the padding rows of the result, and a transpose by a matmul against an identity
    moves poison only where it moves the element. Assumption, stated in docs/nki_emulator.md: what unwritten memory
    holds is finite (stale data), so garbage times an exact zero is zero, as on hardware unless it happens to hold
    a NaN/Inf bit pattern."""
    zero = torch.zeros((), dtype=torch.bool)
    s_poison = zero.expand(s.shape) if s_poison is None else s_poison.reshape(s.shape)
    m_poison = zero.expand(mv.shape) if m_poison is None else m_poison.reshape(mv.shape)
    live_s, live_m = ((s != 0) | s_poison).float(), ((mv != 0) | m_poison).float()  # may contribute a nonzero
    return (s_poison.float().T @ live_m + live_s.T @ m_poison.float()) > 0


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """dst = data.T between partition and (flattened) free dims (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.nc_transpose.html)."""
    op, url = "nc_transpose", URL_TRANSPOSE
    _on_chip(data, "data", op, url)
    _on_chip(dst, "dst", op, url)
    p, f = _per_partition(data)
    if dst.dtype != data.dtype:
        raise violation("transpose-dtype", f"dst dtype {dst.dtype} must equal data dtype {data.dtype}", url)
    if tuple(dst.shape) != (f, p):
        raise violation("transpose-shape", f"dst shape {dst.shape} must be {(f, p)} for data {data.shape}", url)
    on_pe = engine is engine_enum.tensor or (engine is engine_enum.unknown and data.buffer is SBUF
                                                     and dst.buffer is PSUM)
    if on_pe:
        if data.buffer is not SBUF or dst.buffer is not PSUM:
            raise violation("transpose-buffer", "Tensor Engine nc_transpose reads SBUF and writes PSUM; got "
                            f"data in {data.buffer}, dst in {dst.buffer}", url)
        if p > 128 or f > 128:
            raise violation("transpose-size", f"Tensor Engine transpose handles up to [128, 128]; data is {(p, f)}",
                            url)
    elif p > 32 or f > 32:
        raise violation("transpose-size", f"Vector Engine transpose (dst in {dst.buffer}) handles up to [32, 32]; "
                        f"data is {(p, f)}; write the result to PSUM to use the Tensor Engine", url)

    def run():
        value, init, _ = _read_moved(data)
        dst.write(value.reshape(p, f).T.contiguous(), init=init.reshape(p, f).T.contiguous())
        if on_pe:  # the PE array transposes by a matmul against identity: 2 * p * p * f FLOPs
            stats = current().stats
            stats.pe_flops += 2 * p * p * f
            stats.pe_transpose_flops += 2 * p * p * f

    emit("tensor" if on_pe else "vector", op, run,
         transpose_work(data) if on_pe else elementwise_work(dst, data))


# -- DMA ---------------------------------------------------------------------------------------------------------------
def dma_copy(dst, src, dst_rmw_op=None, oob_mode=None, dge_mode=None, engine=None, name=None):  # noqa: F811
    """dst = src via the DMA engines, HBM <-> SBUF, casting dtype on the way (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.dma_copy.html)."""
    op, url = "dma_copy", URL_DMA
    if dst_rmw_op is not None:
        raise violation("api-drift", "dma_copy(dst_rmw_op=...) was replaced in NKI 0.3 by nisa.dma_compute(dst, "
                        "srcs=[dst, src], reduce_op=nl.add)", URL_DMA_COMPUTE)
    for what, t in (("src", src), ("dst", dst)):
        _view(t, what, op)
        if t.buffer is PSUM:
            raise violation("dma-buffer", f"dma_copy moves data between HBM and SBUF; {what} is in PSUM "
                            "(evict PSUM to SBUF with tensor_copy first)", url)
    _dma_elements(op, url, dst=dst, src=src)
    skip = _oob_skip(oob_mode, op)

    def run():
        value, init, keep = _read_moved(src, skip)
        if isinstance(dst, Tensor):
            dst.write(value, keep=keep, init=init)
        else:
            dst.write(value, keep=keep, skip=skip, init=init)
        _count_dma(dst, src)
        if getattr(src, "vector_offset", None) is not None:
            _count_gather(src, value, keep)

    emit("dma", op, run, dma_work(dst, src))


def _dma_elements(op: str, url: str, **sides) -> None:
    """A DMA moves the same number of elements out of src as into dst, each side in its row-major order.

    The dma_copy page states no equal-shape requirement, and nki-library copies e.g. a (1, n) SBUF row into a
    (n,) HBM vector; the element counts must agree (nothing else defines which element goes where)."""
    counts = {name: math.prod(t.shape) for name, t in sides.items()}
    if len(set(counts.values())) > 1:
        shapes = {name: tuple(t.shape) for name, t in sides.items()}
        raise violation("dma-shape", f"{op}: the sides move different numbers of elements {counts} (shapes "
                        f"{shapes}); slice both to the same element count", url)


def _oob_skip(mode, op: str) -> bool:
    """True for oob_mode.skip; None/oob_mode.error mean out-of-range indirect offsets raise."""
    if mode is None or mode is oob_mode.error:
        return False
    if mode is oob_mode.skip:
        return True
    raise TypeError(f"{op}: oob_mode must be nisa.oob_mode.error or .skip, got {mode!r}")


def _read_moved(src, skip: bool = False):
    """src's values, initialised mask and (oob_mode.skip on an access pattern) the mask of elements actually read:
    a copy or transpose moves unwritten elements along as unwritten instead of failing (see Tensor.read_moved)."""
    if isinstance(src, AccessPattern):
        return src.read_moved(skip)
    return (*src.read_moved(), None)


def _count_gather(src, value, keep=None) -> None:
    """Row gather (indirect DMA, `vector_offset`): rows read, and how many of them were entirely zero.

    A zero row is what a padding slot computes on: blockwise kernels point padding slots at a zero row (the MoE
    kernels' row T of x_pad), so for the gather of a kernel's input rows this is "padding slots computed"."""
    stats = current().stats
    rows = src.pattern[0][1]
    zero_rows = (dtypes.values(value).reshape(rows, -1) == 0).all(dim=1)
    if keep is not None:  # rows skipped under oob_mode.skip are not read
        read = keep.reshape(rows, -1)[:, 0]
        rows, zero_rows = int(read.sum()), zero_rows & read
    zero = int(zero_rows.sum())
    name = _name(src)
    stats.gathered_rows[name] = stats.gathered_rows.get(name, 0) + rows
    stats.padding_rows[name] = stats.padding_rows.get(name, 0) + zero


def _count_dma(dst, src) -> None:
    stats = current().stats
    nbytes = math.prod(src.shape) * src.dtype.itemsize
    side = dst if dst.buffer is SBUF else src if src.buffer is SBUF else dst
    per_partition = nbytes // (side.shape[0] if side.shape else 1)
    stats.dma_count += 1
    stats.dma_bytes += nbytes
    stats.dma_sizes.append((nbytes, per_partition, _name(src), _name(dst)))


def _name(t) -> str:
    storage = t.root._storage if hasattr(t, "root") else t._storage
    return storage.name or "?"


def dma_compute(dst, srcs, reduce_op=None, scales=None, unique_indices=True, oob_mode=None, name=None):
    """dst = reduce_op(srcs[0] * scales[0], ...) in fp32 inside the DMA engines; only nl.add and scales 1.0 (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.dma_compute.html).

    With a vector_offset access pattern as dst and as one source it is the scatter read-modify-write
    dst[indices] += src. Duplicate indices: unique_indices=False is outside the emulated subset.
    """
    op, url = "dma_compute", URL_DMA_COMPUTE
    if reduce_op is not nl.add:
        raise violation("dma-compute-op", f"dma_compute supports reduce_op=nl.add only, got {reduce_op!r}", url)
    if scales is not None and any(float(s) != 1.0 for s in scales):
        raise violation("dma-compute-op", f"dma_compute scales must all be 1.0, got {scales!r}", url)
    if not unique_indices:
        raise NotImplementedError("dma_compute(unique_indices=False) is outside the emulated subset")
    if not isinstance(srcs, (list, tuple)) or not srcs:
        raise TypeError("dma_compute: srcs must be a non-empty list of tensors")
    if len(srcs) > 16:
        raise violation("dma-compute-sources", f"dma_compute takes at most 16 source tensors, got {len(srcs)}", url)
    for what, t in [("dst", dst)] + [(f"srcs[{i}]", s) for i, s in enumerate(srcs)]:
        _view(t, what, op)
        if t.buffer is PSUM:
            raise violation("dma-buffer", f"dma_compute operands are in HBM or SBUF; {what} is in PSUM", url)
        if tuple(t.shape) != tuple(dst.shape):
            raise violation("dma-shape", f"dma_compute: {what} shape {t.shape} != dst shape {dst.shape}", url)

    def run():
        total, poison = _data(srcs[0])
        masks = [poison]
        for s in srcs[1:]:
            value, poison = _data(s)
            total = total + value
            masks.append(poison)
        dst.write(total, init=_clean(dst, *masks))
        stats = current().stats
        nbytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in srcs)
        side = next((t for t in [dst, *srcs] if t.buffer is SBUF), dst)
        stats.dma_count += 1
        stats.dma_bytes += nbytes
        stats.dma_sizes.append((nbytes, nbytes // side.shape[0], _name(srcs[-1]), _name(dst)))

    emit("dma", op, run, dma_work(dst, *srcs))


# -- Vector / Scalar / GpSimd engines ----------------------------------------------------------------------------------
def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """Copy within SBUF/PSUM, bit-exact for equal dtypes, via fp32 otherwise (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.tensor_copy.html)."""
    op, url = "tensor_copy", URL_TENSOR_COPY
    _on_chip(src, "src", op, url)
    _on_chip(dst, "dst", op, url)
    _same_layout(op, url, dst=dst, src=src)

    def run():
        value, init, _ = _read_moved(src)  # the stored bits: an equal dtype copies them
        value = value if value.dtype == dst.dtype or value.dtype in dtypes.INTEGER else dtypes.values(value).float()
        dst.write(value, init=init)

    emit(_engine(engine, "vector"), op, run, elementwise_work(dst, src))


def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    """dst = data1 <op> data2 elementwise in fp32 (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.tensor_tensor.html)."""
    name_, url = "tensor_tensor", URL_TENSOR_TENSOR
    fn = _arith(op, name_, url)
    for what, t in (("data1", data1), ("data2", data2), ("dst", dst)):
        _on_chip(t, what, name_, url)
    if data1.buffer is PSUM and data2.buffer is PSUM:
        raise violation("tensor-tensor-psum-inputs", "data1 and data2 cannot both reside in PSUM; copy one to SBUF",
                        url)
    _same_layout(name_, url, dst=dst, data1=data1, data2=data2)
    def run():
        (a, a_poison), (b, b_poison) = _data(data1), _data(data2)
        dst.write(fn(a.reshape(dst.shape), b.reshape(dst.shape)), init=_clean(dst, a_poison, b_poison))

    emit(_engine(engine, "vector"), name_, run, elementwise_work(dst, data1, data2))


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=engine.unknown, name=None):
    """dst = (data <op0> operand0) <op1> operand1, operands scalars or (P, 1) vectors (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.tensor_scalar.html)."""
    name_, url = "tensor_scalar", URL_TENSOR_SCALAR
    _on_chip(data, "data", name_, url)
    _on_chip(dst, "dst", name_, url)
    _same_layout(name_, url, dst=dst, data=data)
    steps = []
    for op, operand, reverse in ((op0, operand0, reverse0), (op1, operand1, reverse1)):
        if op is None:
            continue
        steps.append((*_scalar_operand(op, operand, reverse, data, name_, url), reverse))

    def run():
        result, poison = _data(data)
        masks = [poison]
        for fn, operand, reverse in steps:
            value, poison = _operand(operand, data)
            masks.append(poison)
            result = fn(value, result.reshape(data.shape)) if reverse else fn(result.reshape(data.shape), value)
        dst.write(result, init=_clean(dst, *masks))

    emit(_engine(engine, "vector"), name_, run, elementwise_work(dst, data))


def _scalar_operand(op, operand, reverse, data, name: str, url: str):
    """(fn, operand) of a tensor_scalar-style op after its checks: the operand a float or a (P, 1) fp32 tile."""
    fn, operand = _scalar_op(op, operand, reverse, name, url)
    _check_operand(operand, data, "operand", name, url)
    if not isinstance(operand, (int, float)) and operand.dtype != torch.float32:
        raise violation("tensor-scalar-operand-dtype", f"{name}: a tile operand of an arithmetic op must be float32, "
                        f"got {operand.dtype}; keep per-partition scale/bias vectors in fp32", url)
    return fn, operand


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=None,  # noqa: F811
               engine=None, name=None):
    """dst = op(data * scale + bias) on the Scalar Engine in fp32 (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.activation.html)."""
    name_, url = "activation", URL_ACTIVATION
    if engine is not None:
        raise violation("api-drift", "nisa.activation has no engine= parameter in current NKI (it always runs on the "
                        "Scalar Engine on trn2); drop engine=", URL_ACTIVATION_LATEST)
    if reduce_res is not None and reduce_cmd is constants.reduce_cmd.reset_reduce:
        # reset, then reduce this instruction's results into reduce_res: activation_reduce's semantics
        activation_reduce(dst, op, data, reduce_op, reduce_res, bias=bias, scale=scale)
        return
    if reduce_op is not None or reduce_res is not None or reduce_cmd is not None:
        raise NotImplementedError("activation reduce_* options other than reduce_cmd=reset_reduce with a reduce_res "
                                  "are outside the emulated subset (accumulators carried across instructions)")
    _check_activation(dst, op, data, bias, scale, name_, url)

    def run():
        y, masks = _activate(op, data, bias, scale)
        dst.write(y, init=_clean(dst, *masks))

    emit("scalar", name_, run, elementwise_work(dst, data))


def _check_activation(dst, op, data, bias, scale, name: str, url: str) -> None:
    if op not in nl.ACTIVATIONS:
        raise NotImplementedError(f"{name}: activation op {op!r} outside the emulated subset {nl.ACTIVATIONS}")
    _on_chip(data, "data", name, url)
    _on_chip(dst, "dst", name, url)
    _same_layout(name, url, dst=dst, data=data)
    _check_operand(scale, data, "scale", name, url)
    if bias is not None:
        _check_operand(bias, data, "bias", name, url)


def _activate(op, data, bias, scale):
    """op(data * scale + bias) in fp32, in data's shape, and the poison masks it depends on (data's per element,
    scale's and bias's per partition)."""
    (x, x_poison), (a, a_poison) = _data(data), _operand(scale, data)
    x = x.reshape(data.shape) * a
    b_poison = None
    if bias is not None:
        b, b_poison = _operand(bias, data)
        x = x + b
    return op.fn(x), (x_poison, a_poison, b_poison)


def _check_reduce_res(reduce_res, data, name: str, url: str) -> None:
    """reduce_res: "a SBUF/PSUM tile with the same partition axis size as the input tile data and one element per
    partition", "a tile of shape (data.shape[0], 1)" (activation_reduce and tensor_scalar_reduce pages)."""
    if reduce_res is None:
        raise NotImplementedError(f"{name}(reduce_res=None), keeping the result in the engine's accumulator "
                                  f"registers for a later instruction, is outside the emulated subset ({url})")
    _on_chip(reduce_res, "reduce_res", name, url)
    if _per_partition(reduce_res) != (data.shape[0], 1):
        raise violation("reduce-res-shape", f"{name}: reduce_res must hold one element per partition of data, "
                        f"shape ({data.shape[0]}, 1), got {tuple(reduce_res.shape)}", url)


def _write_with_reduction(dst, y, masks, reduce_res, fn, negate: bool = False) -> None:
    """Store the elementwise result y (fp32, cast on store) into dst and fn of each partition's row of y (the
    fp32 results, before dst's rounding: the engine reduces what it computes) into reduce_res. A poison element
    of y poisons its dst element and its partition's reduction."""
    p = y.shape[0]
    init = _clean(dst, *masks)
    rows = None if init is None else ~init.reshape(p, -1).all(1)
    sources = list(current().taint)  # each write ends the instruction's reading: both results need the sources
    dst.write(y, init=init)
    current().taint.extend(sources)
    r = fn(y.reshape(p, -1), (1,))
    reduce_res.write(-r if negate else r, init=None if rows is None else _clean(reduce_res, rows))


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """dst = op(data * scale + bias) in fp32 on the Scalar Engine, as nisa.activation, and reduce_res (P, 1) = the
    sum over all free dims of each partition's fp32 activated values ("reduce_res = reduce_op(output,
    axis=<FreeAxis>)"; the registers are reset first, so nothing accumulates across instructions). reduce_op must
    be nl.add ("the Scalar Engine reduction registers can only sum the activated data")
    (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.activation_reduce.html;
    op/data/bias/scale as in https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.activation.html).
    """
    name_, url = "activation_reduce", URL_ACTIVATION_REDUCE
    _check_activation(dst, op, data, bias, scale, name_, url)
    if reduce_op is not nl.add:
        raise violation("reduce-op", f"{name_}: reduce_op must be nl.add (the Scalar Engine's reduction registers "
                        f"only sum; reduce the result with nisa.tensor_reduce for max/min), got {reduce_op!r}", url)
    _check_reduce_res(reduce_res, data, name_, url)

    def run():
        y, masks = _activate(op, data, bias, scale)
        _write_with_reduction(dst, y, masks, reduce_res, _REDUCE["add"])

    emit("scalar", name_, run, elementwise_work(dst, data))


_SCALAR_REDUCE_OPS = ("add", "multiply", "maximum", "minimum")  # the page's "nl.add, nl.multiply, nl.max or nl.min"


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=constants.reduce_cmd.reset_reduce,  # noqa: F811 - the page's parameter name
                         reduce_init=None, reduce_res_negate=False, name=None):
    """dst = data <op0> operand0 in fp32 on the Vector Engine, as nisa.tensor_scalar with one op (an arithmetic
    one; a unary op such as nl.abs takes operand0 None or 0), and reduce_res (P, 1) = reduce_op (nl.add,
    nl.multiply, nl.maximum, nl.minimum) over all free dims of each partition's fp32 results, negated with
    reduce_res_negate; data and dst have at most 3 free dims
    (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.tensor_scalar_reduce.html).
    Only reduce_cmd=reset_reduce (the default: reset the accumulators, then reduce this instruction's results);
    accumulating across instructions (reduce, load_reduce) and reverse0 ("not supported yet") are not emulated.
    """
    name_, url = "tensor_scalar_reduce", URL_TENSOR_SCALAR_REDUCE
    if reverse0:
        raise NotImplementedError(f"{name_}(reverse0=True): the page marks reverse0 \"not supported yet\" ({url})")
    if reduce_cmd is not constants.reduce_cmd.reset_reduce or reduce_init is not None:
        raise NotImplementedError(f"{name_}(reduce_cmd={reduce_cmd!r}, reduce_init={reduce_init!r}): accumulator "
                                  "state carried across instructions is outside the emulated subset; only "
                                  f"reduce_cmd=reset_reduce ({url})")
    _on_chip(data, "data", name_, url)
    _on_chip(dst, "dst", name_, url)
    _same_layout(name_, url, dst=dst, data=data)
    for what, t in (("data", data), ("dst", dst)):
        if len(t.shape) > 4:
            raise violation("reduce-rank", f"{name_}: {what} has {len(t.shape) - 1} free dims {tuple(t.shape)}; at "
                            "most three (rank 4 with the partition dim)", url)
    fn, operand = _scalar_operand(op0, operand0, reverse0, data, name_, url)
    if getattr(reduce_op, "name", None) not in _SCALAR_REDUCE_OPS or reduce_op not in nl.ARITHMETIC:
        raise violation("reduce-op", f"{name_}: reduce_op must be nl.add, nl.multiply, nl.maximum or nl.minimum, "
                        f"got {reduce_op!r}", url)
    _check_reduce_res(reduce_res, data, name_, url)

    def run():
        x, x_poison = _data(data)
        value, o_poison = _operand(operand, data)
        y = fn(x.reshape(data.shape), value)
        _write_with_reduction(dst, y, (x_poison, o_poison), reduce_res, _REDUCE[reduce_op.name],
                              negate=bool(reduce_res_negate))

    emit("vector", name_, run, elementwise_work(dst, data))


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill dst with a compile-time constant (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.memset.html)."""
    _on_chip(dst, "dst", "memset", URL_MEMSET)
    if not isinstance(value, (int, float)):
        raise TypeError(f"memset value must be a compile-time constant number, got {value!r}")
    emit(_engine(engine, "vector"), "memset", lambda: dst.write(torch.full(dst.shape, float(value))),
         elementwise_work(dst))


# -- registers (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.register_alloc.html)
def register_alloc(x=None) -> VirtualRegister:
    """A new virtual register, optionally initialised with the integer x."""
    reg = VirtualRegister(f"register#{id(object()) % 10000}")
    if x is not None:
        register_move(reg, x)
    return reg


def _reg(r, what: str) -> VirtualRegister:
    if not isinstance(r, VirtualRegister):
        raise TypeError(f"{what} must be a VirtualRegister from nisa.register_alloc(), got {r!r}")
    return r


def _scalar_tile(t, what: str, op: str) -> None:
    _view(t, what, op)
    if t.buffer is PSUM or t.dtype != torch.int32 or math.prod(t.shape) != 1:
        raise violation("register-operand", f"{op}: {what} must be a 32-bit int (1, 1) tile in SBUF or HBM, got "
                        f"{t!r}", URL_REGISTER_ALLOC)


def register_move(dst, src) -> None:
    """dst register = a constant int or another register's value."""
    _reg(dst, "dst")
    if isinstance(src, VirtualRegister):
        emit("register", "register_move", lambda: setattr(dst, "value", src.runtime_value()))
    elif isinstance(src, int) and not isinstance(src, bool):
        emit("register", "register_move", lambda: setattr(dst, "value", int(src)))
    else:
        raise TypeError(f"register_move: src must be an int or a VirtualRegister, got {src!r}")


def register_load(dst, src) -> None:
    """dst register = the int32 value of a (1, 1) SBUF/HBM tile, read when the instruction runs."""
    _reg(dst, "dst")
    _scalar_tile(src, "src", "register_load")
    emit("register", "register_load", lambda: setattr(dst, "value", int(src.read().reshape(-1)[0])))


def register_store(dst, src) -> None:
    """Write the register's value into an int32 (1, 1) SBUF/HBM tile."""
    _reg(src, "src")
    _scalar_tile(dst, "dst", "register_store")
    emit("register", "register_store",
         lambda: dst.write(torch.tensor([src.runtime_value()], dtype=torch.int32)))


# -- the rest of nki.isa that nki-library's kernels use ----------------------------------------------------------------
URL_STT = f"{DOCS}/latest/nki/api/generated/nki.isa.scalar_tensor_tensor.html"
URL_PREDICATED = f"{DOCS}/latest/nki/api/generated/nki.isa.tensor_copy_predicated.html"
URL_SHUFFLE = f"{DOCS}/latest/nki/api/generated/nki.isa.nc_stream_shuffle.html"
URL_REDUCE = f"{DOCS}/latest/nki/api/generated/nki.isa.tensor_reduce.html"
URL_RECIPROCAL = f"{DOCS}/latest/nki/api/generated/nki.isa.reciprocal.html"
URL_IOTA = f"{DOCS}/latest/nki/api/generated/nki.isa.iota.html"
dma_engine = engine.sync  # the DMA queue selector nki-library passes as engine= (queues are not modelled)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False,
                         engine=engine.unknown, name=None):
    """dst = (data <op0> operand0) <op1> operand1: operand0 a scalar or (P, 1) vector, operand1 a tile of data's
    layout; fp32 math (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.scalar_tensor_tensor.html)."""
    op, url = "scalar_tensor_tensor", URL_STT
    for what, t in (("data", data), ("operand1", operand1), ("dst", dst)):
        _on_chip(t, what, op, url)
    _same_layout(op, url, dst=dst, data=data, operand1=operand1)
    _check_operand(operand0, data, "operand0", op, url)
    fn0, fn1 = _arith(op0, op, url), _arith(op1, op, url)

    def run():
        (x, x_poison), (a, a_poison), (b, b_poison) = _data(data), _operand(operand0, dst), _data(operand1)
        x = x.reshape(dst.shape)
        x = fn0(a, x) if reverse0 else fn0(x, a)
        b = b.reshape(dst.shape)
        dst.write(fn1(b, x) if reverse1 else fn1(x, b), init=_clean(dst, x_poison, a_poison, b_poison))

    emit(_engine(engine, "vector"), op, run, elementwise_work(dst, data, operand1))


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, engine=engine.unknown, name=None):
    """dst = src where predicate is nonzero (zero with reverse_pred=True); elsewhere dst keeps its value
    (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.tensor_copy_predicated.html)."""
    op, url = "tensor_copy_predicated", URL_PREDICATED
    for what, t in (("src", src), ("predicate", predicate), ("dst", dst)):
        _on_chip(t, what, op, url)
    _same_layout(op, url, dst=dst, src=src, predicate=predicate)

    def run():
        pred, p_poison = predicate.read_data()
        take = (pred.reshape(dst.shape) != 0) ^ bool(reverse_pred)
        value, s_poison = src.read_data()
        old, old_init, _ = _read_moved(dst)  # elements not taken keep dst's value (its bits), poison or not
        poison = torch.where(take, False if s_poison is None else s_poison.reshape(dst.shape),
                             ~old_init.reshape(dst.shape))
        dst.write(torch.where(take, dtypes.cast(value.reshape(dst.shape), dst.dtype), old.reshape(dst.shape)),
                  init=_clean(dst, None if p_poison is None else p_poison.reshape(dst.shape) | poison,
                              poison if bool(poison.any()) else None))

    emit(_engine(engine, "vector"), op, run, elementwise_work(dst, src, predicate))


def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Cross-partition move within 32-partition quadrants on the Vector Engine: dst partition p takes src partition
    32 * (p // 32) + shuffle_mask[p % 32]; mask value 255 leaves dst partition p unmodified
    (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.nc_stream_shuffle.html)."""
    op, url = "nc_stream_shuffle", URL_SHUFFLE
    _on_chip(src, "src", op, url)
    _on_chip(dst, "dst", op, url)
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != 32 or any(not (0 <= m < 32 or m == 255) for m in mask):
        raise violation("shuffle-mask", f"{op}: shuffle_mask must be 32 ints in [0, 32) or 255, got {mask}", url)
    if dst.dtype != src.dtype:
        raise violation("shuffle-operands", f"{op}: dst dtype {dst.dtype} must equal src dtype {src.dtype}", url)
    if _per_partition(dst)[1] != _per_partition(src)[1]:
        raise violation("shuffle-operands", f"{op}: dst and src must have the same elements per partition: "
                        f"{dst.shape} vs {src.shape}", url)
    rows = [32 * (p // 32) + mask[p % 32] for p in range(dst.shape[0]) if mask[p % 32] != 255]
    if rows and max(rows) >= src.shape[0]:
        raise violation("index-bounds", f"{op}: dst partitions read src partition {max(rows)} of a "
                        f"{src.shape[0]}-partition src", url)

    def run():  # a data movement: unwritten partitions move along unwritten
        value, init, _ = _read_moved(src)
        value, init = value.reshape(src.shape[0], -1), init.reshape(src.shape[0], -1)
        out, out_init, _ = _read_moved(dst)
        out, out_init = out.reshape(dst.shape[0], -1).clone(), out_init.reshape(dst.shape[0], -1).clone()
        for p in range(dst.shape[0]):
            if mask[p % 32] != 255:
                out[p], out_init[p] = value[32 * (p // 32) + mask[p % 32]], init[32 * (p // 32) + mask[p % 32]]
        dst.write(out, init=out_init)

    emit("vector", op, run, elementwise_work(dst, src))


_REDUCE = {"add": lambda x, dims: x.sum(dims), "maximum": lambda x, dims: x.amax(dims),
           "minimum": lambda x, dims: x.amin(dims), "multiply": lambda x, dims: _prod(x, dims)}


def _prod(x, dims):
    for d in sorted(dims, reverse=True):
        x = x.prod(d)
    return x


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, engine=engine.unknown, name=None):
    """dst = reduce(op) of data over the free axes `axis` (fp32; `negate` negates the result)
    (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.tensor_reduce.html)."""
    name_, url = "tensor_reduce", URL_REDUCE
    _on_chip(data, "data", name_, url)
    _on_chip(dst, "dst", name_, url)
    if getattr(op, "name", None) not in _REDUCE:
        raise NotImplementedError(f"{name_}: op {op!r} outside the emulated subset {sorted(_REDUCE)} ({url})")
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if not axes or any(a <= 0 or a >= len(data.shape) for a in axes):
        raise violation("reduce-axis", f"{name_}: axis {axis} must name free dims (1..{len(data.shape) - 1}) of "
                        f"{data.shape}; the partition dim is reduced with nc_matmul or partition_all_reduce", url)
    kept = math.prod(n for d, n in enumerate(data.shape) if d not in axes)
    if _per_partition(dst) != (data.shape[0], kept // data.shape[0]):
        raise violation("elementwise-shape", f"{name_}: dst {dst.shape} must hold the {kept // data.shape[0]} "
                        f"values per partition left after reducing {data.shape} over {axes}", url)

    def run():
        value, poison = _data(data)
        result = _REDUCE[op.name](value.reshape(data.shape), axes)
        dst.write(-result if negate else result,
                  init=None if poison is None else _clean(dst, poison.reshape(data.shape).int().amax(axes) > 0))

    emit(_engine(engine, "vector"), name_, run, elementwise_work(data, data))  # streams every input element


def reciprocal(dst, data, engine=engine.unknown, name=None):
    """dst = 1 / data elementwise in fp32 (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.reciprocal.html)."""
    op, url = "reciprocal", URL_RECIPROCAL
    _on_chip(data, "data", op, url)
    _on_chip(dst, "dst", op, url)
    _same_layout(op, url, dst=dst, data=data)
    def run():
        value, poison = _data(data)
        dst.write(torch.reciprocal(value).reshape(dst.shape), init=_clean(dst, poison))

    emit(_engine(engine, "vector"), op, run, elementwise_work(dst, data))


URL_DMA_TRANSPOSE = f"{DOCS}/v2.30.0/nki/api/generated/nki.isa.dma_transpose.html"
_DMA_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(dst, src, axes=None, dge_mode=None, oob_mode=None, name=None):  # noqa: F811
    """dst = src permuted by `axes` through the DMA engines: 2-D (1, 0), 3-D (2, 1, 0), 4-D (3, 1, 2, 0), the only
    supported permutations (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.30.0/nki/api/generated/nki.isa.dma_transpose.html).

    Direct form (src a tensor or an access pattern without `vector_offset`): dge_mode unknown or hwdge; hwdge also
    needs src.shape[0] == 16, src.shape[-1] % 128 == 0 and a 2-byte dtype. Indirect form, the gather-transpose
    (src an HBM access pattern with `vector_offset` = indices): software DGE, `_gather_transpose_rules`; it moves
    rows indices.T.flatten()[:src.shape[0]] of the tensor, then transposes them. Costed as a DMA at the documented
    transpose share of the DMA engines' rate (`timing.dma_engine_rate`)."""
    op, url = "dma_transpose", URL_DMA_TRANSPOSE
    for what, t in (("src", src), ("dst", dst)):
        _view(t, what, op)
        if t.buffer is PSUM:
            raise violation("dma-buffer", f"{op}: {what} is in PSUM; DMA endpoints are HBM or SBUF", url)
    if dst.buffer is not SBUF:
        raise violation("dma-transpose-dst", f"{op}: dst must be a tile in SBUF, got {dst.buffer}", url)
    rank = len(src.shape)
    supported = _DMA_TRANSPOSE_AXES.get(rank)
    axes = supported if axes is None else tuple(axes)
    if supported is None or axes != supported:
        raise violation("dma-transpose-axes", f"{op}: a {rank}-d src supports axes {supported}, got {axes}", url)
    want = tuple(src.shape[a] for a in axes)
    if tuple(dst.shape) != want:
        raise violation("dma-shape", f"{op}: dst shape {tuple(dst.shape)} must be the transposed src shape {want}",
                        url)
    if src.dtype != dst.dtype:
        raise violation("dma-transpose-dtype", f"{op}: src.dtype == dst.dtype, got {src.dtype} and {dst.dtype}", url)
    indirect = getattr(src, "vector_offset", None) is not None
    if indirect:
        _gather_transpose_rules(src, dge_mode, op, url)
        src = src.detached()
        src.column_major = True
    elif dge_mode not in (None, constants.dge_mode.unknown, constants.dge_mode.hwdge):
        raise violation("dma-transpose-dge", f"{op}: a direct transpose takes dge_mode unknown or hwdge, got "
                        f"{dge_mode!r} (software DGE is the indirect form: src an access pattern with vector_offset)",
                        url)
    elif dge_mode is constants.dge_mode.hwdge and (src.shape[0] != 16 or src.shape[-1] % 128 or
                                                   src.dtype.itemsize != 2):
        raise violation("dma-transpose-hwdge", f"{op}: hwdge needs src.shape[0] == 16, src.shape[-1] % 128 == 0 "
                        f"and a 2-byte dtype; src is {tuple(src.shape)} {src.dtype}", url)
    if _oob_skip(oob_mode, op):
        raise NotImplementedError(f"{op}(oob_mode=skip) is outside the emulated subset")

    def run():
        value, init, _ = _read_moved(src)
        dst.write(value.reshape(src.shape).permute(axes).contiguous(),
                  init=init.reshape(src.shape).permute(axes).contiguous())
        _count_dma(dst, src)
        if indirect:
            _count_gather(src, value)

    emit("dma", op, run, dma_work(dst, src, transpose="sbuf" if src.buffer is SBUF else "hbm"))


def _gather_transpose_rules(src, dge_mode, op: str, url: str) -> None:  # noqa: F811
    """The "DMA Indirect Transpose Constraints" of the dma_transpose page: software DGE; a 2-byte dtype; the last
    dim <= 128; src on HBM with src.shape[0] a multiple of 16; 4-D: its dim 1 or 2 of size 1; indices a 2-d
    uint32 SBUF tile of 16..128 rows (a multiple of 16; exactly 128 when it has more than one column) with at least
    src.shape[0] values; TRN2+ only."""
    indices = src.vector_offset
    if get_nc_version() < nc_version.gen3:
        raise violation("dma-gather-transpose", f"{op}: the indirect (gather) transpose is TRN2+ only; the target is "
                        f"{get_nc_version().name}", url)
    if dge_mode not in (None, constants.dge_mode.unknown, constants.dge_mode.swdge):
        raise violation("dma-gather-transpose", f"{op}: the indirect transpose is lowered to software DGE "
                        f"(dma_gather_transpose): dge_mode unknown or swdge, got {dge_mode!r}", url)
    shape, rows = tuple(src.shape), src.shape[0]
    problems = []
    if src.dtype.itemsize != 2:
        problems.append(f"src.dtype {src.dtype} is not 2 bytes")
    if shape[-1] > 128:
        problems.append(f"src.shape[-1] {shape[-1]} > 128")
    if rows % 16:
        problems.append(f"src.shape[0] {rows} is not divisible by 16")
    if len(shape) == 4 and shape[1] != 1 and shape[2] != 1:
        problems.append(f"a 4-d src needs dim 1 or 2 of size 1, got {shape}")
    if len(indices.shape) != 2 or indices.dtype != torch.uint32:
        problems.append(f"indices must be a 2-d uint32 SBUF tile, got {tuple(indices.shape)} {indices.dtype}")
    else:
        n_rows, n_cols = indices.shape
        if not 16 <= n_rows <= 128 or n_rows % 16:
            problems.append(f"indices.shape[0] {n_rows} must be in [16, 128] and divisible by 16")
        if n_cols > 1 and n_rows != 128:
            problems.append(f"indices.shape[0] must be 128 when indices.shape[1] > 1, got {tuple(indices.shape)}")
        if n_rows * n_cols < rows:
            problems.append(f"{n_rows * n_cols} indices for {rows} rows")
    if problems:
        raise violation("dma-gather-transpose", f"{op} (indirect): " + "; ".join(problems), url)


URL_SCAN = f"{DOCS}/latest/nki/api/generated/nki.isa.tensor_tensor_scan.html"


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """dst[p, w, z, y, x] = offset + p * channel_multiplier + w*step_w + z*step_z + y*step_y + x*step_x in int32
    math on GpSimd, cast to dst's dtype; `pattern` = up to 4 [step, num] pairs whose counts multiply to dst's
    elements per partition (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.iota.html)."""
    op, url = "iota", URL_IOTA
    _on_chip(dst, "dst", op, url)
    if dst.buffer is not SBUF:
        raise violation("engine-buffer", f"{op}: dst must be in SBUF, got {dst.buffer}", url)
    pattern = [(int(st), int(n)) for st, n in pattern]
    if not 1 <= len(pattern) <= 4 or math.prod(n for _, n in pattern) != _per_partition(dst)[1]:
        raise violation("elementwise-shape", f"{op}: pattern {pattern} must have 1-4 entries whose counts multiply "
                        f"to dst's {_per_partition(dst)[1]} elements per partition", url)

    def run():
        value = _affine(dst.shape[0], pattern, offset, channel_multiplier)
        dst.write(value.to(torch.float64) if dst.dtype in dtypes.FLOAT else value)

    emit("gpsimd", op, run, elementwise_work(dst))


def _affine(partitions: int, pattern, offset, channel_multiplier) -> torch.Tensor:
    """offset + p * channel_multiplier + sum_k i_k * step_k over (partitions, elements): iota's and
    affine_select's expression, in 64-bit integers."""
    value = torch.tensor(int(offset), dtype=torch.int64) + torch.arange(partitions).reshape(
        [-1] + [1] * len(pattern)) * int(channel_multiplier)
    for k, (st, n) in enumerate(pattern):
        value = value + (torch.arange(n) * st).reshape([1] + [1] * k + [n] + [1] * (len(pattern) - k - 1))
    return value.reshape(partitions, -1)


URL_AFFINE_SELECT = f"{DOCS}/latest/nki/api/generated/nki.isa.affine_select.html"
URL_NONZERO = f"{DOCS}/latest/nki/api/generated/nki.isa.nonzero_with_count.html"


def affine_select(dst, pattern, on_true_tile, on_false_value, offset=0, channel_multiplier=0, cmp_op=nl.equal,
                  name=None):
    """dst = on_true_tile where cmp_op(affine value, 0) else on_false_value, the affine value as in iota
    (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.affine_select.html).
    offset defaults to 0: nki-library (NKI 0.3) calls it without one; pass the rest by keyword."""
    op, url = "affine_select", URL_AFFINE_SELECT
    _on_chip(dst, "dst", op, url)
    _on_chip(on_true_tile, "on_true_tile", op, url)
    _same_layout(op, url, dst=dst, on_true_tile=on_true_tile)
    pattern = [(int(st), int(n)) for st, n in pattern]
    if not 1 <= len(pattern) <= 4 or math.prod(n for _, n in pattern) != _per_partition(dst)[1]:
        raise violation("elementwise-shape", f"{op}: pattern {pattern} must have 1-4 entries whose counts multiply "
                        f"to dst's {_per_partition(dst)[1]} elements per partition", url)
    compare = _arith(cmp_op, op, url)

    def run():
        keep = compare(_affine(dst.shape[0], pattern, offset, channel_multiplier).double(),
                       torch.zeros((), dtype=torch.float64)) != 0
        value, poison = _data(on_true_tile)
        value = value.reshape(dst.shape[0], -1)
        dst.write(torch.where(keep, value, torch.tensor(float(on_false_value))),
                  init=None if poison is None else _clean(dst, poison.reshape(keep.shape) & keep))

    emit("gpsimd", op, run, elementwise_work(dst, on_true_tile))


def nonzero_with_count(dst, src, index_offset=0, padding_val=-1):
    """On partitions 0, 16, ..., 112 only (one per GpSimd core): dst row = indices of src's nonzero elements plus
    index_offset, then padding_val, then their count in the extra last slot; other partitions are untouched
    (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.nonzero_with_count.html)."""
    op, url = "nonzero_with_count", URL_NONZERO
    _on_chip(src, "src", op, url)
    _on_chip(dst, "dst", op, url)
    p, t = _per_partition(src)
    if _per_partition(dst) != (p, t + 1):
        raise violation("elementwise-shape", f"{op}: dst must have {p} partitions of {t + 1} elements (one more "
                        f"than src, for the count), got {dst.shape}", url)

    def run():
        x, x_init = src.read_moved() if isinstance(src, Tensor) else src.read_moved()[:2]
        x, x_init = dtypes.values(x).float().reshape(p, t), x_init.reshape(p, t)
        out, init = dst.read_moved()
        out, init = out.reshape(p, t + 1).clone(), init.reshape(p, t + 1).clone()
        for row in range(0, p, 16):
            idx = torch.nonzero(x[row] != 0).reshape(-1)
            line = torch.full((t + 1,), float(padding_val), dtype=torch.float64)
            line[: len(idx)] = idx.double() + index_offset
            line[t] = len(idx)
            # out holds dst's stored bits (read_moved): an e4m3 row is encoded, other types convert as before
            out[row] = dtypes.cast(line, out.dtype) if out.dtype is dtypes.E4M3 else line.to(out.dtype)
            init[row] = bool(x_init[row].all())  # a poison input poisons its row
        dst.write(out, init=init)

    emit("gpsimd", op, run, elementwise_work(src, src))
URL_MAX8 = f"{DOCS}/v2.33.0/nki/api/generated/nki.isa.max8.html"
URL_FIND8 = f"{DOCS}/v2.32.0/nki/api/generated/nki.isa.nc_find_index8.html"


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """Per partition, along the flattened free dims: r[0] = op1(op0(data0[0], initial), data1[0]) and
    r[i] = op1(op0(data0[i], r[i-1]), data1[i]) in fp32 on the Vector Engine; `initial` a scalar or one value per
    partition; reverseK swaps opK's operands (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.tensor_tensor_scan.html)."""
    op, url = "tensor_tensor_scan", URL_SCAN
    for what, t in (("data0", data0), ("data1", data1), ("dst", dst)):
        _on_chip(t, what, op, url)
    if data0.buffer is PSUM and data1.buffer is PSUM:
        raise violation("tensor-tensor-psum-inputs", f"{op}: data0 and data1 cannot both reside in PSUM", url)
    _same_layout(op, url, dst=dst, data0=data0, data1=data1)
    _check_operand(initial, data0, "initial", op, url)
    fn0, fn1 = _arith(op0, op, url), _arith(op1, op, url)

    def run():
        p = data0.shape[0]
        (a, a_poison), (b, b_poison) = _data(data0), _data(data1)
        a, b = a.reshape(p, -1), b.reshape(p, -1)
        prev, i_poison = _operand(initial, data0)
        prev = prev.reshape(-1, 1).expand(p, 1).reshape(p)
        out = torch.empty_like(a)
        for i in range(a.shape[1]):
            x = fn0(prev, a[:, i]) if reverse0 else fn0(a[:, i], prev)
            prev = out[:, i] = fn1(b[:, i], x) if reverse1 else fn1(x, b[:, i])
        poison = _clean(out, a_poison, b_poison, i_poison)  # r[i] depends on every element up to i: poison carries on
        dst.write(out, init=None if poison is None else (~poison).int().cummax(dim=1).values == 0)

    emit("vector", op, run, elementwise_work(dst, data0, data1))


def _eight_per_partition(op: str, url: str, src, dst) -> None:
    n = _per_partition(src)[1]
    if not 8 <= n <= 16384:
        raise violation("max8-size", f"{op}: the source must have 8..16384 elements per partition, got {n}", url)
    if _per_partition(dst) != (src.shape[0], 8):
        raise violation("elementwise-shape", f"{op}: dst must be ({src.shape[0]}, 8), got {dst.shape}", url)


def max8(dst, src, name=None):
    """The 8 largest values of each partition in descending order, compared in fp32 (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.max8.html)."""
    op, url = "max8", URL_MAX8
    _on_chip(src, "src", op, url)
    _on_chip(dst, "dst", op, url)
    _eight_per_partition(op, url, src, dst)
    def run():
        value, poison = _data(src)
        dst.write(value.reshape(src.shape[0], -1).topk(8, dim=1).values,
                  init=None if poison is None else _clean(dst, poison.reshape(src.shape[0], -1).any(1)))

    emit("vector", op, run, elementwise_work(src, src))


def nc_find_index8(dst, data, vals, name=None):
    """Per partition, the index of the first occurrence in data of each of the 8 vals (uint16/uint32 dst); a value
    not present gives the all-ones sentinel (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.32.0/nki/api/generated/nki.isa.nc_find_index8.html)."""
    op, url = "nc_find_index8", URL_FIND8
    for what, t in (("data", data), ("vals", vals), ("dst", dst)):
        _on_chip(t, what, op, url)
    _eight_per_partition(op, url, data, dst)
    if _per_partition(vals) != (data.shape[0], 8):
        raise violation("elementwise-shape", f"{op}: vals must hold 8 values per partition, got {vals.shape}", url)
    if dst.dtype not in (torch.uint16, torch.uint32):
        raise violation("find-index-dtype", f"{op}: dst must be uint16 or uint32, got {dst.dtype}", url)

    def run():
        (d, d_poison), (v, v_poison) = _data(data), _data(vals)
        hit = d.reshape(data.shape[0], 1, -1) == v.reshape(data.shape[0], 8, 1)
        first = hit.int().argmax(dim=2).to(torch.int64)
        rows = None if d_poison is None else d_poison.reshape(data.shape[0], -1).any(1)
        dst.write(torch.where(hit.any(dim=2), first, torch.iinfo(dst.dtype).max), init=_clean(dst, rows, v_poison))

    emit("vector", op, run, elementwise_work(data, data))


URL_SENDRECV = f"{DOCS}/v2.29.1/nki/api/generated/nki.isa.sendrecv.html"


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id=0, dma_engine=None, name=None):  # noqa: F811
    """Exchange SBUF tiles between the two cores of an LNC 2 launch: this core's src lands in the peer's dst while
    the peer's src lands in this dst; the Nth sendrecv of one core pairs with the Nth of the other, and both wait
    for each other (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.29.1/nki/api/generated/nki.isa.sendrecv.html,
    pairing: nki.lnc.sendrecv page). Modelled as a rendezvous of the two cores, like core_barrier."""
    op, url = "sendrecv", URL_SENDRECV
    launch = require(f"nisa.{op}", url)
    core = launch.core
    for what, t in (("src", src), ("dst", dst)):
        _view(t, what, op)
        if t.buffer is not SBUF:
            raise violation("sendrecv-operands", f"{op}: {what} must be in SBUF, got {t.buffer}", url)
    if launch.lnc != 2 or {int(send_to_rank), int(recv_from_rank)} != {1 - core}:
        raise violation("sendrecv-operands", f"{op} exchanges with the other core of an LNC 2 launch: core {core} "
                        f"must send to and receive from {1 - core} (launch LNC {launch.lnc}, send_to_rank "
                        f"{send_to_rank}, recv_from_rank {recv_from_rank})", url)
    if src.dtype != dst.dtype or _per_partition(src) != _per_partition(dst):
        raise violation("sendrecv-operands", f"{op}: src {tuple(src.shape)} {src.dtype} and dst "
                        f"{tuple(dst.shape)} {dst.dtype} must match", url)
    if launch.trace[core]:
        raise NotImplementedError(f"nisa.{op} inside a dynamic loop is outside the emulated subset")
    mail = launch.__dict__.setdefault("sendrecv_mail", ([], []))  # messages each core sent, in program order
    mail[core].append(_read_moved(src)[:2])
    launch.wait_barrier(core)  # both cores arrive before either proceeds
    value, init = mail[1 - core][len(mail[core]) - 1]
    emit("dma", op, lambda: dst.write(value, init=init), dma_work(dst, src))


URL_BN_STATS = f"{DOCS}/latest/nki/api/generated/nki.isa.bn_stats.html"
URL_BN_AGGR = f"{DOCS}/latest/nki/api/generated/nki.isa.bn_aggr.html"
BN_STATS_FMAX = 512  # "must not exceed 512 (nl.tile_size.bn_stats_fmax)" (bn_stats page)


def _moments(x: torch.Tensor) -> torch.Tensor:
    """(count, mean, variance * count) per partition of x [P, n] (n may be 0: all three 0)."""
    n = x.shape[1]
    if n == 0:
        return torch.zeros(x.shape[0], 3)
    mean = x.mean(1)
    return torch.stack([torch.full_like(mean, float(n)), mean, ((x - mean[:, None]) ** 2).sum(1)], 1)


def _statistics_operands(dst, data, per_partition: int, what: str, op: str, url: str) -> tuple[int, int]:
    """bn_stats / bn_aggr entry checks: both on chip, dst `per_partition` values per partition of data. Returns
    (partitions, data's elements per partition)."""
    _on_chip(data, "data", op, url)
    _on_chip(dst, "dst", op, url)
    p, n = _per_partition(data)
    if _per_partition(dst) != (p, per_partition):
        raise violation("elementwise-shape", f"{op}: dst must hold {what} per partition ({p}, {per_partition}), "
                        f"got {dst.shape}", url)
    return p, n


def _write_statistics(dst, out: torch.Tensor, poison) -> None:
    """dst <- out [P, k] (per-partition statistics); a partition with any poison input gets poison statistics."""
    p = out.shape[0]
    dst.write(out.reshape(dst.shape),
              init=None if poison is None else _clean(dst, poison.reshape(p, -1).int().amax(1) > 0))


def bn_stats(dst, data, name=None):
    """Per partition, in fp32 on the Vector Engine: (count, mean, variance * count) of data's even elements, then
    of its odd elements (6 values); data <= 512 elements per partition (bn_stats page:
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.bn_stats.html)."""
    op, url = "bn_stats", URL_BN_STATS
    p, n = _statistics_operands(dst, data, 6, "6 values", op, url)
    if n > BN_STATS_FMAX:
        raise violation("bn-stats-fmax", f"{op}: data has {n} elements per partition, more than "
                        f"nl.tile_size.bn_stats_fmax = {BN_STATS_FMAX}: one bn_stats per 512-element slice, then "
                        "one bn_aggr over their outputs", url)

    def run():
        value, poison = _data(data)
        x = value.reshape(p, n)
        _write_statistics(dst, torch.cat([_moments(x[:, 0::2]), _moments(x[:, 1::2])], 1), poison)

    emit("vector", op, run, elementwise_work(data, data))  # streams every input element once


def bn_aggr(dst, data, name=None):
    """Per partition, in fp32 on the Vector Engine: the mean and variance of everything the (count, mean,
    variance * count) triples of `data` (bn_stats outputs side by side) summarise (bn_aggr page:
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.isa.bn_aggr.html)."""
    op, url = "bn_aggr", URL_BN_AGGR
    p, n = _statistics_operands(dst, data, 2, "(mean, variance)", op, url)
    if n % 3:
        raise violation("bn-aggr-triples", f"{op}: data holds {n} values per partition; bn_stats outputs are "
                        "(count, mean, variance * count) triples, so it must be a multiple of 3", url)

    def run():
        value, poison = _data(data)
        t = value.reshape(p, n // 3, 3)
        count, mean, m2 = t[..., 0], t[..., 1], t[..., 2]
        total = count.sum(1)
        mu = (count * mean).sum(1) / total
        var = (m2 + count * (mean - mu[:, None]) ** 2).sum(1) / total  # the parallel-variance identity
        _write_statistics(dst, torch.stack([mu, var], 1), poison)

    emit("vector", op, run, elementwise_work(data, data))


def _unemulated(name: str):
    """An nki.isa instruction nki-library uses that the emulator does not model: calling it raises."""

    def instruction(*args, **kwargs):
        raise NotImplementedError(f"nisa.{name} is outside the emulated subset "
                                  f"({DOCS}/latest/nki/api/generated/nki.isa.{name}.html)")

    instruction.__name__ = instruction.__qualname__ = name
    instruction.unemulated = True  # the conformance scan reports it as a kernel's first gap
    return instruction


for _missing in ("quantize_mx", "nc_matmul_mx", "nc_match_replace8", "range_select", "nc_n_gather",
                 "tensor_partition_reduce", "local_gather", "select_reduce", "exponential", "rand2", "rng",
                 "sequence_bounds", "dropout"):
    globals().setdefault(_missing, _unemulated(_missing))


def core_barrier(data, cores=(0, 1), engine=None, name=None) -> None:
    """`nisa.core_barrier(data, cores)`: wait until both cores of the LNC reach this point."""
    launch = require("nisa.core_barrier", URL_BARRIER)
    if tuple(cores) != (0, 1):
        raise violation("lnc-barrier", f"cores={cores!r}: only cores=(0, 1) is supported", URL_BARRIER)
    if launch.lnc == 1 and not version.at_least("0.7.0"):
        raise violation("lnc-barrier", "core_barrier in a kernel launched at LNC 1: before NKI 0.7.0 the barrier "
                         "is only allowed when LNC is enabled (the paired physical core does not run this kernel); "
                         "launch kernel[2] or drop the barrier at LNC 1", URL_BARRIER)
    if launch.lnc == 1:
        # The 2.33 (NKI 0.7.0) page: cores=(0, 1) "applies at LNC degree 1 and 2": at LNC 1 the barrier waits for the
        # paired physical core, which runs its own launch. One emulated launch has no such partner.
        raise NotImplementedError("nisa.core_barrier at LNC 1 waits for the paired physical core's own kernel "
                                  "launch (allowed from NKI 0.7.0); the emulator runs one launch, so it cannot "
                                  f"emulate that partner ({URL_BARRIER})")
    if not isinstance(data, View) or data.buffer is not SHARED_HBM:
        raise violation("lnc-barrier", f"data must be the shared HBM tensor the cores synchronise on (a kernel "
                         f"argument or nl.shared_hbm), got {data!r}", URL_BARRIER)
    # an instruction like any other: inside a compiled loop body it runs (and waits) once per iteration
    launch.emit("sync", "core_barrier", lambda: launch.wait_barrier(launch.core), call_site())
