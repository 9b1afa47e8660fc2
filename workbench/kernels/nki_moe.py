"""NKI kernels for the blockwise Qwen3-MoE experts (forward and backward), standalone NKI API.

Same algorithm as `moe_reference.blockwise_moe`; the host (`autograd.py`) builds the block plan and hands the
kernels flat int32 index tensors. Per block of KB slots (one expert e, read at run time from `block_to_expert`):

    forward   gather x rows -> xT (features on partitions) -> gT, uT = W_gate/up[e] @ xT   (fp32 PSUM)
              hT = silu(gT) * uT -> y = h @ W_down[e]^T -> y * affinity -> y_slots rows
              then out[t] = sum_k y_slots[slot_of_assignment[t, k]]
    backward  recompute gT, uT, hT; dh = (dy @ W_down[e])^T; d_affinity = sum_f h * dh;
              dh *= affinity; du = dh * silu(g); dg = dh * u * silu'(g);
              dx_slots = dg @ W_gate[e] + du @ W_up[e]; dW[e] += (per-slot grads)^T @ (block inputs);
              then dx[t] = sum_k dx_slots[slot_of_assignment[t, k]]

Layout rules this follows (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/about/tiling-overview.html):
the matmul contraction dim sits on the partition axis (<= 128) of both operands; stationary free <= 128, moving
free <= 512; results accumulate in fp32 PSUM tiles of <= 2 KiB per partition and are evicted to SBUF.
Block sizes: KB <= 128, or a multiple of 128 up to 512 (token sub-tiles of 128 on the partition axis; the
gate/up matmuls stream all KB tokens as the moving operand). Matmul operands use the input dtype (bf16 on
device); elementwise math is fp32. Weight tiles come from HBM per block through a runtime expert offset
(`.ap(scalar_offset=...)`); token rows are gathered and combined through indirect DMA (`vector_offset`).

Forward takes transposed weight copies (`w_gate_t`/`w_up_t` [E, D, F], `w_down_t` [E, F, D]) so the
contraction dim of every forward matmul is contiguous in HBM; backward uses the natural torchtitan layouts
for dx / dh and the transposed gate/up copies to recompute the forward. Weight gradients accumulate across the
blocks of an expert with a read-modify-write of fp32 HBM accumulators (hence `sequential_range`).

Status: runs here through the CPU emulator (`nki_emulator`); nothing here has run on Trainium yet.
"""

from __future__ import annotations

from workbench.kernels.nki_api import nisa, nki, nl

P = nl.tile_size.pmax  # 128 partitions
MOVING_FMAX = nl.tile_size.gemm_moving_fmax  # 512: moving free size, also one fp32 PSUM bank
F32 = nl.float32


def _spans(n: int, size: int) -> list[tuple[int, int]]:
    """[(start, length)] tiles of `size` covering range(n); the last one may be shorter."""
    return [(s, min(size, n - s)) for s in range(0, n, size)]


# -- data movement -----------------------------------------------------------------------------------------------------
def _load_rows(src, r0, rows, cols, dtype):
    """SBUF [rows, cols] <- contiguous rows r0.. of a 2-D HBM tensor (DMA casts to `dtype`)."""
    tile = nl.ndarray((rows, cols), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src[r0:r0 + rows, 0:cols])
    return tile


def _gather_rows(src, index, rows, dtype):
    """SBUF [rows, C] with row i = src[index[i], :] (indirect DMA; `index` is an int32 SBUF [rows, 1] tile)."""
    cols = src.shape[1]
    tile = nl.ndarray((rows, cols), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src.ap(pattern=[[cols, rows], [1, cols]], offset=0, vector_offset=index,
                                       indirect_dim=0))
    return tile


def _expert_view(w, e, r0, rows, c0, cols):
    """HBM view w[e, r0:r0+rows, c0:c0+cols] of an [E, R, C] tensor, e an int32 SBUF [1, 1] tile (runtime)."""
    width = w.shape[2]
    return w.ap(pattern=[[width, rows], [1, cols]], offset=r0 * width + c0, scalar_offset=e, indirect_dim=0)


