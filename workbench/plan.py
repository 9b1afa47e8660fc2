"""Per-rank memory plan of one training step, traced from the real model without the hardware.

    python -m workbench.plan --job.config_file configs/X.toml [--nproc N] [--nnodes M]
                             [--device trn2|h100|h200|cpu] [--reserve-gib G] [--json] [--section.key value ...]

What is traced is what `train.py` builds: the backend's real model (its torchtitan `ModelSpec`, built on the meta
device), wrapped by the backend's real `parallelize_fn` (FSDP2 / activation checkpointing / TP as configured), the
real loss (`training.loss_chunks` included) and the real optimizer, all from `trainer.build_titan_config`. The step
runs under `FakeTensorMode` (shapes and dtypes, no data) over torch's fake process group of the full world size,
inside PyTorch's `FSDPMemTracker`, which records every storage alive at each op and keeps the per-category
breakdown at the peak. One rank is traced: FSDP/TP ranks are symmetric.

Why the numbers can be trusted: the optimizer state is created by a warm-up step *before* tracking (AdamW creates
it lazily in its first `step()`), so the traced step is a steady-state step -- forward, backward and optimizer step
with the moments already resident -- and nothing is counted twice. Each category is validated against real runs
by `benchmarks/plan_validation.py`.

Categories (bytes per rank at the step's peak): sharded parameters, gradients, optimizer state, all-gathered
parameters (FSDP's unsharded copies + all-gather buffers), activations (what the AC mode keeps for backward),
attention scores (tensors ending in [seq, seq]: only SDPA's math path makes them), logits and loss (every tensor
whose last dim is the local vocabulary: logits, their fp32 copies, softmax and gradients), nki kernel buffers
(on trn2, everything the nki_moe experts allocate per call: the kernels' own HBM tensors and the autograd glue's
copies), other temporaries, and device runtime (HBM the device's runtime holds outside the tensors: `TRN2_RUNTIME`,
`CUDA_RUNTIME`). "other temporaries" is shown split into its parts (`OTHER_PARTS`): backward temporaries (what the
backward pass allocates besides the above: activation gradients, recomputed inputs of its matmuls), unsharded
gradients (FSDP's full-size gradients before they are reduce-scattered), reduce-scatter buffers and the inputs.

What to change: for every category over `LARGE` of the peak the plan lists the tensors that make it at the peak
(grouped by operator, shape and module, from the tracker's live storages when the peak was reached) and the
setting that shrinks it (`LEVERS`); the saving of the first `advise` of those settings is computed by re-planning
the changed config, never estimated.

The target device changes more than the dtypes (`training.dtype = auto`: bf16 compute on cuda/neuron, fp32 on
CPU) and the capacity; the trace itself runs on this host's CPU, so what would run differently there is put in:
* trn2 (neuron): the nki_moe experts run the NKI kernels (`kernels.autograd.BlockwiseMoEFunction` with kernels
  that allocate exactly the HBM tensors `kernels.buffers.hbm_allocations` lists; tests/test_plan.py checks that
  list against the real kernels in the emulator) instead of the torch reference that runs on CPU/CUDA;
* attention: where no fused SDPA kernel is known to exist on the device (`FUSED_SDPA`; neuron), SDPA is traced on
  its math path, whose S x S scores then show in "attention scores". The plan records the SDPA kernel it traced.
* the device runtime's reserve (`Device.runtime`, each figure with its source; `--reserve-gib` overrides).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import enum
import functools
import hashlib
import json
import os
import resource
import sys
import time
from pathlib import Path

from workbench.core.config import JobConfig, load_config, validate
from workbench.core.errors import ConfigError, announce
from workbench.platform.neuron_env import compiled_for_lnc
from workbench.run.run_folder import checkpoint_space

GiB = 1024**3
MiB = 1024**2
DEVICE_MEMORY_DOC = ("https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/neuron-runtime/explore/"
                     "device-memory.html")
NO_DOCUMENTED_SIZE = "no size on the page (Neuron device memory deep dive, v2.33.0)"

TRN2_RUNTIME = (  # (what, bytes per rank, source): HBM the Neuron runtime holds outside the traced tensors
    ("microcode", 2 * 96 * MiB, f"{DEVICE_MEMORY_DOC}, Overview, model code: 'a micro-code overhead of 96MB per "
     "physical Neuron Core'; an LNC=2 rank is 2 physical cores"),
    ("NEFF code and constants", 740 * MiB, "assumption: the same page's OOM example shows 932 MB of model code "
     "on one HBM (24 GiB: one LNC=2 rank's), the 2 x 96 MB microcode included; the rest depends on the graphs"),
    ("shared scratchpad", 512 * MiB, "assumption: one page. The page (Scratchpad): the runtime allocates the "
     "shared scratchpad in pages of NEURON_SCRATCHPAD_PAGE_SIZE, 512 MB by default; how many pages a model "
     "needs is known only after compiling"),
    ("DMA rings", 64 * MiB, f"assumption, {NO_DOCUMENTED_SIZE}: IO, spill, collectives and runtime rings; its "
     "OOM example shows < 1 MB per NEFF"),
    ("collectives", 256 * MiB, f"assumption, {NO_DOCUMENTED_SIZE}: 'memory overhead used to orchestrate "
     "collective communication'"),
)
"""A device profile adds 'around 2 GB' of profile buffers (same page, Profile Buffers): plan it with --reserve-gib."""
CUDA_RUNTIME = (
    ("CUDA context, library workspaces, NCCL buffers", 1 * GiB, "assumption: outside the caching allocator that "
     "torch.cuda.max_memory_allocated reports; no documented size (driver, cuBLAS/cuDNN and NCCL versions)"),
)


@dataclasses.dataclass(frozen=True)
class Device:
    """A --device choice: the device kind whose rules apply, the memory of one rank (0: host RAM / ranks), the
    runtime's share of it (what, bytes, source) and the logical core count the NKI kernels launch with there."""

    kind: str
    capacity: float
    runtime: tuple[tuple[str, int, str], ...] = ()
    lnc: int = 1


