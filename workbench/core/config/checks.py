"""The value checks every config section uses: a range, a count, one folder name (each a one-line ConfigError)."""

from __future__ import annotations

import math
import os
from typing import Any

from workbench.core.errors import ConfigError

PATH_MAX, NAME_MAX = 4096, 255
"""Linux's limits on a path and on one name in it."""


def check_range(key: str, value: float, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False, special: str = "") -> None:
    """Refuses a value outside its range (NaN and infinities included) with one line naming the field, the value
    and the valid range.

    Args:
        key: "section.field".
        value: the value.
        low, high: the bounds (None: unbounded on that side).
        low_open, high_open: exclude the bound itself.
        special: what an out-of-range special value means, e.g. "or -1 = all ranks" (shown with the range).
    """
    name = key.rsplit(".", 1)[-1]
    ok = math.isfinite(value) and (low is None or (value > low if low_open else value >= low)) and \
        (high is None or (value < high if high_open else value <= high))
    if not ok:
        def show(bound: float) -> str:
            return f"{bound:g}" if isinstance(bound, float) else str(bound)

        lo = "" if low is None else f"{show(low)} {'<' if low_open else '<='} "
        hi = "" if high is None else f" {'<' if high_open else '<='} {show(high)}"
        also = f" {special}" if special else ""
        raise ConfigError(f"{key}={value!r} is out of range: valid is {lo}{name}{hi}{also}.")


COUNT_MAX = 10**9
"""The largest count a config takes (steps, intervals, frequencies, batch sizes, warm-up): a billion steps is
years of training, and anything larger (1e19) overflows the int64 counters and C++ timeouts downstream."""


def check_counts(section: str, obj: Any, lows: dict[str, int]) -> None:
    """Each field of `lows` is a count in [its low, COUNT_MAX]; -1 (the "unset" of several fields) is left to the
    field's own check."""
    for key, low in lows.items():
        value = getattr(obj, key)
        if value != -1:
            check_range(f"{section}.{key}", value, low, COUNT_MAX)


def check_folder_name(key: str, name: str, where: str = "inside the run folder", example: str = "checkpoint") -> None:
    """`name` is one folder name: not empty, no separator, not `.` or `..`, no NUL, at most NAME_MAX bytes.

    Raises:
        ConfigError: naming the key, the value and why (an empty experiment_name makes the dump folder itself the
            run folder; `..` or a path puts it elsewhere).
    """
    bad = (not name.strip() and "is empty") or (name in (".", "..") and "names a parent or the same folder") or \
        (("/" in name or os.sep in name) and "holds a path separator") or ("\0" in name and "holds a NUL byte") or \
        (len(name.encode()) > NAME_MAX and f"is over {NAME_MAX} bytes")
    if bad:
        raise ConfigError(f"{key}={name[:60]!r} {bad}: it must be one folder name, {where}; anything else would "
                          "write elsewhere.", f"give a plain name, e.g. --{key} {example}.")