def _load_expert_tile(w, e, r0, rows, c0, cols):
    tile = nl.ndarray((rows, cols), dtype=w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=_expert_view(w, e, r0, rows, c0, cols))
    return tile


def _combine(out, slots, slot_of_assignment):
    """out[t] = sum_k slots[slot_of_assignment[t, k]]: gather K rows per token, sum in fp32, cast on the store."""
    T, K = slot_of_assignment.shape
    D = slots.shape[1]
    for t0, tl in _spans(T, P):
        where = _load_rows(slot_of_assignment, t0, tl, K, nl.int32)
        acc = _gather_rows(slots, where[0:tl, 0:1], tl, F32)
        for k in nl.static_range(1, K):
            part = _gather_rows(slots, where[0:tl, k:k + 1], tl, F32)
            nisa.tensor_tensor(dst=acc, data1=acc, data2=part, op=nl.add)
        nisa.dma_copy(dst=out[t0:t0 + tl, 0:D], src=acc)


def _zero_fill(t):
    """Write zeros over an [E, R, C] fp32 HBM tensor (kernel outputs start uninitialised)."""
    E, R, C = t.shape
    zeros = nl.ndarray((min(P, R), min(MOVING_FMAX, C)), dtype=F32, buffer=nl.sbuf)
    nisa.memset(dst=zeros, value=0.0)
    for e in nl.affine_range(E):
        for r0, rl in _spans(R, P):
            for c0, cl in _spans(C, MOVING_FMAX):
                nisa.dma_copy(dst=t[e, r0:r0 + rl, c0:c0 + cl], src=zeros[0:rl, 0:cl])


# -- layout changes (Tensor Engine transposes through PSUM) -------------------------------------------------------------
def _transpose_into(dst, src):
    """SBUF dst [f, p] <- SBUF src [p, f]; p, f <= 128."""
    p, f = src.shape
    staged = nl.ndarray((f, p), dtype=src.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=staged, data=src)
    nisa.tensor_copy(dst=dst, src=staged)


def _feature_major(token_tiles, subs, width, dtype, kb):
    """[min(P, width), n_tiles, kb] SBUF: the block's token-major [sl, width] tiles with features on partitions."""
    tiles = _spans(width, P)
    out = nl.ndarray((min(P, width), len(tiles), kb), dtype=dtype, buffer=nl.sbuf)
    for j, (f0, fl) in enumerate(tiles):
        for s, (s0, sl) in enumerate(subs):
            _transpose_into(out[0:fl, j, s0:s0 + sl], token_tiles[s][0:sl, f0:f0 + fl])
    return out


def _token_major(feature_tile, subs, width, dtype):
    """Inverse of `_feature_major`: one [sl, width] SBUF tile per token sub-tile."""
    out = []
    for s0, sl in subs:
        tile = nl.ndarray((sl, width), dtype=dtype, buffer=nl.sbuf)
        for j, (f0, fl) in enumerate(_spans(width, P)):
            _transpose_into(tile[0:sl, f0:f0 + fl], feature_tile[0:fl, j, s0:s0 + sl])
        out.append(tile)
    return out


# -- expert MLP pieces ---------------------------------------------------------------------------------------------------
def _load_block(src_pads, token_index, b, kb, subs):
    """Gather the block's rows from each [T+1, D] HBM tensor in `src_pads` (padding slots read the zero row T)."""
    index = [_load_rows(token_index, b * kb + s0, sl, 1, nl.int32) for s0, sl in subs]
    return [[_gather_rows(src, index[s], sl, src.dtype) for s, (_, sl) in enumerate(subs)] for src in src_pads]


