"""The one home for the workbench's errors: their classes, the exit-code table, and the one-line report.

Bottom floor: imports nothing from torch or the rest of the workbench, so every module (the config layer before
any process group, the trainer, the tools) can raise these and `announce` them.

Exit codes of a training launch (each rank's; torchrun itself exits 1 on any failed rank, and shows the ranks'
codes as `exitcode` in its failure summary):

    0   done
    2   config error: a bad key/value, a checkpoint or HF weights that do not fit the model, an unusable dataset,
        a missing device, a crafted metadata file (HF config.json or index, a prepared manifest: the file and key
        named); also the run folder is locked by another launch
    3   the loss or gradient norm stopped being finite (nothing of that state is saved)
    4   checkpoint or disk: no usable checkpoint to resume from, a checkpoint that asks to run code (refused
        unrun), a failed save, an export or a prepare that hits a full or read-only disk, a run folder that cannot
        be written or that holds a symbolic link
    5   stopped by SIGTERM/SIGINT after saving the current step (relaunch the same command to resume)
    128 + N   stopped at once by a second signal N (130 for SIGINT, 143 for SIGTERM; a SIGTERM after a SIGINT is how
        torchrun relays a second Ctrl-C, so it counts as SIGINT): nothing saved since the last checkpoint
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path

EXIT_CONFIG = 2
EXIT_NON_FINITE = 3
EXIT_CHECKPOINT = 4
EXIT_STOPPED = 5


class WorkbenchError(Exception):
    """A failure the workbench understands: `message` says what happened, `fix` what to do.

    Attributes:
        exit_code: the launch's exit code (see the table above).
        kind: the label of the one-line report ("workbench: <kind>: <message> Fix: <fix>").
        same_on_every_rank: raised by a collective or deterministic decision, so every rank has it (the other
            ranks' torchrun error files then point at rank 0's instead of repeating the line).
    """

    exit_code = 1
    kind = "error"
    fix_label = "Fix"
    same_on_every_rank = True

    def __init__(self, message: str, fix: str = ""):
        super().__init__(message)
        self.message, self.fix = message, fix

    def one_line(self) -> str:
        text = f"workbench: {self.kind}: {self.message}" + (f" {self.fix_label}: {self.fix}" if self.fix else "")
        return " ".join(text.split())  # one line, whatever the message carried


class ConfigError(WorkbenchError, ValueError):
    """Bad job configuration or input. The message says what is wrong and how to fix it."""

    exit_code = EXIT_CONFIG
    kind = "config error"


class DatasetError(ConfigError):
    """A dataset the workbench cannot train on: undecodable bytes (file and offset named), no text at all."""

    same_on_every_rank = False  # every rank reads every document, but not necessarily at the same moment


class FlavorError(ConfigError):
    """A flavor name that is not a Qwen3 model."""


class DeviceError(ConfigError):
    """The requested device cannot be used here. The message is one line naming the cause and the fix."""

    kind = "device error"


class HFCheckpointError(ConfigError):
    """A Hugging Face checkpoint directory that cannot be loaded (or does not fit the model); the message names
    the fix."""


class HFExportError(WorkbenchError, RuntimeError):
    """An export that cannot be written (the target exists, is under a file or read-only: exit 2; the disk is full:
    exit 4, set where the failure is read); the message names the fix."""

    exit_code = EXIT_CONFIG
    kind = "export error"


class RunError(WorkbenchError, RuntimeError):
    """A failure during a run (after the config was accepted)."""


class CheckpointError(RunError):
    """No usable checkpoint to resume from, or a save that failed (exit 4)."""

    exit_code = EXIT_CHECKPOINT
    kind = "checkpoint error"


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that asks to run code: a pickle naming a class outside the allowlist of what DCP writes
    (exit 4). Nothing of it was executed; the message names the file and the class."""

    kind = "unsafe checkpoint"


class CheckpointMismatchError(RunError):
    """The checkpoint reads but was written for another model shape: a config error (exit 2)."""

    exit_code = EXIT_CONFIG
    kind = "config error"


class RunFolderError(RunError):
    """The run folder cannot be created or written (read-only file system, a file in the way): exit 4."""

    exit_code = EXIT_CHECKPOINT
    kind = "run folder error"


class RunLockedError(RunError):
    """Another launch holds the run folder's lock (exit 2): two runs in one folder would destroy each other."""

    exit_code = EXIT_CONFIG
    kind = "run folder locked"


