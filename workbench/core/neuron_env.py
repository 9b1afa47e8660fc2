"""The Neuron compiler's environment: the logical NeuronCore degree (LNC), torch-free and importing nothing else
from the workbench, so that the kernels, the emulator and the device code can all read it.

What an unset `NEURON_LOGICAL_NC_CONFIG` means is decided here and nowhere else:
* the compiler's LNC (`logical_nc_config`): trn2's 2, neuronx-cc's default (NCC_EVRF066); the NKI kernels launch on
  it and the emulator checks a launch against it;
* a kernel called without a launch grid (`unbracketed_lnc`): 1, as the NKI LNC page describes `kernel(...)`;
* the cores behind one rank (`runtime_lnc`): 2 on a Neuron device or host (trn2's runtime default), 1 elsewhere.
"""

from __future__ import annotations

import contextlib
import os

LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
TRN2_LNC = 2  # trn2's runtime and neuronx-cc default when NEURON_LOGICAL_NC_CONFIG is unset (NCC_EVRF066)


def logical_nc_config(default: int = TRN2_LNC) -> int:
    """The logical NeuronCore degree: `NEURON_LOGICAL_NC_CONFIG` (1 or 2), else `default` (trn2: 2).

    The one reader of that variable (this module imports no torch). The NKI kernels launch
    on this many cores and the NKI emulator checks their launch grid against it, as neuronx-cc does since NKI
    0.7.0 (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/error-codes/EVRF066.html).

    Raises:
        ValueError: a value the Neuron SDK does not support (it supports LNC 1 and 2).
    """
    raw = os.environ.get(LNC_ENV, "").strip()
    if not raw:
        return default
    if raw not in ("1", "2"):
        raise ValueError(f"{LNC_ENV}={raw!r}: the Neuron SDK supports 1 or 2; export {LNC_ENV}=2 (trn2's default) "
                         "or 1, or unset it")
    return int(raw)


@contextlib.contextmanager
def compiled_for_lnc(lnc: int):
    """Inside the block `NEURON_LOGICAL_NC_CONFIG` is `lnc`, the compiler's LNC a kernel launch must match (NKI
    0.7.0); the previous value (or its absence) comes back afterwards. For tools that run the kernels at an LNC
    of their own: the memory plan, the cost report, the nki-library conformance command."""
    saved = os.environ.get(LNC_ENV)
    os.environ[LNC_ENV] = str(lnc)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(LNC_ENV, None)
        else:
            os.environ[LNC_ENV] = saved


def lnc_is_set() -> bool:
    """Whether `NEURON_LOGICAL_NC_CONFIG` is set (to anything but blanks)."""
    return bool(os.environ.get(LNC_ENV, "").strip())


def unbracketed_lnc() -> int:
    """The LNC of a kernel called as `kernel(...)`, without a launch grid: the variable, 1 when unset."""
    return logical_nc_config(default=1)


def runtime_lnc(on_neuron: bool) -> int:
    """Physical NeuronCores behind one rank: the variable; unset, trn2's 2 on a Neuron device or host, 1 elsewhere."""
    return logical_nc_config(default=TRN2_LNC if on_neuron else 1)
