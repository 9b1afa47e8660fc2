"""The memory plan's report: the verdict, what to change and its re-planned saving, and its rendering (`plan`,
`render`; `quoted_plans` / `bar_chart` for the notebooks).
"""

from __future__ import annotations

import copy
import os
import resource
from pathlib import Path

from workbench.core.config import FSDP_ONLY_BACKENDS, JobConfig, validate
from workbench.core.errors import ConfigError
from workbench.memory import tables, tracer
from workbench.memory.tables import GiB, MiB
from workbench.run.run_folder import checkpoint_space


def _with(job: JobConfig, world_size: int, **changes) -> JobConfig:
    """A copy of `job` with 'section__key' changes applied and validated like training does."""
    new = copy.deepcopy(job)
    for key, value in changes.items():
        section, field = key.split("__")
        setattr(getattr(new, section), field, value)
    validate(new, world_size)
    return new


def candidates(job: JobConfig, world_size: int, categories: dict[str, int], cap: float
               ) -> list[tuple[str, dict, int]]:
    """Changes that lower the per-rank peak, cheapest first: (flag, changes, world size). Each is re-planned by
    `plan`, not assumed to help."""
    t, par = job.training, job.parallelism
    out: list[tuple[str, dict, int]] = []
    state = sum(categories[k] for k in ("sharded parameters", "gradients", "optimizer state"))
    if state > 0.5 * cap:
        # The sharded training state alone leaves no room: only more shards help. Grow the world (and the FSDP
        # degree with it) by powers of two until the traced state is under half a rank, then re-plan that.
        factor = 2
        while state / factor > 0.5 * cap:
            factor *= 2
        world = world_size * factor
        shard = (par.dp_shard if par.dp_shard > 0 else world_size // (par.tp * par.dp_replicate)) * factor
        out.append((f"{world} ranks (torchrun --nproc_per_node x --nnodes = {world}) with --parallelism.dp_shard "
                    f"{shard}", {"parallelism__dp_shard": shard}, world))
        job = _with(job, world, parallelism__dp_shard=shard)
        world_size = world
    chunks = 0 if t.loss_chunks else next((c for c in (8, 4, 2) if t.seq_len % (c * par.tp) == 0), 0)
    base = dict(out[0][1]) if out else {}
    prefix = f"{out[0][0]} + " if out else ""
    cheap: list[tuple[str, dict]] = []
    if chunks:
        cheap.append((f"--training.loss_chunks {chunks}", {"training__loss_chunks": chunks}))
    if t.local_batch_size > 1:
        acc = t.gradient_accumulation_steps * t.local_batch_size
        batch1 = {"training__local_batch_size": 1, "training__gradient_accumulation_steps": acc,
                  "training__global_batch_size": -1}
        flag = f"--training.local_batch_size 1 --training.gradient_accumulation_steps {acc}"
        if chunks:
            cheap.append((f"{flag} --training.loss_chunks {chunks}", {**batch1, "training__loss_chunks": chunks}))
        cheap.append((flag, batch1))
    if t.activation_checkpoint != "full":
        cheap.append(("--training.activation_checkpoint full", {"training__activation_checkpoint": "full"}))
    if job.model.backend not in FSDP_ONLY_BACKENDS:
        for tp in (2, 4, 8):
            if tp > par.tp and t.seq_len % tp == 0:
                cheap.append((f"--parallelism.tp {tp} --parallelism.dp_shard -1",
                              {"parallelism__tp": tp, "parallelism__dp_shard": -1}))
                break
    for flag, change in cheap:
        try:
            _with(job, world_size, **change)
        except ConfigError:
            continue
        out.append((prefix + flag, {**base, **change}, world_size))
    return out


def levers(job: JobConfig, world_size: int) -> dict[str, tuple[str, dict, int]]:
    """The setting that shrinks each category (or part of "other temporaries") of `job`'s plan, where the config
    has one left: {category: (flag, changes, world size)}; every change is validated like training does."""
    t, par = job.training, job.parallelism
    found: dict[str, tuple[str, dict, int]] = {}

    def offer(categories, flag, change, world=world_size):
        try:
            _with(job, world, **change)
        except ConfigError:
            return
        for cat in categories:
            found.setdefault(cat, (flag, change, world))

    chunks = 0 if t.loss_chunks else next((c for c in (8, 4, 2) if t.seq_len % (c * par.tp) == 0), 0)
    if chunks:  # one chunk's fp32 logits alive at a time instead of the whole sequence's
        offer(["logits and loss"], f"--training.loss_chunks {chunks}", {"training__loss_chunks": chunks})
    if t.activation_checkpoint != "full":  # keep each block's input only, recompute the rest in backward
        offer(["activations"], "--training.activation_checkpoint full", {"training__activation_checkpoint": "full"})
    if t.local_batch_size > 1:  # per-micro-batch tensors halve or better; the same global batch by accumulation
        acc = t.gradient_accumulation_steps * t.local_batch_size
        offer(["attention scores", "backward temporaries", "nki kernel buffers", "activations", "logits and loss"],
              f"--training.local_batch_size 1 --training.gradient_accumulation_steps {acc}",
              {"training__local_batch_size": 1, "training__gradient_accumulation_steps": acc,
               "training__global_batch_size": -1})
    elif t.seq_len >= 256:  # batch 1 already: shorter sequences (the S x S scores shrink by 4)
        offer(["attention scores", "backward temporaries", "nki kernel buffers"],
              f"--training.seq_len {t.seq_len // 2} (shorter context: a different experiment)",
              {"training__seq_len": t.seq_len // 2})
    shard = par.dp_shard if par.dp_shard > 0 else world_size // (par.tp * par.dp_replicate)
    offer(["sharded parameters", "gradients", "optimizer state"],  # the sharded state splits over twice the ranks
          f"{2 * world_size} ranks with --parallelism.dp_shard {2 * shard} (FSDP degree x2)",
          {"parallelism__dp_shard": 2 * shard}, 2 * world_size)
    if job.model.backend not in FSDP_ONLY_BACKENDS:  # full-size per-layer tensors split by tensor parallelism
        tp = next((tp for tp in (2, 4, 8) if tp > par.tp and t.seq_len % tp == 0), 0)
        if tp:
            offer(["all-gathered parameters", "unsharded gradients", "reduce-scatter buffers", "activations"],
                  f"--parallelism.tp {tp} --parallelism.dp_shard -1", {"parallelism__tp": tp,
                                                                       "parallelism__dp_shard": -1})
    return found


def advice(p: dict, job: JobConfig, world_size: int) -> list[dict]:
    """What to change, largest first: every category (with "other temporaries" as its parts) of at least `LARGE`
    of the peak, its top tensors at the peak and its lever (`levers`), not yet re-planned."""
    items = {k: v for k, v in p["categories"].items() if k not in ("other temporaries", "device runtime")}
    items.update(p.get("other_parts", {}))
    found = levers(job, world_size)
    out = []
    for cat, nbytes in sorted(items.items(), key=lambda kv: -kv[1]):
        if nbytes < tables.LARGE * p["peak_bytes"] or nbytes == 0:
            continue
        flag, change, world = found.get(cat, (None, None, world_size))
        out.append({"category": cat, "bytes": nbytes, "top": p.get("top_tensors", {}).get(cat, []), "change": flag,
                    "changes": change, "world_size": world, "peak_bytes_after": None})
    return out


def _replan(job: JobConfig, change: dict, device: str, world: int, reserve_gib: float | None) -> int:
    """The peak of `job` with `change` on `world` ranks, planned in a fresh interpreter (`plan_in_subprocess`: a
    second trace in this process meets the first one's device meshes)."""
    return tracer.plan_in_subprocess(_with(job, world, **change), device, world, reserve_gib=reserve_gib)["peak_bytes"]


def plan(job: JobConfig, device: str = "trn2", nproc: int = 1, nnodes: int = 1, suggest: bool = True,
         max_replans: int = 3, reserve_gib: float | None = None, advise: int = 1, progress=tracer.to_stderr) -> dict:
    """The memory plan of `job` on `nproc` x `nnodes` ranks of `device` (see module doc); JSON-serialisable.

    The peak is the traced step's plus the device runtime's share (`runtime_reserve`; `reserve_gib` replaces it).
    With `suggest`, the levers of the `advise` largest categories are re-planned (their saving, `advice`), and a
    plan over `1 - HEADROOM` of the capacity re-plans up to `max_replans` changes until one fits (`suggestions`).
    `progress` is called with a line as each phase starts.
    """
    world_size = nproc * nnodes
    cap = tables.capacity(device, nproc)
    runtime = tables.runtime_reserve(device, reserve_gib)
    validate(job, world_size)
    traced = tracer.trace(job, device, world_size, progress)
    progress(f"traced in {traced['trace_seconds']:.0f} s")
    categories = {**traced["categories"], "device runtime": sum(r["bytes"] for r in runtime)}
    peak = sum(categories.values())
    result = {
        "config": job.job.config_file, "backend": job.model.backend, "flavor": job.model.flavor,
        "device": device, "world_size": world_size, "fits": peak <= cap, "peak_bytes": peak,
        "capacity_bytes": int(cap), "headroom": 1 - peak / cap, "categories": categories,
        "device_runtime": runtime, "sdpa": traced["sdpa"], "nki_kernels": traced["nki_kernels"],
        "other_parts": traced["other_parts"], "top_tensors": traced["top_tensors"],
        "suggestions": [], "checkpoint_bytes": traced["checkpoint_bytes"], "trace_seconds": traced["trace_seconds"],
    }
    result.update(_disk(job, traced["checkpoint_bytes"]))
    result["advice"] = advice(result, job, world_size)
    replanned: dict[str, int] = {}
    for a in result["advice"]:
        if not suggest or len(replanned) >= advise:
            break
        if a["change"] and a["change"] not in replanned:
            progress(f"re-planning {a['change']} (the lever of {a['category']})")
            replanned[a["change"]] = _replan(job, a["changes"], device, a["world_size"], reserve_gib)
    if suggest and peak > (1 - tables.HEADROOM) * cap:
        for flag, change, world in candidates(job, world_size, categories, cap):
            if len(result["suggestions"]) >= max_replans:
                break
            progress(f"re-planning {flag}")
            p = replanned.get(flag) or _replan(job, change, device, world, reserve_gib)
            replanned[flag] = p
            progress(f"re-planned {flag}: {p / GiB:.2f} GiB")
            result["suggestions"].append({"change": flag, "world_size": world, "peak_bytes": p, "fits": p <= cap,
                                          "headroom": 1 - p / cap})
            if p <= (1 - tables.HEADROOM) * cap:
                break
    for a in result["advice"]:
        a["peak_bytes_after"] = replanned.get(a["change"])
        del a["changes"]
    result["planner_peak_rss_bytes"] = _rss()
    result["planner_cpu_seconds"] = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    return result


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _disk(job: JobConfig, ckpt: int) -> dict:
    """Free space in the dump folder against the checkpoints the run keeps."""
    if not job.checkpoint.enable:
        return {"checkpoint_copies": 0, "checkpoint_disk_bytes": 0, "disk_free_bytes": None, "disk_fits": True}
    c = job.checkpoint
    space = checkpoint_space(job.run_dir / c.folder, ckpt, c.keep_latest_k, job.training.steps, c.interval)
    return {"checkpoint_copies": space.copies, "checkpoint_disk_bytes": space.need_bytes,
            "disk_free_bytes": space.free_bytes, "disk_fits": space.fits}


ATTENTION_KERNELS = {  # the SDPA operators a trace records, in words
    "aten._scaled_dot_product_flash_attention_for_cpu": "fused flash attention (CPU kernel: no S x S scores)",
    "aten._scaled_dot_product_flash_attention": "fused flash attention (no S x S scores)",
    "aten._scaled_dot_product_efficient_attention": "fused memory-efficient attention (no S x S scores)",
    "aten._scaled_dot_product_cudnn_attention": "fused cuDNN attention (no S x S scores)",
    "torch_attn._varlen_attn": "varlen flash attention over cu_seqlens (no S x S scores)",
}


def breakdown(p: dict) -> list[tuple[str, int, bool]]:
    """The plan's categories in order, "other temporaries" followed by its parts: (name, bytes, is a part)."""
    rows = []
    for name, nbytes in p["categories"].items():
        rows.append((name, nbytes, False))
        if name == "other temporaries":
            rows += [(part, b, True) for part, b in p.get("other_parts", {}).items()]
    return rows


def amount(nbytes: float, unit: str) -> str:
    """Bytes in `unit` ("GiB" / "MiB") with 3 significant digits, "0" for nothing, "< 0.01" for a trace."""
    value = nbytes / (GiB if unit == "GiB" else MiB)
    if nbytes == 0:
        return "0"
    if value < 0.01:
        return "< 0.01"
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def tensor_group(t: dict) -> str:
    """One group of top tensors in words: "12 x aten.mm [2, 64, 3072] float32 in layers.*.feed_forward"."""
    if t["op"] == tables.STATE:
        return f"{t['count']} tensors held across steps (not made by an op of the step)"
    shape = "[" + ", ".join(str(d) for d in t["shape"]) + "]"
    return f"{f'{t["count"]} x ' if t['count'] > 1 else ''}{t['op']} {shape} {t['dtype']} in {t['module']}"


def render(p: dict) -> str:
    """The plan as a table (other temporaries split into its parts, with shares of the peak) with the verdict, what
    to change (top tensors and lever of each large category, re-planned savings), what the device adds,
    suggestions and the checkpoint line."""
    unit = "GiB" if p["peak_bytes"] >= GiB else "MiB"
    lines = [f"memory plan: {p['flavor']} {p['backend']} on {p['world_size']} rank(s) of {p['device']} "
             f"({p['config'] or 'defaults'})", f"  {'category':<28}{f'per rank ({unit})':>18}{'of peak':>9}"]
    for name, nbytes, part in breakdown(p):
        label = f"  - {name}" if part else name
        lines.append(f"  {label:<28}{amount(nbytes, unit):>18}{100 * nbytes / p['peak_bytes']:>8.0f}%")
    lines.append(f"  {'peak':<28}{amount(p['peak_bytes'], unit):>18}   of {p['capacity_bytes'] / GiB:.2f} GiB per rank")
    verdict = "FITS" if p["fits"] else "DOES NOT FIT"
    lines.append(f"  verdict: {verdict}, headroom {100 * p['headroom']:.1f}%")
    if p.get("advice"):
        lines.append("  what to change (categories over 10% of the peak, largest first):")
    for a in p.get("advice", []):
        lines.append(f"    {a['category']} {amount(a['bytes'], unit)} {unit}: "
                     + "; ".join(f"{tensor_group(t)} ({amount(t['bytes'], unit)} {unit})" for t in a["top"]))
        if a["change"] is None:
            lines.append("      no setting left that shrinks it in this config")
        elif a["peak_bytes_after"] is not None:
            saved = p["peak_bytes"] - a["peak_bytes_after"]
            lines.append(f"      {a['change']}: peak {amount(a['peak_bytes_after'], unit)} {unit} "
                         f"(saves {amount(saved, unit)} {unit}, re-planned)")
        else:
            lines.append(f"      {a['change']} (not re-planned here: python -m workbench.plan ... {a['change']})")
    kernel = ATTENTION_KERNELS.get(p["sdpa"]["kernel"], p["sdpa"]["kernel"])
    note = p["sdpa"]["note"] if p["device"] == "trn2" or "fused kernel" not in p["sdpa"]["note"] else \
        "the device has a fused kernel too"
    lines.append(f"  attention: {kernel}; {note}")
    for name, k in p["nki_kernels"].items():
        lines.append(f"  NKI kernel {name}: {k['calls']} call(s) in the step, {k['hbm_bytes_per_call'] / GiB:.2f} GiB "
                     "of HBM tensors per call (kernels.buffers)")
    if p["device_runtime"]:
        items = ", ".join(f"{r['what']} {r['bytes'] / GiB:.2f}" for r in p["device_runtime"])
        lines.append(f"  device runtime: {items} GiB (sources: --json device_runtime; override: --reserve-gib)")
    for s in p["suggestions"]:
        mark = "fits" if s["fits"] else "still over"
        lines.append(f"  re-planned {s['change']}: peak {s['peak_bytes'] / GiB:.2f} GiB ({mark}, "
                     f"headroom {100 * s['headroom']:.1f}%)")
    if p["checkpoint_copies"]:
        free = p["disk_free_bytes"]
        lines.append(f"  checkpoint {p['checkpoint_bytes'] / 1e9:.1f} GB on disk; {p['checkpoint_copies']} at once "
                     f"need {p['checkpoint_disk_bytes'] / 1e9:.1f} GB more, {free / 1e9:.1f} GB free in dump_folder"
                     + ("" if p["disk_fits"] else
                        "  -> NOT ENOUGH: lower checkpoint.keep_latest_k or move dump_folder"))
    else:
        lines.append(f"  checkpoint {p['checkpoint_bytes'] / 1e9:.1f} GB on disk (checkpointing off)")
    lines.append(f"  traced in {p['trace_seconds']:.1f} s (planner CPU {p['planner_cpu_seconds']:.0f} s), "
                 f"planner peak RSS {p['planner_peak_rss_bytes'] / GiB:.2f} GiB")
    return "\n".join(lines)


SHORT = {"sharded parameters": "params", "gradients": "grads", "optimizer state": "optimizer",
         "all-gathered parameters": "all-gathered", "activations": "activations", "attention scores": "attention",
         "attention mask": "mask", "logits and loss": "logits+loss", "nki kernel buffers": "nki kernels",
         "other temporaries": "other", "device runtime": "runtime"}


def quote(p: dict, backend: str) -> str:
    """The one-line form a shipped config's comment quotes (read back by `quoted_plans`)."""
    cats = ", ".join(f"{SHORT[k]} {v / GiB:.2f}" for k, v in p["categories"].items())
    return (f"# PLAN {backend}: peak {p['peak_bytes'] / GiB:.2f} GiB of {p['capacity_bytes'] / GiB:.0f} GiB "
            f"(headroom {100 * p['headroom']:.0f}%): {cats} GiB")


def quoted_plans(config: str | os.PathLike) -> dict[str, dict]:
    """{backend: {"peak_bytes", "categories"}} from the `# PLAN ...` lines of a config's comment."""
    import re

    short = {v: k for k, v in SHORT.items()}
    out = {}
    for m in re.finditer(r"# PLAN (\w+): peak ([\d.]+) GiB[^:]*: (.*) GiB", Path(config).read_text()):
        cats = {short[name]: int(float(v) * GiB) for name, v in (c.rsplit(" ", 1) for c in m.group(3).split(", "))}
        out[m.group(1)] = {"peak_bytes": int(float(m.group(2)) * GiB), "categories": cats}
    return out


def bar_chart(plans: dict[str, dict], capacity_bytes: float | None = None):
    """Stacked bars of the categories per plan (label -> plan), with the per-rank capacity as a line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 * len(plans) + 3, 4))
    labels = list(plans)
    bottom = [0.0] * len(labels)
    for cat in tables.CATEGORIES:
        vals = [plans[k]["categories"].get(cat, 0) / GiB for k in labels]
        ax.bar(labels, vals, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    if capacity_bytes:
        ax.axhline(capacity_bytes / GiB, color="red", linestyle="--", label="memory per rank")
    ax.set_ylabel("GiB per rank")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    fig.tight_layout()
    return fig