def _gate_up(xT, e, w_gate_t, w_up_t, kb):
    """gT, uT: fp32 SBUF [min(P, F), n_F, kb] = (x @ W^T)^T for the block's expert, contraction over D tiles."""
    D, F = w_gate_t.shape[1], w_gate_t.shape[2]
    f_tiles = _spans(F, P)
    gT = nl.ndarray((min(P, F), len(f_tiles), kb), dtype=F32, buffer=nl.sbuf)
    uT = nl.ndarray((min(P, F), len(f_tiles), kb), dtype=F32, buffer=nl.sbuf)
    for i, (f0, fl) in enumerate(f_tiles):
        for dst, w in ((gT, w_gate_t), (uT, w_up_t)):
            acc = nl.ndarray((fl, kb), dtype=F32, buffer=nl.psum)
            for j, (d0, dl) in enumerate(_spans(D, P)):
                w_tile = _load_expert_tile(w, e, d0, dl, f0, fl)  # [dl, fl] of W^T
                nisa.nc_matmul(dst=acc, stationary=w_tile, moving=xT[0:dl, j, 0:kb], accumulate=j > 0)
            nisa.tensor_copy(dst=dst[0:fl, i, 0:kb], src=acc)
    return gT, uT


def _swiglu(gT, uT, F, kb, io_dtype):
    """sig = sigmoid(g), silu = g * sig (fp32) and hT = silu * u (io dtype: it feeds the matmuls)."""
    sig = nl.ndarray(gT.shape, dtype=F32, buffer=nl.sbuf)
    silu = nl.ndarray(gT.shape, dtype=F32, buffer=nl.sbuf)
    hT = nl.ndarray(gT.shape, dtype=io_dtype, buffer=nl.sbuf)
    for i, (_, fl) in enumerate(_spans(F, P)):
        g = gT[0:fl, i, 0:kb]
        nisa.activation(dst=sig[0:fl, i, 0:kb], op=nl.sigmoid, data=g)
        nisa.tensor_tensor(dst=silu[0:fl, i, 0:kb], data1=g, data2=sig[0:fl, i, 0:kb], op=nl.multiply)
        nisa.tensor_tensor(dst=hT[0:fl, i, 0:kb], data1=silu[0:fl, i, 0:kb], data2=uT[0:fl, i, 0:kb],
                           op=nl.multiply)
    return sig, silu, hT


def _recompute_block(x_tok, e, w_gate_t, w_up_t, subs, kb, io_dtype):
    """Forward of one block up to the SwiGLU output: (xT, gT, uT, sig, silu, hT), all feature-major."""
    D, F = w_gate_t.shape[1], w_gate_t.shape[2]
    xT = _feature_major(x_tok, subs, D, io_dtype, kb)
    gT, uT = _gate_up(xT, e, w_gate_t, w_up_t, kb)
    sig, silu, hT = _swiglu(gT, uT, F, kb, io_dtype)
    return xT, gT, uT, sig, silu, hT


def _down_chunk(y_slots, hT, e, w_down_t, affinity, subs, row0, c0, cl):
    """y_slots[row0 + s, c0:c0+cl] = affinity * (h @ W_down[e]^T) for one <= 512-wide chunk of D."""
    F = w_down_t.shape[1]
    acc = [nl.ndarray((sl, cl), dtype=F32, buffer=nl.psum) for _, sl in subs]
    for i, (f0, fl) in enumerate(_spans(F, P)):
        w_tile = _load_expert_tile(w_down_t, e, f0, fl, c0, cl)  # [fl, cl] of W_down^T, loaded once per block
        for s, (s0, sl) in enumerate(subs):
            nisa.nc_matmul(dst=acc[s], stationary=hT[0:fl, i, s0:s0 + sl], moving=w_tile, accumulate=i > 0)
    for s, (s0, sl) in enumerate(subs):
        scaled = nl.ndarray((sl, cl), dtype=F32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=scaled, data=acc[s], op0=nl.multiply, operand0=affinity[s])
        nisa.dma_copy(dst=y_slots[row0 + s0:row0 + s0 + sl, c0:c0 + cl], src=scaled)


def _forward_block(b, x_pad, token_index, slot_weight, block_to_expert, w_gate_t, w_up_t, w_down_t, y_slots,
                   subs, kb):
    e = _load_rows(block_to_expert, b, 1, 1, nl.int32)
    (x_tok,) = _load_block([x_pad], token_index, b, kb, subs)
    affinity = [_load_rows(slot_weight, b * kb + s0, sl, 1, F32) for s0, sl in subs]
    hT = _recompute_block(x_tok, e, w_gate_t, w_up_t, subs, kb, x_pad.dtype)[-1]
    for c0, cl in _spans(x_pad.shape[1], MOVING_FMAX):
        _down_chunk(y_slots, hT, e, w_down_t, affinity, subs, b * kb, c0, cl)