DEVICES: dict[str, Device] = {
    "trn2": Device("neuron", 24 * GiB, TRN2_RUNTIME, lnc=2),  # trn2.48xlarge at LNC=2: 96 GiB per chip / 4
    "h100": Device("cuda", 80e9, CUDA_RUNTIME),
    "h200": Device("cuda", 141e9, CUDA_RUNTIME),
    "cpu": Device("cpu", 0.0),
}

FUSED_SDPA: dict[str, str | None] = {
    # device kind -> the fused SDPA kernel known to exist there (its memory is what the CPU trace's fused kernel
    # takes: no S x S scores), or None: SDPA is traced on its math path.
    "cpu": "aten._scaled_dot_product_flash_attention_for_cpu",
    "cuda": "flash / cuDNN attention (traced as the CPU flash kernel: O(S) memory, no S x S scores)",
    "neuron": None,
}
NO_FUSED_SDPA = ("no fused SDPA kernel is known on the neuron device: TorchNeuron documents none, and "
                 "neuron.sdpa_overrideable only lets one dispatch through SDPBackend.OVERRIDEABLE (torchtitan's "
                 "SDPA wrapper allows CUDNN/FLASH/MATH only); planned as SDPA's math path (fp32 S x S scores)")

CATEGORIES = ("sharded parameters", "gradients", "optimizer state", "all-gathered parameters", "activations",
              "attention scores", "logits and loss", "nki kernel buffers", "other temporaries", "device runtime")
OTHER_PARTS = {  # the parts of "other temporaries": the tracker's reference types
    "backward temporaries": "Temp", "unsharded gradients": "Unsharded Grad", "reduce-scatter buffers": "Reduce Scatter",
    "inputs": "Inputs",
}
REF_CATEGORY = {  # the tracker's reference type (value) -> the plan's category, or the part of "other temporaries"
    "Sharded Param": "sharded parameters", "Buffer": "sharded parameters", "Sharded Grad": "gradients",
    "OptState": "optimizer state", "Unsharded Param": "all-gathered parameters",
    "All Gather": "all-gathered parameters",
    "Activation": "activations", "Attention scores": "attention scores", "Logits": "logits and loss",
    "NKI kernels": "nki kernel buffers", **{ref: part for part, ref in OTHER_PARTS.items()},
}
LARGE = 0.10
"""A category (or part of "other temporaries") with at least this share of the peak gets its top tensors and lever."""
STATE = "state"
"""The origin of tensors no operator of the traced step made: parameters, gradients, optimizer state, inputs."""
TOP_TENSORS = 3
"""Tensor groups listed per large category."""
HEADROOM = 0.10
"""Suggestions aim for a peak with at least this fraction of the capacity left free."""


def capacity(device: str, ranks_per_host: int) -> float:
    """Bytes of memory one rank has on `device` (CPU: the host's RAM shared by its ranks)."""
    if device not in DEVICES:
        raise ConfigError(f"Unknown --device {device!r}; choose one of {', '.join(DEVICES)}.")
    if DEVICES[device].capacity == 0:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(ranks_per_host, 1)
    return DEVICES[device].capacity


def runtime_reserve(device: str, reserve_gib: float | None = None) -> list[dict]:
    """The device runtime's share of a rank's memory, item by item with its source (`Device.runtime`);
    `reserve_gib` replaces the table with one figure."""
    if reserve_gib is not None:
        if reserve_gib < 0:
            raise ConfigError(f"--reserve-gib {reserve_gib}: give the device runtime's share in GiB, >= 0.")
        return [{"what": "device runtime", "bytes": int(reserve_gib * GiB), "source": "--reserve-gib"}]
    return [{"what": w, "bytes": b, "source": src} for w, b, src in DEVICES[device].runtime]


# ------------------------------------------------------------------------------------------------
# The trace
# ------------------------------------------------------------------------------------------------


_NKI_SCOPE: list[str] = []
""""forward" / "backward" on top while the nki_moe experts' glue and kernels run in the trace: what they allocate
is filed under "nki kernel buffers" (`_nki_kernels_planned`). Activation checkpointing recomputes a block's
forward when the experts' backward first reads its saved tensors, i.e. inside their "backward" scope: every
module forward started there pushes "recompute", so what the recompute allocates is not filed as theirs."""


