"""A run's metrics: `<run>/metrics.jsonl`, one JSON object per logged step, written, read and trimmed here.

* `WorkbenchMetrics`: torchtitan's metrics processor (through its `log` seam) that appends rank 0's record per
  logged step and prints the progress line. It is built on first use, so that what only reads the file (notebooks,
  bench, the dashboard) imports no torch;
* `read_metrics`: the records in file order; a torn last line (a writer mid-append, a crash) is left out;
* `trim_metrics`: on resume, drops the records after the checkpoint's step and a torn last line, so no step
  appears twice and the file parses again;
* `MemberTally`: for a mixture of datasets, each member's rows so far and its loss in the logged step
  ("rows <member>", "loss <member>").

The MFU's peak and FLOPs per token come from `workbench.run.profiling`.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.core.errors import RunFolderError
from workbench.core.files import open_for_append, write_atomic

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
    """Drops the records after `last_step` and a torn last line from `<run>/metrics.jsonl` (atomically:
    `files.write_atomic`; an intact file is left untouched).

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
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return dropped


def append_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Appends one record as a line of JSON (never through a link planted in the run folder)."""
    with open_for_append(path) as f:
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
            self.extra_source: Callable[[], dict[str, float]] | None = None
            """More values for each record (the trainer's per-member metrics); called on every rank."""

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
                **(self.extra_source() if self.extra_source else {}),
            }
            if "n_tokens_seen" in record:  # a count (torchtitan's sum over ranks is a float)
                record["n_tokens_seen"] = int(record["n_tokens_seen"])
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


class MemberTally:
    """Per member of a mixture: the summed loss and tokens of its rows since the last logged step (`add`, per
    micro-batch), turned into that step's loss per member and the rows each member has given (`collect`).

    Args:
        names: the members as `training.dataset` names them.
        device: where the sums live (the training device: the all-reduce runs there).
    """

    def __init__(self, names: list[str], device):
        self.names, self.device = names, device
        self._sums = None  # [2, members] float64: loss sums, tokens

    def add(self, row_loss, row_tokens, members) -> None:
        """Adds one micro-batch: each row's summed loss and token count, and the member each row came from."""
        import torch

        if self._sums is None:
            self._sums = torch.zeros(2, len(self.names), dtype=torch.float64, device=self.device)
        self._sums[0].index_add_(0, members, row_loss.double())
        self._sums[1].index_add_(0, members, row_tokens.double())

    def collect(self, rows: list[int], group=None) -> dict[str, float]:
        """The record's values (every rank calls it: an all-reduce over `group`) and a fresh start.

        Args:
            rows: rows each member has given since the run began, over all ranks (the data loader's position).
            group: the process group of the ranks whose losses add up (None: this process alone).

        Returns:
            "rows <member>" for every member, "loss <member>" (mean per token) for those with rows in the step.
        """
        import torch
        import torch.distributed as dist

        sums = self._sums if self._sums is not None else torch.zeros(2, len(self.names), dtype=torch.float64,
                                                                     device=self.device)
        if group is not None:
            dist.all_reduce(sums, group=group)
        self._sums = None
        out: dict[str, float] = {f"rows {name}": int(n) for name, n in zip(self.names, rows, strict=True)}
        for name, loss, tokens in zip(self.names, *sums.tolist(), strict=True):
            if tokens:
                out[f"loss {name}"] = loss / tokens
        return out


class NonFiniteGradNorm(Exception):
    """Raised by `WorkbenchMetrics.log` on every rank (the norm is global); the trainer's `train_step` reports it."""

    def __init__(self, loss: float, grad_norm: float):
        super().__init__(f"grad norm {grad_norm}")
        self.loss, self.grad_norm = loss, grad_norm


def __getattr__(name: str):
    if name == "WorkbenchMetrics":
        return _processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["METRICS_FILE", "read_metrics", "trim_metrics", "append_record", "MemberTally",  # and WorkbenchMetrics
           "NonFiniteGradNorm"]
