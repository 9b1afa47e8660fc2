"""The emulator's LNC grid, core barrier, race detection, compiled loops, registers, counters and new rules.

Each rule is shown catching a deliberately wrong kernel; each feature is checked against numpy on a right one.
The compiler's LNC is 1 in these tests (tests/kernels/conftest.py) unless a test sets it with `compiled_for`.
"""

import warnings

import numpy as np
import pytest

from workbench.kernels import nki_emulator as nki
from workbench.kernels.nki_emulator import NkiRuleError, counters, version

nl, nisa = nki.language, nki.isa
RNG = np.random.default_rng(1)


@pytest.fixture
def compiled_for(monkeypatch):
    """compiled_for(n): NEURON_LOGICAL_NC_CONFIG=n, the compiler's LNC a launch must match (NKI >= 0.7.0)."""
    return lambda lnc: monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", str(lnc))


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def raises(rule: str, match: str = ""):
    return pytest.raises(NkiRuleError, match=rf"\[{rule}\].*{match}")


def load(src):
    tile = nl.ndarray(src.shape, dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src)
    return tile


# -- LNC grid, shared HBM, barrier -----------------------------------------------------------------------------------
@nki.jit
def split_rows_then_swap(x):
    """Core c copies rows [c*h, (c+1)*h) of x into `half`; after the barrier each core adds the other core's half."""
    n, h = nl.num_programs(0), x.shape[0] // nl.num_programs(0)
    c = nl.program_id(0)
    half = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm, name="half")
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm, name="out")
    nisa.dma_copy(dst=half[c * h:(c + 1) * h, 0:x.shape[1]], src=load(x[c * h:(c + 1) * h, 0:x.shape[1]]))
    if n > 1:
        nisa.core_barrier(data=half, cores=(0, 1))
    other = (c + 1) % n
    mine = load(half[c * h:(c + 1) * h, 0:x.shape[1]])
    theirs = load(half[other * h:(other + 1) * h, 0:x.shape[1]])
    total = nl.ndarray(mine.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=total, data1=mine, data2=theirs, op=nl.add)
    nisa.dma_copy(dst=out[c * h:(c + 1) * h, 0:x.shape[1]], src=total)
    return out


def test_lnc2_split_with_barrier_matches_numpy(compiled_for):
    x = rand(8, 6)
    np.testing.assert_array_equal(split_rows_then_swap(x), 2 * x)  # LNC 1: one core, its own half twice
    compiled_for(2)
    got = split_rows_then_swap[2](x)
    expected = np.concatenate([x[:4] + x[4:], x[4:] + x[:4]])
    np.testing.assert_array_equal(got, expected)


def test_plain_call_takes_lnc_from_environment(compiled_for):
    x = rand(8, 6)
    compiled_for(2)
    np.testing.assert_array_equal(split_rows_then_swap(x), np.concatenate([x[:4] + x[4:], x[4:] + x[:4]]))
    compiled_for(3)
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG='3'.*supports 1 or 2"):
        split_rows_then_swap(x)


def test_launch_grid_must_equal_the_compilers_lnc(monkeypatch, compiled_for):
    """NKI 0.7.0: the compiler rejects a kernel whose LNC differs from its own (NCC_EVRF066), which is
    NEURON_LOGICAL_NC_CONFIG, 2 on trn2 when unset; a plain kernel(...) runs at that variable, 1 when unset."""
    x = rand(8, 6)
    with raises("lnc-degree", "runs at LNC 1 .*launched as kernel\\[1\\].* compiler at LNC 2 "
                "\\(NEURON_LOGICAL_NC_CONFIG=2\\).*export NEURON_LOGICAL_NC_CONFIG=1"):
        compiled_for(2)
        split_rows_then_swap[1](x)
    with raises("lnc-degree", "runs at LNC 2 .* compiler at LNC 1"):
        compiled_for(1)
        split_rows_then_swap[2](x)
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    with raises("lnc-degree", "runs at LNC 1 .*without brackets.* compiler at LNC 2 .*unset: trn2's default"):
        split_rows_then_swap(x)
    np.testing.assert_array_equal(split_rows_then_swap[2](x), np.concatenate([x[:4] + x[4:], x[4:] + x[:4]]))
    with version.rules_of("0.6.0"):  # before 0.7.0 the mismatch went unchecked
        np.testing.assert_array_equal(split_rows_then_swap[1](x), 2 * x)


