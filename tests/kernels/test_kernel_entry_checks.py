"""The NKI MoE kernels check their arguments on entry (nki-library's kernels assert their constraints the same way):
a wrong dtype or a mismatched dimension stops the launch with a message naming the argument."""

import pytest
import torch

from workbench.core.errors import KernelArgumentError
from workbench.kernels import nki_moe, plan_blocks, route
from workbench.kernels.moe_reference import slot_weights
from workbench.kernels.nki_api import REAL_NKI
from workbench.kernels.nki_moe.tables import KernelPlan

pytestmark = pytest.mark.skipif(REAL_NKI, reason="launches the kernels on torch tensors through the emulator")

T, K, E, D, F = 6, 2, 4, 16, 24


def kernel_args(lnc):
    """Valid (forward args, backward args) of one small layer at LNC `lnc`, as `autograd` builds them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g)
    weights, ids = route(torch.randn(T, E, generator=g), K)
    w_gate, w_up = torch.randn(E, F, D, generator=g), torch.randn(E, F, D, generator=g)
    w_down = torch.randn(E, D, F, generator=g)
    plan = plan_blocks(ids, E, 8)
    kp = KernelPlan.from_plan(plan, E, lnc)
    weight = kp.slot_weights(slot_weights(weights, plan)).float().view(kp.token_index.shape)
    x_pad = torch.nn.functional.pad(x, (0, 0, 0, 1))
    fwd = [x_pad, kp.token_index, weight, *kp.forward_tables(), kp.row_of_slot, kp.top_k,
           w_gate.transpose(1, 2).contiguous(), w_up.transpose(1, 2).contiguous(), w_down.transpose(1, 2).contiguous()]
    _, g_saved, u_saved = nki_moe.moe_blockwise_fwd[lnc](*fwd)
    bwd = [x_pad, torch.randn_like(x_pad), kp.token_index, weight, *kp.backward_tables(), kp.row_of_slot, kp.top_k,
           g_saved, u_saved, w_down, w_gate, w_up]
    return fwd, bwd


FWD = ("x_pad", "token_index", "slot_weight", "piece", "seg_table", "seg_count", "row_of_slot", "top_k",
       "w_gate_t", "w_up_t", "w_down_t")
BWD = ("x_pad", "dout_pad", "token_index", "slot_weight", "piece", "seg_table", "seg_count", "sub_table",
       "zero_rows", "zero_count", "row_of_slot", "top_k", "g_saved", "u_saved", "w_down", "w_gate", "w_up")

# (kernel, argument, how it is made wrong, the message). LNC 1 except where the check is about the LNC: at LNC 2 a
# launch that fails on core 0 waits 5 s for the emulator's other core thread.
WRONG = [
    ("fwd", "token_index", lambda t: t.to(torch.int16), r"token_index must be \[NG, G\] torch.int32, got .* "
                                                         r"torch.int16"),
    ("fwd", "slot_weight", lambda t: t[:, :-1].contiguous(), r"slot_weight must be \[NG, G\] \(token_index's shape\)"),
    ("fwd", "w_gate_t", lambda t: t[:, :-1].contiguous(), r"w_gate_t must be \[E, D, F\] \(D of x_pad"),
    ("fwd", "w_down_t", lambda t: t.to(torch.bfloat16), r"w_down_t must be \[E, F, D\] torch.float32, got .* "
                                                        r"torch.bfloat16"),
    ("fwd", "piece", lambda t: t[:, :2].contiguous(), r"piece must be \[M, 13\] torch.int32, got \(\d+, 2\)"),
    ("bwd", "dout_pad", lambda t: t[:, :-1].contiguous(), r"dout_pad must be \[T\+1, D\] \(x_pad's shape"),
    ("bwd", "w_gate", lambda t: t[:, :, :-1].contiguous(), r"w_gate must be \[E, F, D\] \(D of x_pad"),
    ("bwd", "sub_table", lambda t: t[:, :-1].contiguous(), r"sub_table must be \[LNC \* S \* J, 11 \+ 2L\]"),
    ("bwd", "g_saved", lambda t: t.to(torch.bfloat16), r"g_saved must be \[F, NS\] torch.float32"),
    ("bwd", "zero_count", lambda t: t.view(1, 1, 1), r"zero_count must be \[1, 1\] torch.int32"),
    ("fwd", "row_of_slot", lambda t: t[:-1].contiguous(), r"row_of_slot must be \[NG, G\] \(token_index's shape\)"),
    ("bwd", "top_k", lambda k: 10 ** 6, r"top_k must be an int K >= 1 with T \* K <= NS"),
]
WRONG_AT_LNC2 = [
    ("bwd", "zero_rows", lambda t: t[:-1].contiguous(), r"zero_rows must be \[LNC \* n, 1\] at LNC 2"),
]


@pytest.fixture(scope="module")
def valid():
    """lnc -> the valid (forward, backward) arguments, built once per module."""
    built = {}
    with pytest.MonkeyPatch.context() as mp:
        for lnc in (1, 2):
            mp.setenv("NEURON_LOGICAL_NC_CONFIG", str(lnc))
            built[lnc] = kernel_args(lnc)
    return built


@pytest.mark.parametrize("lnc", [1, 2])
def test_valid_arguments_pass_the_entry_checks(valid, lnc, monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(lnc))
    fwd, bwd = valid[lnc]
    out = nki_moe.moe_blockwise_fwd[lnc](*fwd)[0]
    grads = nki_moe.moe_blockwise_bwd[lnc](*bwd)
    assert out.shape[-1] == D and torch.isfinite(out).all()
    assert [tuple(t.shape) for t in grads[2:]] == [(E + lnc, F, D), (E + lnc, F, D), (E + lnc, D, F)]


CASES = [(1, *case) for case in WRONG] + [(2, *case) for case in WRONG_AT_LNC2]


@pytest.mark.parametrize("lnc,kernel,name,spoil,message", CASES, ids=[f"{c[1]}-{c[2]}" for c in CASES])
def test_a_wrong_argument_fails_with_its_name(valid, lnc, kernel, name, spoil, message, monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(lnc))
    fwd, bwd = valid[lnc]
    launch, given, names = ((nki_moe.moe_blockwise_fwd, fwd, FWD) if kernel == "fwd" else
                            (nki_moe.moe_blockwise_bwd, bwd, BWD))
    wrong = list(given)
    i = names.index(name)
    wrong[i] = spoil(wrong[i])
    with pytest.raises(KernelArgumentError, match=message) as raised:  # raised, not asserted: python -O keeps it
        launch[lnc](*wrong)
    assert raised.value.argument in names
