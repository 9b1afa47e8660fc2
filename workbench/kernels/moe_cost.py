"""The NKI MoE layer's modeled trn2 time: one rank's layer forward + backward through the emulator, its counters
through the time model (`nki_emulator.timing`), and the layer's roofline.

    run = run_layer(tokens=4096, experts=128, top_k=8, hidden=2048, ffn=768, lnc=2, block_size=256)
    run.summary()   # model_ms_overlap, model_ms_serial, roofline_ms, roofline_ratio, bound, ...

Used by benchmarks/nki_moe_cost.py (the full cost report), `workbench.bench` and notebook 03 (the modeled layer
time beside the measured CPU numbers). Everything here is a model: nothing has run on Trainium.

The roofline (`roofline`) is max(PE floor, HBM floor) of one rank (LNC physical cores, their share of the chip),
with each floor counting:
  PE floor   the unpadded expert matmuls, 3 x 2*T*K*D*F FLOPs forward and twice that backward, at 79 BF16 TFLOPS
             per physical NeuronCore-v3 (no transposes, no padding, no recompute);
  HBM floor  at the rank's share of 2.9 TB/s: the three expert matrices read once forward and once backward (io
             dtype), the three weight gradients written once in fp32, and each token's rows once: x read and out
             written forward, x and dy read and dx written backward (5 * T * D elements, io dtype). Routing tables,
             slot scratch, padding and the K-fold gathers are not in it.
The kernels return the weight gradients in the io dtype (what autograd hands on: the weights' dtype), so a floor
counting them at that width is lower still: `summary()` reports it too (`roofline_ms_io_grads`, its ratio); at
30B-A3B in bf16 that floor is the PE floor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from workbench.kernels.nki_emulator import counters
from workbench.kernels.nki_emulator.timing import TRN2, Rates, model


@dataclass(frozen=True)
class Roofline:
    pe_s: float
    hbm_s: float
    hbm_bytes: int
    pe_flops: int

    @property
    def seconds(self) -> float:
        return max(self.pe_s, self.hbm_s)

    @property
    def bound(self) -> str:
        return "pe" if self.pe_s >= self.hbm_s else "hbm"


def roofline(tokens: int, top_k: int, experts: int, hidden: int, ffn: int, lnc: int, io_bytes: int,
             grad_bytes: int = 4, rates: Rates = TRN2) -> Roofline:
    """The layer's floors for one rank of `lnc` physical cores (module docstring: what each counts); `grad_bytes`:
    the width the weight gradients are counted at (4: fp32, as the issue defines the floor)."""
    T, K, E, D, F = tokens, top_k, experts, hidden, ffn
    flops = 9 * 2 * T * K * D * F
    hbm = 3 * E * D * F * (2 * io_bytes + grad_bytes) + 5 * T * D * io_bytes  # weights fwd + bwd, dW, token rows
    return Roofline(pe_s=flops / (rates.pe_bf16_flops * lnc), hbm_s=hbm / (rates.hbm_bytes_per_s * lnc),
                    hbm_bytes=hbm, pe_flops=flops)


@dataclass
class LayerRun:
    """Counters of one rank's MoE layer forward and backward, and what the time model makes of them."""

    forward: object  # nki_emulator Counters
    backward: object
    roofline: Roofline
    roofline_io_grads: Roofline  # the same with the weight gradients at the io dtype the kernels write
    topk_ids: torch.Tensor  # the routing the layer ran with
    seconds: tuple  # emulator wall time of the forward and the backward (CPU)

    def summary(self) -> dict:
        """The time model's bounds for the layer: each kernel takes at least its busiest engine (overlap) and at
        most the sum of its engines (serial); the layer is the forward kernel then the backward kernel."""
        fwd, bwd = model(self.forward), model(self.backward)
        overlap = fwd.overlap_s + bwd.overlap_s
        engines = {e: fwd.engines[e] + bwd.engines[e] for e in fwd.engines}
        return {
            "model_ms_overlap": _ms(overlap),
            "model_ms_serial": _ms(fwd.serial_s + bwd.serial_s),
            "roofline_ms": _ms(self.roofline.seconds),
            "roofline_ratio": round(overlap / self.roofline.seconds, 4),
            "bound": max(engines, key=engines.get),
            "model_ms_engines": {e: _ms(s) for e, s in engines.items()},
            "model_ms_fwd": _ms(fwd.overlap_s), "bound_fwd": fwd.bound,
            "model_ms_bwd": _ms(bwd.overlap_s), "bound_bwd": bwd.bound,
            "roofline_ms_io_grads": _ms(self.roofline_io_grads.seconds),
            "roofline_ratio_io_grads": round(overlap / self.roofline_io_grads.seconds, 4),
            "pe_floor_ms": _ms(self.roofline.pe_s),
            "hbm_floor_ms": _ms(self.roofline.hbm_s),
            "hbm_floor_gib": round(self.roofline.hbm_bytes / 2**30, 3),
            "hbm_gib": round((fwd.hbm_bytes + bwd.hbm_bytes) / 2**30, 3),
            "unmodeled_instructions": sum(fwd.unmodeled.values()) + sum(bwd.unmodeled.values()),
        }


