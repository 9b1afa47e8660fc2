"""Step time of block-causal attention (packed documents kept apart) against plain causal attention, on CPU.

    PYTHONPATH=. python benchmarks/attention_step_time.py [--seq-len 1024] [--docs 8] [--batch 1] [--steps 5]
                                                          [--backend native] [--config configs/cpu_dense.toml]

One process, one model (tiny, real vocabulary, fp32), the same tokens both ways: a WorkbenchTrainer built with
`training.document_mask`, whose real step runs once with the batch's document positions (post_dataloading_process
builds the additive block-causal mask; SDPA takes it) and once with continuous positions through torchtitan's own
post-processing (no mask: SDPA's is_causal, exactly what trains with `training.document_mask = false`). The two
alternate, after a warm-up of each; each step is forward, loss, backward and the optimizer step. Prints the median
step time of each and their ratio.

Other benchmarks call `step_times(positions, ...)` with their own packed rows (benchmarks/sft_packing.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import tempfile
import time

import torch


@contextlib.contextmanager
def one_rank_trainer(job):
    """A WorkbenchTrainer of `job` in this process (a gloo world of one), closed with its process group after."""
    from workbench.platform import titan_device

    titan_device.pin("cpu")
    from workbench.run.titan_config import build_titan_config
    from workbench.run.trainer import WorkbenchTrainer, quiet_titan_logs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    quiet_titan_logs(job.job.verbose)
    cfg = build_titan_config(job, "cpu", 1)
    trainer = WorkbenchTrainer(cfg)
    try:
        yield trainer
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def document_positions(lengths: list[int]) -> torch.Tensor:
    """[S] positions of a row packing documents of these lengths."""
    return torch.cat([torch.arange(n) for n in lengths])


def step_times(positions: torch.Tensor, config: str = "configs/cpu_dense.toml", backend: str = "native",
               steps: int = 5, loss_chunks: int = 0) -> dict:
    """Median seconds of one training step with block-causal attention over the documents of `positions` ([B, S],
    restarting at 0 in each document) and with plain causal attention, alternated in one process.

    Returns:
        {"backend", "batch", "seq_len", "documents", "plain_causal_s", "block_causal_s", "ratio" (block / plain)}.
    """
    from torchtitan.trainer import Trainer

    from workbench.backends import attention
    from workbench.core.config import load_config

    B, S = positions.shape
    with tempfile.TemporaryDirectory() as out:
        job = load_config(config, model__backend=backend, training__document_mask=True, training__seq_len=S,
                          training__local_batch_size=B, training__loss_chunks=loss_chunks, job__dump_folder=out)
        with one_rank_trainer(job) as trainer:
            tokens = torch.randint(0, job.shape.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
            labels = tokens.roll(-1, 1)
            valid = torch.tensor(float(labels.numel()))

            def block_causal():
                trainer.forward_backward_step(input_dict={"input": tokens, "positions": positions}, labels=labels,
                                              global_valid_tokens=valid)

            def plain_causal():  # torchtitan's own post-processing of continuous positions: no mask
                inputs, lab, extra = Trainer.post_dataloading_process(
                    trainer, {"input": tokens, "positions": torch.arange(S).expand(B, S)}, labels)
                trainer.fwd_bwd_fn(inputs, lab, valid, extra)

            def timed(step) -> float:
                t0 = time.perf_counter()
                step()
                trainer.optimizers.step()
                trainer.optimizers.zero_grad()
                return time.perf_counter() - t0

            timed(plain_causal), timed(block_causal)  # warm-up
            plain, block = [], []
            for _ in range(steps):
                plain.append(timed(plain_causal))
                block.append(timed(block_causal))
    p, b = statistics.median(plain), statistics.median(block)
    docs = int(attention.document_boundaries(positions).ids[:, -1].sum()) + B
    return {"backend": backend, "batch": B, "seq_len": S, "documents": docs, "plain_causal_s": p,
            "block_causal_s": b, "ratio": b / p}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--docs", type=int, default=8, help="documents per row (random lengths, seeded)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--backend", default="native")
    ap.add_argument("--config", default="configs/cpu_dense.toml")
    ap.add_argument("--loss-chunks", type=int, default=0)
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(args.batch):
        cuts = torch.randperm(args.seq_len - 1, generator=g)[:args.docs - 1].add(1).sort().values.tolist()
        rows.append(document_positions([b - a for a, b in zip([0, *cuts], [*cuts, args.seq_len], strict=True)]))
    r = step_times(torch.stack(rows), args.config, args.backend, args.steps, args.loss_chunks)
    print(f"{r['backend']}, batch {r['batch']} x seq {r['seq_len']}, {r['documents']} documents, median of "
          f"{args.steps} steps (CPU, fp32, {torch.get_num_threads()} threads):")
    print(f"  plain causal  {r['plain_causal_s'] * 1e3:9.1f} ms/step")
    print(f"  block-causal  {r['block_causal_s'] * 1e3:9.1f} ms/step")
    print(f"  ratio         {r['ratio']:9.3f}  (block-causal / plain causal)")


if __name__ == "__main__":
    main()