def _tracker_class(vocab_local: int, seq_len: int):
    """FSDPMemTracker that files tensors by what they are: the vocabulary as last dim -> 'logits and loss',
    [.., seq, seq] -> 'attention scores', allocated by the nki_moe kernels or glue -> 'nki kernel buffers'; and
    that records the SDPA kernels the step dispatched (`sdpa_ops`)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, get_untyped_storages

    # A str enum with the tracker's own values plus ours: its snapshot dicts are keyed by value (str equality),
    # so the tracker's internal `_FSDPRefType.X` lookups and ours hit the same entries.
    ref = enum.Enum("PlanRefType", {**{m.name: m.value for m in _FSDPRefType}, "LOGITS": "Logits",
                                    "SCORES": "Attention scores", "NKI": "NKI kernels"}, type=str)

    class Tracker(FSDPMemTracker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._ref_class = ref
            self.sdpa_ops: set[str] = set()
            self._op = STATE  # the operator running now: the origin of the storages it creates
            self.origin: dict[int, tuple[str, tuple, str, str]] = {}  # id(winfo) -> (op, shape, dtype, module)
            self.at_peak: list[tuple[int, str, tuple]] = []  # (bytes, reftype, origin) of every storage at the peak

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in func.__name__ and "backward" not in func.__name__:
                self.sdpa_ops.add(f"aten.{func.__name__.split('.')[0]}")
            self._op = f"aten.{func.__name__.split('.')[0]}"
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._op = STATE

        def _update_peak_stats(self, peak_state):
            # Only the global peak is read here. The base class also walks every module's stats after every
            # operator (a weak-dict lookup per module, through the checkpoint wrappers' __getattr__): a third of
            # a 30B trace's time, so that walk is left out.
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = copy.deepcopy(snap)
                    # a new peak: remember what is alive (what "top tensors" reads)
                    self.at_peak = [(w.mem_consumed, str(w.reftype.value), self.origin.get(id(w), ()))
                                    for w, st in self._WINFO.values() if st() is not None and w.mem_consumed]

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
            if reftype in (_FSDPRefType.ACT, _FSDPRefType.TEMP):
                if _NKI_SCOPE and _NKI_SCOPE[-1] != "recompute":
                    reftype = ref.NKI
                elif t.dim() >= 2 and t.shape[-1] == vocab_local:
                    reftype = ref.LOGITS
                elif t.dim() >= 2 and tuple(t.shape[-2:]) == (seq_len, seq_len):
                    reftype = ref.SCORES
            new = [st for st in get_untyped_storages(t) if st not in self._WINFO]
            super()._track(reftype, t)
            parents = self._mod_tracker.parents - {"Global"}
            module = max(parents, key=len).partition(".")[2] if parents else ""  # less the root's class name
            for st in new:
                winfo = self._WINFO.get(st, (None, None))[0]
                if winfo is not None:
                    self.origin[id(winfo)] = (self._op, tuple(t.shape), str(t.dtype).removeprefix("torch."), module)

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
        "attention scores": g("Attention scores"),
        "logits and loss": g("Logits"),
        "nki kernel buffers": g("NKI kernels"),
        "other temporaries": g(*OTHER_PARTS.values()),
    }


def _other_parts(snap: dict) -> dict[str, int]:
    """"other temporaries" split into its parts (`OTHER_PARTS`), bytes at the peak."""
    return {part: int(snap.get(ref, 0)) for part, ref in OTHER_PARTS.items()}


def _top_tensors(at_peak: list[tuple[int, str, tuple]], n: int = TOP_TENSORS) -> dict[str, list[dict]]:
    """{category or part of "other temporaries": its `n` largest groups of storages alive at the peak}, a group being
    the storages one operator made with one shape in one module, layer numbers folded ("layers.*.attention")."""
    import re

    groups: dict[tuple, list[int]] = {}
    for nbytes, reftype, origin in at_peak:
        op, shape, dtype, module = origin or (STATE, (), "", "")
        key = (REF_CATEGORY.get(reftype, reftype), op, shape, dtype, re.sub(r"\.\d+(?=\.|$)", ".*", module))
        groups.setdefault(key, []).append(nbytes)
    out: dict[str, list[dict]] = {}
    for (cat, op, shape, dtype, module), sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        if len(out.setdefault(cat, [])) < n:
            out[cat].append({"op": op, "shape": list(shape), "dtype": dtype, "module": module or "(top level)",
                             "count": len(sizes), "bytes": sum(sizes)})
    return out


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
    from torchtitan.components.loss import ChunkedLossWrapper

    from workbench.model import materialize
    from workbench.run.trainer import build_titan_config

    cfg = build_titan_config(job, device_kind, world_size)
    cfg.compile.enable = False  # eager memory (what compile can save is not promised by the plan)
    spec = cfg.model_spec
    spec.model.update_from_config(config=cfg)
    parallelize = functools.partial(spec.parallelize_fn, parallel_dims=parallel_dims, training=cfg.training,
                                    parallelism=cfg.parallelism, compile_config=cfg.compile,
                                    ac_config=cfg.activation_checkpoint, dump_folder=cfg.dump_folder)
    model = materialize(spec.model, None, parallelize)  # unseeded, as before: memory does not depend on values
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

    from workbench.run.trainer import build_titan_config

    pd = ParallelDims.from_config(build_titan_config(job, device_kind, world_size).parallelism, world_size)
    pd.build_mesh()
    return pd


def _moe_function_node(grad_fn):
    """The `BlockwiseMoEFunction` node behind the experts' output (a few view nodes up), or None."""
    frontier = [grad_fn]
    for _ in range(4):
        frontier = [n for n in frontier if n is not None]
        for node in frontier:
            if type(node).__name__ == "BlockwiseMoEFunctionBackward":
                return node
        frontier = [nxt for node in frontier for nxt, _ in node.next_functions]
    return None


