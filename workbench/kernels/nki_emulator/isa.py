"""Emulated `nki.isa` (nisa): the instructions `workbench.kernels.nki_moe` uses, with their documented rules.

Each instruction checks memory kinds, shapes and dtypes first (raising `NkiRuleError` naming the rule), then
computes like the engine does: Vector/Scalar engines cast inputs to fp32, compute in fp32 and cast on store;
the Tensor Engine multiplies in fp32 and accumulates in fp32 PSUM. Options a kernel here does not use raise
NotImplementedError instead of being silently ignored.
"""

from __future__ import annotations

import math

import torch

from . import language as nl
from ._core import (
    DOCS,
    FLOAT_DTYPES,
    GEMM_MOVING_FMAX,
    GEMM_STATIONARY_FMAX,
    PMAX,
    PSUM,
    SBUF,
    Tensor,
    View,
    violation,
)
from ._runtime import VirtualRegister, core_barrier, current, emit  # noqa: F401 - core_barrier is nisa.*
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


class engine:  # noqa: N801 - mirrors nki.isa.engine
    unknown, tensor, vector, scalar, gpsimd = "unknown", "tensor", "vector", "scalar", "gpsimd"


# -- shared checks ---------------------------------------------------------------------------------------------------
def _view(t, what: str, op: str):
    if not isinstance(t, View):
        raise TypeError(f"{op}: {what} must be an NKI tensor or access pattern, got {type(t).__name__}")
    return t


def _on_chip(t, what: str, op: str, url: str) -> None:
    _view(t, what, op)
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


def _float(t) -> torch.Tensor:
    return t.read().float()


def _check_operand(value, data, what: str, op: str, url: str) -> None:
    """A scalar float or a per-partition (P, 1) vector broadcast along the free dims."""
    if isinstance(value, (int, float)):
        return
    _on_chip(value, what, op, url)
    if tuple(value.shape) != (data.shape[0], 1):
        raise violation("operand-shape", f"{op}: {what} must be a float or a ({data.shape[0]}, 1) tile, got shape "
                        f"{value.shape}", url)


def _operand(value, data) -> torch.Tensor:
    """The operand's value at execution time, broadcastable against `data`."""
    if isinstance(value, (int, float)):
        return torch.as_tensor(float(value), dtype=torch.float32)
    return _float(value).reshape([data.shape[0]] + [1] * (len(data.shape) - 1))


def _engine(engine, default: str) -> str:
    return default if engine in (None, "unknown") else engine


def _arith(op, name: str, url: str):
    if op not in nl.ARITHMETIC:
        raise NotImplementedError(f"{name}: op {op!r} outside the emulated subset {nl.ARITHMETIC} ({url})")
    return op.fn


# -- Tensor Engine -----------------------------------------------------------------------------------------------------
def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=None, name=None):
    """dst (PSUM, fp32) = stationary.T @ moving, or += when accumulate=True (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.nc_matmul.html)."""
    op, url = "nc_matmul", URL_MATMUL
    if is_stationary_onezero or is_moving_onezero or is_transpose or tile_position or tile_size or perf_mode:
        raise NotImplementedError("nc_matmul: onezero/transpose/tiling/perf modes are outside the emulated subset")
    if accumulate is None:
        raise NotImplementedError("nc_matmul: pass accumulate=False (first matmul of a group) or True explicitly; "
                                  "the emulator does not model the compiler's default")
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
    if dst.dtype != torch.float32:
        raise violation("matmul-psum-dtype", f"matmul results accumulate in fp32 PSUM; dst dtype is {dst.dtype}, "
                        "allocate it with dtype=nl.float32", url)
    if tuple(dst.shape) != (m, n):
        raise violation("matmul-output-shape", f"dst shape {dst.shape} != (stationary free, moving free) = "
                        f"{(m, n)}", url)

    def run():
        result = _float(stationary).T @ _float(moving)
        if accumulate:
            if not (isinstance(dst, Tensor) and dst.written_by_matmul()):
                raise violation("matmul-accumulate-init", "accumulate=True onto PSUM elements not written by a "
                                "previous nc_matmul (uninitialised or written by another engine is undefined on "
                                "NeuronCore-v3); open each accumulation group with accumulate=False", url)
            result = result + dst.read()
        dst.write(result, by_matmul=True)
        current().stats.pe_flops += 2 * k_s * m * n

    emit("tensor", op, run, matmul_work(stationary, moving))


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
    tensor_engine = engine == "tensor" or (engine == "unknown" and data.buffer is SBUF and dst.buffer is PSUM)
    if tensor_engine:
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
        dst.write(data.read().reshape(p, f).T.contiguous())
        if tensor_engine:  # the PE array transposes by a matmul against identity: 2 * p * p * f FLOPs
            stats = current().stats
            stats.pe_flops += 2 * p * p * f
            stats.pe_transpose_flops += 2 * p * p * f

    emit("tensor" if tensor_engine else "vector", op, run,
         transpose_work(data) if tensor_engine else elementwise_work(dst, data))