def test_program_id_and_num_programs(compiled_for):
    @nki.jit
    def ids(x):
        out = nl.ndarray((1, 2), dtype=nl.float32, buffer=nl.shared_hbm)
        tile = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=tile, value=float(10 * nl.program_id(0) + nl.num_programs(0)))
        nisa.dma_copy(dst=out[0:1, nl.program_id(0):nl.program_id(0) + 1], src=tile)
        if nl.num_programs(0) == 1:
            nisa.dma_copy(dst=out[0:1, 1:2], src=tile)
        return out

    np.testing.assert_array_equal(ids(rand(1, 1)), [[1.0, 1.0]])
    compiled_for(2)
    np.testing.assert_array_equal(ids[2](rand(1, 1)), [[2.0, 12.0]])


def test_race_both_cores_write_same_output_names_both_instructions(compiled_for):
    @nki.jit
    def naive(x):  # no work split: kernel[2] makes both cores do everything
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=load(x))
        return out

    np.testing.assert_array_equal(naive(np.ones((2, 2), np.float32)), np.ones((2, 2)))
    compiled_for(2)
    with raises("lnc-race", "core 0: dma_copy at test_emulator_lnc.py:\\d+ writes.*core 1: dma_copy at "
                "test_emulator_lnc.py:\\d+ writes"):
        naive[2](np.ones((2, 2), np.float32))


def test_race_read_of_other_cores_write_without_barrier(compiled_for):
    compiled_for(2)

    @nki.jit
    def unfenced(x, half):
        c = nl.program_id(0)
        nisa.dma_copy(dst=half[c:c + 1, 0:2], src=load(x[c:c + 1, 0:2]))
        theirs = load(half[1 - c:2 - c, 0:2])  # the other core's row, with no barrier in between
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[c:c + 1, 0:2], src=theirs)
        return out

    with raises("lnc-race", "reads"):
        unfenced[2](rand(2, 2), rand(2, 2))


def test_race_on_unwritten_scratch_names_both_instructions(compiled_for):
    compiled_for(2)

    @nki.jit
    def unfenced_scratch(x):  # the exchange buffer is kernel scratch: core 0 reads core 1's row before it exists
        c = nl.program_id(0)
        half = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm, name="half")
        nisa.dma_copy(dst=half[c:c + 1, 0:2], src=load(x[c:c + 1, 0:2]))
        theirs = load(half[1 - c:2 - c, 0:2])
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[c:c + 1, 0:2], src=theirs)
        return out

    with raises("lnc-race", "core [01]: dma_copy at test_emulator_lnc.py:\\d+ writes element \\d+ of shared HBM "
                "tensor half that core [01]: dma_copy at test_emulator_lnc.py:\\d+ reads"):
        unfenced_scratch[2](rand(2, 2))


def test_barrier_rules(compiled_for):
    @nki.jit
    def barrier_at_lnc1(x):
        nisa.core_barrier(data=x, cores=(0, 1))
        return x

    @nki.jit
    def only_core0_waits(x):
        if nl.program_id(0) == 0:
            nisa.core_barrier(data=x, cores=(0, 1))
        out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        return out

    with version.rules_of("0.6.0"), raises("lnc-barrier", "LNC 1"):
        barrier_at_lnc1(rand(1, 1))
    # NKI 0.7.0 allows it (it waits for the paired physical core's own launch), which one emulated launch cannot model
    with pytest.raises(NotImplementedError, match="paired physical core's own kernel launch"):
        barrier_at_lnc1(rand(1, 1))
    compiled_for(2)
    with raises("lnc-barrier", "number of nisa.core_barrier calls"):
        only_core0_waits[2](rand(1, 1))


