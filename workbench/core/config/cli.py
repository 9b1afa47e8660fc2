"""The config on the command line: `--section.key value` arguments, and the `--help` text of every key."""

from __future__ import annotations

import dataclasses
from typing import Any

from workbench.core.errors import ConfigError


def parse_cli(argv: list[str]) -> list[tuple[str, Any]]:
    """`--section.key value`, `--section.key=value`, or a bare `--flag` (true) -> [(key, value)]."""
    items, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"Unexpected argument {arg!r}: options look like --section.key value (e.g. --training.steps 30)."
            )
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            key, value = arg[2:], argv[i + 1]
            i += 2
        else:
            key, value = arg[2:], "true"
            i += 1
        items.append((key, value))
    return items


def help_text() -> str:
    """All keys with their types, defaults and one-line docs."""
    import ast
    import inspect

    from workbench.core.config.sections import ALIASES, SECTIONS

    lines = ["Options (TOML [section] key = value, or --section.key value):"]
    for name, cls in SECTIONS.items():
        docs, src = {}, ast.parse(inspect.getsource(cls))
        body = src.body[0].body
        for a, b in zip(body, body[1:], strict=False):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                docs[a.target.id] = b.value.value
        lines.append(f"  [{name}]")
        for f in dataclasses.fields(cls):
            lines.append(f"    --{name}.{f.name} (default {f.default!r}): {docs.get(f.name, '')}")
    lines.append("  Aliases: " + ", ".join(f"{a} -> {c}" for a, c in ALIASES.items()))
    return "\n".join(lines)
