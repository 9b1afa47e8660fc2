"""torchtitan's Trainer, extended through its seams for the workbench's run folder and progress output.

`build_titan_config(job, device)` translates our `JobConfig` into torchtitan's `Trainer.Config` (with the
backend's `ModelSpec`); `WorkbenchTrainer` adds, without touching torchtitan's loop:
  * the run folder contract: one launch at a time (`run_folder.RunLock`, taken right after the process group
    starts), `config.toml` (resolved config), `metrics.jsonl` (one object per logged step, never a step twice),
    `checkpoint/` (DCP, torchtitan's checkpointer), `hf/` (export at the end when asked);
  * a clean stop on SIGTERM / SIGINT (`dist_utils.StopRequest`): every rank finishes the step, they save it
    together and exit 5 with one line;
  * a readable progress line per logged step on rank 0 and a summary at the end; other ranks stay quiet;
  * an MFU against a peak that means something on the device (`workbench.run.profiling.peak_flops`) and model FLOPs
    from the shape (`workbench.run.profiling.flops_per_token`), the same for every backend;
  * torch.profiler traces of the `[profiling]` steps with phase labels (`workbench.run.profiling.StepProfiler`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import spmd_types as spmd
import torch
from torch.profiler import record_function
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer
from torchtitan.config import CommConfig, CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.tools.logging import logger as titan_logger
from torchtitan.tools.profiler import Profiler
from torchtitan.trainer import Trainer

from workbench import data
from workbench.core.config import JobConfig, resolved_dtype
from workbench.core.errors import NonFiniteError, RunError, RunFolderError, StoppedError
from workbench.core.files import open_for_append, write_atomic
from workbench.data.loader import PackedTextDataLoader
from workbench.platform import neuron_adjustments
from workbench.platform.dist_utils import StopRequest, broadcast, say
from workbench.platform.dist_utils import rank as _rank
from workbench.run import profiling
from workbench.run.checkpoint import WorkbenchCheckpointManager, newest_complete
from workbench.run.run_folder import RunLock, describe_holder, trim_metrics


class LazyTokenizer(BaseTokenizer):
    """torchtitan's tokenizer slot, read on first use. The workbench's dataloader tokenizes with its own
    `tokenizers.Tokenizer` (`data.PackedTextDataLoader` discards the one it is handed), so torchtitan's copy of the
    151,669-token BPE (1-2.5 s to parse, at every launch) is built only if something else asks for it."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str):
        super().__init__()
        self.tokenizer_path = tokenizer_path
        self._loaded: HuggingFaceTokenizer | None = None

    def _hf(self) -> HuggingFaceTokenizer:
        if self._loaded is None:
            self._loaded = HuggingFaceTokenizer(tokenizer_path=self.tokenizer_path)
            self.eos_id = self._loaded.eos_id
        return self._loaded

    def encode(self, *args, **kwargs) -> list[int]:
        return self._hf().encode(*args, **kwargs)

    def decode(self, *args, **kwargs) -> str:
        return self._hf().decode(*args, **kwargs)

    def get_vocab_size(self) -> int:
        return self._hf().get_vocab_size()

    def __getattr__(self, name: str):  # anything else torchtitan may read: from the real tokenizer
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._hf(), name)


def _grad_norm(model_parts) -> float:
    """Total norm of the gradients left by the failed step (a collective: every rank calls it)."""
    grads = [p.grad for m in model_parts for p in m.parameters() if p.grad is not None]
    if not grads:
        return float("nan")
    norm = torch.nn.utils.get_total_norm(grads)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


class _NonFiniteGradNorm(Exception):
    """Raised by WorkbenchMetrics.log on every rank (the norm is global); WorkbenchTrainer.train_step reports it."""

    def __init__(self, loss: float, grad_norm: float):
        super().__init__(f"grad norm {grad_norm}")
        self.loss, self.grad_norm = loss, grad_norm


