"""Chat fine-tuning end to end (launches on the bundled chat set): conversations packed apart, the loss over the
global batch's trained targets, an exact resume on fewer ranks, the fine-tuned export's reply ending at <|im_end|>,
compare on held-out conversations. The export's stop tokens in process: tests/hf_weights/test_export.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.run_helpers import losses_by_step, run_train
from workbench.core.config import load_config
from workbench.platform import titan_device

titan_device.pin("cpu")  # the fp32 reference numerics (also on machines with an accelerator)

from workbench.model import export_hf, load_model, load_run  # noqa: E402  (after the device is pinned)

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)

TEXT_END, TURN_END = 151643, 151645  # <|endoftext|>, <|im_end|> in the bundled Qwen3 tokenizer


# ------------------------------------------------------------------------------------------------
# Fine-tuning launches on the bundled chat set (tiny flavor, seq_len 128, 4 steps, global batch 2) from exported
# initial weights: 2 ranks x 1 micro-batch, and its step-2 checkpoint resumed on 1 rank x 2 micro-batches.
# ------------------------------------------------------------------------------------------------

CONFIG = "configs/cpu_dense.toml"
SEQ, SEED = 128, 42


def chat_args(init: Path, name: str, out: Path, *more: str) -> tuple[str, ...]:
    return ("--training.dataset", "chitchat", "--training.seq_len", str(SEQ), "--training.local_batch_size", "1",
            "--training.steps", "4", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
            "--checkpoint.keep_latest_k", "0", "--model.hf_checkpoint", str(init), "--job.experiment_name", name,
            "--job.dump_folder", str(out), *more)


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    """{"2x1": 2 ranks x 1 micro-batch, steps 1-4 (exports fp32 Hugging Face weights), "2->1x2": its step-2
    checkpoint resumed on 1 rank x 2 micro-batches, steps 3-4}, rank-0 outputs, the initial weights."""
    root = tmp_path_factory.mktemp("sft")
    init = export_hf(load_model(load_config(CONFIG)), root / "init", dtype="float32")
    out = root / "runs"
    runs = {"2x1": out / "a", "2->1x2": out / "b"}
    stdout = {"2x1": run_train(CONFIG, *chat_args(init, "a", out, "--checkpoint.export_hf", "true",
                                                  "--checkpoint.export_dtype", "float32"), nproc=2).stdout}
    shutil.copytree(runs["2x1"] / "checkpoint" / "step-2", runs["2->1x2"] / "checkpoint" / "step-2")
    stdout["2->1x2"] = run_train(CONFIG, *chat_args(init, "b", out, "--training.gradient_accumulation_steps", "2"),
                                 nproc=1).stdout
    return runs, stdout, init


@pytest.mark.slow
def test_the_launch_packs_the_conversations_apart(sft_runs):
    runs, stdout, _ = sft_runs
    assert "workbench: packed chitchat: 4,007 conversations -> 3,326 rows of 128 tokens, pad 8.30%" in stdout["2x1"]
    assert "training.document_mask on: chitchat holds conversations" in stdout["2x1"]
    assert "document_mask = true" in (runs["2x1"] / "config.toml").read_text()  # block-causal: packed apart
    loss = losses_by_step(runs["2x1"])
    assert sorted(loss) == [1, 2, 3, 4] and loss[4] < loss[1] - 0.1  # it learns


@pytest.mark.slow
def test_the_loss_is_the_mean_over_the_global_batch_of_trained_targets(sft_runs):
    """Step 3 from the step-2 weights, recomputed here on the step's two rows (global rows 4 and 5): the logged loss
    is the mean over both rows' trained targets (not the mean of the rows' means), on 2 ranks x 1 micro-batch and on
    1 rank x 2 micro-batches alike; the weights after step 4 agree too."""
    from workbench.backends import attention
    from workbench.data.loader import resolve
    from workbench.data.packing import ChatRows, PackSpec
    from workbench.data.prepared import PreparedDataset

    runs, _, _ = sft_runs
    model = load_run(runs["2x1"], step=2)[0]
    rows = ChatRows(PreparedDataset(resolve("chitchat", progress=False)), PackSpec(seq_len=SEQ, seed=SEED, holdout=1),
                    "chitchat")
    ids, labels, pos = (torch.from_numpy(np.stack(a)) for a in zip(*(rows.row(g) for g in (4, 5)), strict=True))
    with torch.no_grad():
        logits = model(ids, **attention.forward_kwargs(model.workbench_info.model_config, pos))
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), reduction="none",
                                                  ignore_index=-100).view(2, SEQ)
    trained = labels != -100
    mean = float(per_token.sum() / trained.sum())
    mean_of_rows = float((per_token.sum(1) / trained.sum(1)).mean())
    logged = {k: losses_by_step(runs[k])[3] for k in runs}
    assert abs(mean - mean_of_rows) > 1e-3 and trained.sum(1).tolist() == [65, 39]  # the two readings differ
    assert abs(logged["2x1"] - mean) < 1e-5 and abs(logged["2->1x2"] - mean) < 1e-5, (logged, mean, mean_of_rows)
    wa, wb = (load_run(runs[k], step=4)[0].state_dict() for k in runs)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5


@pytest.mark.slow
def test_resume_on_fewer_ranks_continues_exactly(sft_runs):
    runs, _, _ = sft_runs
    resumed, whole = losses_by_step(runs["2->1x2"]), losses_by_step(runs["2x1"])
    assert sorted(resumed) == [3, 4]
    assert max(abs(resumed[s] - whole[s]) for s in resumed) < 1e-5, (resumed, whole)


@pytest.mark.slow
def test_the_fine_tuned_export_loads_in_transformers_and_its_reply_ends_at_im_end(sft_runs):
    """Through the chat template and transformers' generate (greedy): the initial weights run to the token limit, the
    fine-tuned export ends its reply with <|im_end|> (after 4 tiny steps the reply is that token alone: the most
    frequent trained target is the turn's end)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    runs, _, init = sft_runs
    got = {}
    for label, folder in (("initial", init), ("fine-tuned", runs["2x1"] / "hf")):
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        prompt = tok.apply_chat_template([{"role": "user", "content": "hey how are you doing today?"}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)
        n = prompt["input_ids"].shape[1]
        got[label] = model.generate(**prompt, max_new_tokens=16, do_sample=False)[0, n:].tolist()
    assert len(got["initial"]) == 16 and TURN_END not in got["initial"]
    assert got["fine-tuned"][-1] == TURN_END and len(got["fine-tuned"]) < 16


@pytest.mark.slow
def test_compare_measures_held_out_conversations_on_their_trained_tokens(sft_runs):
    """The run held out chitchat's last conversation (training.holdout_docs = 1): compare measures both sides on it,
    on the tokens training.loss_on trains (the assistant's replies), where the fine-tune beats its initial weights."""
    from workbench import compare
    from workbench.data.loader import resolve
    from workbench.data.packing import PackSpec, heldout_rows
    from workbench.data.prepared import PreparedDataset

    runs, _, init = sft_runs
    cmp = compare.compare(runs["2x1"], init, seq_len=SEQ, max_new_tokens=2)
    _, labels = heldout_rows(PreparedDataset(resolve("chitchat", progress=False)), PackSpec(seq_len=SEQ), 1)
    assert cmp.settings["dataset"] == "chitchat" and cmp.settings["rows"] == 1
    assert cmp.heldout["tokens"] == int((labels != -100).sum()) == 18  # trained targets only, of 128 positions
    assert cmp.heldout["ppl_a"] < cmp.heldout["ppl_b"]
