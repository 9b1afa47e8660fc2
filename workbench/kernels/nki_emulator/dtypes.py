"""NKI data types (`nl.float32`, `nl.uint8`, `nl.float8_e4m3`, ...) and how the emulator stores them.

The supported-types table (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/api/nki.api.shared.html)
lists (u)int8/16/32, float16, bfloat16, tfloat32, float32, float8_e4m3, float8_e5m2 and the float8_e4m3fn /
packed `_x4` types. A type is stored as the torch dtype with exactly its value set, so every store rounds the way
a cast to that type does. Types whose value set torch has no dtype for are `Unmodelled`: the name exists (kernels
compare against it and pass it around), but allocating or passing a tensor of that type raises
NotImplementedError instead of storing something close.

- `float8_e4m3` on trn2 is the IEEE-style e4m3, the "legacy float8e4" of Neuron's compiler (NCC_EOCP001; not the
  OCP `float8_e4m3fn`, whose same bit patterns mean other values, NCC_EVRF051/052). Emulated bit-exactly (below);
  torch has no such dtype, so its storage is torch's `float8_e4m3fnuz` *holding IEEE e4m3 bit patterns* (`E4M3`):
  every read an engine computes on decodes them (`values`), every store of computed values encodes (`cast`); a
  data movement moves the bytes (`cast` of data already of the type is the identity), NaN patterns included. No
  NKI type is fnuz (Neuron rejects FNUZ types, NCC_EVRF005), so the carrier names nothing else; a torch fnuz tensor
  passed in is refused.
- `float8_e5m2` is IEEE-style e5m2 (bias 15, max 57,344, inf and NaN): torch's type holds the same values and its
  cast rounds to nearest-even with overflow to inf, checked bit by bit in tests/kernels/test_emulator_api.py.
- `tfloat32` rounds the fp32 mantissa to 10 bits; torch has no such storage type.
- `*_x4` / `float4_*` are 4-element packed types for `nc_matmul_mx` (NeuronCore-v4 only).
"""

from __future__ import annotations

import torch

URL_DTYPES = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/api/nki.api.shared.html"


class Unmodelled:
    """An NKI dtype the emulator names but cannot store faithfully (see module docstring)."""

    def __init__(self, name: str, why: str):
        self.name, self.why = name, why

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def refuse(self, what: str):
        raise NotImplementedError(f"{what}: dtype nl.{self.name} is outside the emulated subset ({self.why})")


dtype = torch.dtype  # `nki.dtype`, the annotation nki-library writes for dtype parameters
float32, bfloat16, float16 = torch.float32, torch.bfloat16, torch.float16
int8, int16, int32 = torch.int8, torch.int16, torch.int32
uint8, uint16, uint32 = torch.uint8, torch.uint16, torch.uint32
float8_e5m2 = torch.float8_e5m2  # IEEE-style e5m2 (max 57344): torch's type has the same value set
float8_e4m3fn = torch.float8_e4m3fn  # OCP e4m3fn (max 448, no inf): same value set as torch's
bool_ = torch.bool

float8_e4m3 = E4M3 = torch.float8_e4m3fnuz  # the carrier of IEEE e4m3 bit patterns (module docstring)
tfloat32 = Unmodelled("tfloat32", "fp32 with a 10-bit mantissa has no torch dtype")
float8_e4m3fn_x4 = Unmodelled("float8_e4m3fn_x4", "4x packed fp8 for nc_matmul_mx on NeuronCore-v4")
float8_e5m2_x4 = Unmodelled("float8_e5m2_x4", "4x packed fp8 for nc_matmul_mx on NeuronCore-v4")
float4_e2m1fn_x4 = Unmodelled("float4_e2m1fn_x4", "4x packed fp4 for nc_matmul_mx on NeuronCore-v4")

FLOAT = (float32, bfloat16, float16, float8_e5m2, float8_e4m3fn, float8_e4m3)
INTEGER = (int8, int16, int32, uint8, uint16, uint32)
STORED = FLOAT + INTEGER + (bool_,)

# numpy has no bfloat16/fp8: such inputs arrive as torch tensors; these map numpy kernel arguments
NUMPY_NAMES = {"float32": float32, "float16": float16, "int8": int8, "int16": int16, "int32": int32,
               "uint8": uint8, "uint16": uint16, "uint32": uint32, "bool": bool_}


