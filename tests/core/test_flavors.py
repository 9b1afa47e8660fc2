"""Flavors as data: official parameter counts (built on the meta device) and the HF config round trip."""

from __future__ import annotations

import json

import pytest

from workbench.core import errors, flavors
from workbench.core.config import load_config

OFFICIAL = [n for n, s in flavors.FLAVORS.items() if s.official_params]


@pytest.mark.parametrize("name", OFFICIAL)
def test_parameter_count_matches_official(name):
    shape = flavors.FLAVORS[name]
    counts = flavors.count_params(shape)
    assert abs(counts["total"] / shape.official_params - 1) < 0.005, counts


def test_param_counts_formula_matches_flavors():
    """The notebooks' flavor table counts parameters by formula (no torchtitan import in the kernel)."""
    from workbench.core.flavors import param_counts

    for name in ("tiny", "tiny-moe", "0.6B", "30B-A3B"):
        assert param_counts(flavors.get_shape(name)) == flavors.count_params(flavors.get_shape(name)), name


def test_moe_active_parameters():
    # Published: 30B-A3B activates 3.3B, 235B-A22B activates 22B per token.
    assert abs(flavors.count_params(flavors.FLAVORS["30B-A3B"])["active"] / 3.35e9 - 1) < 0.01
    assert abs(flavors.count_params(flavors.FLAVORS["235B-A22B"])["active"] / 22.19e9 - 1) < 0.01


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_cpu_flavors_are_tiny_but_keep_the_real_vocab(name):
    shape = flavors.FLAVORS[name]
    counts = flavors.count_params(shape)
    assert shape.vocab_size == 151936
    assert counts["total"] - counts["embedding"] < 1_000_000  # "a few M at most" of non-embedding params


@pytest.mark.parametrize("name", OFFICIAL + ["tiny", "tiny-moe"])
def test_hf_config_round_trip(name):
    shape = flavors.FLAVORS[name]
    cfg = flavors.hf_config(shape).to_dict()
    back = flavors.shape_from_hf_config(cfg)
    assert flavors.flavor_of(back) == name


def test_resolve_from_checkpoint_and_disagreement(tmp_path):
    import json

    flavors.hf_config(flavors.FLAVORS["tiny-moe"]).save_pretrained(tmp_path)
    assert flavors.resolve("", str(tmp_path))[0] == "tiny-moe"
    assert flavors.resolve("tiny-moe", str(tmp_path))[0] == "tiny-moe"
    with pytest.raises(ValueError, match="disagrees with"):
        flavors.resolve("tiny", str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="trains Qwen3 only"):
        flavors.resolve("", str(tmp_path))


TINY = flavors.Qwen3Shape(32, 2, 4, 2, head_dim=8, ffn_dim=48, vocab_size=512, tied=True, max_seq_len=256)


def test_a_string_tie_word_embeddings_is_refused_not_tied(tmp_path):
    d = tmp_path / "ckpt"
    flavors.hf_config(TINY).save_pretrained(str(d))
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = "false"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(errors.ConfigError) as refused:
        load_config(None, model={"hf_checkpoint": str(d)})
    assert refused.value.one_line() == (f"workbench: config error: {d / 'config.json'}: tie_word_embeddings is "
                                        "'false' (a string); expected true or false")
