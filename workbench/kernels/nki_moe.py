"""NKI kernels for the blockwise Qwen3-MoE experts (forward and backward), standalone NKI API, LNC 1 or 2.

Same algorithm as `moe_reference.blockwise_moe`; the host (`autograd.py`) builds the block plan and hands the
kernels int32 tables (design, cost numbers and the block-size sweep: docs/nki_kernels.md). Per block of KB slots:

    forward   gather x rows -> xT (features on partitions) -> gT, uT = W_gate/up[e] @ xT   (fp32 PSUM)
              hT = silu(gT) * uT -> y = h @ W_down[e]^T -> y * affinity -> y_slots rows
              then out[t] = sum_k y_slots[slot_of_assignment[t, k]]
    backward  recompute gT, uT, hT; dh = (dy @ W_down[e])^T; d_affinity = sum_f h * dh;
              dh *= affinity; du = dh * silu(g); dg = dh * u * silu'(g);
              dx_slots = dg @ W_gate[e] + du @ W_up[e]; dW[e] += (per-slot grads)^T @ (block inputs);
              then dx[t] = sum_k dx_slots[slot_of_assignment[t, k]]

How the work is laid out (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/get-started/about/lnc.html,
.../nki/deep-dives/nki-dynamic-loops.html):

* **Segments.** The real blocks (sorted by expert) are cut into *segments*: runs of consecutive blocks with one
  expert. The host gives every core its own list of whole segments (an expert never spans two cores, so the fp32
  dW read-modify-write of an expert has one writer). Core `nl.program_id(0)` runs
  `for s in nl.dynamic_range(n_segments)` -> load the expert's weights once (a few DMAs of >= 2 KiB per partition)
  -> `for b in nl.dynamic_range(begin, end)` over the segment's blocks. Both loops are hardware loops: the body is
  traced once, so the program size does not grow with T, and blocks past the real count are never visited.
  Runtime addresses use `.ap(scalar_offset=<loop register or int32 SBUF [1, 1] tile>)`.
* **LNC.** Launched as `kernel[lnc]`; the host splits the segments across the `lnc` cores (balanced by blocks).
  Shared HBM scratch written by one core and read by the other is fenced by `nisa.core_barrier`.
* **Slot scratch.** Block results go to an io-dtype (bf16 on device) HBM scratch, one row per slot, and the
  combine gathers each token's K rows and sums them in fp32. A scatter-add straight into `out` would avoid the
  scratch but needs a DMA read-modify-write whose two writers (cores, or two k of one token in flight) race; the
  io-dtype scratch halves the old fp32 round trip.
* Weight gradients accumulate across an expert's blocks with a read-modify-write of fp32 HBM rows: one expert's
  dW (3 x D x F fp32, 18 MiB at 30B-A3B) fits neither PSUM nor SBUF next to the resident weights.

Layout rules (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/about/tiling-overview.html): the
matmul contraction dim sits on the partition axis (<= 128) of both operands; stationary free <= 128, moving free
<= 512; results accumulate in fp32 PSUM tiles of <= 2 KiB per partition and are evicted to SBUF. Kernel blocks
hold KB <= 256 slots (token sub-tiles of 128 on the partition axis). Matmul operands use the io dtype; elementwise
math is fp32. The code sticks to the documented NKI Python subset (plain for loops over range, no comprehensions).

Status: runs here through the CPU emulator (`nki_emulator`); nothing here has run on Trainium yet.
"""

from __future__ import annotations

from workbench.kernels.nki_api import nisa, nki, nl

P = nl.tile_size.pmax  # 128 partitions
MOVING_FMAX = nl.tile_size.gemm_moving_fmax  # 512: moving free size, also one fp32 PSUM bank
F32 = nl.float32
I32 = nl.int32


def _ntiles(n, size):
    return (n + size - 1) // size


def _width(n, size, j):
    """Length of tile j when range(n) is cut into tiles of `size` (the last one may be shorter)."""
    return min(size, n - j * size)