@nki.jit
def moe_blockwise_fwd(x_pad, token_index, slot_weight, block_to_expert, slot_of_assignment, w_gate_t, w_up_t,
                      w_down_t):
    """Blockwise expert MLP forward.

    Args:
        x_pad: [T+1, D] hidden states, row T zeros (read by padding slots); io dtype (bf16 on device).
        token_index: [N, 1] int32 slot -> token (T on padding), N = NB * KB.
        slot_weight: [N, 1] fp32 routing affinity per slot (0 on padding).
        block_to_expert: [NB, 1] int32 expert of each block of KB slots.
        slot_of_assignment: [T, K] int32 slot of each (token, k).
        w_gate_t, w_up_t: [E, D, F] (gate/up weights transposed); w_down_t: [E, F, D] (down transposed).

    Returns:
        out: [T, D] io dtype, sum over k of affinity * expert_mlp(x).
    """
    T, _ = slot_of_assignment.shape
    N, D = token_index.shape[0], x_pad.shape[1]
    nb = block_to_expert.shape[0]
    kb = N // nb
    subs = _spans(kb, P)
    y_slots = nl.ndarray((N, D), dtype=F32, buffer=nl.hbm)
    for b in nl.affine_range(nb):  # blocks write disjoint rows of y_slots: no loop-carried dependency
        _forward_block(b, x_pad, token_index, slot_weight, block_to_expert, w_gate_t, w_up_t, w_down_t, y_slots,
                       subs, kb)
    out = nl.ndarray((T, D), dtype=x_pad.dtype, buffer=nl.shared_hbm)
    _combine(out, y_slots, slot_of_assignment)
    return out


# -- backward ------------------------------------------------------------------------------------------------------------
def _broadcast_row(row_hbm, ones, parts, kb):
    """SBUF [parts, kb] fp32, every partition a copy of the [1, kb] HBM row: ones[1, parts]^T @ row on the PE."""
    row = nl.ndarray((1, kb), dtype=F32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=row_hbm)
    acc = nl.ndarray((parts, kb), dtype=F32, buffer=nl.psum)
    nisa.nc_matmul(dst=acc, stationary=ones[0:1, 0:parts], moving=row, accumulate=False)
    out = nl.ndarray((parts, kb), dtype=F32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=acc)
    return out


def _swiglu_backward(dyT, e, w_down, hT, uT, sig, silu, affinity_b, ones, d_slot_row, kb, io_dtype):
    """Feature-major dgT, duT (io dtype) of one block; writes the affinity gradient row d_slot_row [1, kb].

    dh = (dy @ W_down[e])^T; d_affinity = sum_f h * dh (a partition sum: ones^T @ (h * dh) on the PE);
    then dh *= affinity, du = dh * silu(g), dg = dh * u * (sig + silu * (1 - sig)).
    """
    D, F = w_down.shape[1], w_down.shape[2]
    dgT = nl.ndarray(hT.shape, dtype=io_dtype, buffer=nl.sbuf)
    duT = nl.ndarray(hT.shape, dtype=io_dtype, buffer=nl.sbuf)
    d_aff = nl.ndarray((1, kb), dtype=F32, buffer=nl.psum)
    for i, (f0, fl) in enumerate(_spans(F, P)):
        dh = nl.ndarray((fl, kb), dtype=F32, buffer=nl.psum)
        for j, (d0, dl) in enumerate(_spans(D, P)):
            w_tile = _load_expert_tile(w_down, e, d0, dl, f0, fl)  # [dl, fl] of W_down (natural layout)
            nisa.nc_matmul(dst=dh, stationary=w_tile, moving=dyT[0:dl, j, 0:kb], accumulate=j > 0)
        cols = (slice(0, fl), i, slice(0, kb))
        scaled = nl.ndarray((fl, kb), dtype=F32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=scaled, data1=hT[cols], data2=dh, op=nl.multiply)
        nisa.nc_matmul(dst=d_aff, stationary=ones[0:fl, 0:1], moving=scaled, accumulate=i > 0)
        nisa.tensor_tensor(dst=scaled, data1=dh, data2=affinity_b[0:fl, 0:kb], op=nl.multiply)
        nisa.tensor_tensor(dst=duT[cols], data1=scaled, data2=silu[cols], op=nl.multiply)
        dsilu = nl.ndarray((fl, kb), dtype=F32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=dsilu, data1=silu[cols], data2=sig[cols], op=nl.multiply)
        nisa.tensor_tensor(dst=dsilu, data1=silu[cols], data2=dsilu, op=nl.subtract)
        nisa.tensor_tensor(dst=dsilu, data1=sig[cols], data2=dsilu, op=nl.add)
        nisa.tensor_tensor(dst=dsilu, data1=dsilu, data2=uT[cols], op=nl.multiply)
        nisa.tensor_tensor(dst=dgT[cols], data1=scaled, data2=dsilu, op=nl.multiply)
    staged = nl.ndarray((1, kb), dtype=F32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=staged, src=d_aff)
    nisa.dma_copy(dst=d_slot_row, src=staged)
    return dgT, duT


