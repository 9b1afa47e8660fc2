"""Peak host memory (RSS) while loading a sharded Hugging Face checkpoint into a workbench model.

    .venv/bin/python benchmarks/hf_load_memory.py [--dir DIR] [--keep]

Writes a ~0.5 GB fp32 random-init Qwen3 checkpoint with transformers' own `save_pretrained(max_shard_size=...)`
(in a child process, so its memory does not count), then, in a fresh child process: builds the model
(`workbench.model.build_model`, fp32 on CPU), resets the RSS high-water mark (Linux /proc/self/clear_refs),
loads the checkpoint with `workbench.hf_weights.load_into_model`, and prints checkpoint size, RSS before the model
existed, RSS with the model built, the peak during the load, and the ratios. The goal is
peak - RSS-before-model <= 1.5 x checkpoint size (the model's own copy is 1.0 x of that).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# ~128M parameters: 6 layers of width 1024 (ffn 4096) + a tied 32768 x 1024 embedding -> ~0.51 GB in fp32.
SHAPE = dict(dim=1024, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=128, ffn_dim=4096, vocab_size=32768,
             tied=True, max_seq_len=4096)
SHARD = "100MB"


def _rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _hwm() -> int:
    """VmHWM (peak RSS since the last reset) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def make_checkpoint(out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from workbench.core import flavors

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(flavors.hf_config(flavors.Qwen3Shape(**SHAPE)))
    model.save_pretrained(out, max_shard_size=SHARD)


def measure(ckpt: str) -> dict:
    from workbench import backends, hf_weights
    from workbench.core.config import JobConfig
    from workbench.model import build_model
    from workbench.platform import titan_device

    job = JobConfig()
    job.model.hf_checkpoint = ckpt
    titan_device.pin("cpu")
    backends.get("native")  # imports torchtitan: part of the baseline, not of the model
    base = _rss_now()
    model = build_model(job)
    built = _rss_now()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    stats = hf_weights.load_into_model(model, ckpt)
    peak = _hwm()
    size = sum(f.stat().st_size for f in Path(ckpt).glob("*.safetensors"))
    return {"checkpoint_bytes": size, "shards": len(list(Path(ckpt).glob("*.safetensors"))),
            "rss_before_model": base, "rss_model_built": built, "peak_rss_during_load": peak,
            "load_overhead_bytes": peak - built, "load_seconds": stats["seconds"]}


def _child(mode: str, ckpt: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, f"--{mode}", ckpt], env=env, capture_output=True, text=True,
                          cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{mode} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="checkpoint directory to use (created if absent)")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    parser.add_argument("--make", help=argparse.SUPPRESS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make:
        return make_checkpoint(args.make)
    if args.measure:
        return print(json.dumps(measure(args.measure)))
    ckpt = Path(args.dir or tempfile.mkdtemp(prefix="hf_load_memory_")) / "ckpt"
    if not ckpt.exists():
        _child("make", str(ckpt))
    r = json.loads(_child("measure", str(ckpt)).strip().splitlines()[-1])
    gb = 1e9
    size = r["checkpoint_bytes"]
    print(f"checkpoint            {size / gb:6.3f} GB in {r['shards']} shards (fp32)")
    print(f"RSS before the model  {r['rss_before_model'] / gb:6.3f} GB (python + torch + torchtitan)")
    print(f"RSS model built       {r['rss_model_built'] / gb:6.3f} GB")
    print(f"peak RSS during load  {r['peak_rss_during_load'] / gb:6.3f} GB ({r['load_seconds']:.1f} s)")
    print(f"load overhead         {r['load_overhead_bytes'] / gb:6.3f} GB = "
          f"{r['load_overhead_bytes'] / size:.2f} x checkpoint")
    print(f"peak - RSS before the model = "
          f"{(r['peak_rss_during_load'] - r['rss_before_model']) / size:.2f} x checkpoint "
          "(goal <= 1.5)")
    if not (args.dir or args.keep):
        import shutil

        shutil.rmtree(ckpt.parent)


if __name__ == "__main__":
    main()