# -- data movement -----------------------------------------------------------------------------------------------------
def _load_scalar(table, row0, reg):
    """int32 SBUF [1, 1] <- table[row0 + reg, 0] of an [R, 1] int32 HBM table (reg: a loop register)."""
    tile = nl.ndarray((1, 1), dtype=I32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=table.ap(pattern=[[1, 1], [1, 1]], offset=row0, scalar_offset=reg, indirect_dim=0))
    return tile


def _register(tile):
    reg = nisa.register_alloc()
    nisa.register_load(reg, tile)
    return reg


def _block_column(table, b, s0, sl, dtype):
    """SBUF [sl, 1] <- table[b, s0:s0+sl] of an [NB, KB] HBM table (one value per partition)."""
    tile = nl.ndarray((sl, 1), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=table.ap(pattern=[[1, sl], [1, 1]], offset=s0, scalar_offset=b, indirect_dim=0))
    return tile


def _gather_rows(src, index, rows, dtype):
    """SBUF [rows, C] with row i = src[index[i], :] (indirect DMA; `index` is an int32 SBUF [rows, 1] tile)."""
    cols = src.shape[1]
    tile = nl.ndarray((rows, cols), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src.ap(pattern=[[cols, rows], [1, cols]], offset=0, vector_offset=index,
                                       indirect_dim=0))
    return tile


def _load_expert_matrix(w, e):
    """SBUF [min(P, R), ceil(R / P), C] <- w[e] of an [E, R, C] HBM tensor: row r at [r % P, r // P, :].

    One DMA moves all full 128-row tiles (C * itemsize * R // 128 bytes per partition: 24 KiB for a
    30B-A3B expert matrix), a second one the remainder rows. `e` is an int32 SBUF [1, 1] tile (runtime).
    """
    R, C = w.shape[1], w.shape[2]
    rp = min(P, R)
    nfull = R // rp
    rem = R - nfull * rp
    tile = nl.ndarray((rp, _ntiles(R, rp), C), dtype=w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile[0:rp, 0:nfull, 0:C],
                  src=w.ap(pattern=[[C, rp], [rp * C, nfull], [1, C]], offset=0, scalar_offset=e, indirect_dim=0))
    if rem > 0:
        nisa.dma_copy(dst=tile[0:rem, nfull, 0:C],
                      src=w.ap(pattern=[[C, rem], [1, C]], offset=nfull * rp * C, scalar_offset=e, indirect_dim=0))
    return tile


def _rows_view(t, r0, rows, reg):
    """HBM view t[reg + r0 : reg + r0 + rows, :] of a 2-D tensor (reg: int32 SBUF [1, 1] tile or register)."""
    cols = t.shape[1]
    return t.ap(pattern=[[cols, rows], [1, cols]], offset=r0 * cols, scalar_offset=reg, indirect_dim=0)


def _expert_rows(w, e, r0, rows):
    """HBM view w[e, r0:r0+rows, :] of an [E, R, C] tensor."""
    cols = w.shape[2]
    return w.ap(pattern=[[cols, rows], [1, cols]], offset=r0 * cols, scalar_offset=e, indirect_dim=0)


# -- layout changes (Tensor Engine transposes through PSUM) -------------------------------------------------------------
def _transpose_into(dst, src):
    """SBUF dst [f, p] <- SBUF src [p, f]; p, f <= 128."""
    p, f = src.shape
    staged = nl.ndarray((f, p), dtype=src.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=staged, data=src)
    nisa.tensor_copy(dst=dst, src=staged)


def _feature_major(tok, kb, width, dtype):
    """[min(P, width), n_tiles, kb] SBUF: the block's token-major [sl, width] tiles with features on partitions."""
    n = _ntiles(width, P)
    out = nl.ndarray((min(P, width), n, kb), dtype=dtype, buffer=nl.sbuf)
    for j in range(n):
        fl = _width(width, P, j)
        for s in range(len(tok)):
            sl = _width(kb, P, s)
            _transpose_into(out[0:fl, j, s * P:s * P + sl], tok[s][0:sl, j * P:j * P + fl])
    return out