def _planned_kernel(kernel, calls: list):
    """Stands in for `kernel` in the trace: allocates the HBM tensors one call of it allocates
    (`kernels.buffers.hbm_allocations`), returns the outputs and drops the scratch when the call returns."""
    import torch

    from workbench.kernels import buffers

    def run(lnc, *args):
        allocations = buffers.hbm_allocations(kernel, lnc, args)
        calls.append((kernel.__name__, allocations))
        tensors = [torch.empty(a.shape, dtype=a.dtype) for a in allocations]  # in the kernel's order
        outs = sorted((a.output, t) for t, a in zip(tensors, allocations, strict=True) if a.output is not None)
        return tuple(t for _, t in outs) if len(outs) > 1 else outs[0][1]

    return run


def _fake_like(obj):
    """A copy of a dataclass whose tensors are replaced by new (fake) tensors of their shapes and dtypes."""
    import torch

    fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return dataclasses.replace(obj, **{name: torch.empty(t.shape, dtype=t.dtype) for name, t in fields.items()
                                       if isinstance(t, torch.Tensor)})


def _kernel_plan_by_shape(build):
    """`KernelPlan.build` for fake tensors. Its shapes depend on (T, K, E, block size, lnc) only, but at LNC 2 it
    indexes a tensor with a 0-d tensor (a read of a value), which fake tensors cannot answer: it runs on real
    zero ids of the routing's shape, and fake tensors of its results' shapes are allocated in their place."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def by_shape(topk_ids_TK, num_experts: int, block_size: int, lnc: int, tiles: int | None = None):
        with unset_fake_temporarily():
            plan, kplan = build(torch.zeros(topk_ids_TK.shape, dtype=topk_ids_TK.dtype), num_experts, block_size, lnc,
                                tiles)
        return _fake_like(plan), _fake_like(kplan)

    return by_shape


@contextlib.contextmanager
def _nki_kernels_planned(lnc: int, calls: list):
    """The nki_moe experts as on a Neuron device: `kernels.autograd.blockwise_moe_nki` (host-side plan, the glue's
    copies, `BlockwiseMoEFunction`) with `_planned_kernel`s in place of the kernels, and everything allocated in
    its forward and backward filed under "nki kernel buffers". `calls` collects every kernel call's allocations.
    The glue on the device (`autograd.neuron_moe_op`) makes the same copies plus one transient [T+1, D] pad of dx
    in its backward (16 MiB at 30B-A3B with 4096 tokens per rank), which this does not count."""
    import torch

    from workbench.backends import nki_moe as backend
    from workbench.kernels import autograd, nki_moe

    def experts(*args, block_size):
        _NKI_SCOPE.append("forward")
        try:
            out = autograd.blockwise_moe_nki(*args, block_size=block_size)
        finally:
            _NKI_SCOPE.pop()
        node = _moe_function_node(out.grad_fn)
        if node is not None:  # the backward's allocations too: from entering the node until its grads are out
            node.register_prehook(enter)
            node.register_hook(leave)
        return out

    def enter(grad_outputs):
        _NKI_SCOPE.append("backward")

    def leave(grad_inputs, grad_outputs):
        _NKI_SCOPE.pop()

    def module_enters(module, args):
        if _NKI_SCOPE:
            _NKI_SCOPE.append("recompute")

    def module_leaves(module, args, output):
        if _NKI_SCOPE and _NKI_SCOPE[-1] == "recompute":
            _NKI_SCOPE.pop()

    with compiled_for_lnc(lnc):  # the kernels launch on the compiler's LNC
        saved = backend.blockwise_moe_auto, autograd.HOST_KERNELS, autograd.KernelPlan.__dict__["build"]
        backend.blockwise_moe_auto = experts
        autograd.HOST_KERNELS = autograd.Kernels(_planned_kernel(nki_moe.moe_blockwise_fwd, calls),
                                                 _planned_kernel(nki_moe.moe_blockwise_bwd, calls))
        autograd.KernelPlan.build = _kernel_plan_by_shape(autograd.KernelPlan.build)
        hooks = (torch.nn.modules.module.register_module_forward_pre_hook(module_enters),
                 torch.nn.modules.module.register_module_forward_hook(module_leaves))
        try:
            yield
        finally:
            backend.blockwise_moe_auto, autograd.HOST_KERNELS, autograd.KernelPlan.build = saved
            for hook in hooks:
                hook.remove()


@contextlib.contextmanager
def _math_sdpa():
    """SDPA on its math path for every backend: torchtitan's attention keeps its own backend list (set before the
    model is built), transformers' follows the sdpa_kernel context."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torchtitan.models.common.attention import ScaledDotProductAttention

    saved = ScaledDotProductAttention.sdpa_backends
    ScaledDotProductAttention.sdpa_backends = [SDPBackend.MATH]
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        ScaledDotProductAttention.sdpa_backends = saved


@contextlib.contextmanager
def _as_on(device: str, job: JobConfig, calls: list):
    """What runs on `device` but not in a CPU trace: SDPA without a fused kernel, the NKI kernels of nki_moe."""
    kind = DEVICES[device].kind
    with contextlib.ExitStack() as stack:
        if FUSED_SDPA[kind] is None:
            stack.enter_context(_math_sdpa())
        if kind == "neuron" and job.model.backend == "nki_moe":
            stack.enter_context(_nki_kernels_planned(DEVICES[device].lnc, calls))
        yield


