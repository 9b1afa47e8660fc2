"""`nki.isa.constants`: the enumerations instructions take (also re-exported as `nisa.oob_mode`, ...).

Members as listed on their API pages (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.29.1/nki/api/
generated/nki.isa.oob_mode.html, .../nki.isa.dge_mode.html, .../nki.isa.engine.html, .../nki.isa.reduce_cmd.html,
.../nki.isa.matmul_perf_mode.html, .../nki.isa.nc_version.html). The emulator models NeuronCore-v3 (trn2), so
`nisa.get_nc_version()` answers `nc_version.gen3`.
"""

from __future__ import annotations

import enum


class oob_mode(enum.Enum):  # noqa: N801 - mirrors nki.isa.oob_mode
    """Out-of-bounds indirect access: `error` raises at run time, `skip` silently skips that access."""

    error = 0
    skip = 1


class dge_mode(enum.Enum):  # noqa: N801
    """Who generates a DMA's descriptors (runtime, GpSimd software DGE, hardware DGE); not modelled."""

    unknown = 0
    none = 1
    swdge = 2
    hwdge = 3


class engine(enum.Enum):  # noqa: N801
    """The engine an instruction runs on; `unknown` lets the compiler choose."""

    unknown = "unknown"
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    sync = "sync"


class reduce_cmd(enum.Enum):  # noqa: N801
    """Accumulation-register command of `activation_reduce` / `tensor_scalar_reduce`-style instructions."""

    idle = 0
    reset = 1
    reset_reduce = 2
    reduce = 3


class matmul_perf_mode(enum.Enum):  # noqa: N801
    """`nc_matmul` performance modes (FP8 double-row etc.); only `none` is emulated."""

    none = 0
    double_row = 1
    double_row_gen3 = 2


class nc_version(enum.IntEnum):  # noqa: N801 - ordered: kernels compare `>= nc_version.gen3`
    """NeuronCore generation: gen2 (trn1/inf2), gen3 (trn2), gen4 (trn3)."""

    gen2 = 2
    gen3 = 3
    gen4 = 4


__all__ = ["dge_mode", "engine", "matmul_perf_mode", "nc_version", "oob_mode", "reduce_cmd"]
