"""Hops of one launch from train.py to step 1: the workbench modules a reader follows, in order.

    .venv/bin/python benchmarks/launch_hops.py [--depth 2 12] [--list] [--section.key value ...]

A hop is a call from one workbench module into another (or from the launcher into `workbench.train.main`), made at
most DEPTH calls below `workbench.train.main`; consecutive identical hops count once. Counting stops when
`WorkbenchTrainer.train_step` is first entered (step 1). Each depth is counted in a fresh process (a lone process,
world size 1) launching `configs/cpu_dense.toml` for one step into a temporary folder; extra `--section.key value`
arguments go to the launch. Printed: the hops per depth, and with --list every hop.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ["--job.config_file", str(ROOT / "configs/cpu_dense.toml"), "--training.steps", "1"]


def _module(frame) -> str | None:
    """The workbench module a frame runs in (`workbench.x.y`), None outside the package."""
    path = frame.f_code.co_filename
    if not path.startswith(str(ROOT / "workbench")):
        return None
    return os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")


def _is_main(frame) -> bool:
    return frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "workbench.train"


def count(depth: int, argv: list[str], out: Path) -> None:
    """Launches `workbench.train.main(argv)` in this process and writes its hops down to `depth` (see the module
    docstring) to `out` when step 1 begins; the launch then finishes its step and exits the process."""
    hops: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        if frame.f_code.co_name == "train_step" and hops:
            sys.setprofile(None)
            threading.setprofile(None)
            out.write_text("\n".join(hops) + "\n")
            return
        if _is_main(frame):
            if not hops:
                hops.append("train.py -> workbench.train.main")
            return
        if not hops or (callee := _module(frame)) is None:
            return
        below, f = 0, frame
        while f is not None and not _is_main(f):
            below, f = below + 1, f.f_back
        caller = _module(frame.f_back) if frame.f_back else None
        if f is None or below > depth or caller is None or caller == callee:
            return
        hop = f"{caller} -> {callee}.{frame.f_code.co_name}"
        if hops[-1] != hop:
            hops.append(hop)

    import workbench.train

    sys.setprofile(profile)
    threading.setprofile(profile)
    workbench.train.main(argv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depth", type=int, nargs="+", default=[2, 12], help="call depths below main (default 2 12)")
    ap.add_argument("--list", action="store_true", help="print every hop")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: DEPTH OUT, counted in this process
    args, launch = ap.parse_known_args(argv)
    if args.one is not None:
        count(int(args.one[0]), launch, Path(args.one[1]))
        return 0
    for depth in args.depth:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "hops.txt"
            cmd = [sys.executable, __file__, "--one", str(depth), out, *LAUNCH, "--job.dump_folder", tmp, *launch]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
            hops = out.read_text().splitlines() if out.is_file() else []
        if proc.returncode or not hops:
            print(proc.stdout[-2000:] + proc.stderr[-2000:], file=sys.stderr)
            return 1
        print(f"depth <= {depth}: {len(hops)} hops")
        if args.list:
            print("\n".join(f"  {h}" for h in hops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