def _ms(seconds: float) -> float:
    """Milliseconds to 4 significant digits (toy shapes run in microseconds)."""
    return float(f"{seconds * 1e3:.4g}")


def layer_inputs(tokens, experts, top_k, hidden, ffn, dtype, seed):
    """Seeded router routing (random hidden states through a random [E, D] router, softmax top-k: what a freshly
    initialised layer sees) and weights scaled so activations are O(1)."""
    from workbench.kernels import route

    T, E, K, D, F = tokens, experts, top_k, hidden, ffn
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    router = torch.randn(E, D, generator=g) * D ** -0.5
    weights, ids = route(x @ router.T, K)
    w_gate = (torch.randn(E, F, D, generator=g) * D ** -0.5).to(dtype).requires_grad_()
    w_up = (torch.randn(E, F, D, generator=g) * D ** -0.5).to(dtype).requires_grad_()
    w_down = (torch.randn(E, D, F, generator=g) * F ** -0.5).to(dtype).requires_grad_()
    dout = torch.randn(T, D, generator=g).to(dtype)
    return x.to(dtype).requires_grad_(), ids, weights.to(dtype).requires_grad_(), w_gate, w_up, w_down, dout


def run_layer(tokens: int, experts: int, top_k: int, hidden: int, ffn: int, lnc: int, block_size: int,
              dtype=torch.bfloat16, seed: int = 0) -> LayerRun:
    """Run one rank's layer forward + backward through the NKI kernels on the emulator at LNC `lnc` (the compiler's
    LNC is set to it for the call), counting each direction."""
    from workbench.device import compiled_for_lnc
    from workbench.kernels import blockwise_moe_nki

    x, ids, w, wg, wu, wd, dout = layer_inputs(tokens, experts, top_k, hidden, ffn, dtype, seed)
    with compiled_for_lnc(lnc):
        t0 = time.perf_counter()
        with counters() as cf:
            out = blockwise_moe_nki(x, ids, w, wg, wu, wd, block_size=block_size)
        t1 = time.perf_counter()
        with counters() as cb:
            out.backward(dout)
        t2 = time.perf_counter()
    io_bytes = torch.empty((), dtype=dtype).element_size()
    shape = (tokens, top_k, experts, hidden, ffn, lnc, io_bytes)
    return LayerRun(cf, cb, roofline(*shape), roofline(*shape, grad_bytes=io_bytes), ids, (t1 - t0, t2 - t1))


def trn2_moe_layer(job) -> dict | None:
    """The time model's trn2 figures for one rank's MoE layer at a job's shapes (tokens per rank = local batch x
    sequence length, the flavor's experts, top-k, hidden and expert widths, model.moe_block_size), run as on trn2:
    bf16, LNC 2. None for a dense flavor. A model from the emulator's counters, not a measurement; the emulator
    takes minutes at 30B-A3B shapes on a CPU.
    """
    shape = job.shape
    if not shape.is_moe:
        return None
    tokens = job.training.local_batch_size * job.training.seq_len
    run = run_layer(tokens, shape.num_experts, shape.top_k, shape.dim, shape.moe_ffn_dim, lnc=2,
                    block_size=job.model.moe_block_size)
    return {"tokens": tokens, "experts": shape.num_experts, "top_k": shape.top_k, "hidden": shape.dim,
            "ffn": shape.moe_ffn_dim, "block_size": job.model.moe_block_size, "moe_layers": shape.n_layers,
            **run.summary()}