def _dx_chunk(dx_slots, dgT, duT, e, w_gate, w_up, subs, row0, c0, cl):
    """dx_slots[row0 + s, c0:c0+cl] = dg @ W_gate[e] + du @ W_up[e] (one PSUM accumulation group per sub-tile)."""
    F = w_gate.shape[1]
    acc = [nl.ndarray((sl, cl), dtype=F32, buffer=nl.psum) for _, sl in subs]
    for i, (f0, fl) in enumerate(_spans(F, P)):
        for which, (dT, w) in enumerate(((dgT, w_gate), (duT, w_up))):
            w_tile = _load_expert_tile(w, e, f0, fl, c0, cl)  # [fl, cl] of W (natural [E, F, D] layout)
            for s, (s0, sl) in enumerate(subs):
                nisa.nc_matmul(dst=acc[s], stationary=dT[0:fl, i, s0:s0 + sl], moving=w_tile,
                               accumulate=i + which > 0)
    for s, (s0, sl) in enumerate(subs):
        staged = nl.ndarray((sl, cl), dtype=F32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=staged, src=acc[s])
        nisa.dma_copy(dst=dx_slots[row0 + s0:row0 + s0 + sl, c0:c0 + cl], src=staged)


def _accumulate_weight_grad(dw, e, lhs_tok, rhs_tok, subs):
    """dw[e] += sum_s lhs_tok[s]^T @ rhs_tok[s] (tokens on partitions; dw is an [E, R, C] fp32 HBM accumulator)."""
    R, C = dw.shape[1], dw.shape[2]
    for r0, rl in _spans(R, P):
        for c0, cl in _spans(C, MOVING_FMAX):
            acc = nl.ndarray((rl, cl), dtype=F32, buffer=nl.psum)
            for s, (_, sl) in enumerate(subs):
                nisa.nc_matmul(dst=acc, stationary=lhs_tok[s][0:sl, r0:r0 + rl], moving=rhs_tok[s][0:sl, c0:c0 + cl],
                               accumulate=s > 0)
            view = _expert_view(dw, e, r0, rl, c0, cl)
            total = nl.ndarray((rl, cl), dtype=F32, buffer=nl.sbuf)
            nisa.dma_copy(dst=total, src=view)
            nisa.tensor_tensor(dst=total, data1=total, data2=acc, op=nl.add)
            nisa.dma_copy(dst=view, src=total)


