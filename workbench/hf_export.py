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

from workbench.core.errors import CheckpointError, HFExportError, WorkbenchError, announce, recognised
from workbench.run import checkpoint
from workbench.run.run_folder import is_complete, read_config, step_dir

RETRIES = 3
"""How often the newest step is chosen again when the one chosen was purged meanwhile (a run still training with
`keep_latest_k` deletes older checkpoints as it saves newer ones)."""


def export_run(run: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None, dtype: str | None = None,
               overwrite: bool = False) -> Path:
    """Exports a run's DCP checkpoint (newest step by default) as a Hugging Face directory.

    Args:
        run: the run folder (holds config.toml and the checkpoint folder).
        out: the directory to create; never the run folder, inside it or above it (the export would replace what
            it reads).
        step: the checkpoint step; None = the newest (chosen again if a training run purges it meanwhile).
        dtype: stored dtype; None = the run's checkpoint.export_dtype.
        overwrite: replace an existing `out` (an earlier export only).
    """
    from workbench import hf_weights
    from workbench.model import build_model

    run = Path(run)
    problem = source_problem(run, Path(out)) or hf_weights.target_problem(out, overwrite)
    if problem:  # before the (possibly long) model build and checkpoint read
        raise HFExportError(problem)
    job = read_config(run)
    model = build_model(job)
    for attempt in range(RETRIES):
        ckpt_dir = step_dir(run, job.checkpoint.folder, step)
        try:
            checkpoint.load_dcp_model_state(model, ckpt_dir)
            break
        except CheckpointError:
            # A purge deletes a step only after a newer one is verified: the step gone or no longer the newest.
            purged = not is_complete(ckpt_dir) or step_dir(run, job.checkpoint.folder, None) != ckpt_dir
            if step is not None or not purged or attempt == RETRIES - 1:
                raise  # damage, not a purge
            print(f"workbench: {ckpt_dir} was purged by the running training while it was read; taking the newest "
                  "checkpoint again.", file=sys.stderr, flush=True)
    return hf_weights.export_model(model, out, dtype=dtype or job.checkpoint.export_dtype, overwrite=overwrite)


def source_problem(run: Path, out: Path) -> str | None:
    """Why `out` cannot receive an export of `run` (None if it can): it is the run folder, inside it, or a folder
    that holds it; an export there would replace or delete the checkpoints it reads."""
    r, o = run.resolve(), out.resolve()
    how = "is" if o == r else "is inside" if r in o.parents else "holds" if o in r.parents else None
    if how is None:
        return None
    return (f"--out {out} {how} the run folder {run} that it exports from: the export would replace the run's "
            "checkpoints. Choose an output directory outside the run folder.")


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
