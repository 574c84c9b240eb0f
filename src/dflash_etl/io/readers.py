"""Source files -> raw records, one per line (or array element, or Parquet row).

Everything streams in bounded chunks: a line (or array element) is decoded on its own, so a
malformed line, a bad byte or a huge line is quarantined alone and never aborts the file (unlike
polars' scan_ndjson), and memory stays near one chunk plus one record whatever the file's size.
A file that cannot be read (not gzip, not Parquet, cut short) or a compressed file that expands
past its ceiling ends in one file-level record with a reason, after the rows read before it.
"""

from __future__ import annotations

import fnmatch
import gzip
import os
import re
import zlib
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from dflash_etl.core import schema as S

SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson", ".json", ".json.gz", ".parquet")
RAW_KEEP_BYTES = 64 * 1024  # quarantine keeps this much of a huge line; file+line find the rest
BOM = b"\xef\xbb\xbf"
CHUNK = 1024 * 1024  # bytes read at a time
DEFAULT_MAX_DECOMPRESSED = 64 * 1024**3
_READ_ERRORS = (OSError, EOFError, zlib.error)


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


# ---------------------------------------------------------------- finding the files
@dataclass
class Resolved:
    """The files a source's path names, and what was skipped on the way (`skipped` counts
    `duplicate_file`: a second path to a file already found, e.g. through a symlink, and
    `visited_directory`: a directory reached again, e.g. through a symlink loop)."""

    paths: list[str] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)


def _is_magic(text: str) -> bool:
    return any(ch in text for ch in "*?[")


def _closure(states: set[int], segs: list[str]) -> set[int]:
    """States plus those reached by letting a `**` match no directory."""
    out, todo = set(states), list(states)
    while todo:
        s = todo.pop()
        if s < len(segs) and segs[s] == "**" and s + 1 not in out:
            out.add(s + 1)
            todo.append(s + 1)
    return out


def _step(states: set[int], name: str, segs: list[str], hidden: bool) -> set[int]:
    """The pattern states after one more path component `name` (glob's rules: `*` and `**`
    skip names starting with '.' unless the pattern spells the dot, or `hidden`)."""
    nxt: set[int] = set()
    dot = name.startswith(".") and not hidden
    for s in _closure(states, segs):
        if s >= len(segs):
            continue
        seg = segs[s]
        if seg == "**":
            if not dot:
                nxt.add(s)
        elif (not dot or seg.startswith(".")) and fnmatch.fnmatchcase(name, seg):
            nxt.add(s + 1)
    return nxt


def _walk(base: str, segs: list[str], hidden: bool, out: Resolved) -> list[str]:
    """Files below `base` whose relative path matches `segs`; every directory is entered once
    (by device and inode), plain directories before symlinked ones, so a symlink loop or a
    second link to the same directory is never followed (and counted)."""
    found: list[str] = []
    visited: set[tuple[int, int]] = set()
    links: deque[tuple[str, set[int]]] = deque()
    stack: list[tuple[str, set[int]]] = [(base, {0})]
    while stack or links:
        directory, states = stack.pop() if stack else links.popleft()
        try:
            info = os.stat(directory)
            entries = sorted(os.scandir(directory), key=lambda e: e.name, reverse=True)
        except OSError:
            continue
        if (info.st_dev, info.st_ino) in visited:
            out.skipped["visited_directory"] += 1
            continue
        visited.add((info.st_dev, info.st_ino))
        for entry in entries:
            nxt = _step(states, entry.name, segs, hidden)
            if not nxt:
                continue
            try:
                is_dir = entry.is_dir()
                is_file = not is_dir and entry.is_file()
            except OSError:
                continue
            if is_dir and any(s < len(segs) for s in nxt):
                (links.append if entry.is_symlink() else stack.append)((entry.path, nxt))
            elif is_file and len(segs) in _closure(nxt, segs):
                found.append(entry.path)
    return found


def resolve_source(pattern: str, base_dir: Path) -> Resolved:
    """A file, a directory (all supported files below it) or a glob (`**` for any depth),
    relative to the config; each real file once, in path order."""
    full = pattern if os.path.isabs(pattern) else str(base_dir / pattern)
    out = Resolved()
    if os.path.isdir(full):
        candidates = [p for p in _walk(full, ["**", "*"], True, out) if p.endswith(SUFFIXES)]
    elif _is_magic(full):
        parts = full.split(os.sep)
        k = next(i for i, part in enumerate(parts) if _is_magic(part))
        base = os.sep.join(parts[:k]) or (os.sep if k else os.curdir)
        segs = [p for p in parts[k:] if p]
        candidates = _walk(base, segs, False, out) if os.path.isdir(base) else []
        if not k:  # a relative pattern from here: paths as glob writes them
            candidates = [os.path.relpath(p) for p in candidates]
    else:
        candidates = [full] if os.path.isfile(full) else []
    seen: set[str] = set()
    for path in sorted(candidates):
        real = os.path.realpath(path)
        if real in seen:
            out.skipped["duplicate_file"] += 1
            continue
        seen.add(real)
        out.paths.append(path)
    return out


