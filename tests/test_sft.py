"""Chat fine-tuning end to end: exports that stop at the chat turn's end token."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from workbench.core.config import load_config
from workbench.platform import titan_device

titan_device.prepare("cpu")  # the fp32 reference numerics (also on machines with an accelerator)

from workbench.model import export_hf, load_model  # noqa: E402  (after the device is pinned)

pytestmark = pytest.mark.machine_cpu_path  # no launch here is held to a stored number (run_helpers.py)

TEXT_END, TURN_END = 151643, 151645  # <|endoftext|>, <|im_end|> in the bundled Qwen3 tokenizer


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
