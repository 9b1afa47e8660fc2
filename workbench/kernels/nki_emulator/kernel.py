"""The emulated `@nki.jit` kernel: `kernel[lnc](*args)` checks the NKI Python subset and the LNC, runs the body on
each core (`launch.run_launch`) and hands back its shared-HBM outputs."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from workbench.core.neuron_env import lnc_is_set, logical_nc_config, unbracketed_lnc

from . import dtypes, python_subset, version
from .errors import violation
from .launch import run_launch
from .memory import DOCS, SHARED_HBM, URL_LNC, URL_MEMORY, URL_TILING, Budget, poison_report
from .tensors import Tensor, _from_array


class Kernel:
    """An emulated `@nki.jit` kernel: `kernel[lnc](*args)` launches on an LNC grid; `kernel(*args)` at the LNC of
    NEURON_LOGICAL_NC_CONFIG (1 when unset), as the NKI LNC page describes. From NKI 0.7.0 that LNC must equal the
    compiler's (`core.neuron_env.logical_nc_config()`: NEURON_LOGICAL_NC_CONFIG, 2 on trn2 when unset), else
    `lnc-degree` (NCC_EVRF066), checked before the kernel runs.

    Call it with torch tensors or numpy arrays, positional or keyword (they become shared HBM tensors). Returns
    torch tensors when any argument was a torch tensor, numpy arrays otherwise (bfloat16 outputs come back as
    float32 numpy, numpy having no bfloat16). `options` (e.g. platform_target) are accepted and ignored. The first
    call checks the kernel's source (and the helpers it calls) against the NKI Python subset (`python_subset.py`).
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
        python_subset.check_kernel(self.func)
        as_torch = any(isinstance(a, torch.Tensor) for a in args)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tile-sized ops: intra-op threading only adds overhead
        try:
            hbm_args = [
                _from_array(a, SHARED_HBM, f"arg{i}") if isinstance(a, (torch.Tensor, np.ndarray)) else a
                for i, a in enumerate(args)
            ]
            kwargs = {k: _from_array(v, SHARED_HBM, k) if isinstance(v, (torch.Tensor, np.ndarray)) else v
                      for k, v in kwargs.items()}
            lnc = self.lnc if self.lnc is not None else unbracketed_lnc()
            _check_compiler_lnc(lnc, self.lnc is None)
            results = run_launch(lnc, lambda: self.func(*hbm_args, **kwargs), Budget)
            result = results[0]
            outs = tuple(result) if isinstance(result, (tuple, list)) else (result,)  # nki-library returns lists
            for k, other in enumerate(results[1:], start=1):
                other = tuple(other) if isinstance(other, (tuple, list)) else (other,)
                if len(other) != len(outs) or any(a is not b and getattr(a, "_storage", 0) is not
                                                  getattr(b, "_storage", 1) for a, b in zip(outs, other, strict=False)):
                    raise violation("kernel-output", f"core {k} returned different tensors than core 0: every core "
                                    "must return the same shared HBM outputs", URL_MEMORY)
            converted = tuple(_to_output(o, as_torch) for o in outs)
        finally:
            torch.set_num_threads(threads)
        return converted if isinstance(result, (tuple, list)) else converted[0]


URL_EVRF066 = f"{DOCS}/latest/compiler/error-codes/EVRF066.html"


def _check_compiler_lnc(lnc: int, implicit: bool) -> None:
    """NKI 0.7.0: "the compiler now validates that the kernel and compiler LNC degrees match" (migration guide)."""
    if not version.at_least("0.7.0"):
        return
    compiler = logical_nc_config()
    if lnc != compiler:
        how = "kernel(...) without brackets runs at NEURON_LOGICAL_NC_CONFIG, 1 when unset" if implicit else \
            f"launched as kernel[{lnc}]"
        source = f"NEURON_LOGICAL_NC_CONFIG={compiler}" if lnc_is_set() else \
            "NEURON_LOGICAL_NC_CONFIG unset: trn2's default"
        raise violation("lnc-degree", f"the kernel runs at LNC {lnc} ({how}) but the compiler at LNC {compiler} "
                        f"({source}): launch it as kernel[{compiler}], or export NEURON_LOGICAL_NC_CONFIG={lnc} so "
                        "both agree", URL_EVRF066)


def jit(func=None, **options):
    """Emulated `nki.jit` (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.jit.html)."""
    if func is None:
        return lambda f: jit(f, **options)
    return Kernel(func, options)


def _to_output(t: Any, as_torch: bool):
    if not isinstance(t, Tensor) or t.buffer is not SHARED_HBM:
        raise violation("kernel-output", f"kernels return tensors allocated in nl.shared_hbm (outputs live in shared "
                        f"HBM, visible to every core of the LNC), got {t!r}", URL_MEMORY)
    value = dtypes.values(t._data.clone())  # float8_e4m3 outputs come back as their float32 values
    if not bool(t._init.all()):
        bad = int((~t._init).sum())
        raise violation("uninitialized-read", f"kernel output {t} holds {bad} of {t._init.numel()} elements that are "
                        f"{poison_report(t._storage, ~t._init, t._derived)}; write every output element (padding "
                        "rows included)",
                        URL_TILING)
    if as_torch:
        return value
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy()


def simulate(kernel):
    """Emulated `nki.simulate(kernel)(*numpy_arrays)`: runs the kernel on the CPU emulator.

    Mirrors https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.simulate.html.
    """
    return lambda *args, **kwargs: kernel(*args, **kwargs)
