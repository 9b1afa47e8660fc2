"""Prepared data from elsewhere, and sources as users have them (issues 53 and 52): every crafted prepared folder is
one line in training and in `verify` (naming the file), every bad row is skipped and located or refused with
--strict, a failing tokenizer stops the worker pool, a read-only or full folder is one line with nothing
half-written left, and prepare reads JSON records and splits one-row-group parquet. All in process except the two
command-line checks (a subprocess each: exit code and stderr as a user sees them)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.run_helpers import unblocking
from workbench.core.errors import EXIT_CHECKPOINT, EXIT_CONFIG, DatasetError
from workbench.data import prepare as prep
from workbench.data.loader import PackedDataset

ROOT = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def corpus(path: Path, n: int = 60) -> Path:
    return write_jsonl(path, [{"text": f"doc {i} " + "lorem ipsum dolor " * (1 + i % 13)} for i in range(n)])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("prepared")
    prep.prepare(str(corpus(d / "c.jsonl")), d / "p", workers=1, progress=False)
    return d / "p"


# ---- 4. every crafted prepared folder: one line in training and in verify, naming the file ------------------------

def _reseal(out: Path, kind: str) -> None:
    """Makes a changed shard file's crc file and manifest entry match it again (a crafted folder, not damage)."""
    from workbench.data.manifest import digest

    f = out / "shards" / f"00000.{kind}"
    crcs, entry = digest(f)
    Path(f"{f}.crc").write_bytes(crcs)
    m = json.loads((out / "manifest.json").read_text())
    m["shards"][0]["files"][kind] = entry
    (out / "manifest.json").write_text(json.dumps(m))


def _manifest(out: Path, change) -> None:
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(change(m)) if callable(change) else change)


def _docs(out: Path, change) -> None:
    d = out / "shards" / "00000.docs"
    ends = np.fromfile(d, dtype=np.int64)
    change(ends)
    ends.tofile(d)


CRAFTED = {  # name -> (damage, the file the one line must name, what it must say)
    "a flipped byte in .docs": (lambda o: _docs(o, lambda e: e.__setitem__(3, e[3] + 1)), "00000.docs",
                                "checksum mismatch in block 0"),
    "document ends that do not rise": (lambda o: (_docs(o, lambda e: e.__setitem__(slice(2, 4), e[[3, 2]])),
                                                  _reseal(o, "docs")), "00000.docs", "ends must rise"),
    "a .docs end of 1e12": (lambda o: (_docs(o, lambda e: e.__setitem__(-1, 10**12)), _reseal(o, "docs")),
                            "00000.docs", "ends must rise"),
    "a truncated .crc": (lambda o: (o / "shards" / "00000.tokens.crc").write_bytes(b"\0\0"), "00000.tokens.crc",
                         "truncated or missing"),
    "token ids past the vocabulary": (lambda o: (_tokens_over_vocab(o), _reseal(o, "tokens")), "00000.tokens",
                                      "outside the tokenizer's vocabulary of 151,669 ids"),
    "a manifest that is not JSON": (lambda o: _manifest(o, "{not json"), "manifest.json", "is not JSON"),
    "a manifest that is a list": (lambda o: _manifest(o, "[]"), "manifest.json", "the top level is [...] (a list)"),
    "no shards": (lambda o: _manifest(o, lambda m: {k: v for k, v in m.items() if k != "shards"}), "manifest.json",
                  "shards is missing"),
    "no first_text_document": (lambda o: _manifest(o, lambda m: {k: v for k, v in m.items()
                                                                 if k != "first_text_document"}),
                               "manifest.json", "first_text_document is missing"),
    "a shard name leaving the folder": (lambda o: _manifest(o, lambda m: {**m, "shards": [
        {**m["shards"][0], "name": "../../elsewhere"}]}), "manifest.json", "a shard name of 5 digits"),
}