def resolve_paths(pattern: str, base_dir: Path) -> list[str]:
    """The files of `resolve_source`, without what was skipped."""
    return resolve_source(pattern, base_dir).paths


# ---------------------------------------------------------------- planning
def _skip_to_newline(fh: BinaryIO) -> None:
    """Move past the next newline in bounded reads (a huge line is never held whole)."""
    while True:
        block = fh.read(CHUNK)
        if not block:
            return
        at = block.find(b"\n")
        if at >= 0:
            fh.seek(at + 1 - len(block), os.SEEK_CUR)
            return


def plan_units(path: str, target_bytes: int = 32 * 1024 * 1024) -> list[Unit]:
    """Split a plain JSONL file into newline-aligned ranges that workers can read on their own."""
    if not path.endswith((".jsonl", ".ndjson")):
        return [Unit(path)]
    try:
        size = os.path.getsize(path)
    except OSError:
        return [Unit(path)]  # read_unit reports it
    if size <= target_bytes:
        return [Unit(path)]
    units: list[Unit] = []
    start, line = 0, 1
    with open(path, "rb") as fh:
        while start < size:
            fh.seek(min(start + target_bytes, size))
            _skip_to_newline(fh)  # run on to the end of the current line
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


# ---------------------------------------------------------------- decoding
def decode_line(raw: bytes, line: int, max_bytes: int) -> Record:
    """One physical line -> a Record with a JSON value, a blank marker, or a reason code."""
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    if raw.startswith(BOM):
        raw = raw[3:]
    if not raw.strip():
        return Record(line, raw=raw, blank=True)
    if len(raw) > max_bytes:
        return _too_long(line, raw[:RAW_KEEP_BYTES], len(raw), max_bytes)
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as uexc:
            return Record(line, raw=raw, error=(S.Q_INVALID_UTF8, f"not UTF-8: {uexc}"))
        return Record(line, raw=raw, error=(S.Q_MALFORMED_JSON, f"malformed JSON: {exc}"))
    return Record(line, value=value, raw=raw)


def _too_long(line: int, head: bytes, size: int, max_bytes: int, what: str = "line") -> Record:
    return Record(
        line, raw=head,
        error=(S.Q_LINE_TOO_LONG, f"{what} is {size} bytes; the limit is {max_bytes} "
               "(raise [run] max_line_bytes to accept it)"),
    )


class _Stream:
    """A binary stream read in chunks: a byte range of a file, or a decompressed file under a
    size ceiling. Read errors and the ceiling end the stream and are kept in `failure` (a
    reason, a message), so the rows before them still count."""

    def __init__(self, fh: BinaryIO, path: str, length: int = -1, ceiling: int | None = None):
        self.fh, self.path, self.left, self.ceiling = fh, path, length, ceiling
        # gzip: read1 returns what decompresses before a cut, where read raises and loses it
        self.take = fh.read1 if isinstance(fh, gzip.GzipFile) else fh.read
        self.count = 0
        self.failure: tuple[str, str] | None = None

    def read(self, n: int = CHUNK) -> bytes:
        if self.failure is not None or self.left == 0:
            return b""
        want = n if self.left < 0 else min(n, self.left)
        if self.ceiling is not None:
            want = min(want, self.ceiling - self.count + 1)
        try:
            data = self.take(want)
        except _READ_ERRORS as exc:
            self.failure = (S.Q_UNREADABLE_FILE, f"cannot decompress after {self.count} bytes "
                            f"({exc}); the file is truncated or not gzip — re-create or "
                            "re-download it")
            return b""
        if self.left > 0:
            self.left -= len(data)
        self.count += len(data)
        if self.ceiling is not None and self.count > self.ceiling:
            data = data[: len(data) - (self.count - self.ceiling)]
            self.count = self.ceiling
            self.failure = (S.Q_DECOMPRESSED_TOO_LARGE,
                            f"decompresses to more than {self.ceiling} bytes; the rest of the "
                            "file is not read (raise [ingest] max_decompressed_bytes to read it)")
        return data


