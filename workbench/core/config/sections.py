"""The config's sections: one dataclass per TOML `[section]`, each with its own `check`, and `JobConfig`, all of them.

Each field's docstring is its one-line documentation (shown by `--help`). A section's `check(job, world_size)` holds
the rules of its own fields, through the value checks at the top (a range, a count, one folder name); the rules that
join sections are `rules.py`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from workbench.core.errors import ConfigError, FlavorError

if TYPE_CHECKING:
    from workbench.core.flavors import Qwen3Shape

BackendName = Literal["huggingface_v5", "native", "nki_moe"]
BACKENDS: tuple[str, ...] = typing.get_args(BackendName)  # the one list of training paths (modules: workbench.backends)
DEFAULT_BACKEND = "native"
"""torchtitan's own Qwen3: the default path, and the baseline the others are measured against."""

PATH_MAX, NAME_MAX = 4096, 255
"""Linux's limits on a path and on one name in it."""


def check_range(key: str, value: float, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False, special: str = "") -> None:
    """Refuses a value outside its range (NaN and infinities included) with one line naming the field, the value
    and the valid range.

    Args:
        key: "section.field".
        value: the value.
        low, high: the bounds (None: unbounded on that side).
        low_open, high_open: exclude the bound itself.
        special: what an out-of-range special value means, e.g. "or -1 = all ranks" (shown with the range).
    """
    name = key.rsplit(".", 1)[-1]
    ok = math.isfinite(value) and (low is None or (value > low if low_open else value >= low)) and \
        (high is None or (value < high if high_open else value <= high))
    if not ok:
        def show(bound: float) -> str:
            return f"{bound:g}" if isinstance(bound, float) else str(bound)

        lo = "" if low is None else f"{show(low)} {'<' if low_open else '<='} "
        hi = "" if high is None else f" {'<' if high_open else '<='} {show(high)}"
        also = f" {special}" if special else ""
        raise ConfigError(f"{key}={value!r} is out of range: valid is {lo}{name}{hi}{also}.")


COUNT_MAX = 10**9
"""The largest count a config takes (steps, intervals, frequencies, batch sizes, warm-up): a billion steps is
years of training, and anything larger (1e19) overflows the int64 counters and C++ timeouts downstream."""


def check_counts(section: str, obj: Any, lows: dict[str, int]) -> None:
    """Each field of `lows` is a count in [its low, COUNT_MAX]; -1 (the "unset" of several fields) is left to the
    field's own check."""
    for key, low in lows.items():
        value = getattr(obj, key)
        if value != -1:
            check_range(f"{section}.{key}", value, low, COUNT_MAX)


