"""Per-rank memory plan of one training step, traced from the real model without the hardware.

    python -m workbench.plan --job.config_file configs/X.toml [--nproc N] [--nnodes M]
                             [--device trn2|h100|h200|cpu] [--json] [--section.key value ...]

What is traced is what `train.py` builds: the backend's real model (its torchtitan `ModelSpec`, built on the meta
device), wrapped by the backend's real `parallelize_fn` (FSDP2 / activation checkpointing / TP as configured), the
real loss (`training.loss_chunks` included) and the real optimizer, all from `trainer.build_titan_config`. The step
runs under `FakeTensorMode` (shapes and dtypes, no data) over torch's fake process group of the full world size,
inside PyTorch's `FSDPMemTracker`, which records every storage alive at each op and keeps the per-category
breakdown at the peak. One rank is traced: FSDP/TP ranks are symmetric.

Why the numbers can be trusted (and what was wrong before, trn2-readiness.md section 3): the optimizer state is
created by a warm-up step *before* tracking (AdamW creates it lazily in its first `step()`), so the traced step is a
steady-state step -- forward, backward and optimizer step with the moments already resident -- and nothing is
counted twice. Each category is validated against real runs by `benchmarks/plan_validation.py`.

Categories (bytes per rank at the step's peak): sharded parameters, gradients, optimizer state, all-gathered
parameters (FSDP's unsharded copies + all-gather buffers), activations (what the AC mode keeps for backward),
logits and loss (every tensor whose last dim is the local vocabulary: logits, their fp32 copies, softmax and
gradients), other temporaries (backward temporaries, reduce-scatter buffers, nki_moe's block buffers, inputs).

The target device only changes the dtypes (`training.dtype = auto`: bf16 compute on cuda/neuron, fp32 on CPU)
and the capacity; the trace itself runs on this host's CPU.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import enum
import hashlib
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

from workbench.config import ConfigError, JobConfig, load_config, validate

GiB = 1024**3

DEVICES: dict[str, tuple[str, float]] = {
    # name: (device kind it trains on, bytes per rank; None = host RAM / ranks)
    "trn2": ("neuron", 24 * GiB),  # trn2.48xlarge at LNC=2: 96 GiB per chip / 4 logical cores
    "h100": ("cuda", 80e9),
    "h200": ("cuda", 141e9),
    "cpu": ("cpu", 0.0),
}
"""--device choices: the device kind whose dtype rules apply, and the memory of one rank."""

CATEGORIES = ("sharded parameters", "gradients", "optimizer state", "all-gathered parameters", "activations",
              "logits and loss", "other temporaries")
HEADROOM = 0.10
"""Suggestions aim for a peak with at least this fraction of the capacity left free."""


def capacity(device: str, ranks_per_host: int) -> float:
    """Bytes of memory one rank has on `device` (CPU: the host's RAM shared by its ranks)."""
    if device not in DEVICES:
        raise ConfigError(f"Unknown --device {device!r}; choose one of {', '.join(DEVICES)}.")
    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(ranks_per_host, 1)
    return DEVICES[device][1]


# ------------------------------------------------------------------------------------------------
# The trace
# ------------------------------------------------------------------------------------------------


def _tracker_class(vocab_local: int):
    """FSDPMemTracker that files tensors with the vocabulary as last dim under 'logits and loss'."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    # A str enum with the tracker's own values plus ours: its snapshot dicts are keyed by value (str equality),
    # so the tracker's internal `_FSDPRefType.X` lookups and ours hit the same entries.
    ref = enum.Enum("PlanRefType", {**{m.name: m.value for m in _FSDPRefType}, "LOGITS": "Logits"}, type=str)

    class Tracker(FSDPMemTracker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._ref_class = ref

        def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
            # A chunked loss calls the FSDP-wrapped lm_head once per chunk; the tracker refuses a module's second
            # forward (its per-module stats assume one). Only the global peak is used here: restart that module's
            # stats instead.
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

            def pre_forward(*args, **kwargs):
                if not self._mod_tracker.is_bw:
                    self.memory_tracking.pop(fsdp_mod, None)
                return inner(*args, **kwargs)

            return pre_forward

        def _track(self, reftype, t):
            if reftype in (_FSDPRefType.ACT, _FSDPRefType.TEMP) and t.dim() >= 2 and t.shape[-1] == vocab_local:
                reftype = ref.LOGITS
            return super()._track(reftype, t)

    return Tracker


def _categories(snap: dict) -> dict[str, int]:
    """The tracker's reference types -> the plan's categories."""
    g = lambda *keys: int(sum(snap.get(k, 0) for k in keys))  # noqa: E731
    return {
        "sharded parameters": g("Sharded Param", "Buffer"),
        "gradients": g("Sharded Grad"),
        "optimizer state": g("OptState"),
        "all-gathered parameters": g("Unsharded Param", "All Gather"),
        "activations": g("Activation"),
        "logits and loss": g("Logits"),
        "other temporaries": g("Temp", "Unsharded Grad", "Reduce Scatter", "Inputs"),
    }


@dataclasses.dataclass
class Built:
    """What `build` returns: torchtitan's config and the objects a training step uses."""

    cfg: object
    model: object
    loss_fn: object
    optimizers: object
    vocab_local: int


def build(job: JobConfig, device_kind: str, world_size: int, parallel_dims) -> Built:
    """Builds the real model, parallelized, initialised, with its loss and optimizer, as torchtitan's Trainer does.

    Runs on whatever device/fake mode is active; `parallel_dims` must already have its mesh built (outside fake
    mode). Used by the planner (fake tensors) and by the validation/loss tests (real tensors).
    """
    import torch
    from torchtitan.components.loss import ChunkedLossWrapper

    from workbench.trainer import build_titan_config

    cfg = build_titan_config(job, device_kind, world_size)
    cfg.compile.enable = False  # eager memory (what compile can save is not promised by the plan)
    spec = cfg.model_spec
    spec.model.update_from_config(config=cfg)
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=cfg.training,
                                parallelism=cfg.parallelism, compile_config=cfg.compile,
                                ac_config=cfg.activation_checkpoint, dump_folder=cfg.dump_folder)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = cfg.loss.build(compile_config=cfg.compile)
    if isinstance(loss_fn, ChunkedLossWrapper):  # what torchtitan's Trainer does for a chunked loss
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    optimizers = cfg.optimizer.build(model_parts=[model])
    return Built(cfg, model, loss_fn, optimizers, job.shape.vocab_size // job.parallelism.tp)


def training_step(b: Built, tokens, labels) -> None:
    """One micro-batch forward + backward with torchtitan's loss contract (sum / global valid tokens)."""
    import torch

    pred = b.model(tokens)
    loss, _ = b.loss_fn(pred, labels, torch.tensor(float(labels.numel())))
    del pred
    loss.backward()


def warm_optimizer(b: Built, accumulation_steps: int = 1) -> None:
    """One optimizer step on zero gradients so AdamW's lazily created moments exist before the traced step.

    With gradient accumulation every micro-batch after the first runs with the sharded gradients resident (FSDP2
    accumulates into them), so they are left allocated: the traced micro-batch is then the worst one.
    """
    import torch

    for p in b.model.parameters():
        p.grad = torch.zeros_like(p)
    b.optimizers.step()
    b.optimizers.zero_grad(set_to_none=accumulation_steps == 1)


def parallel_dims_for(job: JobConfig, device_kind: str, world_size: int):
    """torchtitan's ParallelDims for the job, mesh built (needs an initialised process group)."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    from workbench.trainer import build_titan_config

    pd = ParallelDims.from_config(build_titan_config(job, device_kind, world_size).parallelism, world_size)
    pd.build_mesh()
    return pd


def trace(job: JobConfig, device: str, world_size: int) -> dict:
    """Per-rank peak memory of one steady-state training step of `job` on `world_size` ranks (fake tensors).

    Returns:
        {"peak_bytes", "categories": {name: bytes}, "trace_seconds", "checkpoint_bytes"}.
    """
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from workbench import device as wb_device

    device_kind = DEVICES[device][0]
    wb_device.prepare("cpu")  # the trace runs on this host's CPU whatever the target
    t0 = time.perf_counter()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        pd = parallel_dims_for(job, device_kind, world_size)
        with FakeTensorMode(allow_non_fake_inputs=True):
            b = build(job, device_kind, world_size, pd)
            warm_optimizer(b, job.training.gradient_accumulation_steps)
            ckpt = checkpoint_bytes(b)
            t = job.training
            tokens = torch.zeros(t.local_batch_size, t.seq_len, dtype=torch.long)
            tracker = _tracker_class(b.vocab_local)(b.model, b.optimizers.optimizers[0]
                                                    if hasattr(b.optimizers, "optimizers") else b.optimizers)
            tracker.track_inputs((tokens,))
            with tracker:
                training_step(b, tokens, tokens.clone())
                b.optimizers.step()
                b.optimizers.zero_grad(set_to_none=True)
            snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    finally:
        dist.destroy_process_group()
    cats = _categories(snap)
    return {"peak_bytes": sum(cats.values()), "categories": cats, "trace_seconds": time.perf_counter() - t0,
            "checkpoint_bytes": ckpt}


def trace_in_subprocess(job: JobConfig, device: str, world_size: int) -> dict:
    """`trace` in a fresh interpreter: torch's meshes and fake process groups are process-global, and a trace
    after another one of a different layout (TP after FSDP-only, another world size) can trip over them."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(job.to_toml())
    try:
        proc = subprocess.run([sys.executable, "-m", "workbench.plan", "--job.config_file", f.name, "--nproc",
                               str(world_size), "--device", device, "--json", "--no-suggest"],
                              capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"memory plan failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def checkpoint_bytes(b: Built) -> int:
    """Bytes of one DCP checkpoint (model + optimizer state, global shapes, stored dtypes)."""
    from torch.distributed.tensor import DTensor

    def nbytes(t) -> int:
        return t.numel() * t.element_size()  # a DTensor's numel is its global size

    total = sum(nbytes(t) for t in b.model.state_dict().values() if hasattr(t, "numel"))
    for opt in getattr(b.optimizers, "optimizers", [b.optimizers]):
        for state in opt.state.values():
            total += sum(nbytes(t) for t in state.values() if isinstance(t, DTensor) or hasattr(t, "numel"))
    return int(total)


# ------------------------------------------------------------------------------------------------
# Plan, verdict, suggestions
# ------------------------------------------------------------------------------------------------


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
    if job.model.backend != "huggingface_v5":
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


def plan(job: JobConfig, device: str = "trn2", nproc: int = 1, nnodes: int = 1, suggest: bool = True,
         max_replans: int = 3) -> dict:
    """The memory plan of `job` on `nproc` x `nnodes` ranks of `device` (see module doc); JSON-serialisable."""
    world_size = nproc * nnodes
    cap = capacity(device, nproc)
    validate(job, world_size)
    traced = trace(job, device, world_size)
    print(f"workbench.plan: traced in {traced['trace_seconds']:.0f} s", file=sys.stderr, flush=True)
    peak = traced["peak_bytes"]
    result = {
        "config": job.job.config_file, "backend": job.model.backend, "flavor": job.model.flavor,
        "device": device, "world_size": world_size, "fits": peak <= cap, "peak_bytes": peak,
        "capacity_bytes": int(cap), "headroom": 1 - peak / cap, "categories": traced["categories"],
        "suggestions": [], "checkpoint_bytes": traced["checkpoint_bytes"], "trace_seconds": traced["trace_seconds"],
    }
    result.update(_disk(job, traced["checkpoint_bytes"]))
    if suggest and peak > (1 - HEADROOM) * cap:
        for flag, change, world in candidates(job, world_size, traced["categories"], cap):
            if len(result["suggestions"]) >= max_replans:
                break
            p = trace_in_subprocess(_with(job, world, **change), device, world)["peak_bytes"]
            print(f"workbench.plan: re-planned {flag}: {p / GiB:.2f} GiB", file=sys.stderr, flush=True)
            result["suggestions"].append({"change": flag, "world_size": world, "peak_bytes": p, "fits": p <= cap,
                                          "headroom": 1 - p / cap})
            if p <= (1 - HEADROOM) * cap:
                break
    result["planner_peak_rss_bytes"] = _rss()
    result["planner_cpu_seconds"] = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    return result


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _disk(job: JobConfig, ckpt: int) -> dict:
    """Free space in the dump folder against the checkpoints the run keeps."""
    if not job.checkpoint.enable:
        return {"checkpoints_kept": 0, "checkpoint_disk_bytes": 0, "disk_free_bytes": None, "disk_fits": True}
    keep = job.checkpoint.keep_latest_k or max(job.training.steps // job.checkpoint.interval, 1)
    folder = Path(job.job.dump_folder).resolve()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    # A new checkpoint is written before the oldest is purged: keep + 1 exist at once.
    need = ckpt * (keep + 1)
    return {"checkpoints_kept": keep, "checkpoint_disk_bytes": need, "disk_free_bytes": free, "disk_fits": need <= free}


def render(p: dict) -> str:
    """The plan as a table with the verdict, suggestions and checkpoint line."""
    gib = lambda b: f"{b / GiB:8.2f} GiB"  # noqa: E731
    lines = [f"memory plan: {p['flavor']} {p['backend']} on {p['world_size']} rank(s) of {p['device']} "
             f"({p['config'] or 'defaults'})", f"  {'category':<26}{'per rank':>12}"]
    lines += [f"  {name:<26}{gib(b)}" for name, b in p["categories"].items()]
    lines.append(f"  {'peak':<26}{gib(p['peak_bytes'])}   of {gib(p['capacity_bytes']).strip()} per rank")
    verdict = "FITS" if p["fits"] else "DOES NOT FIT"
    lines.append(f"  verdict: {verdict}, headroom {100 * p['headroom']:.1f}%")
    for s in p["suggestions"]:
        mark = "fits" if s["fits"] else "still over"
        lines.append(f"  re-planned {s['change']}: peak {s['peak_bytes'] / GiB:.2f} GiB ({mark}, "
                     f"headroom {100 * s['headroom']:.1f}%)")
    if p["checkpoints_kept"]:
        free = p["disk_free_bytes"]
        lines.append(f"  checkpoint {p['checkpoint_bytes'] / 1e9:.1f} GB on disk; {p['checkpoints_kept']}+1 kept need "
                     f"{p['checkpoint_disk_bytes'] / 1e9:.1f} GB, {free / 1e9:.1f} GB free in dump_folder"
                     + ("" if p["disk_fits"] else
                        "  -> NOT ENOUGH: lower checkpoint.keep_latest_k or move dump_folder"))
    else:
        lines.append(f"  checkpoint {p['checkpoint_bytes'] / 1e9:.1f} GB on disk (checkpointing off)")
    lines.append(f"  traced in {p['trace_seconds']:.1f} s (planner CPU {p['planner_cpu_seconds']:.0f} s), "
                 f"planner peak RSS {p['planner_peak_rss_bytes'] / GiB:.2f} GiB")
    return "\n".join(lines)


SHORT = {"sharded parameters": "params", "gradients": "grads", "optimizer state": "optimizer",
         "all-gathered parameters": "all-gathered", "activations": "activations", "logits and loss": "logits+loss",
         "other temporaries": "other"}


def quote(p: dict, backend: str) -> str:
    """The one-line form a shipped config's comment quotes (read back by `quoted_plans`)."""
    cats = ", ".join(f"{SHORT[k]} {v / GiB:.2f}" for k, v in p["categories"].items())
    return (f"# PLAN {backend}: peak {p['peak_bytes'] / GiB:.2f} GiB of {p['capacity_bytes'] / GiB:.0f} GiB "
            f"(headroom {100 * p['headroom']:.0f}%): {cats} GiB")


def quoted_plans(config: str | os.PathLike) -> dict[str, dict]:
    """{backend: {"peak_bytes", "categories"}} from the `# PLAN ...` lines of a config's comment."""
    import re

    out = {}
    for m in re.finditer(r"# PLAN (\w+): peak ([\d.]+) GiB[^:]*: (.*) GiB", Path(config).read_text()):
        short = {v: k for k, v in SHORT.items()}
        cats = {short[name]: int(float(v) * GiB) for name, v in (c.rsplit(" ", 1) for c in m.group(3).split(", "))}
        out[m.group(1)] = {"peak_bytes": int(float(m.group(2)) * GiB), "categories": cats}
    return out


def bar_chart(plans: dict[str, dict], capacity_bytes: float | None = None):
    """Stacked bars of the categories per plan (label -> plan), with the per-rank capacity as a line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 * len(plans) + 3, 4))
    labels = list(plans)
    bottom = [0.0] * len(labels)
    for cat in CATEGORIES:
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


# ------------------------------------------------------------------------------------------------
# Preflight (train.py) and CLI
# ------------------------------------------------------------------------------------------------

DEVICE_OF_KIND = {"neuron": "trn2", "cuda": "h100", "cpu": "cpu"}


def preflight(job: JobConfig, world_size: int, device_kind: str, cache_dir: Path | None = None) -> dict | None:
    """Plans `job` before launch on cuda/neuron (cached by a hash of the resolved config and world size).

    The plan runs in a subprocess (it needs a fake process group and pins torchtitan to the CPU). On cuda the
    capacity is taken as an H100's; on neuron a trn2 rank's. On CPU only a model whose parameters alone take over
    1/8 of the host RAM per rank is planned (the tiny CPU runs are not slowed by a plan), and a plan over the
    host's RAM only warns.

    Raises:
        ConfigError: the plan does not fit, with the table and the suggested changes (exit code 2).
    """
    from workbench import flavors

    if not job.job.memory_check:
        return None
    device = DEVICE_OF_KIND.get(device_kind, "cpu")
    if device == "cpu":
        if 4 * flavors.count_params(job.shape)["total"] < capacity("cpu", world_size) / 8:
            return None
    key = hashlib.sha256(f"{job.to_toml()}|{world_size}|{device}".encode()).hexdigest()[:16]
    cache = (cache_dir or Path.home() / ".cache" / "workbench" / "plans") / f"{key}.json"
    if cache.is_file():
        p = json.loads(cache.read_text())
    else:
        import subprocess
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(job.to_toml())
        cmd = [sys.executable, "-m", "workbench.plan", "--job.config_file", f.name, "--nproc", str(world_size),
               "--device", device, "--json"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        os.unlink(f.name)
        if proc.returncode not in (0, 1):
            print(f"workbench: memory plan failed, launching anyway:\n{proc.stderr[-2000:]}", file=sys.stderr)
            return None
        p = json.loads(proc.stdout)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(p))
    if not p["fits"]:
        if device == "cpu":
            print("workbench: warning, the memory plan exceeds this host's RAM:\n" + render(p), file=sys.stderr)
        else:
            raise ConfigError("the memory plan does not fit (skip with --job.memory_check false):\n" + render(p))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m workbench.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=1, help="ranks per node (torchrun --nproc_per_node)")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--device", default="trn2", help=f"one of {', '.join(DEVICES)}")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--no-suggest", action="store_true", help="do not re-plan when it does not fit")
    args, rest = ap.parse_known_args(argv)
    try:
        if args.device not in DEVICES:
            raise ConfigError(f"Unknown --device {args.device!r}; choose one of {', '.join(DEVICES)}.")
        if args.nproc <= 0 or args.nnodes <= 0:
            raise ConfigError("--nproc and --nnodes must be positive.")
        job = load_config(argv=rest, world_size=args.nproc * args.nnodes)
        p = plan(job, args.device, args.nproc, args.nnodes, suggest=not args.no_suggest)
    except ConfigError as e:
        print(f"workbench: config error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p, indent=1) if args.json else render(p), flush=True)
    return 0 if p["fits"] else 1


if __name__ == "__main__":
    sys.stdout.flush()
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip torch.distributed's teardown (see workbench.train.main)