def _token_major(feature, kb, width, dtype):
    """Inverse of `_feature_major`: one [sl, width] SBUF tile per token sub-tile."""
    out = []
    for s in range(_ntiles(kb, P)):
        sl = _width(kb, P, s)
        tile = nl.ndarray((sl, width), dtype=dtype, buffer=nl.sbuf)
        for j in range(_ntiles(width, P)):
            fl = _width(width, P, j)
            _transpose_into(tile[0:sl, j * P:j * P + fl], feature[0:fl, j, s * P:s * P + sl])
        out.append(tile)
    return out


# -- expert MLP pieces ---------------------------------------------------------------------------------------------------
def _load_block(srcs, token_index, b, kb):
    """Gather the block's rows from each [T+1, D] HBM tensor in `srcs` (padding slots read the zero row T)."""
    loaded = []
    for src in srcs:
        loaded.append([])
    for s in range(_ntiles(kb, P)):
        sl = _width(kb, P, s)
        index = _block_column(token_index, b, s * P, sl, I32)
        for i in range(len(srcs)):
            loaded[i].append(_gather_rows(srcs[i], index, sl, srcs[i].dtype))
    return loaded


def _affinities(slot_weight, b, kb):
    out = []
    for s in range(_ntiles(kb, P)):
        out.append(_block_column(slot_weight, b, s * P, _width(kb, P, s), F32))
    return out


def _project_feature_major(w_res, xT, kb, D, n_out):
    """fp32 SBUF [min(P, n_out), n_tiles, kb] = (x @ W^T)^T; w_res: resident W^T tiles [min(P, D), nD, n_out]."""
    out = nl.ndarray((min(P, n_out), _ntiles(n_out, P), kb), dtype=F32, buffer=nl.sbuf)
    for i in range(_ntiles(n_out, P)):
        fl = _width(n_out, P, i)
        acc = nl.ndarray((fl, kb), dtype=F32, buffer=nl.psum)
        for j in range(_ntiles(D, P)):
            dl = _width(D, P, j)
            nisa.nc_matmul(dst=acc, stationary=w_res[0:dl, j, i * P:i * P + fl], moving=xT[0:dl, j, 0:kb],
                           accumulate=j > 0)
        nisa.tensor_copy(dst=out[0:fl, i, 0:kb], src=acc)
    return out


def _swiglu(gT, uT, F, kb, io_dtype):
    """sig = sigmoid(g), silu = g * sig (fp32) and hT = silu * u (io dtype: it feeds the matmuls)."""
    sig = nl.ndarray(gT.shape, dtype=F32, buffer=nl.sbuf)
    silu = nl.ndarray(gT.shape, dtype=F32, buffer=nl.sbuf)
    hT = nl.ndarray(gT.shape, dtype=io_dtype, buffer=nl.sbuf)
    for i in range(_ntiles(F, P)):
        fl = _width(F, P, i)
        g = gT[0:fl, i, 0:kb]
        nisa.activation(dst=sig[0:fl, i, 0:kb], op=nl.sigmoid, data=g)
        nisa.tensor_tensor(dst=silu[0:fl, i, 0:kb], data1=g, data2=sig[0:fl, i, 0:kb], op=nl.multiply)
        nisa.tensor_tensor(dst=hT[0:fl, i, 0:kb], data1=silu[0:fl, i, 0:kb], data2=uT[0:fl, i, 0:kb],
                           op=nl.multiply)
    return sig, silu, hT


