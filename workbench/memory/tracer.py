"""The memory plan's tracer: one training step of the real model under fake tensors, filed by category (`trace`;
`plan_in_subprocess` runs it in a fresh interpreter through `python -m workbench.plan`).

What is traced and why the numbers can be trusted: `workbench.plan`'s docstring.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import json
import os
import sys
import time

from workbench.core.config import NKI_KERNEL_BACKENDS, JobConfig
from workbench.core.neuron_env import compiled_for_lnc
from workbench.memory import tables

_NKI_SCOPE: list[str] = []
""""forward" / "backward" on top while the nki_moe experts' glue and kernels run in the trace: what they allocate
is filed under "nki kernel buffers" (`_nki_kernels_planned`). Activation checkpointing recomputes a block's
forward when the experts' backward first reads its saved tensors, i.e. inside their "backward" scope: every
module forward started there pushes "recompute", so what the recompute allocates is not filed as theirs."""


_MASK_SCOPE: list[str] = []
""""mask" while the step builds its attention masks (`attention.forward_kwargs`): what that allocates (the dense
block-causal mask, or flex's BlockMask / varlen's cu_seqlens, and the document ids) is filed under "attention mask"."""


def tracker_class(vocab_local: int, seq_len: int):
    """FSDPMemTracker that files tensors by what they are: the vocabulary as last dim -> 'logits and loss',
    [.., seq, seq] -> 'attention scores', allocated by the nki_moe kernels or glue -> 'nki kernel buffers', built
    for the attention masks -> 'attention mask'; and that records the SDPA kernels the step dispatched
    (`sdpa_ops`)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, get_untyped_storages

    # A str enum with the tracker's own values plus ours: its snapshot dicts are keyed by value (str equality),
    # so the tracker's internal `_FSDPRefType.X` lookups and ours hit the same entries.
    ref = enum.Enum("PlanRefType", {**{m.name: m.value for m in _FSDPRefType}, "LOGITS": "Logits",
                                    "SCORES": "Attention scores", "NKI": "NKI kernels", "MASK": "Attention mask"},
                     type=str)

    class Tracker(FSDPMemTracker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._ref_class = ref
            self.sdpa_ops: set[str] = set()
            self._op = tables.STATE  # the operator running now: the origin of the storages it creates
            self.origin: dict[int, tuple[str, tuple, str, str]] = {}  # id(winfo) -> (op, shape, dtype, module)
            self.at_peak: list[tuple[int, str, tuple]] = []  # (bytes, reftype, origin) of every storage at the peak

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name.startswith(("_scaled_dot_product", "_varlen_attn")) and "backward" not in name:
                self.sdpa_ops.add(f"{func.namespace}.{name}")
            self._op = f"aten.{func.__name__.split('.')[0]}"
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._op = tables.STATE

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
                if _MASK_SCOPE:
                    reftype = ref.MASK
                elif _NKI_SCOPE and _NKI_SCOPE[-1] != "recompute":
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


def categories_at_peak(snap: dict) -> dict[str, int]:
    """The tracker's reference types -> the plan's categories."""
    g = lambda *keys: int(sum(snap.get(k, 0) for k in keys))  # noqa: E731
    return {
        "sharded parameters": g("Sharded Param", "Buffer"),
        "gradients": g("Sharded Grad"),
        "optimizer state": g("OptState"),
        "all-gathered parameters": g("Unsharded Param", "All Gather"),
        "activations": g("Activation"),
        "attention scores": g("Attention scores"),
        "attention mask": g("Attention mask"),
        "logits and loss": g("Logits"),
        "nki kernel buffers": g("NKI kernels"),
        "other temporaries": g(*tables.OTHER_PARTS.values()),
    }


def other_parts(snap: dict) -> dict[str, int]:
    """"other temporaries" split into its parts (`OTHER_PARTS`), bytes at the peak."""
    return {part: int(snap.get(ref, 0)) for part, ref in tables.OTHER_PARTS.items()}


def top_tensors(at_peak: list[tuple[int, str, tuple]], n: int = tables.TOP_TENSORS) -> dict[str, list[dict]]:
    """{category or part of "other temporaries": its `n` largest groups of storages alive at the peak}, a group being
    the storages one operator made with one shape in one module, layer numbers folded ("layers.*.attention")."""
    import re

    groups: dict[tuple, list[int]] = {}
    for nbytes, reftype, origin in at_peak:
        op, shape, dtype, module = origin or (tables.STATE, (), "", "")
        key = (tables.REF_CATEGORY.get(reftype, reftype), op, shape, dtype, re.sub(r"\.\d+(?=\.|$)", ".*", module))
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
    from workbench.run.titan_config import build_titan_config

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


def training_step(b: Built, tokens, labels, positions=None) -> None:
    """One micro-batch forward + backward with torchtitan's loss contract (sum / global valid tokens); with
    `positions`, the model also gets the attention masks training builds from them (`attention.forward_kwargs`)."""
    import torch
    from torchtitan.config import TORCH_DTYPE_MAP

    from workbench.backends import attention

    _MASK_SCOPE.append("mask")
    try:
        kwargs = attention.forward_kwargs(b.cfg.model_spec.model, positions,
                                          TORCH_DTYPE_MAP[b.cfg.training.mixed_precision_param])
    finally:
        _MASK_SCOPE.pop()
    pred = b.model(tokens, **kwargs)
    loss, _ = b.loss_fn(pred, labels, torch.tensor(float(labels.numel())))
    del pred
    loss.backward()


def step_positions(b: Built, batch: int, seq_len: int):
    """The traced step's positions, from which it builds its attention masks as training does (their sizes depend
    on [batch, seq_len] only): rows of two documents with `training.document_mask`, of one when the attention takes
    a mask anyway (flex, varlen), none for plain causal SDPA."""
    import torch

    from workbench.backends import attention

    if b.cfg.dataloader.document_mask:
        half = seq_len // 2
        return torch.cat([torch.arange(half), torch.arange(seq_len - half)]).expand(batch, seq_len)
    if attention.mask_kind(b.cfg.model_spec.model):
        return torch.arange(seq_len).expand(batch, seq_len)
    return None


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

    from workbench.run.titan_config import build_titan_config

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

    def by_shape(topk_ids_TK, num_experts: int, block_size: int, lnc: int, tiles: int | None = None,
                 halves: bool = False):
        with unset_fake_temporarily():
            plan, kplan = build(torch.zeros(topk_ids_TK.shape, dtype=topk_ids_TK.dtype), num_experts, block_size, lnc,
                                tiles, halves)
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
    kind = tables.DEVICES[device].kind
    with contextlib.ExitStack() as stack:
        if tables.FUSED_SDPA[kind] is None:
            stack.enter_context(_math_sdpa())
        if kind == "neuron" and job.model.backend in NKI_KERNEL_BACKENDS:
            stack.enter_context(_nki_kernels_planned(tables.DEVICES[device].lnc, calls))
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


def to_stderr(msg: str) -> None:
    print(f"workbench.plan: {msg}", file=sys.stderr, flush=True)


def trace(job: JobConfig, device: str, world_size: int, progress=to_stderr) -> dict:
    """Per-rank peak memory of one steady-state training step of `job` on `world_size` ranks (fake tensors).

    Args:
        progress: called with a short line as each phase starts (build, warm-up, traced step).

    Returns:
        {"peak_bytes", "categories": {name: bytes}, "other_parts": `other_parts`, "top_tensors": `top_tensors`,
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

    device_kind = tables.DEVICES[device].kind
    titan_device.pin("cpu")  # the trace runs on this host's CPU whatever the target
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
            positions = step_positions(b, t.local_batch_size, t.seq_len)
            tracker = tracker_class(b.vocab_local, t.seq_len)(
                b.model, b.optimizers.optimizers[0] if hasattr(b.optimizers, "optimizers") else b.optimizers)
            tracker.track_inputs((tokens,))
            progress(f"tracing one training step ({time.perf_counter() - t0:.0f} s so far)")
            with tracker:
                training_step(b, tokens, tokens.clone(), positions)
                b.optimizers.step()
                b.optimizers.zero_grad(set_to_none=True)
            snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    finally:
        dist.destroy_process_group()
    cats = categories_at_peak(snap)
    fused = tables.FUSED_SDPA[device_kind]
    sdpa = {"kernel": ", ".join(sorted(tracker.sdpa_ops)) or "math (decomposed: fp32 S x S scores)",
            "note": f"the device's fused kernel: {fused}" if fused else tables.NO_FUSED_SDPA}
    return {"peak_bytes": sum(cats.values()), "categories": cats, "other_parts": other_parts(snap),
            "top_tensors": top_tensors(tracker.at_peak), "trace_seconds": time.perf_counter() - t0,
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
