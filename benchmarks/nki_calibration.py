"""The NKI time model against AWS's published timings: the tutorials' kernels, written here, at AWS's shapes.

    .venv/bin/python benchmarks/nki_calibration.py [--cases matmul_v2,layernorm_v1,...] [--small]
        [--nki-library DIR]

Each case is one published figure (`CASES`): the kernel, written here from the tutorial's description of each step
(not copied: the same loops, tile shapes, instructions and blocking), runs through the NKI emulator (LNC 1, one
NeuronCore) at the published shape, its result is checked against torch, and `timing.schedule` replays its
instruction trace (the cost report's dependency model) with the rates of the chip the figure was published on:

    matmul_v2..v5   trn2, "Introduction to NKI Kernel Optimization" (https://awsdocs-neuron.readthedocs-hosted.com/
                    en/latest/nki/how-to-guides/kernel-optimization.html): one fp32 matmul, lhsT [K, M] = [8192,
                    4096] x rhs [K, N] = [8192, 8192], profiled at v2 39.89 ms, v3 28.20, v4 28.41, v5 28.30 (as
                    quoted in issue 32). v2 tiled (per output tile [128, 512] and k a [128, 128] lhsT and a [128,
                    512] rhs load); v3 the lhsT column per m, the rhs column per (m, n); v4 blocked 2 x 2 output
                    tiles; v5 blocked 16 x 2 x 8 with the K blocks summed in SBUF (Vector adds)
    layernorm_v1/v2 trn1, the NKI LayerNorm tutorial (SDK <= 2.26), fp32 [4096, 8192], `nki.benchmark` p50 2,311 /
                    1,969 us: v1 reduces for the mean and E[x^2], v2 bn_stats / bn_aggr and one tensor_scalar
    mamba_*         trn1, the fused Mamba tutorial (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/
                    guides/tutorials/fused_mamba.html), fp32, batch 1, state 16, channels 4096 (v1 also 256):
                    v1 states outer, v2 per channel tile, v3 the sequence in 512-column chunks
    rmsnorm_quant_* trn2, LNC 2: AWS's own `rmsnorm_quant_kernel` (nki-library core/rmsnorm, unmodified, from the
                    checkout `--nki-library DIR` names; not shipped) at its design spec's four shapes (https://
                    awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/library/specs/design-rmsnorm-quant.html,
                    "Performance Targets": [1, 2K, 8192] 458.2 us ... [1, 32K, 16384] 13,214.4 us), bf16 input;
                    its values checked against the spec's definition within AWS's test tolerance

v4 and v5 as the tutorial writes them keep more SBUF live in program order than the 212,464 B per partition the
emulator allows (the usable SBUF): v4 two rhs columns of 64 fp32 [128, 512] tiles (256 KiB), v5 its 64 fp32
accumulator tiles with 8 rhs and 8 lhsT rows (224 KiB). The compiler may reorder `affine_range` iterations and
reuse buffers; the emulator keeps program order. They run with the capacity rules lifted, and the table says so. A
case the emulator refuses (mamba_v2_L8192: on trn1 the compiler spilled) is printed as refused. Printed: a table of
published vs modeled, the throughput bracket, and as the LAST line a JSON object. `--small` runs every case at a
small shape (no published figure: a quick check, as tests/kernels/test_timing.py does). Nothing here ran on
Trainium.
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from workbench.core.neuron_env import compiled_for_lnc  # noqa: E402
from workbench.kernels.nki_api import nisa, nki, nl  # noqa: E402
from workbench.kernels.nki_emulator import NkiRuleError, capacity_lifted, counters  # noqa: E402
from workbench.kernels.nki_emulator.timing import TRN1, TRN2, model, schedule  # noqa: E402

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


# -- trn1: the LayerNorm tutorial (fp32 [4096, 8192], `nki.benchmark` p50; NeuronCore-v2) ------------------------
EPS = 1e-5


def _partition_broadcast(row, n, offset=0):
    """An SBUF [128, n] tile whose every partition holds row[offset : offset + n] of a 1-D or 2-D HBM tensor: one DMA
    whose partition stride is 0 (the tutorials' `broadcast_to` of a [1, n] row)."""
    t = nl.ndarray((nl.tile_size.pmax, n), dtype=row.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=row.ap(pattern=[[0, nl.tile_size.pmax], [1, n]], offset=offset))
    return t


def _layernorm(x, gamma, beta, stats):
    """Both tutorial versions: per 128-row tile, one load, the row statistics by `stats`, the normalisation, the
    gamma multiply and beta add as two tensor_tensor ops, one store; gamma and beta broadcast once."""
    R, N = x.shape
    out = nl.ndarray((R, N), dtype=x.dtype, buffer=nl.shared_hbm)
    g, b = _partition_broadcast(gamma, N), _partition_broadcast(beta, N)
    for i in nl.affine_range(R // 128):
        t = nl.ndarray((128, N), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[i * 128:(i + 1) * 128, 0:N])
        y = stats(t, N)
        nisa.tensor_tensor(dst=y, data1=y, data2=g, op=nl.multiply)
        nisa.tensor_tensor(dst=y, data1=y, data2=b, op=nl.add)
        nisa.dma_copy(dst=out[i * 128:(i + 1) * 128, 0:N], src=y)
    return out


def _rstd(var):
    """1 / sqrt(var + eps) of a [128, 1] tile (two small instructions)."""
    nisa.tensor_scalar(dst=var, data=var, op0=nl.add, operand0=EPS)
    nisa.activation(dst=var, op=nl.rsqrt, data=var)
    return var


def _mean_var_v1(t, N):
    """v1: the mean (a Vector reduce), the mean of squares (Scalar square, Vector reduce), var = E[x^2] - mean^2,
    then (x - mean) and * rstd as two N-element instructions."""
    mean, msq, var = (nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf) for _ in range(3))
    nisa.tensor_reduce(dst=mean, op=nl.add, data=t, axis=1)
    nisa.tensor_scalar(dst=mean, data=mean, op0=nl.multiply, operand0=1.0 / N)
    sq = nl.ndarray((128, N), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sq, op=nl.square, data=t)
    nisa.tensor_reduce(dst=msq, op=nl.add, data=sq, axis=1)
    nisa.tensor_scalar(dst=msq, data=msq, op0=nl.multiply, operand0=1.0 / N)
    nisa.tensor_tensor(dst=var, data1=mean, data2=mean, op=nl.multiply)
    nisa.tensor_tensor(dst=var, data1=msq, data2=var, op=nl.subtract)
    rstd = _rstd(var)
    y = nl.ndarray((128, N), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=y, data=t, op0=nl.subtract, operand0=mean)
    nisa.tensor_scalar(dst=y, data=y, op0=nl.multiply, operand0=rstd)
    return y


def _mean_var_v2(t, N):
    """v2: bn_stats per 512 columns and one bn_aggr, then (x - mean) * rstd as one tensor_scalar."""
    F = nl.tile_size.bn_stats_fmax
    stats = nl.ndarray((128, 6 * (N // F)), dtype=nl.float32, buffer=nl.sbuf)
    for j in nl.affine_range(N // F):
        nisa.bn_stats(dst=stats[0:128, 6 * j:6 * j + 6], data=t[0:128, j * F:(j + 1) * F])
    mv = nl.ndarray((128, 2), dtype=nl.float32, buffer=nl.sbuf)
    nisa.bn_aggr(dst=mv, data=stats)
    var = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=var, src=mv[0:128, 1:2])
    rstd = _rstd(var)
    y = nl.ndarray((128, N), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=y, data=t, op0=nl.subtract, operand0=mv[0:128, 0:1], op1=nl.multiply, operand1=rstd)
    return y


@nki.jit
def layernorm_v1(x, gamma, beta):
    return _layernorm(x, gamma, beta, _mean_var_v1)


@nki.jit
def layernorm_v2(x, gamma, beta):
    return _layernorm(x, gamma, beta, _mean_var_v2)


def _layernorm_inputs(small):
    R, N = (512, 2048) if small else (4096, 8192)
    g = torch.Generator().manual_seed(0)
    return torch.rand(R, N, generator=g), torch.rand(N, generator=g), torch.rand(N, generator=g)


def _layernorm_reference(x, gamma, beta):
    return torch.nn.functional.layer_norm(x, x.shape[1:], gamma, beta, EPS)


# -- trn1: the fused Mamba tutorial (fp32, batch 1, channels 4096, state 16; neuron-profile device time) -----------
def _mamba(delta, u, A, B, C, chunk):
    """Per 128-channel tile: delta and u loaded once; per state: A's column, then per `chunk` columns of the
    sequence (v2: the whole sequence, one chunk) exp(delta * A) on the Scalar Engine, B and C rows broadcast over the
    partitions, delta * u, * B, the scan h[t] = exp(delta A)[t] * h[t - 1] + (delta u B)[t] (v3 carries h between
    chunks), * C, added into the tile's accumulator; one store per tile.

    Dimensions:
        Ch: channels (partitions, 128 per tile); L: sequence length; S: state size.
    """
    _, Ch, L = delta.shape
    S = A.shape[1]
    out = nl.ndarray((1, Ch, L), dtype=delta.dtype, buffer=nl.shared_hbm)
    f32 = delta.dtype
    for c in nl.affine_range(Ch // 128):
        c0 = c * 128
        d, x = (nl.ndarray((128, L), dtype=f32, buffer=nl.sbuf) for _ in range(2))
        nisa.dma_copy(dst=d, src=delta[0, c0:c0 + 128, 0:L])
        nisa.dma_copy(dst=x, src=u[0, c0:c0 + 128, 0:L])
        acc = nl.ndarray((128, L), dtype=f32, buffer=nl.sbuf)
        nisa.memset(dst=acc, value=0.0)
        for s in nl.affine_range(S):
            a = nl.ndarray((128, 1), dtype=f32, buffer=nl.sbuf)
            nisa.dma_copy(dst=a, src=A[c0:c0 + 128, s:s + 1])
            carry = None
            for k in nl.static_range(L // chunk):
                k0 = k * chunk
                dA = nl.ndarray((128, chunk), dtype=f32, buffer=nl.sbuf)
                nisa.activation(dst=dA, op=nl.exp, data=d[0:128, k0:k0 + chunk], scale=a)
                b = _partition_broadcast(B, chunk, offset=s * L + k0)
                du = nl.ndarray((128, chunk), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=du, data1=d[0:128, k0:k0 + chunk], data2=x[0:128, k0:k0 + chunk],
                                   op=nl.multiply)
                dbu = nl.ndarray((128, chunk), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=dbu, data1=du, data2=b, op=nl.multiply)
                h = nl.ndarray((128, chunk), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_tensor_scan(dst=h, data0=dA, data1=dbu, initial=0.0 if carry is None else carry,
                                        op0=nl.multiply, op1=nl.add)
                if k + 1 < L // chunk:
                    carry = nl.ndarray((128, 1), dtype=f32, buffer=nl.sbuf)
                    nisa.tensor_copy(dst=carry, src=h[0:128, chunk - 1:chunk])
                cb = _partition_broadcast(C, chunk, offset=s * L + k0)
                hc = nl.ndarray((128, chunk), dtype=f32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=hc, data1=h, data2=cb, op=nl.multiply)
                nisa.tensor_tensor(dst=acc[0:128, k0:k0 + chunk], data1=acc[0:128, k0:k0 + chunk], data2=hc,
                                   op=nl.add)
        nisa.dma_copy(dst=out[0, c0:c0 + 128, 0:L], src=acc)
    return out


@nki.jit
def mamba_v1(delta, u, A, B, C):
    """The tutorial's first version: states outer, channel tiles inner, every tile's accumulator live across the
    states; delta and u reloaded for every (state, tile)."""
    _, Ch, L = delta.shape
    S, T, f32 = A.shape[1], Ch // 128, delta.dtype
    out = nl.ndarray((1, Ch, L), dtype=f32, buffer=nl.shared_hbm)
    acc = nl.ndarray((128, T, L), dtype=f32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)
    for s in nl.affine_range(S):
        for c in nl.affine_range(T):
            c0 = c * 128
            d, x, a = (nl.ndarray((128, n), dtype=f32, buffer=nl.sbuf) for n in (L, L, 1))
            nisa.dma_copy(dst=d, src=delta[0, c0:c0 + 128, 0:L])
            nisa.dma_copy(dst=a, src=A[c0:c0 + 128, s:s + 1])
            dA = nl.ndarray((128, L), dtype=f32, buffer=nl.sbuf)
            nisa.activation(dst=dA, op=nl.exp, data=d, scale=a)
            nisa.dma_copy(dst=x, src=u[0, c0:c0 + 128, 0:L])
            b = _partition_broadcast(B, L, offset=s * L)
            du, dbu, h = (nl.ndarray((128, L), dtype=f32, buffer=nl.sbuf) for _ in range(3))
            nisa.tensor_tensor(dst=du, data1=d, data2=x, op=nl.multiply)
            nisa.tensor_tensor(dst=dbu, data1=du, data2=b, op=nl.multiply)
            nisa.tensor_tensor_scan(dst=h, data0=dA, data1=dbu, initial=0.0, op0=nl.multiply, op1=nl.add)
            cb = _partition_broadcast(C, L, offset=s * L)
            hc = nl.ndarray((128, L), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=hc, data1=h, data2=cb, op=nl.multiply)
            nisa.tensor_tensor(dst=acc[0:128, c, 0:L], data1=acc[0:128, c, 0:L], data2=hc, op=nl.add)
    for c in nl.affine_range(T):
        nisa.dma_copy(dst=out[0, c * 128:(c + 1) * 128, 0:L], src=acc[0:128, c, 0:L])
    return out


@nki.jit
def mamba_v2(delta, u, A, B, C):
    """The whole sequence per instruction."""
    return _mamba(delta, u, A, B, C, delta.shape[2])


@nki.jit
def mamba_v3(delta, u, A, B, C):
    """The sequence in 512-column chunks, the scan's state carried between them."""
    return _mamba(delta, u, A, B, C, 512)


def _mamba_inputs(L, small, Ch=4096):
    Ch, S = (256, 16) if small else (Ch, 16)
    g = torch.Generator().manual_seed(0)
    delta, u = torch.rand(1, Ch, L, generator=g) * 0.1, torch.rand(1, Ch, L, generator=g)
    A = -torch.rand(Ch, S, generator=g)
    return delta, u, A, torch.rand(1, S, L, generator=g), torch.rand(1, S, L, generator=g)


def _mamba_reference(delta, u, A, B, C):
    d, x = delta[0].double(), u[0].double()  # [Ch, L]
    out = torch.zeros_like(d)
    for s in range(A.shape[1]):
        dA = torch.exp(d * A[:, s:s + 1].double())
        dbu = d * x * B[0, s].double()
        h = torch.zeros(d.shape[0], dtype=torch.float64)
        hs = torch.empty_like(d)
        for t in range(d.shape[1]):
            h = dA[:, t] * h + dbu[:, t]
            hs[:, t] = h
        out += hs * C[0, s].double()
    return out.float()[None]


# -- trn2: AWS's rmsnorm_quant (nki-library core/rmsnorm) at its design spec's shapes, LNC 2 ------------------------
RMSNORM_QUANT_US = {(2048, 8192): 458.2, (32768, 8192): 6287.0, (2048, 16384): 866.81, (32768, 16384): 13214.4}
FP8_MAX = 240.0  # trn2's float8_e4m3


def rmsnorm_quant(library: Path, S: int, H: int):
    """AWS's `rmsnorm_quant_kernel`, unmodified, from the nki-library checkout `library`, on hidden [1, S, H] bf16
    (seeded normal, as AWS's LNC tests draw it) and gamma [1, H], ROW quantisation, LNC 2, under the NKI version
    nki-library was written for. Returns (counters, the output [1, S, H + 4] as values, hidden, gamma)."""
    from workbench.kernels.nki_emulator import version
    from workbench.kernels.nki_emulator.aws_harness import LIBRARY_NKI_VERSION, launch, redirected

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, S, H, generator=g).to(torch.bfloat16)
    gamma = torch.randn(1, H, generator=g).to(torch.bfloat16)
    with redirected(library), version.rules_of(LIBRARY_NKI_VERSION):
        from nkilib_src.nkilib.core.rmsnorm.rmsnorm_quant import RmsNormQuantKernelArgs, rmsnorm_quant_kernel
        from nkilib_src.nkilib.core.utils.common_types import NormType, QuantizationType

        kargs = RmsNormQuantKernelArgs(quantization_type=QuantizationType.ROW, lower_bound=0.0,
                                       norm_type=NormType.RMS_NORM, eps=1e-6)
        with counters(trace=True) as c:
            out = launch(rmsnorm_quant_kernel, 2, {"hidden": hidden, "ln_w": gamma, "kargs": kargs,
                                                   "input_dequant_scale": None})
    return c, out, hidden, gamma


def check_rmsnorm_quant(out, hidden, gamma) -> float:
    """The quantised values against RMSNorm-Quant's definition (design spec): y = x / sqrt(mean(x^2) + eps) * gamma
    per row, scale = max|y| / 240, q = y / scale rounded to float8_e4m3; within AWS's test tolerance, |q - ref| <=
    0.072 x max|ref| (its maxAllClose). Returns that relative error. (The 4 bytes per row after the values hold the
    fp32 dequant scale, read back here as fp8 values: checked byte-exactly in tests/kernels/test_emulator_api.py.)"""
    from workbench.kernels.nki_emulator import dtypes

    H = hidden.shape[-1]
    worst, top = 0.0, 0.0
    for r0 in range(0, hidden.shape[1], 1024):  # 1024 rows at a time: the fp8 rounding is memory-hungry
        x = hidden[0, r0:r0 + 1024].float()
        y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * gamma.float()
        scale = y.abs().amax(-1, keepdim=True) / FP8_MAX
        ref = dtypes.values(dtypes.cast(y / scale, dtypes.E4M3)).float()
        worst = max(worst, float((out[0, r0:r0 + 1024, :H].float() - ref).abs().max()))
        top = max(top, float(ref.abs().max()))
    err = worst / top
    if not err <= 0.072:
        raise AssertionError(f"rmsnorm_quant: max |q - ref| / max |ref| = {err:.4f} > 0.072 (AWS's tolerance)")
    return err


# -- the cases -------------------------------------------------------------------------------------------------------
class Case(NamedTuple):
    """One published timing: the kernel written here, its inputs (full or --small), the torch reference, the rates
    of the chip it was published on, the figure (ms; None: none at this shape), SBUF capacity lifted or not;
    `aws`: (S, H) of AWS's own rmsnorm_quant instead (kernel, inputs, reference unused; needs --nki-library)."""

    kernel: object
    inputs: object
    reference: object
    rates: object
    chip: str
    published_ms: float | None
    lifted: bool = False
    aws: tuple | None = None


def _matmul_inputs(small):
    K, M, N = (1024, 2048, 1024) if small else (8192, 4096, 8192)
    g = torch.Generator().manual_seed(0)
    return torch.rand(K, M, generator=g), torch.rand(K, N, generator=g)


CASES = {f"matmul_{v}": Case(k, _matmul_inputs, lambda a, b: a.T @ b, TRN2, "trn2", PUBLISHED_MS[v], v in ("v4", "v5"))
         for v, k in (("v2", v2_tiled), ("v3", v3_hoisted), ("v4", v4_blocked_mn), ("v5", v5_blocked_mnk))}
CASES["layernorm_v1"] = Case(layernorm_v1, _layernorm_inputs, _layernorm_reference, TRN1, "trn1", 2.311)
CASES["layernorm_v2"] = Case(layernorm_v2, _layernorm_inputs, _layernorm_reference, TRN1, "trn1", 1.969)
# the Mamba tutorial: v1 at seq_len 512 (its text), v2 / v3 per seq_len at channels 4096 (its table); --small runs
# channels 256 at seq_len 1024
for _v, _k, _pub in (("v1", mamba_v1, {512: 2.34}), ("v2", mamba_v2, {512: 1.61, 2048: 8.9, 8192: 52.2}),
                     ("v3", mamba_v3, {512: 1.6, 2048: 6.6, 8192: 27.8})):
    for _L, _ms in _pub.items():
        CASES[f"mamba_{_v}_L{_L}"] = Case(_k, lambda small, L=_L: _mamba_inputs(1024 if small else L, small),
                                         _mamba_reference, TRN1, "trn1", _ms)
CASES["mamba_v1_L512_C256"] = Case(mamba_v1, lambda small: _mamba_inputs(512, small, 256), _mamba_reference, TRN1,
                                   "trn1", 0.17293)  # the tutorial's first test case
for (_S, _H), _us in RMSNORM_QUANT_US.items():  # --small: [1, 256, H]
    CASES[f"rmsnorm_quant_{_S // 1024}K_{_H // 1024}K"] = Case(None, None, None, TRN2, "trn2", _us / 1e3, aws=(_S, _H))


def run(name: str, small: bool = False, library: Path | None = None) -> dict:
    """One case: its result checked against torch, its modeled times (ms) under its chip's rates."""
    case = CASES[name]
    t0 = time.perf_counter()
    if case.aws is not None:
        if library is None:
            raise ValueError(f"{name} runs AWS's rmsnorm_quant: pass --nki-library DIR (an aws-neuron/nki-library "
                             "checkout; not shipped)")
        c, out, hidden, gamma = rmsnorm_quant(library, 256 if small else case.aws[0], case.aws[1])
        emulated = time.perf_counter() - t0
        check_rmsnorm_quant(out, hidden, gamma)
    else:
        args = case.inputs(small)
        with compiled_for_lnc(1), counters(trace=True) as c:
            if case.lifted:
                with capacity_lifted():
                    out = case.kernel(*args)
            else:
                out = case.kernel(*args)
        emulated = time.perf_counter() - t0
        torch.testing.assert_close(out, case.reference(*args), rtol=1e-4, atol=1e-3)
    bracket = model(c, case.rates)
    return {"chip": case.chip, "model_ms": round(schedule(c, case.rates).seconds * 1e3, 3),
            "overlap_ms": round(bracket.overlap_s * 1e3, 3), "serial_ms": round(bracket.serial_s * 1e3, 3),
            "bound": bracket.bound, "sbuf_peak_bytes": c.sbuf_peak, "capacity_lifted": case.lifted,
            "emulated_s": round(emulated, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="smaller shapes (no published figure): a quick check")
    parser.add_argument("--cases", default=None, help="comma-separated subset of " + ", ".join(CASES) +
                        " (default: all; the rmsnorm_quant ones only with --nki-library)")
    parser.add_argument("--nki-library", type=Path, default=None, help="an aws-neuron/nki-library checkout, for "
                        "AWS's rmsnorm_quant at its design spec's shapes")
    args = parser.parse_args(argv)
    if args.cases is None:
        args.cases = ",".join(n for n in CASES if args.nki_library or CASES[n].aws is None)
    rows = {}
    print(f"{'case':19s}{'chip':>5s}{'published ms':>14s}{'model ms':>11s}{'model/pub':>11s}{'bracket ms':>22s}  bound")
    for name in args.cases.split(","):
        if name not in CASES:
            parser.error(f"unknown case {name!r}; choose from {', '.join(CASES)}")
        if CASES[name].aws is not None and args.nki_library is None:
            parser.error(f"{name} runs AWS's rmsnorm_quant: pass --nki-library DIR (an aws-neuron/nki-library "
                         "checkout; not shipped)")
        pub = None if args.small else CASES[name].published_ms
        try:
            r = run(name, args.small, args.nki_library)
        except NkiRuleError as exc:  # e.g. sbuf-capacity: the kernel as written does not fit (the hardware spills)
            rows[name] = {"chip": CASES[name].chip, "published_ms": pub, "refused": str(exc).split(" (see ")[0]}
            print(f"{name:19s}{CASES[name].chip:>5s}{pub if pub is not None else '-':>14}  refused: "
                  f"{rows[name]['refused'][:150]}", flush=True)
            continue
        r["published_ms"] = pub
        r["ratio"] = None if pub is None else round(r["model_ms"] / pub, 3)
        rows[name] = r
        note = " (SBUF capacity lifted)" if r["capacity_lifted"] else ""
        print(f"{name:19s}{r['chip']:>5s}{pub if pub is not None else '-':>14}{r['model_ms']:>11.3f}"
              f"{r['ratio'] if r['ratio'] is not None else '-':>11}"
              f"{r['overlap_ms']:>10.3f} .. {r['serial_ms']:<9.3f}  {r['bound']}{note}  [{r['emulated_s']} s]",
              flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
