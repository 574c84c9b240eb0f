"""Readers on real files in tmp_path: every kind of bad line is one record with a reason, and
never aborts the file; line numbers are right; splitting a file into ranges reads the same."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_etl.core.config import SourceConfig
from dflash_etl.io import readers
from dflash_etl.io.readers import RAW_KEEP_BYTES, Record, Unit, decode_line, plan_units, read_unit
from dflash_etl.stages.ingest import normalize_records

MAX = 1 << 20
CHAT = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def line(obj: object) -> bytes:
    return json.dumps(obj).encode()


def read(path: Path, max_bytes: int = MAX) -> list[Record]:
    return list(read_unit(Unit(str(path)), max_bytes))


def summary(records: list[Record]) -> list[tuple[int, str]]:
    """(line, what) per record: 'ok', 'blank' or the reason code."""
    return [
        (r.line, "blank" if r.blank else r.error[0] if r.error else "ok") for r in records
    ]


def ingest(path: Path, max_bytes: int = MAX):
    source = SourceConfig(name="s", path=str(path))
    return normalize_records(read(path, max_bytes), source, str(path))


# ------------------------------------------------------------------ one bad line at a time

BAD_UTF8 = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'


@pytest.fixture
def messy(tmp_path: Path) -> Path:
    lines = [
        b"\xef\xbb\xbf" + line(CHAT),  # 1: BOM
        line(CHAT) + b"\r",  # 2: CRLF
        b"",  # 3: blank
        b"   \t",  # 4: whitespace only
        b'{"messages": [',  # 5: malformed JSON
        BAD_UTF8,  # 6: invalid UTF-8
        b"[1, 2, 3]",  # 7: JSON, not an object
        b'"just a string"',  # 8
        b"null",  # 9
        line({"messages": [{"role": "user", "content": 5}]}),  # 10: wrong type
        line({"messages": "not a list"}),  # 11: wrong type
        b"\r",  # 12: an empty CRLF line
        line(CHAT),  # 13: fine after all that
    ]
    path = tmp_path / "messy.jsonl"
    path.write_bytes(b"\n".join(lines))  # no newline at the end of the last line
    return path


def test_each_bad_line_is_one_record_with_its_line_number(messy):
    assert summary(read(messy)) == [
        (1, "ok"), (2, "ok"), (3, "blank"), (4, "blank"), (5, "malformed_json"),
        (6, "invalid_utf8"), (7, "ok"), (8, "ok"), (9, "ok"), (10, "ok"), (11, "ok"),
        (12, "blank"), (13, "ok"),
    ]


def test_ingest_accounts_for_every_line(messy):
    rows, quarantine, stats = ingest(messy)
    assert [r["line"] for r in rows] == [1, 2, 13]
    assert [(q["line"], q["reason"]) for q in quarantine] == [
        (5, "malformed_json"), (6, "invalid_utf8"), (7, "not_an_object"), (8, "not_an_object"),
        (9, "not_an_object"), (10, "wrong_type"), (11, "wrong_type"),
    ]
    assert dict(stats.rows_filtered) == {"blank_line": 3}  # filtered, not quarantined
    assert stats.rows_in == 13 == stats.rows_out + stats.rows_quarantined + stats.filtered_total
    assert all(q["message"] and q["file"] == str(messy) for q in quarantine)
    # BOM and CR are line framing, not content: both rows are the same conversation
    assert rows[0]["id"] == rows[1]["id"] == rows[2]["id"]


def test_invalid_utf8_keeps_the_exact_bytes(messy):
    _, quarantine, _ = ingest(messy)
    bad = next(q for q in quarantine if q["reason"] == "invalid_utf8")
    assert bad["raw_bytes"] == BAD_UTF8
    assert bad["raw"] == BAD_UTF8.decode("utf-8", errors="backslashreplace")
    assert "not UTF-8" in bad["message"]
    # quarantined UTF-8 lines keep their text and no bytes
    malformed = next(q for q in quarantine if q["reason"] == "malformed_json")
    assert (malformed["raw"], malformed["raw_bytes"]) == ('{"messages": [', None)
    assert next(q for q in quarantine if q["line"] == 7)["raw"] == "[1, 2, 3]"


def test_a_line_over_max_bytes_is_quarantined_and_truncated(tmp_path):
    big = line({"messages": [{"role": "user", "content": "x" * (RAW_KEEP_BYTES + 5000)}]})
    path = tmp_path / "big.jsonl"
    path.write_bytes(line(CHAT) + b"\n" + big + b"\n" + line(CHAT) + b"\n")
    records = read(path, max_bytes=RAW_KEEP_BYTES)
    assert summary(records) == [(1, "ok"), (2, "line_too_long"), (3, "ok")]
    assert records[1].raw == big[:RAW_KEEP_BYTES]
    assert f"line is {len(big)} bytes" in records[1].error[1]
    assert "max_line_bytes" in records[1].error[1]
    # the same line is fine under a larger limit
    assert summary(read(path, max_bytes=len(big))) == [(1, "ok"), (2, "ok"), (3, "ok")]


def test_decode_line_directly():
    assert decode_line(b'{"a": 1}\r', 4, MAX).value == {"a": 1}
    assert decode_line(b'\xef\xbb\xbf{"a": 1}', 1, MAX).value == {"a": 1}
    assert decode_line(b"", 2, MAX).blank and decode_line(b"\xef\xbb\xbf", 1, MAX).blank
    record = decode_line(b'{"a": "\xff"}', 7, MAX)
    assert (record.line, record.error[0], record.raw) == (7, "invalid_utf8", b'{"a": "\xff"}')
    assert decode_line(b'{"a": 1} {"b": 2}', 1, MAX).error[0] == "malformed_json"
    assert decode_line(b"NaN", 1, MAX).error[0] == "malformed_json"
    assert decode_line(b'"\\ud800"', 1, MAX).error[0] == "malformed_json"  # lone surrogate
    assert decode_line(b"[" * 5000, 1, MAX).error[0] == "malformed_json"  # too deep


# ------------------------------------------------------------------ file kinds


def test_json_array_line_is_the_element_number(tmp_path):
    path = tmp_path / "rows.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps([CHAT, 5, CHAT], indent=2).encode())
    records = read(path)
    assert [(r.line, r.value) for r in records] == [(1, CHAT), (2, 5), (3, CHAT)]
    rows, quarantine, _ = ingest(path)
    assert [r["line"] for r in rows] == [1, 3]
    assert [(q["line"], q["reason"], q["raw"]) for q in quarantine] == [(2, "not_an_object", "5")]


def test_json_single_object_is_one_row(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(CHAT, indent=2))
    assert [(r.line, r.value) for r in read(path)] == [(1, CHAT)]


def test_a_dot_json_that_is_really_jsonl(tmp_path):
    path = tmp_path / "rows.json"
    path.write_bytes(line(CHAT) + b"\n\n{broken\n" + line(CHAT) + b"\n")
    assert summary(read(path)) == [(1, "ok"), (2, "blank"), (3, "malformed_json"), (4, "ok")]


def test_jsonl_gz(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wb") as fh:
        fh.write(line(CHAT) + b"\n{bad\n\n" + line(CHAT) + b"\r\n")
    assert summary(read(path)) == [(1, "ok"), (2, "malformed_json"), (3, "blank"), (4, "ok")]
    assert plan_units(str(path), target_bytes=1) == [Unit(str(path))]  # not splittable


def test_json_gz_array(tmp_path):
    path = tmp_path / "rows.json.gz"
    with gzip.open(path, "wb") as fh:
        fh.write(json.dumps([CHAT, CHAT]).encode())
    assert [r.line for r in read(path)] == [1, 2]


def test_a_truncated_gzip_keeps_its_rows_and_ends_in_an_unreadable_file_row(tmp_path):
    good = tmp_path / "good.jsonl.gz"
    with gzip.open(good, "wb") as fh:
        fh.write(b"".join(line({**CHAT, "k": k}) + b"\n" for k in range(2000)))
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    records = read(bad)
    *rows, last = records
    assert rows and all(r.error is None for r in rows)
    assert [r.line for r in records] == list(range(1, len(records) + 1))
    assert last.error[0] == "unreadable_file" and "cannot decompress" in last.error[1]


def test_parquet(tmp_path):
    path = tmp_path / "rows.parquet"
    rows = [
        {"question": "2+2?", "response": "4", "system_prompt": ""},
        {"question": "3+3?", "response": "6", "system_prompt": "Be brief."},
        {"question": None, "response": "x", "system_prompt": ""},
    ]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    records = read(path)
    assert [(r.line, r.value) for r in records] == [(1, rows[0]), (2, rows[1]), (3, rows[2])]
    out, quarantine, _ = ingest(path)
    assert [r["line"] for r in out] == [1, 2] and [r["format"] for r in out] == ["orca"] * 2
    (q,) = quarantine
    assert (q["line"], q["reason"]) == (3, "wrong_type")
    assert json.loads(q["raw"]) == rows[2]  # no original line: the row, as JSON


def test_parquet_with_nested_messages(tmp_path):
    path = tmp_path / "chat.parquet"
    rows = [CHAT, {"messages": [{"role": "user", "content": "q2"}]}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    out, quarantine, _ = ingest(path)
    assert not quarantine
    assert [len(r["messages"]) for r in out] == [2, 1] and out[1]["needs_response"]


# ------------------------------------------------------------------ splitting a file


def _write_varied(path: Path, n: int) -> None:
    parts = []
    for k in range(n):
        if k % 17 == 3:
            parts.append(b"")  # blank
        elif k % 23 == 5:
            parts.append(b"{broken " + b"y" * (k % 50))
        elif k % 29 == 7:
            parts.append(b'{"bad": "\xff\xfe"}')
        else:
            body = {"messages": [{"role": "user", "content": "x" * (k * 37 % 300)}], "k": k}
            parts.append(line(body) + (b"\r" if k % 5 == 0 else b""))
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(parts) + b"\n")


@pytest.mark.parametrize("target", [1, 97, 1000, 4096])
def test_plan_units_ranges_read_the_same_records(tmp_path, target):
    path = tmp_path / "big.jsonl"
    _write_varied(path, 300)
    whole = read(path)
    assert len(whole) == 300
    units = plan_units(str(path), target_bytes=target)
    assert len(units) > 1
    # contiguous, newline-aligned, covering the file
    assert units[0].start == 0 and units[0].first_line == 1
    for a, b in itertools.pairwise(units):
        assert a.end == b.start
    assert units[-1].end == path.stat().st_size
    data = path.read_bytes()
    assert all(data[u.start - 1 : u.start] == b"\n" for u in units[1:])
    pieces = [r for u in units for r in read_unit(u, MAX)]
    assert pieces == whole  # same lines, same line numbers, same values and errors


def test_plan_units_without_trailing_newline_and_small_files(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(line({**CHAT, "k": k}) for k in range(50)))
    units = plan_units(str(path), target_bytes=200)
    assert len(units) > 1
    assert [r for u in units for r in read_unit(u, MAX)] == read(path)
    assert [r.line for r in read(path)] == list(range(1, 51))
    assert plan_units(str(path)) == [Unit(str(path))]  # under the target: one unit
    assert plan_units(str(tmp_path / "x.json"), target_bytes=1) == [Unit(str(tmp_path / "x.json"))]


def test_empty_files(tmp_path):
    cases = [("e.jsonl", b"", []), ("e.json", b"", []), ("a.json", b"[]", []),
             ("n.jsonl", b"\n\r\n", [(1, "blank"), (2, "blank")])]
    for name, data, expected in cases:
        path = tmp_path / name
        path.write_bytes(data)
        assert summary(read(path)) == expected, name


def test_resolve_paths(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("d/a.jsonl", "d/sub/b.json", "d/sub/c.parquet", "d/notes.txt", "d/e.jsonl.gz"):
        (tmp_path / name).write_text("")
    found = readers.resolve_paths("d", tmp_path)
    assert [Path(p).relative_to(tmp_path).as_posix() for p in found] == [
        "d/a.jsonl", "d/e.jsonl.gz", "d/sub/b.json", "d/sub/c.parquet"
    ]
    assert readers.resolve_paths("d/*.jsonl", tmp_path) == [str(tmp_path / "d" / "a.jsonl")]
    assert readers.resolve_paths(str(tmp_path / "d" / "a.jsonl"), Path("/")) == [
        str(tmp_path / "d" / "a.jsonl")
    ]
    assert readers.resolve_paths("missing.jsonl", tmp_path) == []