def check_stored(dtype, what: str):
    """Return `dtype` if the emulator stores it, else raise NotImplementedError naming it."""
    if isinstance(dtype, Unmodelled):
        dtype.refuse(what)
    if dtype not in STORED:
        raise NotImplementedError(f"{what}: dtype {dtype!r} is not an NKI data type the emulator stores "
                                  f"(see {URL_DTYPES})")
    return dtype


def is_float(dtype) -> bool:
    return dtype in FLOAT


# IEEE 754 conventions applied to 1 sign, 4 exponent, 3 mantissa bits: bias 2^(4-1) - 1 = 7; exponent field 0:
# subnormals m * 2^-9; 15: +-inf (mantissa 0) or NaN; else (1 + m/8) * 2^(e-7). Largest finite 1.875 * 2^7 = 240, the
# "max 240" nki-library uses for trn1/trn2 (core/qkv/qkv_cte.py, core/rmsnorm/rmsnorm_quant_constants.py).
E4M3_BIAS, E4M3_MAX = 7, 240.0


def _e4m3_table() -> torch.Tensor:
    """The float64 value of each of the 256 e4m3 bit patterns."""
    bits = torch.arange(256)
    sign = torch.where(bits >= 128, -1.0, 1.0).double()
    e, m = (bits >> 3) & 15, (bits & 7).double()
    mag = torch.where(e == 0, m * 2.0 ** (1 - E4M3_BIAS - 3), (1 + m / 8) * torch.pow(2.0, (e - E4M3_BIAS).double()))
    mag = torch.where(e == 15, torch.where(m == 0, torch.tensor(float("inf")), torch.tensor(float("nan"))), mag)
    return sign * mag


E4M3_VALUES = _e4m3_table()
_E4M3_FINITE = E4M3_VALUES[:120]  # codes 0x00..0x77: every finite non-negative value, increasing with the code


def e4m3_bits(value: torch.Tensor) -> torch.Tensor:
    """uint8 IEEE e4m3 encodings of `value`, rounded to nearest, ties to even (the IEEE 754 default and the mode
    every NeuronCore supports: Neuron docs, "Neuron Rounding Modes"); like IEEE and torch's e5m2 cast, overflow
    (|x| >= 248, the midpoint past 240) gives +-inf, NaN gives 0x7F / 0xFF, the sign of zero is kept."""
    x = value.double().reshape(-1)
    a = x.abs()
    hi = torch.searchsorted(_E4M3_FINITE, a).clamp(max=119)  # first finite value >= |x| (240 when above)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - _E4M3_FINITE[lo], _E4M3_FINITE[hi] - a
    code = torch.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi)  # tie: the even mantissa
    code = torch.where(a >= 248.0, 0x78, code)  # 248 ties between 240 (odd) and 2^8 (even): inf
    code = torch.where(torch.isnan(x), 0x7F, code)
    sign = torch.signbit(x).long() << 7
    return (code | sign).to(torch.uint8).reshape(value.shape)


def values(t: torch.Tensor) -> torch.Tensor:
    """What stored data means: float32 decodings of an e4m3 carrier, else `t` itself."""
    if t.dtype is E4M3:
        return E4M3_VALUES.float()[t.view(torch.uint8).long()]
    return t


def cast(value: torch.Tensor, dtype) -> torch.Tensor:
    """`value` converted to `dtype` as a store does: float types round to nearest-even (torch's cast; `e4m3_bits`
    for float8_e4m3). Data already of `dtype` is stored as it is, bit for bit: a data movement (`read_moved`
    hands over the stored bits, an e4m3 carrier included) copies bytes, so every NaN pattern survives (decoding
    and re-encoding would turn e4m3's 0x79-0x7E into 0x7F). An e4m3 carrier stored as another type is decoded first.

    Float -> integer stores are exact only for integral in-range values; any other value raises
    NotImplementedError, because the engines' float-to-int rounding and saturation are not documented.
    """
    if value.dtype == dtype:
        return value
    value = values(value)
    if dtype in INTEGER and value.is_floating_point():
        info = torch.iinfo(dtype)
        v = value.double()
        if bool(((v != v.round()) | (v < info.min) | (v > info.max)).any()):
            raise NotImplementedError(f"storing non-integral or out-of-range float values into a {dtype} tile: "
                                      "the engines' float-to-int rounding/saturation is outside the emulated subset")
        return v.to(dtype)
    if dtype is E4M3:
        return e4m3_bits(values(value)).view(E4M3)
    return value.to(dtype)
