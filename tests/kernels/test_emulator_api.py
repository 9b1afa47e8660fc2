"""The NKI API added for nki-library's kernels: each op against a numpy/torch definition from its doc page, and each
new refusal on a deliberately wrong kernel. Our own small kernels: CI has no nki-library checkout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.kernels.test_nki_emulator import bf16_round, evict, load, raises, store
from workbench.core.neuron_env import compiled_for_lnc
from workbench.kernels import nki_emulator as nki
from workbench.kernels.nki_emulator import NkiRuleError, conformance, counters, timing
from workbench.kernels.nki_emulator import isa as nisa
from workbench.kernels.nki_emulator import language as nl


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def run(body, *arrays, lnc=1):
    with compiled_for_lnc(lnc):  # the compiler's LNC equals the launch's (NKI >= 0.7.0)
        return nki.jit(body)[lnc](*arrays)


def run_costed(kernel, *args):
    """`run` under the counters, asserting that every instruction it issued has a cost in the trn2 time model.

    Returns:
        (the kernel's outputs, the (engine, instruction) pairs it issued).
    """
    with counters() as c:
        out = run(kernel, *args)
    assert timing.model(c).unmodeled == {}
    return out, {(eng, op) for (_, eng, op, _), _ in c.work.items()}


# -- dtypes ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [nl.int8, nl.uint8, nl.int16, nl.uint16, nl.uint32, nl.int32])
def test_integer_tiles_hold_integers_exactly(dtype):
    info = torch.iinfo(dtype)
    top = min(info.max, 2**24)  # the largest integer fp32 holds exactly
    values = np.array([[info.min, 0, 1, top]], dtype=np.float32)

    def kernel(x):
        tile = nl.ndarray((1, 4), dtype=dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=tile, src=load(x))  # fp32 -> int store of integral values
        return store(tile, nl.float32)

    np.testing.assert_array_equal(run(kernel, values), values)


def test_float8_e5m2_and_e4m3fn_round_like_their_torch_types():
    x = rand(4, 8)

    def kernel(a):
        tile = a
        for dtype in (nl.float8_e5m2, nl.float8_e4m3fn):
            tile = load(tile if tile is a else store(tile), dtype)
        return store(tile, nl.float32)

    want = torch.from_numpy(x).to(torch.float8_e5m2).float().to(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(run(kernel, x), want)


def _e4m3_reference(x: float) -> float:
    """IEEE 754 rounding (nearest, ties to even) of x to 1-4-3 bits, bias 7, written independently of the
    emulator: enumerate the finite values by their fields, pick the nearest, an exact tie to the even mantissa;
    past 240 + half its spacing (16 / 2) the result overflows to inf."""
    if math.isnan(x):
        return math.nan
    grid = [(m * 2.0**-9, m) for m in range(8)] + [((1 + m / 8) * 2.0 ** (e - 7), m) for e in range(1, 15)
                                                   for m in range(8)]
    a = abs(x)
    if a >= 248:
        return math.copysign(math.inf, x)
    best = min(grid, key=lambda vm: (abs(vm[0] - a), vm[1] % 2))  # nearest; a tie goes to the even mantissa
    return math.copysign(best[0], x)


E4M3_EDGES = [240.0, 239.0, 232.0, 244.0, 247.99, 248.0, 1000.0, -248.0, 2.0**-6, 2.0**-9, 7 * 2.0**-9, 2.0**-10,
              1.5 * 2.0**-10, 3 * 2.0**-10, 0.0, -0.0, 1.0625, 1.1875, 17.0, 19.0, float("inf"), float("nan")]


def test_float8_e4m3_is_trn2s_ieee_e4m3_bit_exactly():
    """nl.float8_e4m3 (trn2's IEEE-style e4m3, max 240): every store rounds like the reference above. Edges: max 240
    (239 and 244 round to it, 244 < 248; 232, a tie between 224 and 240, to 224), 248 (a tie between 240 and 256)
    and beyond overflow to inf, min normal 2^-6, subnormals 2^-9 .. 7 * 2^-9, 2^-10 (a tie between 0 and 2^-9: to
    0), ties at 1.0625 -> 1.0 and 1.1875 -> 1.25 (even mantissas), 17 -> 16, 19 -> 20; NaN stays NaN; all 256 bit
    patterns decode as IEEE."""
    x = np.array([E4M3_EDGES], dtype=np.float32)

    def kernel(a):
        fp8 = load(a, nl.float8_e4m3)  # the DMA casts fp32 -> e4m3
        twice = nl.ndarray(a.shape, dtype=nl.float8_e4m3, buffer=nl.sbuf)
        nisa.tensor_copy(dst=twice, src=fp8)  # e4m3 -> e4m3 is exact
        return store(twice, nl.float32)

    got = run(kernel, x)[0]
    want = np.array([_e4m3_reference(float(v)) for v in x[0]], dtype=np.float32)
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[E4M3_EDGES.index(0.0) + 1]) and got.tolist()[:8] == [240, 240, 224, 240, 240, float("inf"),
                                                                            float("inf"), float("-inf")]
    table = nki.dtypes.E4M3_VALUES
    assert table[0x77] == 240 and table[0x08] == 2.0**-6 and table[0x01] == 2.0**-9 and table[0xF8] == -math.inf
    assert math.isnan(table[0x79]) and math.isnan(table[0xFF])
    assert table[0x80] == 0 and math.copysign(1, table[0x80]) < 0
    bits = nki.dtypes.e4m3_bits(table[~torch.isnan(table)])  # every finite/infinite pattern encodes back to itself
    assert bits.tolist() == [b for b in range(256) if not math.isnan(table[b])]


def test_float8_e5m2_is_ieee_e5m2_bit_exactly():
    """nl.float8_e5m2 (bias 15, max 57344, inf, NaN), stored as torch's float8_e5m2: the same edges against the same
    kind of independent reference (57344 + 4096 = 61440 ties to inf; 2^-17 ties to 0; 2^-16 the smallest)."""
    edges = [57344.0, 61439.0, 61440.0, 1e6, 2.0**-14, 2.0**-16, 2.0**-17, 1.5 * 2.0**-17, 2.5 * 2.0**-16, 0.0,
             1.125, 1.375, -3.0, float("inf"), float("nan")]

    def reference(v):
        if math.isnan(v):
            return math.nan
        grid = [(m * 2.0**-16, m) for m in range(4)] + [((1 + m / 4) * 2.0 ** (e - 15), m) for e in range(1, 31)
                                                        for m in range(4)]
        if abs(v) >= 61440:
            return math.copysign(math.inf, v)
        return math.copysign(min(grid, key=lambda vm: (abs(vm[0] - abs(v)), vm[1] % 2))[0], v)

    def kernel(a):
        return store(load(a, nl.float8_e5m2), nl.float32)

    got = run(kernel, np.array([edges], dtype=np.float32))[0]
    np.testing.assert_array_equal(got, np.array([reference(v) for v in edges], dtype=np.float32))


def test_unmodelled_dtypes_and_lossy_int_stores_raise_not_implemented():
    def fp8_e4m3_tile(_):
        nl.ndarray((2, 2), dtype=nl.tfloat32, buffer=nl.sbuf)

    def fractional_into_int(x):
        tile = nl.ndarray(x.shape, dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=tile, src=load(x))

    with pytest.raises(NotImplementedError, match="tfloat32"):
        run(fp8_e4m3_tile, rand(2, 2))
    with pytest.raises(NotImplementedError, match="float-to-int"):
        run(fractional_into_int, np.full((2, 2), 0.5, dtype=np.float32))
    assert nki.dtype is torch.dtype and isinstance(nl.tfloat32, nki.dtypes.Unmodelled)


# -- language ---------------------------------------------------------------------------------------------------------
def test_ds_ellipsis_and_reshape_views():
    x = rand(4, 6)

    def kernel(a):
        tile = load(a)
        out = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[..., nl.ds(0, 3)], src=tile[:, nl.ds(3, 3)])  # t[..., ds] == t[:, 0:3]
        nisa.dma_copy(dst=out[nl.ds(0, 4), 3:6], src=tile[..., 0:3])
        return out

    np.testing.assert_array_equal(run(kernel, x), np.concatenate([x[:, 3:], x[:, :3]], axis=1))

    def reshape_then_ap(a):  # a whole reshaped HBM tensor takes an access pattern: column 1 of a (12, 2) view
        tile = nl.ndarray((1, 12), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=a.reshape((12, 2)).ap(pattern=[[1, 1], [2, 12]], offset=1))
        return store(tile)

    np.testing.assert_array_equal(run(reshape_then_ap, x), x.reshape(12, 2)[:, 1][None])

    def reshape_partitions(a):
        load(a).reshape((8, 3))

    with pytest.raises(NotImplementedError, match="partition dim"):
        run(reshape_partitions, x)


def test_nkiobject_takes_keyword_fields_and_program_grid():
    class Dims(nl.NKIObject):
        a: int
        b: int

    d = Dims(a=3)
    assert d.a == 3 and not hasattr(d, "b")

    def kernel(x):
        out = nl.ndarray((1, 2), dtype=nl.int32, buffer=nl.shared_hbm)
        tile = nl.ndarray((1, 2), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=tile[0:1, 0:1], value=nl.num_programs(axes=0))
        nisa.memset(dst=tile[0:1, 1:2], value=nl.program_ndim())
        if nl.program_id(0) == 0:
            nisa.dma_copy(dst=out, src=tile)
        return out

    np.testing.assert_array_equal(run(kernel, rand(1, 1), lnc=2), [[2, 1]])


def test_shared_identity_matrix_is_an_initialised_sbuf_constant():
    def kernel(_):
        return store(nl.shared_identity_matrix(5, dtype=nl.float32))

    np.testing.assert_array_equal(run(kernel, rand(1, 1)), np.eye(5))


# -- isa: element-wise and reductions ------------------------------------------------------------------------------
@pytest.mark.parametrize("op, ref", [(nl.minimum, np.minimum), (nl.equal, np.equal), (nl.less, np.less),
                                     (nl.greater_equal, np.greater_equal), (nl.divide, np.divide),
                                     (nl.logical_and, np.logical_and)])
def test_new_tensor_tensor_ops(op, ref):
    a, b = rand(4, 5), rand(4, 5, seed=1)
    b[0] = a[0]  # equal elements for the comparisons

    def kernel(x, y):
        tile = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=tile, data1=load(x), data2=load(y), op=op)
        return store(tile)

    np.testing.assert_allclose(run(kernel, a, b), ref(a, b).astype(np.float32), rtol=1e-6)


@pytest.mark.parametrize("op, ref", [
    (nl.exp, np.exp), (nl.copy, lambda x: x), (nl.rsqrt, lambda x: 1 / np.sqrt(np.abs(x) + 1)),
    (nl.silu, lambda x: x / (1 + np.exp(-x))), (nl.gelu_apprx_sigmoid, lambda x: x / (1 + np.exp(-1.702 * x))),
    (nl.square, np.square)])
def test_new_activation_functions(op, ref):
    x = rand(4, 6)
    data = np.abs(x) + 1 if op is nl.rsqrt else x

    def kernel(a):
        tile = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=tile, op=op, data=load(a))
        return store(tile)

    np.testing.assert_allclose(run(kernel, data), ref(x).astype(np.float32), rtol=1e-5, atol=1e-6)


def test_scalar_tensor_tensor_reciprocal_and_predicated_copy():
    x, y, v = rand(4, 6), rand(4, 6, seed=1), rand(4, 1, seed=2)
    pred = (rand(4, 6, seed=3) > 0).astype(np.uint8)

    def kernel(a, b, s, p):
        ta, tb = load(a), load(b)
        stt = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=stt, data=ta, op0=nl.multiply, operand0=load(s), op1=nl.subtract,
                                  operand1=tb, reverse1=True)  # b - a * s
        rec = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=rec, data=tb)
        nisa.tensor_copy_predicated(dst=ta, src=rec, predicate=load(p))  # where(p, 1/b, a)
        out = nl.ndarray((2, 4, 6), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[0], src=stt)
        nisa.dma_copy(dst=out[1], src=ta)
        return out

    out, _ = run_costed(kernel, x, y, v, pred)
    np.testing.assert_allclose(out[0], y - x * v, rtol=1e-6)
    np.testing.assert_allclose(out[1], np.where(pred != 0, 1 / y, x), rtol=1e-6)


def test_tensor_reduce_scan_max8_find_index8():
    x = rand(4, 2, 16)

    def kernel(a):
        t = load(a)
        out = nl.ndarray((4, 35), dtype=nl.float32, buffer=nl.shared_hbm)
        s = nl.ndarray((4, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=s, op=nl.add, data=t, axis=2)  # sum over the last free axis
        m = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=m, op=nl.maximum, data=t, axis=(1, 2), negate=True)
        scan = nl.ndarray((4, 16), dtype=nl.float32, buffer=nl.sbuf)
        ones = nl.ndarray((4, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=ones, value=1.0)  # r[i] = 1 * r[i-1] + x[i]: a cumulative sum
        nisa.tensor_tensor_scan(dst=scan, data0=ones, data1=t[:, 0, :], initial=0.0, op0=nl.multiply, op1=nl.add)
        top = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=top, src=t)
        idx = nl.ndarray((4, 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=idx, data=t, vals=top)
        idx_f = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=idx_f, src=idx)
        parts = ((s, 0, 2), (m, 2, 1), (scan, 3, 16), (top, 19, 8), (idx_f, 27, 8))
        for k in range(len(parts)):
            nisa.dma_copy(dst=out[:, parts[k][1]:parts[k][1] + parts[k][2]], src=parts[k][0])
        return out

    out, _ = run_costed(kernel, x)
    flat = x.reshape(4, 32)
    top8 = -np.sort(-flat, axis=1)[:, :8]
    np.testing.assert_allclose(out[:, 0:2], x.sum(axis=2), rtol=1e-5)
    np.testing.assert_allclose(out[:, 2], -flat.max(axis=1), rtol=1e-6)
    np.testing.assert_allclose(out[:, 3:19], np.cumsum(x[:, 0, :], axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[:, 19:27], top8)
    np.testing.assert_array_equal(out[:, 27:35], np.argsort(-flat, axis=1, kind="stable")[:, :8])


def test_bn_stats_over_slices_then_bn_aggr_give_the_rows_mean_and_variance():
    x = rand(4, 1100) * 3 + 1  # 512 + 512 + 76 elements per partition: three bn_stats, the last one short and odd

    def kernel(a):
        t = load(a)
        stats = nl.ndarray((4, 18), dtype=nl.float32, buffer=nl.sbuf)
        for j in range(3):
            nisa.bn_stats(dst=stats[:, 6 * j:6 * j + 6], data=t[:, 512 * j:min(1100, 512 * j + 512)])
        mv = nl.ndarray((4, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=mv, data=stats)
        out = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[:, 0:6], src=stats[:, 12:18])
        nisa.dma_copy(dst=out[:, 6:8], src=mv)
        return out

    out, _ = run_costed(kernel, x)
    last = x[:, 1024:]  # the third slice's stats: even elements, then odd
    for half, k in ((last[:, 0::2], 0), (last[:, 1::2], 3)):
        np.testing.assert_allclose(out[:, k], half.shape[1])
        np.testing.assert_allclose(out[:, k + 1], half.mean(1), rtol=1e-5)
        np.testing.assert_allclose(out[:, k + 2], half.var(1) * half.shape[1], rtol=1e-4)
    np.testing.assert_allclose(out[:, 6], x.mean(1), rtol=1e-5)
    np.testing.assert_allclose(out[:, 7], x.var(1), rtol=1e-4)  # population variance (ddof 0)

    def too_wide(a):
        stats = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.sbuf)
        nisa.bn_stats(dst=stats, data=load(a))

    with raises("bn-stats-fmax"):
        run(too_wide, x)


def test_iota_affine_select_nonzero_with_count():
    def kernel(a):
        pos = nl.ndarray((4, 2, 3), dtype=nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=pos, pattern=[[10, 2], [1, 3]], offset=5, channel_multiplier=100)
        tri = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.affine_select(dst=tri, pattern=[[-1, 4]], channel_multiplier=1, on_true_tile=load(a),
                           on_false_value=-9.0, cmp_op=nl.greater_equal)  # keep where p - i >= 0
        nz = nl.ndarray((32, 5), dtype=nl.float32, buffer=nl.sbuf)
        src = nl.ndarray((32, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=src, value=0.0)
        nisa.memset(dst=src[16:17, 1:2], value=3.0)
        nisa.memset(dst=src[16:17, 3:4], value=1.0)
        nisa.memset(dst=nz, value=7.0)
        nisa.nonzero_with_count(dst=nz, src=src, index_offset=10, padding_val=-1)
        out = nl.ndarray((3, 4, 6), dtype=nl.float32, buffer=nl.shared_hbm)
        pos_f = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=pos_f, src=pos)
        nisa.dma_copy(dst=out[0], src=pos_f)
        nisa.dma_copy(dst=out[1, :, 0:4], src=tri)
        nisa.dma_copy(dst=out[1, :, 4:6], src=tri[:, 0:2])
        nisa.dma_copy(dst=out[2, 0:2, 0:5], src=nz[15:17, :])
        nisa.dma_copy(dst=out[2, 0:2, 5:6], src=nz[0:2, 4:5])  # the count slot of partitions 0 and 1
        nisa.dma_copy(dst=out[2, 2:4, :], src=pos_f[0:2, :])
        return out

    a = rand(4, 4)
    out, _ = run_costed(kernel, a)
    want_pos = 5 + 100 * np.arange(4)[:, None, None] + 10 * np.arange(2)[None, :, None] + np.arange(3)[None, None]
    np.testing.assert_array_equal(out[0], want_pos.reshape(4, 6))
    np.testing.assert_array_equal(out[1, :, :4], np.where(np.tril(np.ones((4, 4))) > 0, a, -9.0))
    np.testing.assert_array_equal(out[2, 0, 0:5], [7, 7, 7, 7, 7])  # partition 15: not a GpSimd core's partition
    np.testing.assert_array_equal(out[2, 1, 0:5], [11, 13, -1, -1, 2])  # partition 16: indices + offset, count
    np.testing.assert_array_equal(out[2, 0:2, 5], [0, 7])  # partition 0 has no nonzeros; partition 1 untouched


def test_nc_stream_shuffle_and_dma_transpose():
    x = rand(64, 3)

    def kernel(a):
        t = load(a)
        dst = nl.ndarray((64, 3), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=dst, value=-1.0)
        mask = []
        for i in range(31):  # reverse each quadrant, keep its last partition
            mask.append(31 - i)
        mask.append(255)
        nisa.nc_stream_shuffle(dst=dst, src=t, shuffle_mask=mask)
        tr = nl.ndarray((3, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_transpose(dst=tr, src=a)
        out = nl.ndarray((2, 64, 3), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[0], src=dst)
        back = nl.ndarray((64, 3), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_transpose(dst=back, src=tr)
        nisa.dma_copy(dst=out[1], src=back)
        return out

    out, _ = run_costed(kernel, x)
    want = np.full((64, 3), -1.0, dtype=np.float32)
    for p in range(64):
        if p % 32 != 31:
            want[p] = x[32 * (p // 32) + 31 - p % 32]
    np.testing.assert_array_equal(out[0], want)
    np.testing.assert_array_equal(out[1], x)


def test_oob_skip_skips_rows_and_vector_offset_may_be_an_access_pattern():
    table = rand(5, 4)

    def kernel(t, rows):
        idx = load(rows)  # (1, 3) int32: the indices as one partition's free elements
        col = nl.ndarray((3, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_transpose(dst=col, src=idx)
        dst = nl.ndarray((3, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=dst, value=-1.0)
        nisa.dma_copy(dst=dst, src=t.ap(pattern=[[4, 3], [1, 4]], offset=0, indirect_dim=0,
                                        vector_offset=col.ap(pattern=[[1, 3], [1, 1]])),
                      oob_mode=nisa.oob_mode.skip)
        return store(dst)

    out = run(kernel, table, np.array([[2, 7, 0]], dtype=np.int32))
    np.testing.assert_array_equal(out, np.stack([table[2], np.full(4, -1.0), table[0]]))

    def error_mode(t, rows):
        idx = load(rows)
        col = nl.ndarray((3, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_transpose(dst=col, src=idx)
        dst = nl.ndarray((3, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=dst, src=t.ap(pattern=[[4, 3], [1, 4]], offset=0, vector_offset=col, indirect_dim=0))

    with raises("index-bounds"):
        run(error_mode, table, np.array([[2, 7, 0]], dtype=np.int32))


def test_dma_moves_equal_element_counts_in_row_major_order():
    x = rand(3, 2)

    def kernel(a):
        out = nl.ndarray((2, 3), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=a)
        return out

    np.testing.assert_array_equal(run(kernel, x), x.reshape(2, 3))


# -- isa: an elementwise op fused with a reduction (nki-library's rmsnorm_quant) -----------------------------------
def test_activation_reduce_sums_the_fp32_activation_over_the_free_dims():
    # dst = square(x * scale + bias) stored as bf16; reduce_res = the fp32 sum over both free dims (before dst's
    # rounding: the engine reduces what it computes)
    x, s = rand(4, 2, 6) * 3, rand(4, 1, seed=1)

    def kernel(a, sc):
        dst = nl.ndarray((4, 2, 6), dtype=nl.bfloat16, buffer=nl.sbuf)
        total = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=dst, op=nl.square, data=load(a), reduce_op=nl.add, reduce_res=total,
                               bias=0.5, scale=load(sc))
        out = nl.ndarray((4, 13), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[:, 0:12], src=dst)
        nisa.dma_copy(dst=out[:, 12:13], src=total)
        return out

    out, issued = run_costed(kernel, x, s)
    assert ("scalar", "activation_reduce") in issued
    y = (x * s[:, :, None] + np.float32(0.5)) ** 2
    np.testing.assert_array_equal(out[:, :12], bf16_round(y.reshape(4, 12)))
    np.testing.assert_allclose(out[:, 12], y.reshape(4, 12).sum(1), rtol=1e-6)
    assert not np.allclose(out[:, 12], bf16_round(y.reshape(4, 12)).sum(1), rtol=1e-6, atol=0)

    def max_reduce(a):
        t = load(a)
        total = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=t, op=nl.copy, data=t, reduce_op=nl.maximum, reduce_res=total)

    def wide_result(a):
        t = load(a)
        total = nl.ndarray((4, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=t, op=nl.copy, data=t, reduce_op=nl.add, reduce_res=total)

    with raises("reduce-op"):
        run(max_reduce, x)
    with raises("reduce-res-shape"):
        run(wide_result, x)


def test_tensor_scalar_reduce_abs_max_and_the_other_reduce_ops():
    x, v = rand(4, 3, 5), rand(4, 1, seed=1)

    def kernel(a, b):
        t = load(a)
        mag = nl.ndarray((4, 3, 5), dtype=nl.bfloat16, buffer=nl.sbuf)
        out = nl.ndarray((4, 18), dtype=nl.float32, buffer=nl.shared_hbm)
        r = nl.ndarray((4, 3), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=mag, data=t, op0=nl.abs, operand0=0.0, reduce_op=nl.maximum,
                                  reduce_res=r[:, 0:1])  # nki-library's rmsnorm_quant absmax
        scaled = nl.ndarray((4, 3, 5), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=scaled, data=t, op0=nl.multiply, operand0=load(b), reduce_op=nl.add,
                                  reduce_res=r[:, 1:2], reduce_res_negate=True)
        nisa.tensor_scalar_reduce(dst=scaled, data=t, op0=nl.add, operand0=1.0, reduce_op=nl.minimum,
                                  reduce_res=r[:, 2:3])
        also = nl.ndarray((4, 15), dtype=nl.float32, buffer=nl.sbuf)  # nl.abs: still an activation, and a
        nisa.activation(dst=also[:, 0:10], op=nl.abs, data=t[:, 0:2, :])  # tensor_scalar op with operand None
        nisa.tensor_scalar(dst=also[:, 10:15], data=t[:, 2, :], op0=nl.abs, operand0=None, op1=nl.add, operand1=1.0)
        nisa.dma_copy(dst=out[:, 0:15], src=also)
        nisa.dma_copy(dst=out[:, 15:18], src=r)
        return out

    out, issued = run_costed(kernel, x, v)
    assert ("vector", "tensor_scalar_reduce") in issued
    flat = x.reshape(4, 15)
    np.testing.assert_array_equal(out[:, 0:10], np.abs(flat[:, :10]))
    np.testing.assert_array_equal(out[:, 10:15], np.abs(flat[:, 10:]) + 1)
    np.testing.assert_array_equal(out[:, 15], np.abs(flat).max(1))
    np.testing.assert_allclose(out[:, 16], -(flat * v).sum(1), rtol=1e-5)
    np.testing.assert_allclose(out[:, 17], (flat + 1).min(1), rtol=1e-6)

    def call(**kw):
        def kernel(a):
            t = load(a)
            r = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.sbuf)
            args = {"dst": t, "data": t, "op0": nl.abs, "operand0": 0.0, "reduce_op": nl.maximum, "reduce_res": r}
            args.update(kw)
            nisa.tensor_scalar_reduce(**args)
        return kernel

    with raises("unary-operand"):  # "Must be None or 0 when op0 is a unary operator (e.g., nl.abs)"
        run(call(operand0=2.0), x)
    with raises("reduce-op"):  # nl.abs is not a legal reduction op
        run(call(reduce_op=nl.abs), x)
    with raises("reduce-rank"):
        run(call(), rand(4, 1, 2, 2, 2))
    with pytest.raises(NotImplementedError, match="reduce_cmd"):
        run(call(reduce_cmd=nisa.reduce_cmd.reduce), x)

    def abs_between_tensors(a):
        t = load(a)
        nisa.tensor_tensor(dst=t, data1=t, data2=t, op=nl.abs)

    with pytest.raises(NotImplementedError, match="unary ALU op"):
        run(abs_between_tensors, x)


def test_new_reductions_carry_poison_to_their_partitions_result_only():
    x = rand(4, 6)

    def kernel(a, which):
        t = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.sbuf, name="partly")
        nisa.dma_copy(dst=t[0:3, :], src=a[0:3, :])
        nisa.dma_copy(dst=t[3:4, 0:5], src=a[3:4, 0:5])  # element (3, 5) is never written
        dst = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.sbuf)
        r = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.sbuf)
        if which == "scalar":
            nisa.activation_reduce(dst=dst, op=nl.copy, data=t, reduce_op=nl.add, reduce_res=r)
        else:
            nisa.tensor_scalar_reduce(dst=dst, data=t, op0=nl.abs, operand0=0.0, reduce_op=nl.maximum, reduce_res=r)
        return dst, r

    for which, ref in (("scalar", x), ("vector", np.abs(x))):
        def clean_part(a, which=which):  # everything but element (3, 5) and partition 3's reduction
            dst, r = kernel(a, which)
            out = nl.ndarray((4, 7), dtype=nl.float32, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out[0:3, 0:6], src=dst[0:3, :])
            nisa.dma_copy(dst=out[3:4, 0:5], src=dst[3:4, 0:5])  # the poisoned partition's clean elements
            nisa.dma_copy(dst=out[3:4, 5:6], src=dst[0:1, 5:6])  # (filler)
            nisa.dma_copy(dst=out[0:3, 6:7], src=r[0:3, :])
            nisa.dma_copy(dst=out[3:4, 6:7], src=r[0:1, :])  # (filler)
            return out

        out = run(clean_part, x)
        np.testing.assert_array_equal(out[0:3, 0:6], ref[0:3])
        np.testing.assert_array_equal(out[3, 0:5], ref[3, 0:5])
        np.testing.assert_allclose(out[0:3, 6], ref[0:3].sum(1) if which == "scalar" else ref[0:3].max(1),
                                   rtol=1e-6)

        def poisoned_row(a, which=which):
            _, r = kernel(a, which)
            return store(r)

        with pytest.raises(NkiRuleError, match=r"\[uninitialized-read\] .* holds 1 of 4 .*partly \(nl.sbuf"):
            run(poisoned_row, x)


# -- reinterpret casts and fp8 bits ---------------------------------------------------------------------------------
E4M3_NAN_BYTES = list(range(0x79, 0x80)) + list(range(0xF9, 0x100))


@pytest.mark.parametrize("fp8", [nl.float8_e4m3, nl.float8_e5m2])
def test_fp8_data_movements_copy_every_bit_pattern(fp8):
    # all 256 byte patterns (e4m3 NaNs 0x79-0x7F / 0xF9-0xFF among them) through an HBM -> SBUF -> HBM -> SBUF
    # round trip of fp8 DMAs and an fp8 -> fp8 tensor_copy: every byte arrives unchanged (e4m3 used to decode and
    # re-encode, collapsing its NaNs into 0x7F / 0xFF; e5m2, torch's own type, was already moved as bytes)
    bits = np.arange(256, dtype=np.uint8).reshape(1, 256)

    def kernel(raw):
        a = nl.ndarray((1, 256), dtype=fp8, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=raw.ap(pattern=[[256, 1], [1, 256]], dtype=fp8))
        hbm = nl.ndarray((1, 256), dtype=fp8, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=hbm, src=a)
        b = load(hbm)
        c = nl.ndarray((1, 256), dtype=fp8, buffer=nl.sbuf)
        nisa.tensor_copy(dst=c, src=b)
        out = nl.ndarray((1, 256), dtype=nl.uint8, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=c.ap(pattern=[[256, 1], [1, 256]], dtype=nl.uint8))
        return out

    np.testing.assert_array_equal(run(kernel, bits), bits)


def test_ap_dtype_reinterprets_fp32_bytes_as_fp8_exactly():
    # rmsnorm_quant's scale store: a (P, 1) fp32 tile viewed as P x 4 fp8 bytes ([[4, P], [1, 4]]) and DMA'd into
    # fp8 HBM. Values chosen so that their bytes hold e4m3 NaN patterns (0x7A, 0xFA, 0x7F, 0xFF).
    scales = np.frombuffer(bytes([0x10, 0x7A, 0xFA, 0x3C, 0x7F, 0x00, 0x80, 0x3F, 0xFF, 0xF9, 0x01, 0x3D,
                                  0x00, 0x00, 0x79, 0x40]), dtype=np.float32).reshape(4, 1).copy()

    def kernel(s):
        t = load(s)
        packed = nl.ndarray((4, 4), dtype=nl.float8_e4m3, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=packed, src=t.ap(pattern=[[4, 4], [1, 4]], dtype=nl.float8_e4m3))
        out = nl.ndarray((4, 4), dtype=nl.uint8, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=packed.ap(pattern=[[4, 4], [1, 4]], dtype=nl.uint8))
        back = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.sbuf)  # and the other way: 4 fp8 as one fp32,
        nisa.dma_copy(dst=back.ap(pattern=[[4, 4], [1, 4]], dtype=nl.float8_e4m3), src=packed)  # written whole
        return out, store(back), packed

    out, back, packed = run(kernel, scales)
    np.testing.assert_array_equal(out, scales.view(np.uint8).reshape(4, 4))
    np.testing.assert_array_equal(back.view(np.uint32), scales.view(np.uint32))
    assert np.isnan(packed.reshape(-1)[np.isin(out.reshape(-1), E4M3_NAN_BYTES)]).all()

    def partial_write_of_unwritten(s):
        t = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t.ap(pattern=[[2, 4], [1, 1]], dtype=nl.bfloat16), src=s)  # 2 of each fp32's 4 bytes

    with pytest.raises(NotImplementedError, match="only some bytes"):
        run(partial_write_of_unwritten, np.zeros((4, 1), dtype=np.float32))

    def unwritten_bytes_are_poison(s):
        t = nl.ndarray((4, 2), dtype=nl.float32, buffer=nl.sbuf, name="half")
        nisa.dma_copy(dst=t[:, 0:1], src=s)
        packed = nl.ndarray((4, 8), dtype=nl.float8_e4m3, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=packed, src=t.ap(pattern=[[8, 4], [1, 8]], dtype=nl.float8_e4m3))
        return packed

    with pytest.raises(NkiRuleError, match=r"\[uninitialized-read\] .* holds 16 of 32 .*half \(nl.sbuf"):
        run(unwritten_bytes_are_poison, scales)

    def odd_bytes(s):
        t = nl.ndarray((4, 3), dtype=nl.uint8, buffer=nl.sbuf)
        t.ap(pattern=[[1, 4], [1, 1]], dtype=nl.float32)  # 3 bytes per partition: not a whole fp32

    def as_bool(s):
        load(s).ap(pattern=[[4, 4], [1, 4]], dtype=nl.bool_)

    def step_in_old_units(s):
        load(s).ap(pattern=[[1, 4], [1, 4]], dtype=nl.float8_e4m3)  # the partition step counts fp8 elements: 4

    for kernel, rule in ((odd_bytes, "ap-reinterpret"), (as_bool, "ap-reinterpret"),
                         (step_in_old_units, "ap-partition-contiguity")):
        with raises(rule):
            run(kernel, scales)


# -- isa: matmul modes ------------------------------------------------------------------------------------------------
def test_matmul_accumulate_none_opens_then_continues_a_group_and_is_transpose():
    a, b, c = rand(4, 3), rand(4, 5, seed=1), rand(4, 5, seed=2)

    def kernel(x, y, z):
        acc = nl.ndarray((3, 5), dtype=nl.float32, buffer=nl.psum)
        tx = load(x)
        nisa.nc_matmul(dst=acc, stationary=tx, moving=load(y))  # fresh PSUM: overwrites
        nisa.nc_matmul(dst=acc, stationary=tx, moving=load(z))  # last written by a matmul: accumulates
        tr = nl.ndarray((3, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=tr, stationary=tx, moving=nl.shared_identity_matrix(4, dtype=nl.float32),
                       is_transpose=True)
        out = nl.ndarray((3, 9), dtype=nl.float32, buffer=nl.shared_hbm)
        parts = ((acc, 0, 5), (tr, 5, 4))
        for k in range(2):
            s = nl.ndarray((3, parts[k][2]), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=s, src=parts[k][0])
            nisa.dma_copy(dst=out[:, parts[k][1]:parts[k][1] + parts[k][2]], src=s)
        return out

    out = run(kernel, a, b, c)
    np.testing.assert_allclose(out[:, 0:5], a.T @ b + a.T @ c, rtol=1e-5)
    np.testing.assert_array_equal(out[:, 5:9], a.T)


# -- rules ------------------------------------------------------------------------------------------------------------
def _padded_tokens(x):
    """A (4, 2) token tile of which only rows 0-2 are written (row 3: padding nobody wrote), the way AWS's
    blockwise_mm_bwd leaves a block's padding tokens."""
    tokens = nl.ndarray((2, 4), dtype=nl.float32, buffer=nl.sbuf, name="tokens")  # [hidden, token]: stationary
    nisa.dma_copy(dst=tokens[:, 0:3], src=x)
    return tokens


def test_poison_in_discarded_padding_rows_passes():
    # the matmul, elementwise ops and reductions all read the unwritten padding token (hardware reads whatever is
    # there); its poison stays in its own result row, which the kernel never stores: no error, exact values
    x, w = rand(2, 3), rand(2, 5, seed=1)

    def kernel(a, b):
        tokens = _padded_tokens(a)
        acc = nl.ndarray((4, 5), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=tokens, moving=load(b))
        act = nl.ndarray((4, 5), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=act, op=nl.silu, data=acc)
        total = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=total, op=nl.add, data=act, axis=1)
        scaled = nl.ndarray((4, 5), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=scaled, data=act, op0=nl.multiply, operand0=total)
        out = nl.ndarray((3, 5), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=scaled[0:3, :])  # the padding row is discarded
        return out

    h = x.T.astype(np.float64) @ w
    silu = h / (1 + np.exp(-h))
    np.testing.assert_allclose(run(kernel, x, w), silu * silu.sum(1, keepdims=True), rtol=1e-5)


def test_poison_reaching_an_output_names_its_allocation_and_line():
    x, w = rand(2, 3), rand(2, 5, seed=1)

    def matmul_row(a, b):  # the padding token's output row is stored too
        acc = nl.ndarray((4, 5), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=_padded_tokens(a), moving=load(b))
        return evict(acc)

    def moved_then_computed(a):  # moved along unwritten, then computed on, then returned
        copy = nl.ndarray((2, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=copy, src=_padded_tokens(a))
        twice = nl.ndarray((2, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=twice, data1=copy, data2=copy, op=nl.add)
        return store(twice)

    line = _padded_tokens.__code__.co_firstlineno + 3  # the nl.ndarray line
    where = rf"tokens \(nl.sbuf, \(2, 4\) float32\) allocated at test_emulator_api.py:{line}"
    with pytest.raises(NkiRuleError, match=rf"\[uninitialized-read\] kernel output .* holds 5 of 20 .*{where}"):
        run(matmul_row, x, w)
    with pytest.raises(NkiRuleError, match=rf"\[uninitialized-read\] kernel output .* holds 2 of 8 .*{where}"):
        run(moved_then_computed, x)


def test_poison_used_as_an_index_or_loop_bound_raises():
    def offset_from_garbage(x):
        rows = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="rows")
        copy = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=copy, src=rows)  # the unwritten offset moves along
        tile = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x.ap(pattern=[[4, 1], [1, 4]], scalar_offset=copy))

    def bound_from_garbage(x):
        count = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="count")
        reg = nisa.register_alloc()
        nisa.register_load(reg, count)

    for kernel, name in ((offset_from_garbage, "rows"), (bound_from_garbage, "count")):
        with pytest.raises(NkiRuleError, match=rf"\[uninitialized-read\] .* index, offset or loop bound .*{name} "
                           r"\(nl.sbuf"):
            run(kernel, rand(4, 4))


