"""Per-rank memory plan of one training step, traced from the real model without the hardware.

    python -m workbench.plan --job.config_file configs/X.toml [--nproc N] [--nnodes M]
                             [--device trn2|h100|h200|cpu] [--reserve-gib G] [--json] [--section.key value ...]

What is traced is what `train.py` builds: the backend's real model (its torchtitan `ModelSpec`, built on the meta
device), wrapped by the backend's real `parallelize_fn` (FSDP2 / activation checkpointing / TP as configured), the
real loss (`training.loss_chunks` included) and the real optimizer, all from `titan_config.build_titan_config`.
The step runs under `FakeTensorMode` (shapes and dtypes, no data) over torch's fake process group of the full world
size, inside PyTorch's `FSDPMemTracker`, which records every storage alive at each op and keeps the per-category
breakdown at the peak. One rank is traced: FSDP/TP ranks are symmetric.

Why the numbers can be trusted: the optimizer state is created by a warm-up step *before* tracking (AdamW creates
it lazily in its first `step()`), so the traced step is a steady-state step -- forward, backward and optimizer step
with the moments already resident -- and nothing is counted twice. Each category is validated against real runs
by `benchmarks/plan_validation.py`.

Categories (bytes per rank at the step's peak): sharded parameters, gradients, optimizer state, all-gathered
parameters (FSDP's unsharded copies + all-gather buffers), activations (what the AC mode keeps for backward),
attention scores (tensors ending in [seq, seq]: only SDPA's math path makes them), attention mask (what the step
builds for packed documents with `training.document_mask`: the dense [B, 1, S, S] bool block-causal mask of SDPA,
or flex's BlockMask / varlen's cu_seqlens; traced from rows of two documents each), logits and loss (every tensor
whose last dim is the local vocabulary: logits, their fp32 copies, softmax and gradients), nki kernel buffers
(on trn2, everything the nki_moe experts allocate per call: the kernels' own HBM tensors and the autograd glue's
copies), other temporaries, and device runtime (HBM the device's runtime holds outside the tensors: `TRN2_RUNTIME`,
`CUDA_RUNTIME`). "other temporaries" is shown split into its parts (`OTHER_PARTS`): backward temporaries (what the
backward pass allocates besides the above: activation gradients, recomputed inputs of its matmuls), unsharded
gradients (FSDP's full-size gradients before they are reduce-scattered), reduce-scatter buffers and the inputs.

What to change: for every category over `LARGE` of the peak the plan lists the tensors that make it at the peak
(grouped by operator, shape and module, from the tracker's live storages when the peak was reached) and the
setting that shrinks it (`LEVERS`); the saving of the first `advise` of those settings is computed by re-planning
the changed config, never estimated.

The target device changes more than the dtypes (`training.dtype = auto`: bf16 compute on cuda/neuron, fp32 on
CPU) and the capacity; the trace itself runs on this host's CPU, so what would run differently there is put in:
* trn2 (neuron): the nki_moe experts run the NKI kernels (`kernels.autograd.BlockwiseMoEFunction` with kernels
  that allocate exactly the HBM tensors `kernels.buffers.hbm_allocations` lists; tests/memory/test_tracer.py checks that
  list against the real kernels in the emulator) instead of the torch reference that runs on CPU/CUDA;
* attention: where no fused SDPA kernel is known to exist on the device (`FUSED_SDPA`; neuron), SDPA is traced on
  its math path, whose S x S scores then show in "attention scores". The plan records the SDPA kernel it traced.
* the device runtime's reserve (`Device.runtime`, each figure with its source; `--reserve-gib` overrides).

This module is the command; the plan itself is `workbench.memory`, in three parts with one public entry each: the
tracer (`memory.tracer.trace`), the report (`memory.report.plan`, `render`) and a launch's preflight
(`memory.preflight.plan_for_run`: refuses a plan that does not fit, hands the run its plan), over the device and
category tables (`memory.tables`). The in-run measurement that compares a launch's peaks with the plan is
`workbench.run.peak_memory`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from workbench.core.config import load_config
from workbench.core.errors import ConfigError, announce
from workbench.memory import report, tables


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m workbench.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=1, help="ranks per node (torchrun --nproc_per_node)")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--device", default="trn2", help=f"one of {', '.join(tables.DEVICES)}")
    ap.add_argument("--reserve-gib", type=float, default=None,
                    help="the device runtime's share of a rank in GiB (default: the device's table, see --json)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--no-suggest", action="store_true", help="do not re-plan when it does not fit")
    ap.add_argument("--advise", type=int, default=1,
                    help="re-plan the levers of this many of the largest categories, for their saving (default 1)")
    args, rest = ap.parse_known_args(argv)
    try:
        if args.device not in tables.DEVICES:
            raise ConfigError(f"Unknown --device {args.device!r}; choose one of {', '.join(tables.DEVICES)}.")
        if args.nproc <= 0 or args.nnodes <= 0:
            raise ConfigError("--nproc and --nnodes must be positive.")
        job = load_config(argv=rest, world_size=args.nproc * args.nnodes)
        p = report.plan(job, args.device, args.nproc, args.nnodes, suggest=not args.no_suggest,
                        reserve_gib=args.reserve_gib, advise=args.advise)
    except ConfigError as e:
        return announce(e)
    print(json.dumps(p, indent=1) if args.json else report.render(p), flush=True)
    return 0 if p["fits"] else 1


if __name__ == "__main__":
    sys.stdout.flush()
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip torch.distributed's teardown (see workbench.train.main)
