"""Source files -> raw records, one per line (or array element, or Parquet row).

Lines are decoded one at a time, so a malformed line, a bad byte or a huge line is quarantined
on its own and never aborts the file (unlike polars' scan_ndjson).
"""

from __future__ import annotations

import glob
import gzip
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from dflash_etl.core import schema as S
from dflash_etl.core.errors import StageError

SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson", ".json", ".json.gz", ".parquet")
RAW_KEEP_BYTES = 64 * 1024  # quarantine keeps this much of a huge line; file+line find the rest
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Unit:
    """A piece of work: a whole file, or a newline-aligned byte range of a plain JSONL file."""

    path: str
    start: int = 0
    end: int = -1  # -1: to the end of the file
    first_line: int = 1


@dataclass
class Record:
    """One decoded input record; `error` is set (and `value` is None) when decoding failed."""

    line: int
    value: Any = None
    raw: bytes = b""
    error: tuple[str, str] | None = None
    blank: bool = False


def resolve_paths(pattern: str, base_dir: Path) -> list[str]:
    """A file, a directory (all supported files below it) or a glob, relative to the config."""
    full = pattern if os.path.isabs(pattern) else str(base_dir / pattern)
    if os.path.isdir(full):
        found = [str(p) for p in sorted(Path(full).rglob("*")) if p.is_file()]
        return [p for p in found if p.endswith(SUFFIXES)]
    if any(ch in full for ch in "*?["):
        return sorted(p for p in glob.glob(full, recursive=True) if os.path.isfile(p))
    return [full] if os.path.isfile(full) else []


def plan_units(path: str, target_bytes: int = 32 * 1024 * 1024) -> list[Unit]:
    """Split a plain JSONL file into newline-aligned ranges that workers can read on their own."""
    if not path.endswith((".jsonl", ".ndjson")):
        return [Unit(path)]
    size = os.path.getsize(path)
    if size <= target_bytes:
        return [Unit(path)]
    units: list[Unit] = []
    start, line = 0, 1
    with open(path, "rb") as fh:
        while start < size:
            fh.seek(min(start + target_bytes, size))
            fh.readline()  # run on to the end of the current line
            end = min(fh.tell(), size)
            units.append(Unit(path, start, end, line))
            fh.seek(start)
            line += _count_newlines(fh, end - start)
            start = end
    return units


def _count_newlines(fh: Any, length: int) -> int:
    count = 0
    while length > 0:
        block = fh.read(min(length, 8 * 1024 * 1024))
        if not block:
            break
        count += block.count(b"\n")
        length -= len(block)
    return count


def decode_line(raw: bytes, line: int, max_bytes: int) -> Record:
    """One physical line -> a Record with a JSON value, a blank marker, or a reason code."""
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    if raw.startswith(BOM):
        raw = raw[3:]
    if not raw.strip():
        return Record(line, raw=raw, blank=True)
    if len(raw) > max_bytes:
        return Record(
            line,
            raw=raw[:RAW_KEEP_BYTES],
            error=(S.Q_LINE_TOO_LONG, f"line is {len(raw)} bytes; the limit is {max_bytes} "
                   "(raise [run] max_line_bytes to accept it)"),
        )
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as uexc:
            return Record(line, raw=raw, error=(S.Q_INVALID_UTF8, f"not UTF-8: {uexc}"))
        return Record(line, raw=raw, error=(S.Q_MALFORMED_JSON, f"malformed JSON: {exc}"))
    return Record(line, value=value, raw=raw)


def _jsonl_lines(data: bytes, first_line: int, max_bytes: int) -> Iterator[Record]:
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for offset, raw in enumerate(lines):
        yield decode_line(raw, first_line + offset, max_bytes)


def read_unit(unit: Unit, max_bytes: int) -> Iterator[Record]:
    """All records of one unit, in file order."""
    path = unit.path
    if path.endswith(".parquet"):
        yield from _parquet(path)
        return
    if path.endswith(".gz"):
        try:
            with gzip.open(path, "rb") as fh:
                data = fh.read()
        except (OSError, EOFError, zlib.error) as exc:
            raise StageError(
                f"{path}: cannot decompress ({exc}); the file is truncated or not gzip — "
                "re-create or re-download it"
            ) from None
    else:
        with open(path, "rb") as fh:
            fh.seek(unit.start)
            data = fh.read() if unit.end < 0 else fh.read(unit.end - unit.start)
    if path.endswith((".json", ".json.gz")):
        yield from _json_document(data, max_bytes)
        return
    yield from _jsonl_lines(data, unit.first_line, max_bytes)


def _json_document(data: bytes, max_bytes: int) -> Iterator[Record]:
    """A .json file is an array of rows (line = element number), a single object, or JSONL."""
    body = data[3:] if data.startswith(BOM) else data
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        yield from _jsonl_lines(data, 1, max_bytes)  # many ".json" files are really JSONL
        return
    items = value if isinstance(value, list) else [value]
    for index, item in enumerate(items):
        yield Record(index + 1, value=item, raw=b"")


def _parquet(path: str) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    line = 1
    try:
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=8192):
            for row in batch.to_pylist():
                yield Record(line, value=row, raw=b"")
                line += 1
    except (pa.ArrowException, OSError) as exc:
        raise StageError(
            f"{path}: cannot read it as Parquet after {line - 1} rows ({exc}); the file is "
            "truncated or not Parquet — re-create or re-download it, or remove it from the source"
        ) from None


def raw_text(record: Record) -> tuple[str, bytes | None]:
    """Quarantine's `raw` (text) and `raw_bytes` (only when the original is not UTF-8)."""
    raw = record.raw
    if not raw and record.value is not None:
        try:
            raw = orjson.dumps(record.value, default=str)
        except TypeError:  # e.g. an integer beyond 64 bits: no JSON for it, keep its repr
            raw = repr(record.value).encode()
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="backslashreplace"), raw
