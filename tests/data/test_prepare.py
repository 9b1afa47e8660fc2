"""workbench.data.prepare: tokenizing a source into a prepared folder: resume after kill -9, one prepare per folder,
a source changed since, --strict on a rerun, long documents in pieces, a failing tokenizer that stops the worker
pool, a full or read-only folder (one line, nothing half-written). In process but the command-line checks (a
subprocess each: exit code and stderr as a user sees them)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.data.helpers import corpus, prepare_cli, write_jsonl, write_texts
from tests.run_helpers import ROOT
from workbench import data
from workbench.core import errors
from workbench.core.errors import EXIT_CHECKPOINT, EXIT_CONFIG, DatasetError
from workbench.data import prepare as prep


def test_undecodable_text_names_the_file_and_offset(tmp_path):
    from workbench.data.prepare import prepare

    f = tmp_path / "latin1.txt"
    f.write_bytes("naïve café".encode("latin-1"))
    with pytest.raises(errors.DatasetError) as refused:
        prepare(str(f), tmp_path / "p", strict=True, progress=False)
    assert f"bad row {f}:1: not UTF-8 (byte 2) (prepare --strict)" in refused.value.one_line()


def test_kill_9_during_prepare_then_resume(tmp_path):
    """A real `prepare` process killed with SIGKILL after its first shard: its folder is refused as unfinished, and
    the next prepare keeps the verified shards and ends with the same shards as an uninterrupted prepare."""
    src = write_texts(tmp_path / "big.jsonl", [f"row {i} " + "words and more words " * 40 for i in range(300)])
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
        prep.PreparedDataset(out)
    notes = []
    resumed = prep.prepare(str(src), out, workers=1, progress=False, shard_bytes=int(0.01 * 2**20),
                           say=notes.append)
    assert any("resuming" in n and "shards done and verified" in n for n in notes), notes
    clean = prep.prepare(str(src), tmp_path / "clean", workers=2, progress=False, shard_bytes=int(0.01 * 2**20))
    assert len(clean["shards"]) >= 10 and resumed["shards"] == clean["shards"]  # sha256 of each shard equal
    again = []
    assert prep.prepare(str(src), out, workers=1, progress=False, shard_bytes=int(0.01 * 2**20),
                        say=again.append) == resumed and again == []  # a re-run does nothing


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
        prep.PreparedDataset(out)
    with pytest.raises(DatasetError, match="another source fingerprint .* the source changed since prepare"):
        prep.prepare(str(src), out, workers=1, progress=False)


def test_long_document_is_tokenized_in_pieces(tmp_path, monkeypatch):
    text = " ".join(f"word{i % 97}" for i in range(3000))  # ~20k characters, one line
    monkeypatch.setattr(prep, "CHUNK_CHARS", 1000)
    m = prep.prepare(str(write_texts(tmp_path / "long.jsonl", [text])), tmp_path / "p", workers=1, progress=False)
    tok = data.load_tokenizer()
    whole = tok.encode(text, add_special_tokens=False).ids + [151643]
    assert m["tokens"] == len(whole)
    assert prep.PreparedDataset(tmp_path / "p").document(0).tolist() == whole  # cut at spaces: the same tokens
    monkeypatch.setattr(prep, "MAX_DOCUMENT_BYTES", 10_000)
    with pytest.raises(DatasetError, match=r"long.jsonl:1: a document of 2.,... characters is over the limit"):
        prep.prepare(str(tmp_path / "long.jsonl"), tmp_path / "p2", workers=1, progress=False)


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


def test_a_tokenizer_that_fails_in_the_workers_stops_the_pool_with_one_line(tmp_path):
    """Two workers whose initializer cannot load the tokenizer: one line, exit 2, at once (a pool whose initializer
    raises starts new workers forever)."""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": "truncated')
    src = corpus(tmp_path, 300)
    proc = prepare_cli(str(src), str(tmp_path / "p"), "--workers", "2", "--shard-mb", "0.002", "--tokenizer",
                        str(tok), timeout=60)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("workbench")]
    assert proc.returncode == EXIT_CONFIG and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"workbench: config error: the tokenizer {tok / 'tokenizer.json'}"
                                                   " cannot be used: "), lines


def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "wb-test", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.parametrize("fs", ["full", "read-only"])
def test_prepare_into_a_full_or_read_only_folder_is_one_line(tmp_path, fs):
    src = corpus(tmp_path, 3000)
    where = tmp_path / "fs"
    mounted = _mount_tmpfs(where, "size=64k" if fs == "full" else "ro,size=1m")
    if not mounted:  # not root: a folder without write permission stands in for both
        os.chmod(where, 0o555)
    try:
        proc = prepare_cli(str(src), str(where / "out"), "--workers", "1")
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