def _tokens_over_vocab(out: Path) -> None:
    t = out / "shards" / "00000.tokens"
    ids = np.fromfile(t, dtype=np.uint32)
    ids[5] = 10**9
    ids.tofile(t)


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_prepared_folder_is_one_line_in_training_and_in_verify(prepared, tmp_path, capsys, name):
    damage, culprit, says = CRAFTED[name]
    out = Path(shutil.copytree(prepared, tmp_path / "p"))
    damage(out)
    with pytest.raises(DatasetError) as refused:  # training: open, then read every row once
        rows = iter(PackedDataset(str(out), "", 16))
        for _ in range(100):
            next(rows)
    line = refused.value.one_line()
    assert culprit in line and says in line, line
    assert prep.main(["verify", str(out)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and culprit in err and says in err and "Traceback" not in err, err


def test_verify_names_the_side_file_whose_bytes_changed(prepared, tmp_path, capsys):
    out = Path(shutil.copytree(prepared, tmp_path / "p"))
    _docs(out, lambda e: e.__setitem__(-1, e[-1]))  # same bytes: still whole
    assert prep.main(["verify", str(out)]) == 0
    crc = out / "shards" / "00000.docs.crc"
    crc.write_bytes(bytes(b ^ 1 for b in crc.read_bytes()))
    assert prep.main(["verify", str(out)]) == EXIT_CONFIG
    assert f"shard {out / 'shards' / '00000.docs'} is corrupt: checksum mismatch in block 0" in capsys.readouterr().err


# ---- 7. every bad row skipped and located, or refused with --strict ----------------------------------------------

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


def test_strict_takes_effect_on_a_rerun(tmp_path):
    """A folder a non-strict prepare finished (bad rows skipped), or left after failing (all rows bad): --strict
    then refuses the bad row instead of reusing what was prepared without it."""
    src = write_jsonl(tmp_path / "rows.jsonl", [{"text": "good"}, {"text": None}])
    prep.prepare(str(src), tmp_path / "p", workers=1, progress=False)
    with pytest.raises(DatasetError, match=rf"bad row {src}:2 \('text' is null\) \(prepare --strict; "):
        prep.prepare(str(src), tmp_path / "p", workers=1, progress=False, strict=True)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": None}, {"text": 3}])
    with pytest.raises(DatasetError, match="no documents: 2 bad row"):
        prep.prepare(str(bad), tmp_path / "q", workers=1, progress=False)
    with pytest.raises(DatasetError, match=rf"bad row {bad}:1: 'text' is null \(prepare --strict\)"):
        prep.prepare(str(bad), tmp_path / "q", workers=1, progress=False, strict=True)


# ---- 3. nothing hangs: a failing tokenizer stops the pool; a FIFO source is refused -------------------------------

def _prepare_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m workbench.data prepare ARGS` in its own session; past `timeout` its whole group is killed (its
    workers too) and the test fails."""
    proc = subprocess.Popen([sys.executable, "-m", "workbench.data", "prepare", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"prepare {' '.join(args)} did not end within {timeout} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_tokenizer_that_fails_in_the_workers_stops_the_pool_with_one_line(tmp_path):
    """Two workers whose initializer cannot load the tokenizer: one line, exit 2, at once (a pool whose initializer
    raises starts new workers forever)."""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": "truncated')
    src = corpus(tmp_path / "c.jsonl", 300)
    proc = _prepare_cli(str(src), str(tmp_path / "p"), "--workers", "2", "--shard-mb", "0.002", "--tokenizer",
                        str(tok), timeout=60)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("workbench")]
    assert proc.returncode == EXIT_CONFIG and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"workbench: config error: the tokenizer {tok / 'tokenizer.json'}"
                                                   " cannot be used: "), lines


def test_a_fifo_source_is_refused_not_read(tmp_path):
    os.mkfifo(tmp_path / "rows.jsonl")
    with unblocking(tmp_path / "rows.jsonl") as hung, pytest.raises(DatasetError) as refused:
        prep.prepare(str(tmp_path / "rows.jsonl"), tmp_path / "p", workers=1, progress=False)
    assert not hung(), "prepare blocked on the FIFO"
    assert f"{tmp_path / 'rows.jsonl'} is a FIFO, not a regular file" in refused.value.one_line()


# ---- 10. a read-only or full folder: one line, exit 4, nothing half-written ---------------------------------------

def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "wb-test", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.parametrize("fs", ["full", "read-only"])
def test_prepare_into_a_full_or_read_only_folder_is_one_line(tmp_path, fs):
    src = corpus(tmp_path / "c.jsonl", 3000)
    where = tmp_path / "fs"
    mounted = _mount_tmpfs(where, "size=64k" if fs == "full" else "ro,size=1m")
    if not mounted:  # not root: a folder without write permission stands in for both
        os.chmod(where, 0o555)
    try:
        proc = _prepare_cli(str(src), str(where / "out"), "--workers", "1")
        left = sorted(str(p.relative_to(where)) for p in where.rglob("*"))
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], check=False)
    reason = ("No space left on device" if fs == "full" else "Read-only file system") if mounted else \
        "Permission denied"
    assert proc.returncode == EXIT_CHECKPOINT, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("workbench: disk error: writing ") and \
        f"failed: {reason}; nothing half-written was kept." in proc.stderr and "Traceback" not in proc.stderr
    assert not [p for p in left if p.endswith(".tmp")], left


# ---- 52.6: prepare reads what users have ---------------------------------------------------------------------------

def test_json_arrays_and_objects_of_records_are_read(tmp_path):
    texts = [f"record number {i} " * 5 for i in range(4)]
    (tmp_path / "array.json").write_text(json.dumps([{"text": t} for t in texts]))
    (tmp_path / "object.json").write_text(json.dumps({f"id{i}": {"text": t} for i, t in enumerate(texts)}))
    write_jsonl(tmp_path / "lines.jsonl", [{"text": t} for t in texts])
    made = {n: prep.prepare(str(tmp_path / n), tmp_path / f"p-{n}", workers=1, progress=False)
            for n in ("array.json", "object.json", "lines.jsonl")}
    assert {n: (m["documents"], m["tokens"]) for n, m in made.items()} == {
        n: (4, made["lines.jsonl"]["tokens"]) for n in made}


def test_conversations_say_chat_and_messages_name_what_the_user_typed(tmp_path):
    """chitchat's dataset.json shape (an object of conversations); the command line's own names in every message."""
    chats = {f"dlg{i}": {"messages": [[{"text": "hello", "sender": "a"}, {"text": "hi", "sender": "b"}]]}
             for i in range(3)}
    (tmp_path / "dataset.json").write_text(json.dumps(chats))
    proc = _prepare_cli(str(tmp_path / "dataset.json"), str(tmp_path / "p"), "--text-field", "messages")
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
    whole = prep.prepare(str(write_jsonl(tmp_path / "one.jsonl", [{"text": r} for r in rows])), tmp_path / "j",
                         workers=1, progress=False)
    assert len(cut["shards"]) == 3 and (cut["documents"], cut["tokens"]) == (600, whole["tokens"])
    a, b = prep.Prepared(tmp_path / "p"), prep.Prepared(tmp_path / "j")
    assert all(np.array_equal(a.document(i), b.document(i)) for i in range(600))  # the same documents, in order
