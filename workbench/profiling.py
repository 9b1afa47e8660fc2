"""Peak FLOP/s per device, for an MFU that means something on every device.

torchtitan looks the peak up by GPU name and falls back to the A100's 312 TFLOP/s for anything it does not
know — on a CPU that makes MFU meaningless. Here:
  * neuron: 158 TFLOP/s bf16 per LNC=2 rank (trn2: 8 NeuronCore-v3 at 79 TFLOP/s per chip, 2 per rank);
  * cuda: a table of dense bf16/fp32 peaks by device name (H100/H200 SXM: 989 bf16 TFLOP/s);
  * cpu: *measured* by a square-matmul microbenchmark in the training dtype, once per machine and
    thread count, cached under ~/.cache/workbench/.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

# Dense (no sparsity) peaks in FLOP/s.
GPU_PEAKS = {  # name fragment -> {dtype: peak}
    "H200": {"bfloat16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float32": 19.5e12},
    "L40S": {"bfloat16": 362e12, "float32": 91.6e12},
}
NEURON_PEAK_PER_RANK = {"bfloat16": 158e12, "float32": 158e12 / 4}  # trn2 LNC=2 logical core


def _cache_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "workbench" / "cpu_peak_flops.json"


def measure_cpu_peak(dtype: str = "float32", n: int = 1024, repeats: int = 5) -> float:
    """Best-of-`repeats` FLOP/s of an n x n matmul on this CPU with the current torch thread count."""
    dt = getattr(torch, dtype)
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    a @ b  # warm-up (thread pool, kernels)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def peak_flops(device_kind: str, dtype: str = "bfloat16") -> float:
    """Peak FLOP/s of one device (one rank) in `dtype`."""
    if device_kind == "neuron":
        return NEURON_PEAK_PER_RANK[dtype]
    if device_kind == "cuda":
        name = torch.cuda.get_device_name(0)
        for frag, peaks in GPU_PEAKS.items():
            if frag in name:
                return peaks[dtype]
        return GPU_PEAKS["A100"][dtype]
    key = f"{platform.processor() or platform.machine()}|{os.cpu_count()}|{torch.get_num_threads()}|{dtype}"
    cache = _cache_file()
    table = {}
    if cache.is_file():
        try:
            table = json.loads(cache.read_text())
        except json.JSONDecodeError:
            table = {}
    if key not in table:
        table[key] = measure_cpu_peak(dtype)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(cache)
    return table[key]
