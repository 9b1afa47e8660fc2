"""workbench.data.prepare: tokenizing sources into a prepared folder: resume after kill -9, one prepare per folder,
bad rows skipped and located or refused with --strict, long documents, a failing tokenizer, a full or read-only
folder."""

from __future__ import annotations

import pytest

from workbench.core import errors


def test_undecodable_text_names_the_file_and_offset(tmp_path):
    from workbench.data.prepare import prepare

    f = tmp_path / "latin1.txt"
    f.write_bytes("naïve café".encode("latin-1"))
    with pytest.raises(errors.DatasetError) as refused:
        prepare(str(f), tmp_path / "p", strict=True, progress=False)
    assert f"bad row {f}:1: not UTF-8 (byte 2) (prepare --strict)" in refused.value.one_line()