class WorkbenchMetrics(MetricsProcessor):
    """torchtitan's metrics processor plus metrics.jsonl and a one-line progress report."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        jsonl_path: str = ""
        backend: str = ""
        total_steps: int = 0
        peak_flops: float = 0.0
        """Peak FLOP/s of one device in the training dtype (replaces torchtitan's table lookup)."""

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        if config.peak_flops > 0:
            self.gpu_peak_flops = config.peak_flops
        self.history: list[dict[str, Any]] = []

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None):
        cfg = self.config
        if not math.isfinite(grad_norm):  # torchtitan checks the loss only; a non-finite norm poisons the weights
            raise _NonFiniteGradNorm(global_avg_loss, grad_norm)
        time_delta = time.perf_counter() - self.time_last_log
        steps_in_window = max(len(self.data_loading_times), 1)  # one data fetch per micro-batch
        # tokens per second per device (torchtitan's definition)
        tps = self.ntokens_since_last_log / (time_delta * self.parallel_dims.non_data_parallel_size)
        mfu = self.num_flops_per_token * tps / self.gpu_peak_flops
        mem = self.device_memory_monitor.get_peak_stats()
        record = {
            "step": step,
            "loss": global_avg_loss,
            "max_loss": global_max_loss,
            "grad_norm": grad_norm,
            "tokens_per_second": tps,
            "mfu": mfu,
            "tflops": self.num_flops_per_token * tps / 1e12,
            "step_time_s": time_delta / max(step - getattr(self, "_last_step", step - 1), 1),
            "data_time_s": sum(self.data_loading_times) / steps_in_window,
            "peak_memory_bytes": int(mem.max_reserved_gib * 1024**3),
            "backend": cfg.backend,
            "time": time.time(),
            **{k: v for k, v in (extra_metrics or {}).items() if isinstance(v, (int, float))},
        }
        self._last_step = step
        self.history.append(record)
        self.logger.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step)
        if _rank() == 0:
            if cfg.jsonl_path:
                with open_for_append(cfg.jsonl_path) as f:  # never through a link planted in the run folder
                    f.write(json.dumps(record) + "\n")
            width = len(str(cfg.total_steps))
            say(
                f"step {step:>{width}}/{cfg.total_steps}  loss {global_avg_loss:8.4f}  "
                f"tok/s {tps:10,.0f}  mfu {100 * mfu:6.2f}%  mem {mem.max_reserved_gib:6.2f} GiB  "
                f"step {record['step_time_s']:.3f}s"
            )
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()


