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

How the work is laid out (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/get-started/about/lnc.html,
.../nki/deep-dives/nki-loops.html), NKI 0.7.0 (Neuron SDK 2.33):

* **Segments and pieces.** Each expert's slots are padded to a multiple of G = 32 only (the host plan); the
  expert's slot groups run as full blocks of KB slots, then its tail as at most one piece each of KB/2, ..., G
  slots (the binary digits of the leftover group count). One segment per non-empty expert, on one core (an
  expert never spans two cores, so the fp32 dW read-modify-write of an expert has one writer). Core
  `nl.program_id(0)` runs `nl.fori_loop(0, n_positions, segment)` -> load the expert's weights once (a few DMAs of
  >= 2 KiB per partition) -> per piece class k (KB >> k slots) `nl.fori_loop(begin_k, end_k, piece)` over the
  segment's rows of `piece`. All are compiled loops: each body is traced once (one body per piece class), so the
  program size does not grow with T. Runtime addresses use `.ap(scalar_offset=<loop register or int32 SBUF
  [1, 1] tile>)`.
* **The same trip counts on every core** (LNC page: control flow that differs between the cores is undefined).
  Both cores run the same number of segment positions and, at each position, the same number of pieces of each
  class; where a core has fewer real pieces than the other it runs no-op pieces (zero rows of x, slot weight 0,
  its own scratch slot rows: they add exact zeros to its expert's dW). The host deals experts to cores sorted by
  group count, so the two experts of a position mostly have equal piece counts (30B-A3B layer: 6 no-op pieces
  beside 212 real ones at KB 256; why this and not AWS's shared-count-with-barriers pattern: docs/nki_kernels.md).
  The zero fill splits every expert's rows, the combine a tile count padded to a multiple of the LNC.
* **F chunks.** When an expert's resident matrices exceed RESIDENT_WEIGHT_BYTES per partition (D = 4096), the
  weights are kept resident one F chunk at a time (chunk loop between the segment and piece loops); y, dx and
  d_affinity accumulate their partial sums over chunks in fp32 slot scratch, dW rows/columns of a chunk are
  disjoint.
* **LNC.** Launched as `kernel[lnc]`, lnc the compiler's (`workbench.device.logical_nc_config()`); shared HBM
  scratch written by one core and read by the other is fenced by `nisa.core_barrier`.
* **Slot scratch.** Block results go to an io-dtype (bf16 on device) HBM scratch, one row per slot, and the
  combine gathers each token's K rows and sums them in fp32. A scatter-add straight into `out` would avoid the
  scratch but needs a DMA read-modify-write whose two writers (cores, or two k of one token in flight) race; the
  io-dtype scratch halves the old fp32 round trip.
* Weight gradients accumulate across an expert's blocks with a read-modify-write of fp32 HBM rows: one expert's
  dW (3 x D x F fp32, 18 MiB at 30B-A3B) fits neither PSUM nor SBUF next to the resident weights.

Layout rules (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/about/tiling-overview.html): the
matmul contraction dim sits on the partition axis (<= 128) of both operands; stationary free <= 128, moving free
<= 512; results accumulate in fp32 PSUM tiles of <= 2 KiB per partition and are evicted to SBUF. Kernel blocks
hold KB <= 256 slots (token sub-tiles of 128 on the partition axis); tail pieces are 32..KB/2 slots. Matmul
operands use the io dtype; elementwise math is fp32. The code sticks to the documented NKI Python subset (plain
for loops over range, no comprehensions).

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
def _load_entry(table, row0, col, reg):
    """int32 SBUF [1, 1] <- table[row0 + reg, col] of an [R, C] int32 HBM table (reg: a loop register)."""
    tile = nl.ndarray((1, 1), dtype=I32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=table.ap(pattern=[[1, 1], [1, 1]], offset=row0 * table.shape[1] + col,
                                         scalar_offset=reg, indirect_dim=0))
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


def _load_expert_matrix(w, e, r0, R, c0, C):
    """SBUF [min(P, R), ceil(R / P), C] <- w[e, r0:r0+R, c0:c0+C] of an [E, Rt, Ct] HBM tensor: row r of the
    window at [r % P, r // P, :].

    One DMA moves all full 128-row tiles (C * itemsize * R // 128 bytes per partition: 24 KiB for a whole
    30B-A3B expert matrix, or for a 384-wide F chunk at D = 4096), a second one the remainder rows. `e` is an
    int32 SBUF [1, 1] tile (runtime).
    """
    Ct = w.shape[2]
    rp = min(P, R)
    nfull = R // rp
    rem = R - nfull * rp
    tile = nl.ndarray((rp, _ntiles(R, rp), C), dtype=w.dtype, buffer=nl.sbuf, name="w_resident")
    nisa.dma_copy(dst=tile[0:rp, 0:nfull, 0:C], src=w.ap(pattern=[[Ct, rp], [rp * Ct, nfull], [1, C]],
                                                         offset=r0 * Ct + c0, scalar_offset=e, indirect_dim=0))
    if rem > 0:
        nisa.dma_copy(dst=tile[0:rem, nfull, 0:C], src=w.ap(pattern=[[Ct, rem], [1, C]],
                                                            offset=(r0 + nfull * rp) * Ct + c0, scalar_offset=e,
                                                            indirect_dim=0))
    return tile


def _expert_window(w, e, r0, rows, c0, cols):
    """HBM view w[e, r0:r0+rows, c0:c0+cols] of an [E, R, C] tensor."""
    Ct = w.shape[2]
    return w.ap(pattern=[[Ct, rows], [1, cols]], offset=r0 * Ct + c0, scalar_offset=e, indirect_dim=0)


# -- F chunks: how much of an expert's weights is resident at once ---------------------------------------------------
# SBUF is 224 KiB per partition (trn2). The resident expert weights get at most this much; the rest holds one
# block's workspace (x / dy token tiles, xT, the fp32 dW row band, ...: <= 80 KiB at D = 4096, KB = 256).
RESIDENT_WEIGHT_BYTES = 144 * 1024


def _resident_bytes(D, fc, itemsize, n_mats):
    """Bytes/partition of n_mats resident [D, fc] expert matrices (either layout: [D/128, fc] or [fc/128, D])."""
    return n_mats * max(_ntiles(D, P) * fc, _ntiles(fc, P) * D) * itemsize


def _f_chunk(D, F, itemsize, n_mats):
    """Width of the F chunk a kernel keeps resident: F when all n_mats matrices fit RESIDENT_WEIGHT_BYTES, else the
    widest multiple of 128 that fits (at least 128). Chunks are processed one after the other per expert segment;
    the F-contractions (y, dx, d_affinity) accumulate their partial sums across chunks (docs/nki_kernels.md)."""
    if _resident_bytes(D, F, itemsize, n_mats) <= RESIDENT_WEIGHT_BYTES or F <= P:
        return F
    fc = P
    for n in range(2, F // P + 1):
        if _resident_bytes(D, n * P, itemsize, n_mats) <= RESIDENT_WEIGHT_BYTES:
            fc = n * P
    return fc


# -- workspace: every SBUF/PSUM tile a block needs, allocated once per kernel and reused by every block ----------------
# A compiled loop body is traced once, so every tile it allocates is one fixed buffer for the whole loop; allocating
# the working tiles up front and reusing them across phases (xT then dyT, gT then dhT, ...) is what keeps the
# backward's resident weights plus one block inside SBUF, and the PSUM tiles inside 3 of the 8 banks.
def _psum_pool(io_dtype):
    return {
        "t": nl.ndarray((P, P), dtype=io_dtype, buffer=nl.psum, name="psum_transpose"),
        "acc": nl.ndarray((P, MOVING_FMAX), dtype=F32, buffer=nl.psum, name="psum_acc"),
        "aff": nl.ndarray((1, MOVING_FMAX), dtype=F32, buffer=nl.psum, name="psum_affinity_grad"),
    }


def _block_tiles(kb, width, dtype, name):
    """One [sl, width] SBUF tile per 128-token sub-tile of a block (tokens on partitions)."""
    tiles = []
    for s in range(_ntiles(kb, P)):
        tiles.append(nl.ndarray((_width(kb, P, s), width), dtype=dtype, buffer=nl.sbuf, name=name))
    return tiles


def _workspace(kb, D, F, io_dtype, backward, slot_dtype, chunked):
    """F: the F-chunk width; chunked: F is split (partial sums accumulate in the slot scratch, then fp32)."""
    dp, fp, nD, nF = min(P, D), min(P, F), _ntiles(D, P), _ntiles(F, P)
    ws = {
        "x": _block_tiles(kb, D, io_dtype, "x_tok"),
        "xT": nl.ndarray((dp, nD, kb), dtype=io_dtype, buffer=nl.sbuf, name="xT"),  # backward: then dyT
        "g": nl.ndarray((fp, nF, kb), dtype=F32, buffer=nl.sbuf, name="gT"),  # backward: then dhT
        "u": nl.ndarray((fp, nF, kb), dtype=F32, buffer=nl.sbuf, name="uT"),
        "sig": nl.ndarray((fp, nF, kb), dtype=F32, buffer=nl.sbuf, name="sigT"),
        "silu": nl.ndarray((fp, nF, kb), dtype=F32, buffer=nl.sbuf, name="siluT"),
        "h": nl.ndarray((fp, nF, kb), dtype=io_dtype, buffer=nl.sbuf, name="hT"),
        "chunk": nl.ndarray((P, MOVING_FMAX), dtype=slot_dtype, buffer=nl.sbuf, name="out_chunk"),
    }
    if chunked:  # F chunked: later chunks add to the partial sums already in the slot scratch
        ws["prev"] = nl.ndarray((P, MOVING_FMAX), dtype=F32, buffer=nl.sbuf, name="partial_sum")
    if backward:
        ws["dy"] = _block_tiles(kb, D, io_dtype, "dy_tok")
        ws["dg"] = nl.ndarray((fp, nF, kb), dtype=io_dtype, buffer=nl.sbuf, name="dgT")
        ws["du"] = nl.ndarray((fp, nF, kb), dtype=io_dtype, buffer=nl.sbuf, name="duT")
        ws["tmp1"] = nl.ndarray((fp, kb), dtype=F32, buffer=nl.sbuf, name="tmp1")
        ws["tmp2"] = nl.ndarray((fp, kb), dtype=F32, buffer=nl.sbuf, name="tmp2")
        ws["aff_b"] = nl.ndarray((fp, kb), dtype=F32, buffer=nl.sbuf, name="affinity_bcast")
        ws["row"] = nl.ndarray((1, kb), dtype=F32, buffer=nl.sbuf, name="row")
        ws["row2"] = nl.ndarray((1, kb), dtype=F32, buffer=nl.sbuf, name="row_partial")
        ws["tok"] = _block_tiles(kb, F, io_dtype, "grad_tok")  # dg, then du, then h, token-major
        ws["band"] = nl.ndarray((P, max(D, F)), dtype=F32, buffer=nl.sbuf, name="dw_band")
        ws["ones"] = nl.ndarray((P, P), dtype=F32, buffer=nl.sbuf, name="ones")
        nisa.memset(dst=ws["ones"], value=1.0)
    return ws


def _ws_view(ws, kb):
    """The workspace cut to a kb-slot piece (kb <= the workspace's block): every per-slot tile sliced to kb."""
    v = {}
    for key in ("x", "dy", "tok"):
        if key in ws:
            tiles = []
            for s in range(_ntiles(kb, P)):
                t = ws[key][s]
                tiles.append(t[0:_width(kb, P, s), 0:t.shape[1]])
            v[key] = tiles
    for key in ("xT", "g", "u", "sig", "silu", "h", "dg", "du"):
        if key in ws:
            t = ws[key]
            v[key] = t[0:t.shape[0], 0:t.shape[1], 0:kb]
    for key in ("tmp1", "tmp2", "aff_b", "row", "row2"):
        if key in ws:
            v[key] = ws[key][0:ws[key].shape[0], 0:kb]
    for key in ("chunk", "prev", "band", "ones"):
        if key in ws:
            v[key] = ws[key]
    return v


def _piece_widths(token_index, seg_table):
    """Slots per piece of each piece class: KB, KB/2, ..., G (G = token_index.shape[1], one class per column
    pair of seg_table after the expert column)."""
    G = token_index.shape[1]
    L = (seg_table.shape[1] - 1) // 2
    widths = []
    for k in range(L):
        widths.append(G * 2 ** (L - 1 - k))
    return widths


# -- layout changes (Tensor Engine transposes through PSUM) ------------------------------------------------------------
def _transpose_into(dst, src, ps):
    """SBUF dst [f, p] <- SBUF src [p, f]; p, f <= 128."""
    p, f = src.shape
    staged = ps["t"][0:f, 0:p]
    nisa.nc_transpose(dst=staged, data=src)
    nisa.tensor_copy(dst=dst, src=staged)


def _feature_major(out, tok, kb, width, ps):
    """out [min(P, width), n_tiles, kb] <- the block's token-major [sl, width] tiles, features on partitions."""
    for j in range(_ntiles(width, P)):
        fl = _width(width, P, j)
        for s in range(len(tok)):
            sl = _width(kb, P, s)
            _transpose_into(out[0:fl, j, s * P:s * P + sl], tok[s][0:sl, j * P:j * P + fl], ps)


def _token_major(tiles, feature, kb, width, ps):
    """Inverse of `_feature_major`: fill one [sl, width] tile per token sub-tile."""
    for s in range(len(tiles)):
        sl = _width(kb, P, s)
        for j in range(_ntiles(width, P)):
            fl = _width(width, P, j)
            _transpose_into(tiles[s][0:sl, j * P:j * P + fl], feature[0:fl, j, s * P:s * P + sl], ps)


# -- expert MLP pieces -------------------------------------------------------------------------------------------------
def _gather_into(dst, src, index):
    """dst [rows, C] with row i = src[index[i], :] (indirect DMA; `index` an int32 SBUF [rows, 1] tile)."""
    rows, cols = dst.shape[0], src.shape[1]
    nisa.dma_copy(dst=dst, src=src.ap(pattern=[[cols, rows], [1, cols]], offset=0, vector_offset=index,
                                      indirect_dim=0))


def _load_block(dsts, srcs, token_index, b, kb):
    """Gather the block's rows of each [T+1, D] HBM tensor in `srcs` (padding slots read the zero row T)."""
    for s in range(_ntiles(kb, P)):
        index = _block_column(token_index, b, s * P, _width(kb, P, s), I32)
        for i in range(len(srcs)):
            _gather_into(dsts[i][s], srcs[i], index)


def _affinities(slot_weight, b, kb):
    out = []
    for s in range(_ntiles(kb, P)):
        out.append(_block_column(slot_weight, b, s * P, _width(kb, P, s), F32))
    return out


def _project(out, w_res, xT, kb, D, n_out, ps):
    """out (fp32 [min(P, n_out), n_tiles, kb]) = (x @ W^T)^T; w_res: resident W^T tiles [min(P, D), nD, n_out]."""
    for i in range(_ntiles(n_out, P)):
        fl = _width(n_out, P, i)
        acc = ps["acc"][0:fl, 0:kb]
        for j in range(_ntiles(D, P)):
            dl = _width(D, P, j)
            nisa.nc_matmul(dst=acc, stationary=w_res[0:dl, j, i * P:i * P + fl], moving=xT[0:dl, j, 0:kb],
                           accumulate=j > 0)
        nisa.tensor_copy(dst=out[0:fl, i, 0:kb], src=acc)


def _swiglu(ws, F, kb):
    """sig = sigmoid(g), silu = g * sig (fp32) and hT = silu * u (io dtype: it feeds the matmuls)."""
    for i in range(_ntiles(F, P)):
        fl = _width(F, P, i)
        g, sig, silu = ws["g"][0:fl, i, 0:kb], ws["sig"][0:fl, i, 0:kb], ws["silu"][0:fl, i, 0:kb]
        nisa.activation(dst=sig, op=nl.sigmoid, data=g)
        nisa.tensor_tensor(dst=silu, data1=g, data2=sig, op=nl.multiply)
        nisa.tensor_tensor(dst=ws["h"][0:fl, i, 0:kb], data1=silu, data2=ws["u"][0:fl, i, 0:kb], op=nl.multiply)


def _recompute(ws, w_gate_res, w_up_res, kb, D, F, ps):
    _feature_major(ws["xT"], ws["x"], kb, D, ps)
    _project(ws["g"], w_gate_res, ws["xT"], kb, D, F, ps)
    _project(ws["u"], w_up_res, ws["xT"], kb, D, F, ps)
    _swiglu(ws, F, kb)


def _combine(out, slots, slot_of_assignment, pid, lnc):
    """out[t] = sum_k slots[slot_of_assignment[t, k]]: K row gathers per token tile, summed in fp32.

    Token tiles are split across the cores, the same number per core (the host pads the tile count to a multiple
    of the LNC: one trip count for both cores); `out` is [nT, TT, D] (tile t at `scalar_offset=t`).
    """
    nT, TT, K = slot_of_assignment.shape
    D = slots.shape[1]
    assert nT % lnc == 0, f"{nT} token tiles for {lnc} cores: the host pads the tile count to a multiple of the LNC"
    per = nT // lnc
    where = nl.ndarray((TT, K), dtype=I32, buffer=nl.sbuf, name="slot_of_assignment")
    part = nl.ndarray((TT, D), dtype=slots.dtype, buffer=nl.sbuf, name="slot_rows")
    acc = nl.ndarray((TT, D), dtype=F32, buffer=nl.sbuf, name="combine_acc")
    result = nl.ndarray((TT, D), dtype=out.dtype, buffer=nl.sbuf, name="combined")

    def token_tile(t):
        nisa.dma_copy(dst=where, src=slot_of_assignment.ap(pattern=[[K, TT], [1, K]], offset=0, scalar_offset=t,
                                                           indirect_dim=0))
        for k in range(K):
            _gather_into(part, slots, where[0:TT, k:k + 1])
            if k == 0:
                nisa.tensor_copy(dst=acc, src=part)
            else:
                nisa.tensor_tensor(dst=acc, data1=acc, data2=part, op=nl.add)
        nisa.tensor_copy(dst=result, src=acc)
        nisa.dma_copy(dst=out.ap(pattern=[[D, TT], [1, D]], offset=0, scalar_offset=t, indirect_dim=0), src=result)

    nl.fori_loop(pid * per, (pid + 1) * per, token_tile)


def _class_bounds(seg_table, row0, k, s):
    """(first, end) piece-table rows of class k of segment s of this core, as loop registers."""
    begin = _register(_load_entry(seg_table, row0, 1 + 2 * k, s))
    end = _register(_load_entry(seg_table, row0, 2 + 2 * k, s))
    return begin, end


def _segment_count(seg_count):
    """The number of segment positions, one count shared by every core (a register)."""
    tile = nl.ndarray((1, 1), dtype=I32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=seg_count[0:1, 0:1])
    return _register(tile)


def _slot_window(slots, row0, s0, sl, c0, cl):
    """HBM view slots[row0 + s0 : row0 + s0 + sl, c0 : c0 + cl] (row0 an int32 SBUF [1, 1] tile)."""
    D = slots.shape[1]
    return slots.ap(pattern=[[D, sl], [1, cl]], offset=s0 * D + c0, scalar_offset=row0, indirect_dim=0)


def _emit(dst_slots, acc, scale, ws, row0, s0, sl, c0, cl, first):
    """Slot rows [s0, s0 + sl) x columns [c0, c0 + cl) of the block: = acc * scale (scale None: acc) for the first
    F chunk, += for later chunks (read-modify-write of the fp32 scratch; the rows belong to this core's block)."""
    chunk = ws["chunk"][0:sl, 0:cl]
    if scale is None:
        nisa.tensor_copy(dst=chunk, src=acc)
    else:
        nisa.tensor_scalar(dst=chunk, data=acc, op0=nl.multiply, operand0=scale)
    if not first:
        prev = ws["prev"][0:sl, 0:cl]
        nisa.dma_copy(dst=prev, src=_slot_window(dst_slots, row0, s0, sl, c0, cl))
        nisa.tensor_tensor(dst=chunk, data1=chunk, data2=prev, op=nl.add)
    nisa.dma_copy(dst=_slot_window(dst_slots, row0, s0, sl, c0, cl), src=chunk)


# -- forward -----------------------------------------------------------------------------------------------------------
def _forward_block(grp, row0, hbm, w, ws, ps, kb, first):
    """One kb-slot piece starting at slot row0 (= grp * G; grp indexes the [NG, G] slot tables) against one F
    chunk (w: W_gate^T, W_up^T and W_down^T of that chunk, resident)."""
    D, F = hbm["x"].shape[1], w[0].shape[2]
    _load_block([ws["x"]], [hbm["x"]], hbm["index"], grp, kb)
    affinity = _affinities(hbm["weight"], grp, kb)
    _recompute(ws, w[0], w[1], kb, D, F, ps)
    for s in range(len(ws["x"])):
        sl = _width(kb, P, s)
        for c in range(_ntiles(D, MOVING_FMAX)):
            c0, cl = c * MOVING_FMAX, _width(D, MOVING_FMAX, c)
            acc = ps["acc"][0:sl, 0:cl]
            for i in range(_ntiles(F, P)):
                fl = _width(F, P, i)
                nisa.nc_matmul(dst=acc, stationary=ws["h"][0:fl, i, s * P:s * P + sl],
                               moving=w[2][0:fl, i, c0:c0 + cl], accumulate=i > 0)
            _emit(hbm["slots"], acc, affinity[s], ws, row0, s * P, sl, c0, cl, first)


def _pieces(piece, begin, end, e, hbm, w, ws, ps, kb, f0, first, backward):
    """Rows [begin, end) of `piece` (registers), all of one width class kb, against the resident F chunk `w` of
    expert e: a compiled loop whose body (one kb-slot block, forward or backward) is traced once."""

    def body(j):
        grp = _load_entry(piece, 0, 0, j)
        row0 = _load_entry(piece, 0, 1, j)
        if backward:
            _backward_block(grp, row0, e, hbm, w, ws, ps, kb, f0, first)
        else:
            _forward_block(grp, row0, hbm, w, ws, ps, kb, first)

    nl.fori_loop(begin, end, body)


def _expert_segments(pid, S, hbm, piece, seg_table, seg_count, mats, row_chunked, backward):
    """This core's expert segments, forward or backward (its own function so the workspace is freed before the
    combine). Per segment position (one expert) and F chunk: load the chunk of each matrix in `mats` once
    (resident in SBUF, reused by every piece of the segment), then run the segment's full KB blocks and its tail's
    KB/2, ..., G pieces (0 or 1 each, plus the position's no-op pieces), each class a compiled loop over its rows
    of `piece`.

    Args:
        hbm: the kernel's HBM tensors by role ("x", "index", "weight", "slots"; backward also "dout", "d_slot",
            "grads").
        mats: [E, D, F] or [E, F, D] expert matrices; `row_chunked[i]`: mats[i] is [E, F, D] (chunked by rows)
            rather than [E, D, F] (by columns). F is mats[0].shape[2].
        backward: a specialization-time flag: which block body the pieces run.
    """
    x_pad = hbm["x"]
    D, F = x_pad.shape[1], mats[0].shape[2]
    widths = _piece_widths(hbm["index"], seg_table)
    fc = _f_chunk(D, F, x_pad.dtype.itemsize, len(mats))
    ws = _workspace(widths[0], D, fc, x_pad.dtype, backward, hbm["slots"].dtype, fc < F)
    ps = _psum_pool(x_pad.dtype)

    def segment(s):
        e = _load_entry(seg_table, pid * S, 0, s)
        for c in range(_ntiles(F, fc)):  # one chunk (all of F) unless the matrices do not fit SBUF
            f0, fl = c * fc, _width(F, fc, c)
            w = []
            for i in range(len(mats)):
                if row_chunked[i]:  # [min(P, fl), nF, D]: rows [f0, f0 + fl) of the [F, D] matrix
                    w.append(_load_expert_matrix(mats[i], e, f0, fl, 0, D))
                else:  # [min(P, D), nD, fl]: columns [f0, f0 + fl) of the [D, F] matrix
                    w.append(_load_expert_matrix(mats[i], e, 0, D, f0, fl))
            for k in range(len(widths)):  # full KB blocks, then the tail's KB/2, ..., G pieces (0 or 1 each)
                view = _ws_view(ws, widths[k])
                begin, end = _class_bounds(seg_table, pid * S, k, s)
                _pieces(piece, begin, end, e, hbm, w, view, ps, widths[k], f0, c == 0, backward)
            w = None  # the chunk's weights are dead: the next chunk's take their SBUF

    nl.fori_loop(0, _segment_count(seg_count), segment)


@nki.jit
def moe_blockwise_fwd(x_pad, token_index, slot_weight, piece, seg_table, seg_count, slot_of_assignment, w_gate_t,
                      w_up_t, w_down_t):
    """Blockwise expert MLP forward; launch as `moe_blockwise_fwd[lnc](...)`.

    Slots come in groups of G (each expert's slots padded to a multiple of G); an expert's groups are computed as
    full blocks of KB = G * 2^(L-1) slots, then its tail as at most one piece each of KB/2, ..., G slots.

    Args:
        x_pad: [T+1, D] hidden states, row T zeros (read by padding slots); io dtype (bf16 on device).
        token_index: [NG, G] int32 slot -> token (T on padding slots); row g = slot group g (the last ones: the
            cores' no-op areas).
        slot_weight: [NG, G] fp32 routing affinity per slot (0 on padding).
        piece: [M, 2] int32, per piece its first slot group and first slot row (group * G); rows grouped by class.
        seg_table: [lnc * S, 1 + 2L] int32; core c's segment position s at row c * S + s: its expert, then per
            piece class k (KB >> k slots) the [begin, end) rows of `piece` (the same count on every core).
        seg_count: [1, 1] int32, segment positions run (the same on every core).
        slot_of_assignment: [nT, TT, K] int32 slot of each (token, k), tokens in tiles of TT, nT a multiple of the
            LNC (padded tokens point at any real slot; the host drops their rows).
        w_gate_t, w_up_t: [E, D, F] (gate/up weights transposed); w_down_t: [E, F, D] (down transposed).

    Returns:
        out: [nT, TT, D] io dtype, sum over k of affinity * expert_mlp(x).
    """
    pid = nl.program_id(0)
    lnc = nl.num_programs(0)
    ng, G = token_index.shape
    D = x_pad.shape[1]
    S = seg_table.shape[0] // lnc
    nT, TT = slot_of_assignment.shape[0], slot_of_assignment.shape[1]
    F = w_gate_t.shape[2]
    chunked = _f_chunk(D, F, x_pad.dtype.itemsize, 3) < F
    y_slots = nl.ndarray((ng * G, D), dtype=F32 if chunked else x_pad.dtype, buffer=nl.shared_hbm, name="y_slots")
    hbm = {"x": x_pad, "index": token_index, "weight": slot_weight, "slots": y_slots}
    _expert_segments(pid, S, hbm, piece, seg_table, seg_count, (w_gate_t, w_up_t, w_down_t),  # W^T[:, chunk] x 2,
                     (False, False, True), False)  # W_down^T[chunk, :]
    if lnc > 1:
        nisa.core_barrier(data=y_slots, cores=(0, 1))  # the combine reads rows the other core wrote
    out = nl.ndarray((nT, TT, D), dtype=x_pad.dtype, buffer=nl.shared_hbm)
    _combine(out, y_slots, slot_of_assignment, pid, lnc)
    return out


# -- backward ----------------------------------------------------------------------------------------------------------
def _broadcast_row(ws, slot_weight, b, parts, kb, ps):
    """ws["aff_b"] [parts, kb] fp32, every partition a copy of slot_weight[b, :]: ones[1, parts]^T @ row (PE)."""
    nisa.dma_copy(dst=ws["row"], src=slot_weight.ap(pattern=[[kb, 1], [1, kb]], offset=0, scalar_offset=b,
                                                    indirect_dim=0))
    acc = ps["acc"][0:parts, 0:kb]
    nisa.nc_matmul(dst=acc, stationary=ws["ones"][0:1, 0:parts], moving=ws["row"], accumulate=False)
    nisa.tensor_copy(dst=ws["aff_b"], src=acc)


def _swiglu_backward(ws, d_slot, b, kb, F, ps, first):
    """ws["dg"], ws["du"] (feature-major, io dtype) from dhT (in ws["g"]); writes the affinity grads d_slot[b, :].

    d_affinity = sum_f h * dh (a partition sum: ones^T @ (h * dh) on the PE);
    then dh *= affinity, du = dh * silu(g), dg = dh * u * (sig + silu * (1 - sig)).
    """
    d_aff = ps["aff"][0:1, 0:kb]
    for i in range(_ntiles(F, P)):
        fl = _width(F, P, i)
        dh, silu, sig = ws["g"][0:fl, i, 0:kb], ws["silu"][0:fl, i, 0:kb], ws["sig"][0:fl, i, 0:kb]
        t1, t2 = ws["tmp1"][0:fl, 0:kb], ws["tmp2"][0:fl, 0:kb]
        nisa.tensor_tensor(dst=t1, data1=ws["h"][0:fl, i, 0:kb], data2=dh, op=nl.multiply)
        nisa.nc_matmul(dst=d_aff, stationary=ws["ones"][0:fl, 0:1], moving=t1, accumulate=i > 0)
        nisa.tensor_tensor(dst=t1, data1=dh, data2=ws["aff_b"][0:fl, 0:kb], op=nl.multiply)
        nisa.tensor_tensor(dst=ws["du"][0:fl, i, 0:kb], data1=t1, data2=silu, op=nl.multiply)
        nisa.tensor_tensor(dst=t2, data1=silu, data2=sig, op=nl.multiply)
        nisa.tensor_tensor(dst=t2, data1=silu, data2=t2, op=nl.subtract)
        nisa.tensor_tensor(dst=t2, data1=sig, data2=t2, op=nl.add)
        nisa.tensor_tensor(dst=t2, data1=t2, data2=ws["u"][0:fl, i, 0:kb], op=nl.multiply)
        nisa.tensor_tensor(dst=ws["dg"][0:fl, i, 0:kb], data1=t1, data2=t2, op=nl.multiply)
    nisa.tensor_copy(dst=ws["row"], src=d_aff)
    if not first:  # later F chunks add their partial sum over f
        nisa.dma_copy(dst=ws["row2"], src=d_slot.ap(pattern=[[kb, 1], [1, kb]], offset=0, scalar_offset=b,
                                                     indirect_dim=0))
        nisa.tensor_tensor(dst=ws["row"], data1=ws["row"], data2=ws["row2"], op=nl.add)
    nisa.dma_copy(dst=d_slot.ap(pattern=[[kb, 1], [1, kb]], offset=0, scalar_offset=b, indirect_dim=0),
                  src=ws["row"])


def _dx_block(dx_slots, ws, wg, wu, row0, kb, D, F, ps, first):
    """dx_slots rows of the block = dg @ W_gate[e] + du @ W_up[e] (resident natural [min(P, F), nF, D] tiles)."""
    for s in range(_ntiles(kb, P)):
        sl = _width(kb, P, s)
        for c in range(_ntiles(D, MOVING_FMAX)):
            c0, cl = c * MOVING_FMAX, _width(D, MOVING_FMAX, c)
            acc = ps["acc"][0:sl, 0:cl]
            for i in range(_ntiles(F, P)):
                fl = _width(F, P, i)
                nisa.nc_matmul(dst=acc, stationary=ws["dg"][0:fl, i, s * P:s * P + sl],
                               moving=wg[0:fl, i, c0:c0 + cl], accumulate=i > 0)
                nisa.nc_matmul(dst=acc, stationary=ws["du"][0:fl, i, s * P:s * P + sl],
                               moving=wu[0:fl, i, c0:c0 + cl], accumulate=True)
            _emit(dx_slots, acc, None, ws, row0, s * P, sl, c0, cl, first)


def _accumulate_weight_grad(dw, e, lhs_tok, rhs_tok, band, ps, r_base, R, c_base, C):
    """dw[e, r_base:r_base+R, c_base:c_base+C] += sum_s lhs_tok[s][:, :R]^T @ rhs_tok[s][:, :C] (tokens on
    partitions; dw an [E, *, *] fp32 HBM accumulator).

    Read-modify-write one [<=128, C] row band at a time (C * 4 bytes per partition per DMA).
    """
    for r in range(_ntiles(R, P)):
        r0, rl = r * P, _width(R, P, r)
        total = band[0:rl, 0:C]
        nisa.dma_copy(dst=total, src=_expert_window(dw, e, r_base + r0, rl, c_base, C))
        for c in range(_ntiles(C, MOVING_FMAX)):
            c0, cl = c * MOVING_FMAX, _width(C, MOVING_FMAX, c)
            acc = ps["acc"][0:rl, 0:cl]
            for s in range(len(lhs_tok)):
                sl = lhs_tok[s].shape[0]
                nisa.nc_matmul(dst=acc, stationary=lhs_tok[s][0:sl, r0:r0 + rl], moving=rhs_tok[s][0:sl, c0:c0 + cl],
                               accumulate=s > 0)
            nisa.tensor_tensor(dst=band[0:rl, c0:c0 + cl], data1=band[0:rl, c0:c0 + cl], data2=acc, op=nl.add)
        nisa.dma_copy(dst=_expert_window(dw, e, r_base + r0, rl, c_base, C), src=total)


def _backward_block(b, row0, e, hbm, w, ws, ps, kb, f0, first):
    """One kb-slot piece (slot group b, slot row row0) against one F chunk [f0, f0 + F) of expert e (w: that
    chunk's five resident matrices)."""
    D, F = hbm["x"].shape[1], w[0].shape[2]
    slot_weight, d_slot, grads = hbm["weight"], hbm["d_slot"], hbm["grads"]
    _load_block([ws["x"], ws["dy"]], [hbm["x"], hbm["dout"]], hbm["index"], b, kb)
    affinity = _affinities(slot_weight, b, kb)
    _recompute(ws, w[0], w[1], kb, D, F, ps)
    _feature_major(ws["xT"], ws["dy"], kb, D, ps)  # dyT (xT is no longer needed)
    _project(ws["g"], w[2], ws["xT"], kb, D, F, ps)  # dhT = (dy @ W_down[e])^T (gT is no longer needed)
    _broadcast_row(ws, slot_weight, b, ws["aff_b"].shape[0], kb, ps)
    _swiglu_backward(ws, d_slot, b, kb, F, ps, first)
    _dx_block(hbm["slots"], ws, w[3], w[4], row0, kb, D, F, ps, first)
    # weight grads contract over the block's tokens: token-major operands
    for s in range(len(ws["dy"])):
        nisa.tensor_scalar(dst=ws["dy"][s], data=ws["dy"][s], op0=nl.multiply, operand0=affinity[s])
    _token_major(ws["tok"], ws["dg"], kb, F, ps)
    _accumulate_weight_grad(grads[0], e, ws["tok"], ws["x"], ws["band"], ps, f0, F, 0, D)  # dW_gate[e, chunk, :]
    _token_major(ws["tok"], ws["du"], kb, F, ps)
    _accumulate_weight_grad(grads[1], e, ws["tok"], ws["x"], ws["band"], ps, f0, F, 0, D)  # dW_up[e, chunk, :]
    _token_major(ws["tok"], ws["h"], kb, F, ps)
    _accumulate_weight_grad(grads[2], e, ws["dy"], ws["tok"], ws["band"], ps, 0, D, f0, F)  # dW_down[e, :, chunk]


def _zero_fill(t, zeros, pid, lnc):
    """Zero this core's share of an [E, R, C] fp32 HBM tensor: rows [pid * R / lnc, (pid + 1) * R / lnc) of every
    expert, one expert per iteration (a row split, so every core runs the same E iterations)."""
    E, R, C = t.shape
    per = _ntiles(R, lnc)
    lo = min(R, pid * per)
    hi = min(R, lo + per)

    def expert(e):
        for r0 in range(lo, hi, P):
            rl = min(P, hi - r0)
            nisa.dma_copy(dst=t.ap(pattern=[[C, rl], [1, C]], offset=r0 * C, scalar_offset=e, indirect_dim=0),
                          src=zeros[0:rl, 0:C])

    nl.fori_loop(0, E, expert)


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
def moe_blockwise_bwd(x_pad, dout_pad, token_index, slot_weight, piece, seg_table, seg_count, slot_of_assignment,
                      w_gate, w_up, w_down, w_gate_t, w_up_t):
    """Blockwise expert MLP backward (recomputes the forward activations per block); launch as `[lnc]`.

    Args:
        x_pad, dout_pad: [T+1, D] inputs and output gradient, row T zeros; io dtype.
        token_index, slot_weight, piece, seg_table, seg_count, slot_of_assignment: as in `moe_blockwise_fwd`.
        w_gate, w_up: [E, F, D]; w_down: [E, D, F] (torchtitan layouts); w_gate_t, w_up_t: [E, D, F].

    Returns:
        dx [nT, TT, D] (io dtype), d_slot_weight [NG, G] fp32, dw_gate [E, F, D], dw_up [E, F, D],
        dw_down [E, D, F] (fp32).
    """
    pid = nl.program_id(0)
    lnc = nl.num_programs(0)
    ng, G = token_index.shape
    D = x_pad.shape[1]
    S = seg_table.shape[0] // lnc
    nT, TT = slot_of_assignment.shape[0], slot_of_assignment.shape[1]
    io = x_pad.dtype
    chunked = _f_chunk(D, w_gate.shape[1], io.itemsize, 5) < w_gate.shape[1]
    dx_slots = nl.ndarray((ng * G, D), dtype=F32 if chunked else io, buffer=nl.shared_hbm, name="dx_slots")
    d_slot = nl.ndarray((ng, G), dtype=F32, buffer=nl.shared_hbm)
    dw_gate = nl.ndarray(w_gate.shape, dtype=F32, buffer=nl.shared_hbm)
    dw_up = nl.ndarray(w_up.shape, dtype=F32, buffer=nl.shared_hbm)
    dw_down = nl.ndarray(w_down.shape, dtype=F32, buffer=nl.shared_hbm)
    _zero_outputs(d_slot, dw_gate, dw_up, dw_down, pid, lnc)
    if lnc > 1:
        nisa.core_barrier(data=d_slot, cores=(0, 1))
        nisa.core_barrier(data=dw_gate, cores=(0, 1))
        nisa.core_barrier(data=dw_up, cores=(0, 1))
        nisa.core_barrier(data=dw_down, cores=(0, 1))
    hbm = {"x": x_pad, "dout": dout_pad, "index": token_index, "weight": slot_weight, "slots": dx_slots,
          "d_slot": d_slot, "grads": (dw_gate, dw_up, dw_down)}
    _expert_segments(pid, S, hbm, piece, seg_table, seg_count,
                     (w_gate_t, w_up_t, w_down, w_gate, w_up),  # W_gate^T, W_up^T, natural W_down: [:, chunk];
                     (False, False, False, True, True), True)  # natural W_gate, W_up: [chunk, :]
    if lnc > 1:
        nisa.core_barrier(data=dx_slots, cores=(0, 1))
    dx = nl.ndarray((nT, TT, D), dtype=io, buffer=nl.shared_hbm)
    _combine(dx, dx_slots, slot_of_assignment, pid, lnc)
    return dx, d_slot, dw_gate, dw_up, dw_down
