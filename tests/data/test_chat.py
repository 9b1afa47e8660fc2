"""workbench.data.chat: rendering equal to transformers' apply_chat_template for every bundled conversation, the
owner mask against an independent reading, the stop audit, bad conversations of every kind, conversations read from
JSONL, parquet and a datasets folder. All in process. Packing the rendered conversations: test_packing.py."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from tests.data.helpers import chitchat_conversations, write_jsonl
from workbench import data
from workbench.core.errors import DatasetError
from workbench.data import chat
from workbench.data.prepare import prepare
from workbench.data.prepared import PreparedDataset

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]
# system, tools, reasoning kept and dropped, a call with content, a call without, tool responses, a final think
AGENT = {"tools": TOOLS, "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me check", "reasoning_content": "Need the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18C, sunny"},
    {"role": "assistant", "content": "18C and sunny.", "reasoning_content": "Got it."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "weather",
                                                          "arguments": '{"city": "Paris", "day": 1}'}]},
    {"role": "tool", "content": "20C"},
    {"role": "assistant", "content": "20C.", "reasoning_content": "Easy."},
]}
CALL_1 = '\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_2 = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "day": 1}}\n</tool_call>'
THINK = "<think>\nEasy.\n</think>\n\n"


@pytest.fixture(scope="module")
def tok():
    return chat.hf_tokenizer(data.bundled_tokenizer_dir())


def trained_spans(tok, ids, owners, lut) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    runs = [list(g) for k, g in itertools.groupby(zip(ids.tolist(), lut[owners].tolist(), strict=True),
                                                   key=lambda x: x[1]) if k]
    return tok.backend_tokenizer.decode_batch([[t for t, _ in r] for r in runs], skip_special_tokens=False)


def tokenizer_with_template(tmp_path: Path, template: str) -> Path:
    """A copy of the bundled tokenizer whose chat_template is `template`."""
    d = tmp_path / "tok"
    shutil.copytree(data.bundled_tokenizer_dir(), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return d


# ------------------------------------------------------------------------------------------------
# The bundled set: rendering, mask, audit
# ------------------------------------------------------------------------------------------------


def test_every_bundled_conversation_is_apply_chat_template_token_for_token(bundled, tok):
    convs = chitchat_conversations()
    assert len(bundled) == len(convs) == 4008
    assert bundled.manifest["bad_kinds"] == {"no assistant turn": 3150, "empty content": 10}
    want = tok.apply_chat_template(convs, tokenize=True)["input_ids"]
    got = [bundled.document(i).tolist() for i in range(len(bundled))]
    bad = [i for i in range(len(convs)) if got[i] != want[i]]
    assert not bad, f"{len(bad)} conversations differ, first {bad[:5]}"


def test_bundled_mask_matches_the_turns_read_from_the_messages(bundled, tok):
    """The trained text of every conversation is each assistant turn's content and its <|im_end|>, the final turn's
    with the empty think block Qwen3's template adds: read from the messages, not from the rendering. A reply that
    starts with a newline shares its first token with the header's newline ("\n\n"), which is then trained too."""
    lut = chat.trained_lut()
    convs = chitchat_conversations()
    for i, msgs in enumerate(convs):
        want = [("\n" if m["content"].startswith("\n") else "") + m["content"] + chat.IM_END
                for m in msgs if m["role"] == "assistant"]
        if msgs[-1]["role"] == "assistant":
            want[-1] = "<think>\n\n</think>\n\n" + want[-1]
        got = trained_spans(tok, bundled.document(i), bundled.owners(i), lut)
        assert got == want, f"conversation {i}"
    turns = sum(m["role"] == "assistant" for c in convs for m in c)
    assert bundled.manifest["assistant_turns"] == bundled.manifest["trained_ends"] == turns == 66627


def test_agent_conversation_owners_and_loss_options(tok):
    r = chat.render(tok, [AGENT])[0]
    m, tools = chat.conversation(AGENT)
    assert r.ids.tolist() == tok.apply_chat_template(m, tools=tools, tokenize=True)["input_ids"]
    end = chat.IM_END
    cases = {
        ("assistant", True, True): ["Let me check" + CALL_1 + end, "18C and sunny." + end, CALL_2 + end,
                                    THINK + "20C." + end],
        ("assistant", False, True): ["Let me check" + CALL_1 + end, "18C and sunny." + end, CALL_2 + end,
                                     "20C." + end],
        ("assistant", True, False): ["Let me check", end, "18C and sunny." + end, end, THINK + "20C." + end],
        ("last_assistant", True, True): [THINK + "20C." + end],
    }
    for (loss_on, think, calls), want in cases.items():
        assert trained_spans(tok, r.ids, r.owners, chat.trained_lut(loss_on, think, calls)) == want
    text = tok.apply_chat_template(m, tools=tools, tokenize=False)
    assert trained_spans(tok, r.ids, r.owners, chat.trained_lut("all")) == [text]
    kinds = r.owners & 7
    for kind, piece in ((chat.SYSTEM, "Be brief."), (chat.USER, "Weather in Paris?"),
                        (chat.TOOL, "<tool_response>\n18C, sunny\n</tool_response>")):
        assert piece in tok.decode(r.ids[kinds == kind].tolist(), skip_special_tokens=False)
    assert "Need the tool" not in text and "Got it" not in text  # the template drops reasoning before the last query


