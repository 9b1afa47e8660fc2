"""Data: real tokenizer and corpus, prepared shards, deterministic packing, elastic DP sharding and resume,
mixtures, bad rows, and every refusal of a folder training must not trust (all in process but the kill -9 test)."""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from workbench import data
from workbench.core.errors import DatasetError
from workbench.data import dataset_label, mixture
from workbench.data import prepare as prep
from workbench.data.loader import (
    PackedDataset,
    PackedTextDataLoader,
    Stream,
    heldout_sets,
    mixture_report,
)

ROOT = Path(__file__).resolve().parents[2]


def take(ds, n):
    return list(itertools.islice(iter(ds), n))


def labels(ds, n):
    return [y for _, y in take(ds, n)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Raw tmp datasets are prepared into a tmp cache (Shakespeare tests keep the shared one)."""
    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_jsonl(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def corpus(tmp_path: Path, n: int = 60, name: str = "c.jsonl", word: str = "doc") -> Path:
    """n documents of different lengths (10..~120 tokens)."""
    return write_jsonl(tmp_path / name, [f"{word} {i} " + "lorem ipsum dolor " * (1 + i % 13) for i in range(n)])


def test_bundled_assets_are_the_real_ones():
    tok = data.load_tokenizer()
    assert tok.get_vocab_size() == 151669  # Qwen3's tokenizer (the model pads the table to 151936)
    assert tok.token_to_id("<|endoftext|>") == 151643
    assert len(data.document_sources("shakespeare")) == 38


def test_prepared_stream_is_the_packing_of_whole_documents():
    """The stream before prepared folders (tokenize each document whole + <|endoftext|>, concatenate in the seeded
    epoch order, cut rows of seq_len + 1) is what the prepared path yields, token for token (so the golden loss
    curves stay bit-identical)."""
    tok = data.load_tokenizer()
    files = [p for _, p in data.document_sources("shakespeare")][:-1]  # holdout_docs=1
    order = np.random.default_rng([5, 0]).permutation(len(files))
    ref = []
    for i in order[:2]:
        ref += tok.encode(files[i].read_text(), add_special_tokens=False).ids + [151643]
    rows = len(ref) // 1025
    got = labels(PackedDataset("shakespeare", "", 1024, seed=5, holdout_docs=1), rows)
    assert rows > 40
    assert all(torch.equal(got[r], torch.tensor(ref[r * 1025 + 1:(r + 1) * 1025])) for r in range(rows))
    prepared = data.loader.Prepared(data.loader.resolve("shakespeare"))
    assert (prepared.manifest["documents"], prepared.manifest["tokens"]) == (38, 1479492)
    assert prepared.tokens[0].dtype == np.uint32


def test_rows_are_shifted_and_deterministic():
    a = take(PackedDataset("shakespeare", "", seq_len=32, seed=3), 4)
    b = take(PackedDataset("shakespeare", "", seq_len=32, seed=3), 4)
    c = take(PackedDataset("shakespeare", "", seq_len=32, seed=4), 4)
    for (x, y), (x2, y2) in zip(a, b, strict=True):
        assert torch.equal(x["input"], x2["input"]) and torch.equal(y, y2)
    assert torch.equal(a[0][0]["input"][1:], a[0][1][:-1])  # labels = inputs shifted by one
    assert not torch.equal(a[0][0]["input"], c[0][0]["input"])  # the seed changes the document order


def test_dp_ranks_partition_the_single_rank_stream():
    whole = labels(PackedDataset("shakespeare", "", 16, 0, 1, seed=1), 6)
    r0 = labels(PackedDataset("shakespeare", "", 16, 0, 2, seed=1), 3)
    r1 = labels(PackedDataset("shakespeare", "", 16, 1, 2, seed=1), 3)
    assert all(torch.equal(whole[2 * i], r0[i]) and torch.equal(whole[2 * i + 1], r1[i]) for i in range(3))


def test_resume_continues_exactly_across_epochs():
    ds = PackedDataset("shakespeare", "", 4096, seed=0)  # ~360 rows per epoch
    it = iter(ds)
    for _ in range(400):  # past the end of epoch 0
        next(it)
    state = ds.state_dict()
    expected = [next(it)[1] for _ in range(3)]
    ds2 = PackedDataset("shakespeare", "", 4096, seed=0)
    ds2.load_state_dict(json.loads(json.dumps(state)))  # state is plain data
    assert state["row"] == 400 and ds.streams[0].total * 1 < 400 * 4097  # the position is in epoch 1
    assert all(torch.equal(e, g[1]) for e, g in zip(expected, take(ds2, 3), strict=True))


def loaders(dataset: str, world: int, seq: int = 64, batch: int = 2, **kw) -> list[PackedTextDataLoader]:
    cfg = PackedTextDataLoader.Config(dataset=dataset, seed=7, holdout_docs=1)
    return [PackedTextDataLoader(cfg, dp_world_size=world, dp_rank=r, tokenizer=None, seq_len=seq,
                                 local_batch_size=batch, **kw) for r in range(world)]


def interleave(batches_per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The global row order of per-rank batches: row g is rank g % W's, so within a step the ranks interleave."""
    rows = []
    for step in zip(*batches_per_rank, strict=True):
        per_rank = [list(b) for b in step]
        for i in range(len(per_rank[0])):
            rows += [rank_rows[i] for rank_rows in per_rank]
    return rows


def run_steps(lds: list[PackedTextDataLoader], steps: int) -> list[torch.Tensor]:
    its = [iter(ld) for ld in lds]
    return interleave([[next(it)[1] for _ in range(steps)] for it in its])


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_on_another_dp_degree_continues_the_global_stream(cache, tmp_path, before, after):
    """2 ranks -> 1 and 1 -> 2: the checkpointed position (one tensor, the same on every rank, saved and loaded
    through DCP) continues the union of rows exactly where the uninterrupted run is."""
    import torch.distributed.checkpoint as dcp

    src = str(corpus(tmp_path))
    whole = run_steps(loaders(src, 1, batch=4), 20)  # 80 rows of 65 tokens: into the second epoch
    first = loaders(src, before, batch=4 // before)
    head = run_steps(first, 6)
    states = [ld.state_dict() for ld in first]
    assert all(torch.equal(s["stream_position"], states[0]["stream_position"]) for s in states)
    dcp.save({"dataloader": first[0]}, checkpoint_id=str(tmp_path / "ckpt"))
    second = loaders(src, after, batch=4 // after)
    for ld in second:
        dcp.load({"dataloader": ld}, checkpoint_id=str(tmp_path / "ckpt"))
    tail = run_steps(second, 14)
    assert len(head) + len(tail) == len(whole) == 80
    assert all(torch.equal(a, b) for a, b in zip(head + tail, whole, strict=True))


def test_mixture_shares_and_heldout_per_dataset(cache, tmp_path):
    a, b = corpus(tmp_path, 50, "a.jsonl", "alpha"), corpus(tmp_path, 30, "b.jsonl", "beta")
    out_a, out_b = tmp_path / "pa", tmp_path / "pb"
    prep.prepare(str(a), out_a, workers=1, progress=False)
    prep.prepare(str(b), out_b, workers=1, progress=False)
    spec = f"{out_a}:0.7,{out_b}:0.3"
    ds = PackedDataset(spec, "", 8, seed=1, holdout_docs=2)
    it = iter(ds)
    for _ in range(10_000):
        next(it)
    counts = ds.state_dict()["counts"]
    assert sum(counts) == 10_000 and abs(counts[0] / 10_000 - 0.7) < 0.01 and abs(counts[1] / 10_000 - 0.3) < 0.01
    # every row says which member it is from: the rows of b are b's documents
    tok = data.load_tokenizer()
    for row, _ in take(PackedDataset(spec, "", 8, seed=1, holdout_docs=2), 20):
        text = tok.decode(row["input"].tolist())
        assert row["member"].item() == (1 if "beta" in text else 0) or not ("alpha" in text or "beta" in text)
    # Elastic and deterministic with a mixture too: 3 ranks' rows interleave into the 1-rank stream.
    whole = labels(PackedDataset(spec, "", 8, seed=1, holdout_docs=2), 9)
    ranks = [labels(PackedDataset(spec, "", 8, r, 3, seed=1, holdout_docs=2), 3) for r in range(3)]
    assert all(torch.equal(whole[3 * i + r], ranks[r][i]) for i in range(3) for r in range(3))
    held = heldout_sets(spec, num_docs=2)
    tok = data.load_tokenizer()
    assert list(held) == [str(out_a), str(out_b)]
    assert tok.decode(held[str(out_b)].tolist()).startswith("beta 28 ")  # the last 2 documents of b


@pytest.mark.parametrize(("spec", "refused"), [
    ("/d/a,/d/b", "member '/d/a' has no weight; a mixture needs one for every member"),
    ("/d/a:0.5,", "member 2 is empty"),
    (",/d/a:0.5", "member 1 is empty"),
    ("/d/a:nan,/d/b:1", "the weight 'nan' of '/d/a' is not a finite positive number"),
    ("/d/a:inf,/d/b:1", "the weight 'inf' of '/d/a' is not a finite positive number"),
    ("/d/a:0,/d/b:1", "the weight '0' of '/d/a' is not a finite positive number"),
    ("/d/a:-2", "the weight '-2' of '/d/a' is not a finite positive number"),
    ("/d/a:1e-300,/d/b:1e300", "the weight of '/d/a' is so much smaller than the largest one that its share is 0"),
])
def test_mixture_weights_are_given_for_every_member_and_finite(spec, refused):
    with pytest.raises(DatasetError, match="training.dataset=") as e:
        mixture(spec)
    assert refused in e.value.message


def test_mixture_weights_are_normalised_and_the_launch_says_what_each_member_gives():
    assert mixture("/d/a:0.7,/d/b:0.7") == [("/d/a", 0.5), ("/d/b", 0.5)]
    assert mixture("/d/a:1e308,/d/b:1e308") == [("/d/a", 0.5), ("/d/b", 0.5)]  # no overflow to inf (shares 0)
    assert mixture("/d/x:y") == [("/d/x:y", 1.0)] and mixture("/d/x:2") == [("/d/x", 1.0)]  # one dataset
    assert mixture_report("/d/a", [100], 10, 9) == ([], [])
    # 1,000 rows of 9 tokens at 0.7 / 0.3 over members of 63,000 and 270 tokens
    lines, warnings = mixture_report("/d/a:0.7,/d/b:0.7,/d/c:0.6", [63_000, 270, 10_000], 1000, 9)
    assert lines == [
        "workbench: training.dataset weights 0.7, 0.7, 0.6 sum to 2: normalised to shares 0.35, 0.35, 0.3.",
        "workbench: mixture member /d/a: share 0.35, 63,000 tokens, 0.05 epoch(s) over the run (350 rows of 9 "
        "tokens).",
        "workbench: mixture member /d/b: share 0.35, 270 tokens, 11.7 epoch(s) over the run (350 rows of 9 tokens).",
        "workbench: mixture member /d/c: share 0.3, 10,000 tokens, 0.27 epoch(s) over the run (300 rows of 9 tokens)."]
    assert warnings == ["workbench: warning: mixture member /d/b repeats 11.7 times over the run; lower its weight "
                        "or give it more data if that is not intended."]
    assert mixture_report("/d/a:0.5,/d/b:0.5", [1000, 1000], 10, 9)[0][0].startswith("workbench: mixture member")
    assert dataset_label("/data/web.prepared:0.7,/x/code.jsonl:0.7") == "web.prepared 0.5 + code.jsonl 0.5"
    assert dataset_label("shakespeare") == "shakespeare" and dataset_label("/d/c.prepared/") == "c.prepared"


def test_kill_9_during_prepare_then_resume(tmp_path):
    """A real `prepare` process killed with SIGKILL after its first shard: its folder is refused as unfinished, and
    the next prepare keeps the verified shards and ends with the same shards as an uninterrupted prepare."""
    src = write_jsonl(tmp_path / "big.jsonl", [f"row {i} " + "words and more words " * 40 for i in range(300)])
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "workbench.data", "prepare", str(src), str(out), "--workers", "1",
                             "--shard-mb", "0.01"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (out / "shards" / "00000.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    assert not (out / "manifest.json").exists()
    with pytest.raises(DatasetError, match="was never finished"):
        prep.Prepared(out)
    notes = []
    resumed = prep.prepare(str(src), out, workers=1, progress=False, shard_bytes=int(0.01 * 2**20),
                           say=notes.append)
    assert any("resuming" in n and "shards done and verified" in n for n in notes), notes
    clean = prep.prepare(str(src), tmp_path / "clean", workers=2, progress=False, shard_bytes=int(0.01 * 2**20))
    assert len(clean["shards"]) >= 10 and resumed["shards"] == clean["shards"]  # sha256 of each shard equal
    again = []
    assert prep.prepare(str(src), out, workers=1, progress=False, shard_bytes=int(0.01 * 2**20),
                        say=again.append) == resumed and again == []  # a re-run does nothing


def test_corrupt_truncated_shard_and_tokenizer_mismatch(cache, tmp_path):
    src = corpus(tmp_path)
    out = tmp_path / "p"
    prep.prepare(str(src), out, workers=1, progress=False)
    tokens = out / "shards" / "00000.tokens"
    raw = bytearray(tokens.read_bytes())
    raw[100] ^= 0xFF
    tokens.write_bytes(raw)
    p = prep.Prepared(out)
    with pytest.raises(DatasetError, match=r"shard .*00000\.tokens is corrupt: checksum mismatch"):
        take(PackedDataset(str(out), "", 16), 1)
    with pytest.raises(DatasetError, match=r"00000\.tokens is corrupt: its sha256"):
        p.verify()
    tokens.write_bytes(raw[:-8])
    with pytest.raises(DatasetError, match=r"shard .*00000\.tokens is truncated"):
        prep.Prepared(out)
    other = tmp_path / "tok"
    other.mkdir()
    (other / "tokenizer.json").write_text(json.dumps(json.loads((data.tokenizer_dir() / "tokenizer.json")
                                                                .read_text()), indent=1))
    with pytest.raises(DatasetError) as e:
        prep.Prepared(out, tokenizer_path=str(other))
    assert data.tokenizer_hash()[:16] in str(e.value) and data.tokenizer_hash(str(other))[:16] in str(e.value)


def test_second_concurrent_prepare_is_refused(tmp_path):
    src = corpus(tmp_path)
    out = tmp_path / "p"
    out.mkdir()
    with (out / ".lock").open("a+") as held:  # another prepare holds the folder
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 12345")
        held.flush()
        with pytest.raises(DatasetError, match="being prepared by pid 12345 right now; a second prepare into the"):
            prep.prepare(str(src), out, workers=1, progress=False)
    assert not (out / "manifest.json").exists()
    assert prep.prepare(str(src), out, workers=1, progress=False)["documents"] == 60  # free again


def test_source_changed_since_prepare_is_named(tmp_path):
    src = corpus(tmp_path)
    out = tmp_path / "p"
    before = prep.prepare(str(src), out, workers=1, progress=False)["fingerprint"]
    os.utime(src, ns=(1, 1))
    with pytest.raises(DatasetError, match=f"changed since it was prepared .*fingerprint {before[:16]} then"):
        prep.Prepared(out)
    with pytest.raises(DatasetError, match="another source fingerprint .* the source changed since prepare"):
        prep.prepare(str(src), out, workers=1, progress=False)


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


def test_long_document_is_tokenized_in_pieces(tmp_path, monkeypatch):
    text = " ".join(f"word{i % 97}" for i in range(3000))  # ~20k characters, one line
    monkeypatch.setattr(prep, "CHUNK_CHARS", 1000)
    m = prep.prepare(str(write_jsonl(tmp_path / "long.jsonl", [text])), tmp_path / "p", workers=1, progress=False)
    tok = data.load_tokenizer()
    whole = tok.encode(text, add_special_tokens=False).ids + [151643]
    assert m["tokens"] == len(whole)
    assert prep.Prepared(tmp_path / "p").document(0).tolist() == whole  # cut at spaces: the same tokens
    monkeypatch.setattr(prep, "MAX_DOCUMENT_BYTES", 10_000)
    with pytest.raises(DatasetError, match=r"long.jsonl:1: a document of 2.,... characters is over the limit"):
        prep.prepare(str(tmp_path / "long.jsonl"), tmp_path / "p2", workers=1, progress=False)


def test_sources_text_jsonl_parquet_and_save_to_disk(cache, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("hello world " * 50)
    (tmp_path / "txt" / "b.md").write_text("# title\n" * 20)
    rows = [f"document number {i} " * 20 for i in range(5)]
    write_jsonl(tmp_path / "d.jsonl", rows)
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
        write_jsonl(repo / "blobs" / rev, [f"{words} {i} " * 20 for i in range(4)])
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


def test_check_inputs_refuses_before_training(cache, tmp_path):
    """The launcher's check (every rank, before any process group) prepares a raw dataset and refuses a bad one."""
    import workbench
    from workbench.train import check_inputs

    src = corpus(tmp_path, 3)
    check_inputs(workbench.load_config(ROOT / "configs/cpu_dense.toml", training={"dataset": str(src)}))
    assert len(list(cache.iterdir())) == 1  # prepared into the cache once
    with pytest.raises(DatasetError, match="holdout_docs=3 leaves no training documents"):
        check_inputs(workbench.load_config(ROOT / "configs/cpu_dense.toml",
                                           training={"dataset": str(src), "holdout_docs": 3}))
    assert Stream(prep.Prepared(next(cache.iterdir())), 0, 0, "x").total == prep.Prepared(next(cache.iterdir())
                                                                                          ).manifest["tokens"]


def test_user_tokenizer_dir(tmp_path):
    import shutil

    shutil.copy(data.bundled_tokenizer_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    assert data.load_tokenizer(str(tmp_path)).token_to_id("<|endoftext|>") == 151643
