"""Folders from elsewhere, round two (issue 53): a run folder never writes outside itself, an export never deletes
what it reads, nothing hangs on a FIFO, absurd shapes are refused before any estimate, crafted metadata is one line,
and the recovery paths end without a dead end.

All in this process, on real pieces: a run folder made here as training writes it (config.toml and DCP step folders
of the cpu_dense model through the checksumming writer), tiny Hugging Face checkpoints written by transformers."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

from tests.run_helpers import unblocking
from workbench.core import errors, flavors
from workbench.core.config import load_config
from workbench.run.checkpoint import check_checkpoint, checksumming_writer, commit_checksums, read_metadata
from workbench.run.run_folder import RunLock

ROOT = Path(__file__).resolve().parents[2]
DENSE = ROOT / "configs/cpu_dense.toml"
TINY = flavors.Qwen3Shape(32, 2, 4, 2, head_dim=8, ffn_dim=48, vocab_size=512, tied=True, max_seq_len=256)

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


# ---- 1. a run folder never writes outside itself --------------------------------------------------------------------

@pytest.mark.parametrize("name", [".lock", "summary.json", "checkpoint"])
def test_a_link_in_a_run_folder_is_refused_and_its_target_untouched(tmp_path, name):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(precious)
    with pytest.raises(errors.RunFolderError) as refused:
        RunLock(run).acquire()
    assert refused.value.one_line().startswith(f"workbench: run folder error: {run / name} is a symbolic link; the "
                                               "workbench never writes through one")
    assert refused.value.exit_code == errors.EXIT_CHECKPOINT and precious.read_text() == "keep me"


def test_run_folder_files_are_never_written_through_a_link(tmp_path):
    """Past the launch's check (a link planted later, a hard link): appends refuse, atomic writes replace the name."""
    from workbench.core import files

    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(precious)
    with pytest.raises(files.LinkError, match="metrics.jsonl is a symbolic link"):
        files.open_for_append(run / "metrics.jsonl")
    (run / "metrics.jsonl").unlink()
    os.link(precious, run / "metrics.jsonl")
    with pytest.raises(OSError, match="has other hard links"):
        files.open_for_append(run / "metrics.jsonl")
    (run / "summary.json").symlink_to(precious)
    files.write_atomic(run / "summary.json", "{}")
    assert precious.read_text() == "keep me" and not (run / "summary.json").is_symlink()
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "summary.json"]  # no temp file left


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../../elsewhere", "/abs/run", "x" * 300])
def test_experiment_name_is_one_folder_name(name):
    with pytest.raises(errors.ConfigError) as refused:
        load_config(DENSE, job={"experiment_name": name})
    assert refused.value.one_line().startswith(f"workbench: config error: job.experiment_name={name[:60]!r} ")
    assert "one folder name" in refused.value.message
    assert load_config(DENSE, job={"experiment_name": "run-2.b"}).run_dir.name == "run-2.b"


# ---- 2. an export never deletes what it reads -----------------------------------------------------------------------

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


# ---- 8. recovery: a purged step is chosen again; a killed export's partial folder is cleaned -----------------------

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


# ---- 3. nothing hangs: a FIFO is refused; absurd shapes are refused by range --------------------------------------

def test_a_fifo_named_safetensors_is_refused_not_read(tmp_path):
    from workbench.backends import hf

    d = tmp_path / "ckpt"
    d.mkdir()
    flavors.hf_config(TINY).save_pretrained(str(d))
    os.mkfifo(d / "model.safetensors")
    with unblocking(d / "model.safetensors") as hung, pytest.raises(errors.HFCheckpointError) as refused:
        hf.table_of_contents(d)
    assert not hung(), "the reader blocked on the FIFO"
    assert f"{d / 'model.safetensors'} is a FIFO, not a regular file" in refused.value.one_line()


def test_an_absurd_depth_is_refused_before_any_estimate():
    """10^7 layers: refused by range when the config is read (the memory gate's estimate would build every layer)."""
    with pytest.raises(errors.ConfigError, match=r"model.n_layers=10000000 is out of range: valid is 0 <= n_layers "
                                                 r"<= 1024 \(0 = the flavor's\)"):
        load_config(DENSE, model={"n_layers": 10_000_000})
    assert load_config(DENSE, model={"n_layers": 3}).shape.n_layers == 3


