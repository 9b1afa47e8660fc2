"""Static and executed cost of the NKI MoE kernels for one rank's MoE layer, counted by the NKI emulator.

    .venv/bin/python benchmarks/nki_moe_cost.py --tokens 4096 --experts 128 --top-k 8 --hidden 2048 --ffn 768 \
        --lnc 2 [--block-size N]

One Qwen3-30B-A3B layer per rank by default (T=4096, E=128, K=8, D=2048, F=768, bf16). Routing comes from a
seeded router (random hidden states through a random [E, D] router, softmax top-k), the same statistics a
freshly initialised layer sees. The kernels run forward + backward through the emulator (`nki_emulator`), whose
counters give: instructions in the traced program per engine (`static`: a dynamic loop's body counts once) and
executed (every core, every iteration), DMAs (count, bytes, bytes per partition), PE FLOPs, loop trips.

Printed: a table per direction, then as the LAST line a JSON object with
  static_instructions      traced program, forward + backward (target <= 5,000)
  executed_instructions    all cores, all iterations, forward + backward
  padding_fraction         padding slots computed / slots computed (target <= 0.10), counted by the emulator:
                           rows of x_pad the backward's row gathers read that are x_pad's zero row (the padding
                           slots' row), over all rows they read; cross-checked against the host plan
  dma_small_fraction       expert-weight bytes moved in DMAs < 2 KiB per partition / all expert-weight bytes (<= 0.10)
  pe_flops_ratio           PE FLOPs / FLOPs of the unpadded expert matmuls (fwd 3 + bwd 6 per assignment; <= 1.25)
  nki_version              the NKI whose rules the emulator applied (nki_emulator.version: 0.7.0, Neuron SDK 2.33)
  divergent_loops          compiled loops whose trip counts differ between the cores, from the emulator's per-core
                           trip counts (target 0; its lnc-divergent-control rule stops a launch at the first one,
                           so a report that completes at LNC 2 has 0)
  noop_pieces              the pieces (slots: count) the kernels run only so both cores have the same trip counts
  model_ms                 the dependency time model (workbench.kernels.nki_emulator.timing.schedule): each kernel's
                           instruction trace replayed on per-engine in-order queues (operands ready, engine free,
                           DGE / DMA / semaphore latencies, core barriers); forward then backward
  roofline_ms              max(PE floor, HBM floor) of the layer (workbench.kernels.moe_cost.roofline: what each
                           floor counts; every tensor in the dtypes the kernels use, bf16 dW)
  roofline_ratio           model_ms / roofline_ms (target <= 1.3)
  engine_shares            engine -> {busy, waiting}: shares of the cores' time (fwd + bwd timelines)
  top_stalls               the largest waits: engine, the waiting instruction's source line, what it waited for
  model_ms_overlap         the throughput bracket's lower end: each kernel at its busiest engine (nothing waits)
  model_ms_serial          its upper end: each kernel the sum of its engines (nothing overlaps)
  bound                    the engine with the most modeled busy time (fwd + bwd); bound_fwd / bound_bwd per kernel
  sbuf_peak_bytes          the emulator's SBUF high-water mark per partition (fwd, bwd: the larger)
  sbuf_usable_bytes        nl.tile_size.total_available_sbuf_size, 212,464 B on trn2 (the capacity the emulator
                           enforces; nki_emulator/memory.py cites it)
  sensitivity              name -> {values, model_ms, roofline_ratio}: each marked assumption of the time model at
                           its low and high end, as [low, high] pairs (moe_cost.sensitivity_rates: concurrent PE
                           tiles, DMA transpose cost, DMA fixed cost, Vector rate); --no-sensitivity skips it
  roofline_ratio_range     [min, max] of roofline_ratio over those ends
  what_if                  (--what-if) name -> {model_ms, roofline_ratio} with one group of costs removed
                           (moe_cost.what_if_rates: loop control, DMA, Vector/Scalar/GpSimd, all three, the
                           Tensor Engine, all but the DMA, all but the PE's work and the DMA's bytes)
  lnc, block_size, kernel_block, plus per-direction numbers.
Not a test; the emulator is slow at full scale (minutes on 2 CPU cores).
"""

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from workbench.core.moe_blocks import kernel_block_size  # noqa: E402
from workbench.kernels import nki_moe, plan_blocks  # noqa: E402
from workbench.kernels.moe_cost import layer_inputs, run_layer  # noqa: E402
from workbench.kernels.nki_api import nl  # noqa: E402
from workbench.kernels.nki_emulator import version  # noqa: E402
from workbench.kernels.nki_moe.tables import KernelPlan, tiles_per_sub  # noqa: E402

