"""Emulated `nki.language` (nl): allocation, buffers, dtypes, loop iterators, tile-size constants, op tokens.

Only what `workbench.kernels.nki_moe` uses. Op tokens (`nl.add`, `nl.sigmoid`, ...) exist to be passed as
`op=` to `nki.isa` instructions; calling them as standalone tile functions is outside the emulated subset.
"""

from __future__ import annotations

import torch

from ._core import (
    GEMM_MOVING_FMAX,
    GEMM_STATIONARY_FMAX,
    HBM,
    PMAX,
    PSUM,
    PSUM_BANK_BYTES,
    SBUF,
    SHARED_HBM,
    allocate,
)
from ._runtime import dynamic_range, fori_loop, num_programs, program_id, while_loop  # noqa: F401 - nl.*

sbuf, psum, hbm, shared_hbm = SBUF, PSUM, HBM, SHARED_HBM
float32, bfloat16, float16, int32 = torch.float32, torch.bfloat16, torch.float16, torch.int32


def ndarray(shape, dtype, buffer=SBUF, name: str = ""):
    """Allocate an uninitialised tensor in `buffer` (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/generated/nki.language.NkiTensor.html)."""
    return allocate(shape, dtype, buffer, name)


# Static range iterators (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/deep-dives/nki-loops.html):
# "In NKI 0.7 and later, the static range iterators nki.language.affine_range(), nki.language.sequential_range(),
# and nki.language.static_range() are deprecated and default to Python range": each returns the `range` object
# Python would, unrolled at trace time. (Before 0.7 affine_range promised no loop-carried dependency; the emulator
# ran it in order then too, so it never caught a wrongly declared one.)
def affine_range(start, stop=None, step=1):
    return range(0, start, step) if stop is None else range(start, stop, step)


sequential_range = static_range = affine_range

# Compiled loops (nl.fori_loop, nl.while_loop; nl.dynamic_range under the rules of NKI <= 0.6) and nl.program_id(0)
# / nl.num_programs(0) (the LNC launch grid) live in _runtime.py.


class tile_size:  # noqa: N801 - mirrors nki.language.tile_size
    """Hardware tile limits (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/nki/api/nki.language.tile_size.html)."""

    pmax = PMAX
    psum_fmax = psum_bank_fmax = PSUM_BANK_BYTES // 4
    gemm_stationary_fmax = GEMM_STATIONARY_FMAX
    gemm_moving_fmax = GEMM_MOVING_FMAX


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
def _silu_dx(x):
    sig = torch.sigmoid(x)
    return sig * (1 + x * (1 - sig))


sigmoid = _Op("sigmoid", torch.sigmoid)
copy = _Op("copy", torch.clone)  # Identity
silu = _Op("silu", torch.nn.functional.silu)
silu_dx = _Op("silu_dx", _silu_dx)  # Silu Derivative: sigmoid(x) * (1 + x * (1 - sigmoid(x)))
ACTIVATIONS = (sigmoid, copy, silu, silu_dx)