def test_private_memory_shared_alloc_and_grid_rules(compiled_for):
    stash = []

    @nki.jit
    def peeks_at_core0_sbuf(x):
        if nl.program_id(0) == 0:
            stash.append(load(x))
        nisa.core_barrier(data=x, cores=(0, 1))
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        if nl.program_id(0) == 1:
            nisa.dma_copy(dst=out, src=stash[0])
        return out

    @nki.jit
    def mismatched_shared(x):
        out = nl.ndarray((1 + nl.program_id(0), 1), dtype=nl.float32, buffer=nl.shared_hbm)
        return out

    @nki.jit
    def private_output(x):
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.hbm)
        nisa.dma_copy(dst=out, src=load(x))
        return out

    @nki.jit
    def axis1(x):
        nl.program_id(1)
        return x

    with raises("kernel-output", "shared_hbm"):
        private_output(rand(2, 2))
    compiled_for(2)
    with raises("lnc-private-memory", "core 1 touches nl.sbuf"):
        peeks_at_core0_sbuf[2](rand(2, 2))
    with raises("lnc-shared-alloc"):
        mismatched_shared[2](rand(1, 1))
    with raises("lnc-grid"):
        private_output[4](rand(2, 2))
    with raises("lnc-grid"):
        axis1(rand(1, 1))


# -- compiled loops and registers ------------------------------------------------------------------------------------
def row_view(t, reg):
    """Row `reg` (a register or scalar) of a 2-D HBM tensor."""
    return t.ap(pattern=[[t.shape[1], 1], [1, t.shape[1]]], offset=0, scalar_offset=reg, indirect_dim=0)


def load_register(count):
    n = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=n, src=count)
    reg = nisa.register_alloc()
    nisa.register_load(reg, n)
    return reg


def zeroed_output(x):
    """A shared HBM tensor shaped like x, all zeros."""
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    zero = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=zero, value=0.0)
    nisa.dma_copy(dst=out, src=zero)
    return out


