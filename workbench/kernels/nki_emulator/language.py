"""Emulated `nki.language` (nl): allocation, buffers, dtypes, loop iterators, tile-size constants, op tokens.

Only what `workbench.kernels.nki_moe` uses. Op tokens (`nl.add`, `nl.sigmoid`, ...) exist to be passed as
`op=` to `nki.isa` instructions; calling them as standalone tile functions is outside the emulated subset.
"""

from __future__ import annotations

import torch

from .dtypes import (  # noqa: F401 - the NKI data types are nl.*
    bfloat16,
    bool_,
    float4_e2m1fn_x4,
    float8_e4m3,
    float8_e4m3fn,
    float8_e4m3fn_x4,
    float8_e5m2,
    float8_e5m2_x4,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from .launch import num_programs, program_id, require  # noqa: F401 - re-exported as nl.*
from .loops import VirtualRegister, dynamic_range, fori_loop, while_loop  # noqa: F401 - re-exported as nl.*
from .memory import (
    GEMM_MOVING_FMAX,
    GEMM_STATIONARY_FMAX,
    HBM,
    PMAX,
    PSUM,
    PSUM_BANK_BYTES,
    SBUF,
    SBUF_PARTITION_BYTES,
    SHARED_HBM,
)
from .tensors import allocate

sbuf, psum, hbm, shared_hbm = SBUF, PSUM, HBM, SHARED_HBM


def ndarray(shape, dtype, buffer=SBUF, name: str = "", address=None):
    """Allocate an uninitialised tensor in `buffer` (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.language.NkiTensor.html).

    `address=(start_partition, byte_offset)` places an SBUF/PSUM tile explicitly (NKI 0.3 "explicit memory
    address placement"); the emulator checks the placement fits and that live placed tiles do not overlap."""
    return allocate(shape, dtype, buffer, name, address)


# Static range iterators (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/deep-dives/nki-loops.html):
# "In NKI 0.7 and later, the static range iterators nki.language.affine_range(), nki.language.sequential_range(),
# and nki.language.static_range() are deprecated and default to Python range": each returns the `range` object
# Python would, unrolled at trace time. (Before 0.7 affine_range promised no loop-carried dependency; the emulator
# ran it in order then too, so it never caught a wrongly declared one.)
def affine_range(start, stop=None, step=1):
    return range(0, start, step) if stop is None else range(start, stop, step)


sequential_range = static_range = affine_range

# Compiled loops (nl.fori_loop, nl.while_loop; nl.dynamic_range under the rules of NKI <= 0.6) and nl.program_id(0)
# / nl.num_programs(0) (the LNC launch grid) live in loops.py and launch.py.


class tile_size:  # noqa: N801 - mirrors nki.language.tile_size
    """Hardware tile limits (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/nki.language.tile_size.html)."""

    pmax = PMAX
    psum_fmax = psum_bank_fmax = PSUM_BANK_BYTES // 4
    gemm_stationary_fmax = GEMM_STATIONARY_FMAX
    gemm_moving_fmax = GEMM_MOVING_FMAX
    bn_stats_fmax = 512  # nki.isa.bn_stats page: "must not exceed 512 (nl.tile_size.bn_stats_fmax)"
    # "Usable SBUF free dimension per partition, in bytes" (tile_size page, v2.30): the page gives no number; this
    # is 224 KiB less the compiler's reservations as nki-library writes them (memory.SBUF_PARTITION_BYTES: the
    # figure the emulator's sbuf-capacity rule enforces)
    total_available_sbuf_size = SBUF_PARTITION_BYTES


class _Op:
    """An op token: `fn` maps float32 torch tensors to float32 (engines compute in fp32)."""

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"nl.{self.name} as a standalone tile op is outside the emulated subset; pass it "
                                  "as op= to an nki.isa instruction")


# Arithmetic operators for tensor_tensor / tensor_scalar.
add = _Op("add", torch.add)
subtract = _Op("subtract", torch.sub)
multiply = _Op("multiply", torch.mul)
maximum = _Op("maximum", torch.maximum)
ARITHMETIC = (add, subtract, multiply, maximum)

# Activation functions for nisa.activation ("Supported Activation Functions for NKI ISA", evaluated exactly here:
# https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/api/nki.api.shared.html).
sigmoid = _Op("sigmoid", torch.sigmoid)
ACTIVATIONS = (sigmoid,)


# -- the rest of nki.language that nki-library's kernels use ----------------------------------------------------------
URL_NL = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated"

bool = bool_  # noqa: A001 - nl.bool is the documented spelling
# `nl.private_hbm`: HBM private to one logical core, as `nl.hbm` (NkiTensor page lists sbuf, psum, hbm,
# private_hbm, shared_hbm)
private_hbm = HBM


class NKIObject:
    """`nl.NKIObject`: base class of the configuration records a kernel creates and passes around.

    Its constructor takes keyword arguments and sets them as attributes (`NKIObject.__init__(self, **kwargs)` in
    the nki.language source listing of the v2.30 docs, _modules/nki/language.html); annotated fields not passed stay
    unset, as nki-library relies on (`DimensionSizes(T=..., ...)` then `derive_all_dims()` in bwmm_shard_on_I.py).
    Subclasses decorated with `@dataclass` get the dataclass constructor instead.
    """

    def __init__(self, **kwargs):
        for name, value in kwargs.items():
            setattr(self, name, value)