class NonFiniteError(RunError):
    """The loss or gradient norm stopped being finite (exit 3); nothing of that state is saved."""

    exit_code = EXIT_NON_FINITE
    kind = "non-finite loss"


class StoppedError(RunError):
    """Stopped by SIGTERM/SIGINT after the current step was saved (exit 5)."""

    exit_code = EXIT_STOPPED
    kind = "stopped"
    fix_label = "Resume"


class NotebookParameterError(ConfigError):
    """A parameter the notebook does not declare, or a value of the wrong type / rejected by the workbench."""


class TrainingFailed(RuntimeError):
    """torchrun exited non-zero; the message ends with the last lines of its output (the real error)."""


class BackendUnavailable(RuntimeError):
    """A backend that cannot run this checkpoint here; the message goes into the report row."""


class NkiRuleError(RuntimeError):
    """A kernel broke a documented NKI/NeuronCore rule; the message names the rule, the fix and the doc page (raised
    by the NKI emulator, `workbench.kernels.nki_emulator`)."""

    def __init__(self, rule: str, detail: str, url: str):
        self.rule = rule
        super().__init__(f"[{rule}] {detail} (see {url})")


class KernelArgumentError(ValueError):
    """A kernel's entry check failed: `argument` is the argument's name, the message its expected shape/dtype or the
    limit it broke. Raised (not asserted: `python -O` keeps it) by `workbench.kernels.nki_moe`."""

    def __init__(self, argument: str, message: str):
        self.argument = argument
        super().__init__(message)


def check_argument(ok: bool, argument: str, message: str) -> None:
    """A kernel's entry check: raises `KernelArgumentError(argument, message)` unless `ok`."""
    if not ok:
        raise KernelArgumentError(argument, message)


def recognised(e: BaseException) -> WorkbenchError | None:
    """The workbench error a failure means, or None for one the workbench does not know (its traceback shows).

    A missing file is a config error (exit 2); a run folder that cannot be written (read-only, full, a file in the
    way) is a run folder error (exit 4).
    """
    if isinstance(e, WorkbenchError):
        return e
    if isinstance(e, FileNotFoundError):
        return ConfigError(str(e).strip('"'))
    if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.ENOTDIR):
        error = RunFolderError(f"writing {e.filename or 'a file'} failed: {e.strerror}.",
                               "point --job.dump_folder at a writable folder with free space.")
        error.same_on_every_rank = False  # maybe this rank's alone: its line must be able to be the root cause
        return error
    return None


def announce(error: WorkbenchError, rank: int | None = None, *, also_print: bool = False) -> int:
    """Shows `error` as one line, once, instead of a traceback per rank; returns its exit code.

    Under torchrun the line goes into the rank's torchelastic error file, whose text torchrun prints in its failure
    summary (the last lines of its output) with the rank's exit code: rank 0's (or any rank's error that only some
    ranks have) is dated a second early so that torchrun names it the root cause; for an error every rank has, the
    other ranks' files point at rank 0's, dated an hour late so that they never become the root cause. Alone (no
    torchrun), or with `also_print` (a stop on a signal: torchrun, signalled itself, prints no summary), rank 0
    prints the line on stderr.

    Args:
        error: the failure.
        rank: this process's global rank (default: torchrun's RANK, 0 outside torchrun).
        also_print: print on rank 0 even under torchrun.
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    line, code = error.one_line(), error.exit_code
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        pointer = rank != 0 and error.same_on_every_rank
        text = f"stopped with rank 0's error (the root cause above), exit code {code}" if pointer else line
        when = str(int(time.time()) + (3600 if pointer else -1))
        Path(error_file).write_text(json.dumps(
            {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": when}}}))
    if rank == 0 and (also_print or not error_file):
        print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


__all__ = ["EXIT_CONFIG", "EXIT_NON_FINITE", "EXIT_CHECKPOINT", "EXIT_STOPPED", "WorkbenchError", "ConfigError",
           "DatasetError", "FlavorError", "DeviceError", "HFCheckpointError", "HFExportError", "RunError",
           "CheckpointError", "UnsafeCheckpointError", "CheckpointMismatchError", "RunFolderError", "RunLockedError",
           "NonFiniteError", "StoppedError", "recognised", "announce"]
