"""NKI data types (`nl.float32`, `nl.uint8`, `nl.float8_e4m3`, ...) and how the emulator stores them.

The supported-types table (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/api/nki.api.shared.html)
lists (u)int8/16/32, float16, bfloat16, tfloat32, float32, float8_e4m3, float8_e5m2 and the float8_e4m3fn /
packed `_x4` types. A type is stored as the torch dtype with exactly its value set, so every store rounds the way
a cast to that type does. Types whose value set torch has no dtype for are `Unmodelled`: the name exists (kernels
compare against it and pass it around), but allocating or passing a tensor of that type raises
NotImplementedError instead of storing something close.

- `float8_e4m3` on trn2 is the IEEE-style e4m3 (max 240, as nki-library's tests use: range (-240, 240)); torch's
  `float8_e4m3fn` has max 448 and `float8_e4m3fnuz` a different exponent bias, so neither holds the same values.
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

float8_e4m3 = Unmodelled("float8_e4m3", "trn2's IEEE-style e4m3 with max 240 has no torch dtype")
tfloat32 = Unmodelled("tfloat32", "fp32 with a 10-bit mantissa has no torch dtype")
float8_e4m3fn_x4 = Unmodelled("float8_e4m3fn_x4", "4x packed fp8 for nc_matmul_mx on NeuronCore-v4")
float8_e5m2_x4 = Unmodelled("float8_e5m2_x4", "4x packed fp8 for nc_matmul_mx on NeuronCore-v4")
float4_e2m1fn_x4 = Unmodelled("float4_e2m1fn_x4", "4x packed fp4 for nc_matmul_mx on NeuronCore-v4")

FLOAT = (float32, bfloat16, float16, float8_e5m2, float8_e4m3fn)
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


def cast(value: torch.Tensor, dtype) -> torch.Tensor:
    """`value` converted to `dtype` as a store does: float types round to nearest-even (torch's cast).

    Float -> integer stores are exact only for integral in-range values; any other value raises
    NotImplementedError, because the engines' float-to-int rounding and saturation are not documented.
    """
    if dtype in INTEGER and value.is_floating_point():
        info = torch.iinfo(dtype)
        v = value.double()
        if bool(((v != v.round()) | (v < info.min) | (v > info.max)).any()):
            raise NotImplementedError(f"storing non-integral or out-of-range float values into a {dtype} tile: "
                                      "the engines' float-to-int rounding/saturation is outside the emulated subset")
        return v.to(dtype)
    return value.to(dtype)
