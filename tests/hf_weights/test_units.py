"""workbench.hf_weights.units: the pieces loaded and exported one at a time (in process, from the mapping itself), and
the check of a folder against them: missing, unexpected and mis-shaped keys listed together."""

from __future__ import annotations

import json

import pytest

from tests.hf_weights.helpers import DENSE, MOE, copy_of
from workbench import hf_weights as hf
from workbench.core import errors, flavors
from workbench.model import load_model

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)


@pytest.mark.parametrize("key, unit", [
    ("layers.3.attention.wq.weight", "layers.3"),
    ("layers.12.moe.experts.w1", "layers.12"),        # the first numeric part closes the unit
    ("model.layers.0.mlp.experts.7.down_proj.weight", "model.layers.0"),
    ("tok_embeddings.weight", "tok_embeddings"),     # no number: the owning module
    ("output.weight", "output"),
    ("blocks.1", "blocks"),                           # a numeric *leaf* is a parameter name, not a unit
    ("scale", ""),                                    # a root-level parameter belongs to the root
    ("model.norm.weight", "model.norm"),             # the whole owner path
])
def test_unit_of(key, unit):
    assert hf.unit_of(key) == unit


def units_of(shape: flavors.Qwen3Shape, **model_options):
    from workbench import backends

    adapter = backends.get("native").hf_adapter(shape)
    sd = hf.meta_state_dict(flavors.titan_model_config(shape, **model_options))
    return sd, hf.group_units(sd, adapter)


