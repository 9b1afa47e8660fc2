"""workbench.compare: a checkpoint against itself, two backends from one HF checkpoint, held-out perplexity per
mixture member and per run. A run's DCP checkpoint against its HF export (a launch):
tests/integration/test_weights_in_and_out.py."""

from __future__ import annotations

import math

import pytest
import torch

from tests.run_helpers import ROOT, assert_identical
from workbench import compare
from workbench.core.config import load_config
from workbench.core.errors import ConfigError
from workbench.model import load_model

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)

SMALL = dict(seq_len=32, rows=2, max_new_tokens=4, prompts=("ROMEO:", "To be, or not to be"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny-moe Hugging Face checkpoint (seeded random init, fp32) written by the workbench's export."""
    from workbench.model import export_hf, load_model

    out = tmp_path_factory.mktemp("compare") / "hf"
    export_hf(load_model(ROOT / "configs/cpu_moe.toml", backend="native"), out, dtype="float32")
    return out


def test_tensor_diffs_reports_values_and_key_mismatches():
    a = {"w": torch.tensor([3.0, 4.0]), "z": torch.zeros(2), "only_a": torch.ones(1), "s": torch.ones(2)}
    b = {"w": torch.tensor([3.0, 5.0]), "z": torch.zeros(2), "only_b": torch.ones(1), "s": torch.ones(3)}
    df = compare.tensor_diffs(a, b).set_index("key")
    assert df.loc["w", "max_abs"] == 1 and df.loc["w", "rel_norm"] == pytest.approx(1 / 5)
    assert df.loc["z", "rel_norm"] == 0  # zero tensors on both sides are equal, not NaN
    assert df.loc["only_a", "status"] == "only in a" and df.loc["only_b", "status"] == "only in b"
    assert df.loc["s", "status"] == "shape differs" and math.isnan(df.loc["s", "max_abs"])
    # Buffers the HF format cannot hold: an absent one compares as zeros (routing without a bias).
    buffers = compare.tensor_diffs({"bias": torch.tensor([0.0, 2.0])}, {}, hf=False).iloc[0]
    assert (buffers.status, buffers.max_abs, buffers.hf) == ("only in a", 2.0, False)


def test_hf_checkpoint_compared_with_itself_is_identical(hf_dir):
    cmp = compare.compare(hf_dir, hf_dir, **SMALL)
    assert_identical(cmp)
    keys = set(cmp.tensors[cmp.tensors.hf].key)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys  # HF key space, per expert
    assert "lm_head.weight" not in keys  # tied
    assert cmp.heldout["tokens"] == 2 * 32 and 1 < cmp.heldout["ppl_a"] < 1e6


def test_heldout_perplexity_per_mixture_member(hf_dir, tmp_path, monkeypatch):
    """A mixture dataset: perplexity on each member's held-out rows besides the pooled one."""
    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("Now is the winter of our discontent. " * 40)
    b.write_text("1, 2, 3, 4, 5, 6, 7, 8, 9, 10. " * 40)
    side = compare.Loaded("native", "native", load_model(ROOT / "configs/cpu_moe.toml", backend="native"), "")
    cmp = compare.compare_models(side, side, **SMALL, dataset=f"{a}:0.5,{b}:0.5")
    ppl = {k: v for k, v in cmp.heldout.items() if k.startswith("ppl_a ")}
    assert list(ppl) == [f"ppl_a {a}", f"ppl_a {b}"]
    assert all(1 < v < 1e6 for v in ppl.values()) and len(set(ppl.values())) == 2
    assert cmp.heldout[f"ppl_b {a}"] == ppl[f"ppl_a {a}"]


def test_runs_on_different_data_are_each_measured_on_their_own_held_out_set(hf_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(tmp_path / "cache"))
    prose, numbers = tmp_path / "prose.txt", tmp_path / "numbers.txt"
    prose.write_text("Now is the winter of our discontent. " * 40)
    numbers.write_text("1, 2, 3, 4, 5, 6, 7, 8, 9, 10. " * 40)
    model = load_model(ROOT / "configs/cpu_moe.toml", backend="native")
    a, b = (compare.Loaded(f"native:{d.stem}", "native", model, "", compare.HeldOut(str(d))) for d in (prose, numbers))
    cmp = compare.compare_models(a, b, **SMALL)

    def alone(side):  # the model's perplexity on a side's held-out rows
        rows = compare.heldout_rows(side.data, 32, 2, side.vocab_size)[0][""]
        return compare.perplexity(model(rows.inputs), rows.labels)

    assert cmp.heldout["ppl_a"] == alone(a) and cmp.heldout["ppl_b"] == alone(b) != alone(a)
    assert cmp.settings["dataset"] == f"{prose} (a), {numbers} (b)"
    assert cmp.notes == [f"a and b trained on different data (a: {prose}, b: {numbers}): each perplexity is on its "
                         "own run's held-out documents; logits, top-1 and KL on a's."]
    # --dataset: both on one corpus, whatever they trained on
    assert compare.held_out(a, b, str(numbers)) == compare.held_out(b, a, str(numbers)) == b.data
    hf_side = compare.Loaded("native:hf", "native", model)  # an HF directory says nothing of its data: the run's
    assert compare.held_out(hf_side, b, None) == b.data and compare.held_out(hf_side, hf_side, None) == \
        compare.HeldOut("shakespeare", 1)


@pytest.mark.parametrize("backend", ["nki_moe", "huggingface_v5"])
def test_two_backends_from_the_same_hf_checkpoint_agree(hf_dir, backend):
    cmp = compare.compare(hf_dir, hf_dir, backend_a="native", backend_b=backend, **SMALL)
    assert cmp.b.startswith(f"{backend}:")
    assert (cmp.tensors[cmp.tensors.hf].status == "same keys").all() and (cmp.tensors.max_abs == 0).all()
    assert cmp.heldout["logits_max_abs_diff"] <= 1e-4
    assert cmp.generations.same.all()


def test_expert_bias_outside_the_hf_format_is_reported_and_explains_logit_differences(hf_dir):
    a = compare.load_checkpoint(hf_dir)
    # torchtitan's aux-loss-free balancing keeps a per-expert bias buffer (off by default in the workbench)
    balanced = load_config(None, model={"hf_checkpoint": str(hf_dir), "moe_load_balance_coeff": 1e-3})
    model = load_model(balanced)
    b = compare.Loaded(f"native:{hf_dir}", "native", model, model.workbench_info.tokenizer_path)
    name, bias = next((n, t) for n, t in b.model.named_buffers() if "expert_bias" in n)
    with torch.no_grad():
        bias.copy_(torch.linspace(-5, 5, bias.numel()))  # strong enough to change every token's routing
    summary = compare.compare_models(a, b, **SMALL).summary()
    assert summary["mismatched_keys"] == 0 and summary["weights_max_abs"] == 0  # HF weights identical ...
    assert summary["non_hf_buffers_max_abs"] == 5 and summary["logits_max_abs_diff"] > 1e-3  # ... routing is not


def test_a_path_that_is_no_checkpoint_names_what_is_expected(tmp_path):
    with pytest.raises(ConfigError, match="Hugging Face directory .* run folder .* DCP step"):
        compare.load_checkpoint(tmp_path)
    (tmp_path / "config.toml").write_text((ROOT / "configs/cpu_moe.toml").read_text())  # a run folder, no steps
    with pytest.raises(ConfigError, match="No DCP checkpoint"):
        compare.load_checkpoint(tmp_path)
