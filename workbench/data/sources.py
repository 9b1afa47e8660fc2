"""The documents of a raw dataset, read a piece (a "unit") at a time, with bad rows skipped and located.

A unit is a part of one file that a prepare worker reads alone: a whole .txt/.md file (one document), a byte
range of a .jsonl file cut at line ends, row groups of a .parquet file, or a whole .arrow file. Units are planned
from file sizes and parquet metadata only, so planning never reads the text.

A bad row is a null, a value that is not a string, a line that is not JSON (or not an object, or without the text
field), or bytes that are not UTF-8; it is reported as `file:line` (jsonl, text files) or `file:row` (parquet, arrow).
With `text_field=None` (conversations, `prepare --chat`) a row is the whole record, checked by `workbench.data.chat`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from workbench.core.errors import DatasetError
from workbench.data import document_sources

Unit = dict  # {"kind", "path", "start", "stop", "first", "bytes"}: see `plan_units`


def plan_units(dataset: str, text_field: str | None, unit_bytes: int) -> list[Unit]:
    """Cuts a raw dataset into units of about `unit_bytes` of source each, in the dataset's fixed order.

    Raises:
        DatasetError: a missing path, or a parquet / arrow file without the text column.
    """
    units: list[Unit] = []
    for kind, path in document_sources(dataset):
        size = path.stat().st_size
        if kind == "file":
            units.append({"kind": "text", "path": str(path), "start": 0, "stop": size, "first": 1, "bytes": size})
        elif path.suffix == ".jsonl":
            units += _jsonl_units(path, unit_bytes)
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path)
            _check_column(path, meta.schema_arrow.names, text_field)
            start, row, acc = 0, 0, 0
            rows = [meta.metadata.row_group(i) for i in range(meta.num_row_groups)]
            for i, rg in enumerate(rows):
                acc += rg.total_byte_size
                if acc >= unit_bytes or i == len(rows) - 1:
                    units.append({"kind": "parquet", "path": str(path), "start": start, "stop": i + 1, "first": row,
                                  "bytes": acc})
                    row += sum(r.num_rows for r in rows[start:i + 1])
                    start, acc = i + 1, 0
        else:
            units.append({"kind": "arrow", "path": str(path), "start": 0, "stop": 0, "first": 0, "bytes": size})
    return units


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


def _check_column(path: Path, names: list[str], field: str | None) -> None:
    if field is not None and field not in names:
        raise DatasetError(f"{path} has no column {field!r} (training.dataset_text_field); columns: {names}.",
                           f"pass --text-field with one of {names} (training.dataset_text_field).")


def read_unit(unit: Unit, text_field: str | None) -> Iterator[tuple[str, str | dict | None, str]]:
    """The documents of a unit: (location, text, "") for a good row, (location, None, reason) for a bad one; with
    `text_field=None`, (location, the whole row, "") for a row that is an object."""
    path = Path(unit["path"])
    kind = unit["kind"]
    if kind == "text":
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
        row = unit["first"]
        for column in _arrow_columns(unit, text_field):
            for value in column:
                yield _value(f"{path}:row {row}", value, text_field) if text_field else (f"{path}:row {row}", value, "")
                row += 1


def _jsonl_row(where: str, line: bytes, field: str) -> Iterator[tuple[str, str | None, str]]:
    if not line.strip():
        return  # blank lines are not rows
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        yield where, None, f"not UTF-8 (byte {e.start:,} of the line)"
        return
    except json.JSONDecodeError as e:
        yield where, None, f"not JSON ({e.msg} at column {e.colno})"
        return
    if not isinstance(row, dict):
        yield where, None, f"a JSON {type(row).__name__}, not an object"
    elif field is None:
        yield where, row, ""
    elif field not in row:
        yield where, None, f"no {field!r} key (keys: {sorted(row)[:8]})"
    else:
        yield _value(where, row[field], field)


def _value(where: str, value, field: str) -> tuple[str, str | None, str]:
    if value is None:
        return where, None, f"{field!r} is null"
    if not isinstance(value, str):
        return where, None, f"{field!r} is a {type(value).__name__}, not a string"
    return where, value, ""


def _arrow_columns(unit: Unit, field: str | None) -> Iterator[list]:
    """The text column of a parquet unit's row groups, or of an .arrow file's record batches, a batch at a time
    (field None: the rows as dicts)."""
    import pyarrow as pa

    path = Path(unit["path"])
    if unit["kind"] == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        for i in range(unit["start"], unit["stop"]):
            yield pf.read_row_group(i).to_pylist() if field is None else \
                pf.read_row_group(i, columns=[field]).column(field).to_pylist()
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
            _check_column(path, batch.schema.names, field)
            yield batch.to_pylist() if field is None else batch.column(field).to_pylist()
