"""What checkpoint checksums cost at one 0.6B-shaped rank: seconds per GB, side by side in one process.

One rank holding a whole Qwen3-0.6B training state (fp32 parameters of the real shapes + AdamW's two moments: the
tensors DCP writes) is saved three ways into a temporary folder:
  * plain DCP (`dcp.save`, torchtitan's default writer);
  * the workbench's save: the same writer hashing every byte as it is written (xxh3-64), the read-back check of
    every file against those checksums, and `checksums.json` (`workbench.run.checkpoint.dcp_save`'s path);
  * hashing alone, for comparison: zlib.crc32 and xxh3-64 over the saved files (page cache warm).
and the load-time verification (`verify_checkpoint`: sizes + every file's checksum). The saves alternate (plain,
workbench, plain, workbench, ...) so that load from other processes hits both alike.

    .venv/bin/python benchmarks/checkpoint_checksum.py [--repeats 2] [--layers 28] [--dir /tmp]

`--layers` below 28 scales the state down (the rate per GB is what is reported) when memory is short.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import xxhash

from workbench.core import flavors
from workbench.run.checkpoint import checksumming_writer, commit_checksums, verify_checkpoint


def param_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Qwen3-0.6B's parameter shapes (tied embedding; the first `layers` decoder layers)."""
    s = flavors.get_shape("0.6B")
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    shapes = {"tok_embeddings.weight": (s.vocab_size, s.dim), "norm.weight": (s.dim,)}
    for i in range(layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in {
            "attention.wq.weight": (q, s.dim), "attention.wk.weight": (kv, s.dim), "attention.wv.weight": (kv, s.dim),
            "attention.wo.weight": (s.dim, q), "attention.q_norm.weight": (s.head_dim,),
            "attention.k_norm.weight": (s.head_dim,), "attention_norm.weight": (s.dim,), "ffn_norm.weight": (s.dim,),
            "feed_forward.w1.weight": (s.ffn_dim, s.dim), "feed_forward.w3.weight": (s.ffn_dim, s.dim),
            "feed_forward.w2.weight": (s.dim, s.ffn_dim)}.items()})
    return shapes


def state_of_0_6b(layers: int) -> dict[str, torch.Tensor]:
    """fp32 parameters of those shapes and AdamW's two moments of each (random values: hashing cost does not
    depend on them)."""
    return {f"{kind}.{name}": torch.randn(shape) for name, shape in param_shapes(layers).items()
            for kind in ("param", "exp_avg", "exp_avg_sq")}


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def save_plain(state, path: Path) -> None:
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def save_workbench(state, path: Path) -> None:
    sums: dict = {}
    metadata = dcp.save(state, storage_writer=checksumming_writer(str(path), sums), no_dist=True)
    commit_checksums(path, sums, metadata)


def crc32_files(path: Path) -> int:
    crc = 0
    for f in sorted(path.iterdir()):
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                crc = zlib.crc32(chunk, crc)
    return crc


def xxh3_files(path: Path) -> str:
    h = xxhash.xxh3_64()
    for f in sorted(path.iterdir()):
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    state = state_of_0_6b(args.layers)
    gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
    print(f"state: Qwen3-0.6B shapes, {args.layers} layers, fp32 params + 2 Adam moments = {gb:.2f} GB")
    root = Path(tempfile.mkdtemp(dir=args.dir))
    times: dict[str, list[float]] = {"plain DCP save": [], "workbench save (hash + read-back + commit)": [],
                                     "verify at load (sizes + xxh3-64)": [], "crc32 of the files": [],
                                     "xxh3-64 of the files": []}
    saves = {"plain DCP save": save_plain, "workbench save (hash + read-back + commit)": save_workbench}
    after_save = {"verify at load (sizes + xxh3-64)": verify_checkpoint, "crc32 of the files": crc32_files,
                  "xxh3-64 of the files": xxh3_files}
    try:
        for i in range(args.repeats):
            for label, save in saves.items():
                path = root / f"{i}-{label[:5]}"
                times[label].append(timed(lambda save=save, path=path: save(state, path)))
                if save is save_workbench:
                    for name, fn in after_save.items():
                        times[name].append(timed(lambda fn=fn, path=path: fn(path)))
                shutil.rmtree(path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    plain = min(times["plain DCP save"])
    print(f"{'':44s} {'best s':>8s} {'s/GB':>8s} {'vs plain save':>14s}")
    for label, ts in times.items():
        best = min(ts)
        print(f"{label:44s} {best:8.2f} {best / gb:8.3f} {best / plain:13.2f}x")
    extra = min(times["workbench save (hash + read-back + commit)"]) - plain
    print(f"checksum cost of a save: {extra:+.2f} s = {extra / gb:+.3f} s/GB ({100 * extra / plain:+.0f}% of the "
          "plain save)")


if __name__ == "__main__":
    main()