def _lines(stream: _Stream | _Prefixed, first_line: int, max_bytes: int) -> Iterator[Record]:
    """JSONL, chunk by chunk. A line longer than the limit is counted, not kept (its first
    RAW_KEEP_BYTES are); +4 leaves room for a BOM and a CR, which are framing. A line cut by a
    read failure is part of the failure's record."""
    line = first_line
    parts: list[bytes] = []
    held = 0  # bytes of the current line held in `parts`
    skipped = -1  # >= 0: the current line is too long; bytes seen of it
    head, last = b"", b""

    def too_long() -> Record:
        size = skipped - (last == b"\r") - 3 * head.startswith(BOM)
        return _too_long(line, head.removeprefix(BOM), size, max_bytes)

    while chunk := stream.read():
        pieces = chunk.split(b"\n")
        for k, piece in enumerate(pieces):
            done = k < len(pieces) - 1  # the piece ends with a newline
            if skipped >= 0:
                skipped += len(piece)
                last = piece[-1:] or last
            elif held + len(piece) > max_bytes + 4:
                head = (b"".join(parts) + piece[:RAW_KEEP_BYTES])[:RAW_KEEP_BYTES]
                skipped, parts, held, last = held + len(piece), [], 0, piece[-1:]
            elif done and not parts:
                yield decode_line(piece, line, max_bytes)
                line += 1
                continue
            else:
                parts.append(piece)
                held += len(piece)
            if done:
                if skipped >= 0:
                    yield too_long()
                    skipped, head = -1, b""
                else:
                    yield decode_line(b"".join(parts), line, max_bytes)
                    parts, held = [], 0
                line += 1
    if stream.failure is not None:
        yield Record(line, error=stream.failure)
    elif skipped >= 0:
        yield too_long()
    elif any(parts):
        yield decode_line(b"".join(parts), line, max_bytes)


_OUTSIDE = re.compile(rb'[\[\]{}",]')
_INSIDE = re.compile(rb'["\\]')
_SPACE = b" \t\r\n"


def _malformed(number: int, why: str, raw: bytes = b"") -> Record:
    """A broken JSON array as a record numbered where it breaks, with what can show it."""
    return Record(number, raw=raw[:RAW_KEEP_BYTES], error=(S.Q_MALFORMED_JSON,
                                                           f"malformed JSON: {why}"))


def _array(stream: _Stream, buf: bytes, max_bytes: int) -> Iterator[Record]:
    """The elements of a JSON array (`buf` starts at its `[`), without holding the document:
    a scanner finds each element's end (strings and escapes respected), then orjson decodes
    it alone. Line = element number. An element over the limit is counted, not kept; a broken
    array (cut short, an empty element, text after it) gives a malformed_json record after the
    elements before it."""
    number, pos, start = 1, 1, 1  # element number; scan position; where the element begins
    depth, in_string, closed = 1, False, False
    skipped, head = -1, b""  # skipped >= 0: the element is too long; bytes of it passed over

    def element(end: int) -> Record | None:
        if skipped >= 0:
            return _too_long(number, head, skipped + end - start, max_bytes, "array element")
        raw = buf[start:end].strip(_SPACE)
        return decode_line(raw, number, max_bytes) if raw else None

    while not closed:
        match = (_INSIDE if in_string else _OUTSIDE).search(buf, pos)
        if match is None or (match.group() == b"\\" and match.end() >= len(buf)):
            pos = len(buf) if match is None else match.start()  # rescan a split escape
            refilled = _array_refill(stream, buf, pos, start, skipped, head, max_bytes)
            if refilled is None:
                break
            buf, pos, start, skipped, head = refilled
            continue
        char, pos = match.group(), match.end()
        if in_string:
            if char == b"\\":
                pos += 1
            else:
                in_string = False
        elif char == b'"':
            in_string = True
        elif char in b"[{":
            depth += 1
        elif char in b"]}":
            depth -= 1
            if depth == 0:
                closed = True
                record = element(pos - 1)
                if record is None and number > 1:
                    record = _malformed(number, "an empty array element (a trailing comma?)")
                if record is not None:
                    yield record
                    number += 1
        elif depth == 1:  # the comma after an element
            yield element(pos - 1) or _malformed(number, "an empty array element")
            number, start, skipped, head = number + 1, pos, -1, b""
    rest = buf[pos:] if closed else (head or buf[start:].strip(_SPACE))
    yield from _array_end(stream, number, closed, rest)


def _array_refill(stream: _Stream, buf: bytes, pos: int, start: int, skipped: int,
                  head: bytes, max_bytes: int) -> tuple[bytes, int, int, int, bytes] | None:
    """The next chunk after the unscanned rest of `buf`, as (buf, pos, start, skipped, head);
    None at the end of the stream. An element past the limit stops being kept: only its head
    and its size go on, so a huge element never sits in memory."""
    chunk = stream.read()
    if not chunk:
        return None
    if skipped < 0 and pos - start > max_bytes:
        head, skipped = buf[start:start + RAW_KEEP_BYTES].lstrip(_SPACE), 0
    if skipped >= 0:  # the element is only counted from here on
        return buf[pos:] + chunk, 0, 0, skipped + pos - start, head
    return buf[start:] + chunk, pos - start, 0, skipped, head


