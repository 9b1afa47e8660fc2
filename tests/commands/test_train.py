"""workbench.train: what the launcher checks before any process group (`check_inputs`: the tokenizer and the dataset).
All in process."""

from __future__ import annotations

import pytest

from tests.data.helpers import corpus
from tests.run_helpers import ROOT
from workbench.core import errors
from workbench.core.errors import DatasetError
from workbench.data import prepare as prep
from workbench.data.loader import Stream

DENSE = ROOT / "configs/cpu_dense.toml"


def test_undecodable_file_is_a_located_bad_row(tmp_path, monkeypatch):
    """Bytes that are not UTF-8 are a bad row, skipped and located in the launcher's check (before any process
    group); `prepare --strict` refuses them in one line (tests/data/test_prepare.py)."""
    from workbench.core.config import load_config
    from workbench.data.loader import resolve
    from workbench.data.prepared import Prepared
    from workbench.train import check_inputs

    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("To be, or not to be.")
    (data / "b.txt").write_bytes(b"plain start " + bytes(range(128, 256)) * 40)
    check_inputs(load_config(DENSE, ["--training.dataset", str(data), "--training.holdout_docs", "0"]))
    m = Prepared(resolve(str(data))).manifest
    assert (m["documents"], m["bad_rows"], m["bad_examples"]) == (1, 1, [f"{data / 'b.txt'}:1 (not UTF-8 (byte 12))"])


@pytest.mark.parametrize("holdout", [0, 1])
def test_a_dataset_without_text_is_refused_whatever_holdout_docs(tmp_path, holdout, monkeypatch):
    from workbench.core.config import load_config
    from workbench.train import check_inputs

    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("")
    (data / "b.txt").write_text(" <|endoftext|>\n<|endoftext|> ")
    (data / "c.txt").write_text("\n")
    job = load_config(DENSE, ["--training.dataset", str(data), "--training.holdout_docs", str(holdout)])
    with pytest.raises(errors.DatasetError) as refused:
        check_inputs(job)
    assert refused.value.one_line() == (
        f"workbench: config error: training.dataset={str(data)!r}: its {3 - holdout} training document(s) hold no "
        "text (empty, whitespace or <|endoftext|> only). Fix: point --training.dataset at files with text.")
    (data / "a.txt").write_text("Now is the winter of our discontent")
    check_inputs(job)  # one document with text is enough


def test_check_inputs_refuses_before_training(tmp_path, monkeypatch):
    """The launcher's check (every rank, before any process group) prepares a raw dataset and refuses a bad one."""
    import workbench
    from workbench.train import check_inputs

    cache = tmp_path / "cache"
    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(cache))
    src = corpus(tmp_path, 3)
    check_inputs(workbench.load_config(DENSE, training={"dataset": str(src)}))
    assert len(list(cache.iterdir())) == 1  # prepared into the cache once
    with pytest.raises(DatasetError, match="holdout_docs=3 leaves no training documents"):
        check_inputs(workbench.load_config(DENSE,
                                           training={"dataset": str(src), "holdout_docs": 3}))
    assert Stream(prep.Prepared(next(cache.iterdir())), 0, 0, "x").total == prep.Prepared(next(cache.iterdir())
                                                                                          ).manifest["tokens"]