SMALL_DMA = 2048  # bytes per partition below which a DMA is dominated by its fixed cost (DMA bandwidth guide)


def _arg_names(kernel, names):
    """The emulator's names (argN, N the position in the call) of a kernel's arguments `names`."""
    params = list(inspect.signature(getattr(kernel, "func", kernel)).parameters)
    return {f"arg{params.index(n)}" for n in names}


# expert-weight arguments of each kernel, found by name (a new argument shifts the positions)
WEIGHT_ARGS = {"fwd": _arg_names(nki_moe.moe_blockwise_fwd, ("w_gate_t", "w_up_t", "w_down_t")),
               "bwd": _arg_names(nki_moe.moe_blockwise_bwd, ("w_down", "w_gate", "w_up"))}


def add_shape_args(p):
    """The layer's shape options (one rank's Qwen3-30B-A3B layer by default)."""
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--lnc", type=int, default=2, choices=(1, 2))
    p.add_argument("--block-size", type=int, default=None,
                   help="model.moe_block_size (default: the config default)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--what-if", action="store_true",
                   help="also replay the traces with groups of costs removed (DMA, the other engines, loop "
                        "control, the Tensor Engine; all but the DMA; all but the PE's work and the DMA's bytes): "
                        "how much of model_ms each puts on the critical path; adds `what_if` to the JSON (16 "
                        "more replays, under a minute at full scale)")
    p.add_argument("--no-sensitivity", dest="sensitivity", action="store_false",
                   help="skip the sensitivity replays (6 more replays of the trace, ~2-3 min at full scale)")
    p.add_argument("--compare-nki-library", type=Path, default=None, metavar="DIR",
                   help="also run nki-library's bwmm_shard_on_block (checkout DIR) on the same routing")
    p.add_argument("--aws-blocks", default="tests", choices=("tests", "needed"),
                   help="nki-library's static block count: its tests' worst-case formula, or what the routing needs")
    p.add_argument("--aws-skip-weights", action="store_true",
                   help="nki-library's SkipMode(True, True) (mode 3: consecutive blocks of one expert reuse weights)")
    return p.parse_args(argv)


def summarize(c, direction):
    weights = [(b, bpp) for b, bpp, src, dst in c.dma_sizes if src in WEIGHT_ARGS[direction]]
    weight_bytes = sum(b for b, _ in weights)
    small = sum(b for b, bpp in weights if bpp < SMALL_DMA)
    return {
        "static": dict(sorted(c.static.items())), "static_total": c.static_total,
        "executed": dict(sorted(c.executed.items())), "executed_total": c.executed_total,
        "dma_count": c.dma_count, "dma_bytes": c.dma_bytes, "weight_dma_count": len(weights),
        "weight_bytes": weight_bytes, "weight_small_bytes": small, "pe_flops": c.pe_flops,
        "pe_transpose_flops": c.pe_transpose_flops,
        "loop_trips": dict(c.loop_trips), "sbuf_peak": c.sbuf_peak,
        "divergent_loops": sum(1 for trips in c.loop_trips_per_core.values() if len(set(trips)) > 1),
        "gathered": c.gathered_rows.get("arg0", 0), "padding": c.padding_rows.get("arg0", 0),
    }


