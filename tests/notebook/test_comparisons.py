"""workbench.notebook.comparisons: what notebooks 05 and 06 show: the benchmark table, the H200 measurements
labelled or said to be missing."""

from __future__ import annotations

from tests.run_helpers import ROOT


def test_bench_table_is_readable():
    """Short headers with units, MFU in percent, 4 significant digits, "—" with a footnote for a missing value, no
    index (bench.csv keeps full precision)."""
    import pandas as pd

    from workbench.notebook.comparisons import bench_table

    df = pd.DataFrame({"backend": ["native", "nki_moe"], "status": ["ok", "failed"], "tokens_per_s": [401.98765, None],
                       "step_time_median_s": [0.3188812, None], "mfu": [0.0623456, None], "error": ["", "boom"]})
    t = bench_table(df)
    assert list(t.frame.columns) == ["backend", "status", "tok/s", "step median (s)", "MFU (%)", "error"]
    assert t.frame.iloc[0].tolist() == ["native", "ok", "402.0", "0.3189", "6.235", ""]
    assert t.frame.iloc[1].tolist() == ["nki_moe", "failed", "—", "—", "—", "boom"]
    assert any(n.startswith("—: no value") for n in t.footnotes)
    assert "nan" not in repr(t).lower() and "NaN" not in t._repr_html_()


def test_measured_on_h200_is_labelled_or_says_not_measured(tmp_path):
    """06 shows docs/measured_on_h200.md labelled as measured on one H200, or one line when it does not exist."""
    from workbench.notebook.comparisons import measured_on_h200

    absent = measured_on_h200(ROOT / "docs" / "no_such_file.md").data
    assert absent.startswith("**Measured on one NVIDIA H200:** not measured yet") and "\n" not in absent
    table = tmp_path / "measured_on_h200.md"
    table.write_text("Measured 2026-12-04, torch 2.14.0\n\n| backend | tok/s |\n|---|---|\n| native | 1000 |\n")
    shown = measured_on_h200(table).data
    assert shown.startswith("**Measured on one NVIDIA H200**") and "| native | 1000 |" in shown