def _combine(out, slots, slot_of_assignment, pid, lnc):
    """out[t] = sum_k slots[slot_of_assignment[t, k]]: K row gathers per token tile, summed in fp32.

    Token tiles are split across the cores; `out` is [nT, TT, D] (tile t at `scalar_offset=t`).
    """
    nT, TT, K = slot_of_assignment.shape
    D = slots.shape[1]
    per = _ntiles(nT, lnc)
    lo = min(nT, pid * per)
    hi = min(nT, lo + per)
    if hi > lo:
        for t in nl.dynamic_range(lo, hi):
            where = nl.ndarray((TT, K), dtype=I32, buffer=nl.sbuf)
            nisa.dma_copy(dst=where, src=slot_of_assignment.ap(pattern=[[K, TT], [1, K]], offset=0, scalar_offset=t,
                                                               indirect_dim=0))
            acc = nl.ndarray((TT, D), dtype=F32, buffer=nl.sbuf)
            for k in range(K):
                part = _gather_rows(slots, where[0:TT, k:k + 1], TT, slots.dtype)
                if k == 0:
                    nisa.tensor_copy(dst=acc, src=part)
                else:
                    nisa.tensor_tensor(dst=acc, data1=acc, data2=part, op=nl.add)
            result = nl.ndarray((TT, D), dtype=out.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=result, src=acc)
            nisa.dma_copy(dst=out.ap(pattern=[[D, TT], [1, D]], offset=0, scalar_offset=t, indirect_dim=0),
                          src=result)


def _segment_bounds(seg_expert, seg_begin, seg_end, row0, s):
    """(expert tile, first block register, end block register) of segment s of this core."""
    e = _load_scalar(seg_expert, row0, s)
    begin = _register(_load_scalar(seg_begin, row0, s))
    end = _register(_load_scalar(seg_end, row0, s))
    return e, begin, end


def _segment_count(seg_count, pid):
    tile = nl.ndarray((1, 1), dtype=I32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=seg_count[pid:pid + 1, 0:1])
    return _register(tile)


# -- forward -------------------------------------------------------------------------------------------------------------
def _forward_block(b, x_pad, token_index, slot_weight, block_row, wgT, wuT, wdT, y_slots, kb):
    io, D, F = x_pad.dtype, x_pad.shape[1], wgT.shape[2]
    row0 = _load_scalar(block_row, 0, b)
    x_tok = _load_block([x_pad], token_index, b, kb)[0]
    affinity = _affinities(slot_weight, b, kb)
    xT = _feature_major(x_tok, kb, D, io)
    gT = _project_feature_major(wgT, xT, kb, D, F)
    uT = _project_feature_major(wuT, xT, kb, D, F)
    hT = _swiglu(gT, uT, F, kb, io)[2]
    for s in range(len(x_tok)):
        sl = _width(kb, P, s)
        y = nl.ndarray((sl, D), dtype=io, buffer=nl.sbuf)
        for c in range(_ntiles(D, MOVING_FMAX)):
            c0, cl = c * MOVING_FMAX, _width(D, MOVING_FMAX, c)
            acc = nl.ndarray((sl, cl), dtype=F32, buffer=nl.psum)
            for i in range(_ntiles(F, P)):
                fl = _width(F, P, i)
                nisa.nc_matmul(dst=acc, stationary=hT[0:fl, i, s * P:s * P + sl], moving=wdT[0:fl, i, c0:c0 + cl],
                               accumulate=i > 0)
            nisa.tensor_scalar(dst=y[0:sl, c0:c0 + cl], data=acc, op0=nl.multiply, operand0=affinity[s])
        nisa.dma_copy(dst=_rows_view(y_slots, s * P, sl, row0), src=y)