def test_partition_int_index_moves_by_dma_but_not_into_an_engine():
    def dma_ok(x):
        t = load(x)
        out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t[1, 0])
        return out

    np.testing.assert_array_equal(run(dma_ok, np.arange(4, dtype=np.float32).reshape(2, 2)), [[2.0]])

    def engine_refuses(x):
        t = load(x)
        nisa.tensor_copy(dst=t[0:1, 0:1], src=t[1, 0:1])

    with raises("partition-view"):
        run(engine_refuses, rand(2, 2))


def test_capacity_counts_tiles_until_their_last_use():
    def dead_tiles_free_space(_):
        for _ in range(3):  # each 200 KB tile is dead after its memset
            t = nl.ndarray((128, 50_000), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=t, value=0.0)
        return store(nl.shared_identity_matrix(1, dtype=nl.float32))

    with counters() as c:
        run(dead_tiles_free_space, rand(1, 1))
    assert c.sbuf_peak == 200_000

    def live_tiles_do_not(_):
        tiles = []
        for _ in range(2):
            tiles.append(nl.ndarray((128, 50_000), dtype=nl.float32, buffer=nl.sbuf))
            nisa.memset(dst=tiles[-1], value=0.0)
        for t in tiles:
            nisa.memset(dst=t, value=1.0)

    with raises("sbuf-capacity"):
        run(live_tiles_do_not, rand(1, 1))