def _kernel_calls(calls: list) -> dict:
    """{kernel: {"calls", "hbm_bytes_per_call", "allocations": [[name, shape, dtype, output], ...]}} (the
    allocations of the largest call; output: the kernel's output position, None for scratch)."""
    out: dict = {}
    for name, allocations in calls:
        nbytes = sum(a.nbytes for a in allocations)
        entry = out.setdefault(name, {"calls": 0, "hbm_bytes_per_call": -1})
        entry["calls"] += 1
        if nbytes > entry["hbm_bytes_per_call"]:
            entry["hbm_bytes_per_call"] = nbytes
            entry["allocations"] = [[a.name, list(a.shape), str(a.dtype).removeprefix("torch."), a.output]
                                    for a in allocations]
    return out


def _stderr(msg: str) -> None:
    print(f"workbench.plan: {msg}", file=sys.stderr, flush=True)


def trace(job: JobConfig, device: str, world_size: int, progress=_stderr) -> dict:
    """Per-rank peak memory of one steady-state training step of `job` on `world_size` ranks (fake tensors).

    Args:
        progress: called with a short line as each phase starts (build, warm-up, traced step).

    Returns:
        {"peak_bytes", "categories": {name: bytes}, "other_parts": `_other_parts`, "top_tensors": `_top_tensors`,
        "trace_seconds", "checkpoint_bytes", "sdpa": {"kernel", "note"}, "nki_kernels": `_kernel_calls`}. The
        device runtime is not in it (see `plan`).
    """
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from workbench.platform import titan_device
    from workbench.run.checkpoint import checkpoint_bytes
    from workbench.run.trainer import quiet_titan_logs

    device_kind = DEVICES[device].kind
    titan_device.prepare("cpu")  # the trace runs on this host's CPU whatever the target
    quiet_titan_logs(job.job.verbose)  # the warnings training hides (initial_load_model_only, DTensor RNG) too
    t0 = time.perf_counter()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    calls: list = []
    try:
        pd = parallel_dims_for(job, device_kind, world_size)
        with FakeTensorMode(allow_non_fake_inputs=True), _as_on(device, job, calls):
            progress(f"building {job.model.flavor} {job.model.backend} for {world_size} rank(s) of {device} "
                     "(fake tensors)")
            b = build(job, device_kind, world_size, pd)
            progress("warm-up step (optimizer state)")
            warm_optimizer(b, job.training.gradient_accumulation_steps)
            ckpt = checkpoint_bytes([b.model], b.optimizers)
            t = job.training
            tokens = torch.zeros(t.local_batch_size, t.seq_len, dtype=torch.long)
            tracker = _tracker_class(b.vocab_local, t.seq_len)(
                b.model, b.optimizers.optimizers[0] if hasattr(b.optimizers, "optimizers") else b.optimizers)
            tracker.track_inputs((tokens,))
            progress(f"tracing one training step ({time.perf_counter() - t0:.0f} s so far)")
            with tracker:
                training_step(b, tokens, tokens.clone())
                b.optimizers.step()
                b.optimizers.zero_grad(set_to_none=True)
            snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    finally:
        dist.destroy_process_group()
    cats = _categories(snap)
    fused = FUSED_SDPA[device_kind]
    sdpa = {"kernel": ", ".join(sorted(tracker.sdpa_ops)) or "math (decomposed: fp32 S x S scores)",
            "note": f"the device's fused kernel: {fused}" if fused else NO_FUSED_SDPA}
    return {"peak_bytes": sum(cats.values()), "categories": cats, "other_parts": _other_parts(snap),
            "top_tensors": _top_tensors(tracker.at_peak), "trace_seconds": time.perf_counter() - t0,
            "checkpoint_bytes": ckpt, "sdpa": sdpa, "nki_kernels": _kernel_calls(calls)}


