"""A run's weights in and out, through real launches (torchrun over gloo): training from a Hugging Face checkpoint and
exporting it (1 rank; 2 ranks give back the checkpoint bit for bit), and a run on one's own data (a mixture made
here) whose compare and export use its newest checkpoint and its own held-out data. In process: tests/hf_weights/
(loading and writing the weights), tests/commands/test_compare.py, tests/commands/test_hf_export.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.run_helpers import assert_identical, hf_logits, hf_model, max_diff, read_metrics, run_train
from workbench import compare
from workbench.core import flavors
from workbench.core.config import load_config
from workbench.hf_export import export_run
from workbench.platform import titan_device
from workbench.run.run_folder import step_dirs

titan_device.pin("cpu")  # the fp32 reference numerics (also on machines with an accelerator)

from workbench.model import build_model, load_model  # noqa: E402  (after the device is pinned)

pytestmark = [pytest.mark.slow, pytest.mark.machine_cpu_path]  # no launch here is held to a stored number

TOL = 1e-4


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


@pytest.fixture(scope="module")
def tiny_moe_checkpoint(tmp_path_factory) -> Path:
    """transformers' Qwen3-MoE at the tiny-moe shape (real vocabulary, tied), saved in shards."""
    path = tmp_path_factory.mktemp("tiny_moe") / "ckpt"
    hf_model(flavors.get_shape("tiny-moe"), seed=3).save_pretrained(path, max_shard_size="8MB")
    return path


TRAIN = ("--training.seq_len", "32", "--model.moe_load_balance_coeff", "0", "--checkpoint.export_hf", "true",
         "--checkpoint.export_dtype", "float32")


