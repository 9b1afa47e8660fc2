"""The data loader side by side: prepared and raw (this workbench) vs HF `datasets` streaming + split_dataset_by_node.

    PYTHONPATH=. python benchmarks/data_loader.py                 # ~100 MB and ~1 GB of text (the lead's full run)
    PYTHONPATH=. python benchmarks/data_loader.py --sizes 20MB    # a quick run

One generated jsonl corpus per size (random words, documents of 0.5-8 KB; cached in --workdir, generated fast from a
numpy word table). For each size and each of 8 and 64 ranks, rank 0 is simulated in a fresh process and measured:
RSS growth (peak RSS minus the RSS after imports), time to first batch (from constructing the loader), and tokens/s
delivered over the next rows. Loaders:

* prepared: `PackedDataset(<prepared folder>)`: memory-mapped shards, rank 0 reads only its rows;
* raw: `PackedDataset(<the jsonl>)` with an empty cache: the first launch, which prepares into the cache (its
  time to first batch is the prepare; its workers' peak RSS is reported apart);
* hf-stream: `datasets.load_dataset("json", streaming=True)` + `split_dataset_by_node`, tokenized and packed on the
  fly (torchtitan's way).

Prepare throughput is measured on the smallest size with 1 and with 2 workers. Targets (issue 31): prepared RSS
growth <= 64 MiB at 1 GB as at 100 MB, first batch <= 1 s, >= 2M tokens/s per rank at 64 ranks; raw RSS growth
<= 256 MiB at 1 GB; prepare >= 1.7x faster with 2 workers than with 1.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_size(s: str) -> int:
    s = s.strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if s.endswith(unit):
            return int(float(s[:-len(unit)]) * mult)
    return int(s)


def generate(path: Path, size: int, seed: int = 0) -> Path:
    """A jsonl corpus of about `size` bytes of random-word documents (cached: generated once per size)."""
    import numpy as np

    if path.exists() and path.with_suffix(".done").exists():
        return path
    rng = np.random.default_rng(seed)
    syll = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "an", "el", "is", "or", "um", "be", "de", "gi"]
    words = np.asarray([" " + "".join(rng.choice(syll, rng.integers(1, 4))) for _ in range(4096)])
    written = 0
    with path.open("w") as f:
        while written < size:
            lengths = rng.integers(80, 1300, 256)  # words per document
            idx = rng.integers(0, len(words), int(lengths.sum()))
            out, pos = [], 0
            for n in lengths:
                chunk = words[idx[pos:pos + n]]
                pos += n
                out.append(json.dumps({"text": "".join(chunk).lstrip()}))
            block = "\n".join(out) + "\n"
            f.write(block)
            written += len(block)
    path.with_suffix(".done").touch()
    return path


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def measure(mode: str, path: str, world: int, seq: int, rows: int, seconds: float) -> dict:
    """Runs in its own process: rank 0 of `world` ranks, one loader, measured."""
    import numpy as np
    import torch  # noqa: F401 (imported before the baseline)

    from workbench.data import load_tokenizer
    from workbench.data.loader import PackedDataset

    base = rss_mib()  # after imports (torch, tokenizers)
    t0 = time.perf_counter()
    if mode in ("prepared", "raw"):
        it = iter(PackedDataset(path, "", seq, 0, world, seed=0, holdout_docs=0))
        take = lambda: next(it)[1].numel() + 1  # noqa: E731
    else:
        import datasets
        from datasets.distributed import split_dataset_by_node

        tok = load_tokenizer()
        sep = tok.token_to_id("<|endoftext|>")
        ds = split_dataset_by_node(datasets.load_dataset("json", data_files=path, split="train", streaming=True),
                                   rank=0, world_size=world)

        def rows_of():
            buf: list[int] = []
            while True:  # epochs, like the training loaders
                for ex in ds:
                    buf += tok.encode(ex["text"], add_special_tokens=False).ids + [sep]
                    while len(buf) >= seq + 1:
                        row, buf = np.asarray(buf[:seq + 1], dtype=np.int64), buf[seq + 1:]
                        yield torch.from_numpy(row)

        gen = rows_of()
        take = lambda: next(gen).numel()  # noqa: E731
    take()
    first = time.perf_counter() - t0
    t1, tokens, n = time.perf_counter(), 0, 0
    while n < rows and time.perf_counter() - t1 < seconds:
        tokens += take()
        n += 1
    rate = tokens / (time.perf_counter() - t1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 if mode == "raw" else 0.0
    return {"rss_growth_mib": peak - base, "workers_peak_rss_mib": children, "first_batch_s": first,
            "tokens_per_s": rate, "rows": n}


def sub(mode: str, path: Path, world: int, args, env: dict) -> dict:
    cmd = [sys.executable, __file__, "_measure", mode, str(path), str(world), str(args.seq), str(args.rows),
           str(args.seconds)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(f"{mode} at {world} ranks failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def prepare_time(src: Path, out: Path, workers: int, env: dict) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "workbench.data", "prepare", str(src), str(out), "--workers", str(workers),
                    "--shard-mb", "4"], env=env, check=True, capture_output=True)
    dt = time.perf_counter() - t
    return dt, json.loads((out / "manifest.json").read_text())["tokens"]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_measure":
        mode, path, world, seq, rows, seconds = sys.argv[2:8]
        print(json.dumps(measure(mode, path, int(world), int(seq), int(rows), float(seconds))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100MB,1GB", help="corpus sizes (text), comma-separated")
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=300, help="rows timed after the first (or --seconds)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/workbench-data-bench"))
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    table = []
    for size in sizes:
        label = f"{size / 1e6:,.0f} MB"
        src = generate(args.workdir / f"corpus-{size}.jsonl", size)
        cache = args.workdir / f"cache-{size}"
        shutil.rmtree(cache, ignore_errors=True)
        for world in ranks:  # raw first: the first launch prepares into an empty cache
            renv = {**env, "WORKBENCH_DATA_CACHE": str(cache)}
            if world != ranks[0]:
                shutil.rmtree(cache, ignore_errors=True)
            table.append((label, "raw (first launch, prepares)", world, sub("raw", src, world, args, renv)))
        prepared = next(cache.iterdir())
        for world in ranks:
            table.append((label, "prepared", world, sub("prepared", prepared, world, args, env)))
        if not args.skip_hf:
            for world in ranks:
                table.append((label, "hf-stream + split_dataset_by_node", world, sub("hf", src, world, args, env)))
    small = generate(args.workdir / f"corpus-{sizes[0]}.jsonl", sizes[0])
    p1, tokens = prepare_time(small, args.workdir / "prep-1", 1, env)
    p2, _ = prepare_time(small, args.workdir / "prep-2", 2, env)

    print(f"\nseq {args.seq}, rank 0 of N simulated, {os.cpu_count()} cores\n")
    print("| corpus | loader | ranks | RSS growth (MiB) | workers' peak RSS (MiB) "
          "| first batch (s) | tokens/s per rank |")
    print("|---|---|---|---|---|---|---|")
    for label, loader, world, r in table:
        print(f"| {label} | {loader} | {world} | {r['rss_growth_mib']:,.0f} | {r['workers_peak_rss_mib']:,.0f} | "
              f"{r['first_batch_s']:,.2f} | {r['tokens_per_s']:,.0f} |")
    print(f"\nprepare ({sizes[0] / 1e6:,.0f} MB, {tokens:,} tokens): 1 worker {p1:,.1f} s ({tokens / p1:,.0f} tok/s), "
          f"2 workers {p2:,.1f} s ({tokens / p2:,.0f} tok/s): {p1 / p2:.2f}x\n")
    big = max(sizes)
    prep = {(lbl, w): r for lbl, loader, w, r in table if loader == "prepared"}
    raw = {(lbl, w): r for lbl, loader, w, r in table if loader.startswith("raw")}
    big_label = f"{big / 1e6:,.0f} MB"
    checks = [
        ("prepared RSS growth <= 64 MiB (largest size)", max(r["rss_growth_mib"] for (lb, _), r in prep.items()
                                                             if lb == big_label), 64, "<="),
        ("prepared first batch <= 1 s", max(r["first_batch_s"] for r in prep.values()), 1.0, "<="),
        (f"prepared tokens/s per rank at {max(ranks)} ranks >= 2M", min(r["tokens_per_s"] for (_, w), r in prep.items()
                                                                      if w == max(ranks)), 2e6, ">="),
        ("raw RSS growth <= 256 MiB (largest size)", max(r["rss_growth_mib"] for (lb, _), r in raw.items()
                                                         if lb == big_label), 256, "<="),
        ("prepare with 2 workers >= 1.7x 1 worker", p1 / p2, 1.7, ">="),
    ]
    print("| target | measured | met |\n|---|---|---|")
    for name, value, limit, op in checks:
        ok = value <= limit if op == "<=" else value >= limit
        print(f"| {name} | {value:,.2f} | {'yes' if ok else 'NO'} |")


if __name__ == "__main__":
    main()
