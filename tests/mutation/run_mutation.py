"""`make mutation`: mutmut over the modules where a wrong answer is silent, each against its own fast tests.

    python tests/mutation/run_mutation.py [TARGET ...] [--timeout SECONDS per target] [--children N]

Each target runs in its own scratch folder `build/mutation/<target>/` (links to the repository plus a pyproject.toml
whose [tool.mutmut] names that target's module and tests), one after the other, single-process pytest (no xdist,
no slow tests: no torchrun, no notebook kernel), so a run fits 2 shared cores. Prints and writes
`build/mutation/summary.json`: per target, killed / survived / other and the surviving mutants' names.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import tomli_w

ROOT = Path(__file__).resolve().parents[2]
SCRATCH = ROOT / "build" / "mutation"
LINKED = ["tests", "conftest.py", "configs", "benchmarks", "train.py", "notebooks", "scripts"]

def _names(module: str, functions: tuple[str, ...], methods: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """mutmut's mutant-name patterns of these functions and (class, method) pairs of `module`."""
    return ([f"{module}.x_{f}__mutmut_*" for f in functions]
            + [f"{module}.x\u01c1{c}\u01c1{m}__mutmut_*" for c, m in methods])


PLAN_TESTS = "c10_allocators_own_events_one_rank or kernel_buffers or math_scores"  # the plan's fast tests

# target -> (files mutated, mutant-name patterns run (the functions under test), fast tests, pytest -k expression)
TARGETS: dict[str, tuple[list[str], list[str], list[str], str]] = {
    "config": (["workbench/core/config/load.py", "workbench/core/config/sections.py"],
               _names("workbench.core.config.load", ("validate",))
               + _names("workbench.core.config.sections", (), tuple((c, "check") for c in (
                   "Model", "Optimizer", "Training", "Parallelism", "Checkpoint", "Profiling", "Metrics"))),
               ["tests/core/test_config.py"], "not cli_exits"),
    "checkpoint": (["workbench/run/checkpoint.py"],
                   _names("workbench.run.checkpoint", ("newest_complete", "check_checkpoint", "verify_files",
                                                   "verify_checkpoint", "stale_checkpoints", "shape_mismatches"),
                          (("WorkbenchCheckpointManager", "_find_load_step"),)),
                   ["tests/run/test_checkpoint.py"], ""),
    "run_folder": (["workbench/run/run_folder.py", "workbench/run/metrics.py"],
                   _names("workbench.run.metrics", ("_parse", "read_metrics", "trim_metrics"))
                   + _names("workbench.run.run_folder", ("is_complete", "step_dirs", "step_dir")),
                   ["tests/run/test_run_folder.py", "tests/run/test_metrics.py", "tests/run/test_checkpoint.py",
                    "tests/commands/test_bench.py"], ""),
    "metrics": (["workbench/notebook/dashboard.py", "workbench/bench.py"],
                _names("workbench.bench", ("summarize_run", "_percentile"))
                + _names("workbench.notebook.dashboard", (), (("Dashboard", "poll"), ("Dashboard", "_status_html"),
                                                              ("Dashboard", "summary_text"), ("Dashboard", "frame"))),
                ["tests/notebook/test_dashboard.py", "tests/commands/test_bench.py"], ""),
    # The memory plan's categorising part: the tracker's reference types -> categories, and the tracker that files
    # tensors under them (its nested methods are mutants of `tracker_class`).
    "plan": (["workbench/memory/tracer.py"], _names("workbench.memory.tracer", ("categories_at_peak",)),
             ["tests/memory/test_tracer.py"], PLAN_TESTS),
    "plan_tracker": (["workbench/memory/tracer.py"], _names("workbench.memory.tracer", ("tracker_class",)),
                     ["tests/memory/test_tracer.py"], PLAN_TESTS),
    "hf": (["workbench/hf_weights/units.py"], _names("workbench.hf_weights.units",
                                                      ("unit_of", "group_units", "_ignorable", "check_against")),
           # the expert-bias warning test fails in mutmut's copy of the tree (it passes in the repository)
           ["tests/hf_weights/test_units.py", "tests/hf_weights/test_load.py", "tests/hf_weights/test_export.py",
            "tests/hf_weights/test_folder.py"], "not expert_bias"),
    "doctor": (["workbench/doctor.py"], _names("workbench.doctor", ("_base", "software_checks", "nki_check")),
               ["tests/commands/test_doctor.py"], ""),
    "autograd": (["workbench/kernels/autograd.py"],
                 _names("workbench.kernels.autograd", ("_transposed", "neuron_moe_op", "blockwise_moe_nki",
                                                       "blockwise_moe_auto"),
                        (("BlockwiseMoEFunction", "forward"), ("BlockwiseMoEFunction", "backward"),
                         ("KernelPlan", "tokens"), ("KernelPlan", "slot_weights"))),
                 ["tests/kernels/test_moe_kernels.py"], "custom_op or nki_kernels_match_reference_fp32"),
}


