"""Performance accounting: peak FLOP/s per device, model FLOPs per token (MFU), peak memory, torch.profiler traces.

MFU = flops_per_token(shape, seq_len) x tokens/s per device / peak_flops(device, dtype). Both factors are ours,
so the number means the same thing on every backend and every device:

* **Model FLOPs per token** (`flops_per_token`) come from the model *shape*, not from whichever module tree a
  backend builds (transformers' and torchtitan's Qwen3 differ in structure, not in arithmetic)::

      6 x N_matmul  +  6 x n_layers x n_heads x head_dim x seq_len          (causal attention, the default)

  N_matmul counts the weights of every matmul a token goes through: q/k/v/o projections; the dense MLP
  (gate, up, down) or, for MoE, `top_k` of the `num_experts` expert MLPs plus the router; and the lm_head
  (counted even when tied to the embedding: the output projection is a real matmul). The embedding lookup and
  the norms are not matmuls and are not counted. 6 = 2 (multiply-add) x 3 (forward + the two backward matmuls).
  The attention term is the score and value matmuls, 2 x 2 x seq_len x head_dim per head and token forward,
  x 3 for forward + backward, halved because a causal mask makes half the score matrix dead work; pass
  `causal=False` for the non-causal count (12 x ... x seq_len, what torchtitan and the PaLM paper use). No
  recomputation (activation checkpointing) is counted: this is *model* FLOPs utilisation.
* **Peak FLOP/s** (`peak_flops`) per device (= per rank) in the training dtype: trn2 158 TFLOP/s bf16 per LNC=2
  rank (79 per NeuronCore-v3, 667 per chip; fp32 181 per chip); NVIDIA from a table of dense tensor-core peaks;
  an unknown GPU is *measured* with a matmul microbenchmark; a CPU rank's peak is the measured single-core matmul
  peak (cached per CPU model and dtype under ~/.cache/workbench/) times the rank's torch threads. torchtitan's
  fallback (an A100's 312 TFLOP/s for anything it does not recognise) is never used.

Profiling (`StepProfiler`, enabled by `[profiling] enable = true`) records torch.profiler traces of steps
`start_step .. start_step + steps - 1` and writes, per rank, into `<run>/<profiling.folder>/`:

    trace_rank{R}.json.gz       Chrome trace (chrome://tracing, https://ui.perfetto.dev)
    breakdown_rank{R}.csv/.md   per step: data, forward, backward, optimizer, other, communication (ms)
    top_ops_rank{R}.csv/.md     operators by self time (calls, CPU/device time, memory, FLOPs)
    profile_rank{R}.json        steps, peak memory (device memory; process RSS on CPU), the files above

The phases come from `record_function` labels the trainer puts around data loading ("data"), the model and loss
("forward"), `loss.backward()` ("backward") and the optimizer step with its hooks ("optimizer"); "other" is
the rest of the step (gradient clipping, zero_grad, host-to-device copies, loss reduction, logging).
"communication" is the union of visible collective ops (gloo/NCCL/c10d) and overlaps the other phases.

Neuron (TorchNeuron, `torch-neuronx` 2.14): traces add the `PrivateUse1` activity, which the Neuron Explorer
docs name for runtime and device events, and peak memory reads `torch.neuron.max_memory_allocated()` after
`torch.neuron.synchronize()` (the Neuron allocator is asynchronous). Written from the AWS docs; unverified
(no Trainium was available).
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import math
import os
import platform
import re
import resource
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, record_function

from workbench.core.files import FileLock, read_json, write_atomic

if TYPE_CHECKING:
    from workbench.core.config import Profiling

# ------------------------------------------------------------------------------------------------
# Peak FLOP/s
# ------------------------------------------------------------------------------------------------

# Dense (no sparsity) tensor-core peaks in FLOP/s; first matching name fragment wins (specific before generic).
# fp32 = plain FP32 (training "float32" on CUDA runs fp32 matmuls unless TF32 is enabled).
GPU_PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bfloat16": 756e12, "float32": 51e12}),
    ("H100 NVL", {"bfloat16": 835e12, "float32": 60e12}),
    ("H200", {"bfloat16": 989e12, "float32": 67e12}),
    ("H100", {"bfloat16": 989e12, "float32": 67e12}),  # SXM
    ("B200", {"bfloat16": 2250e12, "float32": 80e12}),
    ("A100", {"bfloat16": 312e12, "float32": 19.5e12}),
    ("L40S", {"bfloat16": 362e12, "float32": 91.6e12}),
]
# trn2: per physical NeuronCore-v3 (AWS: 79 TFLOP/s BF16/FP16/TF32; chip = 8 cores: 667 BF16, 181 FP32).
NEURON_CORE_PEAK = {"bfloat16": 79e12, "float16": 79e12, "float32": 181e12 / 8}


def neuron_cores_per_rank() -> int:
    """Physical NeuronCores behind one rank: the logical-core setting; unset = trn2's default, 2."""
    from workbench.core.neuron_env import runtime_lnc

    return runtime_lnc(on_neuron=True)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "workbench" / "cpu_peak_flops.json"


