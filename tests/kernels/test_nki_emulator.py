"""The NKI emulator: every emulated instruction against a direct numpy definition, every enforced rule raising.

Kernels here target the emulator explicitly (not the nki_api shim), so these tests mean the same on any host.
"""

import numpy as np
import pytest
import torch

from workbench.kernels import nki_emulator as nki
from workbench.kernels.nki_emulator import NkiRuleError

nl, nisa = nki.language, nki.isa
RNG = np.random.default_rng(0)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def bf16_round(a: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 -> fp32 with round-to-nearest-even, on the bit pattern."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def load(src, dtype=None, shape=None):
    tile = nl.ndarray(shape or src.shape, dtype=dtype or src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src)
    return tile


def store(tile, dtype=None):
    out = nl.ndarray(tile.shape, dtype=dtype or tile.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


def evict(psum_tile):
    tile = nl.ndarray(psum_tile.shape, dtype=psum_tile.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=tile, src=psum_tile)
    return store(tile)


def raises(rule: str):
    return pytest.raises(NkiRuleError, match=rf"\[{rule}\]")


# -- semantics ---------------------------------------------------------------------------------------------------------
def test_dma_roundtrip_and_bf16_rounding():
    @nki.jit
    def kernel(x):
        return store(load(x, dtype=nl.bfloat16), dtype=nl.float32)

    x = rand(16, 40) * 3
    np.testing.assert_array_equal(kernel(x), bf16_round(x))


def test_indirect_row_gather_and_runtime_expert_offset():
    @nki.jit
    def kernel(table, rows, w, expert):
        idx = load(rows)
        gathered = nl.ndarray((rows.shape[0], table.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=gathered, src=table.ap(pattern=[[table.shape[1], rows.shape[0]], [1, table.shape[1]]],
                                                 offset=0, vector_offset=idx, indirect_dim=0))
        e = load(expert)
        C = w.shape[2]
        tile = nl.ndarray((3, 4), dtype=nl.float32, buffer=nl.sbuf)  # w[e, 1:4, 2:6]
        nisa.dma_copy(dst=tile, src=w.ap(pattern=[[C, 3], [1, 4]], offset=1 * C + 2, scalar_offset=e,
                                         indirect_dim=0))
        return store(gathered), store(tile)

    table, w = rand(10, 7), rand(5, 6, 8)
    rows = np.array([[3], [0], [9], [3]], dtype=np.int32)
    got_rows, got_tile = kernel(table, rows, w, np.array([[2]], dtype=np.int32))
    np.testing.assert_array_equal(got_rows, table[rows[:, 0]])
    np.testing.assert_array_equal(got_tile, w[2, 1:4, 2:6])


def test_nc_matmul_and_accumulate():
    @nki.jit
    def kernel(a, b, c, d):
        acc = nl.ndarray((a.shape[1], b.shape[1]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=load(a, nl.bfloat16), moving=load(b, nl.bfloat16), accumulate=False)
        nisa.nc_matmul(dst=acc, stationary=load(c), moving=load(d), accumulate=True)
        return evict(acc)

    a, b, c, d = rand(128, 96), rand(128, 512), rand(64, 96), rand(64, 512)
    want = bf16_round(a).T.astype(np.float64) @ bf16_round(b) + c.T.astype(np.float64) @ d
    np.testing.assert_allclose(kernel(a, b, c, d), want, rtol=1e-5, atol=1e-4)


def test_nc_transpose_tensor_and_vector_engine():
    @nki.jit
    def kernel(x, small):
        staged = nl.ndarray((x.shape[1], x.shape[0]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=staged, data=load(x))
        sb = nl.ndarray((small.shape[1], small.shape[0]), dtype=nl.float32, buffer=nl.sbuf)
        nisa.nc_transpose(dst=sb, data=load(small))  # SBUF -> SBUF: Vector Engine, <= 32x32
        return evict(staged), store(sb)

    x, small = rand(100, 128), rand(32, 20)
    big_t, small_t = kernel(x, small)
    np.testing.assert_array_equal(big_t, x.T)
    np.testing.assert_array_equal(small_t, small.T)


@pytest.mark.parametrize("op,ref", [("add", np.add), ("subtract", np.subtract), ("multiply", np.multiply),
                                    ("maximum", np.maximum)])
def test_tensor_tensor(op, ref):
    op_token = getattr(nl, op)  # outside the kernel: getattr() is not in the NKI Python subset

    @nki.jit
    def kernel(a, b):
        out = nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=out, data1=load(a), data2=load(b), op=op_token)
        return store(out)

    a, b = rand(8, 3, 5), rand(8, 3, 5)
    np.testing.assert_array_equal(kernel(a, b), ref(a, b))


def test_tensor_scalar_vector_and_scalar_operands():
    @nki.jit
    def kernel(x, v):
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=out, data=load(x), op0=nl.multiply, operand0=load(v), op1=nl.subtract,
                           operand1=2.0, reverse1=True)
        return store(out)

    x, v = rand(16, 9), rand(16, 1)
    np.testing.assert_allclose(kernel(x, v), 2.0 - x * v, rtol=1e-6)


def test_activation_sigmoid_scale_bias_and_bf16_store():
    @nki.jit
    def kernel(x, bias):
        out = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.activation(dst=out, op=nl.sigmoid, data=load(x), bias=load(bias), scale=0.5)
        return store(out, dtype=nl.float32)

    x, bias = rand(12, 30), rand(12, 1)
    want = bf16_round(1.0 / (1.0 + np.exp(-(x * 0.5 + bias))))
    np.testing.assert_allclose(kernel(x, bias), want, atol=2 ** -8)  # within one bf16 ulp of the rounding point


@pytest.mark.parametrize("op,ref", [
    ("copy", lambda x: x),
    ("silu", lambda x: x / (1.0 + np.exp(-x))),
    ("silu_dx", lambda x: (1.0 + np.exp(-x) + x * np.exp(-x)) / (1.0 + np.exp(-x)) ** 2),  # d/dx x * sigmoid(x)
])
def test_activation_copy_silu_and_its_derivative(op, ref):
    function = getattr(nl, op)

    @nki.jit
    def kernel(x):
        out = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=out, op=function, data=load(x), scale=2.0)
        return store(out)

    x = rand(8, 20)
    np.testing.assert_allclose(kernel(x), ref(2.0 * x), rtol=1e-5, atol=1e-6)


def test_memset_and_tensor_copy_cast():
    @nki.jit
    def kernel(x):
        tile = nl.ndarray((4, 6), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=tile, value=1.5)
        low = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=low, src=load(x))
        return store(tile), store(low, dtype=nl.float32)

    x = rand(5, 5)
    ones, low = kernel(x)
    np.testing.assert_array_equal(ones, np.full((4, 6), 1.5, np.float32))
    np.testing.assert_array_equal(low, bf16_round(x))


def test_torch_in_torch_out():
    @nki.jit
    def kernel(x):
        return store(load(x))

    x = torch.randn(3, 4, dtype=torch.bfloat16)
    out = kernel(x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and torch.equal(out, x)


# -- rules -------------------------------------------------------------------------------------------------------------
def run(body, *arrays):
    """Run `body(*hbm_args)` as a kernel; the body raises before returning."""
    nki.jit(body)(*(arrays or (rand(2, 2),)))


def test_partition_dim_limit():
    def too_many_partitions(_):
        nl.ndarray((129, 4), dtype=nl.float32, buffer=nl.sbuf)

    with raises("partition-dim-limit"):
        run(too_many_partitions)


def test_psum_bank_size():
    def over_one_bank(_):
        nl.ndarray((128, 513), dtype=nl.float32, buffer=nl.psum)

    with raises("psum-bank-size"):
        run(over_one_bank)


def test_psum_and_sbuf_capacity():
    def too_much_psum(_):  # nine tiles in use at once (each is written again after the ninth is allocated)
        banks = []
        for _ in range(8):
            banks.append(nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum))
            nisa.memset(dst=banks[-1], value=0.0)
        banks.append(nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.psum))
        for bank in banks:
            nisa.memset(dst=bank, value=1.0)

    def too_much_sbuf(_):
        keep = nl.ndarray((128, 50_000), dtype=nl.float32, buffer=nl.sbuf)  # 200000 B of 229376
        nisa.memset(dst=keep, value=0.0)
        more = nl.ndarray((128, 8_000), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=more, value=0.0)
        nisa.memset(dst=keep, value=1.0)  # keep is still in use after more was allocated

    with raises("psum-capacity"):
        run(too_much_psum)
    with raises("sbuf-capacity"):
        run(too_much_sbuf)


