"""workbench.data.prepared: a prepared folder from elsewhere is checked before training reads it: every crafted folder
is one line in training and in `verify` (naming the file), a corrupt or truncated shard, a tokenizer that is not the
one it was prepared with. All in process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.data.helpers import corpus, take
from workbench import data
from workbench.core.errors import EXIT_CONFIG, DatasetError
from workbench.data import prepare as prep
from workbench.data.loader import PackedDataset

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("prepared")
    prep.prepare(str(corpus(d)), d / "p", workers=1, progress=False)
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


# ---- 52.6: prepare reads what users have ---------------------------------------------------------------------------


def test_corrupt_truncated_shard_and_tokenizer_mismatch(cache, tmp_path):
    src = corpus(tmp_path)
    out = tmp_path / "p"
    prep.prepare(str(src), out, workers=1, progress=False)
    tokens = out / "shards" / "00000.tokens"
    raw = bytearray(tokens.read_bytes())
    raw[100] ^= 0xFF
    tokens.write_bytes(raw)
    p = prep.PreparedDataset(out)
    with pytest.raises(DatasetError, match=r"shard .*00000\.tokens is corrupt: checksum mismatch"):
        take(PackedDataset(str(out), "", 16), 1)
    with pytest.raises(DatasetError, match=r"00000\.tokens is corrupt: its sha256"):
        p.verify()
    tokens.write_bytes(raw[:-8])
    with pytest.raises(DatasetError, match=r"shard .*00000\.tokens is truncated"):
        prep.PreparedDataset(out)
    other = tmp_path / "tok"
    other.mkdir()
    (other / "tokenizer.json").write_text(json.dumps(json.loads((data.tokenizer_dir() / "tokenizer.json")
                                                                .read_text()), indent=1))
    with pytest.raises(DatasetError) as e:
        prep.PreparedDataset(out, tokenizer_path=str(other))
    assert data.tokenizer_hash()[:16] in str(e.value) and data.tokenizer_hash(str(other))[:16] in str(e.value)
