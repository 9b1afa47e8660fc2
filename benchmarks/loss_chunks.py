"""Chunked vs plain loss (training.loss_chunks), measured on CPU with the tiny real-vocabulary flavors, where the
fp32 [tokens, 151,936] logits dominate memory.

    python benchmarks/loss_chunks.py [--chunks 8] [--seq 1024] [--batch 2] [--steps 3]

For each backend: the real model + FSDP2 + loss + optimizer (`workbench.memory.tracer.build`, one gloo rank), the same
weights and batch for both losses; prints the loss and the largest gradient difference, the peak of live tensor
bytes of one steady-state step (PyTorch's tracker in real mode, as benchmarks/plan_validation.py) and the median
step time, side by side.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(args: list[str], state=None, steps: int = 3):
    import torch

    from workbench.core.config import load_config
    from workbench.memory import tracer

    job = load_config(argv=args)
    torch.manual_seed(0)
    b = tracer.build(job, "cpu", 1, tracer.parallel_dims_for(job, "cpu", 1))
    if state is not None:
        b.model.load_state_dict(state)
    t = job.training
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 151_936, (t.local_batch_size, t.seq_len), generator=g)
    labels = torch.randint(0, 151_936, (t.local_batch_size, t.seq_len), generator=g)
    pred = b.model(tokens)
    loss, _ = b.loss_fn(pred, labels, torch.tensor(float(labels.numel())))
    del pred
    loss.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in b.model.named_parameters()}
    sd = {k: v.clone() for k, v in b.model.state_dict().items()}
    # Memory: a fresh build (the tracker must see the model from its first step), warmed optimizer, one step.
    m = tracer.build(job, "cpu", 1, tracer.parallel_dims_for(job, "cpu", 1))
    tracer.warm_optimizer(m)
    tracker = tracer.tracker_class(m.vocab_local)(m.model, m.optimizers.optimizers[0])
    with tracker:
        tracer.training_step(m, tokens, labels)
        m.optimizers.step()
        m.optimizers.zero_grad(set_to_none=True)
    peak = sum(tracer.categories_at_peak(next(iter(tracker.get_tracker_snapshot("peak").values()))).values())
    del m, tracker
    b.optimizers.zero_grad(set_to_none=True)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tracer.training_step(b, tokens, labels)
        b.optimizers.step()
        b.optimizers.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return loss.item(), grads, sd, peak, sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    import torch.distributed as dist

    from tests.run_helpers import free_port
    from workbench.platform import titan_device

    titan_device.pin("cpu")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    print(f"seq {a.seq} x batch {a.batch}, {a.chunks} chunks; memory = peak live tensor bytes of one step")
    print(f"{'backend':<24}{'|dloss|':>10}{'max|dgrad|':>12}{'plain MiB':>11}{'chunked MiB':>13}{'mem ratio':>11}"
          f"{'plain s':>9}{'chunked s':>11}{'time ratio':>12}")
    for backend, flavor in (("native", "tiny"), ("huggingface_v5", "tiny"), ("nki_moe", "tiny-moe"),
                            ("huggingface_v5", "tiny-moe")):
        args = ["--model.flavor", flavor, "--model.backend", backend, "--training.seq_len", str(a.seq),
                "--training.local_batch_size", str(a.batch)]
        l0, g0, sd, m0, t0 = run(args, steps=a.steps)
        l1, g1, _, m1, t1 = run([*args, "--training.loss_chunks", str(a.chunks)], sd, steps=a.steps)
        dg = max((g1[n] - g).abs().max().item() for n, g in g0.items())
        print(f"{backend + ' ' + flavor:<24}{abs(l1 - l0):>10.2e}{dg:>12.2e}{m0 / 2**20:>11.1f}{m1 / 2**20:>13.1f}"
              f"{m1 / m0:>11.3f}{t0:>9.3f}{t1:>11.3f}{t1 / t0:>12.3f}", flush=True)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