def double_row(x, out, i):
    """out[i] = 2 * x[i] (i a register or scalar)."""
    row = nl.ndarray((1, x.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=row_view(x, i))
    nisa.tensor_scalar(dst=row, data=row, op0=nl.multiply, operand0=2.0)
    nisa.dma_copy(dst=row_view(out, i), src=row)


@nki.jit
def rows_up_to_count(x, count):
    """out[i] = 2 * x[i] for i < count (count read at run time), zero elsewhere; one traced body."""
    out = zeroed_output(x)

    def body(i):
        double_row(x, out, i)

    nl.fori_loop(0, load_register(count), body)
    return out


@pytest.mark.parametrize("count", [0, 3, 7])
def test_fori_loop_traced_once_runs_runtime_count(count):
    x = rand(7, 5)
    with counters() as c:
        got = rows_up_to_count(x, np.array([[count]], dtype=np.int32))
    expected = np.where(np.arange(7)[:, None] < count, 2 * x, 0)
    np.testing.assert_array_equal(got, expected)
    # static program: memset, 3 dma_copy, register_load, the loop, and its body (2 dma_copy + tensor_scalar) once
    assert c.static == {"vector": 2, "dma": 4, "register": 1, "control": 1}
    executed = {"vector": 1 + count, "dma": 2 + 2 * count, "register": 1, "control": count}
    assert c.executed == {k: v for k, v in executed.items() if v}
    assert list(c.loop_trips.values()) == [count] and list(c.loop_trips_per_core.values()) == [[count]]


def test_nested_fori_loops_with_register_bound_and_step():
    @nki.jit
    def nested(x):
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        acc = nl.ndarray((1, x.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        bound = nisa.register_alloc(3)

        def outer(i):  # rows 0, 2
            nisa.memset(dst=acc, value=0.0)

            def inner(_j):
                row = nl.ndarray((1, x.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=row, src=row_view(x, i))
                nisa.tensor_tensor(dst=acc, data1=acc, data2=row, op=nl.add)

            nl.fori_loop(0, bound, inner)
            nisa.dma_copy(dst=row_view(out, i), src=acc)
            nisa.dma_copy(dst=out.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], offset=x.shape[1], scalar_offset=i,
                                     indirect_dim=0), src=acc)

        nl.fori_loop(0, x.shape[0], outer, step=2)
        return out

    x = rand(4, 3)
    with counters() as c:
        got = nested(x)
    np.testing.assert_allclose(got, np.repeat(3 * x[::2], 2, axis=0), rtol=1e-6)
    assert c.static_total == 1 + 1 + 1 + 1 + 2 + 2  # register_move, 2 loops, memset, body dma+add, 2 stores
    assert c.executed["dma"] == 2 * 3 + 2 * 2


def test_fori_loop_value_is_passed_by_value():
    """Writing to the iteration register changes that iteration's value, never the loop: all 4 trips run."""

    @nki.jit
    def overwrite(x):
        out = zeroed_output(x)
        one = nl.ndarray((1, x.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=one, value=1.0)
        acc = nl.ndarray((1, x.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=acc, value=0.0)

        def body(i):
            nisa.register_move(i, 1)  # the body's copy only
            nisa.tensor_tensor(dst=acc, data1=acc, data2=one, op=nl.add)
            nisa.dma_copy(dst=row_view(out, i), src=acc)

        nl.fori_loop(0, nisa.register_alloc(4), body)
        return out

    with counters() as c:
        got = overwrite(rand(5, 2))
    np.testing.assert_array_equal(got[:, 0], [0, 4, 0, 0, 0])  # 4 trips, each storing to row 1
    assert list(c.loop_trips.values()) == [4]


def test_fori_loop_iteration_value_kinds():
    """A register bound gives a VirtualRegister, int bounds an NkiScalar (NKI 0.7.0); neither has a Python
    value, and NkiScalar arithmetic is outside the emulated subset."""
    seen = []

    @nki.jit
    def kinds(x, use):
        nl.fori_loop(0, nisa.register_alloc(1), lambda_free_append)
        nl.fori_loop(0, 2, lambda_free_append)
        if use == "if":
            nl.fori_loop(0, 2, branches)
        if use == "add":
            nl.fori_loop(0, 2, adds)
        return x

    def lambda_free_append(i):
        seen.append(type(i).__name__)

    def branches(i):
        if i:
            pass

    def adds(i):
        return row_view(i + 1, 0)

    kinds(rand(1, 1), "")
    assert seen == ["VirtualRegister", "NkiScalar"]
    with pytest.raises(TypeError, match="NkiScalar: its value exists only on device"):
        kinds(rand(1, 1), "if")
    with pytest.raises(NotImplementedError, match="NkiScalar arithmetic is outside the emulated subset"):
        kinds(rand(1, 1), "add")


def test_fori_loop_rules():
    def register_step(x):
        nl.fori_loop(0, 4, lambda_free_noop, step=nisa.register_alloc(1))

    def zero_step(x):
        nl.fori_loop(0, 4, lambda_free_noop, step=0)

    def bound_past_32_bits(x):
        nl.fori_loop(0, 2**31, lambda_free_noop)

    def float_bound(x):
        nl.fori_loop(0, 4.0, lambda_free_noop)

    def body_returns_state(x):
        nl.fori_loop(0, 4, lambda_free_carry)

    for body, rule, what in ((register_step, "loop-bounds", "step must be a compile-time positive int"),
                             (zero_step, "loop-bounds", "step must be a compile-time positive int"),
                             (bound_past_32_bits, "loop-bounds", "does not fit 32 bits"),
                             (float_bound, "loop-bounds", "must be a Python int, a VirtualRegister"),
                             (body_returns_state, "loop-body", "returns None; carry loop state through SBUF/HBM")):
        with raises(rule, what):
            nki.jit(body)(rand(1, 1))


def lambda_free_noop(i):
    pass


def lambda_free_carry(i):
    return 0


@nki.jit
def countdown(x, start):
    """out[0] = start * 1 by a while_loop that decrements a condition register held in SBUF."""
    out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    acc = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)
    left = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=left, src=start)
    cond = nisa.register_alloc()
    nisa.register_load(cond, left)
    step = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=step, value=1.0)

    def body(r):
        nisa.tensor_tensor(dst=acc, data1=acc, data2=step, op=nl.add)
        nisa.tensor_scalar(dst=left, data=left, op0=nl.subtract, operand0=1)
        nxt = nisa.register_alloc()
        nisa.register_load(nxt, left)
        return nxt

    nl.while_loop(cond, body)
    nisa.dma_copy(dst=out, src=acc)
    return out


@pytest.mark.parametrize("start", [0, 1, 5])
def test_while_loop_runs_while_its_register_is_nonzero(start):
    with counters() as c:
        got = countdown(rand(1, 1), np.array([[start]], dtype=np.int32))
    np.testing.assert_array_equal(got, [[float(start)]])  # checked before each iteration: 0 never runs the body
    assert list(c.loop_trips.values()) == [start]
    assert c.static["control"] == 1 and c.executed.get("control", 0) == start


def test_while_loop_rules():
    def int_init(x):
        nl.while_loop(1, lambda_free_noop)

    def body_returns_no_register(x):
        nl.while_loop(nisa.register_alloc(0), lambda_free_carry)

    for body, what in ((int_init, "init must be a condition register"),
                       (body_returns_no_register, "must return the register holding the next condition")):
        with raises("loop-bounds" if body is int_init else "loop-body", what):
            nki.jit(body)(rand(1, 1))


# The loop forms NKI 0.7.0 removed (NKI Migration Guides, "Migrating from NKI 0.6.0 to NKI 0.7.0").
@nki.jit
def old_style_rows(x, count):
    """rows_up_to_count as written for NKI <= 0.6: `for i in nl.dynamic_range(reg)`."""
    out = zeroed_output(x)
    for i in nl.dynamic_range(load_register(count)):
        double_row(x, out, i)
    return out


def test_dynamic_range_is_refused_naming_its_replacement():
    x, count = rand(7, 5), np.array([[3]], dtype=np.int32)
    with raises("api-removed", "test_emulator_lnc.py:\\d+ in old_style_rows: nl.dynamic_range was removed in NKI "
                "0.7.0.*nl.fori_loop\\(lower, upper, body_fun, step=1\\).*nki/migration/index.html"):
        old_style_rows(x, count)
    with version.rules_of("0.6.0"), pytest.warns(DeprecationWarning, match="deprecated in NKI 0.6.0"):
        got = old_style_rows(x, count)  # as its authors ran it: deprecated, still a compiled loop
    np.testing.assert_array_equal(got, np.where(np.arange(7)[:, None] < 3, 2 * x, 0))
    with version.rules_of("0.4.0"), warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(old_style_rows(x, count), got)


def test_dynamic_range_refused_when_traced_past_the_source_check():
    """A helper reached through an attribute (not checked before tracing) still meets the rule at its call."""

    class Helpers:
        loop = staticmethod(lambda_free_dynamic_range)

    @nki.jit
    def via_attribute(x):
        Helpers.loop(2)
        return x

    with raises("api-removed", "nl.dynamic_range was removed in NKI 0.7.0.*nl.fori_loop"):
        via_attribute(rand(1, 1))


def lambda_free_dynamic_range(n):
    for _i in nl.dynamic_range(n):
        pass


def test_bare_while_on_a_register_is_refused_naming_while_loop():
    @nki.jit
    def bare_while(x):
        reg = nisa.register_alloc(1)
        while reg:
            nisa.register_move(reg, 0)
        return x

    with raises("api-removed", "`while <register>:` at test_emulator_lnc.py:\\d+ was removed in NKI 0.7.0.*"
                "nl.while_loop\\(init_register, body_fun\\).*migration"):
        bare_while(rand(1, 1))
    with version.rules_of("0.6.0"), pytest.raises(NotImplementedError, match="outside the emulated subset"):
        bare_while(rand(1, 1))


def test_compiled_loops_need_nki_0_6():
    with version.rules_of("0.5.0"), raises("api-version", "nl.fori_loop arrived in NKI 0.6.0"):
        rows_up_to_count(rand(2, 2), np.array([[1]], dtype=np.int32))


def test_static_range_iterators_are_python_range():
    """NKI 0.7: affine_range, sequential_range and static_range are deprecated and default to Python range."""
    for args in ((5,), (2, 9), (2, 9, 3), (0, 5, 2)):
        for it in (nl.affine_range, nl.sequential_range, nl.static_range):
            assert it(*args) == range(*args)
    assert nl.affine_range(5, step=2) == range(0, 5, 2)


def test_register_in_python_control_flow_is_a_type_error():
    @nki.jit
    def branches_on_register(x):
        reg = nisa.register_alloc(1)
        if reg:
            pass
        return x

    with pytest.raises(TypeError, match="VirtualRegister"):
        branches_on_register(rand(1, 1))


# -- the same control flow on both cores ----------------------------------------------------------------------------
@nki.jit
def per_core_rows(x, bounds):
    """Core c copies rows [bounds[c, 0], bounds[c, 1]) of x: a runtime trip count of its own."""
    c = nl.program_id(0)
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)

    def body(i):
        row = nl.ndarray((1, x.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=row_view(x, i))
        nisa.dma_copy(dst=row_view(out, i), src=row)

    nl.fori_loop(load_register(bounds[c:c + 1, 0:1]), load_register(bounds[c:c + 1, 1:2]), body)
    return out


def test_same_trip_counts_on_both_cores_pass(compiled_for):
    compiled_for(2)
    x = rand(8, 3)
    with counters() as c:
        np.testing.assert_array_equal(per_core_rows[2](x, np.array([[0, 4], [4, 8]], dtype=np.int32)), x)
    assert list(c.loop_trips_per_core.values()) == [[4, 4]]


def test_divergent_trip_counts_name_the_loop_and_both_counts(compiled_for):
    compiled_for(2)
    with raises("lnc-divergent-control", "fori_loop at test_emulator_lnc.py:\\d+ runs 5 iterations on core 0 but 3 "
                "on core 1.*same compiled control flow"):
        per_core_rows[2](rand(8, 3), np.array([[0, 5], [5, 8]], dtype=np.int32))


def test_a_compiled_loop_on_one_core_only_diverges(compiled_for):
    @nki.jit
    def core0_loops(x):
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        c = nl.program_id(0)
        nisa.dma_copy(dst=out[c:c + 1, 0:x.shape[1]], src=load(x[c:c + 1, 0:x.shape[1]]))
        if c == 0:  # a Python branch on the core id around a compiled loop
            nl.fori_loop(0, 2, lambda_free_noop)
        return out

    compiled_for(2)
    with raises("lnc-divergent-control", "core 0 runs fori_loop at test_emulator_lnc.py:\\d+ \\(2 iterations\\) "
                "where core 1 runs no further compiled loop"):
        core0_loops[2](rand(2, 3))


@nki.jit
def swap_rows_each_iteration(x):
    """AWS's pattern (one shared trip count, a barrier inside the loop): per row pair i, core c stages row
    2i + c, then after the barrier writes the other core's staged row to out row 2i + c."""
    c = nl.program_id(0)
    stage = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm, name="stage")
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    mine = nl.ndarray((1, x.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
    theirs = nl.ndarray((1, x.shape[1]), dtype=nl.float32, buffer=nl.sbuf)

    def body(i):  # i = 2 * pair: rows i and i + 1
        nisa.dma_copy(dst=mine, src=x.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], offset=c * x.shape[1],
                                         scalar_offset=i, indirect_dim=0))
        nisa.dma_copy(dst=stage.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], offset=c * x.shape[1],
                                   scalar_offset=i, indirect_dim=0), src=mine)
        nisa.core_barrier(data=stage, cores=(0, 1))
        nisa.dma_copy(dst=theirs, src=stage.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]],
                                               offset=(1 - c) * x.shape[1], scalar_offset=i, indirect_dim=0))
        nisa.dma_copy(dst=out.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], offset=c * x.shape[1],
                                 scalar_offset=i, indirect_dim=0), src=theirs)

    nl.fori_loop(0, x.shape[0], body, step=2)
    return out


