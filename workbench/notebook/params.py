"""Notebook parameters -> a validated workbench `JobConfig`.

Every training notebook's `parameters` cell holds plain literals (`config`, `backend`, `flavor`, `steps`, ...)
and a cell tagged `config` turns them into a job with `job_from_params`. The batch runner executes exactly
those two cells (plus papermill's injected values) *before* the notebook itself, so a bad value fails fast with
the workbench's own `ConfigError` message instead of somewhere in the middle of a kernel run.

Paths in parameters (`config`, `hf_checkpoint`, `dataset`, `dump_folder`) may be relative: a path that exists relative
to the current directory is taken as is, anything else is resolved against the repository root (the folder
holding `configs/`). Notebook kernels run in `notebooks/` (JupyterLab, nbval) or in the caller's directory
(papermill), and the same parameter values must mean the same files in all of them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from workbench.core.config import JobConfig, load_config
from workbench.core.errors import ConfigError


def repo_root() -> Path:
    """The checkout this `workbench` package lives in (the folder with `configs/` and `notebooks/`).

    Falls back to the current directory when the package was installed without its checkout (then
    relative paths in parameters are simply relative to the current directory).
    """
    root = Path(__file__).resolve().parents[2]
    return root if (root / "configs").is_dir() else Path.cwd()


def resolve_path(path: str | os.PathLike, *, must_exist: bool = False) -> Path:
    """Resolves a parameter path: absolute as is; relative to the cwd if it exists there; else to the repo root.

    Args:
        path: the path as the user wrote it.
        must_exist: raise `ConfigError` when the resolved path does not exist.
    """
    p = Path(path).expanduser()
    if p.is_absolute():
        resolved = p
    elif p.exists():
        resolved = p.resolve()
    else:
        resolved = repo_root() / p
    if must_exist and not resolved.exists():
        raise ConfigError(f"{str(path)!r} does not exist (looked in {Path.cwd()} and {repo_root()}).")
    return resolved


def resolve_dataset(dataset: str, one: bool = False) -> str:
    """A `dataset` parameter (`training.dataset` syntax) with its paths resolved as `resolve_path` does: the bundled
    names ("shakespeare", "chitchat") as they are, each member of a mixture on its own.

    Args:
        dataset: the parameter.
        one: refuse a mixture (a notebook that shows one dataset).

    Raises:
        ConfigError: a mixture where `one` (the message names a member to pass), or a malformed one.
    """
    from workbench.data import BUNDLED, dataset_label, parse_mixture

    members = parse_mixture(dataset)
    if one and len(members) > 1:
        raise ConfigError(f"dataset={dataset!r} is a mixture ({dataset_label(dataset)}): mixtures are not shown here; "
                          f"pass one member, e.g. dataset={members[0][0]!r}.")
    if len(members) == 1:
        return dataset if dataset in BUNDLED else str(resolve_path(dataset))
    return ",".join(f"{name if name in BUNDLED else resolve_path(name)}:{w!r}" for name, w in members)


# Notebook parameter name -> config key. Only parameters given as something other than None are applied;
# "" is a real value (e.g. hf_checkpoint = "" means "no checkpoint", flavor = "" means "from the checkpoint").
PARAM_KEYS: dict[str, str] = {
    "backend": "model.backend",
    "flavor": "model.flavor",
    "hf_checkpoint": "model.hf_checkpoint",
    "dataset": "training.dataset",
    "steps": "training.steps",
    "seq_len": "training.seq_len",
    "batch_size": "training.local_batch_size",
    "lr": "optimizer.lr",
    "seed": "job.seed",
    "experiment_name": "job.experiment_name",
    "dump_folder": "job.dump_folder",
}


def job_from_params(config: str | os.PathLike | None = None, *, nproc: int = 1,
                    overrides: dict[str, Any] | None = None, **params: Any) -> JobConfig:
    """Builds and validates the job a notebook's parameters describe.

    Args:
        config: TOML file (e.g. "configs/cpu_dense.toml"); None = the workbench defaults.
        nproc: ranks the job will run with (the parallel degrees are validated for that world size).
        overrides: any other fields as {"section.key": value} (e.g. {"optimizer.lr": 1e-3}).
        **params: the notebook's named parameters, see `PARAM_KEYS` (backend, flavor, steps, seq_len,
            batch_size, hf_checkpoint, dataset, lr, seed, experiment_name, dump_folder). None = keep the TOML's
            value.

    Returns:
        The validated `JobConfig`; `job.dump_folder` is absolute so the torchrun child writes where the
        notebook reads, whatever its working directory.

    Raises:
        ConfigError: an unknown parameter, or a value the workbench rejects (the message names the fix).
    """
    unknown = sorted(set(params) - set(PARAM_KEYS))
    if unknown:
        raise ConfigError(f"job_from_params: unknown parameter(s) {unknown}; known: {', '.join(PARAM_KEYS)} "
                          "(anything else goes into overrides={'section.key': value}).")
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ConfigError(f"nproc must be a positive integer; got {nproc!r}.")
    kw: dict[str, Any] = {}
    for name, value in params.items():
        if value is None:
            continue
        if name in ("hf_checkpoint", "dump_folder") and value != "":
            value = str(resolve_path(value, must_exist=(name == "hf_checkpoint")))
        elif name == "dataset":
            value = resolve_dataset(value)
        kw[PARAM_KEYS[name].replace(".", "__")] = value
    for key, value in (overrides or {}).items():
        if not isinstance(key, str) or "." not in key:
            raise ConfigError(f"overrides keys look like 'section.key' (e.g. 'optimizer.lr'); got {key!r}.")
        kw[key.replace(".", "__")] = value
    path = str(resolve_path(config, must_exist=True)) if config else None
    job = load_config(path, world_size=nproc, **kw)
    job.job.dump_folder = str(resolve_path(job.job.dump_folder))
    return job


def bench_jobs(config: str | os.PathLike | None, backends: list[str], **params: Any) -> dict[str, JobConfig]:
    """One validated job per backend of a benchmark matrix (identical except `model.backend`).

    Args:
        config: the TOML file.
        backends: the paths to compare, e.g. ["huggingface_v5", "native", "nki_moe"].
        **params: as for `job_from_params` (without `backend`).

    Raises:
        ConfigError: no backends, a repeated one, or a backend the config does not suit (e.g. nki_moe + dense).
    """
    if not backends or not isinstance(backends, (list, tuple)):
        raise ConfigError(
            f"backends must be a non-empty list of backends, e.g. ['native', 'nki_moe']; got {backends!r}.")
    if len(set(backends)) != len(backends):
        raise ConfigError(f"backends lists a backend twice: {backends}.")
    return {b: job_from_params(config, backend=b, **params) for b in backends}


def write_job_toml(job: JobConfig, path: str | os.PathLike) -> Path:
    """Writes the resolved job as a TOML file (what `workbench.bench.run_matrix` and the CLI take)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(job.to_toml())
    return p


__all__ = ["PARAM_KEYS", "job_from_params", "bench_jobs", "write_job_toml", "repo_root",
           "resolve_path", "resolve_dataset"]