def measure(args):
    """Run the layer (`parse_args` namespace) and count it: (the JSON result, what the printed tables need)."""
    from workbench.core.config import Model

    bs = args.block_size or Model().moe_block_size
    T, E, K, D, F = args.tokens, args.experts, args.top_k, args.hidden, args.ffn
    run = run_layer(T, E, K, D, F, args.lnc, bs, dtype=getattr(torch, args.dtype), seed=args.seed)
    ids, cf, cb = run.topk_ids, run.forward, run.backward
    dtype = getattr(torch, args.dtype)
    plan, kplan = KernelPlan.build(ids, E, bs, args.lnc, *tiles_per_sub(kernel_block_size(bs), D, F, dtype))
    kb = kplan.kb
    pieces = kplan.pieces()
    slots_run = sum(w for _, w, _ in pieces)
    widths, noop = {}, {}
    for _, w, row in pieces:
        widths[w] = widths.get(w, 0) + 1
        if row >= plan.max_blocks * plan.block_size:  # a no-op piece (its core's own scratch rows)
            noop[w] = noop.get(w, 0) + 1
    old_padding = 1 - T * K / int(plan_blocks(ids, E, bs).num_blocks * bs)  # whole blocks per expert

    fwd, bwd = summarize(cf, "fwd"), summarize(cb, "bwd")
    # the emulator's count: the backward's gathers of x_pad (arg0), one per computed slot (the forward's also read
    # the rows its software pipeline prefetches for pieces a class loop does not run)
    padding = bwd["padding"] / bwd["gathered"]
    padding_plan = 1 - T * K / slots_run  # what the host plan says the kernels compute
    if abs(padding - padding_plan) > 1e-9:
        raise SystemExit(f"emulator padding count {padding} != host plan {padding_plan}")

    useful = 2 * T * K * D * F  # FLOPs of one unpadded expert matmul over all assignments
    weight_bytes = fwd["weight_bytes"] + bwd["weight_bytes"]
    result = {
        "static_instructions": fwd["static_total"] + bwd["static_total"],
        "executed_instructions": fwd["executed_total"] + bwd["executed_total"],
        "padding_fraction": round(padding, 4),
        "dma_small_fraction": round((fwd["weight_small_bytes"] + bwd["weight_small_bytes"]) / weight_bytes, 4),
        "pe_flops_ratio": round((fwd["pe_flops"] + bwd["pe_flops"]) / (9 * useful), 4),
        "nki_version": version.active(),
        "divergent_loops": fwd["divergent_loops"] + bwd["divergent_loops"],
        "noop_pieces": dict(sorted(noop.items(), reverse=True)),
        "lnc": args.lnc,
        "block_size": bs,
        "kernel_block": kb,
        "static_fwd": fwd["static_total"], "static_bwd": bwd["static_total"],
        "executed_fwd": fwd["executed_total"], "executed_bwd": bwd["executed_total"],
        "pe_flops_ratio_fwd": round(fwd["pe_flops"] / (3 * useful), 4),
        "pe_flops_ratio_matmul_only": round((fwd["pe_flops"] + bwd["pe_flops"] - fwd["pe_transpose_flops"]
                                             - bwd["pe_transpose_flops"]) / (9 * useful), 4),
        "pieces_run": dict(sorted(widths.items(), reverse=True)), "slot_granule": plan.block_size,
        "whole_block_padding_fraction": round(old_padding, 4),
        "weight_dma_count": fwd["weight_dma_count"] + bwd["weight_dma_count"],
        "weight_gib": round(weight_bytes / 2**30, 3),
        "dma_gib": round((fwd["dma_bytes"] + bwd["dma_bytes"]) / 2**30, 3),
        "padding_slots_computed": bwd["padding"], "slots_computed": bwd["gathered"],
        "sbuf_peak_bytes": max(fwd["sbuf_peak"], bwd["sbuf_peak"]),
        "sbuf_usable_bytes": nl.tile_size.total_available_sbuf_size,
        **run.summary(),
    }
    if args.sensitivity:
        result["sensitivity"] = run.sensitivity()
        ratios = [x for row in result["sensitivity"].values() for x in row["roofline_ratio"]]
        result["roofline_ratio_range"] = [min(ratios), max(ratios)]
    if args.what_if:
        result["what_if"] = run.what_if()
    return result, {"fwd": fwd, "bwd": bwd, "plan": plan, "old_padding": old_padding, "weight_bytes": weight_bytes,
                    "seconds": run.seconds, "forward_counters": run.forward}


