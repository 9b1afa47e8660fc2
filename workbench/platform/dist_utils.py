"""The process's place in a distributed job, and its stop requests, for code that runs with and without a process
group (no torch import here)."""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

from workbench.core.errors import WorkbenchError, announce


def rank() -> int:
    """Global rank: the process group's when one is initialised, else torchrun's `RANK` (0 outside torchrun).

    The environment covers the time before `init_process_group` (torchrun sets RANK for every worker), so
    rank-0-only output works from the first line of a run.
    """
    dist = sys.modules.get("torch.distributed")  # not imported yet = no process group (and no torch import here)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def say(msg: str) -> None:
    """Prints on global rank 0 only (the workbench's user-facing output)."""
    if rank() == 0:
        print(msg, flush=True)


def _group_size() -> int:
    """World size of the initialised process group; 1 without one."""
    dist = sys.modules.get("torch.distributed")
    return dist.get_world_size() if dist is not None and dist.is_available() and dist.is_initialized() else 1


def broadcast(obj):
    """rank 0's `obj` on every rank (a no-op without a process group)."""
    if _group_size() == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank ([obj] without a process group)."""
    if _group_size() == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if _group_size() > 1:
        import torch.distributed as dist

        dist.barrier()


class StopRequest:
    """SIGTERM / SIGINT ask for a clean stop: the trainer finishes the current step, saves it and exits 5.

    A second signal stops at once (exit 128 + N, nothing saved after the last checkpoint; a SIGTERM after a SIGINT
    counts as SIGINT: that is how torchrun relays a second Ctrl-C), and so does the death of the launcher after a
    first signal. The same
    signal arriving again within `same_within_s` of the first counts once: Slurm signals every process of a job
    step and torchrun forwards what it gets, so a rank sees one request twice.

    How: a Python-level no-op handler plus `signal.set_wakeup_fd`, whose pipe a watcher thread reads. The C-level
    handler writes each signal's number there at once, so the watcher reacts even while the main thread is inside
    a long C call (a forward, a collective) that would delay a Python handler.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, same_within_s: float = 1.0):
        self.same_within_s = same_within_s
        self.signal: int | None = None  # the first signal received
        self._first_at = 0.0
        self._parent = os.getppid()
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for sig in self.SIGNALS:
            signal.signal(sig, lambda *_: None)
        threading.Thread(target=self._watch, args=(r,), name="workbench-stop", daemon=True).start()

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else "a stop request on another rank"

    def _watch(self, fd: int) -> None:
        while True:
            ready, _, _ = select.select([fd], [], [], 0.5 if self.requested else None)
            if not ready:  # after a first signal: is the launcher still there?
                if os.getppid() != self._parent:
                    self._stop_now(self.signal, "the launcher exited")
                continue
            for signum in os.read(fd, 64):
                if signum in self.SIGNALS:
                    self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        now = time.monotonic()
        if self.signal is None:
            self.signal, self._first_at = signum, now
            if rank() == 0:
                print(f"workbench: {self.name}: finishing the current step, then saving it and stopping (another "
                      "signal stops at once, without saving).", file=sys.stderr, flush=True)
        elif now - self._first_at > self.same_within_s:
            # torchrun relays a second Ctrl-C as SIGTERM (its agent's shutdown after the first one's SIGINT): what the
            # user sent was SIGINT, and the README's code for it is 130
            if self.signal == signal.SIGINT and signum == signal.SIGTERM:
                signum = signal.SIGINT
            self._stop_now(signum, f"a second {signal.Signals(signum).name}")

    @staticmethod
    def _stop_now(signum: int, why: str) -> None:
        error = WorkbenchError(f"{why}: stopped at once; nothing was saved after the newest checkpoint.",
                               "relaunch the same command to resume from the newest checkpoint.")
        error.kind, error.exit_code = "stopped", 128 + signum
        try:
            announce(error, rank(), also_print=True)
        finally:  # the launcher gone, stderr may be a closed pipe: exit whatever printing did
            os._exit(error.exit_code)


__all__ = ["rank", "broadcast", "all_gather", "barrier", "StopRequest"]
