"""A run folder: `config.toml`, `metrics.jsonl`, the DCP checkpoints under `<checkpoint.folder>/step-N/`, and the
lock that keeps it to one launch at a time.

The one home for these lookups (the trainer writes the folder; bench, notebooks, compare, hf_export and the
tests read it).

**One run per folder.** A launch holds an exclusive `flock(2)` on `<run>/.lock` for its whole life (rank 0 takes
it; `RunLock`). Why flock: the kernel (or the file server) releases it when the holder dies, whatever killed it,
so a stale lock can never block a relaunch, and it works on the shared file systems a trn2 cluster uses:
  * local disk: flock(2) locks the open file description; released on close or process exit;
  * NFS: Linux clients (since 2.6.12) emulate flock() with fcntl(2) byte-range locks on the whole file, which the
    NFS lock protocol makes coherent across clients (flock(2), "NFS details",
    https://man7.org/linux/man-pages/man2/flock.2.html); a dead client's locks go when its lease expires;
  * Lustre / FSx for Lustre: coherent across client nodes with the `flock` client mount option
    (mount.lustre(8): "flock: Enable full flock support, coherent across all client nodes"; `localflock` is
    node-local only, `noflock` makes flock fail); AWS's FSx mount command uses `-o relatime,flock`
    (https://docs.aws.amazon.com/fsx/latest/LustreGuide/mounting-ec2-instance.html).
The file also records the holder (host, pid, start time, command) for the refusal message; it is cleared on a
clean exit, so a record found under a lock we could take is a stale lock (its holder was killed): taken over,
saying so. An O_EXCL lock file would need a heartbeat to tell a dead holder on another host from a live one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.core.errors import RunFolderError, RunLockedError
from workbench.core.files import FileLock, LinkError, LockUnsupportedError, find_link

_STEP_DIR = re.compile(r"step-(\d+)")
LOCK_FILE = ".lock"
CHECKSUMS = "checksums.json"
"""Per-file checksums of a DCP step folder, written last: a step folder without it is incomplete."""


def read_config(run_dir: str | os.PathLike):
    """The run's `config.toml` as a validated `JobConfig`, for reading in one process (a world of one): the
    parallel degrees the run trained with are reset to single-process values; everything else is as trained.

    Raises:
        FileNotFoundError: no config.toml (not a run folder).
    """
    from workbench.core.config import load_config

    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.toml); pass the folder a training run "
                                "wrote, <job.dump_folder>/<job.experiment_name>.")
    return load_config(path, parallelism={"dp_shard": -1, "dp_replicate": 1, "tp": 1, "ep": 1})


def is_complete(path: Path) -> bool:
    """The workbench writes `checksums.json` after DCP's `.metadata` and the shards: without it the save did not
    finish (or predates checksums)."""
    return (path / CHECKSUMS).is_file()


def step_dirs(folder: str | os.PathLike, complete: bool = False) -> dict[int, Path]:
    """step -> `step-N/` directory of a checkpoint folder; with `complete`, only finished saves (`is_complete`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    dirs = {int(m[1]): p for p in folder.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))}
    return {s: p for s, p in dirs.items() if is_complete(p)} if complete else dirs


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def nearest_existing(path: str | os.PathLike) -> Path:
    """`path` (resolved), or its nearest existing parent: the file system a folder not yet created will land on."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return path


CHECKPOINT_BYTES_PER_PARAM = 12
"""Size of a DCP checkpoint per parameter when no model is built: fp32 weights + AdamW's two fp32 moments."""


@dataclass(frozen=True)
class CheckpointSpace:
    """The disk a run's checkpoints take at their peak (`checkpoint_space`)."""

    copies: int  # checkpoints on disk at once, at the peak
    need_bytes: int  # bytes still to be written by then (what is on disk already counts)
    free_bytes: int
    where: Path  # the existing folder whose file system was asked

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.free_bytes


