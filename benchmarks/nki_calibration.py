"""The trn2 time model against AWS's published timings of the matmul tutorial's four kernels.

    .venv/bin/python benchmarks/nki_calibration.py [--small]

AWS's "Introduction to NKI Kernel Optimization" tutorial (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/
nki/how-to-guides/kernel-optimization.html) takes one fp32 matmul, lhsT [K, M] = [8192, 4096] x rhs [K, N] =
[8192, 8192], through four kernels and profiles each on a trn2 NeuronCore (published: v2 39.89 ms, v3 28.20, v4
28.41, v5 28.30, as quoted in issue 32). The kernels below are written here from the tutorial's description of each
step (not copied): the same loops, tile shapes, loads and blocking factors.

    v2  tiled: per output tile [128, 512], per k: load a [128, 128] lhsT tile and a [128, 512] rhs tile, matmul
    v3  hoisted: a column of lhsT tiles per m, a column of rhs tiles per (m, n), then K/128 matmuls
    v4  blocked M and N (2 x 128 by 2 x 512 output tiles per block): each loaded column serves two output tiles
    v5  blocked M, N, K (16, 2, 8 tiles): K blocks accumulate in SBUF (Vector Engine adds), rhs / lhsT loaded as
        [128, 1024] / [128, 2048] rows

Each runs through the NKI emulator (LNC 1, one NeuronCore) at AWS's shape; its result is checked against torch,
and `timing.schedule` replays its instruction trace (the cost report's dependency model, same rates). Printed: a
table of published vs modeled, the throughput bracket, and as the LAST line a JSON object. v4 and v5 as the
tutorial writes them keep more SBUF live in program order than the 212,464 B per partition the emulator allows (the
usable SBUF): v4 two rhs columns of 64 fp32 [128, 512] tiles (256 KiB), v5 its 64 fp32 accumulator tiles with 8 rhs
and 8 lhsT rows (224 KiB). The compiler may reorder `affine_range` iterations and reuse buffers; the emulator keeps
program order. They run with the capacity rules lifted, and the table says so. `--small` runs a 16x smaller
problem (no published figure: a quick check of the kernels). Nothing here ran on Trainium.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from workbench.core.neuron_env import compiled_for_lnc  # noqa: E402
from workbench.kernels.nki_api import nisa, nki, nl  # noqa: E402
from workbench.kernels.nki_emulator import capacity_lifted, counters  # noqa: E402
from workbench.kernels.nki_emulator.timing import model, schedule  # noqa: E402

PUBLISHED_MS = {"v2": 39.89, "v3": 28.20, "v4": 28.41, "v5": 28.30}  # trn2, the tutorial's profiles
TK, TM, TN = 128, 128, 512  # contraction tile (partitions), stationary free size, moving free size


def _shapes(lhsT, rhs):
    """K, M, N and the result [M, N] fp32 in HBM of lhsT [K, M] x rhs [K, N]."""
    K, M = lhsT.shape
    N = rhs.shape[1]
    return K, M, N, nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)


def _store(result, acc, m0, n0):
    """result[m0:m0+128, n0:n0+512] <- the PSUM tile acc (evicted to SBUF first: PSUM cannot be DMAed)."""
    rows = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=rows, src=acc)
    nisa.dma_copy(dst=result[m0:m0 + TM, n0:n0 + TN], src=rows)


@nki.jit
def v2_tiled(lhsT, rhs):
    """Every output tile loads its own operand tiles inside the k loop (each lhsT tile is loaded N/512 times)."""
    K, M, N, result = _shapes(lhsT, rhs)
    for m in nl.affine_range(M // TM):
        for n in nl.affine_range(N // TN):
            acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TK):
                a = nl.ndarray((TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
                b = nl.ndarray((TK, TN), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
                nisa.dma_copy(dst=b, src=rhs[k * TK:(k + 1) * TK, n * TN:(n + 1) * TN])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b, accumulate=k > 0)
            _store(result, acc, m * TM, n * TN)
    return result


def _column(src, c0, width):
    """The K/128 tiles [128, width] of columns c0 .. c0 + width of src [K, *], one DMA each."""
    tiles = []
    for k in nl.affine_range(src.shape[0] // TK):
        t = nl.ndarray((TK, width), dtype=src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=src[k * TK:(k + 1) * TK, c0:c0 + width])
        tiles.append(t)
    return tiles


@nki.jit
def v3_hoisted(lhsT, rhs):
    """The lhsT column of an m loaded once per m, the rhs column of an n once per (m, n)."""
    K, M, N, result = _shapes(lhsT, rhs)
    for m in nl.affine_range(M // TM):
        a = _column(lhsT, m * TM, TM)
        for n in nl.affine_range(N // TN):
            b = _column(rhs, n * TN, TN)
            acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TK):
                nisa.nc_matmul(dst=acc, stationary=a[k], moving=b[k], accumulate=k > 0)
            _store(result, acc, m * TM, n * TN)
    return result


@nki.jit
def v4_blocked_mn(lhsT, rhs):
    """Blocks of 2 x 2 output tiles: two lhsT columns per m block, two rhs columns per (m, n) block."""
    K, M, N, result = _shapes(lhsT, rhs)
    BM, BN = 2, 2
    for m in nl.affine_range(M // (BM * TM)):
        a = []
        for i in nl.affine_range(BM):
            a.append(_column(lhsT, (m * BM + i) * TM, TM))
        for n in nl.affine_range(N // (BN * TN)):
            b = []
            for j in nl.affine_range(BN):
                b.append(_column(rhs, (n * BN + j) * TN, TN))
            for i in nl.affine_range(BM):
                for j in nl.affine_range(BN):
                    acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
                    for k in nl.affine_range(K // TK):
                        nisa.nc_matmul(dst=acc, stationary=a[i][k], moving=b[j][k], accumulate=k > 0)
                    _store(result, acc, (m * BM + i) * TM, (n * BN + j) * TN)
    return result


@nki.jit
def v5_blocked_mnk(lhsT, rhs):
    """Blocks of 16 x 2 output tiles and 8 contraction tiles: per n block, every output tile of the column
    accumulates in SBUF (fp32, zeroed first) over the K blocks; per K block the rhs rows [128, 1024] load once and
    each m block's lhsT rows [128, 2048]; a PSUM tile sums one K block, the Vector Engine adds it in."""
    K, M, N, result = _shapes(lhsT, rhs)
    BM, BN, BK = 16, 2, 8
    nm, nn, nk = M // (BM * TM), N // (BN * TN), K // (BK * TK)
    for n in nl.affine_range(nn):
        sums = []  # [m block][i][j] fp32 [128, 512] in SBUF
        for _m in range(nm):
            rows = []
            for _i in range(BM):
                cols = []
                for _j in range(BN):
                    t = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.memset(dst=t, value=0.0)
                    cols.append(t)
                rows.append(cols)
            sums.append(rows)
        for kb in nl.sequential_range(nk):
            b = []
            for r in range(BK):
                t = nl.ndarray((TK, BN * TN), dtype=rhs.dtype, buffer=nl.sbuf)
                k0 = (kb * BK + r) * TK
                nisa.dma_copy(dst=t, src=rhs[k0:k0 + TK, n * BN * TN:(n + 1) * BN * TN])
                b.append(t)
            for m in nl.affine_range(nm):
                a = []
                for r in nl.affine_range(BK):
                    t = nl.ndarray((TK, BM * TM), dtype=lhsT.dtype, buffer=nl.sbuf)
                    k0 = (kb * BK + r) * TK
                    nisa.dma_copy(dst=t, src=lhsT[k0:k0 + TK, m * BM * TM:(m + 1) * BM * TM])
                    a.append(t)
                for j in nl.affine_range(BN):
                    for i in nl.affine_range(BM):
                        acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
                        for r in nl.affine_range(BK):
                            nisa.nc_matmul(dst=acc, stationary=a[r][0:TK, i * TM:(i + 1) * TM],
                                           moving=b[r][0:TK, j * TN:(j + 1) * TN], accumulate=r > 0)
                        nisa.tensor_tensor(dst=sums[m][i][j], data1=sums[m][i][j], data2=acc, op=nl.add)
        for m in nl.affine_range(nm):
            for i in nl.affine_range(BM):
                packed = nl.ndarray((TM, BN * TN), dtype=nl.float32, buffer=nl.sbuf)
                for j in nl.affine_range(BN):
                    nisa.tensor_copy(dst=packed[0:TM, j * TN:(j + 1) * TN], src=sums[m][i][j])
                m0 = (m * BM + i) * TM
                nisa.dma_copy(dst=result[m0:m0 + TM, n * BN * TN:(n + 1) * BN * TN], src=packed)
    return result