def test_core_barrier_inside_a_compiled_loop(compiled_for):
    compiled_for(2)
    x = rand(6, 4)
    with counters() as c:
        got = swap_rows_each_iteration[2](x)
    np.testing.assert_array_equal(got, x.reshape(3, 2, 4)[:, ::-1].reshape(6, 4))
    assert c.static["sync"] == 1 and c.executed["sync"] == 2 * 3  # one traced barrier, run per core per trip
# -- the NKI Python subset ---------------------------------------------------------------------------------------------
def _helper_with_comprehension(x):
    return [x for _ in range(2)]


def test_python_subset_rejects_undocumented_constructs():
    @nki.jit
    def comprehension(x):
        tiles = [load(x) for _ in range(2)]
        return tiles

    @nki.jit
    def enumerate_tuple_target(x):
        for i, t in enumerate([x]):  # noqa: B007 - the deliberate tuple target under test
            pass
        return x

    @nki.jit
    def lambda_inside(x):
        f = lambda t: t  # noqa: E731
        return f(x)

    @nki.jit
    def try_inside(x):
        try:
            pass
        except ValueError:
            pass
        return x

    @nki.jit
    def calls_bad_helper(x):
        return _helper_with_comprehension(x)

    @nki.jit
    def break_in_dynamic_loop(x):  # a rule of NKI <= 0.6 (0.7.0 removed nl.dynamic_range)
        for _i in nl.dynamic_range(2):
            break
        return x

    # The subset is a rule of NKI 0.6.0 and older: NKI 0.7.0 specializes with full Python (below).
    for kernel, what in ((comprehension, "list comprehension"), (enumerate_tuple_target, "not a single name"),
                         (lambda_inside, "lambda"), (try_inside, "try"),
                         (calls_bad_helper, "_helper_with_comprehension.*list comprehension")):
        with version.rules_of("0.6.0"), raises("nki-python-subset", what):
            kernel(rand(1, 1))
    with version.rules_of("0.6.0"), raises("nki-python-subset", "break inside an nl.dynamic_range"):
        break_in_dynamic_loop(rand(1, 1))