# ---- 5/6. crafted metadata: casts reported, non-finite refused, paths that leave their folder ----------------------

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("tiny_hf") / "ckpt"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(flavors.hf_config(TINY)).save_pretrained(str(d))
    return d


def _rewrite(d: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(d / "model.safetensors"))
    change(state)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_cast_weights_are_reported_and_non_finite_ones_refused(tiny_hf, tmp_path):
    from workbench.model import load_model

    d = Path(shutil.copytree(tiny_hf, tmp_path / "ckpt"))
    key = "model.layers.0.mlp.up_proj.weight"

    def to_int8(state):
        state[key] = state[key].mul(100).to(torch.int8)
        state["model.norm.weight"] = state["model.norm.weight"].half()

    _rewrite(d, to_int8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_model(None, hf_checkpoint=d)
    said = [str(w.message) for w in caught if "cast on load" in str(w.message)]
    assert said == [f"{d}: cast on load: 1 weight(s) float16 -> float32 (first: norm.weight); 1 weight(s) int8 -> "
                    "float32 (first: layers.0.feed_forward.w3.weight)"], [str(w.message) for w in caught]

    def nan(state):
        state[key] = state[key].float()
        state[key][3, 1] = float("nan")

    _rewrite(d, nan)
    with pytest.raises(errors.HFCheckpointError, match=r"The weights of layers.0.feed_forward.w3.weight hold NaN or "
                                                       r"infinite values"):
        load_model(None, hf_checkpoint=d)


def test_a_string_tie_word_embeddings_is_refused_not_tied(tiny_hf, tmp_path):
    d = Path(shutil.copytree(tiny_hf, tmp_path / "ckpt"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = "false"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(errors.ConfigError) as refused:
        load_config(None, model={"hf_checkpoint": str(d)})
    assert refused.value.one_line() == (f"workbench: config error: {d / 'config.json'}: tie_word_embeddings is "
                                        "'false' (a string); expected true or false")


def test_an_index_naming_a_file_outside_is_refused_before_it_is_opened(tiny_hf, tmp_path):
    from workbench.backends import hf

    d = Path(shutil.copytree(tiny_hf, tmp_path / "ckpt"))
    outside = tmp_path / "outside.safetensors"
    shutil.move(d / "model.safetensors", outside)
    keys = hf._file_keys(outside)
    (d / hf.INDEX_FILE).write_text(json.dumps({"weight_map": {k: "../outside.safetensors" for k in keys}}))
    with pytest.raises(errors.HFCheckpointError, match=r"weight_map\['model.embed_tokens.weight'\] is "
                                                       r"'../outside.safetensors' \(a string\); expected a"):
        hf.table_of_contents(d)


def test_dcp_metadata_naming_a_file_outside_its_step_is_refused_before_dcp_opens_it(tmp_path):
    """A `.metadata` whose storage entry points at ../../x (its checksum updated to match): refused by the cheap
    check, before DCP's reader would open <step>/../../x."""
    step = save_step(tmp_path / "checkpoint" / "step-2", {"w": torch.arange(10.0)})
    metadata = read_metadata(step)
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data[index] = type(info)("../../secret", info.offset, info.length)
    data = pickle.dumps(metadata)
    (step / ".metadata").write_bytes(data)
    sums = json.loads((step / "checksums.json").read_text())
    sums["files"][".metadata"] = {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
    (step / "checksums.json").write_text(json.dumps(sums))
    assert check_checkpoint(step) == (f"{step / '.metadata'} names a file outside its step folder ('../../secret'); "
                                      "nothing was read")


# ---- 10. parity on a pickle-only folder ---------------------------------------------------------------------------

class _Tripwire:
    """Unpickling this creates a file: proof that a loader unpickled the weights."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_parity_refuses_a_pickle_only_folder_before_transformers_reads_it(tiny_hf, tmp_path, capsys):
    from workbench import parity

    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(tiny_hf / "config.json", d)
    marker = tmp_path / "unpickled"
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(_Tripwire(marker)))
    assert parity.main([str(d), "--steps", "1"]) == errors.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pytorch_model.bin" in err and "never unpickles" in err
    assert not marker.exists()
