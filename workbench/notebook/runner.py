"""Batch execution of the notebooks with papermill: parameter checking up front, executed copies, a summary.

    python -m workbench.notebook run                                   # every notebook, defaults
    python -m workbench.notebook run 02_native -p steps 20 -p nproc 2  # one notebook, two parameters
    python -m workbench.notebook run -f params.yaml --out runs/nb      # parameters from a YAML file

What papermill alone does not: it *warns* about a parameter the notebook does not declare and runs anyway,
and a bad value surfaces minutes later as a traceback in an executed notebook. Here, before any kernel starts:

1. names: every parameter must be declared by the notebook's `parameters` cell (read with
   `papermill.inspect_notebook`); a typo is an error that names the closest one and lists the valid names;
2. types: a value must have the type of the declared default (int, float, str, bool, list, dict; a default
   of None accepts anything) — `-p steps ten` is an error, `-p lr 1e-3` is a float;
3. values: the `parameters` cell, the given values and the cells tagged `config` (the notebook's
   config-building lines, e.g. `job = job_from_params(...)`) are executed in this process, so a value the
   workbench rejects (a bad flavor, nki_moe on a dense model, a missing checkpoint) fails with the workbench's
   own `ConfigError` message.

Then each notebook runs under papermill in its own directory (as JupyterLab and nbval run it) with the dashboard
in static mode; its executed copy and a `summary.csv` / `summary.md` (notebook, status, seconds, error) go to
`--out`. Training outputs go to `<out>/outputs` unless `dump_folder` is given. Any failure: exit status 1, the
notebook's error printed.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import io
import os
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.core.errors import NotebookParameterError
from workbench.notebook.params import repo_root

CONFIG_TAG = "config"  # cells the runner executes up front to validate the parameters
PARAMETERS_TAG = "parameters"


def notebooks_dir() -> Path:
    return repo_root() / "notebooks"


def discover(names: Iterable[str] = ()) -> list[Path]:
    """The notebooks to run: all numbered notebooks, or the given names.

    A name can be a path, a file name, a stem ("02_native") or just its number prefix ("02").

    Raises:
        FileNotFoundError: a name that matches no notebook (the message lists the available ones).
    """
    available = sorted(p for p in notebooks_dir().glob("[0-9][0-9]_*.ipynb"))
    names = list(names)
    if not names:
        return available
    out = []
    for name in names:
        p = Path(name)
        if p.suffix == ".ipynb" and p.is_file():
            out.append(p.resolve())
            continue
        matches = [a for a in available if name in (a.name, a.stem) or a.stem.split("_", 1)[0] == name]
        if len(matches) != 1:
            raise FileNotFoundError(
                f"No notebook {name!r}. Available: {', '.join(a.stem for a in available)} "
                "(or a path to an .ipynb file)."
            )
        out.append(matches[0])
    return out


# ------------------------------------------------------------------------------------------------
# Parameters
# ------------------------------------------------------------------------------------------------


@dataclass
class Declared:
    """One parameter of a notebook's `parameters` cell."""

    name: str
    default: Any  # the literal value (None when the default is not a plain literal)
    source: str  # the default as written
    help: str = ""


def declared_parameters(path: str | os.PathLike) -> dict[str, Declared]:
    """The parameters a notebook declares, read with `papermill.inspect_notebook` ({} without a `parameters` cell)."""
    import papermill

    with contextlib.redirect_stderr(io.StringIO()):  # papermill logs "Input Notebook: ..." on every call
        found = papermill.inspect_notebook(str(path))
    out = {}
    for name, p in found.items():
        try:
            default = ast.literal_eval(p["default"])
        except (ValueError, SyntaxError):
            default = None
        out[name] = Declared(name, default, p["default"], p.get("help", ""))
    # papermill's line parser skips some valid lines (e.g. a '=' inside the comment); papermill still injects
    # such parameters, so they must not be rejected here: add every top-level assignment Python itself sees.
    for src in _tagged_sources(path, PARAMETERS_TAG)[:1]:
        with contextlib.suppress(SyntaxError):
            for node in ast.parse(src).body:
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        if isinstance(t, ast.Name) and t.id not in out:
                            text = ast.get_source_segment(src, node.value) or ""
                            try:
                                default = ast.literal_eval(node.value)
                            except ValueError:
                                default = None
                            out[t.id] = Declared(t.id, default, text)
    return out


