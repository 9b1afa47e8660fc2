"""Checkpoints that survive crashes, truncated files and full disks, and the run's known failures.

`WorkbenchCheckpointManager` is torchtitan's DCP `CheckpointManager` (subclassed through its Config, methods
overridden, nothing copied) with:
  * resume from the newest *readable* checkpoint: rank 0 checks each `step-N/` cheaply (the DCP `.metadata`
    unpickles, every file it names exists and is at least as long as the last byte it points at), warns naming
    the step and the file, and broadcasts the chosen step before the collective load
    (`checkpoint.on_corrupt = "error"` stops instead);
  * a checkpoint that reads but does not fit the model (other flavor/shapes) -> exit 2 naming the keys;
  * saves that cannot hurt older checkpoints: a stale folder of the step being saved is removed first (a relaunch
    after a fallback re-saves a step), a failed save (full disk) removes its partial folder and stops with one
    line, and `keep_latest_k` counts only complete checkpoints (a partial or in-flight save never pushes the last
    complete one out);
  * a free-space check before the first save (warn, or refuse with `checkpoint.refuse_low_disk`).

`RunError` and its subclasses are the failures the workbench knows during a run: `workbench.train.main` prints
them once (rank 0) as one line plus the fix and exits with their code instead of a traceback per rank.
"""

from __future__ import annotations

import os
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import MODEL, CheckpointManager

from workbench.dist_utils import rank
from workbench.run_folder import is_complete, step_dirs

EXIT_NON_FINITE = 3
EXIT_CHECKPOINT = 4


class RunError(RuntimeError):
    """A failure the workbench understands: `message` says what happened, `fix` what to do."""

    exit_code = 1
    kind = "error"

    def __init__(self, message: str, fix: str = ""):
        super().__init__(message)
        self.message, self.fix = message, fix

    def one_line(self) -> str:
        return f"workbench: {self.kind}: {self.message}" + (f" Fix: {self.fix}" if self.fix else "")


class CheckpointError(RunError):
    """No readable checkpoint to resume from, or a save that failed (exit 4)."""

    exit_code = EXIT_CHECKPOINT
    kind = "checkpoint error"


class CheckpointMismatchError(RunError):
    """The checkpoint reads but was written for another model shape: a config error (exit 2)."""

    exit_code = 2
    kind = "config error"


class NonFiniteError(RunError):
    """The loss or gradient norm stopped being finite (exit 3); nothing of that state is saved."""

    exit_code = EXIT_NON_FINITE
    kind = "non-finite loss"


# ---- cheap checks of a DCP checkpoint folder --------------------------------------------------------------------

def newest_complete(folder: str | os.PathLike) -> int | None:
    return max(step_dirs(folder, complete=True), default=None)


def read_metadata(path: Path):
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)


def check_checkpoint(path: str | os.PathLike) -> str | None:
    """None if the files of a DCP checkpoint match its metadata, else why not (naming the file).

    Sizes only (no data is read): catches unfinished saves, truncated or missing shard files (an interrupted copy,
    a full disk) and unreadable metadata. Flipped bytes inside a file of the right size are not detected.
    """
    path = Path(path)
    if not is_complete(path):
        return f"{path / '.metadata'} is missing (the save did not finish)"
    try:
        md = read_metadata(path)
        storage = dict(md.storage_data or {})
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing here
        return f"{path / '.metadata'} is unreadable ({type(e).__name__})"
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(needed.items()):
        f = path / rel
        if not f.is_file():
            return f"{f} is missing"
        have = f.stat().st_size
        if have < size:
            return f"{f} is truncated ({have:,} of {size:,} bytes)"
    return None