def test_full_python_during_specialization_from_nki_0_7():
    """NKI 0.7.0 traces kernels with Python: comprehensions, generators, lambdas, zip/enumerate, classes
    ("Announcing changes to NKI specialization", Neuron 2.33). The same kernel is refused under 0.6.0 rules."""
    class Rows:
        def __init__(self, x):
            self.parts = [x[i:i + 2, :] for i in range(0, x.shape[0], 2)]

    @nki.jit
    def copy_by_halves(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        tiles = (load(part) for part in Rows(x).parts)  # a generator over a class's list comprehension
        dst = lambda i: out[2 * i:2 * i + 2, :]  # noqa: E731 - a lambda, allowed from 0.7
        for i, tile in enumerate(tiles):
            nisa.dma_copy(dst=dst(i), src=tile)
        return out

    x = rand(6, 4)
    np.testing.assert_array_equal(copy_by_halves(x), x)
    with version.rules_of("0.6.0"), raises("nki-python-subset", "not a single name"):
        copy_by_halves(x)


def test_python_subset_rejects_undocumented_builtins():
    @nki.jit
    def uses_zip(x):
        for pair in zip([x], [x]):  # noqa: B007, B905 - the deliberate zip under test
            pass
        return x

    with version.rules_of("0.6.0"), raises("nki-python-subset", "builtin zip"):
        uses_zip(rand(1, 1))
    uses_zip(rand(1, 1))  # NKI 0.7.0: full Python


# -- PSUM banks, operand rules, API drift ------------------------------------------------------------------------------
def test_psum_small_tiles_still_take_a_bank_each():
    @nki.jit
    def nine_small_psum_tiles(x):
        keep = []
        for _ in range(9):  # 9 x 4 B would fit a 16 KiB pool; 9 banks do not exist
            keep.append(nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.psum))
        return x

    with raises("psum-capacity", "8 of 8 banks"):
        nine_small_psum_tiles(rand(1, 1))


