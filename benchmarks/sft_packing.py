"""Chat SFT data side by side, on the bundled chat set (chitchat-dataset 0.9.0) at seq_len 2048 and 4096:

    PYTHONPATH=. python benchmarks/sft_packing.py [--seq-lens 2048,4096] [--workers 0]

* packing: rows, pad fraction and trained tokens per row of the workbench's packing (best-fit-decreasing over the
  whole set, over-long conversations truncated before a turn start: `training.overlong = "truncate"`; also split)
  against torchtitan 0.3.0's `ChatDataset` packing on the same tokenized conversations, written here from its
  description: next-fit in the dataset's order (a conversation that does not fit the rest of the row pads the row
  with EOS and starts the next), conversations over seq_len dropped; trained tokens are counted with the same mask
  (every assistant turn) for both;
* prepare throughput: `python -m workbench.data prepare chitchat` into a fresh folder (tokens/s, wall clock);
* step time of block-causal against plain causal attention on CPU, on the first packed row of each seq_len (the
  tiny flavor, one process: `benchmarks/attention_step_time.step_times`).

Prints a table (Markdown) that docs/sft.md holds.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.data import chat, packing  # noqa: E402
from workbench.data.loader import resolve  # noqa: E402
from workbench.data.prepare import prepare  # noqa: E402
from workbench.data.prepared import PreparedDataset  # noqa: E402


def next_fit(lengths: np.ndarray, trained: np.ndarray, seq_len: int) -> dict:
    """torchtitan's ChatDataset packing: a conversation of L tokens fills L - 1 positions; in order, each goes into
    the current row if it fits, else the row is padded and closed and a new one starts; L - 1 > seq_len: dropped."""
    rows = filled = used = kept_trained = dropped = dropped_tokens = 0
    for n, t in zip((lengths - 1).tolist(), trained.tolist(), strict=True):
        if n > seq_len:
            dropped += 1
            dropped_tokens += n + 1
            continue
        if used + n > seq_len:
            rows, used = rows + 1, 0
        used += n
        filled += n
        kept_trained += t
    rows += used > 0
    return {"rows": rows, "pad": 1 - filled / (rows * seq_len), "trained_per_row": kept_trained / rows,
            "dropped": dropped, "dropped_tokens": dropped_tokens}


def ours(p: PreparedDataset, seq_len: int, overlong: str) -> dict:
    rows = packing.ChatRows(p, packing.PackSpec(seq_len=seq_len, overlong=overlong, seed=42, holdout=0), "chitchat")
    st = rows.stats()
    return {"rows": st["rows"], "pad": st["pad_fraction"], "trained_per_row": st["trained_targets"] / st["rows"],
            "dropped": st["dropped"], "dropped_tokens": st["dropped_tokens"], "left_out": st["cut_tokens"]}


def prepare_throughput(workers: int) -> tuple[float, int, int]:
    """(seconds, tokens, shards) of a fresh prepare of the bundled chat set."""
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        m = prepare("chitchat", Path(d) / "out", workers=workers, progress=False, say=lambda _: None)
        dt = time.perf_counter() - t0
    return dt, m["tokens"], len(m["shards"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", default="2048,4096")
    ap.add_argument("--workers", type=int, default=0, help="prepare processes (0 = every core)")
    ap.add_argument("--attention-steps", type=int, default=3, help="timed steps of each attention (0: skip)")
    args = ap.parse_args(argv)

    p = PreparedDataset(resolve("chitchat", progress=False))
    lut = chat.trained_lut()
    lengths = p.lengths.astype(np.int64)
    trained = np.asarray([int(lut[p.owners(i)][1:].sum()) for i in range(len(p))])
    total = int(lengths.sum())
    print(f"bundled chat set: {len(p):,} conversations with an assistant turn ({p.manifest['bad_rows']:,} skipped at "
          f"prepare: {p.manifest['bad_kinds']}), {total:,} tokens, median {int(np.median(lengths)):,}, max "
          f"{int(lengths.max()):,}; {int(trained.sum()):,} trained targets\n")
    print("| seq_len | packing | rows | pad | trained tokens per row | dropped (tokens) | left out by truncation |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        tt = next_fit(lengths, trained, seq_len)
        print(f"| {seq_len:,} | torchtitan 0.3.0 next-fit | {tt['rows']:,} | {100 * tt['pad']:.2f}% | "
              f"{tt['trained_per_row']:,.0f} | {tt['dropped']:,} ({100 * tt['dropped_tokens'] / total:.1f}%) | - |")
        for overlong in ("truncate", "split"):
            w = ours(p, seq_len, overlong)
            print(f"| {seq_len:,} | workbench BFD, {overlong} | {w['rows']:,} | {100 * w['pad']:.2f}% | "
                  f"{w['trained_per_row']:,.0f} | {w['dropped']:,} | {w['left_out']:,} tokens "
                  f"({100 * w['left_out'] / total:.1f}%) |")
    dt, tokens, shards = prepare_throughput(args.workers)
    workers = min(args.workers or os.cpu_count() or 1, shards)
    print(f"\nprepare chitchat ({shards} shard(s): {workers} worker process(es), {os.cpu_count()} cores): {dt:.1f} s "
          f"for {tokens:,} tokens = {tokens / dt:,.0f} tokens/s")
    if args.attention_steps:
        attention_table(p, [int(s) for s in args.seq_lens.split(",")], args.attention_steps)
    return 0


def attention_table(p: PreparedDataset, seq_lens: list[int], steps: int) -> None:
    """Median step time of the tiny flavor on the first packed row of each seq_len, block-causal vs plain causal."""
    import torch

    from benchmarks.attention_step_time import step_times

    print("\n| seq_len | conversations in the row | plain causal (s/step) | block-causal (s/step) | ratio |")
    print("|---|---|---|---|---|")
    for seq_len in seq_lens:
        rows = packing.ChatRows(p, packing.PackSpec(seq_len=seq_len, seed=42, holdout=0), "chitchat")
        positions = torch.from_numpy(rows.row(0)[2])[None]
        r = step_times(positions, steps=steps, loss_chunks=8)
        print(f"| {seq_len:,} | {r['documents']} | {r['plain_causal_s']:.3f} | {r['block_causal_s']:.3f} | "
              f"{r['ratio']:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