class WorkbenchTrainer(Trainer):
    """torchtitan's Trainer with the workbench's run folder, HF export and summary."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        job: JobConfig = field(default_factory=JobConfig)
        """The validated workbench config (its shape resolved: `job.shape`)."""

    def __init__(self, config: Config, stop: StopRequest | None = None,
                 launch_check: Callable[[WorkbenchTrainer], None] | None = None):
        """`launch_check(trainer)`: runs once before the first step of this launch (the launcher hands in the memory
        plan's `workbench.memory.measure.check_on_launch`); None: nothing."""
        self.job = config.job
        self.stop = stop
        self.launch_check = launch_check
        self.run_lock: RunLock | None = None
        self._t0 = time.perf_counter()
        try:
            super().__init__(config)
        except BaseException:
            if self.run_lock:
                self.run_lock.release()
            raise
        self.init_seconds = time.perf_counter() - self._t0
        self._start_step: int | None = None  # last step before this launch (0 = fresh), set by _on_first_step
        self._first_step_at: float | None = None
        self._setup_performance_accounting()

    # ---- The run folder: one launch at a time -------------------------------------------------------------------

    def init_distributed(self):
        """torchtitan's process group, then the run folder's lock (before anything is built or written)."""
        parallel_dims = super().init_distributed()
        # The stop flag travels over gloo (a CPU int): no device sync added to the step on cuda/neuron.
        self._cpu_group = None if "gloo" in str(torch.distributed.get_backend()) else \
            torch.distributed.new_group(backend="gloo")
        self._take_run_folder()
        return parallel_dims

    def _take_run_folder(self) -> None:
        """Rank 0 locks the run folder and writes config.toml / shape.json; every rank gets the same outcome."""
        from workbench.core import flavors

        run_dir = Path(self.config.dump_folder)
        outcome: Any = None
        if _rank() == 0:
            try:
                self.run_lock = RunLock(run_dir)
                outcome = self.run_lock.acquire()
                write_atomic(run_dir / "config.toml", self.job.to_toml())
                # The architecture itself, so the run folder stays self-describing even if hf_checkpoint moves.
                write_atomic(run_dir / "shape.json", json.dumps(flavors.describe(self.job.shape), indent=2))
            except RunError as e:
                outcome = e
            except OSError as e:
                outcome = RunFolderError(f"cannot write the run folder {run_dir}: {e.strerror} ({e.filename}).",
                                         "point --job.dump_folder at a writable folder.")
        outcome = broadcast(outcome)
        if isinstance(outcome, RunError):
            raise outcome
        if outcome:
            say(f"workbench: warning: took over the lock of {run_dir} from a launch that is gone "
                f"({describe_holder(outcome)}): killed or crashed; resuming as usual.")

    def should_continue_training(self) -> bool:
        """torchtitan's loop condition, plus the stop request of any rank (checked together after every step)."""
        if not super().should_continue_training():
            return False
        if self.stop is not None and self._any_rank_stopping():
            raise self._stop_and_save()
        return True

    def _any_rank_stopping(self) -> bool:
        flag = torch.tensor([int(self.stop.requested)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._cpu_group)
        return bool(flag.item())

    def _stop_and_save(self) -> StoppedError:
        """Saves the step just finished (unless it is saved already) and says how to resume."""
        ckpt = self.checkpointer
        fresh = self._start_step is None or self.step == self._start_step  # nothing trained by this launch
        if not ckpt.enable:
            what = "checkpointing is off (checkpoint.enable false): nothing was saved"
            fix = "relaunch the same command to train again from step 1 (enable checkpoints to resume)."
        elif self.step == 0:
            what = "no step had run: nothing to save"
            fix = "relaunch the same command."
        else:
            if not fresh and self.step % ckpt.interval:
                ckpt.save(self.step, last_step=True)  # last_step: saves whatever the interval
            what = f"checkpoint step {self.step} is saved in {ckpt._create_checkpoint_id(self.step)}"
            fix = f"relaunch the same command: it continues after step {self.step}."
        return StoppedError(f"{self.stop.name} after step {self.step}: {what}.", fix)

    # ---- Performance accounting: MFU from the model shape, profiler step window, phase labels -------------------
    # torchtitan's own seams: `train_step` (wrapped, not copied) and `_forward_backward_body` (torchtitan 0.3.0's body
    # verbatim plus record_function labels). Everything else lives in workbench/run/profiling.py.

    def _setup_performance_accounting(self) -> None:
        # The same formula for every backend (torchtitan's count depends on the module tree a backend builds).
        self.metrics_processor.num_flops_per_token = profiling.flops_per_token(self.job.shape,
                                                                               self.config.training.seq_len)
        self.step_profiler = profiling.StepProfiler(self.job.profiling, self.config.dump_folder, self.device.type,
                                                    last_step=self.config.training.steps, rank=_rank())
        profiling.label_calls(self.optimizers, "step", "optimizer")

    def train_step(self, data_iterator):
        if self._start_step is None:
            self._on_first_step()
        with self.step_profiler.step(self.step):
            try:
                super().train_step(profiling.Labelled(data_iterator, "data"))
            except _NonFiniteGradNorm as e:
                raise self._non_finite(e.loss, e.grad_norm) from None
            except RuntimeError as e:
                # torchtitan raises this before logging (and before the step's checkpoint save); the loss is
                # all-reduced, so every rank gets here together.
                if not str(e).startswith("Loss is not finite"):
                    raise
                loss = float(str(e).split("global_avg_loss=")[1].split(")")[0])
                raise self._non_finite(loss, _grad_norm(self.model_parts)) from None
        if self._first_step_at is None:
            self._first_step_at = time.perf_counter()

    def _non_finite(self, loss: float, grad_norm: float) -> NonFiniteError:
        """The one-line report of a diverged run: where, what is kept, what to try."""
        kept = newest_complete(self.checkpointer.folder) if self.checkpointer.enable else None
        kept_s = (f"the last checkpoint kept is {self.checkpointer.folder}/step-{kept}" if kept is not None
                  else "no checkpoint was kept")
        return NonFiniteError(
            f"step {self.step}: loss {loss:.6g}, grad norm {grad_norm:.6g}; training stopped and nothing of this "
            f"state was saved; {kept_s}.",
            f"lower --optimizer.lr (now {self.job.optimizer.lr:g}), lengthen --lr_scheduler.warmup_steps or "
            "lower --training.max_norm, then relaunch (it resumes from the last checkpoint kept).",
        )

    def _on_first_step(self) -> None:
        """Runs once, after torchtitan's resume (if any) and before the first step of this launch."""
        if self.launch_check is not None:  # measured peak per rank vs the memory plan after steps 1 and 2
            self.launch_check(self)
        self._start_step = self.step - 1  # the loop increments step before calling train_step; 0 = fresh run
        # torchtitan starts the first step's clock when it builds the metrics processor; restart it so step 1
        # measures the step (with warm-up/compile), not init and checkpoint loading.
        self.metrics_processor.time_last_log = time.perf_counter()
        jsonl = Path(self.metrics_processor.config.jsonl_path)
        if _rank() == 0 and self._start_step == 0 and jsonl.is_file():
            jsonl.unlink()  # a fresh (not resumed) run in a reused folder starts a new curve
        elif _rank() == 0:
            trim_metrics(jsonl.parent, self._start_step)  # steps logged after the checkpoint are redone now

    def _forward_backward_body(self, inputs: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor,
                               extra_kwargs: dict[str, Any]) -> torch.Tensor:
        with self.train_context():
            with record_function("forward"):
                pred = self.model_parts[0](inputs, **extra_kwargs)
                loss_kwargs = {}
                if "positions" in extra_kwargs:
                    loss_kwargs["positions"] = extra_kwargs["positions"]
                loss, _ = self.loss_fn(pred, labels, global_valid_tokens, **loss_kwargs)
                del pred
            with record_function("backward"), spmd.no_typecheck():
                loss.backward()
        return loss  # local SUM loss / global_valid_tokens, as torchtitan returns it

    # ---- end of performance accounting ----------------------------------------------------------------------------

    def close(self) -> None:
        super().close()
        if self.run_lock:
            self.run_lock.release()

    def train(self):
        run_dir = Path(self.config.dump_folder)
        t_start = time.perf_counter()
        if self.job.model.hf_checkpoint:
            # Published weights first; if the run folder holds a DCP checkpoint, torchtitan's resume (inside
            # super().train()) then overwrites them with the newer state, optimizer included.
            from workbench.backends import hf

            hf.load_into_trainer(self, self.job.model.hf_checkpoint)
        super().train()
        if self.job.checkpoint.export_hf:
            from workbench.backends import hf

            out = hf.export_trainer(self, run_dir / "hf")
            say(f"exported Hugging Face weights to {out}")
        hist = self.metrics_processor.history
        if hist and _rank() == 0:
            losses = [h["loss"] for h in hist]
            tps = sorted(h["tokens_per_second"] for h in hist[1:] or hist)
            summary = {
                "backend": self.job.model.backend,
                "flavor": self.config.model_spec.flavor,
                "steps": self.step,
                "resumed_from": self._start_step or 0,
                "first_loss": losses[0],
                "last_loss": losses[-1],
                "median_tokens_per_second": tps[len(tps) // 2],
                "init_seconds": self.init_seconds,
                "time_to_first_step_s": (self._first_step_at - t_start) if self._first_step_at else None,
                "train_seconds": time.perf_counter() - t_start,
                "run_dir": str(run_dir),
            }
            write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
            say(
                f"done: {summary['backend']} {summary['flavor']} steps {summary['resumed_from'] + 1}-{self.step}  "
                f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}  "
                f"median tok/s {summary['median_tokens_per_second']:,.0f}  run folder {run_dir}"
            )


def build_titan_config(job: JobConfig, device_kind: str, world_size: int = 1) -> WorkbenchTrainer.Config:
    """Translates the workbench config into torchtitan's Trainer.Config (with the backend's ModelSpec)."""
    from workbench import backends

    run_dir = job.run_dir
    dtype = resolved_dtype(job, device_kind)
    par = job.parallelism
    dp = world_size // par.tp  # data-parallel ranks (tensor-parallel ranks share a batch)
    spec = backends.model_spec(job)
    opt = job.optimizer
    ac = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[job.training.activation_checkpoint]
    init_timeout_s, step_timeout_s = neuron_adjustments.comm_timeouts(job.neuron, device_kind)
    tcfg = WorkbenchTrainer.Config(
        model_spec=spec,
        hf_assets_path=str(data.tokenizer_dir(job.model.tokenizer_path)),
        tokenizer=LazyTokenizer.Config(),
        dump_folder=str(run_dir),
        job=job,
        metrics=WorkbenchMetrics.Config(
            log_freq=job.metrics.log_freq, enable_tensorboard=job.metrics.enable_tensorboard,
            disable_color_printing=True, jsonl_path=str(run_dir / "metrics.jsonl"), backend=job.model.backend,
            total_steps=job.training.steps, peak_flops=profiling.peak_flops(device_kind, dtype),
        ),
        dataloader=PackedTextDataLoader.Config(
            dataset=job.training.dataset, text_field=job.training.dataset_text_field,
            tokenizer_path=job.model.tokenizer_path, seed=job.job.seed, holdout_docs=job.training.holdout_docs,
        ),
        optimizer=OptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=r".*", optimizer_name=opt.name,
            optimizer_kwargs={"lr": opt.lr, "betas": (opt.beta1, opt.beta2), "eps": opt.eps,
                              "weight_decay": opt.weight_decay},
        )]),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=job.lr_scheduler.warmup_steps,
            decay_ratio=None if job.lr_scheduler.decay_ratio < 0 else job.lr_scheduler.decay_ratio,
            decay_type=job.lr_scheduler.decay_type, min_lr_factor=job.lr_scheduler.min_lr_factor,
            total_steps=job.lr_scheduler.total_steps if job.lr_scheduler.total_steps > 0 else None,
        ),
        training=TrainingConfig(
            local_batch_size=job.training.local_batch_size,
            global_batch_size=(job.training.global_batch_size if job.training.global_batch_size > 0 else
                               job.training.local_batch_size * dp * job.training.gradient_accumulation_steps),
            seq_len=job.training.seq_len, max_norm=job.training.max_norm, steps=job.training.steps,
            dtype="float32", mixed_precision_param=dtype,
            disable_cuda_graphs=True,
        ),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=par.dp_shard, data_parallel_replicate_degree=par.dp_replicate,
            tensor_parallel_degree=par.tp, expert_parallel_degree=par.ep,
        ),
        checkpoint=WorkbenchCheckpointManager.Config(
            enable=job.checkpoint.enable, folder=job.checkpoint.folder, interval=job.checkpoint.interval,
            keep_latest_k=job.checkpoint.keep_latest_k, load_step=job.checkpoint.load_step,
            last_save_model_only=False, export_dtype=job.checkpoint.export_dtype,
            on_corrupt=job.checkpoint.on_corrupt, refuse_low_disk=job.checkpoint.refuse_low_disk,
            total_steps=job.training.steps,
        ),
        activation_checkpoint=ac,
        compile=CompileConfig(enable=job.training.compile,
                              backend="neuron" if device_kind == "neuron" else "inductor"),
        profiler=Profiler.Config(enable_profiling=False),
        comm=CommConfig(init_timeout_seconds=init_timeout_s, train_timeout_seconds=step_timeout_s),
        debug=DebugConfig(seed=job.job.seed, enable_structured_logging=False),
        # Tensor parallelism shards the vocabulary dimension of the logits: the loss needs the global size.
        loss=loss_config(job.training.loss_chunks, job.shape.vocab_size if par.tp > 1 else None),
    )
    return tcfg