def ds(start, size):
    """`nl.ds(start, size)`: the index range `start:start+size` (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.language.ds.html)."""
    if isinstance(start, VirtualRegister) or isinstance(size, VirtualRegister):
        raise NotImplementedError("nl.ds with a runtime (register) start/size is outside the emulated subset; use "
                                  "an access pattern with scalar_offset")
    return slice(int(start), int(start) + int(size))


def program_ndim() -> int:
    """`nl.program_ndim()`: dimensions of the launch grid. Every emulated launch is a 1-D LNC grid: `kernel[lnc]`,
    or a plain call at the LNC of NEURON_LOGICAL_NC_CONFIG (see URL_NL/nki.language.program_ndim.html)."""
    require("nl.program_ndim", f"{URL_NL}/nki.language.program_ndim.html")
    return 1


def _compare(fn):
    return lambda a, b: fn(a, b).float()  # comparisons give 1.0 / 0.0 (NKI: "returns 1 ... 0 otherwise")


def _logical(fn):
    return lambda a, b: fn(a != 0, b != 0).float()


# More arithmetic/compare/logical operators for tensor_tensor / tensor_scalar / scalar_tensor_tensor
# (nki.language.<op> pages: numpy semantics on fp32 values).
minimum = _Op("minimum", torch.minimum)
divide = _Op("divide", torch.div)
power = _Op("power", torch.pow)
equal = _Op("equal", _compare(torch.eq))
not_equal = _Op("not_equal", _compare(torch.ne))
greater = _Op("greater", _compare(torch.gt))
greater_equal = _Op("greater_equal", _compare(torch.ge))
less = _Op("less", _compare(torch.lt))
less_equal = _Op("less_equal", _compare(torch.le))
logical_and = _Op("logical_and", _logical(torch.logical_and))
logical_or = _Op("logical_or", _logical(torch.logical_or))
logical_xor = _Op("logical_xor", _logical(torch.logical_xor))
ARITHMETIC = ARITHMETIC + (minimum, divide, power, equal, not_equal, greater, greater_equal, less, less_equal,
                           logical_and, logical_or, logical_xor)


def _gelu_apprx_sigmoid(x):
    return x * torch.sigmoid(1.702 * x)


def _gelu_apprx_sigmoid_dx(x):
    s = torch.sigmoid(1.702 * x)
    return s + 1.702 * x * s * (1 - s)


def _silu_dx(x):
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


# More activation functions for nisa.activation (nki.language.<fn> pages; exact math, see docs/nki_emulator.md:
# the Scalar Engine's hardware approximations are not modelled).
copy = _Op("copy", lambda x: x)
exp = _Op("exp", torch.exp)
log = _Op("log", torch.log)
tanh = _Op("tanh", torch.tanh)
sin = _Op("sin", torch.sin)
abs = _Op("abs", torch.abs)  # noqa: A001 - nl.abs
square = _Op("square", torch.square)
sqrt = _Op("sqrt", torch.sqrt)
rsqrt = _Op("rsqrt", torch.rsqrt)
reciprocal = _Op("reciprocal", torch.reciprocal)
relu = _Op("relu", torch.relu)
silu = _Op("silu", torch.nn.functional.silu)
silu_dx = _Op("silu_dx", _silu_dx)
gelu = _Op("gelu", lambda x: torch.nn.functional.gelu(x, approximate="none"))
gelu_apprx_tanh = _Op("gelu_apprx_tanh", lambda x: torch.nn.functional.gelu(x, approximate="tanh"))
gelu_apprx_sigmoid = _Op("gelu_apprx_sigmoid", _gelu_apprx_sigmoid)
gelu_apprx_sigmoid_dx = _Op("gelu_apprx_sigmoid_dx", _gelu_apprx_sigmoid_dx)
ACTIVATIONS = ACTIVATIONS + (copy, exp, log, tanh, sin, abs, square, sqrt, rsqrt, reciprocal, relu, silu, silu_dx,
                             gelu, gelu_apprx_tanh, gelu_apprx_sigmoid, gelu_apprx_sigmoid_dx)

# Absolute (`nl.abs`) is also an ALU op: the "Supported Math Operators for NKI ISA" table lists it among the
# arithmetic operators ("Arithmetic Unary" in the current table; not a legal reduction op). A unary ALU op applies
# to an instruction's tensor input alone: tensor_scalar / tensor_scalar_reduce take it with operand None or 0 (their
# operand0: "Must be None or 0 when op0 is a unary operator (e.g., nl.abs)"). As an activation it stays torch.abs.
URL_ALU_OPS = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/api/nki.api.shared.html#nki-aluop"
ARITHMETIC_UNARY = (abs,)
ARITHMETIC = ARITHMETIC + ARITHMETIC_UNARY


def shared_identity_matrix(n: int, dtype=uint8):
    """`nl.shared_identity_matrix(n, dtype=nl.uint8)`: an (n, n) identity matrix in SBUF, a compiler constant (no
    instruction) (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.30.0/nki/api/generated/nki.language.shared_identity_matrix.html)."""
    tile = allocate((n, n), dtype, SBUF, f"identity{n}")
    tile.write(torch.eye(n))
    return tile