@nki.jit
def moe_blockwise_fwd(x_pad, token_index, slot_weight, block_row, seg_expert, seg_begin, seg_end, seg_count,
                      slot_of_assignment, w_gate_t, w_up_t, w_down_t):
    """Blockwise expert MLP forward; launch as `moe_blockwise_fwd[lnc](...)`.

    Args:
        x_pad: [T+1, D] hidden states, row T zeros (read by padding slots); io dtype (bf16 on device).
        token_index: [NB, KB] int32 slot -> token (T on padding slots).
        slot_weight: [NB, KB] fp32 routing affinity per slot (0 on padding).
        block_row: [NB, 1] int32, b * KB (the first slot row of block b).
        seg_expert, seg_begin, seg_end: [lnc * S, 1] int32; core c's segment s at row c * S + s: its expert and
            block range [begin, end). seg_count: [lnc, 1] int32, segments per core.
        slot_of_assignment: [nT, TT, K] int32 slot of each (token, k), tokens in tiles of TT (padded tokens
            point at any real slot; the host drops their rows).
        w_gate_t, w_up_t: [E, D, F] (gate/up weights transposed); w_down_t: [E, F, D] (down transposed).

    Returns:
        out: [nT, TT, D] io dtype, sum over k of affinity * expert_mlp(x).
    """
    pid = nl.program_id(0)
    lnc = nl.num_programs(0)
    nb, kb = token_index.shape
    D = x_pad.shape[1]
    S = seg_expert.shape[0] // lnc
    nT, TT = slot_of_assignment.shape[0], slot_of_assignment.shape[1]
    y_slots = nl.ndarray((nb * kb, D), dtype=x_pad.dtype, buffer=nl.shared_hbm)
    for s in nl.dynamic_range(_segment_count(seg_count, pid)):
        e, begin, end = _segment_bounds(seg_expert, seg_begin, seg_end, pid * S, s)
        wgT = _load_expert_matrix(w_gate_t, e)  # [min(P, D), nD, F], reused by every block of the segment
        wuT = _load_expert_matrix(w_up_t, e)
        wdT = _load_expert_matrix(w_down_t, e)  # [min(P, F), nF, D]
        for b in nl.dynamic_range(begin, end):
            _forward_block(b, x_pad, token_index, slot_weight, block_row, wgT, wuT, wdT, y_slots, kb)
    if lnc > 1:
        nisa.core_barrier(data=y_slots, cores=(0, 1))  # the combine reads rows the other core wrote
    out = nl.ndarray((nT, TT, D), dtype=x_pad.dtype, buffer=nl.shared_hbm)
    _combine(out, y_slots, slot_of_assignment, pid, lnc)
    return out


# -- backward ------------------------------------------------------------------------------------------------------------
def _broadcast_row(slot_weight, b, ones, parts, kb):
    """SBUF [parts, kb] fp32, every partition a copy of slot_weight[b, :]: ones[1, parts]^T @ row on the PE."""
    row = nl.ndarray((1, kb), dtype=F32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=slot_weight.ap(pattern=[[kb, 1], [1, kb]], offset=0, scalar_offset=b, indirect_dim=0))
    acc = nl.ndarray((parts, kb), dtype=F32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=ones[0:1, 0:parts], moving=row, accumulate=False)
    out = nl.ndarray((parts, kb), dtype=F32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=acc)
    return out


def _swiglu_backward(dhT, hT, uT, sig, silu, affinity_b, ones, d_slot, b, kb, F, io_dtype):
    """Feature-major dgT, duT (io dtype) of one block; writes the affinity gradient row d_slot[b, :].

    d_affinity = sum_f h * dh (a partition sum: ones^T @ (h * dh) on the PE);
    then dh *= affinity, du = dh * silu(g), dg = dh * u * (sig + silu * (1 - sig)).
    """
    n_f = hT.shape[1]
    d_aff = nl.ndarray((1, kb), dtype=F32, buffer=nl.psum)
    dgT = nl.ndarray(hT.shape, dtype=io_dtype, buffer=nl.sbuf)
    duT = nl.ndarray(hT.shape, dtype=io_dtype, buffer=nl.sbuf)
    for i in range(n_f):
        fl = _width(F, P, i)
        dh = dhT[0:fl, i, 0:kb]
        h = hT[0:fl, i, 0:kb]
        scaled = nl.ndarray((fl, kb), dtype=F32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=scaled, data1=h, data2=dh, op=nl.multiply)
        nisa.nc_matmul(dst=d_aff, stationary=ones[0:fl, 0:1], moving=scaled, accumulate=i > 0)
        nisa.tensor_tensor(dst=scaled, data1=dh, data2=affinity_b[0:fl, 0:kb], op=nl.multiply)
        nisa.tensor_tensor(dst=duT[0:fl, i, 0:kb], data1=scaled, data2=silu[0:fl, i, 0:kb], op=nl.multiply)
        dsilu = nl.ndarray((fl, kb), dtype=F32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=dsilu, data1=silu[0:fl, i, 0:kb], data2=sig[0:fl, i, 0:kb], op=nl.multiply)
        nisa.tensor_tensor(dst=dsilu, data1=silu[0:fl, i, 0:kb], data2=dsilu, op=nl.subtract)
        nisa.tensor_tensor(dst=dsilu, data1=sig[0:fl, i, 0:kb], data2=dsilu, op=nl.add)
        nisa.tensor_tensor(dst=dsilu, data1=dsilu, data2=uT[0:fl, i, 0:kb], op=nl.multiply)
        nisa.tensor_tensor(dst=dgT[0:fl, i, 0:kb], data1=scaled, data2=dsilu, op=nl.multiply)
    staged = nl.ndarray((1, kb), dtype=F32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=staged, src=d_aff)
    nisa.dma_copy(dst=d_slot.ap(pattern=[[kb, 1], [1, kb]], offset=0, scalar_offset=b, indirect_dim=0), src=staged)
    return dgT, duT