def loss_config(chunks: int, global_vocab_size: int | None = None):
    """Plain cross-entropy, or torchtitan's ChunkedLossWrapper around it when `chunks` > 0.

    Chunked: the model returns hidden states (`_skip_lm_head`, set by torchtitan's Trainer; huggingface_v5's
    HFQwen3 honours it too) and lm_head + CE run per sequence chunk with a backward per chunk, so only one
    chunk's fp32 logits are alive at a time. The sum over chunks is the same loss, the same gradients.
    """
    ce = CrossEntropyLoss.Config(global_vocab_size=global_vocab_size)
    return ChunkedLossWrapper.Config(num_chunks=chunks, loss_fn=ce) if chunks > 0 else ce


# torchtitan warnings that are expected with the workbench's setup (we supply the peak FLOPs ourselves,
# export without an index template, load HF weights ourselves): hidden unless job.verbose.
_EXPECTED_TITAN_WARNINGS = ("lspci", "Peak flops undefined", "initial_load_model_only", "model.safetensors.index.json")
_EXPECTED_PY_WARNINGS = ("DTensor random operators", "'set_vital' is deprecated",
                         "torch.distributed is already initialized")


def quiet_titan_logs(verbose: bool) -> None:
    """torchtitan logs INFO on every rank; keep warnings only (INFO on rank 0 when verbose)."""
    import warnings

    from torchtitan.tools.logging import init_logger

    init_logger()
    level = logging.INFO if (verbose and _rank() == 0) else logging.WARNING
    titan_logger.setLevel(level)
    for h in titan_logger.handlers:
        h.setLevel(level)
    if not verbose:
        titan_logger.addFilter(lambda r: not any(s in r.getMessage() for s in _EXPECTED_TITAN_WARNINGS))
        for msg in _EXPECTED_PY_WARNINGS:
            warnings.filterwarnings("ignore", message=f".*{msg}")


__all__ = ["WorkbenchTrainer", "WorkbenchMetrics", "build_titan_config", "loss_config", "quiet_titan_logs"]
