"""workbench.hf_weights.export: any model back out as a transformers folder, atomically: round trips through
transformers, bfloat16, the stop tokens `generate` needs, and exports that cannot clobber (an existing target, a
target under a file or read-only, two exports racing, a full disk, a failure midway)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.hf_weights.helpers import TOL, stored_keys
from tests.run_helpers import hf_logits, max_diff
from workbench import hf_weights as hf
from workbench.core import errors
from workbench.core.config import load_config
from workbench.model import export_hf, load_model

TEXT_END, TURN_END = 151643, 151645  # <|endoftext|>, <|im_end|> in the bundled Qwen3 tokenizer

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)


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

