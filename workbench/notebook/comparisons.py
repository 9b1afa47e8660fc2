"""Tables and plots of checkpoint comparisons (notebook 05: `workbench.compare`, `workbench.parity`) and of the
benchmark matrix of the three paths (06: `workbench.bench`), as the notebooks show them (`display.Table`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pandas as pd

from workbench.core.config import JobConfig
from workbench.notebook.display import MISSING, Table, checks, number, percent
from workbench.notebook.params import repo_root
from workbench.run.metrics import read_metrics


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


__all__ = [
    "comparison_summary", "largest_differences", "parity_facts", "token_agreement", "bench_table", "BENCH_HEADERS",
    "significant", "plot_bench", "loss_agreement", "shared_init", "measured_on_h200", "trn2_model_table",
]