def test_tiles_past_their_last_use_free_capacity():
    @nki.jit
    def kernel(_):
        banks = []
        for _ in range(20):  # 20 banks stay referenced, but each is dead after its memset (compiler liveness)
            banks.append(nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum))
            nisa.memset(dst=banks[-1], value=0.0)
        out = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        tile = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=tile, value=0.0)
        nisa.dma_copy(dst=out, src=tile)
        return out

    assert kernel(rand(1, 1)).shape == (1, 1)



def test_a_loop_carried_tile_ends_with_its_loop_not_in_the_next_one():
    """A tile used inside one compiled loop (allocated before it) is live to that loop's last instruction, and free
    for a tile used by the next loop at the same depth (the emulator carried it into the next loop until a
    shallower instruction came, and refused kernels whose sibling loops fit one after the other). The capacity
    error names the tiles in use."""

    def kernel_of(first_kib, second_kib):
        @nki.jit
        def kernel(_):
            out = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.shared_hbm)
            big = nl.ndarray((128, first_kib * 256), dtype=nl.float32, buffer=nl.sbuf, name="big")

            def first(i):
                nisa.memset(dst=big, value=1.0)

            nl.fori_loop(0, 2, first)
            other = nl.ndarray((128, second_kib * 256), dtype=nl.float32, buffer=nl.sbuf, name="other")

            def second(i):
                nisa.memset(dst=other, value=2.0)
                nisa.dma_copy(dst=out, src=other[0:128, 0:1])

            nl.fori_loop(0, 2, second)
            return out

        return kernel

    # 120 + 100 KiB do not fit 207 KiB together, each fits alone
    assert kernel_of(120, 100)(rand(1, 1)).shape == (128, 1)

    @nki.jit
    def both_live(_):
        out = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        big = nl.ndarray((128, 120 * 256), dtype=nl.float32, buffer=nl.sbuf, name="big")
        other = nl.ndarray((128, 100 * 256), dtype=nl.float32, buffer=nl.sbuf, name="other")

        def body(i):
            nisa.memset(dst=big, value=1.0)
            nisa.memset(dst=other, value=2.0)
            nisa.dma_copy(dst=out, src=other[0:128, 0:1])

        nl.fori_loop(0, 2, body)
        return out

    with pytest.raises(NkiRuleError, match=r"\[sbuf-capacity\].*in use by tiles used later \(big at "
                       r"\S+ 122880 B\)"):
        both_live(rand(1, 1))

