"""One way to present results in the notebooks: tables with units in the headers, meaningful rounding, no index,
no NaN, no cut text, and checks as ✓/✗ rows with the measured value and the tolerance.

Every table a notebook shows is a `Table`: its cells are already text (numbers rounded by `number`, memory by
`memory_column`), so what JupyterLab renders (`_repr_html_`) and what nbval compares (`__repr__`, `text/plain`)
are the same words, deterministic and free of object addresses. A value that does not exist is shown as "—" and
the table's footnote says why.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd

from workbench.core.units import GiB, MiB

MISSING = "—"
_NUMBER_TEXT = re.compile(r"^(|—|[<>]?\s?-?[\d,]*\.?\d+(e[+-]\d+)?\s?(%|×)?)$")
"""Cells that read as a number (right-aligned): "1,234", "0.25", "< 0.01", "26 %", "—", ""."""


def number(x: Any, digits: int = 4) -> str:
    """`x` as text rounded to `digits` significant digits, thousands separated (1234567 -> "1,234,567",
    0.0123456 -> "0.01235", 11.93420 -> "11.93"); None / NaN -> "—"; text and booleans unchanged."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return MISSING
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, int) or (float(x).is_integer() and abs(x) >= 10**digits):
        return f"{int(round(x)):,}"
    if x == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(x)))
    decimals = max(digits - 1 - magnitude, 0)
    return f"{x:,.{decimals}f}"


def memory_unit(values: Iterable[float]) -> tuple[str, int]:
    """("GiB", 2**30) when the largest of `values` (bytes) is at least 1 GiB, else ("MiB", 2**20): one unit per
    column, so no column mixes units."""
    largest = max((abs(v) for v in values if v is not None and v == v), default=0)
    return ("GiB", GiB) if largest >= GiB else ("MiB", MiB)


def memory(nbytes: float | None, unit: str | None = None) -> str:
    """Bytes as "1.65 GiB" / "12.3 MiB" (3 significant digits; `unit` forces "GiB" or "MiB")."""
    if nbytes is None or nbytes != nbytes:
        return MISSING
    name, scale = (unit, GiB if unit == "GiB" else MiB) if unit else memory_unit([nbytes])
    return f"{number(nbytes / scale, 3)} {name}"


def percent(fraction: float | None, digits: int = 3) -> str:
    """A fraction as a percentage: 0.0144 -> "1.44 %"."""
    if fraction is None or fraction != fraction:
        return MISSING
    return f"{number(100 * fraction, digits)} %"


class Table:
    """A table for reading: text cells, headers with units, no index, optional title and footnotes.

    Args:
        frame: the rows; every cell is shown as text (`number` for numbers, "—" for None / NaN).
        title: a heading above the table.
        footnotes: lines shown under the table (what "—" means, where a number comes from).
        digits: significant digits for the numbers not already text.

    Attributes:
        frame: the text cells as a DataFrame (for tests and scripts).
    """

    def __init__(self, frame: pd.DataFrame, title: str = "", footnotes: Sequence[str] = (), digits: int = 4):
        self.frame = frame.reset_index(drop=True).map(lambda v: number(v, digits)).astype(str)
        self.title, self.footnotes = title, [f for f in footnotes if f]
        self._numeric = [bool(len(self.frame)) and all(_NUMBER_TEXT.match(v) for v in self.frame[c])
                         and any(v not in ("", MISSING) for v in self.frame[c]) for c in self.frame.columns]

    @classmethod
    def of(cls, rows: Iterable[Sequence[Any]], columns: Sequence[str], **kwargs) -> Table:
        """A table from rows (tuples) and column headers."""
        return cls(pd.DataFrame(list(rows), columns=list(columns)), **kwargs)

    def column(self, name: str) -> list[str]:
        return self.frame[name].tolist()

    def __len__(self) -> int:
        return len(self.frame)

    def __repr__(self) -> str:
        body = self.frame.to_string(index=False, max_colwidth=None) if len(self.frame) else "(no rows)"
        return "\n".join([*([self.title] if self.title else []), body, *self.footnotes])

    def _repr_html_(self) -> str:
        esc = html.escape
        head = "".join(f"<th style='text-align:{'right' if num else 'left'}'>{esc(str(c))}</th>"
                       for c, num in zip(self.frame.columns, self._numeric, strict=True))
        rows = "".join(
            "<tr>" + "".join(f"<td style='text-align:{'right' if num else 'left'};white-space:pre-wrap'>"
                             f"{esc(v)}</td>" for v, num in zip(row, self._numeric, strict=True)) + "</tr>"
            for row in self.frame.itertuples(index=False))
        title = f"<b>{esc(self.title)}</b>" if self.title else ""
        notes = "".join(f"<div style='font-size:90%'>{esc(n)}</div>" for n in self.footnotes)
        return (f"<div class='wb-table'>{title}<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
                f"{notes}</div>")


def key_values(pairs: Iterable[tuple[str, Any]] | dict[str, Any], key: str = "quantity", value: str = "value",
               **kwargs) -> Table:
    """A two-column table from (name, value) pairs or a dict (never shown as a raw dict)."""
    items = pairs.items() if isinstance(pairs, dict) else pairs
    return Table.of(((k, number(v)) for k, v in items), [key, value], **kwargs)


def checks(rows: Iterable[tuple[str, bool, Any, Any]], title: str = "checks") -> Table:
    """Checks as rows: ✓ / ✗, what is checked, the measured value, the tolerance (or the expectation).

    Args:
        rows: (check, passed, measured, tolerance) each; measured / tolerance may be numbers or text.
    """
    return Table.of((("✓" if ok else "✗", name, number(measured), number(tol)) for name, ok, measured, tol in rows),
                    ["", "check", "measured", "tolerance / expected"], title=title)


def plot_title(job, steps: int | None = None, device: str | None = None, what: str = "") -> str:
    """A figure title naming what was run: config, backend, flavor, dataset, steps and device."""
    from workbench.data import dataset_label
    from workbench.platform import titan_device

    config = job.job.config_file.rsplit("/", 1)[-1] if job.job.config_file else "defaults"
    kind = device or titan_device.pinned_kind() or job.job.device  # "auto" until a run reports its device
    steps = job.training.steps if steps is None else steps
    head = f"{what} · " if what else ""
    return (f"{head}{config} · {job.model.backend} · {job.model.flavor or 'from checkpoint'} · "
            f"{dataset_label(job.training.dataset)} · {steps} steps · {kind}")


__all__ = ["Table", "number", "memory", "memory_unit", "percent", "key_values", "checks", "plot_title", "MISSING"]
