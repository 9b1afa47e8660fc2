"""workbench.hf_weights.load: published-format weights into a model, in this process: logits match transformers' own
model for every layout (sharded, per-expert, fused experts), cast weights are reported and non-finite ones refused,
a config.json of another model type is refused. Round trips through training:
tests/integration/test_weights_in_and_out.py."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import workbench
from tests.hf_weights.helpers import TOL, copy_of, logits, stored_keys
from tests.run_helpers import hf_logits, max_diff
from workbench import hf_weights as hf
from workbench.core import errors
from workbench.model import load_model

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)


@pytest.mark.parametrize("name", ["dense", "dense-sharded", "moe", "moe-sharded", "moe-fused"])
def test_native_logits_match_transformers(saved, ids, name):
    path, reference = saved[name]
    if name.endswith("sharded"):
        assert (path / hf.INDEX_FILE).is_file() and len(list(path.glob("*.safetensors"))) > 2
    if name == "moe-fused":
        assert any(k.endswith("experts.gate_up_proj") for k in stored_keys(path))
    model = workbench.load_model(None, backend="native", hf_checkpoint=path)  # the notebooks' API
    out = logits(model, ids)
    assert out.shape == (2, 24, 512) and out.dtype == torch.float32 and not model.training
    assert max_diff(out, hf_logits(reference, ids)) <= TOL


def test_not_qwen3(saved, tmp_path):
    d = copy_of(saved, "dense", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type='llama'.*Qwen3 only"):
        load_model(None, hf_checkpoint=d)


def _rewrite(d: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(d / "model.safetensors"))
    change(state)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_cast_weights_are_reported_and_non_finite_ones_refused(saved, tmp_path):
    from workbench.model import load_model

    d = Path(shutil.copytree(saved["dense"][0], tmp_path / "ckpt"))
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