def _backward_block(b, x_pad, dout_pad, token_index, slot_weight, slot_weight_row, block_to_expert, w_gate, w_up,
                    w_down, w_gate_t, w_up_t, ones, dx_slots, d_slot, dw_gate, dw_up, dw_down, subs, kb):
    io_dtype = x_pad.dtype
    D, F = x_pad.shape[1], w_gate.shape[1]
    e = _load_rows(block_to_expert, b, 1, 1, nl.int32)
    x_tok, dy_tok = _load_block([x_pad, dout_pad], token_index, b, kb, subs)
    affinity = [_load_rows(slot_weight, b * kb + s0, sl, 1, F32) for s0, sl in subs]
    _, gT, uT, sig, silu, hT = _recompute_block(x_tok, e, w_gate_t, w_up_t, subs, kb, io_dtype)
    dyT = _feature_major(dy_tok, subs, D, io_dtype, kb)
    affinity_b = _broadcast_row(slot_weight_row[b:b + 1, 0:kb], ones, min(P, F), kb)
    dgT, duT = _swiglu_backward(dyT, e, w_down, hT, uT, sig, silu, affinity_b, ones, d_slot[b:b + 1, 0:kb], kb,
                                io_dtype)
    for c0, cl in _spans(D, MOVING_FMAX):
        _dx_chunk(dx_slots, dgT, duT, e, w_gate, w_up, subs, b * kb, c0, cl)
    # weight grads contract over the block's tokens: token-major operands
    dY_tok = []
    for s, (_, sl) in enumerate(subs):
        scaled = nl.ndarray((sl, D), dtype=io_dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=scaled, data=dy_tok[s], op0=nl.multiply, operand0=affinity[s])
        dY_tok.append(scaled)
    _accumulate_weight_grad(dw_gate, e, _token_major(dgT, subs, F, io_dtype), x_tok, subs)
    _accumulate_weight_grad(dw_up, e, _token_major(duT, subs, F, io_dtype), x_tok, subs)
    _accumulate_weight_grad(dw_down, e, dY_tok, _token_major(hT, subs, F, io_dtype), subs)


@nki.jit
def moe_blockwise_bwd(x_pad, dout_pad, token_index, slot_weight, slot_weight_row, block_to_expert,
                      slot_of_assignment, w_gate, w_up, w_down, w_gate_t, w_up_t):
    """Blockwise expert MLP backward (recomputes the forward activations per block).

    Args:
        x_pad, dout_pad: [T+1, D] inputs and output gradient, row T zeros; io dtype.
        token_index, slot_weight, block_to_expert, slot_of_assignment: as in `moe_blockwise_fwd`.
        slot_weight_row: [NB, KB] fp32, the same affinities laid out one block per row.
        w_gate, w_up: [E, F, D]; w_down: [E, D, F] (torchtitan layouts); w_gate_t, w_up_t: [E, D, F].

    Returns:
        dx [T, D] (io dtype), d_slot_weight [NB, KB] fp32, dw_gate [E, F, D], dw_up [E, F, D],
        dw_down [E, D, F] (fp32).
    """
    T, _ = slot_of_assignment.shape
    N, D = token_index.shape[0], x_pad.shape[1]
    nb, kb = slot_weight_row.shape
    subs = _spans(kb, P)
    dx_slots = nl.ndarray((N, D), dtype=F32, buffer=nl.hbm)
    d_slot = nl.ndarray((nb, kb), dtype=F32, buffer=nl.shared_hbm)
    dw_gate = nl.ndarray(w_gate.shape, dtype=F32, buffer=nl.shared_hbm)
    dw_up = nl.ndarray(w_up.shape, dtype=F32, buffer=nl.shared_hbm)
    dw_down = nl.ndarray(w_down.shape, dtype=F32, buffer=nl.shared_hbm)
    for dw in (dw_gate, dw_up, dw_down):
        _zero_fill(dw)
    ones = nl.ndarray((P, P), dtype=F32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    for b in nl.sequential_range(nb):  # read-modify-write of dw[e] across blocks: loop-carried
        _backward_block(b, x_pad, dout_pad, token_index, slot_weight, slot_weight_row, block_to_expert, w_gate, w_up,
                        w_down, w_gate_t, w_up_t, ones, dx_slots, d_slot, dw_gate, dw_up, dw_down, subs, kb)
    dx = nl.ndarray((T, D), dtype=x_pad.dtype, buffer=nl.shared_hbm)
    _combine(dx, dx_slots, slot_of_assignment)
    return dx, d_slot, dw_gate, dw_up, dw_down