def test_group_units_groups_in_model_order_and_names_the_dropped_keys():
    sd, units = units_of(MOE, moe_load_balance_coeff=1e-3)  # with torchtitan's expert bias
    assert [u.name for u in units] == ["tok_embeddings", "layers.0", "layers.1", "norm", "lm_head"]
    assert [k for u in units for k in u.model] == list(sd)  # every key once, in state-dict order
    assert all(k.startswith(u.name + ".") for u in units for k in u.model)
    # The HF side, per unit: the embedding, a layer's attention + norms + router + 4 experts x 3, the final norm.
    assert list(units[0].hf) == ["model.embed_tokens.weight"]
    assert units[0].hf["model.embed_tokens.weight"].shape == (512, 32)
    layer0 = units[1].hf
    assert len(layer0) == 4 + 2 + 2 + 1 + 4 * 3 and all(k.startswith("model.layers.0.") for k in layer0)
    assert layer0["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (32, 16)
    assert list(units[4].hf) == ["lm_head.weight"]
    # torchtitan's per-layer expert bias (load balancing state) has no HF key: dropped, per layer, nothing else.
    assert [u.dropped for u in units] == [[], ["layers.0.moe.expert_bias_E"], ["layers.1.moe.expert_bias_E"], [], []]


def test_group_units_tied_output_has_no_hf_key():
    _, units = units_of(DENSE)
    head = units[-1]
    assert (head.name, list(head.model), head.hf) == ("lm_head", ["lm_head.weight"], {})
    assert head.dropped == ["lm_head.weight"]
    assert "lm_head.weight" not in {k for u in units for k in u.hf}
    assert all(u.dropped == [] for u in units[:-1])


@pytest.mark.parametrize("key, tied, ignorable", [
    ("model.layers.0.self_attn.rotary_emb.inv_freq", False, True),
    ("model.rotary_emb.inv_freq", True, True),
    ("model.layers.0.self_attn.inv_freq", False, False),  # only the RoPE module's table
    ("lm_head.weight", True, True),                        # tied: the embedding is the weight
    ("lm_head.weight", False, False),                      # untied: a real weight, never skipped
    ("model.lm_head.weight", True, False),
    ("model.norm.weight", True, False),
])
def test_ignorable_keys(key, tied, ignorable):
    shape = DENSE if tied else MOE
    assert shape.tied is tied
    assert hf.units._ignorable(key, shape) is ignorable


class _Stored:
    """A table-of-contents entry: only its shape matters to `check_against`."""

    def __init__(self, *shape: int):
        self.shape = tuple(shape)


def test_check_against_passes_an_exact_match_and_ignores_rope_tables():
    _, units = units_of(DENSE)
    toc = {k: _Stored(*v.shape) for u in units for k, v in u.hf.items()}
    toc["model.rotary_emb.inv_freq"] = _Stored(4)
    toc["lm_head.weight"] = _Stored(512, 32)  # tied: a writer that stores it anyway is fine
    hf.check_against(toc, units, DENSE, "ckpt")  # no error


def test_check_against_message_in_full():
    _, units = units_of(MOE)
    toc = {k: _Stored(*v.shape) for u in units for k, v in u.hf.items()}
    del toc["model.norm.weight"]
    toc["model.layers.1.self_attn.q_norm.weight"] = _Stored(9)
    toc["model.extra.weight"] = _Stored(2, 3)
    toc["lm_head.weight"] = _Stored(512, 32)  # untied MoE: expected, present
    with pytest.raises(errors.HFCheckpointError) as err:
        hf.check_against(toc, units, MOE, "/ckpt")
    assert str(err.value) == (
        "The weights in /ckpt do not match the model its config.json describes (MoE, dim 32, 2 layers, vocab 512):\n"
        "  shape mismatch (1): model.layers.1.self_attn.q_norm.weight expected [8], found [9]\n"
        "  missing (1): model.norm.weight [32]\n"
        "  unexpected (1): model.extra.weight [2, 3]\n"
        "config.json and the *.safetensors must come from the same model: re-export the checkpoint or fix config.json."
    )


def test_check_against_lists_at_most_five_per_kind_and_counts_all():
    _, units = units_of(DENSE)
    toc = {k: _Stored(*v.shape) for u in units for k, v in u.hf.items()}
    for i in range(7):
        toc[f"model.extra.{i}.weight"] = _Stored(1)
    toc["model.norm.weight"] = _Stored(33)
    with pytest.raises(errors.HFCheckpointError) as err:
        hf.check_against(toc, units, DENSE, "d")
    msg = str(err.value)
    assert "(dense, dim 32, 2 layers, vocab 512, tied):" in msg
    assert "shape mismatch (1): model.norm.weight expected [32], found [33]\n" in msg
    assert "unexpected (7): " + ", ".join(f"model.extra.{i}.weight [1]" for i in range(5)) + "\n" in msg
    assert "missing" not in msg


def test_check_against_any_one_kind_alone_is_refused_and_lists_are_separated():
    _, units = units_of(DENSE)
    whole = {k: _Stored(*v.shape) for u in units for k, v in u.hf.items()}
    only_missing = {k: v for k, v in whole.items() if k not in ("model.norm.weight", "model.embed_tokens.weight")}
    with pytest.raises(errors.HFCheckpointError) as err:
        hf.check_against(only_missing, units, DENSE, "d")
    assert "\n  missing (2): model.embed_tokens.weight [512, 32], model.norm.weight [32]\n" in str(err.value)
    two_shapes = {**whole, "model.norm.weight": _Stored(33), "model.layers.0.input_layernorm.weight": _Stored(31)}
    with pytest.raises(errors.HFCheckpointError) as err:
        hf.check_against(two_shapes, units, DENSE, "d")
    assert ("shape mismatch (2): model.layers.0.input_layernorm.weight expected [32], found [31]; "
            "model.norm.weight expected [32], found [33]\n") in str(err.value)


def test_key_mismatch_lists_the_keys(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    d = copy_of(saved, "dense", tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.1.mlp.gate.weight"] = tensors.pop("model.layers.1.mlp.gate_proj.weight")
    del tensors["model.norm.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(errors.HFCheckpointError) as err:
        load_model(None, hf_checkpoint=d)
    msg = str(err.value)
    assert "missing (2): " in msg and "model.norm.weight [32]" in msg
    assert "model.layers.1.mlp.gate_proj.weight [48, 32]" in msg
    assert "unexpected (1): model.layers.1.mlp.gate.weight [48, 32]" in msg


def test_shape_mismatch_lists_expected_and_found(saved, tmp_path):
    d = copy_of(saved, "dense", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 64  # config.json no longer describes the stored weights
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(errors.HFCheckpointError) as err:
        load_model(None, hf_checkpoint=d)
    msg = str(err.value)
    assert "shape mismatch (6): " in msg  # gate, up and down projections of both layers
    assert "model.layers.0.mlp.down_proj.weight expected [32, 64], found [32, 48]" in msg