def measure_matmul_peak(dtype: str = "float32", device: str = "cpu", sizes: tuple[int, ...] = (512, 1024),
                        seconds_per_size: float = 1.0) -> float:
    """Best FLOP/s of square matmuls on `device`, each size repeated for `seconds_per_size`.

    The best repeat, not the mean: on a shared machine (other processes, other ranks) the best repeat is the one
    closest to what the hardware can do, and short matmuls (512: ~1 ms on a CPU core) find quiet moments.
    """
    dt = getattr(torch, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dt, device=device), torch.randn(n, n, dtype=dt, device=device)
        a @ b  # warm-up (thread pool, kernel selection)
        sync()
        start = time.perf_counter()
        while time.perf_counter() - start < seconds_per_size:
            t = time.perf_counter()
            a @ b
            sync()
            best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best


def _cached_cpu_core_peak(dtype: str) -> float:
    """The measured single-core FLOP/s of this CPU model in `dtype`; measured once per machine and cached.

    One core, not the process's thread pool: a multi-threaded matmul runs at the pace of its slowest thread, so
    on a shared machine it measures the neighbours' load, while a single thread finds a quiet core. The file lock
    keeps the ranks of one job from measuring at once (they would compete) or clobbering the cache.
    """
    key = f"{_cpu_name()}|{os.cpu_count()}|1 core|{dtype}"
    cache = _cache_file()
    cache.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(cache.with_suffix(".lock"))
    lock.acquire(wait=True)
    try:
        try:
            table = read_json(cache) if cache.is_file() else {}
        except (OSError, ValueError):
            table = {}
        if not isinstance(table, dict) or not isinstance(table.get(key, 0.0), float):
            table = {}
        if key not in table:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                table[key] = measure_matmul_peak(dtype)
            finally:
                torch.set_num_threads(threads)
            write_atomic(cache, json.dumps(table, indent=1))
    finally:
        lock.release(clear=False)
    return table[key]


def peak_flops(device_kind: str, dtype: str = "bfloat16") -> float:
    """Peak FLOP/s of one device (one rank) in `dtype` ("bfloat16", "float16" or "float32")."""
    if device_kind == "neuron":
        return NEURON_CORE_PEAK[dtype] * neuron_cores_per_rank()
    if device_kind == "cuda":
        try:
            name = torch.cuda.get_device_name(0)
        except (RuntimeError, AssertionError):  # `plan --device h100` on a host without a GPU: no GPU, no MFU
            return float("nan")
        for fragment, peaks in GPU_PEAKS:
            if fragment in name:
                return peaks["bfloat16" if dtype == "float16" else dtype]
        warnings.warn(f"No published peak for GPU {name!r}: MFU uses a measured {dtype} matmul peak instead "
                      "(add the datasheet value to workbench.run.profiling.GPU_PEAKS).", stacklevel=2)
        return measure_matmul_peak(dtype, "cuda", sizes=(8192,))
    return _cached_cpu_core_peak(dtype) * torch.get_num_threads()  # this rank's cores