def plan_in_subprocess(job: JobConfig, device: str, world_size: int, suggest: bool = False,
                       reserve_gib: float | None = None, advise: int = 0) -> dict:
    """`plan` in a fresh interpreter: torch's meshes and fake process groups are process-global, and a trace
    after another one of a different layout (TP after FSDP-only, another world size) can trip over them; a
    training process also keeps its own process group. `advise`: levers re-planned for their saving (`plan`; none
    by default: a launch's check re-plans only when the plan does not fit, as `suggestions`).

    Raises:
        RuntimeError: the planner failed (its stderr's tail).
    """
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(job.to_toml())
    cmd = [sys.executable, "-m", "workbench.plan", "--job.config_file", f.name, "--nproc", str(world_size),
           "--device", device, "--json", "--advise", str(advise), *([] if suggest else ["--no-suggest"]),
           *([] if reserve_gib is None else ["--reserve-gib", str(reserve_gib)])]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    try:  # 0 fits, 1 does not (both print the plan); anything else, or no plan printed (a traceback exits 1)
        if proc.returncode in (0, 1):
            return json.loads(proc.stdout)
    except json.JSONDecodeError:
        pass
    raise RuntimeError(f"memory plan failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


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
    if job.model.backend != "huggingface_v5":  # full-size per-layer tensors split by tensor parallelism
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
        if nbytes < LARGE * p["peak_bytes"] or nbytes == 0:
            continue
        flag, change, world = found.get(cat, (None, None, world_size))
        out.append({"category": cat, "bytes": nbytes, "top": p.get("top_tensors", {}).get(cat, []), "change": flag,
                    "changes": change, "world_size": world, "peak_bytes_after": None})
    return out


def _replan(job: JobConfig, change: dict, device: str, world: int, reserve_gib: float | None) -> int:
    """The peak of `job` with `change` on `world` ranks, planned in a fresh interpreter (`plan_in_subprocess`: a
    second trace in this process meets the first one's device meshes)."""
    return plan_in_subprocess(_with(job, world, **change), device, world, reserve_gib=reserve_gib)["peak_bytes"]


def plan(job: JobConfig, device: str = "trn2", nproc: int = 1, nnodes: int = 1, suggest: bool = True,
         max_replans: int = 3, reserve_gib: float | None = None, advise: int = 1, progress=_stderr) -> dict:
    """The memory plan of `job` on `nproc` x `nnodes` ranks of `device` (see module doc); JSON-serialisable.

    The peak is the traced step's plus the device runtime's share (`runtime_reserve`; `reserve_gib` replaces it).
    With `suggest`, the levers of the `advise` largest categories are re-planned (their saving, `advice`), and a
    plan over `1 - HEADROOM` of the capacity re-plans up to `max_replans` changes until one fits (`suggestions`).
    `progress` is called with a line as each phase starts.
    """
    world_size = nproc * nnodes
    cap = capacity(device, nproc)
    runtime = runtime_reserve(device, reserve_gib)
    validate(job, world_size)
    traced = trace(job, device, world_size, progress)
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
    if suggest and peak > (1 - HEADROOM) * cap:
        for flag, change, world in candidates(job, world_size, categories, cap):
            if len(result["suggestions"]) >= max_replans:
                break
            progress(f"re-planning {flag}")
            p = replanned.get(flag) or _replan(job, change, device, world, reserve_gib)
            replanned[flag] = p
            progress(f"re-planned {flag}: {p / GiB:.2f} GiB")
            result["suggestions"].append({"change": flag, "world_size": world, "peak_bytes": p, "fits": p <= cap,
                                          "headroom": 1 - p / cap})
            if p <= (1 - HEADROOM) * cap:
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
    if t["op"] == STATE:
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
         "logits and loss": "logits+loss", "nki kernel buffers": "nki kernels", "other temporaries": "other",
         "device runtime": "runtime"}


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
# The launch's memory check (train.py), the first-launch check (trainer.py) and CLI
# ------------------------------------------------------------------------------------------------

DEVICE_OF_KIND = {"neuron": "trn2", "cuda": "h100", "cpu": "cpu"}


def launch_device(device_kind: str) -> str:
    """The --device a launch on `device_kind` is planned for: the GPU by its name (an H200 has 141 GB, not an
    H100's 80), else `DEVICE_OF_KIND`."""
    if device_kind == "cuda":
        import torch

        if "H200" in torch.cuda.get_device_name(0):
            return "h200"
    return DEVICE_OF_KIND.get(device_kind, "cpu")


def launch_plan(job: JobConfig, world_size: int, device_kind: str, cache_dir: Path | None = None) -> dict:
    """The plan of a launch of `job` on `world_size` ranks of `device_kind` (with suggestions), from a subprocess,
    cached by a hash of the resolved config, world size and device. On cuda the capacity is the GPU's
    (`launch_device`: an H200's or else an H100's), on neuron a trn2 rank's.

    Raises:
        RuntimeError: the planner failed.
    """
    device = launch_device(device_kind)
    key = hashlib.sha256(f"{job.to_toml()}|{world_size}|{device}".encode()).hexdigest()[:16]
    cache = (cache_dir or Path.home() / ".cache" / "workbench" / "plans") / f"{key}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    p = plan_in_subprocess(job, device, world_size, suggest=True)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(p))
    return p


def check_fits(job: JobConfig, world_size: int, device_kind: str, cache_dir: Path | None = None) -> dict | None:
    """Plans `job` before launch (`launch_plan`) and refuses a plan over the rank's memory.

    On CPU a launch is planned only when its lower bound (`cpu_floor_bytes`) is over 1/8 of the host RAM per rank
    (the tiny CPU runs are not slowed by a plan), and refused at once, unplanned, when that bound alone exceeds it.

    Raises:
        ConfigError: the plan does not fit, with the numbers and the suggested changes (exit code 2).
    """
    if not job.job.memory_check:
        return None
    if device_kind == "cpu":
        floor, ram = cpu_floor_bytes(job), capacity("cpu", world_size)
        if floor > ram:  # certain without a trace (which would take minutes at such sizes)
            raise ConfigError(
                f"this launch needs at least {floor / GiB:.1f} GiB per rank (fp32 weights + the logits of "
                f"{job.training.local_batch_size} x {job.training.seq_len} tokens), and each of the {world_size} "
                f"rank(s) has {ram / GiB:.1f} GiB of this host's RAM: lower --training.local_batch_size (raise "
                "--training.gradient_accumulation_steps to keep the batch) or set --training.loss_chunks 8 "
                "(skip the check with --job.memory_check false).")
        if floor < ram / 8:
            return None
    try:
        p = launch_plan(job, world_size, device_kind, cache_dir)
    except RuntimeError as e:
        print(f"workbench: {e}\nworkbench: launching anyway", file=sys.stderr)
        return None
    if not p["fits"]:
        raise ConfigError("the memory plan does not fit (skip with --job.memory_check false):\n" + render(p))
    return p


def cpu_floor_bytes(job: JobConfig) -> int:
    """A lower bound of a CPU rank's peak: fp32 weights plus one fp32 logits tensor of a micro-batch (per loss
    chunk). Cheap (no trace)."""
    t = job.training
    logits = t.local_batch_size * t.seq_len * job.shape.vocab_size * 4 // max(t.loss_chunks, 1)
    return 4 * _total_params(job.shape) + logits


