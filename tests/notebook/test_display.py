"""workbench.notebook.display: numbers rounded with their units, labels, and the checks table."""

from __future__ import annotations


def test_display_helpers_round_label_and_check():
    """One presentation: significant digits with separators, one memory unit per value, MFU as %, checks as ✓/✗ rows
    with the measured value and the tolerance; the text form (what nbval compares) has no index and no addresses."""
    from workbench.notebook.display import Table, checks, memory, number, percent

    assert [number(x) for x in (1773260800, 11.934203147888184, 0.0144, 109608.11688241182, None, float("nan"))] == \
        ["1,773,260,800", "11.93", "0.01440", "109,608", "—", "—"]
    assert memory(1773260800) == "1.65 GiB" and memory(3 * 2**20) == "3.00 MiB" and percent(0.0144) == "1.44 %"
    c = checks([("loss decreased", True, "11.93 → 10.5", "lower"), ("steps logged", False, 7, 8)])
    assert c.frame.values.tolist() == [["✓", "loss decreased", "11.93 → 10.5", "lower"],
                                       ["✗", "steps logged", "7", "8"]]
    t = Table.of([("a long path " * 10, 1.5)], ["what", "value (s)"], footnotes=["note"])
    assert repr(t).splitlines()[-1] == "note" and "a long path " * 10 in repr(t)  # not cut at 50 characters
    assert "<th" in t._repr_html_() and " at 0x" not in repr(t)