# ------------------------------------------------------------------------------------------------
# Model FLOPs per token
# ------------------------------------------------------------------------------------------------


def matmul_params(shape) -> dict[str, int]:
    """Weights of the matmuls one token goes through, by part (MoE: only its top_k experts + the router).

    Args:
        shape: a `workbench.core.flavors.Qwen3Shape`.
    """
    q_width, kv_width = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    attention = shape.dim * q_width * 2 + shape.dim * kv_width * 2  # q, o + k, v
    if shape.is_moe:
        mlp = shape.top_k * 3 * shape.dim * shape.moe_ffn_dim + shape.dim * shape.num_experts  # experts + router
    else:
        mlp = 3 * shape.dim * shape.ffn_dim
    return {"attention": shape.n_layers * attention, "mlp": shape.n_layers * mlp,
            "lm_head": shape.dim * shape.vocab_size}


def attention_flops_per_token(shape, seq_len: int, causal: bool = True) -> float:
    """Score (QK^T) and value (PV) matmul FLOPs per token, forward + backward (see the module docstring)."""
    full = 12 * shape.n_layers * shape.n_heads * shape.head_dim * seq_len
    return full / 2 if causal else full


def flops_per_token(shape, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs (forward + backward) per token: 6 x active matmul weights + attention.

    Args:
        shape: a `workbench.core.flavors.Qwen3Shape`.
        seq_len: tokens per sequence (the attention term grows with it).
        causal: count only the unmasked half of the attention scores (default); False = the full square.
    """
    return 6 * sum(matmul_params(shape).values()) + attention_flops_per_token(shape, seq_len, causal)


# ------------------------------------------------------------------------------------------------
# Peak memory
# ------------------------------------------------------------------------------------------------


def peak_memory_bytes(device_kind: str) -> int:
    """Peak memory of this process so far: device memory reserved on CUDA, allocated on Neuron (unverified),
    the resident-set high-water mark on CPU."""
    if device_kind == "cuda":
        return int(torch.cuda.max_memory_reserved())
    if device_kind == "neuron":
        torch.neuron.synchronize()  # type: ignore[attr-defined]
        return int(torch.neuron.max_memory_allocated())  # type: ignore[attr-defined]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------


def markdown_table(df: pd.DataFrame, floatfmt: str = ".4g") -> str:
    """A GitHub markdown table of a DataFrame's columns (no index; NaN as an empty cell)."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "" if math.isnan(v) else format(v, floatfmt)
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def save_table(df: pd.DataFrame, stem: Path) -> None:
    """Writes `stem`.csv and `stem`.md."""
    df.to_csv(stem.with_suffix(".csv"), index=False)
    stem.with_suffix(".md").write_text(markdown_table(df))


# ------------------------------------------------------------------------------------------------
# Trace analysis
# ------------------------------------------------------------------------------------------------

PHASES = ("data", "forward", "backward", "optimizer")
STEP_PREFIX = "ProfilerStep#"
# Collectives as they appear in traces: gloo/NCCL ops and kernels, c10d ops, FSDP's labelled ranges.
_COMM = re.compile(r"nccl|gloo|c10d::|record_param_comms|all_?gather|reduce_?scatter|all_?reduce|all_?to_?all|"
                   r"broadcast", re.IGNORECASE)


def load_trace(path: str | os.PathLike) -> dict[str, Any]:
    """A Chrome trace (.json or .json.gz) as a dict with `traceEvents`."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        return json.load(f)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (nested or overlapping events counted once)."""
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def step_breakdown(trace: dict[str, Any] | str | os.PathLike) -> pd.DataFrame:
    """Per profiled step: wall time and its phases in milliseconds, from a trace this module wrote.

    Columns: step, step_ms, data_ms, forward_ms, backward_ms, optimizer_ms, other_ms (= step - phases),
    communication_ms (visible collectives; overlaps the phases), and device_busy_ms when the trace has device
    kernels (union of kernel time).
    """
    events = [e for e in (trace if isinstance(trace, dict) else load_trace(trace))["traceEvents"]
              if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if e["name"].startswith(STEP_PREFIX)), key=lambda e: e["ts"])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    rows = []
    for st in steps:
        lo, hi = st["ts"], st["ts"] + st["dur"]

        def within(pred, lo=lo, hi=hi) -> float:
            spans = [(max(e["ts"], lo), min(e["ts"] + e["dur"], hi)) for e in events
                     if pred(e) and e["ts"] < hi and e["ts"] + e["dur"] > lo]
            return _union_us(spans) / 1e3

        row = {"step": int(st["name"][len(STEP_PREFIX):]), "step_ms": st["dur"] / 1e3}
        for phase in PHASES:
            row[f"{phase}_ms"] = within(lambda e, p=phase: e["name"] == p)
        row["other_ms"] = row["step_ms"] - sum(row[f"{p}_ms"] for p in PHASES)
        row["communication_ms"] = within(lambda e: bool(_COMM.search(e["name"])))
        if kernels:
            row["device_busy_ms"] = within(lambda e: e.get("cat") == "kernel")
        rows.append(row)
    return pd.DataFrame(rows)


