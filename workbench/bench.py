"""Benchmark matrix: the training paths side by side, same config, data and seed, each in its own torchrun job.

    python -m workbench.bench --job.config_file configs/cpu_moe.toml [--backends huggingface_v5,native,nki_moe]
                              [--steps N] [--nproc N] [--warmup-steps N] [--out DIR] [--section.key value ...]

From Python (notebooks): `workbench.bench.run_matrix("configs/cpu_moe.toml", steps=10)` -> pandas DataFrame.

Each path trains with the identical resolved config (only `model.backend` differs) through `workbench.train.train`,
one after the other (never concurrently: they would share the machine), into `<out>/runs/<backend>/`. Checkpoint
saving, HF export and profiling are switched off (they are not step time). A path that fails (or a config that
does not apply to it, e.g. `nki_moe` on a dense flavor) becomes a row with status "failed"/"skipped" and the
error; the other paths still run. Progress: one bar per path, advanced by its "step n/N" lines; each run's full
output goes to `<out>/runs/<backend>.log`.

Columns of bench.csv / bench.md (bench.png plots them), per path, all from rank 0's metrics.jsonl unless noted:

    tokens_per_s            median tokens/s per device (torchtitan's definition; metrics.jsonl `tokens_per_second`)
    tokens_per_s_all_ranks  tokens_per_s x nproc
    step_time_median_s / step_time_p90_s    over the timed steps
    mfu                     median MFU (model FLOPs from the shape / the device's peak; workbench.run.profiling)
    peak_memory_gib         highest `peak_memory_bytes` (device memory; process RSS high-water mark on CPU)
    first_step_s            wall time of step 1: compilation / lazy initialisation / warm-up (not in the medians)
    time_to_first_step_s    launch of torchrun -> first step logged (measured here: imports, init, step 1)
    init_s                  trainer construction (summary.json `init_seconds`)
    final_loss              loss of the last step
    speed_vs_native         tokens_per_s / native's tokens_per_s
    trn2_moe_layer_model_ms nki_moe row, MoE flavors: a MODEL, not a measurement: the trn2 time of one rank's MoE
                            layer (forward + backward) at this config's shapes (tokens per rank, experts, widths,
                            moe_block_size; bf16, LNC 2), from the NKI kernels' emulator counters through the time
                            model (`workbench.kernels.moe_cost.trn2_moe_layer`): the dependency model (each instruction
                            waits for its engine and its operands); with trn2_moe_layer_serial_ms (no overlap at
                            all) and trn2_moe_layer_roofline_ms (the layer's floor)

The first `warmup_steps` steps are left out of every median and percentile (if a run has no more steps than
that, only its last step is timed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from workbench.core.config import BACKENDS, DEFAULT_BACKEND, NKI_KERNEL_BACKENDS, load_config
from workbench.core.errors import ConfigError, announce, recognised
from workbench.run.metrics import read_metrics

STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)\s")
# Every config change the matrix makes to each run: nothing but training is timed.
BENCH_OVERRIDES = ["--checkpoint.enable", "false", "--checkpoint.export_hf", "false", "--profiling.enable", "false"]
METRIC_COLUMNS = [
    "tokens_per_s", "tokens_per_s_all_ranks", "step_time_median_s", "step_time_p90_s", "mfu", "peak_memory_gib",
    "first_step_s", "time_to_first_step_s", "init_s", "final_loss", "speed_vs_native",
]
MODEL_COLUMNS = ["trn2_moe_layer_model_ms", "trn2_moe_layer_serial_ms", "trn2_moe_layer_roofline_ms"]
COLUMNS = ["backend", "status", *METRIC_COLUMNS, *MODEL_COLUMNS, "steps", "timed_steps", "wall_s", "run_dir", "error"]


# ------------------------------------------------------------------------------------------------
# Reading a finished run
# ------------------------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    return float(pd.Series(values).quantile(q))


def summarize_run(run_dir: str | Path, warmup_steps: int, nproc: int) -> dict[str, Any]:
    """The matrix columns of one finished run (see the module docstring), from its run folder."""
    records = read_metrics(run_dir)
    timed = records[warmup_steps:] if len(records) > warmup_steps else records[-1:]
    summary_file = Path(run_dir) / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    tps = statistics.median(r["tokens_per_second"] for r in timed)
    step_times = [r["step_time_s"] for r in timed]
    return {
        "tokens_per_s": tps,
        "tokens_per_s_all_ranks": tps * nproc,
        "step_time_median_s": statistics.median(step_times),
        "step_time_p90_s": _percentile(step_times, 0.9),
        "mfu": statistics.median(r["mfu"] for r in timed),
        "peak_memory_gib": max(r["peak_memory_bytes"] for r in records) / 2**30,
        "first_step_s": records[0]["step_time_s"] if records[0]["step"] == 1 else float("nan"),
        "init_s": summary.get("init_seconds", float("nan")),
        "final_loss": records[-1]["loss"],
        "steps": records[-1]["step"],
        "timed_steps": len(timed),
    }


# ------------------------------------------------------------------------------------------------
# Running one path
# ------------------------------------------------------------------------------------------------


class _Progress:
    """Consumes a run's output: writes it to its log, advances the progress bar, notes when step 1 appeared."""

    def __init__(self, log_path: Path, bar):
        self.log = open(log_path, "w")
        self.bar = bar
        self.started = time.perf_counter()
        self.first_step_at: float | None = None
        self.tail: deque[str] = deque(maxlen=300)  # enough to reach the rank's error above torchrun's report

    def __call__(self, line: str) -> None:
        self.log.write(line)
        self.tail.append(line.rstrip())
        m = STEP_LINE.match(line)
        if m:
            if self.first_step_at is None:
                self.first_step_at = time.perf_counter()
                # The rate and ETA from step 1 on: start-up (imports, process group, model build) is not a step.
                self.bar.reset(total=int(m[2]))
                self.bar.initial = int(m[1])
                self.bar.set_postfix_str(f"start-up {self.first_step_at - self.started:.0f} s", refresh=False)
            self.bar.total = int(m[2])
            self.bar.n = int(m[1])
            self.bar.refresh()

    def close(self) -> None:
        self.log.close()


