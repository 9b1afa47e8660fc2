"""workbench.backends.hf: Hugging Face safetensors in and out, in this process: parity with transformers' own
models, export round trips, and a clear refusal for every kind of bad input (a FIFO, a file named outside the
folder, cast or non-finite weights, pickles never unpickled).

Checkpoints here are written by transformers itself (random init, fp32) from small custom shapes with a
512-token vocabulary. Round trips through training (launches): tests/integration/test_weights_in_and_out.py.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import workbench
from tests.run_helpers import PicklePayload, hf_logits, hf_model, max_diff, unblocking
from workbench import hf_weights as hf
from workbench.core import errors, flavors
from workbench.core.config import load_config
from workbench.platform import titan_device

titan_device.pin("cpu")  # the fp32 reference numerics (also on machines with an accelerator)

from workbench.model import export_hf, load_model  # noqa: E402  (after the device is pinned)

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)

DENSE = flavors.Qwen3Shape(32, 2, 4, 2, head_dim=8, ffn_dim=48, vocab_size=512, tied=True, max_seq_len=256)
MOE = flavors.Qwen3Shape(32, 2, 4, 2, head_dim=8, vocab_size=512, tied=False, max_seq_len=256, num_experts=4,
                         top_k=2, moe_ffn_dim=16)
TOL = 1e-4
TEXT_END, TURN_END = 151643, 151645  # <|endoftext|>, <|im_end|> in the bundled Qwen3 tokenizer


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """name -> (checkpoint dir, the transformers model that wrote it)."""
    root = tmp_path_factory.mktemp("hf")
    dense, moe = hf_model(DENSE), hf_model(MOE)
    layouts = {
        "dense": (dense, {}),
        "dense-sharded": (dense, {"max_shard_size": "20KB"}),
        "moe": (moe, {}),  # published per-expert keys (transformers' default on disk)
        "moe-sharded": (moe, {"max_shard_size": "20KB"}),
        "moe-fused": (moe, {"save_original_format": False}),  # v5 in-memory gate_up_proj / down_proj
    }
    out = {}
    for name, (model, kwargs) in layouts.items():
        model.save_pretrained(root / name, **kwargs)
        out[name] = (root / name, model)
    return out


def stored_keys(d: Path) -> set[str]:
    from safetensors import safe_open

    keys = set()
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            keys |= set(h.keys())
    return keys


# ------------------------------------------------------------------------------------------------
# Loading published-format weights
# ------------------------------------------------------------------------------------------------


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


def test_load_model_without_checkpoint_is_seeded(ids):
    job = load_config(None, model={"flavor": "tiny"})
    a, b = load_model(job), load_model(job)
    assert torch.equal(logits(a, ids), logits(b, ids))  # every buffer (RoPE cache) initialised, no stray state


# ------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dense", "moe-fused"])
def test_export_round_trip_through_transformers(saved, ids, name, tmp_path):
    path, reference = saved[name]
    model = load_model(None, hf_checkpoint=path)
    out = hf.export_model(model, tmp_path / "export", max_shard_bytes=30_000)
    index = json.loads((out / hf.INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == {p.name for p in out.glob("*.safetensors")}
    assert len(index["weight_map"]) == len(stored_keys(out))
    assert not any("gate_up_proj" in k for k in stored_keys(out))  # per-expert layout, like published checkpoints
    assert ("lm_head.weight" in stored_keys(out)) == (not reference.config.tie_word_embeddings)
    assert json.loads((out / "config.json").read_text())["model_type"] == reference.config.model_type
    assert (out / "tokenizer.json").is_file()
    assert max_diff(hf_logits(out, ids), hf_logits(reference, ids)) <= TOL
    assert not list(tmp_path.glob(".export*")), "temporary directory left behind"


def test_export_bfloat16(saved, ids, tmp_path):
    path, _ = saved["dense"]
    out = export_hf(load_model(None, hf_checkpoint=path), tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as h:
        assert {h.get_tensor(k).dtype for k in h.keys()} == {torch.bfloat16}


def test_export_warns_about_the_expert_bias(saved, tmp_path):
    balanced = load_config(None, model={"hf_checkpoint": str(saved["moe"][0]), "moe_load_balance_coeff": 1e-3},
                           training={"seq_len": 64})
    model = load_model(balanced)
    model.layers["0"].moe.expert_bias_E.fill_(0.5)  # what torchtitan's load balancing learns in training
    with pytest.warns(UserWarning, match="expert_bias_E.*moe_load_balance_coeff = 0"):
        export_hf(model, tmp_path / "out")


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------


def copy_of(saved, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved[name][0], tmp_path / name))


def test_missing_shard(saved, tmp_path):
    d = copy_of(saved, "dense-sharded", tmp_path)
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(errors.HFCheckpointError, match=rf"missing from .*{victim.name}.*fetch the missing shard"):
        load_model(None, hf_checkpoint=d)


def test_truncated_safetensors(saved, tmp_path):
    d = copy_of(saved, "dense", tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(errors.HFCheckpointError,
                       match="model.safetensors is not a readable safetensors file.*truncated"):
        load_model(None, hf_checkpoint=d)


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


def test_not_qwen3(saved, tmp_path):
    d = copy_of(saved, "dense", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type='llama'.*Qwen3 only"):
        load_model(None, hf_checkpoint=d)


def test_pickle_weights_are_refused_never_unpickled(saved, tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(saved["dense"][0] / "config.json", d)
    marker = tmp_path / "unpickled"
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(PicklePayload(marker)))
    with pytest.raises(errors.HFCheckpointError, match=r"pytorch_model.bin.*never unpickles.*save_pretrained"):
        load_model(None, hf_checkpoint=d)
    assert not marker.exists()


def test_export_refuses_an_existing_target_unless_overwrite(saved, ids, tmp_path):
    """An existing target is refused; --overwrite replaces an earlier export (its marker), never another folder."""
    model = load_model(None, hf_checkpoint=saved["dense"][0])
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(errors.HFExportError, match="already exists.*overwrite"):
        export_hf(model, target)
    with pytest.raises(errors.HFExportError, match=r"is not a folder the workbench exported \(it has no "
                                                   r"\.workbench-hf-export\); --overwrite replaces only an earlier"):
        export_hf(model, target, overwrite=True)
    assert (target / "keep.txt").read_text() == "mine"
    (target / "keep.txt").unlink()
    export_hf(model, target, overwrite=True)  # an empty folder is taken
    (target / "model.safetensors").write_bytes(b"old")
    export_hf(model, target, overwrite=True)  # an earlier export is replaced
    assert (target / "model.safetensors").stat().st_size > 3 and (target / hf.EXPORT_MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old directory left


def test_failed_export_leaves_nothing(saved, tmp_path, monkeypatch):
    model = load_model(None, hf_checkpoint=saved["dense"][0])

    def disk_full(*_a, **_k):
        raise OSError("No space left on device")

    monkeypatch.setattr(hf.export, "_copy_tokenizer", disk_full)
    with pytest.raises(errors.HFExportError, match="No space left on device.*nothing was written"):
        export_hf(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# Units and the refusal, in process (no checkpoint files; the mapping itself)
# ------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------
# Exports that cannot clobber (issue 33): a target under a file or read-only, two exports racing, a full disk
# ------------------------------------------------------------------------------------------------


def _mount_tmpfs(path: Path, options: str) -> None:

    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, f"wb-{path.name}", str(path)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")


def _umount(path: Path) -> None:

    subprocess.run(["umount", "-l", str(path)], check=False)


def test_export_target_under_a_file_or_read_only_is_one_line(saved, tmp_path, capsys):
    from workbench import hf_export

    (tmp_path / "file").write_text("x")
    # the CLI checks the target before it reads the run (which need not exist for the refusal)
    assert hf_export.main(["--run", str(tmp_path / "no_run"), "--out", str(tmp_path / "file" / "hf")]) == 2
    err = capsys.readouterr().err
    assert err == (f"workbench: export error: {tmp_path / 'file' / 'hf'} cannot be created: {tmp_path / 'file'} is a "
                   "file, not a directory. Choose another output directory.\n")
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "ro,size=1m")
    try:
        with pytest.raises(errors.HFExportError, match=f"{ro} is not writable \\(a read-only file system"):
            export_hf(load_model(None, hf_checkpoint=saved["dense"][0]), ro / "deep" / "hf")
    finally:
        _umount(ro)


def test_two_exports_into_one_folder_exactly_one_wins(saved, tmp_path, monkeypatch):
    """Both pass the early existence check, both write, then both try to put their export in place: exactly one
    does, the other is refused in one line and leaves nothing behind."""
    import threading

    model = load_model(None, hf_checkpoint=saved["dense"][0])
    both_written = threading.Barrier(2, timeout=60)
    write_config = hf.export._write_config

    def write_config_then_wait(*args, **kwargs):  # the real writer; then wait for the other export
        write_config(*args, **kwargs)
        both_written.wait()

    monkeypatch.setattr(hf.export, "_write_config", write_config_then_wait)
    outcomes: list = [None, None]

    def export(i: int) -> None:
        try:
            outcomes[i] = export_hf(model, tmp_path / "out")
        except errors.HFExportError as e:
            outcomes[i] = e

    threads = [threading.Thread(target=export, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    won = [o for o in outcomes if isinstance(o, Path)]
    lost = [o for o in outcomes if isinstance(o, errors.HFExportError)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert lost[0].one_line() == (f"workbench: export error: {tmp_path / 'out'} was created by another export while "
                                  "this one was written; this export was discarded. Choose another output directory, "
                                  "or pass --overwrite.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the loser's partial directory is gone
    assert stored_keys(tmp_path / "out") == stored_keys(saved["dense"][0])


def test_an_export_onto_a_full_disk_exits_4(saved, tmp_path):
    """A real full file system (a tmpfs smaller than the export): the README's exit code for disk failures."""
    full = tmp_path / "full"
    _mount_tmpfs(full, "size=64k")
    try:
        with pytest.raises(errors.HFExportError) as e:
            export_hf(load_model(None, hf_checkpoint=saved["dense"][0]), full / "hf")
        assert e.value.exit_code == errors.EXIT_CHECKPOINT == 4
        assert "nothing was written there" in e.value.message and list(full.iterdir()) == []
    finally:
        _umount(full)