def test_operand_rules_and_api_drift():
    def matmul_mix(x):
        a = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        b = nl.ndarray((4, 4), dtype=nl.bfloat16, buffer=nl.sbuf)
        acc = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=a, moving=b, accumulate=False)

    def bf16_vector_operand(x):
        t = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        v = nl.ndarray((4, 1), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=v)

    def scalar_offset_2x1(x):
        off = nl.ndarray((2, 1), dtype=nl.int32, buffer=nl.sbuf)
        x.ap(pattern=[[1, 1], [1, 1]], offset=0, scalar_offset=off, indirect_dim=0)

    def vector_offset_on_sbuf(x):
        t = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        idx = nl.ndarray((4, 1), dtype=nl.int32, buffer=nl.sbuf)
        t.ap(pattern=[[4, 4], [1, 4]], offset=0, vector_offset=idx, indirect_dim=0)

    def vector_offset_dim1(x):
        idx = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        x.ap(pattern=[[1, 1], [1, 1]], offset=0, vector_offset=idx, indirect_dim=1)

    def dma_rmw(x):
        t = load(x)
        nisa.dma_copy(dst=x, src=t, dst_rmw_op=nl.add)

    def activation_engine(x):
        t = load(x)
        nisa.activation(dst=t, op=nl.sigmoid, data=t, engine=nisa.engine.scalar)

    for body, rule in ((matmul_mix, "matmul-dtype-mix"), (bf16_vector_operand, "tensor-scalar-operand-dtype"),
                       (scalar_offset_2x1, "scalar-offset-shape"), (vector_offset_on_sbuf, "vector-offset"),
                       (vector_offset_dim1, "vector-offset"), (dma_rmw, "api-drift"),
                       (activation_engine, "api-drift")):
        with raises(rule):
            nki.jit(body)(rand(1, 1))


