"""Hostile inputs (issue 16, section 4): files that expand past memory, huge JSON arrays, symlink
loops, sources with no rows, and files that are not what their name says. Each case is a real
file in tmp_path, read by the real readers; memory is checked with tracemalloc (bounded), time
with a wall-clock budget."""

from __future__ import annotations

import gzip
import json
import os
import time
import tracemalloc
import zlib
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_etl.io import readers
from dflash_etl.io.readers import RAW_KEEP_BYTES, Unit, read_unit

MB = 1024 * 1024
CHAT = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
LINE = json.dumps(CHAT).encode()


def summary(records) -> list[tuple[int, str]]:
    return [(r.line, "blank" if r.blank else r.error[0] if r.error else "ok") for r in records]


def peak_while_reading(path: Path, **kwargs) -> tuple[list, int, float]:
    """(records, peak traced bytes, seconds) of reading `path`. A record is kept as (line, error,
    blank, len(raw)), and a run of good rows as one (first line, None, count, -1), so what is
    measured is the reader, not this list."""
    tracemalloc.start()
    t0 = time.monotonic()
    out: list = []
    try:
        for r in read_unit(Unit(str(path)), kwargs.pop("max_bytes", MB), **kwargs):
            if r.error is None and out and out[-1][3] == -1:
                out[-1] = (out[-1][0], None, out[-1][2] + 1, -1)
            elif r.error is None:
                out.append((r.line, None, 1, -1))
            else:
                out.append((r.line, r.error, r.blank, len(r.raw)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, peak, time.monotonic() - t0


def write_gzip_stream(path: Path, block: bytes, total: int) -> None:
    """A gzip file of `total` bytes made of `block` repeated, compressed on the fly."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    with open(path, "wb") as fh:
        written = 0
        while written < total:
            fh.write(comp.compress(block))
            written += len(block)
        fh.write(comp.flush())


# ---------------------------------------------------------------- gzip: stream, ceiling
def test_a_gzip_bomb_stops_at_the_ceiling_in_bounded_memory(tmp_path):
    bomb = tmp_path / "bomb.jsonl.gz"
    write_gzip_stream(bomb, (LINE + b"\n") * 1000, 50 * MB)  # ~50 MB of rows, ~100 KB on disk
    assert bomb.stat().st_size < 2 * MB
    out, peak, seconds = peak_while_reading(bomb, max_decompressed=MB)
    (first, _, n_rows, _), last = out
    assert first == 1 and MB // (len(LINE) + 1) - 1 <= n_rows <= MB // (len(LINE) + 1)
    assert last[1][0] == "decompressed_too_large" and "max_decompressed_bytes" in last[1][1]
    assert last[0] == n_rows + 1  # the next line number: where the rest begins
    assert peak < 8 * MB and seconds < 30  # ~0.5 s here; the budget leaves room for a busy CI


def test_a_gzip_line_without_end_is_cut_at_max_line_bytes(tmp_path):
    path = tmp_path / "one_line.jsonl.gz"
    write_gzip_stream(path, b"x" * MB, 50 * MB)  # one 50 MB line, no newline
    out, peak, seconds = peak_while_reading(path, max_bytes=MB)
    assert [(n, e[0]) for n, e, _, _ in out] == [(1, "line_too_long")]
    assert f"line is {50 * MB} bytes" in out[0][1][1] and out[0][3] == RAW_KEEP_BYTES
    assert peak < 8 * MB and seconds < 30


def test_a_plain_jsonl_huge_line_between_rows_is_cut_in_bounded_memory(tmp_path):
    path = tmp_path / "rows.jsonl"
    with open(path, "wb") as fh:
        fh.write(LINE + b"\n" + b'{"x": "' + b"y" * (20 * MB) + b'"}\r\n' + LINE + b"\n")
    out, peak, _ = peak_while_reading(path, max_bytes=MB)
    assert [(n, e[0] if e else "ok") for n, e, _, _ in out] == [
        (1, "ok"), (2, "line_too_long"), (3, "ok")]
    assert f"line is {20 * MB + 9} bytes" in out[1][1][1]
    assert peak < 8 * MB
    units = readers.plan_units(str(path), target_bytes=MB)  # planning scans, never holds it
    assert [r for u in units for r in read_unit(u, MB)] == list(read_unit(Unit(str(path)), MB))


def test_gzip_lines_match_the_plain_file(tmp_path):
    body = b"\xef\xbb\xbf" + LINE + b"\r\n\n{bad\n" + b'{"a": "\xff"}\n' + LINE
    plain, packed = tmp_path / "r.jsonl", tmp_path / "r.jsonl.gz"
    plain.write_bytes(body)
    packed.write_bytes(gzip.compress(body))
    assert list(read_unit(Unit(str(packed)), MB)) == list(read_unit(Unit(str(plain)), MB))
    assert summary(read_unit(Unit(str(plain)), MB)) == [
        (1, "ok"), (2, "blank"), (3, "malformed_json"), (4, "invalid_utf8"), (5, "ok")]


def test_a_ceiling_on_a_json_gz_array(tmp_path):
    path = tmp_path / "rows.json.gz"
    path.write_bytes(gzip.compress(json.dumps([CHAT] * 20000).encode()))
    out = list(read_unit(Unit(str(path)), MB, max_decompressed=100_000))
    assert summary(out[:-1]) == [(k, "ok") for k in range(1, len(out))]
    assert out[-1].error[0] == "decompressed_too_large" and out[-1].line == len(out)


# ---------------------------------------------------------------- JSON arrays stream
def test_a_big_json_array_streams_in_bounded_memory(tmp_path):
    path = tmp_path / "rows.json"
    rows = [{"messages": [{"role": "user", "content": f"q{k} " + "z" * 300},
                          {"role": "assistant", "content": "a"}]} for k in range(30000)]
    path.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    assert path.stat().st_size > 12 * MB  # read whole, it alone would be over the bound
    out, peak, _ = peak_while_reading(path)
    assert out == [(1, None, 30000, -1)]
    assert peak < 6 * MB, peak


def test_an_array_element_over_the_limit_is_counted_not_kept(tmp_path):
    path = tmp_path / "rows.json"
    big = {"messages": [{"role": "user", "content": "w" * (3 * MB)}]}
    path.write_bytes(orjson.dumps([CHAT, big, CHAT]))
    out, peak, _ = peak_while_reading(path, max_bytes=MB)
    assert [(n, e[0] if e else "ok") for n, e, _, _ in out] == [
        (1, "ok"), (2, "line_too_long"), (3, "ok")]
    assert f"array element is {len(orjson.dumps(big))} bytes" in out[1][1][1]
    assert out[1][3] <= RAW_KEEP_BYTES and peak < 8 * MB


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_array_edges_at_every_chunk_boundary(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(readers, "CHUNK", chunk)
    tricky = [{"s": 'a "quoted" ] } , [ { \\ \\" end'}, [1, [2, {"x": "]"}]], "\\u00e9\\\\",
              {}, [], 0, None]
    path = tmp_path / "t.json"
    path.write_bytes(b"\xef\xbb\xbf \n" + json.dumps(tricky, indent=1).encode() + b"\n")
    assert [r.value for r in read_unit(Unit(str(path)), MB)] == tricky
    cases = {
        b"[]": [], b" [ ] ": [], b"[1,]": [(1, "ok"), (2, "malformed_json")],
        b"[,1]": [(1, "malformed_json"), (2, "ok")],
        b'[{"a": 1}, {"b": ': [(1, "ok"), (2, "malformed_json")],  # cut short
        b"[1, NaN, 2]": [(1, "ok"), (2, "malformed_json"), (3, "ok")],
        b"[1] [2]": [(1, "ok"), (2, "malformed_json")],  # text after the array
        b'["\\': [(1, "malformed_json")],
    }
    for data, expected in cases.items():
        path.write_bytes(data)
        assert summary(read_unit(Unit(str(path)), MB)) == expected, data


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                  max_size=4),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(items=st.lists(json_values, max_size=8), indent=st.booleans(),
       chunk=st.integers(1, 40))
def test_the_array_scanner_agrees_with_orjson(tmp_path_factory, items, indent, chunk):
    path = tmp_path_factory.mktemp("arr") / "a.json"
    path.write_text(json.dumps(items, indent=1 if indent else None, ensure_ascii=False))
    old, readers.CHUNK = readers.CHUNK, chunk
    try:
        got = list(read_unit(Unit(str(path)), MB))
    finally:
        readers.CHUNK = old
    assert [(r.line, r.value, r.error) for r in got] == [
        (k + 1, v, None) for k, v in enumerate(items)]


# ---------------------------------------------------------------- unreadable files
def _parquet_bytes(tmp_path: Path) -> bytes:
    path = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist([CHAT] * 10), path)
    return path.read_bytes()


@pytest.mark.parametrize("name,data", [
    ("empty.parquet", b""),
    ("fake.parquet", LINE + b"\n"),
    ("cut.parquet", None),
    ("fake.jsonl.gz", LINE + b"\n"),
    ("empty.jsonl.gz", b"\x1f\x8b"),
])
def test_an_unreadable_file_is_one_quarantined_row(tmp_path, name, data):
    path = tmp_path / name
    if data is None:
        good = _parquet_bytes(tmp_path)
        data = good[: len(good) // 2]
    path.write_bytes(data)
    (record,) = list(read_unit(Unit(str(path)), MB))
    assert (record.line, record.error[0]) == (1, "unreadable_file")
    assert "cannot" in record.error[1] and "(" in record.error[1]  # the reader's own message


def test_a_parquet_row_over_max_line_bytes_is_counted_not_read_into_python(tmp_path):
    """max_line_bytes held for JSON lines only: a Parquet row with a 4 MB message passed ingest
    and aborted the tokenizer. Now it is `line_too_long` in its place, its neighbours kept."""
    huge = {"messages": [{"role": "user", "content": "q" * (4 * MB)},
                         {"role": "assistant", "content": "a"}]}
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist([CHAT, huge, CHAT, CHAT]), path)
    records = list(read_unit(Unit(str(path)), MB))
    assert summary(records) == [(1, "ok"), (2, "line_too_long"), (3, "ok"), (4, "ok")]
    assert "row is" in records[1].error[1] and "max_line_bytes" in records[1].error[1]
    assert records[0].value == CHAT and records[2].value == CHAT


def test_a_file_that_vanished_is_one_quarantined_row(tmp_path):
    (record,) = list(read_unit(Unit(str(tmp_path / "gone.jsonl")), MB))
    assert record.error[0] == "unreadable_file" and "No such file" in record.error[1]


# ---------------------------------------------------------------- globs and symlinks
@pytest.fixture
def looped(tmp_path: Path) -> Path:
    """d/a.jsonl, d/sub/b.jsonl, d/sub/loop -> d, d/self -> d, d/alias.jsonl -> d/a.jsonl,
    d/sub/.hidden/c.jsonl."""
    d = tmp_path / "d"
    (d / "sub" / ".hidden").mkdir(parents=True)
    for rel in ("a.jsonl", "sub/b.jsonl", "sub/.hidden/c.jsonl"):
        (d / rel).write_bytes(LINE + b"\n")
    os.symlink(d, d / "sub" / "loop")
    os.symlink(d, d / "self")
    os.symlink(d / "a.jsonl", d / "alias.jsonl")
    return tmp_path


def _rel(paths: list[str], root: Path) -> list[str]:
    return [Path(p).relative_to(root).as_posix() for p in paths]


def test_a_recursive_glob_through_symlink_loops_reads_each_file_once(looped):
    t0 = time.monotonic()
    found = readers.resolve_source("d/**/*.jsonl", looped)
    assert time.monotonic() - t0 < 5
    assert _rel(found.paths, looped) == ["d/a.jsonl", "d/sub/b.jsonl"]
    assert found.skipped["duplicate_file"] == 1  # alias.jsonl -> a.jsonl
    assert found.skipped["visited_directory"] == 2  # sub/loop and self
    # a directory source: every supported file, hidden ones too, each once
    whole = readers.resolve_source("d", looped)
    assert _rel(whole.paths, looped) == ["d/a.jsonl", "d/sub/.hidden/c.jsonl", "d/sub/b.jsonl"]
    assert readers.resolve_paths("d/*.jsonl", looped) == [str(looped / "d" / "a.jsonl")]
    assert _rel(readers.resolve_paths("d/sub/.hidden/*.jsonl", looped), looped) == [
        "d/sub/.hidden/c.jsonl"]
    assert _rel(readers.resolve_paths("d/s*/*.jsonl", looped), looped) == [
        "d/sub/b.jsonl"]


def test_glob_semantics_match_the_standard_glob_without_links(tmp_path):
    import glob

    for rel in ("x/a.jsonl", "x/y/b.jsonl", "x/y/z/c.json", "x/y/z/d.txt", "x/.h/e.jsonl",
                "x/y/.f.jsonl", "x/[k]/g.jsonl"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    for pattern in ("x/**/*.jsonl", "x/**", "x/*/*", "x/y/**/*.json*", "x/**/z/*", "x/?/*.jsonl",
                    "x/**/.f.jsonl", "**/*.json", "x/[[]k]/*"):
        expected = sorted(p for p in glob.glob(str(tmp_path / pattern), recursive=True)
                          if os.path.isfile(p))
        assert readers.resolve_paths(pattern, tmp_path) == expected, pattern


def test_ingesting_a_json_array_holds_chunks_of_rows_not_the_file(tmp_path):
    from dflash_etl.core.config import SourceConfig
    from dflash_etl.core.stage import WorkItem
    from dflash_etl.stages.ingest import IngestStage

    def run(path: Path):
        item = WorkItem(0, (SourceConfig(name="s", path=str(path)), Unit(str(path))))
        stage = IngestStage(max_line_bytes=16 * MB, max_decompressed_bytes=1 << 40)
        return stage.process_batch(stage.load(item), item)

    (tmp_path / "one.json").write_bytes(orjson.dumps([CHAT]))
    run(tmp_path / "one.json")  # the modules pyarrow and the formats import on first use
    path = tmp_path / "rows.json"
    rows = [{"messages": [{"role": "user", "content": f"q{k} " + "z" * 300},
                          {"role": "assistant", "content": "a"}]} for k in range(10000)]
    path.write_bytes(orjson.dumps(rows))
    del rows
    tracemalloc.start()
    try:
        out = run(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.rows.num_rows == 10000 and out.stats["s"].rows_out == 10000
    assert out.rows.column("line").to_pylist() == list(range(1, 10001))
    # the Python objects of one chunk of rows (the rows themselves are Arrow): ~6 MB; all
    # 10000 rows as dicts were ~17 MB, and grow with the file
    assert peak < 10 * MB, peak
