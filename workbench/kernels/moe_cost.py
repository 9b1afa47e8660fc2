"""The NKI MoE layer's modeled trn2 time: one rank's layer forward + backward through the emulator, its instruction
trace through the dependency time model (`nki_emulator.timing.schedule`), and the layer's roofline.

    run = run_layer(tokens=4096, experts=128, top_k=8, hidden=2048, ffn=768, lnc=2, block_size=256)
    run.summary()   # model_ms, roofline_ms, roofline_ratio, model_ms_overlap .. model_ms_serial, engine shares, ...
    run.what_if()   # model_ms with groups of costs removed (what_if_rates): what the critical path is made of
    run.sensitivity()  # model_ms, roofline_ratio with each marked assumption at its low and high end

`model_ms` is the dependency model: the trace replayed on per-engine in-order queues (operands ready, engine free,
DGE and DMA latencies, barriers). `model_ms_overlap` (each kernel at its busiest engine) and `model_ms_serial`
(each kernel the sum of its engines) are the throughput model's bracket around it.

Used by benchmarks/nki_moe_cost.py (the full cost report), `workbench.bench` and notebook 03 (the modeled layer
time beside the measured CPU numbers). Everything here is a model: nothing has run on Trainium.

The roofline (`roofline`) is max(PE floor, HBM floor) of one rank (LNC physical cores, their share of the chip),
with each floor counting:
  PE floor   the unpadded expert matmuls, 3 x 2*T*K*D*F FLOPs forward and twice that backward, at 79 BF16 TFLOPS
             per physical NeuronCore-v3 (no transposes, no padding, no recompute);
  HBM floor  at the rank's share of 2.9 TB/s: the three expert matrices read once forward and once backward, the
             three weight gradients written once, and each token's rows once: x read and out written forward, x
             and dy read and dx written backward (5 * T * D elements), all in the dtypes the kernels use: the io
             dtype, bf16 on trn2 (the kernels write dW in the weights' dtype, as torch's autograd does for bf16
             weights). Routing tables, slot scratch, padding and the K-fold gathers are not in it.
At 30B-A3B in bf16 the roofline is the PE floor (5.87 ms; the HBM floor is 5.11 ms).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from workbench.kernels.nki_emulator import counters
from workbench.kernels.nki_emulator.timing import TRN2, Rates, model, schedule


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
             rates: Rates = TRN2) -> Roofline:
    """The layer's floors for one rank of `lnc` physical cores (module docstring: what each counts), every tensor
    at the io dtype the kernels read and write (`io_bytes` per element)."""
    T, K, E, D, F = tokens, top_k, experts, hidden, ffn
    flops = 9 * 2 * T * K * D * F
    hbm = 3 * E * D * F * 3 * io_bytes + 5 * T * D * io_bytes  # weights fwd + bwd, dW, token rows
    return Roofline(pe_s=flops / (rates.pe_bf16_flops * lnc), hbm_s=hbm / (rates.hbm_bytes_per_s * lnc),
                    hbm_bytes=hbm, pe_flops=flops)


@dataclass
class LayerRun:
    """Counters of one rank's MoE layer forward and backward, and what the time model makes of them."""

    forward: object  # nki_emulator Counters (with the instruction trace)
    backward: object
    roofline: Roofline
    topk_ids: torch.Tensor  # the routing the layer ran with
    seconds: tuple  # emulator wall time of the forward and the backward (CPU)

    def what_if(self, rates: Rates = TRN2) -> dict:
        """`model_ms` with one group of costs removed (`what_if_rates`): name -> {model_ms, roofline_ratio}. How
        much of the modeled time each group puts on the critical path; not a prediction for any hardware."""
        out = {}
        for name, r in what_if_rates(rates).items():
            seconds = schedule(self.forward, r).seconds + schedule(self.backward, r).seconds
            out[name] = {"model_ms": _ms(seconds), "roofline_ratio": round(seconds / self.roofline.seconds, 4)}
        return out

    def sensitivity(self, rates: Rates = TRN2) -> dict:
        """`model_ms` and `roofline_ratio` with each marked assumption at its low and its high end
        (`sensitivity_rates`): name -> {values, model_ms, roofline_ratio}, each a [low, high] pair."""
        out, replayed = {}, {}  # Rates -> seconds: an end at the modeled value replays once
        for name, ends in sensitivity_rates(rates).items():
            row = {"values": [v for v, _ in ends], "model_ms": [], "roofline_ratio": []}
            for _, r in ends:
                if r not in replayed:
                    replayed[r] = schedule(self.forward, r).seconds + schedule(self.backward, r).seconds
                seconds = replayed[r]
                row["model_ms"].append(_ms(seconds))
                row["roofline_ratio"].append(round(seconds / self.roofline.seconds, 4))
            out[name] = row
        return out

    def summary(self) -> dict:
        """The layer's modeled time: `model_ms` the dependency model (the forward kernel then the backward
        kernel, each its slowest core's timeline), its ratio to the roofline, each engine's busy and waiting share
        and the largest stalls; the throughput bracket (each kernel at least its busiest engine, at most the sum
        of its engines); the floors."""
        fwd, bwd = model(self.forward), model(self.backward)
        sf, sb = schedule(self.forward), schedule(self.backward)
        seconds = sf.seconds + sb.seconds
        overlap = fwd.overlap_s + bwd.overlap_s
        engines = {e: fwd.engines[e] + bwd.engines[e] for e in fwd.engines}
        both = sf  # the layer's shares and stalls: the two kernels' timelines together
        for e in both.busy:
            both.busy[e] += sb.busy[e]
            both.waiting[e] += sb.waiting[e]
        for k, v in sb.stalls.items():
            both.stalls[k] = both.stalls.get(k, 0.0) + v
        both.core_seconds += sb.core_seconds
        return {
            "model_ms": _ms(seconds),
            "roofline_ms": _ms(self.roofline.seconds),
            "roofline_ratio": round(seconds / self.roofline.seconds, 4),
            "model_ms_fwd": _ms(sf.seconds), "model_ms_bwd": _ms(sb.seconds),
            "engine_shares": both.shares(),
            "top_stalls": both.top_stalls(8),
            "model_ms_overlap": _ms(overlap),
            "model_ms_serial": _ms(fwd.serial_s + bwd.serial_s),
            "bound": max(engines, key=engines.get),
            "model_ms_engines": {e: _ms(s) for e, s in engines.items()},
            "model_ms_overlap_fwd": _ms(fwd.overlap_s), "bound_fwd": fwd.bound,
            "model_ms_overlap_bwd": _ms(bwd.overlap_s), "bound_bwd": bwd.bound,
            "pe_floor_ms": _ms(self.roofline.pe_s),
            "hbm_floor_ms": _ms(self.roofline.hbm_s),
            "hbm_floor_gib": round(self.roofline.hbm_bytes / 2**30, 3),
            "hbm_gib": round((fwd.hbm_bytes + bwd.hbm_bytes) / 2**30, 3),
            "unmodeled_instructions": sum(fwd.unmodeled.values()) + sum(bwd.unmodeled.values()),
        }


