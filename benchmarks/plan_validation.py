"""Plan vs measured: the per-rank peak of `workbench.plan` (fake tensors, fake process group) against the same
training step run for real on CPU over gloo.

    python benchmarks/plan_validation.py [--quick]

Measured = PyTorch's tracker in *real* mode: the same `workbench.memory.tracer.build` (real model, real FSDP2 / AC, real
loss and optimizer), real tensors, real gloo collectives, one warm-up step then one tracked step. It counts the bytes of
every real storage alive at each op -- the quantity the plan predicts (live tensor bytes per rank; the CPU
allocator has no peak statistics of its own, and process RSS also counts the interpreter, libraries and
allocator caching). What it checks: fake-tensor shape propagation, the fake process group, the AC mode, the
optimizer's lazy state and FSDP's buffers against reality. On a GPU the same script can compare with
`torch.cuda.max_memory_allocated` (none was lent to us).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MOE_BF16 = ["--job.config_file", "configs/cpu_moe.toml", "--model.flavor", "tiny-moe", "--training.dtype", "bfloat16"]
CASES = [  # (label, nproc, args). MoE cases run in bf16 (as on trn2/GPU): the fake-tensor kernel of torch._grouped_mm
    # accepts bf16 only, while CPU training defaults to fp32.
    ("tiny native", 1, ["--model.flavor", "tiny", "--model.backend", "native"]),
    ("tiny huggingface_v5", 1, ["--model.flavor", "tiny", "--model.backend", "huggingface_v5"]),
    ("tiny native", 2, ["--model.flavor", "tiny", "--model.backend", "native"]),
    ("tiny huggingface_v5", 2, ["--model.flavor", "tiny", "--model.backend", "huggingface_v5"]),
    ("tiny native loss_chunks 4", 2, ["--model.flavor", "tiny", "--model.backend", "native",
                                      "--training.loss_chunks", "4"]),
    ("tiny-moe native bf16", 1, [*MOE_BF16, "--model.backend", "native"]),
    ("tiny-moe nki_moe bf16", 1, [*MOE_BF16, "--model.backend", "nki_moe"]),
    ("tiny-moe huggingface_v5 bf16", 1, [*MOE_BF16, "--model.backend", "huggingface_v5"]),
    ("0.6B native seq 128", 1, ["--model.flavor", "0.6B", "--model.backend", "native", "--training.seq_len", "128",
                                "--training.local_batch_size", "1"]),
]
COMMON = ["--training.seq_len", "256", "--training.local_batch_size", "2"]


def measure(argv: list[str]) -> dict:
    """This rank's tracked peak of one real steady-state step (call under torchrun or alone)."""
    import torch
    import torch.distributed as dist

    from workbench.core.config import load_config
    from workbench.memory import tracer
    from workbench.platform import titan_device

    titan_device.pin("cpu")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if "MASTER_ADDR" not in os.environ:
        from tests.run_helpers import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=world)
    job = load_config(argv=argv)
    b = tracer.build(job, "cpu", world, tracer.parallel_dims_for(job, "cpu", world))
    tracer.warm_optimizer(b, job.training.gradient_accumulation_steps)
    t = job.training
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, 151_936, (t.local_batch_size, t.seq_len), generator=g)
    tracker = tracer.tracker_class(b.vocab_local, t.seq_len)(b.model, b.optimizers.optimizers[0])
    tracker.track_inputs((tokens,))
    with tracker:
        tracer.training_step(b, tokens, tokens.roll(-1, 1))
        b.optimizers.step()
        b.optimizers.zero_grad(set_to_none=True)
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    cats = tracer.categories_at_peak(snap)
    dist.destroy_process_group()
    return {"peak_bytes": sum(cats.values()), "categories": cats}


def run_case(nproc: int, args: list[str]) -> tuple[dict, dict]:
    """(plan, measured rank 0) for one case."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    planned = subprocess.run([sys.executable, "-m", "workbench.plan", "--device", "cpu", "--nproc", str(nproc),
                              "--json", "--no-suggest", *args], capture_output=True, text=True, env=env, cwd=ROOT)
    assert planned.returncode in (0, 1), planned.stderr[-3000:]
    from tests.run_helpers import free_port

    real = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                           f"--master_port={free_port()}", __file__, "--measure", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert real.returncode == 0, real.stderr[-3000:]
    line = next(x for x in real.stdout.splitlines() if x.startswith("{"))
    return json.loads(planned.stdout), json.loads(line)


def main() -> None:
    if "--measure" in sys.argv:
        argv = [a for a in sys.argv[1:] if a != "--measure"]
        m = measure(argv)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(m), flush=True)
        os._exit(0)
    cases = CASES[:4] if "--quick" in sys.argv else CASES
    print(f"{'case':<30}{'ranks':>6}{'plan MiB':>11}{'measured MiB':>14}{'plan/measured':>15}")
    for label, nproc, args in cases:
        p, m = run_case(nproc, [*COMMON, *args])
        print(f"{label:<30}{nproc:>6}{p['peak_bytes'] / 2**20:>11.1f}{m['peak_bytes'] / 2**20:>14.1f}"
              f"{p['peak_bytes'] / m['peak_bytes']:>15.3f}", flush=True)
        for cat in m["categories"]:  # the traced categories (on CPU the plan adds no device runtime)
            print(f"    {cat:<26}{p['categories'][cat] / 2**20:>11.1f}{m['categories'][cat] / 2**20:>14.1f}")


if __name__ == "__main__":
    main()
