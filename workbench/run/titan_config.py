"""The workbench config as torchtitan's: `build_titan_config(job, device_kind, world_size)` translates a validated
`JobConfig` into `WorkbenchTrainer.Config`: torchtitan's `Trainer.Config` (with the backend's `ModelSpec`) plus the
run's own record (`RunRecord`: what the trainer needs beyond torchtitan's config).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer
from torchtitan.config import CommConfig, CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.tools.profiler import Profiler

from workbench import data
from workbench.core.config import JobConfig, resolved_dtype
from workbench.data.loader import OpenedMembers, PackedTextDataLoader
from workbench.platform import neuron_adjustments
from workbench.run import profiling
from workbench.run.checkpoint import WorkbenchCheckpointManager
from workbench.run.metrics import WorkbenchMetrics
from workbench.run.record import RunRecord
from workbench.run.trainer import WorkbenchTrainer


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


def build_titan_config(job: JobConfig, device_kind: str, world_size: int = 1, *, memory_plan: dict | None = None,
                       opened: OpenedMembers | None = None) -> WorkbenchTrainer.Config:
    """Translates the validated workbench config into torchtitan's Trainer.Config (with the backend's ModelSpec) and
    the run's record (`RunRecord.of`).

    Args:
        memory_plan: the launch preflight's memory plan (rank 0), for the in-run measurement.
        opened: the dataset's members the launch's input check opened (the loader reads them; None: it opens them).
    """
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
        run=RunRecord.of(job, device_kind, memory_plan),
        metrics=WorkbenchMetrics.Config(
            log_freq=job.metrics.log_freq, enable_tensorboard=job.metrics.enable_tensorboard,
            disable_color_printing=True, jsonl_path=str(run_dir / "metrics.jsonl"), backend=job.model.backend,
            total_steps=job.training.steps, peak_flops=profiling.peak_flops(device_kind, dtype),
        ),
        dataloader=PackedTextDataLoader.Config(
            dataset=job.training.dataset, text_field=job.training.dataset_text_field,
            tokenizer_path=job.model.tokenizer_path, seed=job.job.seed, holdout_docs=job.training.holdout_docs,
            document_mask=job.training.document_mask,
            chat=job.training.chat_options(), opened=opened,
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
            global_batch_size=job.training.global_rows(dp),
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
    if device_kind == "cpu":
        tcfg.comm.trace_buf_size = 0  # NCCL flight recorder: nothing to record on gloo
    return tcfg


def loss_config(chunks: int, global_vocab_size: int | None = None):
    """Plain cross-entropy, or torchtitan's ChunkedLossWrapper around it when `chunks` > 0.

    Chunked: the model returns hidden states (`_skip_lm_head`, set by torchtitan's Trainer; huggingface_v5's
    HFQwen3 honours it too) and lm_head + CE run per sequence chunk with a backward per chunk, so only one
    chunk's fp32 logits are alive at a time. The sum over chunks is the same loss, the same gradients.
    """
    ce = CrossEntropyLoss.Config(global_vocab_size=global_vocab_size)
    return ChunkedLossWrapper.Config(num_chunks=chunks, loss_fn=ce) if chunks > 0 else ce


__all__ = ["LazyTokenizer", "build_titan_config", "loss_config"]