# -- DMA ---------------------------------------------------------------------------------------------------------------
def dma_copy(dst, src, dst_rmw_op=None, oob_mode=None, dge_mode=None, engine=None, name=None):
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
    if tuple(dst.shape) != tuple(src.shape):
        raise violation("dma-shape", f"dst shape {dst.shape} != src shape {src.shape}", url)
    def run():
        value = src.read()
        dst.write(value)
        _count_dma(dst, src)
        if getattr(src, "vector_offset", None) is not None:
            _count_gather(src, value)

    emit("dma", op, run, dma_work(dst, src))


def _count_gather(src, value) -> None:
    """Row gather (indirect DMA, `vector_offset`): rows read, and how many of them were entirely zero.

    A zero row is what a padding slot computes on: blockwise kernels point padding slots at a zero row (the MoE
    kernels' row T of x_pad), so for the gather of a kernel's input rows this is "padding slots computed"."""
    stats = current().stats
    rows = src.pattern[0][1]
    zero = int((value.reshape(rows, -1) == 0).all(dim=1).sum())
    name = _name(src)
    stats.gathered_rows[name] = stats.gathered_rows.get(name, 0) + rows
    stats.padding_rows[name] = stats.padding_rows.get(name, 0) + zero


def _count_dma(dst, src) -> None:
    stats = current().stats
    nbytes = math.prod(src.shape) * src.dtype.itemsize
    side = dst if dst.buffer is SBUF else src if src.buffer is SBUF else dst
    per_partition = nbytes // side.shape[0]
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
    for what, t in [("dst", dst)] + [(f"srcs[{i}]", s) for i, s in enumerate(srcs)]:
        _view(t, what, op)
        if t.buffer is PSUM:
            raise violation("dma-buffer", f"dma_compute operands are in HBM or SBUF; {what} is in PSUM", url)
        if tuple(t.shape) != tuple(dst.shape):
            raise violation("dma-shape", f"dma_compute: {what} shape {t.shape} != dst shape {dst.shape}", url)

    def run():
        total = _float(srcs[0])
        for s in srcs[1:]:
            total = total + _float(s)
        dst.write(total)
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
        value = src.read()
        dst.write(value if value.dtype == dst.dtype else value.float())

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
    emit(_engine(engine, "vector"), name_,
         lambda: dst.write(fn(_float(data1).reshape(dst.shape), _float(data2).reshape(dst.shape))),
         elementwise_work(dst, data1, data2))


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
        _check_operand(operand, data, "operand", name_, url)
        if not isinstance(operand, (int, float)) and operand.dtype != torch.float32:
            raise violation("tensor-scalar-operand-dtype", f"tensor_scalar: a tile operand of an arithmetic op must "
                            f"be float32, got {operand.dtype}; keep per-partition scale/bias vectors in fp32", url)
        steps.append((_arith(op, name_, url), operand, reverse))

    def run():
        result = _float(data)
        for fn, operand, reverse in steps:
            value = _operand(operand, data)
            result = fn(value, result) if reverse else fn(result, value)
        dst.write(result)

    emit(_engine(engine, "vector"), name_, run, elementwise_work(dst, data))


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=None,
               engine=None, name=None):
    """dst = op(data * scale + bias) on the Scalar Engine in fp32 (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.isa.activation.html)."""
    name_, url = "activation", URL_ACTIVATION
    if engine is not None:
        raise violation("api-drift", "nisa.activation has no engine= parameter in current NKI (it always runs on the "
                        "Scalar Engine on trn2); drop engine=", URL_ACTIVATION_LATEST)
    if reduce_op is not None or reduce_res is not None or reduce_cmd is not None:
        raise NotImplementedError("activation reduce_* options are outside the emulated subset")
    if op not in nl.ACTIVATIONS:
        raise NotImplementedError(f"activation op {op!r} outside the emulated subset {nl.ACTIVATIONS}")
    _on_chip(data, "data", name_, url)
    _on_chip(dst, "dst", name_, url)
    _same_layout(name_, url, dst=dst, data=data)
    _check_operand(scale, data, "scale", name_, url)
    if bias is not None:
        _check_operand(bias, data, "bias", name_, url)

    def run():
        x = _float(data) * _operand(scale, data)
        if bias is not None:
            x = x + _operand(bias, data)
        dst.write(op.fn(x))

    emit("scalar", name_, run, elementwise_work(dst, data))


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


__all__ = ["VirtualRegister", "activation", "core_barrier", "dma_compute", "dma_copy", "engine", "memset",
           "nc_matmul", "nc_transpose", "register_alloc", "register_load", "register_move", "register_store",
           "tensor_copy", "tensor_scalar", "tensor_tensor"]