def test_explicit_address_placement():
    def overlapping(_):
        a = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf, address=(0, 0))
        b = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf, address=(2, 16))  # bytes 16..47 overlap 0..31
        nisa.memset(dst=a, value=0.0)
        nisa.memset(dst=b, value=0.0)
        nisa.memset(dst=a, value=1.0)

    def disjoint(_):
        a = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf, address=(0, 0))
        b = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf, address=(4, 0))  # other partitions
        nisa.memset(dst=a, value=0.0)
        nisa.memset(dst=b, value=2.0)
        nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add)
        return store(a)

    def outside(_):
        nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf, address=(126, 0))

    with raises("tile-address"):
        run(overlapping, rand(1, 1))
    np.testing.assert_array_equal(run(disjoint, rand(1, 1)), np.full((4, 8), 2.0))
    with raises("tile-address"):
        run(outside, rand(1, 1))


def test_sendrecv_exchanges_between_the_two_cores():
    x = rand(2, 4)

    def kernel(a):
        core = nl.program_id(0)
        mine = load(a[core:core + 1, :])
        theirs = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - core, recv_from_rank=1 - core, pipe_id=0)
        out = nl.ndarray((2, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[core:core + 1, :], src=theirs)
        return out

    np.testing.assert_array_equal(run(kernel, x, lnc=2), x[::-1])

    def at_lnc1(a):
        t = load(a)
        nisa.sendrecv(src=t, dst=t, send_to_rank=1, recv_from_rank=1, pipe_id=0)

    with raises("sendrecv-operands"):
        run(at_lnc1, x)


def test_engine_selectors_constants_and_unemulated_instructions():
    assert nisa.vector_engine is nisa.engine.vector and nisa.get_nc_version() >= nisa.nc_version.gen3
    assert nisa.constants.oob_mode is nisa.oob_mode

    def quantize(x):
        nisa.quantize_mx(load(x))

    with pytest.raises(NotImplementedError, match="nisa.quantize_mx"):
        run(quantize, rand(2, 2))

    def bad_engine(x):
        t = load(x)
        nisa.tensor_copy(dst=t, src=t, engine="vector")

    with pytest.raises(TypeError, match="nisa.engine"):
        run(bad_engine, rand(2, 2))


def test_divmod_is_allowed_in_kernels():
    def kernel(x):
        q, r = divmod(x.shape[1], 3)
        out = nl.ndarray((1, 2), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=t[0:1, 0:1], value=float(q))
        nisa.memset(dst=t[0:1, 1:2], value=float(r))
        nisa.dma_copy(dst=out, src=t)
        return out

    np.testing.assert_array_equal(run(kernel, rand(1, 7)), [[2.0, 1.0]])


# -- the conformance command's own pieces (nki-library itself is not in CI) ---------------------------------------
def test_compare_is_nki_librarys_max_mode_allclose():
    ref = {"out": torch.tensor([10.0, -2.0, 0.0])}
    result = conformance.Result("k")
    conformance.compare({"out": torch.tensor([10.1, -2.0, 0.15])}, ref, rtol=0.02, atol=0.0, result=result)
    assert result.match and math.isclose(result.max_abs, 0.15, rel_tol=1e-5)  # 0.15 <= 0.02 * max|ref| = 0.2
    conformance.compare({"out": torch.tensor([10.0, -2.0, 0.25])}, ref, rtol=0.02, atol=0.0, result=result)
    assert not result.match


def test_aws_functions_defines_only_the_named_definitions(tmp_path):
    src = tmp_path / "helpers.py"
    src.write_text("import not_installed_anywhere\n\ndef double(x):\n    return 2 * x\n\ndef other():\n    pass\n")
    ns = conformance.aws_functions(src, ["double"], {})
    assert ns["double"](4) == 8 and "other" not in ns
    with pytest.raises(LookupError, match="missing"):
        conformance.aws_functions(src, ["missing"], {})


def test_conformance_cli_refuses_a_directory_that_is_not_nki_library(tmp_path, capsys):
    assert conformance.main(["--nki-library", str(tmp_path)]) == 2
    assert "aws-neuron/nki-library" in capsys.readouterr().err


def test_conformance_reports_races_and_lifts_capacity_without_hiding_them():
    def racy(x):  # both cores write the whole output: a write-write overlap with no barrier
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=load(x))
        return out

    x = rand(2, 4)
    with raises("lnc-race"):
        run(racy, x, lnc=2)
    found = []
    with nki.races_reported(found):
        np.testing.assert_array_equal(run(racy, x, lnc=2), x)
    assert len(found) == 1 and found[0].startswith("[lnc-race]")

    def nine_banks(_):
        banks = []
        for _ in range(9):
            banks.append(nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum))
            nisa.memset(dst=banks[-1], value=0.0)
        for bank in banks:
            nisa.memset(dst=bank, value=1.0)
        return store(nl.shared_identity_matrix(1, dtype=nl.float32))

    with counters() as c, nki.capacity_lifted():
        run(nine_banks, rand(1, 1))
    assert c.psum_peak == 9 * 2048
    with raises("psum-capacity"):  # lifted only inside the block
        run(nine_banks, rand(1, 1))


