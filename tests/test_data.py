"""Data: real tokenizer and corpus, deterministic packing, DP sharding, resumability, user data, errors."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from workbench import data


def take(ds, n):
    return list(itertools.islice(iter(ds), n))


def test_bundled_assets_are_the_real_ones():
    tok = data.load_tokenizer()
    assert tok.get_vocab_size() == 151669  # Qwen3's tokenizer (the model pads the table to 151936)
    assert tok.token_to_id("<|endoftext|>") == 151643
    assert len(data.document_sources("shakespeare")) == 38


def test_rows_are_shifted_and_deterministic():
    a = take(data.PackedDataset("shakespeare", "", seq_len=32, seed=3), 4)
    b = take(data.PackedDataset("shakespeare", "", seq_len=32, seed=3), 4)
    c = take(data.PackedDataset("shakespeare", "", seq_len=32, seed=4), 4)
    for (x, y), (x2, y2) in zip(a, b, strict=True):
        assert torch.equal(x["input"], x2["input"]) and torch.equal(y, y2)
    assert torch.equal(a[0][0]["input"][1:], a[0][1][:-1])  # labels = inputs shifted by one
    assert not torch.equal(a[0][0]["input"], c[0][0]["input"])  # the seed changes the document order


def test_dp_ranks_partition_the_single_rank_stream():
    whole = take(data.PackedDataset("shakespeare", "", 16, 0, 1, seed=1), 6)
    r0 = take(data.PackedDataset("shakespeare", "", 16, 0, 2, seed=1), 3)
    r1 = take(data.PackedDataset("shakespeare", "", 16, 1, 2, seed=1), 3)
    assert all(torch.equal(whole[2 * i][1], r0[i][1]) and torch.equal(whole[2 * i + 1][1], r1[i][1]) for i in range(3))


def test_resume_continues_exactly_across_epochs():
    ds = data.PackedDataset("shakespeare", "", 4096, seed=0)  # ~360 rows per epoch
    it = iter(ds)
    for _ in range(400):  # past the end of epoch 0
        next(it)
    state = ds.state_dict()
    expected = [next(it)[1] for _ in range(3)]
    ds2 = data.PackedDataset("shakespeare", "", 4096, seed=0)
    ds2.load_state_dict(json.loads(json.dumps(state)))  # state is plain data
    assert state["epoch"] == 1
    assert all(torch.equal(e, g[1]) for e, g in zip(expected, take(ds2, 3), strict=False))


def test_user_text_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("hello world " * 50)
    rows = [{"text": f"document number {i} " * 20} for i in range(5)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    pq.write_table(pa.table({"body": [r["text"] for r in rows]}), tmp_path / "d.parquet")
    assert len(take(data.PackedDataset(str(tmp_path / "txt"), "", 16), 3)) == 3
    assert len(data.document_sources(str(tmp_path / "d.jsonl"))) == 5
    assert len(take(data.PackedDataset(str(tmp_path / "d.parquet"), "", 16, text_field="body"), 3)) == 3
    with pytest.raises(KeyError, match="no column 'text'"):
        data.document_sources(str(tmp_path / "d.parquet"))


def test_missing_paths_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist. Use 'shakespeare'"):
        data.document_sources(str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="holds no .txt, .md, .jsonl or .parquet"):
        data.document_sources(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="No tokenizer.json"):
        data.load_tokenizer(str(tmp_path))


def test_user_tokenizer_dir(tmp_path):
    import shutil

    shutil.copy(data.bundled_tokenizer_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    assert data.load_tokenizer(str(tmp_path)).token_to_id("<|endoftext|>") == 151643