KERNELS = {"v2": v2_tiled, "v3": v3_hoisted, "v4": v4_blocked_mn, "v5": v5_blocked_mnk}
LIFTED = {"v4", "v5"}  # over the usable SBUF in program order (module docstring)


def run(name: str, K: int, M: int, N: int) -> dict:
    """One kernel at lhsT [K, M] x rhs [K, N] fp32: its result checked against torch, its modeled times (ms)."""
    g = torch.Generator().manual_seed(0)
    lhsT, rhs = torch.rand(K, M, generator=g), torch.rand(K, N, generator=g)
    t0 = time.perf_counter()
    with compiled_for_lnc(1), counters(trace=True) as c:
        if name in LIFTED:
            with capacity_lifted():
                out = KERNELS[name](lhsT, rhs)
        else:
            out = KERNELS[name](lhsT, rhs)
    emulated = time.perf_counter() - t0
    torch.testing.assert_close(out, lhsT.T @ rhs, rtol=1e-4, atol=1e-3)
    bracket = model(c)
    return {"model_ms": round(schedule(c).seconds * 1e3, 3), "overlap_ms": round(bracket.overlap_s * 1e3, 3),
            "serial_ms": round(bracket.serial_s * 1e3, 3), "bound": bracket.bound,
            "capacity_lifted": name in LIFTED, "emulated_s": round(emulated, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="lhsT [1024, 2048] x rhs [1024, 1024]: no published "
                        "figure, a quick check")
    parser.add_argument("--versions", default="v2,v3,v4,v5", help="comma-separated subset of v2,v3,v4,v5")
    args = parser.parse_args(argv)
    K, M, N = (1024, 2048, 1024) if args.small else (8192, 4096, 8192)
    rows = {}
    print(f"matmul tutorial kernels, fp32 lhsT [{K}, {M}] x rhs [{K}, {N}], one NeuronCore (LNC 1), trn2 time model")
    print(f"{'kernel':8s}{'published ms':>14s}{'model ms':>11s}{'model/pub':>11s}{'bracket ms':>20s}  bound")
    for name in args.versions.split(","):
        r = run(name, K, M, N)
        pub = None if args.small else PUBLISHED_MS[name]
        r["published_ms"] = pub
        r["ratio"] = None if pub is None else round(r["model_ms"] / pub, 3)
        rows[name] = r
        note = " (SBUF capacity lifted)" if r["capacity_lifted"] else ""
        print(f"{name:8s}{pub if pub is not None else '-':>14}{r['model_ms']:>11.2f}"
              f"{r['ratio'] if r['ratio'] is not None else '-':>11}"
              f"{r['overlap_ms']:>9.2f} .. {r['serial_ms']:<8.2f}  {r['bound']}{note}  [{r['emulated_s']} s]",
              flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
