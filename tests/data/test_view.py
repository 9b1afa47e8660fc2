"""workbench.data.view: `inspect --json` shows the rows training reads."""

from __future__ import annotations

import contextlib
import io
import json

from workbench.data import packing, view


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