_FREE = 1e6  # a rate multiplied by this costs nothing at these shapes


def what_if_rates(rates: Rates = TRN2) -> dict:
    """The time model's rates with one group of costs removed, for `LayerRun.what_if`:
      loop control free          compiled loops' branches and register instructions cost 0 on every engine
      DMA free                   transfers, HBM, descriptor generation (hardware and software DGE) and the
                                 DMA-to-DMA semaphore latency cost 0
      Vector/Scalar/GpSimd free  those engines run at 1e6 x their clock (GpSimd's software-DGE row cycles too)
      only the Tensor Engine     all three of the above: what is left is the Tensor Engine's own work and its
                                 waits on dependencies through it
      Tensor Engine free         the Tensor Engine at 1e6 x its clock, no 64-cycle matmul minimum
      only the DMA               everything but the DMA free (the Tensor Engine too)
      only PE + DMA bandwidth    the Tensor Engine's work and the DMA's bytes (HBM, DMA engines) cost; the other
                                 engines, loop control and every DMA latency (DGE, semaphore, fixed cost) are free
    """
    r = rates
    control = {"branch_s": 0.0, "sequencer_s": 0.0}
    latency = {"dma_fixed_s": 0.0, "dge_hw_s": 0.0, "dge_sw_s": 0.0, "dge_sw_row_cycles": 0, "dma_semaphore_s": 0.0}
    dma = {"hbm_bytes_per_s_chip": r.hbm_bytes_per_s_chip * _FREE, "dma_engine_bytes_per_s":
           r.dma_engine_bytes_per_s * _FREE, **latency}
    elementwise = {"vector_hz": r.vector_hz * _FREE, "scalar_hz": r.scalar_hz * _FREE,
                   "gpsimd_hz": r.gpsimd_hz * _FREE}
    tensor = {"tensor_hz": r.tensor_hz * _FREE, "matmul_min_cycles": 0}
    return {"as modeled": r, "loop control free": replace(r, **control), "DMA free": replace(r, **dma),
            "Vector/Scalar/GpSimd free": replace(r, **elementwise),
            "only the Tensor Engine": replace(r, **control, **dma, **elementwise),
            "Tensor Engine free": replace(r, **tensor),
            "only the DMA": replace(r, **control, **elementwise, **tensor),
            "only PE + DMA bandwidth": replace(r, **control, **elementwise, **latency)}