def _failure(tail: Iterable[str]) -> str:
    """The most telling line of a failed run's output: the last exception raised in a rank (not torchrun's own
    ChildFailedError report), else the last line."""
    tail = list(tail)
    for line in reversed(tail):
        if re.match(r"^\s*(\[rank\d+\]:\s*)?[\w.]*(Error|Exception)\b", line) and "ChildFailedError" not in line:
            return line.strip()
    return tail[-1].strip() if tail else "no output"


def run_backend(config: str | Path, backend: str, *, out: Path, overrides: list[str], nproc: int,
                warmup_steps: int, show_progress: bool = True, timeout_s: float | None = None) -> dict[str, Any]:
    """Trains one path (torchrun subprocess) and returns its matrix row; never raises for a failed run (nor for
    one stopped at `timeout_s`: its row says so and keeps the steps it logged)."""
    from tqdm.auto import tqdm

    from workbench.train import train

    argv = [*overrides, *BENCH_OVERRIDES, "--model.backend", backend, "--job.dump_folder", str(out / "runs"),
            "--job.experiment_name", backend]
    row: dict[str, Any] = {"backend": backend}
    try:
        job = load_config(config, argv=argv, world_size=nproc)
    except (ConfigError, FileNotFoundError) as e:
        return {**row, "status": "skipped", "error": str(e)}
    shutil.rmtree(job.run_dir, ignore_errors=True)  # metrics.jsonl appends and DCP resumes: start clean
    job.run_dir.mkdir(parents=True)
    bar = tqdm(total=job.training.steps, desc=f"{backend:>14}", unit="step", disable=not show_progress,
               leave=True, file=sys.stderr)
    progress = _Progress(out / "runs" / f"{backend}.log", bar)
    row["run_dir"] = str(job.run_dir)
    try:
        train(job, nproc=nproc, stream=progress, timeout_s=timeout_s)
        row.update(status="ok", **summarize_run(job.run_dir, warmup_steps, nproc))
    except subprocess.TimeoutExpired:
        row.update(status="timed out", error=f"stopped after the {timeout_s:.0f} s limit")
        with contextlib.suppress(FileNotFoundError, KeyError, ValueError, IndexError, statistics.StatisticsError):
            row.update(**summarize_run(job.run_dir, warmup_steps, nproc))
    except (subprocess.CalledProcessError, FileNotFoundError, KeyError, ValueError) as e:
        row.update(status="failed", error=_failure(progress.tail) if isinstance(e, subprocess.CalledProcessError)
                   else f"{type(e).__name__}: {e}")
    finally:
        progress.close()
        bar.close()
    row["wall_s"] = time.perf_counter() - progress.started
    if progress.first_step_at is not None:
        row["time_to_first_step_s"] = progress.first_step_at - progress.started
    return row


