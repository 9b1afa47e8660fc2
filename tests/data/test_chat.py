"""Chat data: rendering equal to transformers' apply_chat_template for every bundled conversation, the owner mask
against an independent reading, the stop audit, bad input of every kind, packing (determinism, pad fraction,
truncate/split/drop, windows, elastic rows), and `inspect --json`. All in process."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from workbench import data
from workbench.core.errors import DatasetError
from workbench.data import chat, packing, view
from workbench.data.loader import PackedDataset, resolve
from workbench.data.prepare import prepare
from workbench.data.prepared import Prepared

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


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def bundled():
    """The bundled chat set, prepared once into the shared data cache (as training.dataset = "chitchat" does)."""
    return Prepared(resolve("chitchat", progress=False))


def chitchat_conversations() -> list[list[dict]]:
    """The test's own reading of chitchat's dataset.json: the first sender is the user, a turn's utterances are
    joined with a newline; a conversation without an assistant turn or with an empty turn is left out."""
    out = []
    for rec in json.loads(data.bundled_chat_json().read_text()).values():
        first = rec["messages"][0][0]["sender"]
        msgs = [{"role": "user" if t[0]["sender"] == first else "assistant",
                 "content": "\n".join(u["text"] for u in t)} for t in rec["messages"]]
        if any(m["role"] == "assistant" for m in msgs) and all(m["content"].strip() for m in msgs):
            out.append(msgs)
    return out


def trained_spans(tok, ids, owners, lut) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    runs = [list(g) for k, g in itertools.groupby(zip(ids.tolist(), lut[owners].tolist(), strict=True),
                                                   key=lambda x: x[1]) if k]
    return tok.backend_tokenizer.decode_batch([[t for t, _ in r] for r in runs], skip_special_tokens=False)


def write_rows(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


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
    src = write_rows(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"},
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
    src = write_rows(tmp_path / "c.jsonl", [GOOD, *BAD.values(), "not json", GOOD])
    notes: list[str] = []
    m = prepare(str(src), tmp_path / "out", tokenizer_path=str(d), workers=1, progress=False, say=notes.append,
                chat=True)
    assert m["documents"] == 2 and m["bad_rows"] == len(BAD) + 1
    assert m["bad_kinds"] == {**dict.fromkeys(BAD, 1), "unreadable": 1}
    assert f"{src}:2 (no assistant turn" in notes[-1] and "skipped 10 bad row(s)" in notes[-1]
    for k, kind in enumerate(BAD):
        rows = write_rows(tmp_path / f"s{k}.jsonl", [GOOD, GOOD, BAD[kind]])
        with pytest.raises(DatasetError, match=rf"bad row {rows}:3: .*--strict") as e:
            prepare(str(rows), tmp_path / f"strict{k}", tokenizer_path=str(d), workers=1, progress=False,
                    strict=True, chat=True)
        assert "\n" not in e.value.one_line()


def test_chat_is_detected_from_the_first_row_and_prompt_completion_rows_work(tmp_path, cache, tok):
    src = write_rows(tmp_path / "pc.jsonl", [{"prompt": "2+2?", "completion": "4"},
                                             {"prompt": [{"role": "user", "content": "Hi"}],
                                              "completion": [{"role": "assistant", "content": "Hello"}]}])
    m = prepare(str(src), tmp_path / "out", workers=1, progress=False, say=lambda _: None)
    assert m["mode"] == "chat" and m["documents"] == 2 and m["assistant_turns"] == 2
    p = Prepared(tmp_path / "out")
    assert trained_spans(tok, p.document(0), p.owners(0), chat.trained_lut()) == \
        ["<think>\n\n</think>\n\n4" + chat.IM_END]
    assert prepare(str(write_rows(tmp_path / "t.jsonl", [{"text": "plain"}])), tmp_path / "t",
                   workers=1, progress=False, say=lambda _: None)["mode"] == "text"


def test_a_flipped_mask_byte_is_caught(tmp_path, cache):
    src = write_rows(tmp_path / "c.jsonl", [GOOD] * 3)
    prepare(str(src), tmp_path / "out", workers=1, progress=False, say=lambda _: None)
    mask = tmp_path / "out" / "shards" / "00000.mask"
    b = bytearray(mask.read_bytes())
    b[5] ^= 1
    mask.write_bytes(bytes(b))
    with pytest.raises(DatasetError, match=r"00000\.mask is corrupt"):
        Prepared(tmp_path / "out").owners(1)


# ------------------------------------------------------------------------------------------------
# Packing
# ------------------------------------------------------------------------------------------------


def spec(**kw) -> packing.PackSpec:
    return packing.PackSpec(**{"seq_len": 4096, "seed": 0, "holdout": 1, **kw})


def test_bundled_packing_at_4096_pads_under_one_percent_and_drops_nothing(bundled, cache):
    rows = packing.ChatRows(bundled, spec(), "chitchat")
    st = rows.stats()
    assert st["pad_fraction"] <= 0.01 and st["dropped"] == 0
    assert st["overlong"] == 121 and st["conversations"] == 4007
    # every training conversation is in exactly one row (truncate: one piece each)
    pieces, offsets = rows.epoch(0)
    assert sorted(pieces[:, 0].tolist()) == list(range(4007))
    assert (np.diff(offsets) > 0).all()
    assert all((pieces[a:b, 2] - pieces[a:b, 1] - 1).sum() <= 4096
               for a, b in zip(offsets[:-1], offsets[1:], strict=True))


def test_packing_is_a_function_of_seed_and_epoch(bundled, cache):
    a = packing.ChatRows(bundled, spec(seq_len=512), "chitchat")
    b = packing.ChatRows(bundled, spec(seq_len=512), "chitchat")  # read back from the cache folder
    c = packing.ChatRows(bundled, spec(seq_len=512, seed=1), "chitchat")
    assert (a.dir / "pieces.npy").is_file() and str(a.dir).startswith(str(cache))
    for e in (0, 1):
        assert all(np.array_equal(x, y) for x, y in zip(a.epoch(e), b.epoch(e), strict=True))
    assert not np.array_equal(a.epoch(0)[0], a.epoch(1)[0]) and not np.array_equal(a.epoch(0)[0], c.epoch(0)[0])
    assert sorted(map(tuple, a.epoch(0)[0].tolist())) == sorted(map(tuple, a.epoch(1)[0].tolist()))
    assert a.stats(0)["rows"] == a.stats(1)["rows"]  # equal sizes are interchangeable: the same bins every epoch


def test_rows_hold_whole_pieces_with_restarting_positions_and_labels_only_on_trained_targets(bundled, cache):
    rows = packing.ChatRows(bundled, spec(seq_len=256), "chitchat")
    lut = chat.trained_lut()
    for g in range(40):
        ids, labels, pos = rows.row(g)
        at = 0
        for i, a, b in rows.row_pieces(g).tolist():
            n = b - a - 1  # the piece's last token is a target only
            tokens = bundled.document(i, a, b).astype(np.int64)
            assert ids[at:at + n].tolist() == tokens[:-1].tolist() and pos[at:at + n].tolist() == list(range(n))
            trained = lut[bundled.owners(i, a + 1, b)]
            assert labels[at:at + n].tolist() == np.where(trained, tokens[1:], -100).tolist()
            if b == bundled.lengths[i]:  # a whole conversation's last target is the newline after <|im_end|>
                assert labels[at + n - 1] == -100
            at += n
        assert (labels[at:] == -100).all() and pos[at:].tolist() == list(range(256 - at))
        assert (labels != -100).any()


def test_truncate_split_and_drop(bundled, cache):
    t, s, d = (packing.ChatRows(bundled, spec(seq_len=2048, overlong=o), "chitchat") for o in packing.OVERLONG)
    st_t, st_s, st_d = t.stats(), s.stats(), d.stats()
    over = sum(int(bundled.lengths[i]) > 2049 for i in range(4007))
    assert st_t["overlong"] == st_s["overlong"] == st_d["dropped"] == over == 409
    assert st_t["dropped"] == st_s["dropped"] == 0
    assert st_t["pieces"] == 4007 and st_s["pieces"] > 4007 and st_d["pieces"] == 4007 - over
    assert st_s["cut_tokens"] < st_t["cut_tokens"] / 100  # split keeps nearly everything
    for i, a, b, _ in t.items.tolist():
        if int(bundled.lengths[i]) > 2049:  # truncated before a turn start, or at seq_len + 1 tokens when none fits
            assert a == 0 and b <= 2049 and (bundled.document(i, b, b + 1)[0] == t.start_id or b == 2049)
    assert "conversation" in d.describe() and "> seq_len 2,048 + 1" in d.describe()
    with pytest.raises(DatasetError, match=r"409 of 4,007 conversations .* training\.max_dropped=0\.05"):
        d.check_dropped(0.05)
    d.check_dropped(0.2)


def test_best_fit_windows_keep_their_conversations_together():
    rng = np.random.default_rng(0)
    n = 40
    items = np.stack([np.arange(n), np.zeros(n, int), rng.integers(5, 65, n), np.ones(n, int)], axis=1)
    sp = packing.PackSpec(seq_len=64, window=10)
    pieces, offsets = packing.pack_epoch(items, sp, 0, n)
    rank = np.empty(n, int)
    rank[np.random.default_rng([0, 0]).permutation(n)] = np.arange(n)
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        assert len(set(rank[pieces[a:b, 0]] // 10)) == 1
        assert (pieces[a:b, 2] - pieces[a:b, 1] - 1).sum() <= 64
    assert sorted(pieces[:, 0].tolist()) == list(range(n))
    whole = packing.pack_epoch(items, packing.PackSpec(seq_len=64), 0, n)
    assert len(whole[1]) <= len(offsets)  # a window can only pack worse
    bins = packing.best_fit_decreasing(np.array([50, 30, 20, 14, 10, 5]), 64)
    assert bins.tolist() == [0, 1, 1, 1, 0, 2]  # 30+20+14 (the fuller of the two with room 14), 50+10, 5 alone


def test_rows_are_the_same_on_any_number_of_ranks_and_resume(cache):
    convs = chitchat_conversations()[:300]
    write_rows(cache.parent / "c.jsonl", [{"messages": c} for c in convs])
    src = str(cache.parent / "c.jsonl")

    def take(ds, n):
        return [(x["input"].tolist(), x["positions"].tolist(), y.tolist()) for x, y in itertools.islice(iter(ds), n)]

    whole = take(PackedDataset(src, "", 128, 0, 1, seed=3, holdout_docs=2), 6)
    r0, r1 = (take(PackedDataset(src, "", 128, r, 2, seed=3, holdout_docs=2), 3) for r in (0, 1))
    assert whole[0::2] == r0 and whole[1::2] == r1
    ds = PackedDataset(src, "", 128, 0, 2, seed=3, holdout_docs=2)
    take(ds, 2)
    one = PackedDataset(src, "", 128, 0, 1, seed=3, holdout_docs=2)
    one.load_state_dict(ds.state_dict())  # 2 ranks -> 1: the global row carries over
    assert take(one, 2) == whole[4:6]
    ds = PackedDataset(src, "", 4096, 0, 1, seed=3, holdout_docs=2)
    assert sorted(ds.streams[0].epoch(0)[0][:, 0].tolist()) == list(range(298))  # the last 2 are held out


# ------------------------------------------------------------------------------------------------
# inspect
# ------------------------------------------------------------------------------------------------


def test_inspect_json_rows_are_the_training_rows(bundled, cache):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert view.main([str(bundled.folder), "--seq-len", "256", "--rows", "3:6", "--json"]) == 0
    got = [json.loads(line) for line in out.getvalue().splitlines()]
    rows = packing.ChatRows(bundled, packing.PackSpec(seq_len=256, seed=42, holdout=1), "x")
    assert [r["row"] for r in got] == [3, 4, 5] and all(set(r) == {"row", "input_ids", "labels", "positions"}
                                                           for r in got)
    for r in got:
        ids, labels, pos = rows.row(r["row"])
        assert (r["input_ids"], r["labels"], r["positions"]) == (ids.tolist(), labels.tolist(), pos.tolist())
        starts = [i for i, p in enumerate(r["positions"]) if p == 0]
        assert starts[0] == 0 and all(r["labels"][s - 1] == -100 for s in starts[1:])
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        view.main([str(bundled.folder), "--seq-len", "256", "--rows", "3:4"])
    assert "── row 3:" in text.getvalue() and "⟦" in text.getvalue() and "<|im_end|>⟧" in text.getvalue()
    assert view.spans(got[0])[0][0] == 0


def test_heldout_conversations_are_rows_of_their_own_with_the_trained_labels(bundled):
    ids, labels = packing.heldout_rows(bundled, spec(seq_len=512), 3)
    lut = chat.trained_lut()
    assert ids.shape == labels.shape == (3, 512)
    for r, i in enumerate(range(4005, 4008)):
        doc = bundled.document(i).astype(np.int64)
        b = len(doc)
        if b > 513:  # the first piece: up to the last turn start within 513 tokens (after something trained)
            b = max(int(t) for t in np.flatnonzero(doc == 151644) if 1 < t <= 513)
            b = b if lut[bundled.owners(i, 1, b)].any() else 513
        tokens, n = doc[:b], b - 1
        assert ids[r, :n].tolist() == tokens[:-1].tolist()
        assert labels[r, :n].tolist() == np.where(lut[bundled.owners(i, 1, n + 1)], tokens[1:], -100).tolist()
        assert (labels[r, n:] == -100).all() and (labels[r] != -100).any()
    train = packing.ChatRows(bundled, spec(seq_len=512, holdout=3), "chitchat").items
    assert train[:, 0].max() == 4004


def test_packing_settings_are_checked_with_the_config():
    from workbench.core.config import load_config
    from workbench.core.errors import ConfigError

    for key, value, message in (("pack_window", 5000, "at least 10000"), ("max_dropped", 1.5, "out of range"),
                                ("loss_on", "user", "must be one of assistant, last_assistant, all"),
                                ("overlong", "wrap", "must be one of truncate, split, drop")):
        with pytest.raises(ConfigError, match=message):
            load_config("configs/cpu_dense.toml", training={key: value})
    t = load_config("configs/cpu_dense.toml", training={"pack_window": 20000, "loss_on": "all"}).training
    assert packing.PackSpec(seq_len=64, **t.chat_options()).lut().all()


def test_conversations_from_jsonl_parquet_and_a_datasets_folder_prepare_the_same(tmp_path, cache):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": c} for c in chitchat_conversations()[:30]]
    rows.append({"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."}]})
    write_rows(tmp_path / "c.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "c_ds"))
    got = {}
    for src in ("c.jsonl", "c.parquet", "c_ds"):
        m = prepare(str(tmp_path / src), tmp_path / f"{src}.out", workers=1, progress=False, say=lambda _: None)
        assert m["mode"] == "chat" and m["documents"] == 31 and m["bad_rows"] == 0
        p = Prepared(tmp_path / f"{src}.out")
        got[src] = [(p.document(i).tolist(), p.owners(i).tolist()) for i in range(len(p))]
    assert got["c.jsonl"] == got["c.parquet"] == got["c_ds"]
    assert chat.THINK | chat.LAST_TURN in got["c.jsonl"][-1][1]  # the final turn's reasoning is kept and owned