def checkpoint_space(folder: str | os.PathLike, size: int, keep_latest_k: int, steps: int, interval: int,
                     done_steps: int = 0) -> CheckpointSpace:
    """The one disk rule for checkpoints: how many sit in `folder` at once and what that needs beyond today.

    torchtitan purges after a save completes, so at the peak `keep_latest_k` old checkpoints sit next to the new
    one (`keep_latest_k = 0` keeps all). Saves still to come: one per `interval` from `done_steps` to `steps`, plus
    the last step's (an upper bound).

    Args:
        folder: the checkpoint folder (`<run>/<checkpoint.folder>`; need not exist yet).
        size: bytes of one checkpoint: measured on disk, traced, or `CHECKPOINT_BYTES_PER_PARAM` x parameters.
        keep_latest_k: `checkpoint.keep_latest_k`.
        steps: `training.steps`.
        interval: `checkpoint.interval`.
        done_steps: the step the run resumes from.
    """
    dirs = step_dirs(folder)
    total = len(dirs) + max(steps - done_steps, 0) // interval + 1
    copies = min(keep_latest_k + 1, total) if keep_latest_k > 0 else total
    where = nearest_existing(folder)
    need = copies * size - sum(dir_bytes(p) for p in dirs.values())
    return CheckpointSpace(copies, need, shutil.disk_usage(where).free, where)


def step_dir(run: Path, folder: str, step: int | None) -> Path:
    """The DCP directory of `step` (None = the newest) in `<run>/<folder>`.

    Raises:
        FileNotFoundError: no complete checkpoint there, or none for `step` (the message lists those there are).
    """
    steps = step_dirs(run / folder, complete=True)
    if not steps:
        raise FileNotFoundError(f"No DCP checkpoint in {run / folder}: train with --checkpoint.enable true "
                                "(and --checkpoint.interval N) to write one.")
    if step is None:
        return steps[max(steps)]
    if step not in steps:
        raise FileNotFoundError(f"No checkpoint for step {step} in {run / folder}; available steps: "
                                f"{', '.join(map(str, sorted(steps)))}.")
    return steps[step]


class RunLock:
    """The exclusive lock of a run folder (see the module docstring): `acquire` once, `release` at the end."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self.lock = FileLock(self.path)

    def acquire(self) -> dict[str, Any] | None:
        """Takes the lock and records this launch in it.

        Returns:
            The record of the previous holder when the lock was stale (that launch is gone), else None.

        Raises:
            RunLockedError: another launch holds it (the message names it).
            RunFolderError: the file system cannot lock (Lustre without `flock`), the folder is not writable, or it
                holds a symbolic link (named).
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            check_no_links(self.path.parent)
            taken = self.lock.acquire()
        except RunFolderError:
            raise
        except LinkError as e:
            raise _link_refused(e.filename) from None
        except LockUnsupportedError as e:
            raise RunFolderError(
                f"cannot lock {self.path} ({e.strerror}): the file system does not support flock.",
                "on Lustre / FSx for Lustre mount with -o flock (not localflock/noflock); on NFS run the lock "
                "service (lockd/NFSv4); or use a local folder.") from None
        except OSError as e:
            raise RunFolderError(f"cannot create the run folder {self.path.parent}: {e.strerror}.",
                                 "point --job.dump_folder at a writable folder.") from None
        if not taken:
            raise RunLockedError(
                f"{self.path.parent} is in use by another launch ({describe_holder(_parse(self.lock.holder()))}); "
                "a second run in one folder would overwrite its checkpoints and metrics.",
                "wait for it to finish, stop it (SIGTERM saves and exits), or launch into another folder "
                "(--job.experiment_name).")
        previous = _parse(self.lock.holder())
        self.lock.record(json.dumps(_own_record()))
        return previous

    def release(self) -> None:
        """Clears the record (a clean exit leaves no stale lock) and unlocks."""
        self.lock.release()


def check_no_links(run_dir: str | os.PathLike) -> None:
    """Refuses a run folder holding a symbolic link anywhere inside it: the workbench writes its files, checkpoints
    and exports there, and a link (from a colleague's folder or a download) would carry a write outside it.

    Raises:
        RunFolderError: naming the link (exit 4).
    """
    link = find_link(run_dir)
    if link is not None:
        raise _link_refused(link)


def _link_refused(link) -> RunFolderError:
    return RunFolderError(f"{link} is a symbolic link; the workbench never writes through one (it could point "
                          "outside the run folder).", f"remove the link (rm {link}), or launch into another folder "
                          "(--job.experiment_name).")


def _own_record() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)[:300]}


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(data) if data.strip() else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def describe_holder(record: dict[str, Any] | None) -> str:
    """'host H, pid P, started T' of a lock record."""
    if not record:
        return "holder not recorded yet"
    return f"host {record.get('host')}, pid {record.get('pid')}, started {record.get('started')}"


__all__ = ["read_config", "is_complete", "step_dirs", "step_dir", "RunLock", "check_no_links", "describe_holder",
           "LOCK_FILE", "CHECKSUMS"]