@functools.lru_cache(maxsize=16)
def _total_params(shape) -> int:
    """`flavors.count_params(shape)["total"]`, once per shape (it builds the model on meta)."""
    from workbench.core import flavors

    return flavors.count_params(shape)["total"]


CHECK_STEPS = 2
"""The first-launch check measures this launch's first steps: step 1 (AdamW creates its state in it) and step 2
(steady state, what the plan traces)."""


ALLOCATOR_API = ("synchronize", "reset_peak_memory_stats", "max_memory_allocated", "memory_allocated")
"""What `AllocatorPeak` calls on torch.accelerator / torch.cuda / torch.neuron (the check is skipped, saying so,
where one is missing)."""


def allocator_module(kind: str, torch_module=None):
    """(module, its name) whose ALLOCATOR_API reads device `kind`'s allocator; (None, ...) on cpu or when missing.

    `torch.accelerator` (device-generic, torch >= 2.9) when the current accelerator is `kind` and has the API: the
    torch-neuronx v2.34.0 release notes say its memory functions work on Neuron from SDK 2.34. Else `torch.<kind>`:
    torch.cuda, or torch.neuron (SDK 2.33, once torch_neuronx imports). `torch_module` replaces `torch` (tests)."""
    if kind == "cpu":
        return None, ""
    if torch_module is None:
        import torch as torch_module
    acc = getattr(torch_module, "accelerator", None)
    current = acc.current_accelerator() if acc is not None and acc.is_available() else None
    if current is not None and current.type == kind and all(hasattr(acc, f) for f in ALLOCATOR_API):
        return acc, "torch.accelerator"
    return getattr(torch_module, kind, None), f"torch.{kind}"