def check_folder_name(key: str, name: str, where: str = "inside the run folder", example: str = "checkpoint") -> None:
    """`name` is one folder name: not empty, no separator, not `.` or `..`, no NUL, at most NAME_MAX bytes.

    Raises:
        ConfigError: naming the key, the value and why (an empty experiment_name makes the dump folder itself the
            run folder; `..` or a path puts it elsewhere).
    """
    bad = (not name.strip() and "is empty") or (name in (".", "..") and "names a parent or the same folder") or \
        (("/" in name or os.sep in name) and "holds a path separator") or ("\0" in name and "holds a NUL byte") or \
        (len(name.encode()) > NAME_MAX and f"is over {NAME_MAX} bytes")
    if bad:
        raise ConfigError(f"{key}={name[:60]!r} {bad}: it must be one folder name, {where}; anything else would "
                          "write elsewhere.", f"give a plain name, e.g. --{key} {example}.")


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Root folder; the run folder is <dump_folder>/<experiment_name>/."""
    experiment_name: str = "qwen3_run"
    """Name of the run folder under dump_folder."""
    device: Literal["auto", "cpu", "cuda", "neuron"] = "auto"
    """Accelerator: auto picks neuron (torch_neuronx importable) > cuda > cpu."""
    seed: int = 42
    """Seed for model init and data order (identical runs give identical losses)."""
    verbose: bool = False
    """Show torchtitan's own INFO logs (otherwise only the workbench's progress lines)."""
    config_file: str = ""
    """The TOML this config was read from (set by --job.config_file)."""
    memory_check: bool = True
    """cuda/neuron: plan per-rank memory before launch (`python -m workbench.plan`) and exit 2 if it will not fit."""
    memory_measure: Literal["auto", "always", "never"] = "auto"
    """After steps 1 and 2, each rank's measured peak vs the memory plan (<run>/memory_check.json + a progress line).
    auto: on cuda/neuron when memory_check plans the launch; always: also on CPU (plans first); never."""

    def check(self, job: JobConfig, world_size: int) -> None:
        check_range("job.seed", self.seed, 0, 2**63 - 1)  # torch.manual_seed's range, as a TOML (int64) writes it
        check_folder_name("job.experiment_name", self.experiment_name, "the run folder being "
                          "<job.dump_folder>/<job.experiment_name> (an empty one would make the dump folder the run "
                          "folder)", "my_run")


@dataclass
class Model:
    name: str = "qwen3"
    """Model family; only qwen3 (dense and MoE) is supported."""
    flavor: str = ""
    """Qwen3 flavor: 0.6B 1.7B 4B 8B 14B 32B 30B-A3B 235B-A22B, tiny / tiny-moe (CPU); empty = from hf_checkpoint."""
    n_layers: int = 0
    """Decoder layers; 0 = the flavor's. Fewer makes a shallower copy of the flavor with its real layer shapes
    (benchmarks, memory checks, debugging); not with hf_checkpoint (the checkpoint fixes its depth)."""
    backend: BackendName = DEFAULT_BACKEND
    """Training path: huggingface_v5 (transformers' modeling), native (torchtitan), nki_moe (NKI experts)."""
    norm_type: str = "RMSNorm"
    """Normalisation layer; Qwen3 uses RMSNorm (accepted for the article's config; nothing else is valid)."""
    tokenizer_path: str = ""
    """Directory with tokenizer.json; empty = the bundled real Qwen3 tokenizer."""
    hf_checkpoint: str = ""
    """Directory with config.json + *.safetensors to start from (published Qwen3 weights)."""
    attn_backend: Literal["sdpa", "flex", "varlen"] = "sdpa"
    """Attention kernel for native/nki_moe; sdpa runs everywhere (flex/varlen: CUDA and Neuron)."""
    moe_load_balance_coeff: float = 0.0
    """torchtitan's aux-loss-free expert-bias rate (its default is 1e-3); 0 = Qwen3/HF routing. The bias has no
    Hugging Face equivalent, so with > 0 an HF export routes differently from the trained model (export warns)."""
    moe_block_size: int = 128
    """nki_moe: slots per expert block; at most 128 or a multiple of 128 (the NKI kernels' blocks). The NKI
    kernels pad each expert's tokens to 32 slots, the torch reference used off Neuron to whole blocks;
    docs/nki_kernels.md has the block-size sweep."""
    hf_moe_implementation: Literal["hf", "titan"] = "hf"
    """huggingface_v5 + MoE: transformers' own MoE block (hf); "titan" (torchtitan's MoE swapped in) is reserved."""
    moe_experts_impl: Literal["grouped_mm", "batched_mm", "loop"] = "grouped_mm"
    """native / huggingface_v5 MoE experts: grouped_mm (torch._grouped_mm), or a fallback for devices without it:
    batched_mm (each expert's tokens padded to the largest group, one bmm) or loop (one matmul per expert)."""

    def check(self, job: JobConfig, world_size: int) -> None:
        """The model's own values and its shape (resolved here, once: `job.shape`); its backend's rules follow
        (`validate`: `rules.BACKEND_RULES`)."""
        from workbench.core import flavors

        if self.name.lower() != "qwen3":
            raise ConfigError(f"model.name={self.name!r}: the workbench trains Qwen3 only (model.name = \"qwen3\").")
        if self.norm_type != "RMSNorm":
            raise ConfigError(
                f"model.norm_type={self.norm_type!r}: Qwen3 uses RMSNorm; set model.norm_type = \"RMSNorm\".")
        if not self.flavor and not self.hf_checkpoint:
            raise ConfigError(
                f"model.flavor is not set. Choose one of {', '.join(flavors.FLAVORS)}, or set model.hf_checkpoint "
                "to infer it from the checkpoint's config.json."
            )
        if self.n_layers < 0 or (self.n_layers and self.hf_checkpoint):
            raise ConfigError(f"model.n_layers={self.n_layers}: give a positive number of decoder layers (0 = the "
                              "flavor's), and none with model.hf_checkpoint, whose config.json fixes the depth.")
        # Before the shape is resolved: an absurd depth would make every estimate (the memory plan's) build it.
        check_range("model.n_layers", self.n_layers, 0, flavors.MAX_LAYERS, special="(0 = the flavor's)")
        try:
            job.shape  # noqa: B018 - resolves and caches the shape
        except FlavorError as e:
            raise ConfigError(f"model.flavor: {e}") from None
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from None
        if self.moe_block_size <= 0:
            raise ConfigError(f"model.moe_block_size must be positive; got {self.moe_block_size}.")
        check_counts("model", self, {"moe_block_size": 1})
        check_range("model.moe_load_balance_coeff", self.moe_load_balance_coeff, 0, 1)


LR_MAX = 1e4
"""The largest optimizer.lr accepted. Adam moves each weight by about lr per step, so any lr near 1 already wrecks
a model; the bound is this high because the divergence test needs a run whose fp32 values overflow within a few
steps (lr 10 only makes the loss climb, measured), and what it refuses is the absurd: 1e30, inf."""


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer class from torch.optim."""
    lr: float = 3e-4
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""

    def check(self, job: JobConfig, world_size: int) -> None:
        # also NaN; a negative lr trains uphill without any other sign, and 0 trains nothing while looking like a run
        # (a forgotten override, a typo).
        if not self.lr > 0:
            raise ConfigError(f"optimizer.lr must be positive; got {self.lr}. Set e.g. --optimizer.lr 3e-4.")
        # torchtitan passes these per parameter group, so torch's own checks in AdamW.__init__ never run.
        check_range("optimizer.lr", self.lr, 0, LR_MAX, low_open=True)
        check_range("optimizer.weight_decay", self.weight_decay, 0, 1)
        check_range("optimizer.beta1", self.beta1, 0, 1, high_open=True)
        check_range("optimizer.beta2", self.beta2, 0, 1, high_open=True)
        check_range("optimizer.eps", self.eps, 0, 1, low_open=True)


@dataclass
class LRScheduler:
    warmup_steps: int = 2
    """Linear warm-up steps."""
    decay_ratio: float = -1.0
    """Fraction of steps spent decaying at the end; -1 = decay over all post-warm-up steps."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay."""
    min_lr_factor: float = 0.0
    """Final lr as a fraction of the peak."""
    total_steps: int = -1
    """Length of the schedule; -1 = training.steps (set it to stop early on the same lr curve)."""

    def check(self, job: JobConfig, world_size: int) -> None:
        check_range("lr_scheduler.warmup_steps", self.warmup_steps, 0)
        check_counts("lr_scheduler", self, {"warmup_steps": 0, "total_steps": 1})
        if self.decay_ratio != -1:
            check_range("lr_scheduler.decay_ratio", self.decay_ratio, 0, 1, special="(or -1 = decay over all post-"
                        "warm-up steps)")
        check_range("lr_scheduler.min_lr_factor", self.min_lr_factor, 0, 1)
        if self.total_steps != -1:
            check_range("lr_scheduler.total_steps", self.total_steps, 1, special="(or -1 = training.steps)")


@dataclass
class Training:
    local_batch_size: int = 4
    """Sequences per rank per micro-batch (the article's training.batch_size)."""
    seq_len: int = 2048
    """Tokens per sequence."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; -1 = local_batch_size x DP ranks x gradient_accumulation_steps."""
    steps: int = 1000
    """Optimizer steps to train for."""
    max_norm: float = 1.0
    """Gradient clipping norm."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Parameter dtype for compute: auto = float32 on CPU (bf16 is ~40x slower there), bfloat16 elsewhere."""
    compile: bool = False
    """torch.compile the model (backend 'neuron' on Trainium, inductor on CUDA)."""
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward to save memory."""
    dataset: str = "shakespeare"
    """'shakespeare' (bundled corpus), a prepared folder (python -m workbench.data prepare SRC OUT), or a raw path
    (.txt/.md files or folders, .jsonl, .parquet, a `datasets` save_to_disk folder; prepared into a cache on first
    use); a mixture is 'A:0.7,B:0.3'."""
    dataset_text_field: str = "text"
    """Column / key holding the document text in JSONL and parquet files."""
    loss_chunks: int = 0
    """lm_head + cross-entropy in this many sequence chunks (torchtitan's ChunkedLossWrapper): the full fp32
    [tokens, vocab] logits never exist at once; same loss and gradients. 0 = plain loss."""
    holdout_docs: int = 1
    """Documents at the end of the dataset's fixed order kept out of training (held-out perplexity); 0 = none."""
    document_mask: bool = False
    """Packed documents never see each other: positions restart at 0 at each document of a row (RoPE) and
    attention is block-causal, on every backend (docs/attention.md). Off: plain causal rows."""
    loss_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    """Conversations: the targets trained: every assistant turn's reply and its closing <|im_end|> (assistant), the
    last assistant turn's only (last_assistant), or every token (all). System, user and tool turns only with all."""
    train_thinking: bool = True
    """Conversations: train the <think>...</think> blocks of trained assistant turns (where the template keeps them)."""
    train_tool_calls: bool = True
    """Conversations: train the <tool_call>...</tool_call> blocks of trained assistant turns."""
    overlong: Literal["truncate", "split", "drop"] = "truncate"
    """Conversations longer than seq_len: keep the first piece cut at a turn boundary (truncate), every such piece
    (split), or none (drop). A piece without a trained token is dropped."""
    pack_window: int = 0
    """Conversations: best-fit packing over windows of this many conversations (at least 10,000); 0 = the whole set."""
    max_dropped: float = 0.05
    """Conversations: refuse the launch when more than this share of them is dropped (too long, nothing trained)."""

    def global_rows(self, dp: int) -> int:
        """Rows per optimizer step over `dp` data-parallel ranks: global_batch_size, or local x dp x accumulation."""
        return self.global_batch_size if self.global_batch_size > 0 else \
            self.local_batch_size * dp * self.gradient_accumulation_steps

    def check(self, job: JobConfig, world_size: int) -> None:
        tp = job.parallelism.tp
        for key in ("local_batch_size", "seq_len", "steps", "gradient_accumulation_steps"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"training.{key} must be positive; got {getattr(self, key)}.")
        # <= 0 would clip every gradient to nothing, or (negative) flip it: gradient ascent
        check_range("training.max_norm", self.max_norm, 0, low_open=True)
        self.check_dataset_path()
        if self.seq_len > job.shape.max_seq_len:
            raise ConfigError(
                f"training.seq_len={self.seq_len} exceeds the model's max_seq_len {job.shape.max_seq_len}.")
        if tp > 1 and self.seq_len % tp:
            raise ConfigError(f"training.seq_len={self.seq_len} must be divisible by parallelism.tp={tp}.")
        if self.holdout_docs < 0:
            raise ConfigError(f"training.holdout_docs must be >= 0; got {self.holdout_docs}.")
        if self.pack_window and self.pack_window < MIN_PACK_WINDOW:
            raise ConfigError(f"training.pack_window={self.pack_window}: 0 packs the whole set, a window needs at "
                              f"least {MIN_PACK_WINDOW} conversations (best-fit needs a wide choice).")
        check_range("training.max_dropped", self.max_dropped, 0, 1)
        if self.loss_chunks < 0 or (self.loss_chunks and self.seq_len % (self.loss_chunks * max(tp, 1))):
            raise ConfigError(f"training.loss_chunks={self.loss_chunks} must be 0 (plain loss) or divide "
                              f"training.seq_len ({self.seq_len}) per tensor-parallel rank; "
                              "e.g. --training.loss_chunks 8.")
        if self.global_batch_size != -1:
            per_pass = self.local_batch_size * (world_size // tp)
            if self.global_batch_size <= 0 or self.global_batch_size % per_pass:
                raise ConfigError(
                    f"training.global_batch_size={self.global_batch_size} must be a positive multiple of "
                    f"local_batch_size ({self.local_batch_size}) x data-parallel ranks ({world_size // tp}) = "
                    f"{per_pass}."
                )
            if self.gradient_accumulation_steps not in (1, self.global_batch_size // per_pass):
                raise ConfigError(
                    f"training.gradient_accumulation_steps={self.gradient_accumulation_steps} contradicts "
                    f"global_batch_size={self.global_batch_size} ({self.global_batch_size // per_pass} accumulation "
                    "steps); set only one of them."
                )
        check_counts("training", self, {"local_batch_size": 1, "seq_len": 1, "steps": 1, "global_batch_size": 1,
                                        "gradient_accumulation_steps": 1, "holdout_docs": 0, "loss_chunks": 0})


    def chat_options(self) -> dict:
        """The conversation packing options (`workbench.data.packing.PackSpec` fields)."""
        return {"loss_on": self.loss_on, "train_thinking": self.train_thinking,
                "train_tool_calls": self.train_tool_calls, "overlong": self.overlong, "window": self.pack_window}

    def check_dataset_path(self) -> None:
        """training.dataset as a path: not empty (never the working directory by accident), of a length the file
        system takes, readable where it exists (its existence and contents are the data path's checks)."""
        d = self.dataset
        if not d.strip():
            raise ConfigError("training.dataset is empty: set it to 'shakespeare' (the bundled corpus) or to a "
                              ".txt/.md file or folder, .jsonl or .parquet files.")
        if "\0" in d or len(d) > PATH_MAX or any(len(part) > NAME_MAX for part in Path(d).parts):
            raise ConfigError(f"training.dataset={d[:60]!r}{'...' if len(d) > 60 else ''} ({len(d)} characters) is no "
                              f"usable path: at most {PATH_MAX} characters, {NAME_MAX} per name, no NUL byte.")
        if d != "shakespeare" and os.path.lexists(d) and not os.access(d, os.R_OK):
            raise ConfigError(f"training.dataset={d!r} is not readable (permissions); fix them or pick another path.")


MIN_PACK_WINDOW = 10_000
"""Conversations per best-fit packing window, at the least (`training.pack_window`)."""
@dataclass
class Parallelism:
    dp_shard: int = -1
    """FSDP shard degree (the article's job.model_parallel_size); -1 = all ranks not used elsewhere."""
    dp_replicate: int = 1
    """HSDP replicate degree."""
    tp: int = 1
    """Tensor-parallel degree (native / nki_moe)."""
    ep: int = 1
    """Expert-parallel degree (native MoE)."""

    def check(self, job: JobConfig, world_size: int) -> None:
        if self.dp_shard != -1:
            check_range("parallelism.dp_shard", self.dp_shard, 1, special="(or -1 = all ranks not used elsewhere)")
        for key in ("dp_replicate", "tp", "ep"):
            check_range(f"parallelism.{key}", getattr(self, key), 1)
        non_dp = self.tp * self.dp_replicate
        shard = self.dp_shard if self.dp_shard != -1 else world_size // max(non_dp, 1)
        if shard <= 0 or shard * non_dp != world_size:
            raise ConfigError(
                f"Parallel degrees do not fit {world_size} rank(s): dp_shard ({self.dp_shard}, the article's "
                f"job.model_parallel_size) x dp_replicate ({self.dp_replicate}) x tp ({self.tp}) must equal the number "
                f"of ranks (torchrun --nproc_per_node x --nnodes). Set --parallelism.dp_shard -1 to use all ranks."
            )


@dataclass
class Checkpoint:
    enable: bool = False
    """Save DCP checkpoints every `interval` steps and resume from the latest on relaunch."""
    folder: str = "checkpoint"
    """Checkpoint folder inside the run folder."""
    interval: int = 500
    """Steps between checkpoints (a crash loses at most this many)."""
    keep_latest_k: int = 3
    """Keep only the newest k checkpoints (0 = keep all)."""
    load_step: int = -1
    """Resume from this step instead of the latest (-1 = latest)."""
    export_hf: bool = False
    """Write <run>/hf/ (safetensors + config.json + tokenizer) at the end of training."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """dtype of the exported safetensors."""
    on_corrupt: Literal["fallback", "error"] = "fallback"
    """Newest checkpoint unusable on resume (a file missing, truncated or not matching its checksum): warn and resume
    from the newest verified one (fallback), or stop with exit code 4 (error)."""
    refuse_low_disk: bool = False
    """Stop (exit 4) instead of warning when the checkpoint folder lacks room for keep_latest_k checkpoints."""

    def check(self, job: JobConfig, world_size: int) -> None:
        if self.interval <= 0:
            raise ConfigError(f"checkpoint.interval must be positive; got {self.interval}.")
        if self.keep_latest_k == 1 or self.keep_latest_k < 0:
            raise ConfigError(f"checkpoint.keep_latest_k={self.keep_latest_k}: keep 0 (all) or at least 2, so that "
                              "the last complete checkpoint survives while the next one is written.")
        if self.load_step != -1:
            check_range("checkpoint.load_step", self.load_step, 0, special="(or -1 = the newest verified)")
        check_counts("checkpoint", self, {"interval": 1, "keep_latest_k": 0, "load_step": 0})
        check_folder_name("checkpoint.folder", self.folder)
        folder = job.run_dir / self.folder
        if self.enable and folder.exists() and not folder.is_dir():
            raise ConfigError(f"checkpoint.folder {folder} is a file, not a folder: move it away or set "
                              "--checkpoint.folder to another name.")


@dataclass
class Profiling:
    enable: bool = False
    """Record a torch.profiler trace."""
    start_step: int = 3
    """First profiled step (after warm-up)."""
    steps: int = 2
    """Number of profiled steps."""
    folder: str = "profiling"
    """Trace folder inside the run folder."""

    def check(self, job: JobConfig, world_size: int) -> None:
        steps = job.training.steps
        check_counts("profiling", self, {"start_step": 0, "steps": 0})
        check_folder_name("profiling.folder", self.folder, example="profiling")
        if self.enable and (self.steps <= 0 or not 1 <= self.start_step <= steps):
            raise ConfigError(
                f"profiling: start_step={self.start_step}, steps={self.steps} must profile at least one "
                f"of the run's steps 1..{steps} (start_step within them, steps positive)."
            )


@dataclass
class Neuron:
    """Adjustments for the TorchNeuron `neuron` device (`workbench/platform/neuron_adjustments.py`); each can be
    switched off."""

    apply: Literal["auto", "always", "never"] = "auto"
    """auto: on the neuron device only; always: also on cpu/cuda (offline check of this code path); never."""
    process_group: str = "neuron"
    """torch.distributed backend the run uses when the adjustments apply (TorchNeuron registers "neuron")."""
    force_sum_reduction: bool = True
    """FSDP2 reduce-scatter with ReduceOp.SUM instead of PREMUL_SUM (not documented for the neuron backend)."""
    sdpa_overrideable: bool = True
    """Let torchtitan's SDPA use the OVERRIDEABLE backend (how PrivateUse1 devices register attention kernels)."""
    init_timeout_s: int = 3600
    """Collective timeout for start-up and the first step (neuronx-cc compiles the graphs then)."""
    step_timeout_s: int = 900
    """Collective timeout after the first step."""
    sync_memory_stats: bool = True
    """Synchronize the device before reading peak-memory statistics (asynchronous execution)."""

    def check(self, job: JobConfig, world_size: int) -> None:
        for key in ("init_timeout_s", "step_timeout_s"):  # a timedelta in the process group's C++: a week at most
            check_range(f"neuron.{key}", getattr(self, key), 1, TIMEOUT_MAX_S)
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_:]{0,63}", self.process_group):
            raise ConfigError(f"neuron.process_group={self.process_group[:60]!r} is no torch.distributed backend "
                              "name: set it to \"neuron\" (TorchNeuron's), or \"gloo\" / \"nccl\".")


TIMEOUT_MAX_S = 7 * 24 * 3600
"""The longest collective timeout accepted (neuron.init_timeout_s, step_timeout_s): a week."""


@dataclass
class Metrics:
    log_freq: int = 1
    """Log (and append to metrics.jsonl) every this many steps."""
    enable_tensorboard: bool = False
    """Also write TensorBoard scalars."""

    def check(self, job: JobConfig, world_size: int) -> None:
        if self.log_freq <= 0:
            raise ConfigError(f"metrics.log_freq must be positive; got {self.log_freq}.")
        check_counts("metrics", self, {"log_freq": 1})


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    profiling: Profiling = field(default_factory=Profiling)
    metrics: Metrics = field(default_factory=Metrics)
    neuron: Neuron = field(default_factory=Neuron)

    @property
    def shape(self) -> Qwen3Shape:
        """The model's architecture, resolved from model.flavor / model.hf_checkpoint once (when the config is
        validated) and carried with the config; resolved again only if either field changes."""
        return self._resolved()[1]

    @property
    def flavor_name(self) -> str:
        """model.flavor, or the flavor the checkpoint's config.json matches ("custom" when none does)."""
        return self._resolved()[0]

    def _resolved(self) -> tuple[str, Qwen3Shape]:
        from workbench.core import flavors

        key = (self.model.flavor, self.model.hf_checkpoint, self.model.n_layers)
        cached = self.__dict__.get("_shape_cache")  # not a dataclass field: never in to_dict / config.toml
        if cached is None or cached[0] != key:
            name, shape = flavors.resolve(*key[:2])
            if self.model.n_layers:  # a shallower (or deeper) copy: not the published model any more
                name = f"{name}-{self.model.n_layers}L"
                shape = dataclasses.replace(shape, n_layers=self.model.n_layers, official_params=0.0)
            cached = self.__dict__["_shape_cache"] = (key, (name, shape))
        return cached[1]

    @property
    def run_dir(self) -> Path:
        """<job.dump_folder>/<job.experiment_name>/"""
        return Path(self.job.dump_folder) / self.job.experiment_name

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(self.to_dict())


# The article's field names -> canonical (section, key).
ALIASES: dict[str, str] = {
    "job.model_parallel_size": "parallelism.dp_shard",
    "job.enable_checkpoint": "checkpoint.enable",
    "job.checkpoint_folder": "checkpoint.folder",
    "training.batch_size": "training.local_batch_size",
    "parallelism.data_parallel_shard_degree": "parallelism.dp_shard",
    "parallelism.data_parallel_replicate_degree": "parallelism.dp_replicate",
    "parallelism.tensor_parallel_degree": "parallelism.tp",
    "parallelism.expert_parallel_degree": "parallelism.ep",
}


SECTIONS: dict[str, type] = {
    "job": Job, "model": Model, "optimizer": Optimizer, "lr_scheduler": LRScheduler, "training": Training,
    "parallelism": Parallelism, "checkpoint": Checkpoint, "profiling": Profiling, "metrics": Metrics,
    "neuron": Neuron,
}