def test_train_from_hf_then_export(tiny_moe_checkpoint, tmp_path):
    run_train("configs/cpu_moe.toml", *TRAIN, "--job.dump_folder", str(tmp_path), "--training.steps", "5",
              "--model.hf_checkpoint", str(tiny_moe_checkpoint), "--checkpoint.enable", "true",
              "--checkpoint.interval", "5")
    run = tmp_path / "cpu_moe"
    export = run / "hf"
    ids = torch.randint(0, 151936, (2, 16), generator=torch.Generator().manual_seed(2))
    reference = hf_logits(export, ids)
    # the exported files hold the trained weights: equal to the DCP checkpoint of the last step
    from workbench.run.checkpoint import load_dcp_model_state
    from workbench.run.run_folder import step_dir

    job = load_config(run / "config.toml")
    trained = build_model(job)
    load_dcp_model_state(trained, step_dir(run, "checkpoint", None))
    assert max_diff(logits(trained, ids), reference) <= TOL
    assert max_diff(logits(load_model(None, hf_checkpoint=export), ids), reference) <= TOL
    assert max_diff(reference, hf_logits(tiny_moe_checkpoint, ids)) > 1e-3  # training changed the weights

    from transformers import AutoTokenizer

    from workbench import data

    text = "Shall I compare thee to a summer's day?"
    assert AutoTokenizer.from_pretrained(export)(text)["input_ids"] == data.load_tokenizer().encode(text).ids

    # the CLI exports the same weights from the DCP checkpoint
    from safetensors.torch import load_file

    from workbench.hf_export import main

    assert main(["--run", str(run), "--out", str(tmp_path / "cli"), "--dtype", "float32"]) == 0
    a, b = load_file(str(export / "model.safetensors")), load_file(str(tmp_path / "cli" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_load_and_export_exactly(tiny_moe_checkpoint, tmp_path):
    """FSDP-sharded load and gathered export over 2 ranks give back the checkpoint bit for bit.

    The one step runs at lr 1e-30 without weight decay (lr 0 is refused as a mistake): Adam's first update is about
    lr x sign(grad) = 1e-30, far below half an fp32 ulp of any weight larger than ~1e-22, so every weight rounds back
    to itself and any difference is the load or the export.
    """
    run_train("configs/cpu_moe.toml", *TRAIN, "--job.dump_folder", str(tmp_path), "--training.steps", "1",
              "--optimizer.lr", "1e-30", "--optimizer.weight_decay", "0",
              "--model.hf_checkpoint", str(tiny_moe_checkpoint), nproc=2)
    from safetensors.torch import load_file

    source = {k: v for f in tiny_moe_checkpoint.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    exported = load_file(str(tmp_path / "cpu_moe" / "hf" / "model.safetensors"))
    assert source.keys() == exported.keys()
    assert all(torch.equal(source[k], exported[k]) for k in source)


SMALL = dict(seq_len=32, rows=2, max_new_tokens=4, prompts=("ROMEO:", "To be, or not to be"))


def weight_diffs(a, b) -> float:
    """The largest |a - b| of any weight of two checkpoints (HF key space)."""
    (wa, _), (wb, _) = (compare.comparable_state(compare.load_checkpoint(p)) for p in (a, b))
    diffs = compare.tensor_diffs(wa, wb)
    assert (diffs.status == "same keys").all()
    return diffs.max_abs.max()


@pytest.fixture(scope="module")
def own_data_run(tmp_path_factory):
    """A run on data of one's own, made here: a mixture of two small jsonl corpora (weights 0.7 and 0.7), the
    numbers' documents shorter than one held-out row; 4 steps, DCP checkpoints at 2 and 4, the fp32 HF export at
    the end, all state in HF format. Yields (run folder, the mixture, the launch's stdout)."""
    root = tmp_path_factory.mktemp("own_data")
    prose = root / "prose.jsonl"
    prose.write_text("".join(json.dumps({"text": f"Essay {i}: the river bends where the old mill stood, and " * 3})
                             + "\n" for i in range(30)))
    numbers = root / "numbers.jsonl"
    numbers.write_text("".join(json.dumps({"text": ", ".join(str(i * k % 97) for k in range(8))}) + "\n"
                               for i in range(12)))
    mixture = f"{prose}:0.7,{numbers}:0.7"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORKBENCH_DATA_CACHE", str(root / "cache"))  # the launch and compare prepare into it
        proc = run_train("configs/cpu_moe.toml", "--training.steps", "4", "--job.dump_folder", str(root / "out"),
                         "--training.dataset", mixture, "--checkpoint.enable", "true", "--checkpoint.interval", "2",
                         "--checkpoint.keep_latest_k", "0", "--checkpoint.export_hf", "true",
                         "--checkpoint.export_dtype", "float32", "--model.moe_load_balance_coeff", "0")
        yield root / "out" / "cpu_moe", mixture, proc.stdout


def test_a_mixture_of_ones_own_data_is_normalised_out_loud_and_logged_per_member(own_data_run):
    run, mixture, stdout = own_data_run
    prose, numbers = (m.rsplit(":", 1)[0] for m in mixture.split(","))
    assert "workbench: training.dataset weights 0.7, 0.7 sum to 1.4: normalised to shares 0.5, 0.5." in stdout
    assert f"workbench: mixture member {numbers}: share 0.5, " in stdout and "epoch(s) over the run (4 rows" in stdout
    records = read_metrics(run)
    before = {prose: 0, numbers: 0}
    for r in records:  # every step: rows per member add up to the batch, the member losses to the step's loss
        now = {m: r[f"rows {m}"] for m in before}
        taken = {m: now[m] - before[m] for m in before}
        assert sum(taken.values()) == 2 and set(taken) == {m for m in before if f"loss {m}" in r} | \
            {m for m in before if not taken[m]}
        pooled = sum(r[f"loss {m}"] * n for m, n in taken.items() if n) / 2
        assert abs(pooled - r["loss"]) <= 1e-5 * r["loss"], (r["step"], pooled, r["loss"])
        before = now
    assert before == {prose: 4, numbers: 4}


def test_compare_and_export_of_a_run_use_its_newest_checkpoint_and_its_own_data(own_data_run, tmp_path, capsys):
    run, mixture, _ = own_data_run
    prose, numbers = (m.rsplit(":", 1)[0] for m in mixture.split(","))
    assert sorted(step_dirs(run / "checkpoint", complete=True)) == [2, 4]
    assert_identical(compare.compare(run, run / "checkpoint" / "step-4", **SMALL))
    assert weight_diffs(run, run / "hf") == 0 < weight_diffs(run / "checkpoint" / "step-2", run / "hf")
    # The command line: the newest DCP step (trained weights, titan keys) vs the fp32 HF export written at the end,
    # each measured on the run's own held-out documents, per member too.
    assert compare.main([str(run), str(run / "hf"), "--seq-len", "32", "--rows", "2", "--max-new-tokens", "4",
                         "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert summary["mismatched_keys"] == 0 and summary["weights_max_abs"] == 0
    assert summary["logits_max_abs_diff"] == 0 and summary["generations_same"] == summary["generations"]
    assert summary["dataset"] == mixture and summary["holdout_docs"] == 1
    assert summary[f"ppl_a {prose}"] == summary[f"ppl_b {prose}"] and 1 < summary[f"ppl_a {numbers}"] < 1e6
    short = [line for line in out.splitlines() if line.startswith(f"note: the held-out set of {numbers} ")]
    assert len(short) == 1 and "fewer than one row of 33: measured on all of it" in short[0], out
    assert (tmp_path / "cmp" / "compare.md").read_text().startswith("# Checkpoint comparison")
    # hf_export of the run without --step: the newest checkpoint, the weights of the export written at the end
    assert weight_diffs(export_run(run, tmp_path / "hf4"), run / "hf") == 0