def _dx_block(dx_slots, dgT, duT, wg, wu, row0, kb, D, F, io_dtype):
    """dx_slots rows of the block = dg @ W_gate[e] + du @ W_up[e] (resident natural [min(P, F), nF, D] tiles)."""
    for s in range(_ntiles(kb, P)):
        sl = _width(kb, P, s)
        dx = nl.ndarray((sl, D), dtype=io_dtype, buffer=nl.sbuf)
        for c in range(_ntiles(D, MOVING_FMAX)):
            c0, cl = c * MOVING_FMAX, _width(D, MOVING_FMAX, c)
            acc = nl.ndarray((sl, cl), dtype=F32, buffer=nl.psum)
            for i in range(_ntiles(F, P)):
                fl = _width(F, P, i)
                nisa.nc_matmul(dst=acc, stationary=dgT[0:fl, i, s * P:s * P + sl], moving=wg[0:fl, i, c0:c0 + cl],
                               accumulate=i > 0)
                nisa.nc_matmul(dst=acc, stationary=duT[0:fl, i, s * P:s * P + sl], moving=wu[0:fl, i, c0:c0 + cl],
                               accumulate=True)
            nisa.tensor_copy(dst=dx[0:sl, c0:c0 + cl], src=acc)
        nisa.dma_copy(dst=_rows_view(dx_slots, s * P, sl, row0), src=dx)


def _accumulate_weight_grad(dw, e, lhs_tok, rhs_tok):
    """dw[e] += sum_s lhs_tok[s]^T @ rhs_tok[s] (tokens on partitions; dw an [E, R, C] fp32 HBM accumulator).

    Read-modify-write one [<=128, C] row band at a time (C * 4 bytes per partition per DMA).
    """
    R, C = dw.shape[1], dw.shape[2]
    for r in range(_ntiles(R, P)):
        r0, rl = r * P, _width(R, P, r)
        total = nl.ndarray((rl, C), dtype=F32, buffer=nl.sbuf)
        nisa.dma_copy(dst=total, src=_expert_rows(dw, e, r0, rl))
        for c in range(_ntiles(C, MOVING_FMAX)):
            c0, cl = c * MOVING_FMAX, _width(C, MOVING_FMAX, c)
            acc = nl.ndarray((rl, cl), dtype=F32, buffer=nl.psum)
            for s in range(len(lhs_tok)):
                sl = lhs_tok[s].shape[0]
                nisa.nc_matmul(dst=acc, stationary=lhs_tok[s][0:sl, r0:r0 + rl], moving=rhs_tok[s][0:sl, c0:c0 + cl],
                               accumulate=s > 0)
            nisa.tensor_tensor(dst=total[0:rl, c0:c0 + cl], data1=total[0:rl, c0:c0 + cl], data2=acc, op=nl.add)
        nisa.dma_copy(dst=_expert_rows(dw, e, r0, rl), src=total)


