"""`kernels.buffers`: the HBM tensors a kernel call allocates, against what the real kernels allocate in the emulator.

The emulator records every HBM allocation of a launch (`Counters.hbm_allocations`: name, shape, dtype, buffer, and
which output it is or None for scratch). The function the memory plan uses must list exactly those, for the
arguments the autograd glue hands the kernels: unchunked and F-chunked (fp32 slot scratch) weights, LNC 1 and 2.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_kernels import make_case

from workbench.kernels import autograd, buffers, nki_moe
from workbench.kernels.nki_api import REAL_NKI
from workbench.kernels.nki_emulator import counters

pytestmark = pytest.mark.skipif(REAL_NKI, reason="the emulator's allocation record is the reference here")


def _recording(kernel, calls):
    host = autograd._on_host(kernel)

    def run(lnc, *args):
        calls.append(buffers.hbm_allocations(kernel, lnc, args))
        return host(lnc, *args)

    return run


@pytest.mark.parametrize(("T", "K", "E", "D", "F", "dtype", "lnc", "chunked"), [
    (512, 2, 8, 64, 64, torch.bfloat16, 2, False),  # the tiny-moe step the plan test traces
    (150, 2, 4, 16, 24, torch.float32, 1, False),
    (20, 2, 2, 4096, 1024, torch.bfloat16, 1, True),  # F chunked at D = 4096: the slot scratch is fp32
])
def test_listed_allocations_equal_the_emulators(monkeypatch, T, K, E, D, F, dtype, lnc, chunked):
    calls = []
    monkeypatch.setattr(autograd, "HOST_KERNELS", autograd.Kernels(_recording(nki_moe.moe_blockwise_fwd, calls),
                                                                   _recording(nki_moe.moe_blockwise_bwd, calls)))
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(lnc))  # the kernels launch on the compiler's LNC
    x, ids, w, wg, wu, wd = make_case(T, K, E, D, F, dtype=dtype)
    with counters() as c:
        out = autograd.blockwise_moe_nki(x, ids, w, wg, wu, wd, block_size=128)
        out.float().sum().backward()
    listed = [a for call in calls for a in call]
    assert listed == c.hbm_allocations
    assert len(calls) == c.launches == 2
    scratch = {a.name: a for a in listed if a.output is None}
    assert set(scratch) == {"y_rows", "dx_rows"}
    assert all(a.dtype == (torch.float32 if chunked else dtype) for a in scratch.values())
    # the backward's weight gradients in the io dtype, one dummy expert row per core: 3 x (E + lnc) x F x D
    assert sum(a.nbytes for a in calls[1] if a.output in (2, 3, 4)) == 3 * (E + lnc) * F * D * dtype.itemsize
    # the forward's saved gT, uT (outputs 1, 2): [F, slots] each, live until the backward
    assert [a.shape[0] for a in calls[0] if a.output in (1, 2)] == [F, F]


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="workbench/kernels/buffers.py"):
        buffers.hbm_allocations(autograd.slot_granule, 1, ())
