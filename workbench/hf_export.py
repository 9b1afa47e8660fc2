"""Export any DCP checkpoint of a run folder as a Hugging Face checkpoint directory.

    python -m workbench.hf_export --run outputs/cpu_dense [--step N] --out DIR [--overwrite] [--dtype bfloat16]

Reads the run's resolved `config.toml`, builds its model on CPU (fp32), loads the model weights of
`<run>/<checkpoint.folder>/step-N/` (the newest step by default) with torch.distributed.checkpoint, and
writes config.json + safetensors + tokenizer files like the end-of-training export. Needs no process group
and no accelerator. Exit code 2 on a user error (the message says what to fix).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from workbench.core.errors import HFExportError, WorkbenchError, announce, recognised
from workbench.run import checkpoint
from workbench.run.run_folder import read_config, step_dir


def export_run(run: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None, dtype: str | None = None,
               overwrite: bool = False) -> Path:
    """Exports a run's DCP checkpoint (newest step by default) as a Hugging Face directory.

    Args:
        run: the run folder (holds config.toml and the checkpoint folder).
        out: the directory to create.
        step: the checkpoint step; None = the newest.
        dtype: stored dtype; None = the run's checkpoint.export_dtype.
        overwrite: replace an existing `out`.
    """
    from workbench.backends import hf
    from workbench.model import build_model

    run = Path(run)
    problem = hf.target_problem(out, overwrite)
    if problem:  # before the (possibly long) model build and checkpoint read
        raise HFExportError(problem)
    job = read_config(run)
    ckpt_dir = step_dir(run, job.checkpoint.folder, step)
    model = build_model(job)
    checkpoint.load_dcp_model_state(model, ckpt_dir)
    return hf.export_model(model, out, dtype=dtype or job.checkpoint.export_dtype, overwrite=overwrite)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.hf_export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="run folder (<job.dump_folder>/<job.experiment_name>)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="stored dtype (default: the run's checkpoint.export_dtype)")
    args = parser.parse_args(argv)
    try:
        out = export_run(args.run, args.out, step=args.step, dtype=args.dtype, overwrite=args.overwrite)
    except (WorkbenchError, FileNotFoundError) as e:
        return announce(recognised(e))
    print(f"exported {args.run} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