def main(argv=None):
    args = parse_args(argv)
    result, d = measure(args)
    fwd, bwd, plan, old_padding, weight_bytes = d["fwd"], d["bwd"], d["plan"], d["old_padding"], d["weight_bytes"]
    T, E, K, D, F, bs, kb = (args.tokens, args.experts, args.top_k, args.hidden, args.ffn, result["block_size"],
                             result["kernel_block"])
    print(f"NKI MoE kernels, one rank's layer: T={T} E={E} K={K} D={D} F={F} {args.dtype} LNC={args.lnc} "
          f"block={bs} (kernel block {kb}); emulated in {d['seconds'][0]:.0f}s fwd + {d['seconds'][1]:.0f}s bwd")
    engines = sorted(set(fwd["static"]) | set(bwd["static"]) | set(fwd["executed"]) | set(bwd["executed"]))
    print(f"{'engine':<10}{'static fwd':>12}{'static bwd':>12}{'exec fwd':>12}{'exec bwd':>12}")
    for e in engines:
        print(f"{e:<10}{fwd['static'].get(e, 0):>12,}{bwd['static'].get(e, 0):>12,}"
              f"{fwd['executed'].get(e, 0):>12,}{bwd['executed'].get(e, 0):>12,}")
    print(f"{'total':<10}{fwd['static_total']:>12,}{bwd['static_total']:>12,}{fwd['executed_total']:>12,}"
          f"{bwd['executed_total']:>12,}")
    print(f"pieces run (slots: count) {result['pieces_run']}, of which no-op (same trip counts on every core) "
          f"{result['noop_pieces']}; padding {result['padding_fraction']:.1%} of computed "
          f"slots (rounding each expert to {plan.block_size}, and the no-op pieces; whole {bs}-slot blocks would pad "
          f"{old_padding:.1%})")
    print(f"DMAs fwd {fwd['dma_count']:,} ({fwd['dma_bytes'] / 2**20:,.0f} MiB), bwd {bwd['dma_count']:,} "
          f"({bwd['dma_bytes'] / 2**20:,.0f} MiB); expert weights {result['weight_dma_count']:,} DMAs, "
          f"{weight_bytes / 2**20:,.0f} MiB, {result['dma_small_fraction']:.1%} of bytes in DMAs < 2 KiB/partition")
    print(f"PE FLOPs / unpadded expert FLOPs: fwd {result['pe_flops_ratio_fwd']:.3f}, fwd+bwd "
          f"{result['pe_flops_ratio']:.3f} (the backward reads the saved gT, uT: no recompute)")
    print(f"trn2 dependency time model (nki_emulator.timing.schedule; a model, nothing ran on Trainium): layer "
          f"{result['model_ms']:.2f} ms (fwd {result['model_ms_fwd']:.2f}, bwd {result['model_ms_bwd']:.2f}); "
          f"throughput bracket {result['model_ms_overlap']:.2f} (engines overlapped; fwd {result['bound_fwd']}-bound, "
          f"bwd {result['bound_bwd']}-bound) .. {result['model_ms_serial']:.2f} ms (serial); busy ms per engine "
          f"{result['model_ms_engines']}; HBM {result['hbm_gib']:.2f} GiB")
    print("engine shares of the cores' time (busy / waiting): " + ", ".join(
        f"{e} {v['busy']:.0%} / {v['waiting']:.0%}" for e, v in result["engine_shares"].items()))
    for stall in result["top_stalls"]:
        print(f"  stall {stall['ms']:>9.3f} ms  {stall['engine']:<7} at {stall['site']:<22} waits for "
              f"{stall['waits_for']}")
    print(f"roofline {result['roofline_ms']:.2f} ms = max(PE floor {result['pe_floor_ms']:.2f}, HBM floor "
          f"{result['hbm_floor_ms']:.2f} ms for {result['hbm_floor_gib']:.2f} GiB, bf16 dW); model / roofline "
          f"{result['roofline_ratio']:.3f}; SBUF peak {result['sbuf_peak_bytes']:,} of {result['sbuf_usable_bytes']:,} "
          "usable B/partition")
    if "sensitivity" in result:
        print(f"sensitivity (each marked assumption at its low / high end; moe_cost.sensitivity_rates): "
              f"roofline_ratio {result['roofline_ratio_range'][0]:.3f} .. {result['roofline_ratio_range'][1]:.3f}")
        for name, v in result["sensitivity"].items():
            lo, hi = v["roofline_ratio"]
            print(f"  {name:<22} {v['values'][0]!s:>7} / {v['values'][1]!s:<7} model_ms {v['model_ms'][0]:>6.3f} / "
                  f"{v['model_ms'][1]:<6.3f} roofline_ratio {lo:.3f} / {hi:.3f}")
    if "what_if" in result:
        print(f"what if (model_ms with one group of costs removed; roofline {result['roofline_ms']:.2f} ms):")
        for name, v in result["what_if"].items():
            print(f"  {name:<26} {v['model_ms']:>7.2f} ms  {v['roofline_ratio']:.3f} x roofline")
    targets = {"static_instructions": 5000, "padding_fraction": 0.10, "dma_small_fraction": 0.10,
               "pe_flops_ratio": 1.25, "divergent_loops": 0, "roofline_ratio": 1.3,
               "sbuf_peak_bytes": result["sbuf_usable_bytes"]}
    for key, limit in targets.items():
        print(f"  {key:<22} {result[key]:>12,} target <= {limit:<8} {'met' if result[key] <= limit else 'MISSED'}")
    if args.compare_nki_library:
        x, ids, w, w_gate, w_up, w_down, _ = layer_inputs(T, E, K, D, F, getattr(torch, args.dtype), args.seed)
        compare_nki_library(args.compare_nki_library, x, ids, w, w_gate, w_up, w_down, bs, args.lnc, fwd,
                            d["forward_counters"], args.aws_blocks, args.aws_skip_weights)
    print(json.dumps(result))


