"""The MoE kernel's shared helpers at toy shapes: narrow matmuls as PE column tiles (`tiles.matmul`) and the combine
in the DMA engines (`combine.combine`), each against numpy and the work the time model sees."""

import numpy as np
import pytest
import torch

from tests.kernels.test_nki_emulator import load, raises, store
from tests.kernels.test_tiling_and_dma_transpose import CYCLE, _one_core, rand  # noqa: F401 - _one_core: autouse
from workbench.kernels import nki_emulator as nki
from workbench.kernels.nki_emulator import counters
from workbench.kernels.nki_emulator.timing import Matmul, schedule
from workbench.kernels.nki_moe import combine, tiles

nl, nisa = nki.language, nki.isa


def product(stationary, moving):
    """stationary^T @ moving through `tiles.matmul`, bf16 operands; (the result, the counters)."""

    @nki.jit
    def kernel(s, m):
        psum = nl.ndarray((s.shape[1], m.shape[1]), dtype=nl.float32, buffer=nl.psum)
        tiles.matmul(psum, load(s, dtype=nl.bfloat16), load(m, dtype=nl.bfloat16), False)
        out = nl.ndarray(psum.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=psum)
        return store(out)

    with counters(trace=True) as c:
        out = kernel(stationary, moving)
    return out, c


def bf16(x):
    return torch.from_numpy(x).bfloat16().float().numpy()


def matmuls(c):
    return sorted((w.tile, n) for (_core, _e, _op, w), n in c.work.items() if isinstance(w, Matmul))


def tensor_seconds(c):
    return schedule(c).busy["tensor"]


def test_a_narrow_matmul_runs_as_column_tiles_of_32_in_their_psum_partitions():
    """[128, 128]^T @ [128, 32]: four 32-column PE tiles side by side, the same product, 32 cycles of the array
    where the untiled matmul takes 64 (max(min(64, N_stationary), N_moving), tiles in parallel)."""
    s, m = rand(128, 128), rand(128, 32, seed=1)
    out, c = product(s, m)
    np.testing.assert_allclose(out, bf16(s).T @ bf16(m), rtol=1e-5, atol=1e-4)
    assert matmuls(c) == [((0, 128, c0, 32), 1) for c0 in (0, 32, 64, 96)]
    assert tensor_seconds(c) == pytest.approx(32 * CYCLE)


@pytest.mark.parametrize("shape", [((128, 128), (128, 64)), ((128, 32), (128, 16)), ((96, 100), (96, 8))])
def test_a_wide_moving_or_a_narrow_stationary_runs_untiled(shape):
    """64 moving columns cost max(min(64, M), 64) = 64 cycles either way; a stationary of <= 32 columns already
    fits one tile; a stationary of 100 columns tiles as 32, 32, 32, 4."""
    s, m = rand(*shape[0]), rand(*shape[1], seed=1)
    out, c = product(s, m)
    np.testing.assert_allclose(out, bf16(s).T @ bf16(m), rtol=1e-5, atol=1e-4)
    tiled = shape[1][1] <= 32 < shape[0][1]
    want = [((0, 128, c0, 32), 1) for c0 in range(0, shape[0][1], 32)] if tiled else [((), 1)]
    assert matmuls(c) == want


def test_the_combine_sums_each_tokens_k_rows_in_the_dma_engines_only():
    """out[t] = sum_k rows[t * K + k] in fp32, one dma_compute per token tile, no Tensor, Vector or Scalar work."""
    nT, TT, K, D = 3, 16, 4, 40
    rows = rand(nT * TT * K, D)

    @nki.jit
    def kernel(r):
        out = nl.ndarray((nT, TT, D), dtype=nl.float32, buffer=nl.shared_hbm)
        combine.combine(out, r, K, 0, 1)
        return out

    with counters() as c:
        out = kernel(rows)
    np.testing.assert_allclose(out, rows.reshape(nT, TT, K, D).sum(2), rtol=1e-6, atol=1e-5)
    assert {(e, op): n for (_core, e, op, _w), n in c.work.items()} == {("dma", "dma_compute"): nT}


def test_dma_compute_takes_at_most_16_sources():
    @nki.jit
    def kernel(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_compute(dst=out, srcs=[x] * 17, reduce_op=nl.add)
        return out

    with raises("dma-compute-sources"):
        kernel(rand(4, 8))
    with pytest.raises(ValueError, match="top_k must be <= 16"):
        nki.jit(lambda r: combine.combine(nl.ndarray((1, 2, 8), dtype=nl.float32, buffer=nl.shared_hbm), r, 17,
                                          0, 1))(rand(34, 8))