def top_ops(prof: torch.profiler.profile, n: int = 25) -> pd.DataFrame:
    """The `n` operators with the most self time (device time when there is any, else CPU), as a table.

    Columns: op, calls, self_ms, self_pct (of all ops' self time), cpu_total_ms, self_device_ms, cpu_mem_mb
    (self CPU memory allocated), device_mem_mb, gflops (FLOPs the profiler could count, e.g. matmuls).
    """
    avgs = [a for a in prof.key_averages() if not a.key.startswith("ProfilerStep") and a.key not in PHASES]
    on_device = any(a.self_device_time_total > 0 for a in avgs)
    self_us = (lambda a: a.self_device_time_total) if on_device else (lambda a: a.self_cpu_time_total)
    total = sum(self_us(a) for a in avgs) or 1.0
    rows = [{
        "op": a.key, "calls": a.count, "self_ms": self_us(a) / 1e3, "self_pct": 100 * self_us(a) / total,
        "cpu_total_ms": a.cpu_time_total / 1e3, "self_device_ms": a.self_device_time_total / 1e3,
        "cpu_mem_mb": a.self_cpu_memory_usage / 2**20, "device_mem_mb": a.self_device_memory_usage / 2**20,
        "gflops": a.flops / 1e9,
    } for a in avgs]
    df = pd.DataFrame(rows)
    return df.sort_values("self_ms", ascending=False).head(n).reset_index(drop=True) if rows else df


# ------------------------------------------------------------------------------------------------
# Recording (the trainer's hooks)
# ------------------------------------------------------------------------------------------------


class Labelled:
    """An iterator whose every `next()` is a `record_function(label)` range (the "data" phase)."""

    def __init__(self, iterator: Iterator, label: str):
        self._it, self._label = iterator, label

    def __iter__(self) -> Labelled:
        return self

    def __next__(self):
        with record_function(self._label):
            return next(self._it)


def label_calls(obj: Any, method: str, label: str) -> None:
    """Makes every call of `obj.<method>` a `record_function(label)` range (wraps this instance only)."""
    original = getattr(obj, method)

    @functools.wraps(original)
    def labelled(*args, **kwargs):
        with record_function(label):
            return original(*args, **kwargs)

    setattr(obj, method, labelled)