def parse_value(text: str) -> Any:
    """A command-line value as YAML: `8` -> 8, `true` -> True, `[native, nki_moe]` -> list, `tiny` -> "tiny"."""
    import yaml

    if text.strip() == "":
        return ""  # `-p flavor ""` means the empty string (YAML would read None)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _coerce(name: str, value: Any, decl: Declared, notebook: str) -> Any:
    """Checks `value` against the type of the declared default (converting numeric strings)."""
    default = decl.default
    if default is None or value is None:
        return value
    expected = type(default)
    if expected is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if expected in (int, float) and isinstance(value, str):
        with contextlib.suppress(ValueError):
            return expected(value)  # YAML reads 1e-3 as a string; `-p steps "8"` is fine too
    if expected is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # e.g. -p flavor 8B is fine, -p experiment_name 123 too
    if isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
        return value
    raise NotebookParameterError(
        f"{notebook}: parameter {name!r} expects {expected.__name__} (default {decl.source}); "
        f"got {value!r} ({type(value).__name__})."
    )


def check_names(notebook: str, declared: dict[str, Declared], given: dict[str, Any]) -> None:
    """Raises NotebookParameterError for names the notebook does not declare (closest name + all valid names)."""
    for name in given:
        if name in declared:
            continue
        close = difflib.get_close_matches(name, list(declared), n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise NotebookParameterError(
            f"{notebook}: unknown parameter {name!r}.{hint} Valid parameters: {', '.join(declared) or '(none)'}."
        )


def _tagged_sources(path: str | os.PathLike, tag: str) -> list[str]:
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code" and tag in c.get("metadata", {}).get("tags", [])]


def check_values(path: str | os.PathLike, params: dict[str, Any]) -> None:
    """Runs the `parameters` cell, the given values and the `config`-tagged cells here (no kernel, no training).

    Raises:
        NotebookParameterError: a cell raised; the message is the workbench's error (e.g. its ConfigError).
    """
    path = Path(path)
    cells = _tagged_sources(path, CONFIG_TAG)
    if not cells:
        return
    namespace: dict[str, Any] = {"__name__": "__notebook_config_check__"}
    code = [*_tagged_sources(path, PARAMETERS_TAG), *(f"{k} = {v!r}" for k, v in params.items()), *cells]
    old_cwd = os.getcwd()
    os.chdir(path.parent)  # relative paths mean what they mean when the notebook runs
    try:
        for src in code:
            # IPython magics/shell lines cannot run here; config cells should not have any.
            src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))
            exec(compile(src, f"<{path.name}: config check>", "exec"), namespace)
    except Exception as e:
        raise NotebookParameterError(f"{path.stem}: {type(e).__name__}: {e}") from e
    finally:
        os.chdir(old_cwd)


def resolve_parameters(paths: list[Path], common: dict[str, Any],
                       per_notebook: dict[str, dict[str, Any]] | None = None) -> dict[Path, dict[str, Any]]:
    """Decides which parameters each notebook gets, and checks names and types.

    Args:
        paths: the notebooks.
        common: parameters for every notebook that declares them. Each must be declared by at least one of
            the notebooks (so a typo cannot pass silently when running the whole set).
        per_notebook: {stem: {name: value}} for one notebook only; every name must be declared by it.

    Raises:
        NotebookParameterError: see `check_names` / `_coerce`.
    """
    per_notebook = per_notebook or {}
    declared = {p: declared_parameters(p) for p in paths}
    for stem in per_notebook:
        if stem not in {p.stem for p in paths}:
            raise NotebookParameterError(f"parameters given for {stem!r}, which is not among the notebooks run "
                                         f"({', '.join(p.stem for p in paths)}).")
    if len(paths) == 1:
        check_names(paths[0].stem, declared[paths[0]], common)
    else:
        union = {n: d for p in paths for n, d in declared[p].items()}
        check_names("the selected notebooks", union, common)
    out = {}
    for p in paths:
        chosen = {k: v for k, v in common.items() if k in declared[p]}
        own = per_notebook.get(p.stem, {})
        check_names(p.stem, declared[p], own)
        chosen.update(own)
        out[p] = {k: _coerce(k, v, declared[p][k], p.stem) for k, v in chosen.items()}
    return out


