"""Reading a config: the TOML file, then `--section.key value` and Python overrides (`read_config`), then every check
(`validate`); `load_config` is both.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from workbench.core.config.cli import parse_cli
from workbench.core.config.rules import BACKEND_RULES, check_device
from workbench.core.config.sections import ALIASES, SECTIONS, JobConfig
from workbench.core.errors import ConfigError


def _fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every 'section.key' -> (section, Field)."""
    return {f"{name}.{f.name}": (name, f) for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def valid_keys() -> list[str]:
    return sorted(_fields()) + sorted(ALIASES)


def _closest(key: str) -> str:
    close = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


def _field_type(section: str, f: dataclasses.Field) -> Any:
    return typing.get_type_hints(SECTIONS[section])[f.name]


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Converts a TOML or command-line value to the field's type, or raises a ConfigError."""
    origin = typing.get_origin(typ)
    if origin is Literal:
        choices = typing.get_args(typ)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}; got {value!r}.")
        return value
    if origin in (typing.Union, types.UnionType):
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        pass
    else:
        return value
    raise ConfigError(f"{key} expects {getattr(typ, '__name__', typ)}; got {value!r} ({type(value).__name__}).")


def _set(cfg: JobConfig, key: str, value: Any) -> None:
    canonical = ALIASES.get(key, key)
    fields = _fields()
    if canonical not in fields:
        section = key.split(".", 1)[0]
        sections = [f.name for f in dataclasses.fields(JobConfig)]
        if "." not in key or section not in sections:
            raise ConfigError(
                f"Unknown config key {key!r}.{_closest(key)} Sections are: {', '.join(sections)}."
            )
        raise ConfigError(f"Unknown config key {key!r}.{_closest(key)}")
    sec_name, f = fields[canonical]
    setattr(getattr(cfg, sec_name), f.name, _coerce(key, value, _field_type(sec_name, f)))


def _flatten(table: dict[str, Any], source: str) -> list[tuple[str, Any]]:
    items = []
    for section, body in table.items():
        if not isinstance(body, dict):
            raise ConfigError(
                f"{source}: top-level key {section!r} must be a [section] table.{_closest(section + '.x')}"
            )
        for key, value in body.items():
            items.append((f"{section}.{key}", value))
    return items


def load_config(path: str | os.PathLike | None = None, argv: list[str] | None = None, *,
                world_size: int = 1, **overrides: Any) -> JobConfig:
    """Reads a TOML file, applies CLI-style `argv` and keyword overrides (`read_config`), and validates the result
    (`validate`: every rule but the device's, which needs the device).

    Args:
        path: the TOML file (optional: defaults alone are the tiny CPU run).
        argv: command-line overrides, e.g. ["--training.steps", "30"]; may include --job.config_file.
        world_size: total ranks the job will run on, for the parallelism checks (default 1: one process).
        **overrides: Python overrides; use `section__key=value` or a dict per section
            (`training={"steps": 30}`).

    Raises:
        ConfigError: with a message naming the bad key/value and the fix.
    """
    cfg = read_config(path, argv, **overrides)
    validate(cfg, world_size)
    return cfg


def read_config(path: str | os.PathLike | None = None, argv: list[str] | None = None, **overrides: Any
                ) -> JobConfig:
    """The config as written: the TOML file, then `argv`, then `overrides` (`load_config`'s arguments), each value
    converted to its field's type; unchecked beyond that (`validate` checks it).

    Raises:
        ConfigError: a file that is not UTF-8 TOML, an unknown key, a value of the wrong type.
    """
    cli = parse_cli(list(argv or []))
    for key, value in cli:
        if key == "job.config_file":
            path = value
    cfg = JobConfig()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"Config file {str(p)!r} does not exist (see configs/ for examples).")
        try:
            table = tomllib.loads(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:  # binary, UTF-16, Latin-1 ...: TOML is UTF-8
            raise ConfigError(f"{p}: not a UTF-8 text file (byte {e.start}: {e.reason}); TOML config files are "
                              "UTF-8: save it as UTF-8 (or pass the right file).") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from e
        for key, value in _flatten(table, str(p)):
            _set(cfg, key, value)
        cfg.job.config_file = str(p)
    for key, value in cli:
        _set(cfg, key, value)
    for name, value in overrides.items():
        if isinstance(value, dict):
            for k, v in value.items():
                _set(cfg, f"{name}.{k}", v)
        else:
            _set(cfg, name.replace("__", "."), value)
    return cfg


def validate(cfg: JobConfig, world_size: int = 1, device_kind: str | None = None) -> None:
    """Checks everything that can be checked before training starts: each section's own `check` (the rules live
    with their section), the backend's rules right after the model section's (which resolves the shape:
    `BACKEND_RULES`), then, when the device is known, what it cannot run (`check_device`).

    Args:
        cfg: the config.
        world_size: total ranks the job runs on (1 = one process); the launcher passes torchrun's WORLD_SIZE.
        device_kind: the detected device ("cpu", "cuda", "neuron"); None skips the device's rules.
    """
    for name in SECTIONS:
        check = getattr(getattr(cfg, name), "check", None)
        if check is not None:
            check(cfg, world_size)
        if name == "model":
            BACKEND_RULES[cfg.model.backend](cfg)
    if device_kind is not None:
        check_device(cfg, device_kind)
