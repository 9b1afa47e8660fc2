"""A run's metrics: `<run>/metrics.jsonl`, one JSON object per logged step, written, read and trimmed here.

* `WorkbenchMetrics`: torchtitan's metrics processor (through its `log` seam) that appends rank 0's record per
  logged step and prints the progress line. It is built on first use, so that what only reads the file (notebooks,
  bench, the dashboard) imports no torch;
* `read_metrics`: the records in file order; a torn last line (a writer mid-append, a crash) is left out;
* `trim_metrics`: on resume, drops the records after the checkpoint's step and a torn last line, so no step
  appears twice and the file parses again.

The MFU's peak and FLOPs per token come from `workbench.run.profiling`.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from workbench.core.errors import RunFolderError

METRICS_FILE = "metrics.jsonl"


def _parse(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(the records of `path`, 1 if its last line is torn else 0). A bad line elsewhere is refused."""
    lines = [(n, line) for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a record with a step")
        except ValueError:
            if i == len(lines) - 1:
                return records, 1
            raise RunFolderError(f"{path}:{n} is not a metrics record (the file was edited or damaged).",
                                 f"delete that line (or the file: {path.parent} keeps its checkpoints).") from None
        records.append(record)
    return records, 0


def read_metrics(run_dir: str | os.PathLike, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The records of `<run>/metrics.jsonl` (rank 0's), in file order, without a torn last line.

    A resumed run appends to the file; a fresh run in a reused folder starts it again.

    Args:
        run_dir: the run folder.
        missing_ok: return [] when the file does not exist yet (a run that has not finished a step: dashboards
            polling a live run); False = raise.

    Raises:
        FileNotFoundError: no metrics.jsonl and not `missing_ok` (the message says why it may be missing).
        RunFolderError: a line other than the last is not a record.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        if missing_ok:
            return []
        raise FileNotFoundError(f"{path} does not exist: the run logged no step (see its log), or {run_dir} "
                                "is not a run folder.")
    return _parse(path)[0]


def trim_metrics(run_dir: str | os.PathLike, last_step: int) -> int:
    """Drops the records after `last_step` and a torn last line from `<run>/metrics.jsonl` (atomically: temp file
    + rename; an intact file is left untouched).

    A resumed run continues after its checkpoint's step; the steps an interrupted launch logged past it are redone,
    and must not appear twice. Returns the number of lines dropped.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    records, torn = _parse(path)
    kept = [r for r in records if r["step"] <= last_step]
    dropped = len(records) - len(kept) + torn
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
    return dropped


def append_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Appends one record as a line of JSON."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


@functools.cache
def _processor_class():
    """`WorkbenchMetrics`, built on first use (it subclasses torchtitan's MetricsProcessor, which imports torch)."""
    import math
    import time
    from dataclasses import dataclass

    from torchtitan.components.metrics import MetricsProcessor

    from workbench.platform.dist_utils import rank, say

    class WorkbenchMetrics(MetricsProcessor):
        """torchtitan's metrics processor plus metrics.jsonl and a one-line progress report."""

        @dataclass(kw_only=True, slots=True)
        class Config(MetricsProcessor.Config):
            jsonl_path: str = ""
            backend: str = ""
            total_steps: int = 0
            peak_flops: float = 0.0
            """Peak FLOP/s of one device in the training dtype (replaces torchtitan's table lookup)."""

        def __init__(self, config: Config, **kwargs):
            super().__init__(config, **kwargs)
            if config.peak_flops > 0:
                self.gpu_peak_flops = config.peak_flops
            self.history: list[dict[str, Any]] = []

        def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
                extra_metrics: dict[str, Any] | None = None):
            cfg = self.config
            if not math.isfinite(grad_norm):  # torchtitan checks the loss only; a non-finite norm poisons the weights
                raise NonFiniteGradNorm(global_avg_loss, grad_norm)
            time_delta = time.perf_counter() - self.time_last_log
            steps_in_window = max(len(self.data_loading_times), 1)  # one data fetch per micro-batch
            # tokens per second per device (torchtitan's definition)
            tps = self.ntokens_since_last_log / (time_delta * self.parallel_dims.non_data_parallel_size)
            mfu = self.num_flops_per_token * tps / self.gpu_peak_flops
            mem = self.device_memory_monitor.get_peak_stats()
            record = {
                "step": step,
                "loss": global_avg_loss,
                "max_loss": global_max_loss,
                "grad_norm": grad_norm,
                "tokens_per_second": tps,
                "mfu": mfu,
                "tflops": self.num_flops_per_token * tps / 1e12,
                "step_time_s": time_delta / max(step - getattr(self, "_last_step", step - 1), 1),
                "data_time_s": sum(self.data_loading_times) / steps_in_window,
                "peak_memory_bytes": int(mem.max_reserved_gib * 1024**3),
                "backend": cfg.backend,
                "time": time.time(),
                **{k: v for k, v in (extra_metrics or {}).items() if isinstance(v, (int, float))},
            }
            self._last_step = step
            self.history.append(record)
            self.logger.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step)
            if rank() == 0:
                if cfg.jsonl_path:
                    append_record(cfg.jsonl_path, record)
                width = len(str(cfg.total_steps))
                say(
                    f"step {step:>{width}}/{cfg.total_steps}  loss {global_avg_loss:8.4f}  "
                    f"tok/s {tps:10,.0f}  mfu {100 * mfu:6.2f}%  mem {mem.max_reserved_gib:6.2f} GiB  "
                    f"step {record['step_time_s']:.3f}s"
                )
            self.ntokens_since_last_log = 0
            self.data_loading_times.clear()
            self.time_last_log = time.perf_counter()
            self.device_memory_monitor.reset_peak_stats()

    return WorkbenchMetrics


class NonFiniteGradNorm(Exception):
    """Raised by `WorkbenchMetrics.log` on every rank (the norm is global); the trainer's `train_step` reports it."""

    def __init__(self, loss: float, grad_norm: float):
        super().__init__(f"grad norm {grad_norm}")
        self.loss, self.grad_norm = loss, grad_norm


def __getattr__(name: str):
    if name == "WorkbenchMetrics":
        return _processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["METRICS_FILE", "read_metrics", "trim_metrics", "append_record", "NonFiniteGradNorm"]  # and WorkbenchMetrics