def _array_end(stream: _Stream, number: int, closed: bool, rest: bytes) -> Iterator[Record]:
    """After the last element: an array cut short, text after its end (`rest`, then the rest
    of the stream), or a read failure, each one record numbered after the elements."""
    if not closed:
        if stream.failure is None:
            yield _malformed(number, "the array is not closed (the file is cut short?)", rest)
            number += 1
    else:
        rest = rest.strip(_SPACE)
        while not rest and (chunk := stream.read()):
            rest = chunk.strip(_SPACE)
        if rest:
            yield _malformed(number, "text after the end of the array", rest)
            number += 1
    if stream.failure is not None:
        yield Record(number, error=stream.failure)


def _json_document(stream: _Stream, max_bytes: int) -> Iterator[Record]:
    """A .json file is an array of rows (streamed; line = element number), a single value
    (read whole when it is within the record limit), or JSONL (many ".json" files are)."""
    buf = b""
    while not buf.removeprefix(BOM).lstrip(_SPACE) and len(buf) <= max_bytes:
        chunk = stream.read()
        if not chunk:
            break
        buf += chunk
    body = buf.removeprefix(BOM).lstrip(_SPACE)
    if body.startswith(b"["):
        yield from _array(stream, body, max_bytes)
        return
    while len(buf) <= max_bytes and (chunk := stream.read(max_bytes + 1 - len(buf))):
        buf += chunk
    if body and len(buf) <= max_bytes and stream.failure is None:
        try:
            value = orjson.loads(buf.removeprefix(BOM))
        except orjson.JSONDecodeError:
            pass
        else:
            yield Record(1, value=value, raw=b"")
            return
    yield from _lines(_Prefixed(buf, stream), 1, max_bytes)


class _Prefixed:
    """Bytes already read, then the rest of a stream."""

    def __init__(self, prefix: bytes, stream: _Stream):
        self.prefix, self.stream = prefix, stream

    def read(self, n: int = CHUNK) -> bytes:
        if self.prefix:
            data, self.prefix = self.prefix, b""
            return data
        return self.stream.read(n)

    @property
    def failure(self) -> tuple[str, str] | None:
        return self.stream.failure


def read_unit(unit: Unit, max_bytes: int,
              max_decompressed: int = DEFAULT_MAX_DECOMPRESSED) -> Iterator[Record]:
    """All records of one unit, in file order; a file that cannot be read ends in one
    `unreadable_file` record (after the rows read before the problem)."""
    path = unit.path
    if path.endswith(".parquet"):
        yield from _parquet(path, max_bytes)
        return
    try:
        fh: Any = open(path, "rb")  # noqa: SIM115 (closed by the with below; open may fail)
    except OSError as exc:
        yield Record(unit.first_line, error=(S.Q_UNREADABLE_FILE, f"cannot open it ({exc})"))
        return
    with fh:
        if path.endswith(".gz"):
            stream = _Stream(gzip.GzipFile(fileobj=fh, mode="rb"), path, ceiling=max_decompressed)
        else:
            fh.seek(unit.start)
            stream = _Stream(fh, path, -1 if unit.end < 0 else unit.end - unit.start)
        if path.endswith((".json", ".json.gz")):
            yield from _json_document(stream, max_bytes)
        else:
            yield from _lines(stream, unit.first_line, max_bytes)


def _parquet(path: str, max_bytes: int) -> Iterator[Record]:
    """Parquet rows as records; a row over `max_bytes` (its Arrow size: the limit JSON lines
    have, for the same reason: a 200 MB message would reach the tokenizer) is a
    `line_too_long` record, never turned into Python objects."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    line = 1
    try:
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=1024):
            rows = batch.to_pylist() if batch.nbytes <= max_bytes else None
            for i in range(batch.num_rows):
                if rows is None:  # some row may be over the limit: sized one by one
                    one = batch.slice(i, 1)
                    if one.nbytes > max_bytes:
                        yield _too_long(line, b"", one.nbytes, max_bytes, "row")
                        line += 1
                        continue
                    row = one.to_pylist()[0]
                else:
                    row = rows[i]
                yield Record(line, value=row, raw=b"")
                line += 1
    except (pa.ArrowException, OSError) as exc:
        yield Record(line, error=(
            S.Q_UNREADABLE_FILE,
            f"cannot read it as Parquet after {line - 1} rows ({exc}); the file is truncated "
            "or not Parquet — re-create or re-download it, or remove it from the source"))


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
