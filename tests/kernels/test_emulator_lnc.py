"""The emulator's LNC grid, core barrier, race detection, dynamic loops, registers, counters and new rules.

Each rule is shown catching a deliberately wrong kernel; each feature is checked against numpy on a right one.
"""

import numpy as np
import pytest

from workbench.kernels import nki_emulator as nki
from workbench.kernels.nki_emulator import NkiRuleError, counters

nl, nisa = nki.language, nki.isa
RNG = np.random.default_rng(1)


@pytest.fixture(autouse=True)
def _plain_calls_at_lnc1(monkeypatch):
    """A plain kernel(...) call takes its LNC from NEURON_LOGICAL_NC_CONFIG; these tests mean LNC 1 by it."""
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)


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


def test_lnc2_split_with_barrier_matches_numpy():
    x = rand(8, 6)
    got = split_rows_then_swap[2](x)
    expected = np.concatenate([x[:4] + x[4:], x[4:] + x[:4]])
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(split_rows_then_swap(x), 2 * x)  # LNC 1: one core, its own half twice


def test_plain_call_takes_lnc_from_environment(monkeypatch):
    x = rand(8, 6)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    np.testing.assert_array_equal(split_rows_then_swap(x), np.concatenate([x[:4] + x[4:], x[4:] + x[:4]]))
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "3")
    with raises("lnc-grid"):
        split_rows_then_swap(x)


def test_program_id_and_num_programs():
    @nki.jit
    def ids(x):
        out = nl.ndarray((1, 2), dtype=nl.float32, buffer=nl.shared_hbm)
        tile = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=tile, value=float(10 * nl.program_id(0) + nl.num_programs(0)))
        nisa.dma_copy(dst=out[0:1, nl.program_id(0):nl.program_id(0) + 1], src=tile)
        if nl.num_programs(0) == 1:
            nisa.dma_copy(dst=out[0:1, 1:2], src=tile)
        return out

    np.testing.assert_array_equal(ids[2](rand(1, 1)), [[2.0, 12.0]])
    np.testing.assert_array_equal(ids(rand(1, 1)), [[1.0, 1.0]])


def test_race_both_cores_write_same_output_names_both_instructions():
    @nki.jit
    def naive(x):  # no work split: kernel[2] makes both cores do everything
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=load(x))
        return out

    np.testing.assert_array_equal(naive(np.ones((2, 2), np.float32)), np.ones((2, 2)))
    with raises("lnc-race", "core 0: dma_copy at test_emulator_lnc.py:\\d+ writes.*core 1: dma_copy at "
                "test_emulator_lnc.py:\\d+ writes"):
        naive[2](np.ones((2, 2), np.float32))


def test_race_read_of_other_cores_write_without_barrier():
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


def test_race_on_unwritten_scratch_names_both_instructions():
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


def test_barrier_rules():
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

    with raises("lnc-barrier", "LNC 1"):
        barrier_at_lnc1(rand(1, 1))
    with raises("lnc-barrier", "number of nisa.core_barrier calls"):
        only_core0_waits[2](rand(1, 1))


def test_private_memory_shared_alloc_and_grid_rules():
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

    with raises("lnc-private-memory", "core 1 touches nl.sbuf"):
        peeks_at_core0_sbuf[2](rand(2, 2))
    with raises("lnc-shared-alloc"):
        mismatched_shared[2](rand(1, 1))
    with raises("kernel-output", "shared_hbm"):
        private_output(rand(2, 2))
    with raises("lnc-grid"):
        private_output[4](rand(2, 2))
    with raises("lnc-grid"):
        axis1(rand(1, 1))


# -- dynamic loops and registers -------------------------------------------------------------------------------------
@nki.jit
def rows_up_to_count(x, count):
    """out[i] = 2 * x[i] for i < count (count read at run time), zero elsewhere; one traced body."""
    out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    zero = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=zero, value=0.0)
    nisa.dma_copy(dst=out, src=zero)
    n = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=n, src=count)
    reg = nisa.register_alloc()
    nisa.register_load(reg, n)
    for i in nl.dynamic_range(reg):
        row = nl.ndarray((1, x.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=x.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], offset=0, scalar_offset=i,
                                         indirect_dim=0))
        nisa.tensor_scalar(dst=row, data=row, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=out.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], offset=0, scalar_offset=i,
                                 indirect_dim=0), src=row)
    return out