def prepare(target: str) -> Path:
    """The scratch folder of one target: links to the repository and its own pyproject.toml."""
    files, _, tests, select = TARGETS[target]
    folder = SCRATCH / target
    folder.mkdir(parents=True, exist_ok=True)
    for name in ["workbench", *LINKED]:
        link = folder / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project["tool"]["mutmut"] = {
        "source_paths": ["workbench"],
        "only_mutate": files,
        "also_copy": LINKED,
        "pytest_add_cli_args_test_selection": tests,
        "pytest_add_cli_args": ["-p", "no:xdist", "-p", "no:cacheprovider", "-m", "not slow and not browser",
                                *(["-k", select] if select else [])],
        "process_isolation": "forkserver",
        "use_git_change_detection": False,
    }
    (folder / "pyproject.toml").write_text(tomli_w.dumps(project))
    return folder


def run(target: str, timeout: float, children: int) -> dict:
    """Runs mutmut for one target (at most `timeout` seconds) and reads its results."""
    folder = prepare(target)
    patterns = TARGETS[target][1]
    mutmut = [sys.executable, "-m", "mutmut"]
    t0 = time.time()
    with open(folder / "run.log", "w") as log:  # mutmut records each result as it goes: a timeout keeps them
        proc = subprocess.Popen([*mutmut, "run", "--max-children", str(children), *patterns], cwd=folder,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # mutmut's fork server and workers are in its session: stop them all
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            rc = "timeout"
    results = subprocess.run([*mutmut, "results", "--all", "true"], cwd=folder, capture_output=True, text=True)
    status = {}
    for line in results.stdout.splitlines():
        m = re.match(r"\s*(\S+): (.+)$", line)
        if m and any(_match(m[1], p) for p in patterns):
            status[m[1]] = m[2].strip()
    counts: dict[str, int] = {}
    for s in status.values():
        counts[s] = counts.get(s, 0) + 1
    killed = counts.get("killed", 0) + counts.get("timeout", 0)
    tested = sum(n for s, n in counts.items() if s not in ("not checked", "skipped"))
    return {"target": target, "rc": rc, "seconds": round(time.time() - t0), "counts": counts,
            "killed_pct": round(100 * killed / tested, 1) if tested else None,
            "survived": sorted(k for k, s in status.items() if s in ("survived", "no tests"))}


def table(summary: dict) -> str:
    """A markdown table of the last run: per target, mutants killed / tested (and not reached in its time)."""
    lines = ["| target | killed | survived | not reached | killed % | seconds | when |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, r in summary.items():
        c = r.get("counts", {})
        killed, survived = c.get("killed", 0) + c.get("timeout", 0), c.get("survived", 0) + c.get("no tests", 0)
        lines.append(f"| {name} | {killed} | {survived} | {c.get('not checked', 0)} | {r.get('killed_pct')} "
                     f"| {r.get('seconds')} | {r.get('when')} |")
    return "\n".join(lines)


def _match(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatch(name, pattern)


def main(argv: list[str]) -> int:
    options = {"--timeout": 1800.0, "--children": 1}
    for flag, default in options.items():
        if flag in argv:
            i = argv.index(flag)
            options[flag] = type(default)(argv[i + 1])
            del argv[i:i + 2]
    timeout, children = options["--timeout"], options["--children"]
    targets = argv or list(TARGETS)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        print(f"run_mutation: unknown target(s) {unknown}; choose from {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    SCRATCH.mkdir(parents=True, exist_ok=True)
    summary_path = SCRATCH / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    for target in targets:
        result = run(target, timeout, children)
        result["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        summary[target] = result
        summary_path.write_text(json.dumps(summary, indent=2))
        print(json.dumps({k: v for k, v in result.items() if k != "survived"}), flush=True)
        for name in result.get("survived", []):
            print(f"    survived: {name}")
    (SCRATCH / "summary.md").write_text(table(summary) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