def test_a_fifo_named_safetensors_is_refused_not_read(tmp_path):
    from workbench import hf_weights as hf

    d = tmp_path / "ckpt"
    d.mkdir()
    flavors.hf_config(DENSE).save_pretrained(str(d))
    os.mkfifo(d / "model.safetensors")
    with unblocking(d / "model.safetensors") as hung, pytest.raises(errors.HFCheckpointError) as refused:
        hf.table_of_contents(d)
    assert not hung(), "the reader blocked on the FIFO"
    assert f"{d / 'model.safetensors'} is a FIFO, not a regular file" in refused.value.one_line()


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


def test_an_index_naming_a_file_outside_is_refused_before_it_is_opened(saved, tmp_path):
    from workbench import hf_weights as hf

    d = Path(shutil.copytree(saved["dense"][0], tmp_path / "ckpt"))
    outside = tmp_path / "outside.safetensors"
    shutil.move(d / "model.safetensors", outside)
    keys = hf.folder._file_keys(outside)
    (d / hf.INDEX_FILE).write_text(json.dumps({"weight_map": {k: "../outside.safetensors" for k in keys}}))
    with pytest.raises(errors.HFCheckpointError, match=r"weight_map\['model.embed_tokens.weight'\] is "
                                                       r"'../outside.safetensors' \(a string\); expected a"):
        hf.table_of_contents(d)