def compare_nki_library(library, x, ids, weights, w_gate, w_up, w_down, block, lnc, ours, ours_counters,
                        blocks="tests", skip_weights=False):
    """Our forward's counters and trn2 time model next to nki-library's bwmm_shard_on_block on the same routing
    (docs/nki_kernels.md); `blocks`, `skip_weights`: its static block count and skip mode
    (`conformance.aws_blockwise_forward_counters`)."""
    from workbench.kernels.nki_emulator import counters
    from workbench.kernels.nki_emulator.conformance import aws_blockwise_forward_counters
    from workbench.kernels.nki_emulator.timing import model, schedule

    t0 = time.perf_counter()
    with counters(trace=True) as traced:  # nested: collects the same launch with its trace, for the dependency model
        c, plan = aws_blockwise_forward_counters(library, x.detach(), ids, weights.detach(), w_gate, w_up, w_down,
                                                 block, lnc, blocks=blocks, skip_weights=skip_weights)
    aws = summarize(c, "fwd")
    mode = "SkipMode(True, True) (mode 3)" if skip_weights else "SkipMode(True, False)"
    print(f"nki-library bwmm_shard_on_block, same routing: {plan['blocks']} static blocks ({plan['blocks_needed']} "
          f"needed), {mode}, emulated in {time.perf_counter() - t0:.0f}s")
    rows = [("static", "static_total"), ("executed", "executed_total"), ("DMAs", "dma_count"),
            ("DMA bytes", "dma_bytes"), ("PE FLOPs", "pe_flops"), ("SBUF peak B/part.", "sbuf_peak")]
    print(f"{'forward':<20}{'ours':>16}{'nki-library':>16}")
    for kind in ("static", "executed"):
        for engine in sorted(set(ours[kind]) | set(aws[kind])):
            print(f"{kind + ' ' + engine:<20}{ours[kind].get(engine, 0):>16,}{aws[kind].get(engine, 0):>16,}")
    for label, key in rows:
        print(f"{label:<20}{ours[key]:>16,}{aws[key]:>16,}")
    print(f"{'PSUM peak B/part.':<20}{'':>16}{c.psum_peak:>16,}  (capacity 16,384 = 8 banks; run with the SBUF/PSUM "
          "capacity rules lifted)")
    # The same trn2 time model (nki_emulator.timing) over both kernels' counters: a model, not a measurement.
    mine, theirs = model(ours_counters), model(c)
    print(f"{'model ms, dependency':<20}{schedule(ours_counters).seconds * 1e3:>16.3f}"
          f"{schedule(traced).seconds * 1e3:>16.3f}")
    for label, get in (("model ms, overlap", lambda t: f"{t.overlap_s * 1e3:.3f}"),
                       ("model ms, serial", lambda t: f"{t.serial_s * 1e3:.3f}"), ("bound", lambda t: t.bound),
                       ("unmodeled instr.", lambda t: f"{sum(t.unmodeled.values()):,}")):
        print(f"{label:<20}{get(mine):>16}{get(theirs):>16}")
    if theirs.unmodeled:
        print(f"nki-library instructions the model has no cost for: {dict(theirs.unmodeled)}")
    for engine in mine.engines:
        print(f"{'  ms ' + engine:<20}{mine.engines[engine] * 1e3:>16.3f}{theirs.engines[engine] * 1e3:>16.3f}")


if __name__ == "__main__":
    main()
