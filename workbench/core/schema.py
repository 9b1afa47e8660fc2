"""Checks of JSON read from outside the workbench (HF `config.json` and index, `checksums.json`, the prepared
manifest): a wrong type or range is one line naming the file and the key, never a KeyError or TypeError later.

A schema is built from a few spec objects::

    Obj({"files": DictOf(Obj({"bytes": Int(0), "xxh3_64": Str(r"[0-9a-f]{16}")}))})

`check(value, spec, where)` returns the value or raises `SchemaError` ("<where>: files['a'].bytes is -1 (an
integer); expected an integer >= 0"). Extra keys of an `Obj` are allowed (files written by newer tools).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any


class SchemaError(ValueError):
    """A JSON value of the wrong type or out of range; the message names the file and the key."""


def show(value: Any) -> str:
    """A short description of a JSON value: its text (cut) and its JSON type."""
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    text = repr(value) if not isinstance(value, (list, dict)) else ("[...]" if isinstance(value, list) else "{...}")
    return text if value is None else f"{text[:60]}{'...' if len(text) > 60 else ''} ({kind})"


def _bounds(low, high, low_open=False) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}" if isinstance(low, float) else f">= {low}")
    if high is not None:
        parts.append(f"<= {high:g}" if isinstance(high, float) else f"<= {high}")
    return " and ".join(parts)


@dataclass(frozen=True)
class Int:
    """An integer (not a boolean, not 2.0) within [low, high]."""

    low: int | None = None
    high: int | None = None

    def ok(self, v) -> bool:
        return type(v) is int and (self.low is None or v >= self.low) and (self.high is None or v <= self.high)

    def __str__(self) -> str:
        bounds = _bounds(self.low, self.high)
        return "an integer" + (f" {bounds}" if bounds else "")


@dataclass(frozen=True)
class Num:
    """A finite number (an integer too, not a boolean) within its bounds."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def ok(self, v) -> bool:
        return type(v) in (int, float) and math.isfinite(v) and \
            (self.low is None or (v > self.low if self.low_open else v >= self.low)) and \
            (self.high is None or v <= self.high)

    def __str__(self) -> str:
        bounds = _bounds(self.low, self.high, self.low_open)
        return "a finite number" + (f" {bounds}" if bounds else "")


@dataclass(frozen=True)
class Str:
    """A string, matching `pattern` in full when given, at most `max_len` characters."""

    pattern: str | None = None
    max_len: int = 4096
    what: str = ""  # how to say what the pattern means

    def ok(self, v) -> bool:
        return isinstance(v, str) and len(v) <= self.max_len and \
            (self.pattern is None or re.fullmatch(self.pattern, v) is not None)

    def __str__(self) -> str:
        return self.what or (f"a string matching {self.pattern}" if self.pattern else "a string")


@dataclass(frozen=True)
class Bool:
    """true or false (not the string "false")."""

    def ok(self, v) -> bool:
        return isinstance(v, bool)

    def __str__(self) -> str:
        return "true or false"


@dataclass(frozen=True)
class Choice:
    """One of a few values."""

    values: tuple

    def ok(self, v) -> bool:
        return any(v == c and type(v) is type(c) for c in self.values)

    def __str__(self) -> str:
        return "null" if self.values == (None,) else "one of " + ", ".join(map(repr, self.values))


@dataclass(frozen=True)
class AnyOf:
    """Any one of `specs` (e.g. a number or null)."""

    specs: tuple

    def __str__(self) -> str:
        return " or ".join(map(str, self.specs))


NULL = Choice((None,))


@dataclass(frozen=True)
class ListOf:
    """A list of `item`s, at most `max_len` of them."""

    item: Any
    max_len: int | None = None

    def __str__(self) -> str:
        return "a list"


@dataclass(frozen=True)
class DictOf:
    """An object whose every key meets `key` and every value `value` (a map such as a weight map)."""

    value: Any
    key: Str = field(default_factory=Str)

    def __str__(self) -> str:
        return "an object"


@dataclass(frozen=True)
class Obj:
    """An object with these keys (each with its spec); `optional` keys are checked when present."""

    required: dict
    optional: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return "an object"


def _at(key: str, part: str | int) -> str:
    return f"{key}[{part!r}]" if isinstance(part, int) or not re.fullmatch(r"[A-Za-z_]\w*", part) else \
        (f"{key}.{part}" if key else part)


def check(value: Any, spec: Any, where: str, key: str = "") -> Any:
    """`value` if it meets `spec` (recursively), else SchemaError naming `where` and the key path."""
    def fail(expected: Any) -> SchemaError:
        return SchemaError(f"{where}: {key or 'the top level'} is {show(value)}; expected {expected}")

    if isinstance(spec, Obj):
        if not isinstance(value, dict):
            raise fail("an object")
        for k, sub in spec.required.items():
            if k not in value:
                raise SchemaError(f"{where}: {_at(key, k)} is missing")
            check(value[k], sub, where, _at(key, k))
        for k, sub in spec.optional.items():
            if k in value:
                check(value[k], sub, where, _at(key, k))
    elif isinstance(spec, DictOf):
        if not isinstance(value, dict):
            raise fail("an object")
        for k, v in value.items():
            if not spec.key.ok(k):
                raise SchemaError(f"{where}: key {show(k)} of {key or 'the top level'}; expected {spec.key}")
            check(v, spec.value, where, _at(key, k))
    elif isinstance(spec, AnyOf):
        for sub in spec.specs:
            try:
                return check(value, sub, where, key)
            except SchemaError:
                continue
        raise fail(spec)
    elif isinstance(spec, ListOf):
        if not isinstance(value, list) or (spec.max_len is not None and len(value) > spec.max_len):
            raise fail("a list" + (f" of at most {spec.max_len:,} items" if spec.max_len is not None else ""))
        for i, v in enumerate(value):
            check(v, spec.item, where, _at(key, i))
    elif not spec.ok(value):
        raise fail(spec)
    return value


__all__ = ["SchemaError", "Int", "Num", "Str", "Bool", "Choice", "AnyOf", "NULL", "ListOf", "DictOf", "Obj", "check",
           "show"]