def make_im_end_likeliest(model) -> None:
    """Edits a transformers Qwen3 (tied embeddings) so that <|im_end|> is the greedy next token after any input: the
    blocks add nothing to the residual, the final norm keeps one dimension, where every embedding is 1 and
    <|im_end|>'s is 2."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 1.0
        emb[TURN_END, 0] = 2.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0


def test_export_declares_the_stop_tokens_and_generate_stops_at_im_end(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_hf(load_model(load_config(model={"flavor": "tiny"})), tmp_path / "hf", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg.get("pad_token_id")) == (TEXT_END, TURN_END, None)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [TURN_END, TEXT_END] and gen["bos_token_id"] == gen["pad_token_id"] == TEXT_END
    assert (gen["do_sample"], gen["temperature"], gen["top_k"], gen["top_p"]) == (True, 0.6, 20, 0.95)

    old = tmp_path / "old"  # the export as it was: null special tokens, no generation_config.json
    shutil.copytree(out, old)
    (old / "generation_config.json").unlink()
    (old / "config.json").write_text(json.dumps({**cfg, "bos_token_id": None, "eos_token_id": None}))

    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    n = prompt["input_ids"].shape[1]
    replies = []
    for folder in (out, old):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        make_im_end_likeliest(model)
        replies.append(model.generate(**prompt, max_new_tokens=12, do_sample=False)[0, n:].tolist())
    assert replies == [[TURN_END], [TURN_END] * 12]  # stops at the turn's end; without the ids it never stops
