"""torchtitan's Trainer, extended through its seams for the workbench's run folder and progress output.

`WorkbenchTrainer` reads torchtitan's `Trainer.Config` plus the run's record (`config.run`: `RunRecord`, what the
workbench needs beyond torchtitan's config; both made by `workbench.run.titan_config.build_titan_config`), and
adds, without touching torchtitan's loop:
  * the run folder contract: one launch at a time (`run_folder.RunLock`, taken right after the process group
    starts), `config.toml` (resolved config), `metrics.jsonl` (one object per logged step, never a step twice),
    `checkpoint/` (DCP, torchtitan's checkpointer), `hf/` (export at the end when asked);
  * a clean stop on SIGTERM / SIGINT (`dist_utils.StopRequest`): every rank finishes the step, they save it
    together and exit 5 with one line;
  * a readable progress line per logged step on rank 0 and a summary at the end; other ranks stay quiet;
  * an MFU against a peak that means something on the device (`workbench.run.profiling.peak_flops`) and model FLOPs
    from the shape (`workbench.run.profiling.flops_per_token`), the same for every backend;
  * torch.profiler traces of the `[profiling]` steps with phase labels (`workbench.run.profiling.StepProfiler`);
  * the first launch's memory check: each rank's peak after steps 1 and 2 against the memory plan
    (`workbench.run.peak_memory`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import spmd_types as spmd
import torch
from torch.profiler import record_function
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger as titan_logger
from torchtitan.trainer import Trainer

from workbench.core.errors import ConfigError, NonFiniteError, RunError, RunFolderError, StoppedError, WorkbenchError
from workbench.core.files import write_atomic
from workbench.platform.dist_utils import StopRequest, broadcast, say
from workbench.platform.dist_utils import rank as _rank
from workbench.run import peak_memory, profiling
from workbench.run.checkpoint import newest_complete, read_train_state
from workbench.run.metrics import MemberTally, NonFiniteGradNorm, trim_metrics
from workbench.run.record import RunRecord
from workbench.run.run_folder import RunLock, describe_holder


def _grad_norm(model_parts) -> float:
    """Total norm of the gradients left by the failed step (a collective: every rank calls it)."""
    grads = [p.grad for m in model_parts for p in m.parameters() if p.grad is not None]
    if not grads:
        return float("nan")
    norm = torch.nn.utils.get_total_norm(grads)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


class WorkbenchTrainer(Trainer):
    """torchtitan's Trainer with the workbench's run folder, HF export and summary."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        run: RunRecord = field(default_factory=RunRecord)
        """What the workbench needs beyond torchtitan's config (`RunRecord.of` the validated config)."""

    def __init__(self, config: Config, stop: StopRequest | None = None):
        self.run = config.run
        self.stop = stop
        self.run_lock: RunLock | None = None
        self._tokens_base = self._tokens_start = 0  # see load_state_dict
        self._t0 = time.perf_counter()
        try:
            super().__init__(config)
        except BaseException:
            if self.run_lock:
                self.run_lock.release()
            raise
        names = self.dataloader.packed.names
        self.member_tally = MemberTally(names, self.device) if len(names) > 1 else None
        if self.member_tally:
            self.metrics_processor.extra_source = self._member_metrics
        self.checkpointer.train_state = {  # train_state.json of every save: what a resume keeps
            "global_batch_size": self.config.training.local_batch_size * self.dp_ranks
            * self.gradient_accumulation_steps, "local_batch_size": self.config.training.local_batch_size,
            "data_parallel_ranks": self.dp_ranks, "gradient_accumulation_steps": self.gradient_accumulation_steps}
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
        self.dp_ranks = parallel_dims.dp_replicate * parallel_dims.dp_shard  # torchtitan's batch degree
        self._take_run_folder()
        return parallel_dims

    def _take_run_folder(self) -> None:
        """Rank 0 locks the run folder, decides the global batch of a resume (`resume_batch`) and writes config.toml /
        shape.json; every rank gets the same outcome."""
        from workbench.core import flavors

        run_dir = Path(self.config.dump_folder)
        outcome: Any = None
        batch: tuple[int, str] | None = None
        if _rank() == 0:
            try:
                self.run_lock = RunLock(run_dir)
                outcome = self.run_lock.acquire()
                batch = self._resume_batch(run_dir)
                write_atomic(run_dir / "config.toml", self.run.config_toml())
                # The architecture itself, so the run folder stays self-describing even if hf_checkpoint moves.
                write_atomic(run_dir / "shape.json", json.dumps(flavors.describe(self.run.shape), indent=2))
            except (RunError, ConfigError) as e:
                outcome = e
            except OSError as e:
                outcome = RunFolderError(f"cannot write the run folder {run_dir}: {e.strerror} ({e.filename}).",
                                         "point --job.dump_folder at a writable folder.")
        outcome, batch = broadcast((outcome, batch))
        if isinstance(outcome, WorkbenchError):
            raise outcome
        if outcome:
            say(f"workbench: warning: took over the lock of {run_dir} from a launch that is gone "
                f"({describe_holder(outcome)}): killed or crashed; resuming as usual.")
        if batch:
            self._set_global_batch(batch[0])
            say(batch[1])

    def _resume_batch(self, run_dir: Path) -> tuple[int, str] | None:
        """(global batch, the line saying so) when the checkpoint to resume from trained with another global batch than
        this launch's config gives; None otherwise (applied here on rank 0, before config.toml is written)."""
        ckpt = self.config.checkpoint
        if not ckpt.enable:
            return None
        folder = run_dir / ckpt.folder
        step = ckpt.load_step if ckpt.load_step != -1 else newest_complete(folder)
        record = read_train_state(folder / f"step-{step}") if step is not None else None
        batch = resume_batch(record, self.run.training, self.dp_ranks, step)
        if batch:
            self._set_global_batch(batch[0])
        return batch

    def _set_global_batch(self, global_batch: int) -> None:
        """torchtitan derives the gradient accumulation from it after `init_distributed`; config.toml records it (with
        accumulation 1: derived from the global batch, valid on any number of ranks that divides it)."""
        self.config.training.global_batch_size = global_batch
        self.run.training.global_batch_size = global_batch
        self.run.training.gradient_accumulation_steps = 1

    # ---- Train state: a token count over all ranks, whatever the number of ranks it resumes on -----------------------

    def _loss_ranks(self) -> tuple[int, int]:
        """(ranks whose token counts torchtitan sums when it logs `n_tokens_seen`, this rank's index among them)."""
        mesh = self.parallel_dims.get_optional_mesh("loss")
        return (mesh.size(), mesh.get_local_rank()) if mesh is not None else (1, 0)

    def state_dict(self) -> dict[str, Any]:
        """torchtitan's train state, with the tokens seen by all ranks (torchtitan's `ntokens_seen` is this rank's).

        Every rank of the sum takes the same number of tokens per step (rows of a fixed shape), so the total is the
        count at this launch's start plus this rank's count since then times the ranks: the same on every rank.
        """
        n, _ = self._loss_ranks()
        return {"step": self.step, "ntokens_seen": self._tokens_base + n * (self.ntokens_seen - self._tokens_start)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The step, and the total token count on the first of the summed ranks (0 on the others), so torchtitan's
        sum over the ranks continues from the total on any number of ranks."""
        self.step = state_dict["step"]
        self._tokens_base = int(state_dict["ntokens_seen"])
        self.ntokens_seen = self._tokens_start = self._tokens_base if self._loss_ranks()[1] == 0 else 0

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
        self.metrics_processor.num_flops_per_token = profiling.flops_per_token(self.run.shape,
                                                                               self.config.training.seq_len)
        self.step_profiler = profiling.StepProfiler(self.run.profiling, self.config.dump_folder, self.device.type,
                                                    last_step=self.config.training.steps, rank=_rank())
        profiling.label_calls(self.optimizers, "step", "optimizer")

    def train_step(self, data_iterator):
        if self._start_step is None:
            self._on_first_step()
        with self.step_profiler.step(self.step):
            try:
                super().train_step(profiling.Labelled(data_iterator, "data"))
            except NonFiniteGradNorm as e:
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
        lr = self.config.optimizer.param_groups[0].optimizer_kwargs["lr"]
        kept_s = (f"the last checkpoint kept is {self.checkpointer.folder}/step-{kept}" if kept is not None
                  else "no checkpoint was kept")
        return NonFiniteError(
            f"step {self.step}: loss {loss:.6g}, grad norm {grad_norm:.6g}; training stopped and nothing of this "
            f"state was saved; {kept_s}.",
            f"lower --optimizer.lr (now {lr:g}), lengthen --lr_scheduler.warmup_steps or "
            "lower --training.max_norm, then relaunch (it resumes from the last checkpoint kept).",
        )

    def _on_first_step(self) -> None:
        """Runs once, after torchtitan's resume (if any) and before the first step of this launch."""
        peak_memory.check_on_launch(self)  # measured peak per rank vs the memory plan after steps 1 and 2
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
                if self.member_tally and self.metrics_processor.should_log(self.step):
                    self._tally_members(pred, labels, loss_kwargs)
                del pred
            with record_function("backward"), spmd.no_typecheck():
                loss.backward()
        return loss  # local SUM loss / global_valid_tokens, as torchtitan returns it

    # ---- end of performance accounting ----------------------------------------------------------------------------

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor):
        """torchtitan's, with the member each row came from taken off first (`PackedDataset`'s "member": no model
        input; kept for `_tally_members`) and the attention masks of packed documents from
        `attention.attention_masks` (fixed capacity: the same shapes every batch). Plain causal attention (no mask)
        is torchtitan's path unchanged; otherwise torchtitan gets the batch without positions, so it builds no
        per-batch flex/varlen mask of its own, and the positions (RoPE) and masks are added after it."""
        from workbench.backends import attention

        self._batch_members = input_dict.pop("member", None)
        positions = input_dict.get("positions")
        masks = attention.attention_masks(self.model_config, positions,
                                          TORCH_DTYPE_MAP[self.config.training.mixed_precision_param])
        if masks is None:
            return super().post_dataloading_process(input_dict, labels)
        inputs, labels, extra_kwargs = super().post_dataloading_process(
            {k: v for k, v in input_dict.items() if k != "positions"}, labels)
        extra_kwargs.update(positions=positions, attention_masks=masks)
        return inputs, labels, extra_kwargs

    # ---- Mixtures: rows and loss per member -------------------------------------------------------------------------

    @torch.no_grad()
    def _tally_members(self, pred: torch.Tensor, labels: torch.Tensor, loss_kwargs: dict[str, Any]) -> None:
        """Each row's summed loss by the run's own loss function (one row at a time: one row's logits at once, and the
        same calls on every rank), added to its member's."""
        row_loss = torch.stack([self.loss_fn(pred[r:r + 1].detach(), labels[r:r + 1], None,
                                             **{k: v[r:r + 1] for k, v in loss_kwargs.items()})[0].float()
                                for r in range(labels.shape[0])])
        self.member_tally.add(row_loss, (labels != IGNORE_INDEX).sum(dim=1), self._batch_members)

    def _member_metrics(self) -> dict[str, float]:
        """The logged step's "rows <member>" / "loss <member>" (every rank: the losses are summed over the ranks)."""
        mesh = self.parallel_dims.get_optional_mesh("loss")
        return self.member_tally.collect(self.dataloader.packed.state_dict()["counts"],
                                         mesh.get_group() if mesh is not None else None)

    def close(self) -> None:
        super().close()
        if self.run_lock:
            self.run_lock.release()

    def train(self):
        run_dir = Path(self.config.dump_folder)
        t_start = time.perf_counter()
        if self.run.hf_checkpoint:
            # Published weights first; if the run folder holds a DCP checkpoint, torchtitan's resume (inside
            # super().train()) then overwrites them with the newer state, optimizer included.
            from workbench import hf_weights

            hf_weights.load_into_trainer(self, self.run.hf_checkpoint)
        if self.device.type == "cpu":
            from workbench.platform import cpu_adjustments

            cpu_adjustments.end_of_training_without_sleep(super().train)
        else:
            super().train()
        if self.run.export_hf:
            from workbench import hf_weights

            out = hf_weights.export_trainer(self, run_dir / "hf")
            say(f"exported Hugging Face weights to {out}")
        hist = self.metrics_processor.history
        if hist and _rank() == 0:
            losses = [h["loss"] for h in hist]
            tps = sorted(h["tokens_per_second"] for h in hist[1:] or hist)
            summary = {
                "backend": self.run.backend,
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


def resume_batch(record: dict[str, int] | None, training, dp: int, step: int | None) -> tuple[int, str] | None:
    """The global batch a resumed run trains with: the checkpoint's, kept on any number of data-parallel ranks by
    changing the gradient accumulation; `training.global_batch_size`, when set, wins.

    Args:
        record: the checkpoint's `train_state.json` (None: a fresh run, or a checkpoint without one).
        training: this launch's `[training]` section.
        dp: this launch's data-parallel ranks.
        step: the checkpoint's step (for the messages).

    Returns:
        None when the batch is what the config gives already; else (global batch, the launch line saying so).

    Raises:
        ConfigError: the checkpoint's global batch is no whole number of this launch's passes (local batch x ranks).
    """
    if not record:
        return None
    kept, per_pass = record["global_batch_size"], training.local_batch_size * dp
    was = (f"step {step} trained with {record['data_parallel_ranks']} data-parallel rank(s) x local batch "
           f"{record['local_batch_size']} x {record['gradient_accumulation_steps']} accumulation step(s)")
    if training.global_batch_size > 0:  # set on purpose: the config's batch wins
        if training.global_batch_size == kept:
            return None
        wanted = training.global_batch_size
        return wanted, (f"workbench: resuming with training.global_batch_size={wanted} as set; the checkpoint's "
                        f"was {kept} ({was}).")
    if per_pass * training.gradient_accumulation_steps == kept:
        return None
    if kept % per_pass:
        fits = max(b for b in range(1, training.local_batch_size + 1) if (kept // dp) % b == 0) if kept % dp == 0 else 0
        fix = (f"set --training.local_batch_size {fits} (it divides {kept} rows / {dp} ranks)" if fits else
               f"resume on a number of data-parallel ranks that divides {kept}")
        raise ConfigError(
            f"the checkpoint to resume ({was}) has a global batch of {kept} rows, which {dp} data-parallel rank(s) x "
            f"training.local_batch_size {training.local_batch_size} = {per_pass} rows per pass do not divide.",
            f"{fix}, or set --training.global_batch_size to go on with another batch.")
    return kept, (f"workbench: resuming with the checkpoint's global batch of {kept} rows: {dp} data-parallel "
                  f"rank(s) x local batch {training.local_batch_size} x {kept // per_pass} accumulation step(s) "
                  f"({was}).")


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


__all__ = ["WorkbenchTrainer", "resume_batch", "quiet_titan_logs"]
