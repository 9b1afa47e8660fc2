"""`python -m workbench.notebook` — run the notebooks in batch, list their parameters, clean them for git.

    python -m workbench.notebook run [NOTEBOOK ...] [-p NAME VALUE ...] [-f params.yaml] [--out DIR]
    python -m workbench.notebook params [NOTEBOOK ...]
    python -m workbench.notebook clean [NOTEBOOK ...] [--outputs-from DIR]
    python -m workbench.notebook kernel [--replace]

`run`: see `workbench.notebook.runner`. NOTEBOOK is a path, a stem (02_native) or a number (02); none = all.
Exit status: 0 all ran, 1 a notebook failed, 2 bad parameters or notebook names (nothing was executed).

`params`: the parameters each notebook declares, with defaults.

`clean`: the form notebooks are committed in (see notebooks/README.md): outputs and execution counts removed
from every cell except those marked `# NBVAL_CHECK_OUTPUT` — the outputs nbval compares (they keep a fixed
execution count: nbval does not compare a cell without one). With `--outputs-from DIR` those cells take their
outputs from the executed copies in DIR (a `run --out DIR` of the defaults), which is how the expected outputs
are refreshed after an intended change.

`kernel`: registers this Python as the notebooks' kernel "Qwen3 workbench" (`qwen3-workbench`), without taking
the name over from another clone's environment unless `--replace` (see `workbench.notebook.kernel`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workbench.core.errors import ConfigError, announce, recognised
from workbench.notebook import runner

NBVAL_MARK = "# NBVAL_CHECK_OUTPUT"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m workbench.notebook", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks with papermill")
    run.add_argument("notebooks", nargs="*", help="paths, stems (02_native) or numbers (02); default: all")
    run.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                     help="a parameter for every notebook that declares it (value read as YAML)")
    run.add_argument("-f", "--parameters-file", help="YAML: name: value, or <stem>: {name: value} for one notebook")
    run.add_argument("--out", help="folder for executed notebooks + summary (default runs/notebooks-<time>)")
    run.add_argument("-k", "--kernel", help="Jupyter kernel name (default: python3, i.e. this Python)")
    run.add_argument("--cell-timeout", type=int, default=None, help="seconds per cell (default: no limit)")
    run.add_argument("--stop-on-failure", action="store_true", help="skip the remaining notebooks after a failure")
    run.add_argument("--log-output", action="store_true", help="stream the notebooks' output here")
    par = sub.add_parser("params", help="list the parameters the notebooks declare")
    par.add_argument("notebooks", nargs="*")
    clean = sub.add_parser("clean", help="strip outputs except the nbval-checked cells")
    clean.add_argument("notebooks", nargs="*")
    clean.add_argument("--outputs-from", help="folder of executed copies to take the checked cells' outputs from")
    ker = sub.add_parser("kernel", help="register this Python as the notebooks' kernel (qwen3-workbench)")
    ker.add_argument("--replace", action="store_true", help="also when it points at another clone's Python")
    return ap


def _run(args) -> int:
    try:
        paths = runner.discover(args.notebooks)
        common, own = {}, {}
        if args.parameters_file:
            common, own = runner.load_params_file(args.parameters_file, {p.stem for p in paths})
        common.update({name: runner.parse_value(value) for name, value in args.parameter})
        results = runner.run_notebooks(paths, common, own, args.out, kernel=args.kernel,
                                       cell_timeout=args.cell_timeout, keep_going=not args.stop_on_failure,
                                       log_output=args.log_output)
    except (runner.NotebookParameterError, FileNotFoundError) as e:
        return announce(recognised(e))
    if not results:
        return announce(ConfigError("workbench.notebook: no notebooks to run."))
    width = max(len(r.notebook) for r in results)
    print(f"\n{'notebook':<{width}}  status  seconds")
    for r in results:
        print(f"{r.notebook:<{width}}  {r.status:<6}  {r.seconds:7.1f}")
    print(f"{'total':<{width}}          {sum(r.seconds for r in results):7.1f}")
    out_dir = Path(results[0].output).parent if results else None
    print(f"executed notebooks and summary.csv in {out_dir}")
    failed = [r for r in results if r.status != "ok"]
    for r in failed:
        print(f"FAILED {r.notebook}: {r.error}\n  (executed copy with the traceback: {r.output})", file=sys.stderr)
    return 1 if failed else 0


def _params(args) -> int:
    for p in runner.discover(args.notebooks):
        print(p.stem)
        for d in runner.declared_parameters(p).values():
            print(f"  {d.name} = {d.source}" + (f"    # {d.help}" if d.help else ""))
    return 0


def clean_notebook(path: Path, outputs_from: Path | None = None) -> bool:
    """Strips outputs except NBVAL_CHECK_OUTPUT cells (optionally refreshed from an executed copy).

    Returns:
        True when the file changed.
    """
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    before = nbformat.writes(nb)
    executed = None
    if outputs_from is not None:
        ex = nbformat.read(str(outputs_from / path.name), as_version=4)
        # papermill inserts an `injected-parameters` cell; match the rest by source
        executed = {c.source: c for c in ex.cells if c.cell_type == "code"}
    for number, cell in enumerate((c for c in nb.cells if c.cell_type == "code"), 1):
        keep = NBVAL_MARK in cell.source
        if keep and executed is not None:
            if cell.source not in executed:
                raise ValueError(f"{path.name}: checked cell not found in {outputs_from / path.name}:\n{cell.source}")
            cell.outputs = executed[cell.source].outputs
        if not keep:
            cell.outputs = []
        # nbval skips the comparison of a cell whose execution_count is None ("unrun"), so checked cells carry
        # one: their position among the code cells, stable from run to run (the kernel's own count is not).
        count = number if keep and cell.outputs else None
        cell.execution_count = count
        for out in cell.outputs:
            if out.get("output_type") == "execute_result":
                out["execution_count"] = count
        cell.metadata.pop("execution", None)
        cell.metadata.pop("papermill", None)
    nb.metadata.pop("papermill", None)
    nb.metadata.pop("widgets", None)
    after = nbformat.writes(nb)
    if after != before:
        path.write_text(after + ("" if after.endswith("\n") else "\n"))
        return True
    return False


def _clean(args) -> int:
    src = Path(args.outputs_from) if args.outputs_from else None
    for p in runner.discover(args.notebooks):
        changed = clean_notebook(p, src)
        print(f"{p.name}: {'cleaned' if changed else 'already clean'}")
    return 0


def _kernel(args) -> int:
    from workbench.notebook.kernel import register

    register(replace=args.replace)
    return 0  # a kept foreign kernel is a warning, not a failed setup


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return {"run": _run, "params": _params, "clean": _clean, "kernel": _kernel}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