def activities(device_kind: str) -> list[ProfilerActivity]:
    """What torch.profiler records: CPU ops always, plus CUDA kernels or Neuron runtime/device events."""
    extra = {"cuda": [ProfilerActivity.CUDA], "neuron": [ProfilerActivity.PrivateUse1]}.get(device_kind, [])
    return [ProfilerActivity.CPU, *extra]


class StepProfiler:
    """torch.profiler over a window of training steps, driven by the trainer (`with profiler.step(n): ...`).

    One step before the window (when there is one) the profiler warms up (Kineto/CUPTI initialisation is not
    recorded); each step of the window is a `ProfilerStep#<n>` range with the real step number; after the last one
    the trace and tables are written (see the module docstring). Disabled, it costs nothing.

    Args:
        cfg: the job's `[profiling]` section (validated: the window starts within the run).
        run_dir: the run folder.
        device_kind: "cpu", "cuda" or "neuron".
        last_step: the run's final step (a window reaching past it is cut there).
        rank: this process's global rank (names the files).
    """

    def __init__(self, cfg: Profiling, run_dir: str | os.PathLike, device_kind: str, last_step: int,
                 rank: int = 0):
        self.enabled = cfg.enable
        self.first = cfg.start_step
        self.last = min(cfg.start_step + cfg.steps - 1, last_step)
        self.folder = Path(run_dir) / cfg.folder
        self.device_kind, self.rank = device_kind, rank
        self._prof: torch.profiler.profile | None = None
        self.files: dict[str, str] = {}

    def _begin(self, step: int) -> None:
        self._prof = torch.profiler.profile(activities=activities(self.device_kind), record_shapes=True,
                                            profile_memory=True, with_flops=True)
        self._prof.prepare_trace()  # warm-up: initialised, not yet recording
        if step >= self.first:  # no warm-up step in this process (window at its start, or a resumed run)
            self._prof.start_trace()

    @contextlib.contextmanager
    def step(self, step: int):
        """Wraps one training step; records it when it falls in the window."""
        if not self.enabled or not (self.first - 1 <= step <= self.last):
            yield
            return
        if self._prof is None:
            self._begin(step)
        if step < self.first:  # the warm-up step
            yield
            self._prof.start_trace()
            return
        with record_function(f"{STEP_PREFIX}{step}"):
            yield
        if step == self.last:
            self._finish()

    def _finish(self) -> None:
        assert self._prof is not None
        self._prof.stop_trace()
        self.folder.mkdir(parents=True, exist_ok=True)
        r = self.rank
        trace = self.folder / f"trace_rank{r}.json.gz"
        self._prof.export_chrome_trace(str(trace))
        self._prof.wait_for_exports()  # CUDA's asynchronous CUPTI export; no-op elsewhere
        breakdown = step_breakdown(trace)
        save_table(breakdown, self.folder / f"breakdown_rank{r}")
        save_table(top_ops(self._prof), self.folder / f"top_ops_rank{r}")
        self.files = {"trace": str(trace), "breakdown": str(self.folder / f"breakdown_rank{r}.csv"),
                      "top_ops": str(self.folder / f"top_ops_rank{r}.csv")}
        summary = {"rank": r, "device": self.device_kind, "steps": [self.first, self.last],
                   "peak_memory_bytes": peak_memory_bytes(self.device_kind),
                   "mean_step_ms": float(breakdown["step_ms"].mean()) if len(breakdown) else None,
                   "files": self.files}
        write_atomic(self.folder / f"profile_rank{r}.json", json.dumps(summary, indent=2))
        self._prof = None


__all__ = [
    "peak_flops", "measure_matmul_peak", "neuron_cores_per_rank", "matmul_params", "attention_flops_per_token",
    "flops_per_token", "peak_memory_bytes", "markdown_table", "save_table", "load_trace", "step_breakdown",
    "top_ops", "Labelled", "label_calls", "activities", "StepProfiler", "GPU_PEAKS", "NEURON_CORE_PEAK", "PHASES",
]
