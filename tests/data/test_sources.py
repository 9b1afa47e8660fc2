"""workbench.data and workbench.data.sources: what a dataset path names (text, JSON records, parquet, a datasets
folder, a hub cache, the bundled sets), the tokenizer, and every bad row of a source skipped and located, or refused
with --strict. In process but one command-line check."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from tests.data.helpers import labels, prepare_cli, take, write_jsonl, write_texts
from tests.run_helpers import unblocking
from workbench import data
from workbench.core.errors import EXIT_CONFIG, DatasetError
from workbench.data import prepare as prep
from workbench.data.loader import PackedDataset


def test_bundled_assets_are_the_real_ones():
    tok = data.load_tokenizer()
    assert tok.get_vocab_size() == 151669  # Qwen3's tokenizer (the model pads the table to 151936)
    assert tok.token_to_id("<|endoftext|>") == 151643
    assert len(data.document_sources("shakespeare")) == 38


def test_bad_rows_are_skipped_and_located_or_refused_with_strict(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = [json.dumps({"text": "good one"}), json.dumps({"text": None}), json.dumps({"text": 3}), "{not json",
             json.dumps(["a list"]), json.dumps({"body": "x"}), "", json.dumps({"text": "good two"})]
    src = tmp_path / "rows.jsonl"
    src.write_bytes("\n".join(lines).encode() + b"\n" + b'{"text": "\xff\xfe"}\n')
    m = prep.prepare(str(src), tmp_path / "p", workers=1, progress=False)
    assert (m["documents"], m["bad_rows"]) == (2, 6)
    assert [b.split(" (")[0].rsplit(":", 1)[1] for b in m["bad_examples"]] == ["2", "3", "4", "5", "6"]
    assert "'text' is null" in m["bad_examples"][0] and "not JSON" in m["bad_examples"][2]
    with pytest.raises(DatasetError, match=r"bad row .*rows.jsonl:2: 'text' is null \(prepare --strict\)"):
        prep.prepare(str(src), tmp_path / "s", workers=1, progress=False, strict=True)
    pq.write_table(pa.table({"text": ["ok", None, "fine"]}), tmp_path / "t.parquet")
    m = prep.prepare(str(tmp_path / "t.parquet"), tmp_path / "pq", workers=1, progress=False)
    assert (m["documents"], m["bad_rows"]) == (2, 1)
    assert m["bad_examples"][0].endswith("t.parquet:row 1 ('text' is null)")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "int.parquet")
    with pytest.raises(DatasetError, match=r"no documents: 2 bad row\(s\) \(first: .*row 0"):
        prep.prepare(str(tmp_path / "int.parquet"), tmp_path / "pi", workers=1, progress=False)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(DatasetError, match=r"latin1.txt:1 \(not UTF-8 \(byte 3\)\)"):
        prep.prepare(str(tmp_path / "latin1.txt"), tmp_path / "pl", workers=1, progress=False)


def test_sources_text_jsonl_parquet_and_save_to_disk(cache, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("hello world " * 50)
    (tmp_path / "txt" / "b.md").write_text("# title\n" * 20)
    rows = [f"document number {i} " * 20 for i in range(5)]
    write_texts(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.table({"body": rows}), tmp_path / "d.parquet")
    datasets.Dataset.from_dict({"text": rows + ["six"]}).save_to_disk(str(tmp_path / "hf"))
    assert len(take(PackedDataset(str(tmp_path / "txt"), "", 16, holdout_docs=1), 3)) == 3
    assert len(take(PackedDataset(str(tmp_path / "d.parquet"), "", 16, text_field="body"), 3)) == 3
    for src, field, docs in (("txt", "text", 2), ("d.jsonl", "text", 5), ("d.parquet", "body", 5), ("hf", "text", 6)):
        m = prep.prepare(str(tmp_path / src), tmp_path / f"p-{src}", workers=1, progress=False, text_field=field)
        assert m["documents"] == docs, src
    with pytest.raises(DatasetError, match=r"has no column 'text' .* columns: \['body'\]"):
        prep.prepare(str(tmp_path / "d.parquet"), tmp_path / "x", workers=1, progress=False)


def test_a_local_hub_cache_folder_reads_the_snapshot_refs_main_names(cache, tmp_path):
    """A dataset in a Hugging Face hub cache (blobs/, refs/main, snapshots/REV/ of links into blobs/): the folder
    reads as the snapshot refs/main names, older snapshots left out; without refs/main, two snapshots are refused."""
    repo = tmp_path / "hub" / "datasets--me--tiny"
    (repo / "blobs").mkdir(parents=True)
    for rev, words in (("aaa111", "old text"), ("bbb222", "new text")):
        write_texts(repo / "blobs" / rev, [f"{words} {i} " * 20 for i in range(4)])
        (repo / "snapshots" / rev / "data").mkdir(parents=True)
        (repo / "snapshots" / rev / "data" / "train.jsonl").symlink_to(repo / "blobs" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("bbb222")
    newest = repo / "snapshots" / "bbb222" / "data" / "train.jsonl"
    assert data.document_sources(str(repo)) == [("rows", newest)]
    got, want = labels(PackedDataset(str(repo), "", 16), 3), labels(PackedDataset(str(newest), "", 16), 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    (repo / "refs" / "main").unlink()
    with pytest.raises(DatasetError, match=r"hub cache folder whose refs/main does not name one of its snapshots "
                                           r"\['aaa111', 'bbb222'\]"):
        data.document_sources(str(repo))


def test_missing_empty_and_looping_paths_name_the_fix(cache, tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        data.document_sources(str(tmp_path / "nothing"))
    with pytest.raises(DatasetError, match="holds no .txt, .md, .json, .jsonl, .parquet or .arrow"):
        data.document_sources(str(tmp_path))
    with pytest.raises(DatasetError, match="training.dataset is empty"):
        data.document_sources("")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(DatasetError, match="is a symlink loop"):
        data.document_sources(str(tmp_path / "loop"))
    with pytest.raises(FileNotFoundError, match="No tokenizer.json"):
        data.load_tokenizer(str(tmp_path))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "blank.txt").write_text(" \n<|endoftext|>\n")
    with pytest.raises(DatasetError, match=r"its 1 training document\(s\) hold no text"):
        PackedDataset(str(tmp_path / "e"), "", 16)


def test_user_tokenizer_dir(tmp_path):

    shutil.copy(data.bundled_tokenizer_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    assert data.load_tokenizer(str(tmp_path)).token_to_id("<|endoftext|>") == 151643


BAD_ROWS = {  # line 2 of a jsonl file -> the reason given for it
    "a lone surrogate": ('{"text": "ok \\ud800 then"}', "a lone surrogate ('\\ud800') at character 3"),
    "100,000-deep arrays": ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply to read"),
    "a 5,000-digit integer": ('{"text": ' + "7" * 5000 + "}", "an integer of over 4,300 digits"),
}


@pytest.mark.parametrize("kind", list(BAD_ROWS))
def test_bad_rows_are_located_or_refused_with_strict(tmp_path, kind):
    row, reason = BAD_ROWS[kind]
    src = write_jsonl(tmp_path / "rows.jsonl", [{"text": "first good"}, row, {"text": "second good"}])
    m = prep.prepare(str(src), tmp_path / "p", workers=1, progress=False)
    assert (m["documents"], m["bad_rows"], m["bad_examples"]) == (2, 1, [f"{src}:2 ({reason})"])
    with pytest.raises(DatasetError) as refused:
        prep.prepare(str(src), tmp_path / "s", workers=1, progress=False, strict=True)
    assert f"bad row {src}:2: {reason} (prepare --strict)." in refused.value.one_line()


def test_a_damaged_parquet_is_a_located_bad_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "data" / "a.parquet"
    good.parent.mkdir()
    pq.write_table(pa.table({"text": [f"row {i} words" for i in range(50)]}), good)
    raw = good.read_bytes()
    (tmp_path / "data" / "b.parquet").write_bytes(raw[: len(raw) // 2])  # an interrupted download
    m = prep.prepare(str(tmp_path / "data"), tmp_path / "p", workers=1, progress=False)
    assert (m["documents"], m["bad_rows"]) == (50, 1)
    assert m["bad_examples"][0].startswith(f"{tmp_path / 'data' / 'b.parquet'} (not a readable parquet file (")
    with pytest.raises(DatasetError, match=r"bad row .*b.parquet: not a readable parquet file .*\(prepare --strict\)"):
        prep.prepare(str(tmp_path / "data"), tmp_path / "s", workers=1, progress=False, strict=True)


def test_a_fifo_source_is_refused_not_read(tmp_path):
    os.mkfifo(tmp_path / "rows.jsonl")
    with unblocking(tmp_path / "rows.jsonl") as hung, pytest.raises(DatasetError) as refused:
        prep.prepare(str(tmp_path / "rows.jsonl"), tmp_path / "p", workers=1, progress=False)
    assert not hung(), "prepare blocked on the FIFO"
    assert f"{tmp_path / 'rows.jsonl'} is a FIFO, not a regular file" in refused.value.one_line()


def test_json_arrays_and_objects_of_records_are_read(tmp_path):
    texts = [f"record number {i} " * 5 for i in range(4)]
    (tmp_path / "array.json").write_text(json.dumps([{"text": t} for t in texts]))
    (tmp_path / "object.json").write_text(json.dumps({f"id{i}": {"text": t} for i, t in enumerate(texts)}))
    write_texts(tmp_path / "lines.jsonl", texts)
    made = {n: prep.prepare(str(tmp_path / n), tmp_path / f"p-{n}", workers=1, progress=False)
            for n in ("array.json", "object.json", "lines.jsonl")}
    assert {n: (m["documents"], m["tokens"]) for n, m in made.items()} == {
        n: (4, made["lines.jsonl"]["tokens"]) for n in made}


def test_conversations_say_chat_and_messages_name_what_the_user_typed(tmp_path):
    """chitchat's dataset.json shape (an object of conversations); the command line's own names in every message."""
    chats = {f"dlg{i}": {"messages": [[{"text": "hello", "sender": "a"}, {"text": "hi", "sender": "b"}]]}
             for i in range(3)}
    (tmp_path / "dataset.json").write_text(json.dumps(chats))
    proc = prepare_cli(str(tmp_path / "dataset.json"), str(tmp_path / "p"), "--text-field", "messages")
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == EXIT_CONFIG and f"{tmp_path / 'dataset.json'}:record 'dlg0' ('messages' is a list, " \
        "not a string)" in line, proc.stderr
    assert line.endswith("Fix: 'messages' holds lists: conversations are prepared with --chat (python -m workbench.data"
                         " prepare SRC OUT --chat), or pick a text field with --text-field.")
    with pytest.raises(DatasetError) as refused:
        prep.prepare(str(tmp_path / "missing.jsonl"), tmp_path / "q", progress=False, args=("SRC", "--text-field"))
    assert refused.value.message.startswith(f"SRC={str(tmp_path / 'missing.jsonl')!r} does not exist.")
    assert refused.value.fix == "point SRC at existing data." and "training.dataset" not in refused.value.one_line()


def test_a_one_row_group_parquet_is_cut_into_shards_by_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [f"row {i} " + "words and more words " * (5 + i % 7) for i in range(600)]
    pq.write_table(pa.table({"text": rows}), tmp_path / "one.parquet", row_group_size=10**6)
    assert pq.ParquetFile(tmp_path / "one.parquet").num_row_groups == 1
    cut = prep.prepare(str(tmp_path / "one.parquet"), tmp_path / "p", workers=2, progress=False, shard_bytes=20_000)
    whole = prep.prepare(str(write_texts(tmp_path / "one.jsonl", rows)), tmp_path / "j",
                         workers=1, progress=False)
    assert len(cut["shards"]) == 3 and (cut["documents"], cut["tokens"]) == (600, whole["tokens"])
    a, b = prep.PreparedDataset(tmp_path / "p"), prep.PreparedDataset(tmp_path / "j")
    assert all(np.array_equal(a.document(i), b.document(i)) for i in range(600))  # the same documents, in order