# FITTED, for the sensitivity table only (never in model_ms): the Vector Engine rate, x the documented one, at which
# the Vector-bound calibration rows that read low (LayerNorm, RMSNorm-Quant) come within ~12% (docs/nki_kernels.md)
VECTOR_LOW = 0.75


def sensitivity_rates(rates: Rates = TRN2) -> dict:
    """The time model's marked assumptions, each at a low and a high end (docs/nki_kernels.md, "Sensitivity"):
    name -> ((low value, Rates), (high value, Rates)); every other rate as modeled.
      concurrent PE tiles      matmuls on disjoint PE tiles serialised (as untiled) / fully in parallel (modeled)
      DMA transpose cost       half the Trainium2 guide's "up to" utilization (HBM -> SBUF 45%, SBUF -> SBUF 25%) /
                               the guide's figures (90%, 50%: modeled)
      DMA fixed cost           0 / 40 ns per DMA per engine (FITTED at 9 ns to the DMA overview's profiles; at 40 ns
                               its 2 KiB-per-engine profile would read +33%)
      Vector rate              VECTOR_LOW x the documented 0.96 GHz (what the Vector-bound RMSNorm-Quant and LayerNorm
                               rows that read low would need) / the documented rate (modeled)
    """
    r = rates
    return {
        "concurrent PE tiles": ((False, replace(r, pe_tiles_concurrent=False)),
                                (True, replace(r, pe_tiles_concurrent=True))),
        "DMA transpose cost": ((0.5, replace(r, dma_transpose_hbm_efficiency=r.dma_transpose_hbm_efficiency / 2,
                                             dma_transpose_sbuf_efficiency=r.dma_transpose_sbuf_efficiency / 2)),
                               (1.0, r)),
        "DMA fixed cost": ((0.0, replace(r, dma_fixed_s=0.0)), (40e-9, replace(r, dma_fixed_s=40e-9))),
        "Vector rate": ((VECTOR_LOW, replace(r, vector_hz=r.vector_hz * VECTOR_LOW)), (1.0, r)),
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
    from workbench.core.neuron_env import compiled_for_lnc
    from workbench.kernels import blockwise_moe_nki

    x, ids, w, wg, wu, wd, dout = layer_inputs(tokens, experts, top_k, hidden, ffn, dtype, seed)
    with compiled_for_lnc(lnc):
        t0 = time.perf_counter()
        with counters(trace=True) as cf:
            out = blockwise_moe_nki(x, ids, w, wg, wu, wd, block_size=block_size)
        t1 = time.perf_counter()
        with counters(trace=True) as cb:
            out.backward(dout)
        t2 = time.perf_counter()
    io_bytes = torch.empty((), dtype=dtype).element_size()
    shape = (tokens, top_k, experts, hidden, ffn, lnc, io_bytes)
    return LayerRun(cf, cb, roofline(*shape), ids, (t1 - t0, t2 - t1))


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