def _block_activation_grads(x_tok, dy_tok, weights, ones, slot_weight, d_slot, b, kb):
    """Recompute the block's forward and return feature-major (hT, dgT, duT); writes d_slot[b, :].

    A helper of its own so xT, dyT, gT, uT, dhT and the SwiGLU intermediates are freed (SBUF) on return.
    """
    wgT, wuT, wd = weights[0], weights[1], weights[2]
    io, D, F = x_tok[0].dtype, x_tok[0].shape[1], wgT.shape[2]
    xT = _feature_major(x_tok, kb, D, io)
    gT = _project_feature_major(wgT, xT, kb, D, F)
    uT = _project_feature_major(wuT, xT, kb, D, F)
    sig, silu, hT = _swiglu(gT, uT, F, kb, io)
    dyT = _feature_major(dy_tok, kb, D, io)
    dhT = _project_feature_major(wd, dyT, kb, D, F)  # (dy @ W_down[e])^T
    affinity_b = _broadcast_row(slot_weight, b, ones, min(P, F), kb)
    dgT, duT = _swiglu_backward(dhT, hT, uT, sig, silu, affinity_b, ones, d_slot, b, kb, F, io)
    return hT, dgT, duT


def _backward_block(b, e, x_pad, dout_pad, token_index, slot_weight, block_row, weights, ones, dx_slots, d_slot,
                    grads, kb):
    dw_gate, dw_up, dw_down = grads
    io, D, F = x_pad.dtype, x_pad.shape[1], weights[0].shape[2]
    row0 = _load_scalar(block_row, 0, b)
    x_tok, dy_tok = _load_block([x_pad, dout_pad], token_index, b, kb)
    affinity = _affinities(slot_weight, b, kb)
    hT, dgT, duT = _block_activation_grads(x_tok, dy_tok, weights, ones, slot_weight, d_slot, b, kb)
    _dx_block(dx_slots, dgT, duT, weights[3], weights[4], row0, kb, D, F, io)
    # weight grads contract over the block's tokens: token-major operands
    dy_scaled = []
    for s in range(len(dy_tok)):
        scaled = nl.ndarray(dy_tok[s].shape, dtype=io, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=scaled, data=dy_tok[s], op0=nl.multiply, operand0=affinity[s])
        dy_scaled.append(scaled)
    _accumulate_weight_grad(dw_gate, e, _token_major(dgT, kb, F, io), x_tok)
    _accumulate_weight_grad(dw_up, e, _token_major(duT, kb, F, io), x_tok)
    _accumulate_weight_grad(dw_down, e, dy_scaled, _token_major(hT, kb, F, io))


def _zero_fill(t, zeros, pid, lnc):
    """Zero this core's share of an [E, R, C] fp32 HBM tensor (experts split across cores), one expert per step."""
    E, R, C = t.shape
    per = _ntiles(E, lnc)
    lo = min(E, pid * per)
    hi = min(E, lo + per)
    if hi > lo:
        for e in nl.dynamic_range(lo, hi):
            for r in range(_ntiles(R, P)):
                rl = _width(R, P, r)
                nisa.dma_copy(dst=t.ap(pattern=[[C, rl], [1, C]], offset=r * P * C, scalar_offset=e, indirect_dim=0),
                              src=zeros[0:rl, 0:C])


def _zero_rows(t, zeros, pid, lnc):
    """Zero this core's share of the rows of a 2-D fp32 HBM tensor."""
    R, C = t.shape
    per = _ntiles(R, lnc)
    lo = min(R, pid * per)
    hi = min(R, lo + per)
    for r0 in range(lo, hi, P):
        rl = min(P, hi - r0)
        nisa.dma_copy(dst=t[r0:r0 + rl, 0:C], src=zeros[0:rl, 0:C])


