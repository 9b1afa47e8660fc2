"""Tables and charts of memory plans (notebook 07: `workbench.memory.report.plan`), as the notebooks show them."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from workbench.notebook.display import Table

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


__all__ = ["plan_table", "plan_advice", "trn2_plans", "trn2_plans_table", "plan_chart"]
