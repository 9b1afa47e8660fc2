"""Training throughput of huggingface_v5 relative to native on the CPU debug configs, measured side by side.

    .venv/bin/python benchmarks/hf_vs_native.py [--nproc 2] [--steps 20] [--warmup 5] [--rounds 2]

For each config (configs/cpu_dense.toml, configs/cpu_moe.toml) both backends train the same job through the
public launcher (`workbench.train.train`: torchrun, FSDP2 over gloo) with nothing changed but
`model.backend`. Launches alternate (native, hf, then hf, native, ...) for `--rounds` rounds, so load from
other processes on the machine lands on both sides alike. Each launch contributes the tokens_per_second of
every logged step after `--warmup` (from its metrics.jsonl); a backend's figure is the median over all of
them. Prints a table with the medians and the ratio huggingface_v5 / native (> 1: the HF path is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run from a checkout without installing: this process and the torchrun workers it launches import workbench.
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
CONFIGS = ("configs/cpu_dense.toml", "configs/cpu_moe.toml")
BACKENDS = ("native", "huggingface_v5")


def step_throughputs(config: str, backend: str, *, nproc: int, steps: int, warmup: int, dump: Path,
                     tag: str) -> list[float]:
    """Trains once and returns tokens/s (per rank) of each logged step after the warm-up."""
    from workbench.core.config import load_config
    from workbench.train import train

    job = load_config(ROOT / config, model={"backend": backend}, training={"steps": steps},
                      job={"dump_folder": str(dump), "experiment_name": f"{Path(config).stem}_{backend}_{tag}"})
    run_dir = train(job, nproc=nproc, stream=lambda line: None)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens_per_second"] for r in records if r["step"] > warmup]


def measure(config: str, *, nproc: int, steps: int, warmup: int, rounds: int, dump: Path) -> dict:
    """Median tokens/s per backend over `rounds` alternating launches, and their ratio."""
    samples: dict[str, list[float]] = {b: [] for b in BACKENDS}
    for r in range(rounds):
        order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
        for backend in order:
            samples[backend] += step_throughputs(config, backend, nproc=nproc, steps=steps, warmup=warmup,
                                                 dump=dump, tag=str(r))
    native, hf = (statistics.median(samples[b]) for b in BACKENDS)
    return {"config": config, "ranks": nproc, "steps measured": len(samples["native"]),
            "native tok/s": round(native, 1), "huggingface_v5 tok/s": round(hf, 1),
            "ratio hf/native": round(hf / native, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks per launch")
    parser.add_argument("--steps", type=int, default=20, help="training steps per launch")
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=2, help="alternating launches per backend and config")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup (no step would be measured)")

    import pandas as pd

    with tempfile.TemporaryDirectory(prefix="hf_vs_native_") as dump:
        rows = [measure(c, nproc=args.nproc, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                        dump=Path(dump)) for c in args.configs]
    print(pd.DataFrame(rows).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