def test_dma_compute_scatter_add():
    @nki.jit
    def scatter_add(table, rows, upd):
        out = nl.ndarray(table.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=load(table))
        idx = load(rows)
        view = out.ap(pattern=[[table.shape[1], rows.shape[0]], [1, table.shape[1]]], offset=0, vector_offset=idx,
                      indirect_dim=0)
        nisa.dma_compute(dst=view, srcs=[view, load(upd)], reduce_op=nl.add)
        return out

    table, upd = rand(6, 3), rand(2, 3)
    rows = np.array([[4], [1]], dtype=np.int32)
    expected = table.copy()
    expected[[4, 1]] += upd
    np.testing.assert_allclose(scatter_add(table, rows, upd), expected, rtol=1e-6)


# -- counters ----------------------------------------------------------------------------------------------------------
def test_counters_dma_sizes_and_pe_flops():
    @nki.jit
    def matmul(a, b):
        acc = nl.ndarray((a.shape[1], b.shape[1]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=load(a), moving=load(b), accumulate=False)
        res = nl.ndarray(acc.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=res, src=acc)
        out = nl.ndarray(acc.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=res)
        t_psum = nl.ndarray((acc.shape[1], acc.shape[0]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=t_psum, data=res)  # SBUF -> PSUM: Tensor Engine
        return out

    a, b = rand(16, 8), rand(16, 32)
    with counters() as c:
        np.testing.assert_allclose(matmul[1](a, b), a.T @ b, rtol=1e-5, atol=1e-5)
    assert c.pe_transpose_flops == 2 * 8 * 8 * 32
    assert c.pe_flops == 2 * 16 * 8 * 32 + c.pe_transpose_flops
    assert c.dma_count == 3 and c.dma_bytes == 4 * (16 * 8 + 16 * 32 + 8 * 32)
    assert [s[:2] for s in c.dma_sizes] == [(16 * 8 * 4, 8 * 4), (16 * 32 * 4, 32 * 4), (8 * 32 * 4, 32 * 4)]
    assert c.executed == {"dma": 3, "tensor": 2, "vector": 1} and c.static == c.executed


def test_register_and_dma_compute_rules():
    def unset_register_as_bound(x):
        nl.fori_loop(0, nisa.register_alloc(), lambda_free_noop)

    def register_load_from_fp32(x):
        nisa.register_load(nisa.register_alloc(), load(x))

    def dma_compute_multiply(x):
        t = load(x)
        nisa.dma_compute(dst=t, srcs=[t, t], reduce_op=nl.multiply)

    def dma_compute_scaled(x):
        t = load(x)
        nisa.dma_compute(dst=t, srcs=[t, t], reduce_op=nl.add, scales=[1.0, 2.0])

    for body, rule in ((unset_register_as_bound, "register-uninitialized"),
                       (register_load_from_fp32, "register-operand"), (dma_compute_multiply, "dma-compute-op"),
                       (dma_compute_scaled, "dma-compute-op")):
        with raises(rule):
            nki.jit(body)(rand(1, 1))


def test_counters_gathered_and_padding_rows_and_sbuf_peak():
    """Row gathers (vector_offset DMAs) count the rows they read and how many of them are all zero (the padding
    rows a blockwise kernel computes on); sbuf_peak is the high-water mark of live SBUF bytes per partition."""

    @nki.jit
    def gather(x, idx):
        index = load(idx)
        rows = nl.ndarray((idx.shape[0], x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows, src=x.ap(pattern=[[x.shape[1], idx.shape[0]], [1, x.shape[1]]], offset=0,
                                         vector_offset=index, indirect_dim=0))
        extra = nl.ndarray((4, 64), dtype=nl.float32, buffer=nl.sbuf)  # 256 B/partition more, live with `rows`
        nisa.memset(dst=extra, value=0.0)
        out = nl.ndarray(rows.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=rows)
        return out

    x = rand(5, 8)
    x[4] = 0.0  # the zero row padding slots point at
    idx = np.array([[0], [4], [2], [4], [4], [1]], dtype=np.int32)
    with counters() as c:
        np.testing.assert_array_equal(gather[1](x, idx), x[idx[:, 0]])
    assert c.gathered_rows == {"arg0": 6} and c.padding_rows == {"arg0": 3}
    assert c.sbuf_peak == 8 * 4 + 64 * 4  # rows (fp32 [6, 8]) + extra; index is dead after the gather reads it