def matmul_case(s_shape, m_shape, d_shape, s_buf=nl.sbuf, d_buf=nl.psum, d_dtype=nl.float32, accumulate=False):
    def body(_):
        s = nl.ndarray(s_shape, dtype=nl.float32, buffer=s_buf)
        m = nl.ndarray(m_shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=s, value=1.0)
        nisa.memset(dst=m, value=1.0)
        d = nl.ndarray(d_shape, dtype=d_dtype, buffer=d_buf)
        nisa.nc_matmul(dst=d, stationary=s, moving=m, accumulate=accumulate)

    return body


@pytest.mark.parametrize("rule,case", [
    ("matmul-stationary-size", matmul_case((128, 129), (128, 4), (128, 4))),
    ("matmul-moving-size", matmul_case((128, 4), (128, 513), (4, 512))),
    ("matmul-contraction", matmul_case((64, 4), (32, 4), (4, 4))),
    ("matmul-operand-buffer", matmul_case((8, 4), (8, 4), (4, 4), s_buf=nl.psum)),
    ("matmul-operand-buffer", matmul_case((8, 4), (8, 4), (4, 4), d_buf=nl.sbuf)),
    ("matmul-psum-dtype", matmul_case((8, 4), (8, 4), (4, 4), d_dtype=nl.bfloat16)),
    ("matmul-output-shape", matmul_case((8, 4), (8, 6), (6, 4))),
    ("matmul-accumulate-init", matmul_case((8, 4), (8, 4), (4, 4), accumulate=True)),
])
def test_matmul_rules(rule, case):
    with raises(rule):
        run(case)