# -- what nki-library's tiling kernels (mlp_tkg, qkv_tkg, router_topk) need beyond the instructions ------------------
def test_an_access_pattern_slices_like_a_tensor():
    """A sliced access pattern picks the same elements as the same slice of the tensor (nki-library slices
    TensorView.get_view() results); an int keeps the partition dim of an on-chip view, drops any other."""
    x = rand(8, 12)

    def kernel(a):
        t = load(a)
        view = t.ap(pattern=[[12, 8], [1, 12]], offset=0)
        out = nl.ndarray((2, 3, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[0], src=view[2:5, nl.ds(4, 4)])
        row = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=row, src=view[6, 1:9:2])
        nisa.dma_copy(dst=out[1, 0:1], src=row)
        nisa.dma_copy(dst=out[1, 1:3], src=a.ap(pattern=[[12, 8], [1, 12]], offset=0)[..., 0:4][0:2])
        return out

    out = run(kernel, x)
    np.testing.assert_array_equal(out[0], x[2:5, 4:8])
    np.testing.assert_array_equal(out[1, 0], x[6, 1:9:2])
    np.testing.assert_array_equal(out[1, 1:3], x[0:2, 0:4])


def test_activation_with_a_reset_reduce_is_activation_reduce_and_kernels_may_return_lists():
    """`activation(reduce_op=nl.add, reduce_res=, reduce_cmd=reset_reduce)` (router_topk's softmax) sums the
    activated values per partition as `activation_reduce` does; a kernel returning a list (nki-library's
    wrappers do) returns its outputs in order; tensors given by keyword become HBM tensors too."""
    x = rand(4, 6)

    def kernel(a, b=None):
        t = load(b)
        e = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.sbuf)
        s = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e, op=nl.exp, data=t, reduce_op=nl.add, reduce_res=s,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        return [store(e), store(s)]

    with compiled_for_lnc(1):
        e, s = nki.jit(kernel)[1](x, b=x)
    np.testing.assert_allclose(e, np.exp(x), rtol=1e-6)
    np.testing.assert_allclose(s[:, 0], np.exp(x).sum(1), rtol=1e-5)