class AllocatorPeak:
    """Peak bytes of the tensors this rank holds during a window, from the device's own allocator.

    cuda / neuron: the caching allocator's peak (`max_memory_allocated` after `synchronize()`, peak reset at the
    window's start) through `torch.accelerator` where it serves the device (Neuron from SDK 2.34), else
    `torch.cuda` / `torch.neuron` (`allocator_module`). The Neuron allocator is asynchronous: its memory-profiling
    guide says to synchronize before reading any statistic
    (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/torch/guides/memory-profiling-guide.html).
    cpu: there are no allocator statistics, so the c10 CPU allocator's own allocation events (torch.profiler with
    profile_memory: the bytes of every allocation and free while it records) are summed in order on top of the
    tensors alive at the start (parameters, buffers, gradients, optimizer state).
    """

    def __init__(self, kind: str, model_parts, optimizers, torch_module=None):
        self.kind, self.model_parts, self.optimizers = kind, model_parts, optimizers
        self.module, self.name = allocator_module(kind, torch_module)
        self.profiler = None
        self.base = 0
        self.resident = 0  # bytes held when the window opened (parameters, optimizer state, ...)

    @property
    def source(self) -> str:
        if self.module is None:
            return "c10 CPU allocator events (torch.profiler profile_memory) + live parameters/optimizer state"
        return f"{self.name}.max_memory_allocated() after {self.name}.synchronize()"

    def start(self) -> None:
        if self.module is not None:
            self.module.synchronize()
            self.module.reset_peak_memory_stats()
            self.resident = int(self.module.memory_allocated())
            return
        import torch

        self.base = self.resident = self._live_bytes()
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()

    def stop(self) -> int:
        """The window's peak (bytes)."""
        if self.module is not None:
            self.module.synchronize()
            return int(self.module.max_memory_allocated())
        self.profiler.__exit__(None, None, None)
        events = [e for e in self.profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
        level = peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            level += e.nbytes()
            peak = max(peak, level)
        self.profiler = None
        return self.base + peak

    def _live_bytes(self) -> int:
        """Bytes of the distinct storages behind the parameters, buffers, gradients and optimizer state."""
        import torch
        from torch.distributed.tensor import DTensor

        tensors = [t for m in self.model_parts for t in (*m.parameters(), *m.buffers())]
        tensors += [p.grad for m in self.model_parts for p in m.parameters() if p.grad is not None]
        for opt in getattr(self.optimizers, "optimizers", [self.optimizers]):  # torchtitan's container holds several
            tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        storages = {}
        for t in tensors:
            local = t.to_local() if isinstance(t, DTensor) else t
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return sum(storages.values())


def measures_on_launch(job: JobConfig, device_kind: str) -> bool:
    """Whether a launch compares the plan with the measured peaks (`job.memory_measure`)."""
    measure = job.job.memory_measure
    return measure == "always" or (measure == "auto" and device_kind != "cpu" and job.job.memory_check)


def check_on_launch(trainer) -> None:
    """The first-launch check: after steps 1 and 2 of this launch, every rank's peak (`AllocatorPeak`) against the
    plan, in `<run>/memory_check.json` and a progress line (`job.memory_measure`; `WorkbenchTrainer` calls this
    before its first step).

    A step's window opens at the model's forward (after torchtitan's zero_grad and the data) and closes after the
    optimizer step (before the metrics log, which resets the peak statistics). The plan's tensors (its peak less
    the device runtime, which no allocator sees) are compared with the largest rank's peak. Rank 0 plans
    (`launch_plan`: `check_fits`'s cached plan on cuda/neuron).
    """
    import torch
    import torch.distributed as dist

    job, kind = trainer.job, trainer.device.type
    if not measures_on_launch(job, kind):
        return
    from workbench.run.trainer import say

    if kind == "cpu" and job.profiling.enable:
        say("memory check: skipped on CPU while [profiling] is on (one torch.profiler at a time)")
        return
    meter = AllocatorPeak(kind, trainer.model_parts, trainer.optimizers)
    if kind != "cpu" and not all(hasattr(meter.module, f) for f in ALLOCATOR_API):
        say(f"memory check: skipped, {meter.name} lacks one of {', '.join(ALLOCATOR_API)}")
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    planned = None
    if rank == 0:
        try:
            planned = launch_plan(job, world, kind)
        except RuntimeError as e:
            print(f"workbench: memory check without a plan: {e}", file=sys.stderr)
    steps = list(range(trainer.step, min(trainer.step + CHECK_STEPS, job.training.steps + 1)))
    report = {"device": kind, "world_size": world, "source": meter.source, "steps": []}
    if planned is not None:
        runtime = planned["categories"].get("device runtime", 0)
        cats = planned["categories"]
        report["plan"] = {"peak_bytes": planned["peak_bytes"], "tensor_bytes": planned["peak_bytes"] - runtime,
                          "device_runtime_bytes": runtime, "capacity_bytes": planned["capacity_bytes"],
                          "device": planned["device"], "sdpa": planned.get("sdpa", {}).get("kernel"),
                          # what a steady-state step starts with: its parameters and optimizer state (the
                          # gradients were freed by zero_grad), comparable with `AllocatorPeak.resident`
                          "resident_bytes": cats["sharded parameters"] + cats["optimizer state"],
                          "categories": cats}
    open_window = [False]

    def before_forward(*_):
        if steps and not open_window[0] and trainer.step == steps[0]:
            meter.start()
            open_window[0] = True

    def after_optimizer_step(*_):
        if not open_window[0]:
            return
        open_window[0] = False
        step = steps.pop(0)
        # MiB as fp32: a dtype every backend's all_gather takes (a byte count needs int64 or fp64)
        mine = torch.tensor([meter.stop() / MiB, meter.resident / MiB], dtype=torch.float32, device=trainer.device)
        every = [torch.zeros_like(mine) for _ in range(world)]
        if world > 1:
            dist.all_gather(every, mine)
        else:
            every = [mine]
        if rank == 0:
            _report_step(report, step, [int(float(t[0]) * MiB) for t in every], Path(trainer.config.dump_folder),
                         resident=[int(float(t[1]) * MiB) for t in every])

    trainer.model_parts[0].register_forward_pre_hook(before_forward, prepend=True)  # before FSDP's all-gather
    trainer.optimizers.register_step_post_hook(after_optimizer_step)


def _report_step(report: dict, step: int, measured: list[int], run_dir: Path, resident: list[int] | None = None
                 ) -> None:
    """Rank 0: add one step's per-rank peaks (and what each rank held when the step began, `resident`) to the
    report, rewrite memory_check.json, print the line."""
    from workbench.run.trainer import say

    top = max(range(len(measured)), key=measured.__getitem__)
    entry = {"step": step, "measured_bytes": measured, "max_bytes": measured[top], "max_rank": top}
    if resident is not None:
        entry["resident_bytes"] = resident[top]
    line = f"memory step {step}: measured peak {measured[top] / GiB:.2f} GiB (rank {top} of {len(measured)})"
    if "plan" in report:
        plan_ = report["plan"]
        entry["measured_over_plan"] = measured[top] / plan_["tensor_bytes"]
        if resident is not None and plan_.get("resident_bytes"):
            entry["resident_over_plan"] = resident[top] / plan_["resident_bytes"]
        line += (f", plan {plan_['tensor_bytes'] / GiB:.2f} GiB of tensors ({plan_['device']}): measured/plan "
                 f"{entry['measured_over_plan']:.3f}; the plan's peak with the device runtime "
                 f"{plan_['peak_bytes'] / GiB:.2f} of {plan_['capacity_bytes'] / GiB:.0f} GiB")
    report["steps"].append(entry)
    (run_dir / "memory_check.json").write_text(json.dumps(report, indent=1))
    say(line)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m workbench.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=1, help="ranks per node (torchrun --nproc_per_node)")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--device", default="trn2", help=f"one of {', '.join(DEVICES)}")
    ap.add_argument("--reserve-gib", type=float, default=None,
                    help="the device runtime's share of a rank in GiB (default: the device's table, see --json)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--no-suggest", action="store_true", help="do not re-plan when it does not fit")
    ap.add_argument("--advise", type=int, default=1,
                    help="re-plan the levers of this many of the largest categories, for their saving (default 1)")
    args, rest = ap.parse_known_args(argv)
    try:
        if args.device not in DEVICES:
            raise ConfigError(f"Unknown --device {args.device!r}; choose one of {', '.join(DEVICES)}.")
        if args.nproc <= 0 or args.nnodes <= 0:
            raise ConfigError("--nproc and --nnodes must be positive.")
        job = load_config(argv=rest, world_size=args.nproc * args.nnodes)
        p = plan(job, args.device, args.nproc, args.nnodes, suggest=not args.no_suggest, reserve_gib=args.reserve_gib,
                 advise=args.advise)
    except ConfigError as e:
        return announce(e)
    print(json.dumps(p, indent=1) if args.json else render(p), flush=True)
    return 0 if p["fits"] else 1


if __name__ == "__main__":
    sys.stdout.flush()
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip torch.distributed's teardown (see workbench.train.main)
