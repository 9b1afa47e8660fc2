"""workbench.hf_export: a run's checkpoint exported as Hugging Face safetensors. An export never deletes what it
reads, a step purged by the running training while it is read is taken again at the newest one, and a killed
export's partial folder is cleaned by the next export.

All in this process, on a run folder made here as training writes it (config.toml and DCP step folders of the
cpu_dense model through the checksumming writer). Loading and writing the weights: tests/hf_weights/."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from workbench.core import errors
from workbench.core.config import load_config
from workbench.run.checkpoint import checksumming_writer, commit_checksums

ROOT = Path(__file__).resolve().parents[2]
DENSE = ROOT / "configs/cpu_dense.toml"

# DCP in one process without a process group warns that it assumes so
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def save_step(folder: Path, state: dict) -> Path:
    """`state` as a finished DCP step folder (checksums.json committed), as the trainer writes one."""
    sums: dict = {}
    metadata = dcp.save(state, storage_writer=checksumming_writer(str(folder), sums), no_dist=True)
    commit_checksums(folder, sums, metadata)
    return folder


@pytest.fixture(scope="module")
def run_source(tmp_path_factory) -> tuple[Path, dict[int, dict]]:
    """A run folder of the cpu_dense model with finished checkpoints at steps 2 and 4 (distinct weights), and a
    finished step 6 kept aside (what a training run would save next). Returns (run folder, step -> state)."""
    from workbench.model import build_model

    base = tmp_path_factory.mktemp("runs")
    job = load_config(DENSE, job={"dump_folder": str(base), "experiment_name": "cpu_dense"})
    run = job.run_dir
    run.mkdir()
    (run / "config.toml").write_text(job.to_toml())
    model = build_model(job)
    states = {}
    for step in (2, 4, 6):
        states[step] = {k: v.detach().clone() + step for k, v in model.state_dict().items()}
        save_step((run / "checkpoint" if step < 6 else base / "next") / f"step-{step}", states[step])
    return run, states


def copy_run(run_source, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_source[0], tmp_path / "runs" / "cpu_dense"))


def exported_embedding(out: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"].float()


# ---- an export never deletes what it reads ---------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["the run", "inside", "holding"])
def test_an_export_into_its_own_run_is_refused(run_source, tmp_path, capsys, where):
    from workbench import hf_export

    run = copy_run(run_source, tmp_path)
    out = {"the run": run, "inside": run / "checkpoint", "holding": run.parent}[where]
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert hf_export.main(["--run", str(run), "--out", str(out), "--overwrite"]) == errors.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"workbench: export error: --out {out} ")
    assert f"the run folder {run} that it exports from" in err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # nothing touched


# ---- recovery: a purged step is chosen again; a killed export's partial folder is cleaned ----------------------------

def test_an_export_that_loses_a_race_with_keep_latest_k_takes_the_newest_again(run_source, tmp_path, monkeypatch,
                                                                                 capsys):
    """While the export reads step 4, the training saves step 6 and purges step 4 (keep_latest_k): the export takes
    step 6 instead of failing with "the save did not finish"."""
    from workbench import hf_export
    from workbench.run import checkpoint

    run = copy_run(run_source, tmp_path)
    real = checkpoint.load_dcp_model_state
    seen = []

    def training_saves_and_purges_meanwhile(model, step_dir):
        seen.append(step_dir.name)
        if len(seen) == 1:
            shutil.copytree(run_source[0].parent / "next" / "step-6", run / "checkpoint" / "step-6")
            shutil.rmtree(run / "checkpoint" / "step-2")
            for f in sorted(step_dir.iterdir()):  # torchtitan's purge: rmtree, the read files first
                f.unlink()
        return real(model, step_dir)

    monkeypatch.setattr(checkpoint, "load_dcp_model_state", training_saves_and_purges_meanwhile)
    out = hf_export.export_run(run, tmp_path / "hf", dtype="float32")
    assert seen == ["step-4", "step-6"]
    assert "step-4 was purged by the running training while it was read" in capsys.readouterr().err
    assert torch.equal(exported_embedding(out), run_source[1][6]["tok_embeddings.weight"])


def test_a_killed_exports_partial_folder_is_cleaned_by_the_next_export(run_source, tmp_path):
    import socket

    from workbench import hf_export

    run = copy_run(run_source, tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    killed = tmp_path / f".hf.partial-{host}-{int(gone.stdout)}-1"  # what a kill -9 leaves mid-export
    swapped = tmp_path / f".hf.old-{host}-{int(gone.stdout)}-1"  # killed between the swap and the delete
    live = tmp_path / f".hf.partial-{host}-{os.getpid()}-1"  # an export of a process still running
    other = tmp_path / f".hf.partial-otherhost-{int(gone.stdout)}-1"  # another host's: its process cannot be asked
    for d in (killed, swapped, live, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    hf_export.export_run(run, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")) == sorted([live.name, other.name])