def stale_checkpoints(folder: str | os.PathLike, keep_latest_k: int) -> list[Path]:
    """The step folders to delete: complete ones beyond the newest `keep_latest_k`, and partial ones older than
    the newest complete one (leftovers of killed or failed saves). Newer partial ones may be a save in flight."""
    dirs = step_dirs(folder)
    complete = sorted(s for s, p in dirs.items() if is_complete(p))
    doomed = complete[:-keep_latest_k] if keep_latest_k > 0 else []
    newest = complete[-1] if complete else -1
    doomed += [s for s, p in dirs.items() if not is_complete(p) and s < newest]
    return [dirs[s] for s in sorted(doomed)]


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def shape_mismatches(state_dict: dict[str, Any], metadata, limit: int = 3) -> list[str]:
    """'key: expected (a, b), found (c, d)' for the model tensors whose checkpoint entry is absent or differs."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    found_md = metadata.state_dict_metadata
    out = []
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue  # optimizer / dataloader / lr states: their shapes follow the model's
        entry = found_md.get(key)
        found = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        if found != tuple(value.shape):
            out.append(f"{key}: expected {tuple(value.shape)}, found {found if found is not None else 'no such key'}")
            if len(out) >= limit:
                break
    return out


def _say(msg: str) -> None:
    if rank() == 0:
        print(msg, flush=True)


def _broadcast(obj: Any) -> Any:
    """rank 0's `obj` on every rank (a no-op without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class WorkbenchCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpointer, hardened against unreadable checkpoints, crashes and full disks."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        on_corrupt: Literal["fallback", "error"] = "fallback"
        """Unreadable newest checkpoint on resume: warn and use the newest readable one, or stop."""
        refuse_low_disk: bool = False
        """Stop before the first save when the folder lacks room for keep_latest_k checkpoints."""
        total_steps: int = 0
        """training.steps (to count the saves still to come for the disk-space check)."""

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.wb_config = config

    # ---- resume -----------------------------------------------------------------------------------------------

    def _find_load_step(self, folder: str = "") -> int:
        """The newest readable complete checkpoint, decided on rank 0 and broadcast (all ranks load the same)."""
        if folder and folder != self.folder:
            return super()._find_load_step(folder)
        decision = self._choose_step() if dist.get_rank() == 0 else None
        step, error = _broadcast(decision)
        if error:
            raise CheckpointError(*error)
        return step

    def _choose_step(self) -> tuple[int, tuple[str, str] | None]:
        """(step or -1, None) or (-1, (message, fix)); runs on rank 0 only and prints the warnings."""
        complete = sorted(step_dirs(self.folder, complete=True), reverse=True)
        bad: list[int] = []
        for step in complete:
            problem = check_checkpoint(self._create_checkpoint_id(step))
            if problem is None:
                if bad:
                    _say(f"workbench: resuming from step {step} (the newest readable checkpoint).")
                return step, None
            bad.append(step)
            if self.wb_config.on_corrupt == "error":
                return -1, (f"checkpoint step {step} is unreadable: {problem}.",
                            f"move {self._create_checkpoint_id(step)} away to resume from an older checkpoint, or "
                            "set --checkpoint.on_corrupt fallback.")
            _say(f"workbench: warning: checkpoint step {step} is unreadable: {problem}; trying an older one.")
        if bad:
            return -1, (f"no readable checkpoint in {self.folder} (unreadable: steps {', '.join(map(str, bad))}).",
                        f"move {self.folder} away to start from scratch.")
        return -1, None

    def load(self, step: int = -1) -> bool:
        if self.enable and step != -1:  # an explicit --checkpoint.load_step: no fallback, just a clear error
            problem = check_checkpoint(self._create_checkpoint_id(step)) if dist.get_rank() == 0 else None
            problem = _broadcast(problem)
            if problem:
                raise CheckpointError(f"checkpoint.load_step={step} is unreadable: {problem}.",
                                      "pick another step (--checkpoint.load_step -1 = newest readable).")
        loaded = super().load(step)
        if self.enable and not self.load_only:
            self._check_disk_space()
        return loaded

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if not from_hf:
            # Every rank reads the (small) metadata and compares global shapes: the same answer everywhere.
            wrong = shape_mismatches(state_dict, read_metadata(Path(checkpoint_id)))
            if wrong:
                raise CheckpointMismatchError(
                    f"checkpoint {checkpoint_id} was written for another model: {'; '.join(wrong)}.",
                    "resume with the flavor/config it was trained with (see config.toml in the run folder), or "
                    "use another --job.experiment_name for the new model.")
        try:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        except (RunError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException (a BaseException) is multi-screen: first line only
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"loading {checkpoint_id} failed: {first[:300]}",
                                  f"move {checkpoint_id} away to resume from an older checkpoint.") from e

    # ---- save ---------------------------------------------------------------------------------------------------

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        path = Path(self._create_checkpoint_id(curr_step))
        # A folder of this step can only be left over from an abandoned timeline (a relaunch that fell back past
        # it, or a killed save): its stale .metadata must not survive next to new shard files.
        if dist.get_rank() == 0 and path.exists():
            shutil.rmtree(path)
        _barrier()
        try:
            return super()._save(curr_step, last_step)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException (a BaseException), raised on every rank
            # ENOSPC often surfaces as a zip-writer "unexpected pos" error: look at the disk too.
            usage = shutil.disk_usage(self.folder)
            full = any(s in str(e) for s in ("No space left", "Errno 28")) or usage.free < max(64 << 20,
                                                                                               usage.total // 100)
            if dist.get_rank() == 0 and path.exists():
                shutil.rmtree(path, ignore_errors=True)  # the partial save: free its space, never resume from it
            kept = newest_complete(self.folder)
            kept_s = f"checkpoint step {kept} is intact" if kept is not None else "no earlier checkpoint exists"
            reason = "the disk is full" if full else (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise CheckpointError(
                f"saving step {curr_step} to {path} failed: {reason}; the partial save was removed, {kept_s}.",
                f"free space in {self.folder} (or lower checkpoint.keep_latest_k / move checkpoint.folder), then "
                "relaunch the same command to resume." if full else "check the checkpoint folder, then relaunch.",
            ) from e

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        delay = float(os.environ.get("WORKBENCH_TEST_SAVE_DELAY_S", "0") or 0)
        if delay <= 0 or to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        # Tests only: hold every save between its shard files and its .metadata (the commit point), so that a
        # kill -9 lands *inside* a save.
        import torch.distributed.checkpoint as dcp

        return dcp.save(state_dict, storage_writer=_SlowCommitWriter(checkpoint_id, delay=delay))

    def _purge_stale_checkpoints(self):
        """keep_latest_k over *complete* checkpoints; partial folders older than the newest complete one go too.

        torchtitan's version counts every step folder, so a partial save (or an async one still in flight) could
        push the last complete checkpoint out.
        """
        if self._should_purge():
            for path in stale_checkpoints(self.folder, self.keep_latest_k):
                self.purge_queue.put(str(path))

    # ---- disk space -------------------------------------------------------------------------------------------

    def _check_disk_space(self) -> None:
        """Before the first save: room for the checkpoints this run will hold at its peak? Warn or refuse."""
        estimate = self._checkpoint_estimate()
        message = self._disk_space_message(estimate) if dist.get_rank() == 0 else None
        message = _broadcast(message)
        if not message:
            return
        if self.wb_config.refuse_low_disk:
            raise CheckpointError(message, f"free space in {self.folder}, lower checkpoint.keep_latest_k, or set "
                                           "--checkpoint.refuse_low_disk false to only warn.")
        _say(f"workbench: warning: {message}")

    def _checkpoint_estimate(self) -> int:
        """Bytes of one checkpoint over all ranks: the model state dict as DCP writes it (a tied embedding twice)
        plus Adam's two moments per parameter (each rank's local FSDP/TP shards, summed over ranks)."""
        def nbytes(t: torch.Tensor) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size()

        local = sum(nbytes(t) for t in self.states[MODEL].state_dict().values() if isinstance(t, torch.Tensor))
        local += 2 * sum(nbytes(p) for m in self.states[MODEL].model for p in m.parameters() if p.requires_grad)
        total = torch.tensor(local, dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)  # once per launch; gloo on CPU
        return int(total)

    def _disk_space_message(self, estimate: int) -> str | None:
        folder = Path(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        dirs = step_dirs(folder)
        newest = newest_complete(folder)
        # A checkpoint on disk is the best measure; else the estimate (the optimizer's own state is not asked for:
        # materialising it before the first step would advance Adam's step count and change the run).
        size = dir_bytes(dirs[newest]) if newest is not None else estimate
        existing = sum(dir_bytes(p) for p in dirs.values())
        saves_left = max(self.wb_config.total_steps - self._current_step(), 0) // self.interval + 1
        k = self.keep_latest_k
        # torchtitan purges after a save completes: at the peak, k old checkpoints sit next to the new one.
        peak_copies = min(k + 1, len(dirs) + saves_left) if k > 0 else len(dirs) + saves_left
        needed = peak_copies * size - existing
        free = shutil.disk_usage(folder).free
        if needed <= free:
            return None
        gib = 1024**3
        return (f"{folder} has {free / gib:.2f} GiB free; {peak_copies} checkpoint(s) of {size / gib:.2f} GiB "
                f"(keep_latest_k={k}) need {needed / gib:.2f} GiB more; a save will fail with a full disk.")

    def _current_step(self) -> int:
        train_state = self.states.get("train_state")
        return int(getattr(train_state, "step", 0) or 0)


class _SlowCommitWriter:
    """A FileSystemWriter that waits before writing `.metadata` (see WORKBENCH_TEST_SAVE_DELAY_S)."""

    def __new__(cls, path: str, delay: float):
        from torch.distributed.checkpoint import FileSystemWriter

        class Slow(FileSystemWriter):
            def finish(self, metadata, results):
                time.sleep(delay)
                return super().finish(metadata, results)

        return Slow(path)


__all__ = ["RunError", "CheckpointError", "CheckpointMismatchError", "NonFiniteError", "WorkbenchCheckpointManager",
           "check_checkpoint", "newest_complete", "stale_checkpoints", "EXIT_NON_FINITE",
           "EXIT_CHECKPOINT"]
