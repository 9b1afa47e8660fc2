"""The process's place in a distributed job, for code that runs with and without a process group."""

from __future__ import annotations

import os
import sys


def rank() -> int:
    """Global rank: the process group's when one is initialised, else torchrun's `RANK` (0 outside torchrun).

    The environment covers the time before `init_process_group` (torchrun sets RANK for every worker), so
    rank-0-only output works from the first line of a run.
    """
    dist = sys.modules.get("torch.distributed")  # not imported yet = no process group (and no torch import here)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))
