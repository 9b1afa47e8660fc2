"""PE tiling (`nc_matmul(tile_position=, tile_size=)`), both forms of `dma_transpose` (direct, and the indirect
gather-transpose) and their costs in the time model, against the API pages the emulator cites."""

import numpy as np
import pytest
import torch

from tests.kernels.test_nki_emulator import load, raises, store
from workbench.kernels import nki_emulator as nki
from workbench.kernels.nki_emulator import NkiRuleError, counters, timing
from workbench.kernels.nki_emulator.constants import nc_version
from workbench.kernels.nki_emulator.timing import TRN2, Matmul, Transpose, instruction_seconds, model, schedule

nl, nisa = nki.language, nki.isa
CYCLE = 1 / 2.4e9


@pytest.fixture(autouse=True)
def _one_core(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def column_tiled(x, w, width):
    """out[32c + t, :] = x[:, c-th column tile] ^T @ w: 128 // width column tiles of the PE array, each a [128,
    width] stationary, its result in the PSUM partitions of its columns (as nki-library's mlp_tkg places them)."""
    n = 128 // width
    psum = nl.ndarray((128, w.shape[1]), dtype=nl.float32, buffer=nl.psum)
    xs, ws = load(x), load(w)
    for c in range(n):
        nisa.nc_matmul(dst=psum[c * width:(c + 1) * width, 0:w.shape[1]],
                       stationary=xs[0:128, c * width:(c + 1) * width], moving=ws, tile_position=(0, c * width),
                       tile_size=(128, width))
    out = nl.ndarray((128, w.shape[1]), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=psum)
    return store(out)


@pytest.mark.parametrize("width", [32, 64])
def test_column_tiles_compute_stationary_t_moving_into_their_partitions(width):
    x, w = rand(128, 128), rand(128, 96, seed=1)
    out = nki.jit(lambda a, b: column_tiled(a, b, width))(x, w)
    np.testing.assert_allclose(out, x.T @ w, rtol=1e-5, atol=1e-4)


def test_row_tiles_contract_their_rows_and_accumulate():
    """Four 32-row tiles, each contracting 32 partitions of x and w, accumulate into one PSUM tile: x^T @ w."""
    x, w = rand(128, 48), rand(128, 80, seed=1)

    @nki.jit
    def kernel(a, b):
        xs, ws = load(a), load(b)
        psum = nl.ndarray((48, 80), dtype=nl.float32, buffer=nl.psum)
        for r in range(4):
            nisa.nc_matmul(dst=psum, stationary=xs[r * 32:(r + 1) * 32, 0:48], moving=ws[r * 32:(r + 1) * 32, 0:80],
                           accumulate=r > 0, tile_position=(r * 32, 0), tile_size=(32, 128))
        out = nl.ndarray((48, 80), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=psum)
        return store(out)

    np.testing.assert_allclose(kernel(x, w), x.T @ w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows,start_row", [(32, 32), (64, 64)])
def test_row_tiles_read_the_partitions_of_their_pe_rows(rows, start_row):
    """Partition p feeds PE row p (Trainium2 guide), so a row tile at start_row r contracts partitions [r, r +
    row_size): operands there compute, the same operands on partitions [0, row_size) are refused."""
    x, w = rand(128, 48), rand(128, 80, seed=1)

    def kernel(a, b, first):
        xs, ws = load(a), load(b)
        psum = nl.ndarray((48, 80), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=psum, stationary=xs[first:first + rows, 0:48], moving=ws[first:first + rows, 0:80],
                       tile_position=(start_row, 0), tile_size=(rows, 128))
        out = nl.ndarray((48, 80), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=psum)
        return store(out)

    band = slice(start_row, start_row + rows)
    got = nki.jit(lambda a, b: kernel(a, b, start_row))(x, w)
    np.testing.assert_allclose(got, x[band].T @ w[band], rtol=1e-5, atol=1e-4)
    with pytest.raises(NkiRuleError, match=rf"\[matmul-tiling\] stationary .* partitions \[0, {rows}\); the row "
                       rf"tile at start_row {start_row} is fed by partitions \[{start_row}, {start_row + rows}\)"):
        nki.jit(lambda a, b: kernel(a, b, 0))(x, w)


@pytest.mark.parametrize("position,size,match", [
    ((0, 32), (), "both must be set"),
    ((0, 0), (96, 128), "2 x 64 or 4 x 32"),
    ((0, 48), (128, 32), "multiple of its tile size"),
    ((64, 0), (128, 128), "inside the 128 x 128 array"),
    ((0, 0), (64, 128), "exceeds tile_size"),  # the stationary's 128 contraction partitions on 64 PE rows
    ((0, 0), (128, 32), "exceeds tile_size"),  # its 64 free columns on 32 PE columns
    ((0.0, 0), (128, 64), "pair of ints"),
])
def test_tiling_rules(position, size, match):
    @nki.jit
    def kernel(a):
        xs = load(a)
        psum = nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=psum, stationary=xs[0:128, 0:64], moving=xs[0:128, 0:64], tile_position=position,
                       tile_size=size)

    with pytest.raises(NkiRuleError, match=rf"\[matmul-tiling\].*{match}"):
        kernel(rand(128, 64))


def test_32_wide_tiles_need_neuroncore_v3():
    x, w = rand(128, 128), rand(128, 32, seed=1)
    with nisa.targeting(nc_version.gen2), raises("matmul-tiling"):
        nki.jit(lambda a, b: column_tiled(a, b, 32))(x, w)
    with nisa.targeting(nc_version.gen2):  # 2 x 64 tiles exist on NeuronCore-v2
        np.testing.assert_allclose(nki.jit(lambda a, b: column_tiled(a, b, 64))(x, w), x.T @ w, rtol=1e-5, atol=1e-4)


def test_matmul_cost_is_the_pages_formula():
    """max(min(64, N_stationary), N_moving) cycles, x4 fp32 (nc_matmul page); a PE transpose of [P, F] max(P,
    min(64, F)) (nc_transpose page)."""
    cost = lambda w: instruction_seconds("tensor", "", w) / CYCLE  # noqa: E731
    assert cost(Matmul(128, 128, 512, False)) == pytest.approx(512)
    assert cost(Matmul(128, 128, 32, False)) == pytest.approx(64)  # the 64-cycle floor with a wide stationary
    assert cost(Matmul(128, 1, 32, False)) == pytest.approx(32)  # a one-column stationary: no floor
    assert cost(Matmul(128, 16, 8, True)) == pytest.approx(4 * 16)
    assert cost(Transpose(32, 32, False)) == pytest.approx(32)
    assert cost(Transpose(32, 128, False)) == pytest.approx(64)
    assert cost(Transpose(128, 32, False)) == pytest.approx(128)


def test_concurrent_tiles_overlap_in_the_time_model():
    """Four 32-column tiles of 512 moving columns (fp32: 4 x 512 cycles each): one tile's time when they run
    concurrently, four times that serialised (the assumption's two ends); the throughput model charges each tile its
    share of the array."""
    x, w = rand(128, 128), rand(128, 512, seed=1)
    with counters(trace=True) as c:
        nki.jit(lambda a, b: column_tiled(a, b, 32))(x, w)
    one = 4 * 512 * CYCLE
    serial = timing.Rates(pe_tiles_concurrent=False)
    assert [schedule(c).busy["tensor"], schedule(c, serial).busy["tensor"]] == [pytest.approx(one),
                                                                               pytest.approx(4 * one)]
    assert model(c).engines["tensor"] == pytest.approx(one)
    assert model(c, serial).engines["tensor"] == pytest.approx(4 * one)
    assert schedule(c, serial).seconds - schedule(c).seconds == pytest.approx(3 * one, rel=1e-6)


def gather_transpose(src, idx, cols):
    """The dma_transpose page's indirect example: dst [128 features, cols rows] = src[indices.T.flatten()].T."""
    idx_sb = load(idx)
    dst = nl.ndarray((128, cols), dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(dst=dst, src=src.ap(pattern=[[128, cols], [1, 128]], vector_offset=idx_sb, indirect_dim=0),
                       axes=(1, 0))
    return store(dst)


@pytest.mark.parametrize("n", [1, 2])
def test_gather_transpose_reads_indices_column_by_column(n):
    src = torch.randn(500, 128).to(torch.bfloat16)
    idx = torch.randint(0, 500, (128, n)).to(torch.uint32)
    out = nki.jit(lambda s, i: gather_transpose(s, i, 128 * n))(src, idx)
    rows = idx.long().T.reshape(-1)
    assert torch.equal(out, src[rows].T)


@pytest.mark.parametrize("change,match", [
    ({"dtype": torch.float32}, "not 2 bytes"),
    ({"idx_dtype": torch.int32}, "uint32"),
    ({"idx_shape": (8, 1), "cols": 8}, r"must be in \[16, 128\]"),
    ({"idx_shape": (64, 2), "cols": 128}, "must be 128 when"),
    ({"cols": 24, "idx_shape": (24, 1)}, "must be in"),  # 24 rows: not a multiple of 16
])
def test_gather_transpose_rules(change, match):
    src = torch.randn(500, 128).to(change.get("dtype", torch.bfloat16))
    idx = torch.zeros(change.get("idx_shape", (128, 1))).to(change.get("idx_dtype", torch.uint32))
    cols = change.get("cols", 128)
    with pytest.raises(Exception, match=match):
        nki.jit(lambda s, i: gather_transpose(s, i, cols))(src, idx)


def test_gather_transpose_is_trn2_only_and_software_dge():
    src, idx = torch.randn(200, 128).to(torch.bfloat16), torch.zeros(128, 1).to(torch.uint32)
    with nisa.targeting(nc_version.gen2), raises("dma-gather-transpose"):
        nki.jit(lambda s, i: gather_transpose(s, i, 128))(src, idx)

    @nki.jit
    def hardware_dge(s, i):
        dst = nl.ndarray((128, 128), dtype=s.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=dst, src=s.ap(pattern=[[128, 128], [1, 128]], vector_offset=load(i), indirect_dim=0),
                           dge_mode=nisa.dge_mode.hwdge)

    with raises("dma-gather-transpose"):
        hardware_dge(src, idx)


def test_dma_transpose_costs_its_documented_share_of_the_dma_rate():
    """HBM -> SBUF transposes move bytes at 90% of the engines' rate, SBUF -> SBUF at 50% (Trainium2 guide); the
    gather-transpose's descriptors come from software DGE (one row per index)."""
    x = torch.randn(128, 128).to(torch.bfloat16)

    @nki.jit
    def kernel(a):
        t = nl.ndarray((128, 128), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=a)
        u = nl.ndarray((128, 128), dtype=a.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=u, src=t)
        return store(u)

    with counters() as c:
        assert torch.equal(kernel(x), x)
    works = [w for (_, engine, op, w) in c.work if op == "dma_transpose"]
    assert sorted(w.transpose for w in works) == ["hbm", "sbuf"]
    plain = timing.Dma(nbytes=128 * 256, hbm_bytes=0, partitions=128)
    copy = instruction_seconds("dma", "", plain)
    fixed = 9e-9 * 16 / 16
    for w in works:
        share = {"hbm": 0.9, "sbuf": 0.5}[w.transpose]
        assert instruction_seconds("dma", "", w) - fixed == pytest.approx((copy - fixed) / share)
    src, idx = torch.randn(200, 128).to(torch.bfloat16), torch.zeros(128, 1).to(torch.uint32)
    with counters(trace=True) as g:
        nki.jit(lambda s, i: gather_transpose(s, i, 128))(src, idx)
    gathers = [w for (_, _, op, w) in g.work if op == "dma_transpose"]
    assert [(w.rows, w.transpose) for w in gathers] == [(128, "hbm")]
    assert schedule(g).busy["gpsimd"] == pytest.approx(TRN2.dge_sw_s + 128 * TRN2.dge_sw_row_cycles / TRN2.gpsimd_hz)
