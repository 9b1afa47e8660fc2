"""Reading a run folder: `config.toml`, `metrics.jsonl` and the DCP checkpoints under `<checkpoint.folder>/step-N/`.

The one home for these lookups (the trainer writes the folder; bench, notebooks, compare, export_hf and the
tests read it).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

_STEP_DIR = re.compile(r"step-(\d+)")


def read_config(run_dir: str | os.PathLike):
    """The run's `config.toml` as a validated `JobConfig`, for reading in one process (a world of one): the
    parallel degrees the run trained with are reset to single-process values; everything else is as trained.

    Raises:
        FileNotFoundError: no config.toml (not a run folder).
    """
    from workbench.config import load_config

    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.toml); pass the folder a training run "
                                "wrote, <job.dump_folder>/<job.experiment_name>.")
    return load_config(path, parallelism={"dp_shard": -1, "dp_replicate": 1, "tp": 1, "ep": 1})


def read_metrics(run_dir: str | os.PathLike, missing_ok: bool = False) -> list[dict[str, Any]]:
    """The records of `<run>/metrics.jsonl` (rank 0's), in file order.

    A resumed run appends to the file; a fresh run in a reused folder starts it again.

    Args:
        run_dir: the run folder.
        missing_ok: return [] when the file does not exist yet (a run that has not finished a step: dashboards
            polling a live run); False = raise.

    Raises:
        FileNotFoundError: no metrics.jsonl and not `missing_ok` (the message says why it may be missing).
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        if missing_ok:
            return []
        raise FileNotFoundError(f"{path} does not exist: the run logged no step (see its log), or {run_dir} "
                                "is not a run folder.")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def is_complete(path: Path) -> bool:
    """DCP writes `.metadata` last (tmp file + rename): without it the save did not finish."""
    return (path / ".metadata").is_file()


def step_dirs(folder: str | os.PathLike, complete: bool = False) -> dict[int, Path]:
    """step -> `step-N/` directory of a checkpoint folder; with `complete`, only finished saves (`is_complete`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    dirs = {int(m[1]): p for p in folder.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))}
    return {s: p for s, p in dirs.items() if is_complete(p)} if complete else dirs


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


__all__ = ["read_config", "read_metrics", "is_complete", "step_dirs", "step_dir"]