def _zero_outputs(d_slot, dw_gate, dw_up, dw_down, pid, lnc):
    """Zero this core's share of the gradient outputs; padding blocks and experts without tokens keep the zeros,
    the segment owners overwrite (d_slot) or accumulate into (dW) the rest after the barrier."""
    width = max(d_slot.shape[1], dw_gate.shape[2], dw_down.shape[2])
    zeros = nl.ndarray((P, width), dtype=F32, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)
    _zero_rows(d_slot, zeros, pid, lnc)
    _zero_fill(dw_gate, zeros, pid, lnc)
    _zero_fill(dw_up, zeros, pid, lnc)
    _zero_fill(dw_down, zeros, pid, lnc)


@nki.jit
def moe_blockwise_bwd(x_pad, dout_pad, token_index, slot_weight, block_row, seg_expert, seg_begin, seg_end,
                      seg_count, slot_of_assignment, w_gate, w_up, w_down, w_gate_t, w_up_t):
    """Blockwise expert MLP backward (recomputes the forward activations per block); launch as `[lnc]`.

    Args:
        x_pad, dout_pad: [T+1, D] inputs and output gradient, row T zeros; io dtype.
        token_index, slot_weight, block_row, seg_*, slot_of_assignment: as in `moe_blockwise_fwd`.
        w_gate, w_up: [E, F, D]; w_down: [E, D, F] (torchtitan layouts); w_gate_t, w_up_t: [E, D, F].

    Returns:
        dx [nT, TT, D] (io dtype), d_slot_weight [NB, KB] fp32, dw_gate [E, F, D], dw_up [E, F, D],
        dw_down [E, D, F] (fp32).
    """
    pid = nl.program_id(0)
    lnc = nl.num_programs(0)
    nb, kb = token_index.shape
    D, F = x_pad.shape[1], w_gate.shape[1]
    S = seg_expert.shape[0] // lnc
    nT, TT = slot_of_assignment.shape[0], slot_of_assignment.shape[1]
    io = x_pad.dtype
    dx_slots = nl.ndarray((nb * kb, D), dtype=io, buffer=nl.shared_hbm)
    d_slot = nl.ndarray((nb, kb), dtype=F32, buffer=nl.shared_hbm)
    dw_gate = nl.ndarray(w_gate.shape, dtype=F32, buffer=nl.shared_hbm)
    dw_up = nl.ndarray(w_up.shape, dtype=F32, buffer=nl.shared_hbm)
    dw_down = nl.ndarray(w_down.shape, dtype=F32, buffer=nl.shared_hbm)
    _zero_outputs(d_slot, dw_gate, dw_up, dw_down, pid, lnc)
    if lnc > 1:
        nisa.core_barrier(data=d_slot, cores=(0, 1))
        nisa.core_barrier(data=dw_gate, cores=(0, 1))
        nisa.core_barrier(data=dw_up, cores=(0, 1))
        nisa.core_barrier(data=dw_down, cores=(0, 1))
    ones = nl.ndarray((P, P), dtype=F32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    grads = (dw_gate, dw_up, dw_down)
    for s in nl.dynamic_range(_segment_count(seg_count, pid)):
        e, begin, end = _segment_bounds(seg_expert, seg_begin, seg_end, pid * S, s)
        weights = (_load_expert_matrix(w_gate_t, e), _load_expert_matrix(w_up_t, e),  # [min(P, D), nD, F]
                   _load_expert_matrix(w_down, e),  # [min(P, D), nD, F] natural W_down
                   _load_expert_matrix(w_gate, e), _load_expert_matrix(w_up, e))  # [min(P, F), nF, D]
        for b in nl.dynamic_range(begin, end):
            _backward_block(b, e, x_pad, dout_pad, token_index, slot_weight, block_row, weights, ones, dx_slots,
                            d_slot, grads, kb)
    if lnc > 1:
        nisa.core_barrier(data=dx_slots, cores=(0, 1))
    dx = nl.ndarray((nT, TT, D), dtype=io, buffer=nl.shared_hbm)
    _combine(dx, dx_slots, slot_of_assignment, pid, lnc)
    return dx, d_slot, dw_gate, dw_up, dw_down