def test_accumulate_onto_memset_psum_is_rejected():
    def body(_):
        s = nl.ndarray((8, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=s, value=1.0)
        acc = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.memset(dst=acc, value=0.0)
        nisa.nc_matmul(dst=acc, stationary=s, moving=s, accumulate=True)

    with raises("matmul-accumulate-init"):
        run(body)


def test_transpose_rules():
    def vector_too_big(x):
        data = load(x)
        nisa.nc_transpose(dst=nl.ndarray((x.shape[1], x.shape[0]), dtype=nl.float32, buffer=nl.sbuf), data=data)

    def dtype_change(x):
        nisa.nc_transpose(dst=nl.ndarray((x.shape[1], x.shape[0]), dtype=nl.bfloat16, buffer=nl.psum),
                          data=load(x))

    with raises("transpose-size"):
        run(vector_too_big, rand(33, 8))
    with raises("transpose-dtype"):
        run(dtype_change, rand(8, 8))


def test_dma_rules():
    def from_psum(_):
        acc = nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.psum)
        nisa.dma_copy(dst=nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.shared_hbm), src=acc)

    def shape_mismatch(x):
        nisa.dma_copy(dst=nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.sbuf), src=x)  # 4 vs 6 elements

    with raises("dma-buffer"):
        run(from_psum)
    with raises("dma-shape"):
        run(shape_mismatch, rand(3, 2))


def test_engine_rules():
    def hbm_operand(x):
        nisa.tensor_tensor(dst=nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf), data1=x, data2=load(x),
                           op=nl.add)

    def two_psum_inputs(x):
        a = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=a, src=load(x))
        nisa.tensor_tensor(dst=nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf), data1=a, data2=a, op=nl.add)

    def layout_mismatch(x):
        nisa.tensor_tensor(dst=nl.ndarray((2, 3), dtype=nl.float32, buffer=nl.sbuf), data1=load(x), data2=load(x),
                           op=nl.add)

    with raises("engine-buffer"):
        run(hbm_operand)
    with raises("tensor-tensor-psum-inputs"):
        run(two_psum_inputs)
    with raises("elementwise-shape"):
        run(layout_mismatch)


def test_index_rules():
    def slice_out_of_range(x):
        load(x)[0:2, 0:3]

    def gather_out_of_range(x, rows):
        nisa.dma_copy(dst=nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.sbuf),
                      src=x.ap(pattern=[[2, 2], [1, 2]], vector_offset=load(rows), indirect_dim=0))

    def partition_int_index(x):  # indexing is fine (a DMA may move it); a compute engine cannot take it
        tile = load(x)
        nisa.tensor_copy(dst=tile[0:1, 0:2], src=tile[0, 0:2])

    with raises("index-bounds"):
        run(slice_out_of_range)
    with raises("index-bounds"):
        run(gather_out_of_range, rand(2, 2), np.array([[0], [2]], dtype=np.int32))
    with raises("partition-view"):
        run(partition_int_index)


def test_access_pattern_rules():
    def strided_partitions(x):
        t = load(x)
        t.ap(pattern=[[8, 2], [1, 4]])

    def ap_on_view(x):
        x[0:1, 0:2].ap(pattern=[[2, 1], [1, 2]])

    def offset_in_hbm(x, rows):
        x.ap(pattern=[[2, 2], [1, 2]], vector_offset=rows, indirect_dim=0)

    with raises("ap-partition-contiguity"):
        run(strided_partitions, rand(4, 4))
    with raises("ap-on-view"):
        run(ap_on_view)
    with raises("offset-tile"):
        run(offset_in_hbm, rand(2, 2), np.zeros((2, 1), np.int32))


def test_uninitialized_read_and_kernel_outputs():
    def read_garbage(_):  # copying unwritten elements moves them along unwritten; returning them is the error
        return store(nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.sbuf))

    def half_written_output(x):
        out = nl.ndarray((4, 2), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[0:2, 0:2], src=load(x))
        return out

    with raises("uninitialized-read"):
        run(read_garbage)
    with raises("uninitialized-read"):
        run(half_written_output)
    def returns_sbuf(x):
        return load(x)

    with raises("kernel-output"):
        run(returns_sbuf)