def load_params_file(path: str | os.PathLike, stems: set[str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Reads a YAML parameters file: top-level names for all notebooks, `<stem>: {..}` mappings for one.

    Raises:
        NotebookParameterError: not a YAML mapping.
    """
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise NotebookParameterError(f"{path}: expected a YAML mapping of parameter names to values.")
    common, own = {}, {}
    for k, v in data.items():
        if k in stems and isinstance(v, dict):
            own[k] = v
        else:
            common[str(k)] = v
    return common, own


# ------------------------------------------------------------------------------------------------
# Execution
# ------------------------------------------------------------------------------------------------


@dataclass
class Result:
    notebook: str
    status: str  # "ok" | "failed" | "invalid"
    seconds: float
    output: str = ""
    error: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)


def _kernel_env() -> dict[str, str]:
    """Environment for the kernels: this workbench importable, dashboard static, no model hub."""
    root = str(repo_root())
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    return {"PYTHONPATH": os.pathsep.join([root, *parts]), "WORKBENCH_DASHBOARD": "static",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@contextlib.contextmanager
def _environ(update: dict[str, str]):
    old = {k: os.environ.get(k) for k in update}
    os.environ.update(update)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def execute(path: Path, params: dict[str, Any], out_dir: Path, *, kernel: str | None = None,
            cell_timeout: int | None = None, log_output: bool = False) -> Result:
    """Runs one notebook with papermill into `out_dir/<name>`; never raises for a failing notebook."""
    import papermill

    out = out_dir / path.name
    t0 = time.perf_counter()
    try:
        with _environ(_kernel_env()):
            papermill.execute_notebook(
                str(path), str(out), parameters=params, kernel_name=kernel or "python3", cwd=str(path.parent),
                progress_bar=False, log_output=log_output, execution_timeout=cell_timeout,
            )
    except papermill.PapermillExecutionError as e:
        return Result(path.stem, "failed", time.perf_counter() - t0, str(out), f"{e.ename}: {e.evalue}", params)
    except Exception as e:  # kernel died, timeout, unreadable notebook ...
        return Result(path.stem, "failed", time.perf_counter() - t0, str(out), f"{type(e).__name__}: {e}", params)
    return Result(path.stem, "ok", time.perf_counter() - t0, str(out), "", params)


def write_summary(results: list[Result], out_dir: Path):
    """summary.csv and summary.md in `out_dir`; returns the table (DataFrame)."""
    import pandas as pd

    df = pd.DataFrame([{"notebook": r.notebook, "status": r.status, "seconds": round(r.seconds, 1),
                        "output": r.output, "parameters": ", ".join(f"{k}={v!r}" for k, v in r.parameters.items()),
                        "error": r.error.splitlines()[0] if r.error else ""} for r in results])
    df.to_csv(out_dir / "summary.csv", index=False)
    lines = ["| notebook | status | seconds | error |", "|---|---|---|---|"]
    lines += [f"| {r.notebook} | {r.status} | {r.seconds:.1f} | {r.error.splitlines()[0] if r.error else ''} |"
              for r in results]
    lines.append(f"\ntotal: {sum(r.seconds for r in results):.1f} s")
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    return df


def default_out_dir() -> Path:
    return repo_root() / "runs" / time.strftime("notebooks-%Y%m%d-%H%M%S")


def run_notebooks(names: Iterable[str] = (), parameters: dict[str, Any] | None = None,
                  per_notebook: dict[str, dict[str, Any]] | None = None, out: str | os.PathLike | None = None, *,
                  kernel: str | None = None, cell_timeout: int | None = None, keep_going: bool = True,
                  log_output: bool = False, echo=print) -> list[Result]:
    """Validates and executes notebooks; the Python face of `python -m workbench.notebook run`.

    Args:
        names: notebooks (paths, stems or number prefixes); empty = all numbered notebooks.
        parameters: parameters for every notebook that declares them.
        per_notebook: {stem: {name: value}}.
        out: folder for executed copies, summary.csv/.md and (unless dump_folder is given) training outputs.
        kernel: Jupyter kernel name; None = "python3", i.e. this Python (not the notebooks' `qwen3-workbench`,
            which may be another clone's environment: a batch run tests this checkout).
        cell_timeout: seconds per cell (None = no limit).
        keep_going: run the remaining notebooks after a failure.
        log_output: stream the notebooks' output to this process's log (papermill --log-output).
        echo: where progress lines go.

    Returns:
        One `Result` per notebook attempted.

    Raises:
        NotebookParameterError: bad parameter names/types/values (nothing has been executed then).
        FileNotFoundError: an unknown notebook name.
    """
    paths = discover(names)
    out_dir = Path(out) if out else default_out_dir()
    resolved = resolve_parameters(paths, dict(parameters or {}), per_notebook)
    for p in paths:  # training outputs inside the batch folder, unless asked otherwise
        if "dump_folder" in declared_parameters(p) and "dump_folder" not in resolved[p]:
            resolved[p]["dump_folder"] = str((out_dir / "outputs").resolve())
    for p in paths:  # every value checked before the first (slow) notebook starts
        check_values(p, resolved[p])
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    for p in paths:
        shown = ", ".join(f"{k}={v!r}" for k, v in resolved[p].items() if k != "dump_folder")
        echo(f"[notebook] {p.stem} {shown}".rstrip())
        r = execute(p, resolved[p], out_dir, kernel=kernel, cell_timeout=cell_timeout, log_output=log_output)
        results.append(r)
        echo(f"[notebook] {p.stem}: {r.status} in {r.seconds:.1f} s -> {r.output}")
        if r.error:
            echo(f"[notebook] {p.stem} error: {r.error}")
        if r.status != "ok" and not keep_going:
            break
    write_summary(results, out_dir)
    return results


def format_exception(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()


__all__ = [
    "NotebookParameterError", "Declared", "Result", "declared_parameters", "check_names", "check_values",
    "resolve_parameters", "parse_value", "load_params_file", "discover", "execute", "run_notebooks",
    "write_summary",
]