# ------------------------------------------------------------------------------------------------
# The matrix
# ------------------------------------------------------------------------------------------------


def run_matrix(config: str | Path, backends: Iterable[str] = BACKENDS, *, steps: int | None = None, nproc: int = 1,
               out: str | Path = "outputs/bench", overrides: Iterable[str] = (), warmup_steps: int = 2,
               show_progress: bool = True) -> pd.DataFrame:
    """Runs every path with the same config and writes bench.csv, bench.md and bench.png into `out`.

    Args:
        config: the TOML file (as for `python -m workbench.train --job.config_file`).
        backends: the paths to run, in order.
        steps: optimizer steps per path (None = the config's training.steps).
        nproc: ranks per run (torchrun --nproc_per_node).
        out: the output folder (runs go to `<out>/runs/<backend>/`, replaced if present).
        overrides: more `--section.key value` overrides, applied to every path.
        warmup_steps: leading steps left out of the medians and percentiles.
        show_progress: draw progress bars (stderr).

    Returns:
        One row per path (columns: see `COLUMNS` and the module docstring).

    Raises:
        ConfigError: the config (with the overrides) is invalid for every path alike, e.g. an unknown key.
    """
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ConfigError(f"Unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}.")
    overrides = list(overrides) + (["--training.steps", str(steps)] if steps is not None else [])
    base = load_config(config, argv=overrides, world_size=nproc)  # fail fast on errors that are not about the backend
    out = Path(out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    rows = [run_backend(config, b, out=out, overrides=overrides, nproc=nproc, warmup_steps=warmup_steps,
                        show_progress=show_progress) for b in backends]
    model = trn2_model_row(base) if NKI_KERNEL_BACKENDS.intersection(backends) else None
    for row in rows:
        if row["backend"] in NKI_KERNEL_BACKENDS and model:
            row.update(model)
    df = pd.DataFrame(rows).reindex(columns=COLUMNS)
    native = df.loc[(df.backend == DEFAULT_BACKEND) & (df.status == "ok"), "tokens_per_s"]
    df["speed_vs_native"] = df["tokens_per_s"] / native.iloc[0] if len(native) else float("nan")
    meta = {"config": str(config), "flavor": base.model.flavor, "steps": base.training.steps, "nproc": nproc,
            "warmup_steps": warmup_steps, "seq_len": base.training.seq_len,
            "local_batch_size": base.training.local_batch_size, "overrides": " ".join(overrides) or "none"}
    write_report(df, out, meta)
    return df


def trn2_model_row(job) -> dict[str, float] | None:
    """The nki_moe row's modeled trn2 MoE-layer columns (`MODEL_COLUMNS`); None for a dense flavor."""
    from workbench.kernels.moe_cost import trn2_moe_layer

    model = trn2_moe_layer(job)
    if model is None:
        return None
    return {"trn2_moe_layer_model_ms": model["model_ms"], "trn2_moe_layer_serial_ms": model["model_ms_serial"],
            "trn2_moe_layer_roofline_ms": model["roofline_ms"]}


def write_report(df: pd.DataFrame, out: Path, meta: dict[str, Any]) -> None:
    """bench.csv (every column), bench.md (metrics table + settings + failures) and bench.png."""
    from workbench.run.profiling import markdown_table

    df.to_csv(out / "bench.csv", index=False)
    shown = df[["backend", "status", *METRIC_COLUMNS, "trn2_moe_layer_model_ms"]]
    lines = ["# Benchmark matrix", "", markdown_table(shown), "Settings: " + ", ".join(f"{k} {v}" for k, v in
             meta.items()) + f". Medians over steps > {meta['warmup_steps']}; see workbench/bench.py for columns.", ""]
    modeled = df.dropna(subset=["trn2_moe_layer_model_ms"])
    for r in modeled.itertuples():
        lines += [f"**Modeled, not measured:** one rank's MoE layer of this config on trn2 (nki_moe kernels, bf16, "
                  f"LNC 2; time model over the NKI emulator's counters, `workbench.kernels.moe_cost`): "
                  f"{r.trn2_moe_layer_model_ms:.4g} ms forward + backward (dependency model: each instruction waits "
                  f"for its engine and operands), {r.trn2_moe_layer_serial_ms:.4g} ms with no overlap; "
                  f"roofline {r.trn2_moe_layer_roofline_ms:.4g} ms. "
                  "The table's times above are measured on this machine.", ""]
    problems = df[df.status != "ok"]
    if len(problems):
        lines += ["Not run to completion:", ""]
        lines += [f"- **{r.backend}** ({r.status}): {r.error}" for r in problems.itertuples()]
    (out / "bench.md").write_text("\n".join(lines) + "\n")
    plot(df, out / "bench.png")


def plot(df: pd.DataFrame, path: Path) -> None:
    """Bar charts of the main columns and each path's loss curve; failed paths are marked on every chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    names = list(df.backend)
    panels = [("tokens_per_s", "tokens/s per device", 1), ("step_time_median_s", "step time (s), median & p90", 1),
              ("mfu", "MFU (%)", 100), ("peak_memory_gib", "peak memory (GiB)", 1),
              ("first_step_s", "first step (s): compile / warm-up", 1)]
    for ax, (col, title, scale) in zip(axes.flat, panels, strict=False):
        values = (df[col] * scale).fillna(0)
        ax.bar(names, values, color="tab:blue")
        if col == "step_time_median_s":
            ax.errorbar(names, values, yerr=[[0] * len(df), (df.step_time_p90_s - df[col]).fillna(0).clip(lower=0)],
                        fmt="none", ecolor="black", capsize=4)
        for i, status in enumerate(df.status):
            if status != "ok":
                ax.text(i, 0, status, ha="center", va="bottom", color="tab:red", rotation=90)
        ax.set_title(title)
        ax.set_ylim(bottom=0)  # from zero: a 1.2x difference must not look like 3x
    ax = axes.flat[-1]
    for i, r in enumerate(df[df.status == "ok"].itertuples()):
        records = read_metrics(r.run_dir)  # dashes and markers keep identical curves (native, nki_moe) visible
        ax.plot([m["step"] for m in records], [m["loss"] for m in records], label=r.backend,
                linestyle=["-", "--", ":"][i % 3], marker="ox+"[i % 3])
    ax.set_title("loss")
    ax.set_xlabel("step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.bench", allow_abbrev=False,
                                     description="Benchmark the training paths side by side (see module docstring).",
                                     epilog="Every other --section.key value is a config override for all paths.")
    parser.add_argument("--job.config_file", dest="config", required=True, help="the TOML config (configs/X.toml)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated paths (default: all three)")
    parser.add_argument("--steps", type=int, default=None, help="steps per path (default: the config's)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per run (default 1)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="leading steps left out of medians (default 2)")
    parser.add_argument("--out", default="outputs/bench", help="output folder (default outputs/bench)")
    args, overrides = parser.parse_known_args(argv)
    try:
        df = run_matrix(args.config, [b for b in args.backends.split(",") if b], steps=args.steps, nproc=args.nproc,
                        out=args.out, overrides=overrides, warmup_steps=args.warmup_steps)
    except (ConfigError, FileNotFoundError) as e:
        return announce(recognised(e))
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(df[["backend", "status", "tokens_per_s", "step_time_median_s", "mfu", "final_loss",
                  "speed_vs_native"]].to_string(index=False))
    print(f"wrote {Path(args.out) / 'bench.csv'}, bench.md, bench.png")
    return 0 if (df.status == "ok").any() else 1


if __name__ == "__main__":
    sys.exit(main())
