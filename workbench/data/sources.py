"""The documents of a raw dataset, read a piece (a "unit") at a time, with bad rows skipped and located.

A unit is a part of one file that a prepare worker reads alone: a whole .txt/.md file (one document), a byte
range of a .jsonl file cut at line ends, a range of rows of a .parquet file (whole row groups, or a part of one
larger than a unit), a whole .json file (an array or object of records) or a whole .arrow file. Units are cut
from file sizes and parquet metadata only, so cutting never reads the text.

A bad row is a null, a value that is not a string, a line that is not JSON (or not an object, or without the text
field, nested too deeply, an integer of too many digits), bytes that are not UTF-8, a lone surrogate, or a part of a
file that cannot be decoded (a damaged parquet or arrow file); it is reported as `file:line` (jsonl, text files),
`file:row N` (parquet, arrow), `file:record K` (json) or `file:rows A-B` (a damaged part). With `text_field=None`
(conversations, `prepare --chat`) a row is the whole record, an object checked by `workbench.data.chat`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

from workbench.core.errors import DatasetError
from workbench.data import TRAINING_ARGS, document_sources, flag

Unit = dict  # {"kind", "path", "start", "stop", "first", "bytes"}: see `split_units`
BATCH_ROWS = 8192  # rows decoded at a time from a row group read in part


def split_units(dataset: str, text_field: str | None, unit_bytes: int, args: tuple[str, str] = TRAINING_ARGS
               ) -> list[Unit]:
    """Cuts a raw dataset into units of about `unit_bytes` of source each, in the dataset's fixed order.

    Args:
        args: how the user named the dataset and the text field (for messages).

    Raises:
        DatasetError: a missing path, or a parquet / arrow file without the text column.
    """
    units: list[Unit] = []
    for kind, path in document_sources(dataset, args[0]):
        size = path.stat().st_size
        if kind == "file":
            units.append({"kind": "text", "path": str(path), "start": 0, "stop": size, "first": 1, "bytes": size})
        elif path.suffix == ".jsonl":
            units += _jsonl_units(path, unit_bytes)
        elif path.suffix == ".parquet":
            units += _parquet_units(path, text_field, unit_bytes, args[1])
        else:
            units.append({"kind": path.suffix[1:], "path": str(path), "start": 0, "stop": 0, "first": 0,
                          "bytes": size})
    return units


def _parquet_units(path: Path, field: str | None, unit_bytes: int, field_arg: str) -> list[Unit]:
    """Row ranges [start, stop) of a parquet file: consecutive row groups up to `unit_bytes`, and a row group larger
    than that cut into parts of about `unit_bytes` (so `--shard-mb` and the workers apply to a one-group file). A
    file whose metadata cannot be read is one unit that reads as one bad row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        return [{"kind": "damaged", "path": str(path), "start": 0, "stop": 0, "first": 0, "bytes": path.stat().st_size,
                 "reason": f"not a readable parquet file ({_first_line(e)})"}]
    _check_column(path, meta.schema_arrow.names, field, field_arg)
    units: list[Unit] = []
    groups = [meta.metadata.row_group(i) for i in range(meta.num_row_groups)]

    def add(start: int, stop: int, nbytes: int) -> None:
        units.append({"kind": "parquet", "path": str(path), "start": start, "stop": stop, "first": start,
                      "bytes": nbytes})

    row, start, acc = 0, 0, 0
    for i, rg in enumerate(groups):
        if rg.total_byte_size > unit_bytes and rg.num_rows > 1:
            if acc:
                add(start, row, acc)
            parts = min(-(-rg.total_byte_size // unit_bytes), rg.num_rows)
            cuts = [row + rg.num_rows * k // parts for k in range(parts + 1)]
            for a, b in zip(cuts, cuts[1:], strict=False):
                add(a, b, rg.total_byte_size * (b - a) // rg.num_rows)
            row += rg.num_rows
            start, acc = row, 0
            continue
        row += rg.num_rows
        acc += rg.total_byte_size
        if acc >= unit_bytes or i == len(groups) - 1:
            add(start, row, acc)
            start, acc = row, 0
    return units


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _jsonl_units(path: Path, unit_bytes: int) -> list[Unit]:
    """Byte ranges of a jsonl file, each ending at a line end, with the line number each starts at."""
    size, units, start, line = path.stat().st_size, [], 0, 1
    with path.open("rb") as f:
        while start < size:
            f.seek(min(start + unit_bytes, size))
            f.readline()  # to the end of the line the cut fell in
            stop = min(f.tell(), size) if start + unit_bytes < size else size
            units.append({"kind": "jsonl", "path": str(path), "start": start, "stop": stop, "first": line,
                          "bytes": stop - start})
            f.seek(start)
            line += _count_newlines(f, stop - start)
            start = stop
    return units


def _count_newlines(f, n: int) -> int:
    count = 0
    while n > 0:
        block = f.read(min(n, 1 << 24))
        count, n = count + block.count(b"\n"), n - len(block)
    return count


def _check_column(path: Path, names: list[str], field: str | None, field_arg: str) -> None:
    if field is not None and field not in names:
        raise DatasetError(f"{path} has no column {field!r} ({field_arg}); columns: {names}.",
                           f"pass {flag(field_arg)} with one of {names}.")


def read_unit(unit: Unit, text_field: str | None, field_arg: str = TRAINING_ARGS[1]
              ) -> Iterator[tuple[str, str | None, str]]:
    """The documents of a unit: (location, text, "") for a good row, (location, None, reason) for a bad one."""
    path = Path(unit["path"])
    kind = unit["kind"]
    if kind == "damaged":
        yield str(path), None, unit["reason"]
    elif kind == "json":
        yield from _json_records(path, text_field)
    elif kind == "text":
        raw = path.read_bytes()
        try:
            yield f"{path}:1", raw.decode("utf-8"), ""
        except UnicodeDecodeError as e:
            yield f"{path}:{raw.count(b'\n', 0, e.start) + 1}", None, f"not UTF-8 (byte {e.start:,})"
    elif kind == "jsonl":
        with path.open("rb") as f:
            f.seek(unit["start"])
            pos, n = unit["start"], unit["first"]
            while pos < unit["stop"]:
                line = f.readline()
                if not line:
                    break
                pos += len(line)
                yield from _jsonl_row(f"{path}:{n}", line, text_field)
                n += 1
    else:
        import pyarrow as pa

        row = unit["first"]
        try:
            for column in _arrow_columns(unit, text_field, field_arg):
                for value in column:
                    yield _value(f"{path}:row {row}", value, text_field) if text_field else \
                        (f"{path}:row {row}", value, "")
                    row += 1
        except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # a truncated or damaged part of the file
            end = f"-{unit['stop'] - 1}" if kind == "parquet" else "+"
            yield f"{path}:rows {row}{end}", None, f"damaged, not read ({_first_line(e)})"


def _parse(data: bytes, line: bool) -> tuple[object, str]:
    """(value, "") of JSON bytes (a jsonl `line`, or a whole file), or (None, why not) for bytes that are not UTF-8
    JSON the reader can hold."""
    try:
        return json.loads(data.decode("utf-8")), ""
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 (byte {e.start:,}{' of the line' if line else ''})"
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg} at {'' if line else f'line {e.lineno}, '}column {e.colno})"
    except RecursionError:
        return None, "nested too deeply to read"
    except ValueError:  # an integer of more digits than Python converts (sys.int_max_str_digits)
        return None, f"an integer of over {sys.get_int_max_str_digits():,} digits"


def _jsonl_row(where: str, line: bytes, field: str | None) -> Iterator[tuple[str, str | None, str]]:
    if not line.strip():
        return  # blank lines are not rows
    row, why = _parse(line, line=True)
    yield (where, None, why) if why else _record(where, row, field)


def _json_records(path: Path, field: str | None) -> Iterator[tuple[str, str | None, str]]:
    """The records of a .json file: an array of records (`file:record 3`), an object of records keyed by id
    (`file:record 'id'`, the shape of chitchat's dataset.json), or one record."""
    value, why = _parse(path.read_bytes(), line=False)
    if why:
        yield str(path), None, why
    elif isinstance(value, list):
        for i, rec in enumerate(value):
            yield _record(f"{path}:record {i}", rec, field)
    elif isinstance(value, dict) and value and field not in value and all(isinstance(v, dict) for v in value.values()):
        for key, rec in value.items():
            yield _record(f"{path}:record {key!r}", rec, field)
    elif isinstance(value, dict):
        yield _record(f"{path}:record 0", value, field)
    else:
        yield str(path), None, f"a JSON {type(value).__name__}: not an array or object of records"


def _record(where: str, row, field: str | None) -> tuple[str, str | None, str]:
    if not isinstance(row, dict):
        return where, None, f"a JSON {type(row).__name__}, not an object"
    if field is None:  # the whole record (a conversation)
        return where, row, ""
    if field not in row:
        return where, None, f"no {field!r} key (keys: {sorted(row)[:8]})"
    return _value(where, row[field], field)


def _value(where: str, value, field: str) -> tuple[str, str | None, str]:
    if value is None:
        return where, None, f"{field!r} is null"
    if not isinstance(value, str):
        return where, None, f"{field!r} is a {type(value).__name__}, not a string"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\ud800": a string no tokenizer (or UTF-8 file) can hold
            return where, None, f"a lone surrogate ({value[e.start]!r}) at character {e.start:,}"
    return where, value, ""


def _arrow_columns(unit: Unit, field: str | None, field_arg: str) -> Iterator[list]:
    """The text column of a parquet unit's rows, or of an .arrow file's record batches, a batch at a time (field
    None: the rows as dicts)."""
    import pyarrow as pa

    path = Path(unit["path"])
    if unit["kind"] == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        first = 0
        for g in range(pf.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            lo, hi = max(unit["start"] - first, 0), min(unit["stop"] - first, n)
            columns = None if field is None else [field]
            if lo < hi and (lo, hi) == (0, n):
                table = pf.read_row_group(g, columns=columns)
                yield table.to_pylist() if field is None else table.column(field).to_pylist()
            elif lo < hi:  # a part of a large row group: decoded in batches, only [lo, hi) kept
                at = 0
                for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[g], columns=columns):
                    a, b = max(lo - at, 0), min(hi - at, batch.num_rows)
                    if a < b:
                        part = batch.slice(a, b - a)
                        yield part.to_pylist() if field is None else part.column(0).to_pylist()
                    at += batch.num_rows
                    if at >= hi:
                        break
            first += n
            if first >= unit["stop"]:
                return
        return
    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_stream(source)  # what `datasets` writes
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(reader)
        for batch in batches:
            _check_column(path, batch.schema.names, field, field_arg)
            yield batch.to_pylist() if field is None else batch.column(field).to_pylist()