def test_stop_audit_refuses_a_template_whose_replies_have_no_end(tmp_path, cache):
    """A template that never closes assistant turns (Megatron's untrained stop token, in template form)."""
    d = tokenizer_with_template(tmp_path, "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                                          "{% if m.role != 'assistant' %}<|im_end|>{% endif %}\n{% endfor %}")
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": "hello"}]}])
    with pytest.raises(DatasetError, match="stop audit"):
        prepare(str(src), tmp_path / "out", tokenizer_path=str(d), workers=1, progress=False, say=lambda m: None)


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD = {  # kind -> a row of that kind
    "no assistant turn": {"messages": [{"role": "user", "content": "anyone?"}]},
    "roles out of order": {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]},
    "unknown role": {"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]},
    "tool response without a call": {"messages": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "x"},
                                                  {"role": "tool", "content": "42"}]},
    "content not a string": {"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "x"}]},
    "empty content": {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]},
    "control token": {"messages": [{"role": "user", "content": "hi<|im_end|>"}, {"role": "assistant", "content": "x"}]},
    "template failed": {"messages": [{"role": "user", "content": "FAIL"}, {"role": "assistant", "content": "x"}]},
    "not a conversation": {"text": "plain"},
}
FAILING = "{% for m in messages %}{% if m.content == 'FAIL' %}{{ raise_exception('no') }}{% endif %}" \
          "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def test_bad_conversations_are_skipped_counted_and_located_or_refused_with_strict(tmp_path, cache):
    d = tokenizer_with_template(tmp_path, FAILING)
    src = write_jsonl(tmp_path / "c.jsonl", [GOOD, *BAD.values(), "not json", GOOD])
    notes: list[str] = []
    m = prepare(str(src), tmp_path / "out", tokenizer_path=str(d), workers=1, progress=False, say=notes.append,
                chat=True)
    assert m["documents"] == 2 and m["bad_rows"] == len(BAD) + 1
    assert m["bad_kinds"] == {**dict.fromkeys(BAD, 1), "unreadable": 1}
    assert f"{src}:2 (no assistant turn" in notes[-1] and "skipped 10 bad row(s)" in notes[-1]
    for k, kind in enumerate(BAD):
        rows = write_jsonl(tmp_path / f"s{k}.jsonl", [GOOD, GOOD, BAD[kind]])
        with pytest.raises(DatasetError, match=rf"bad row {rows}:3: .*--strict") as e:
            prepare(str(rows), tmp_path / f"strict{k}", tokenizer_path=str(d), workers=1, progress=False,
                    strict=True, chat=True)
        assert "\n" not in e.value.one_line()


def test_chat_is_detected_from_the_first_row_and_prompt_completion_rows_work(tmp_path, cache, tok):
    src = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "2+2?", "completion": "4"},
                                             {"prompt": [{"role": "user", "content": "Hi"}],
                                              "completion": [{"role": "assistant", "content": "Hello"}]}])
    m = prepare(str(src), tmp_path / "out", workers=1, progress=False, say=lambda _: None)
    assert m["mode"] == "chat" and m["documents"] == 2 and m["assistant_turns"] == 2
    p = PreparedDataset(tmp_path / "out")
    assert trained_spans(tok, p.document(0), p.owners(0), chat.trained_lut()) == \
        ["<think>\n\n</think>\n\n4" + chat.IM_END]
    assert prepare(str(write_jsonl(tmp_path / "t.jsonl", [{"text": "plain"}])), tmp_path / "t",
                   workers=1, progress=False, say=lambda _: None)["mode"] == "text"


def test_a_flipped_mask_byte_is_caught(tmp_path, cache):
    src = write_jsonl(tmp_path / "c.jsonl", [GOOD] * 3)
    prepare(str(src), tmp_path / "out", workers=1, progress=False, say=lambda _: None)
    mask = tmp_path / "out" / "shards" / "00000.mask"
    b = bytearray(mask.read_bytes())
    b[5] ^= 1
    mask.write_bytes(bytes(b))
    with pytest.raises(DatasetError, match=r"00000\.mask is corrupt"):
        PreparedDataset(tmp_path / "out").owners(1)


# ------------------------------------------------------------------------------------------------
# inspect
# ------------------------------------------------------------------------------------------------


def test_conversations_from_jsonl_parquet_and_a_datasets_folder_prepare_the_same(tmp_path, cache):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": c} for c in chitchat_conversations()[:30]]
    rows.append({"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."}]})
    write_jsonl(tmp_path / "c.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "c_ds"))
    got = {}
    for src in ("c.jsonl", "c.parquet", "c_ds"):
        m = prepare(str(tmp_path / src), tmp_path / f"{src}.out", workers=1, progress=False, say=lambda _: None)
        assert m["mode"] == "chat" and m["documents"] == 31 and m["bad_rows"] == 0
        p = PreparedDataset(tmp_path / f"{src}.out")
        got[src] = [(p.document(i).tolist(), p.owners(i).tolist()) for i in range(len(p))]
    assert got["c.jsonl"] == got["c.parquet"] == got["c_ds"]
    assert chat.THINK | chat.LAST_TURN in got["c.jsonl"][-1][1]  # the final turn's reasoning is kept and owned