@pytest.mark.parametrize("count", [0, 3, 7])
def test_dynamic_range_traced_once_runs_runtime_count(count):
    x = rand(7, 5)
    with counters() as c:
        got = rows_up_to_count(x, np.array([[count]], dtype=np.int32))
    expected = np.where(np.arange(7)[:, None] < count, 2 * x, 0)
    np.testing.assert_array_equal(got, expected)
    # static program: memset, 3 dma_copy, register_load, the loop, and its body (2 dma_copy + tensor_scalar) once
    assert c.static == {"vector": 2, "dma": 4, "register": 1, "control": 1}
    executed = {"vector": 1 + count, "dma": 2 + 2 * count, "register": 1, "control": count}
    assert c.executed == {k: v for k, v in executed.items() if v}
    assert list(c.loop_trips.values()) == [count]


def test_nested_dynamic_loops_with_register_bound():
    @nki.jit
    def nested(x):
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        acc = nl.ndarray((1, x.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        bound = nisa.register_alloc(3)
        for i in nl.dynamic_range(0, x.shape[0], 2):  # rows 0, 2
            nisa.memset(dst=acc, value=0.0)
            for _j in nl.dynamic_range(bound):
                row = nl.ndarray((1, x.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=row, src=x.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], offset=0,
                                                 scalar_offset=i, indirect_dim=0))
                nisa.tensor_tensor(dst=acc, data1=acc, data2=row, op=nl.add)
            nisa.dma_copy(dst=out.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], offset=0, scalar_offset=i,
                                     indirect_dim=0), src=acc)
            nisa.dma_copy(dst=out.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], offset=x.shape[1],
                                     scalar_offset=i, indirect_dim=0), src=acc)
        return out

    x = rand(4, 3)
    with counters() as c:
        got = nested(x)
    np.testing.assert_allclose(got, np.repeat(3 * x[::2], 2, axis=0), rtol=1e-6)
    assert c.static_total == 1 + 1 + 1 + 1 + 2 + 2  # register_move, 2 loops, memset, body dma+add, 2 stores
    assert c.executed["dma"] == 2 * 3 + 2 * 2


def test_register_in_python_control_flow_is_a_type_error():
    @nki.jit
    def branches_on_register(x):
        reg = nisa.register_alloc(1)
        if reg:
            pass
        return x

    with pytest.raises(TypeError, match="VirtualRegister"):
        branches_on_register(rand(1, 1))


def test_dynamic_range_step_must_be_static_int():
    @nki.jit
    def register_step(x):
        reg = nisa.register_alloc(1)
        for _i in nl.dynamic_range(0, 4, reg):
            pass
        return x

    with raises("dynamic-range-bounds"):
        register_step(rand(1, 1))


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
    def break_in_dynamic_loop(x):
        for _i in nl.dynamic_range(2):
            break
        return x

    for kernel, what in ((comprehension, "list comprehension"), (enumerate_tuple_target, "not a single name"),
                         (lambda_inside, "lambda"), (try_inside, "try"),
                         (calls_bad_helper, "_helper_with_comprehension.*list comprehension"),
                         (break_in_dynamic_loop, "break inside an nl.dynamic_range")):
        with raises("nki-python-subset", what):
            kernel(rand(1, 1))


def test_python_subset_rejects_undocumented_builtins():
    @nki.jit
    def uses_zip(x):
        for pair in zip([x], [x]):  # noqa: B007, B905 - the deliberate zip under test
            pass
        return x

    with raises("nki-python-subset", "builtin zip"):
        uses_zip(rand(1, 1))


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
        reg = nisa.register_alloc()
        for _i in nl.dynamic_range(reg):
            pass

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
