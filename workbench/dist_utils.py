"""The process's place in a distributed job, for code that runs with and without a process group."""

from __future__ import annotations

import os


def rank() -> int:
    """Global rank: the process group's when one is initialised, else torchrun's `RANK` (0 outside torchrun).

    The environment covers the time before `init_process_group` (torchrun sets RANK for every worker), so
    rank-0-only output works from the first line of a run.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))
