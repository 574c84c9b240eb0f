"""show: one conversation followed through every stage of a run, from its source line to the
drafter's training split.

    dflash-etl show --run R ID [--turn T]      # ID: a conversation id (or a unique prefix of
    python -m dflash_etl show --run R ID    #     one), or FILE:LINE of a source row

What each stage did with it: ingest (source, file, line, the line itself, or its quarantine
reason), regenerate (the turns it wrote, their finish and tokens), tokenize (each row decoded
with its supervised tokens marked: colour in a terminal, [[brackets]] when piped; length,
truncation, or its quarantine reason), extract (shard, offset, the shard's health), train
(trained on, held out for tau, or filtered). `trace()` returns the same as a dict.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError

SOURCE_LINE_CHARS = 400  # how much of the source line is shown
MAX_LINE_BYTES = 1 << 20  # a bound on the source line read back


def _parquet_rows(pattern: Path, **equal: Any) -> list[dict[str, Any]]:
    """The rows of the Parquet file(s) whose columns equal `equal` (none where a column is
    not in the files: a quarantine keyed by file and line has no id)."""
    import polars as pl

    if not list(pattern.parent.glob(pattern.name)):
        return []
    frame = pl.scan_parquet(str(pattern))
    if set(equal) - set(frame.collect_schema().names()):
        return []
    for column, value in equal.items():
        frame = frame.filter(pl.col(column) == value)
    return frame.collect().to_dicts()


def _resolve_id(run: Path, key: str) -> tuple[str | None, dict[str, Any] | None]:
    """(the conversation id, its ingest row) for an id, a unique id prefix or FILE:LINE."""
    import polars as pl

    shards = run / "ingest" / "conversations" / "*.parquet"
    if not list((run / "ingest" / "conversations").glob("*.parquet")):
        raise StageError(f"{run} has no ingest output: run `dflash-etl ingest --run {run}`")
    frame = pl.scan_parquet(str(shards))
    file, _, line = key.rpartition(":")
    if file and line.isdigit():
        found = frame.filter(pl.col("file").str.ends_with(file)
                             & (pl.col("line") == int(line))).collect()
    else:
        found = frame.filter(pl.col("id").str.starts_with(key)).collect()
    if found.height > 1 and not (file and line.isdigit()):
        ids = sorted(set(found["id"].to_list()))
        if len(ids) > 1:
            raise StageError(f"{key!r} is the start of {len(ids)} ids (e.g. {ids[:3]}): give "
                             "more of it")
    if found.height:
        row = found.row(0, named=True)
        return row["id"], row
    return None, None


def _source_line(path: str, line: int) -> str | None:
    """The row's line in its source file (JSONL), bounded; None for other formats."""
    if not path.endswith(".jsonl"):
        return None
    try:
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, 1):
                if number == line:
                    return raw[:MAX_LINE_BYTES].decode("utf-8", "replace")[:SOURCE_LINE_CHARS]
    except OSError:
        return None
    return None


def _ingest_quarantine(run: Path, key: str) -> dict[str, Any] | None:
    file, _, line = key.rpartition(":")
    if not (file and line.isdigit()):
        return None
    import polars as pl

    path = run / "ingest" / "quarantine.parquet"
    if not path.is_file():
        return None
    found = pl.read_parquet(path).filter(pl.col("file").str.ends_with(file)
                                         & (pl.col("line") == int(line)))
    return found.row(0, named=True) if found.height else None


def trace(run_dir: str | Path, key: str, turn: int | None = None) -> dict[str, Any]:
    """What every stage of the run did with the conversation `key` (see the module doc)."""
    run = Path(run_dir)
    conv_id, row = _resolve_id(run, key)
    if row is None:
        quarantined = _ingest_quarantine(run, key)
        if quarantined is not None:
            return {"key": key, "ingest": {"status": "quarantined", "reason":
                                           quarantined["reason"],
                                           "message": quarantined["message"]}}
        return {"key": key, "ingest": {"status": "unknown", "message": (
            "no conversation of this run has that id or FILE:LINE (filtered rows — duplicate, "
            "max_rows, mix_weight — are counted in ingest/stats.json, not listed; "
            "benchmark_contamination and near_duplicate ones are in ingest/contamination.parquet "
            "and ingest/near_duplicates.parquet)")}}
    from dflash_etl.core.rundir import RunDir

    changed = RunDir(run).source_file_changed(row["file"])
    doc: dict[str, Any] = {"key": key, "id": conv_id, "ingest": {
        "status": "kept", "source": row["source"], "file": row["file"], "line": row["line"],
        "format": row["format"], "messages": len(row["messages"]),
        # a changed file's line is another row now: not shown as this one's
        "source_line": None if changed else _source_line(row["file"], row["line"]),
        "source_changed": changed}}
    doc["regenerate"] = _regenerate(run, conv_id, row["file"], row["line"])
    doc["tokenize"] = _tokenize(run, conv_id, turn)
    doc["extract"] = _extract(run, conv_id)
    doc["train"] = _train(run, conv_id, doc["tokenize"], doc["extract"])
    return doc


def _regenerate(run: Path, conv_id: str, file: str, line: int) -> dict[str, Any]:
    if not (run / "regenerate").is_dir():
        return {"status": "not run"}
    turns = _parquet_rows(run / "regenerate" / "generated_turns.parquet", id=conv_id)
    quarantined = _parquet_rows(run / "regenerate" / "quarantine.parquet", file=file,
                                line=line)
    if quarantined:
        q = quarantined[0]
        return {"status": "quarantined", "reason": q["reason"], "message": q["message"]}
    kept = _parquet_rows(run / "regenerate" / "conversations" / "*.parquet", id=conv_id)
    return {"status": "kept" if kept else "filtered (see regenerate/stats.json)",
            "turns": [{"turn": t["turn"], "finish_reason": t["finish_reason"],
                       "new_tokens": t["new_tokens"], "cache_key": t["key"]} for t in turns]}


def _tokenize(run: Path, conv_id: str, turn: int | None) -> dict[str, Any]:
    import pyarrow as pa

    from dflash_etl.core.outputs import TokenizedOutput

    if not (run / "tokenize").is_dir():
        return {"status": "not run"}
    quarantined = _parquet_rows(run / "tokenize" / "quarantine.parquet", id=conv_id)
    if quarantined:
        q = quarantined[0]
        return {"status": "quarantined", "reason": q["reason"], "message": q["message"]}
    from dflash_etl.validation.contracts import read_arrow

    table = pa.concat_tables([read_arrow(f).select(["id", "turn", "input_ids", "loss_mask"])
                              for f in TokenizedOutput.files_in(run / "tokenize")])
    rows = []
    for position, (rid, rturn) in enumerate(zip(table.column("id").to_pylist(),
                                                table.column("turn").to_pylist(), strict=True)):
        if rid == conv_id and (turn is None or rturn == turn):
            ids = table.column("input_ids")[position].as_py()
            mask = table.column("loss_mask")[position].as_py()
            rows.append({"row": position, "turn": rturn, "tokens": len(ids),
                         "supervised": sum(mask), "input_ids": ids, "loss_mask": mask})
    seq_length = TokenizedOutput.read(run / "tokenize").seq_length
    for r in rows:
        r["at_seq_length"] = r["tokens"] >= seq_length  # cut there (truncation right)
    return {"status": "kept" if rows else "filtered (see tokenize/stats.json)", "rows": rows}


def _extract(run: Path, conv_id: str) -> dict[str, Any]:
    if not (run / "extract").is_dir():
        return {"status": "not run"}
    entries = _parquet_rows(run / "extract" / "index.parquet", id=conv_id)
    quarantined = _parquet_rows(run / "extract" / "quarantine.parquet", id=conv_id)
    stats = json.loads((run / "extract" / "stats.json").read_text())
    health = stats.get("health", {})
    return {"status": "extracted" if entries else (
                quarantined[0]["reason"] if quarantined else "no states"),
            "rows": [{"turn": e["turn"], "row": e["row"], "shard": e["shard"],
                      "offset": e["offset"], "length": e["length"]} for e in entries],
            "layers": stats.get("total", {}).get("layers"),
            "health_problems": health.get("problems", [])}


def _train(run: Path, conv_id: str, tokenized: dict[str, Any],
           extracted: dict[str, Any]) -> dict[str, Any]:
    from dflash_etl.core.outputs import TokenizedOutput
    from dflash_etl.core.rundir import RunDir
    from dflash_etl.models.training.evaluation import held_out_ids

    record = RunDir(run).record("train")
    if not record.complete:
        return {"status": "not run"}
    if not tokenized.get("rows"):
        return {"status": "not trained on (no tokenized row)"}
    settings = record.settings
    import pyarrow as pa

    from dflash_etl.validation.contracts import read_arrow

    ids = pa.concat_tables([read_arrow(f).select(["id"])
                            for f in TokenizedOutput.files_in(run / "tokenize")]
                           ).column("id").to_pylist()
    if not settings.get("online"):
        indexed = {r["row"] for r in extracted.get("rows", [])}
        if not indexed:
            return {"status": "not trained on: extract has no states for it"}
        rows = {e["row"] for e in _parquet_rows_all(run / "extract" / "index.parquet")}
        ids = [i for k, i in enumerate(ids) if k in rows]
    held = held_out_ids(ids, int(settings.get("eval_prompts", 8)), int(settings.get("seed", 0)))
    if conv_id in held:
        return {"status": "held out: one of the prompts tau is measured on"}
    if not any(_has_anchor(r["loss_mask"]) for r in tokenized["rows"]):
        return {"status": "filtered: no two consecutive supervised tokens to anchor a block"}
    return {"status": "trained on"}


def _parquet_rows_all(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["row"]).to_pylist()


def _has_anchor(mask: list[int]) -> bool:
    return any(a and b for a, b in itertools.pairwise(mask))


# ---------------------------------------------------------------- text
def marked(tokenizer: Any, ids: list[int], mask: list[int], color: bool) -> str:
    """The row decoded token by token, the supervised runs marked (bold green, or [[ ]])."""
    out, inside = [], False
    open_, close = ("\x1b[1;32m", "\x1b[0m") if color else ("[[", "]]")
    for token, supervised in zip(ids, mask, strict=True):
        if supervised and not inside:
            out.append(open_)
        elif not supervised and inside:
            out.append(close)
        inside = bool(supervised)
        out.append(tokenizer.decode([token]))
    if inside:
        out.append(close)
    return "".join(out)


def render_text(doc: dict[str, Any], tokenizer: Any = None, color: bool = False) -> str:
    lines = [f"conversation {doc.get('id') or doc['key']}"]
    ingest = doc["ingest"]
    if ingest["status"] != "kept":
        lines.append(f"  ingest: {ingest['status']}: {ingest.get('reason', '')} "
                     f"{ingest.get('message', '')}".rstrip())
        return "\n".join(lines)
    lines.append(f"  ingest: kept, source {ingest['source']!r}, {ingest['file']}:"
                 f"{ingest['line']} ({ingest['format']}, {ingest['messages']} messages)")
    if ingest.get("source_line"):
        lines.append(f"    {ingest['source_line']!r}")
    if ingest.get("source_changed"):
        lines.append(f"    (the source file changed since ingest: {ingest['source_changed']}; "
                     "its line is not shown, it may be another row now)")
    for stage in ("regenerate", "tokenize", "extract", "train"):
        part = doc[stage]
        lines.append(f"  {stage}: {part['status']}"
                     + (f": {part.get('reason')} {part.get('message', '')}"
                        if part.get("reason") else ""))
        if stage == "regenerate":
            lines += [f"    turn {t['turn']}: {t['new_tokens']} new tokens, finish "
                      f"{t['finish_reason']}" for t in part.get("turns", [])]
        elif stage == "tokenize":
            for r in part.get("rows", []):
                cut = ", cut at seq_length" if r["at_seq_length"] else ""
                lines.append(f"    row {r['row']} (turn {r['turn']}): {r['tokens']} tokens, "
                             f"{r['supervised']} supervised{cut}")
                if tokenizer is not None:
                    lines.append("      " + marked(tokenizer, r["input_ids"], r["loss_mask"],
                                                   color).replace("\n", "\n      "))
        elif stage == "extract":
            lines += [f"    row {r['row']}: {r['shard']} offset {r['offset']}, {r['length']} "
                      f"tokens, layers {part.get('layers')}" for r in part.get("rows", [])]
            if part.get("health_problems"):
                lines.append(f"    health: {part['health_problems']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("key", metavar="ID", help="a conversation id (or a unique prefix), or "
                   "FILE:LINE of a source row")
    p.add_argument("--run", default="runs/default", help="run directory (default: %(default)s)")
    p.add_argument("--turn", type=int, default=None, help="only this turn's row")
    p.add_argument("--json", action="store_true", help="the trace as JSON")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error")
    return p


def run_from_args(args: argparse.Namespace) -> int:
    doc = trace(args.run, args.key, args.turn)
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
        return 0 if doc.get("id") else 1
    tokenizer = None
    settings = _tokenizer_dir(Path(args.run))
    if settings:
        from dflash_etl.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(settings)
    print(render_text(doc, tokenizer, color=sys.stdout.isatty()), flush=True)
    return 0 if doc.get("id") else 1


def _tokenizer_dir(run: Path) -> str | None:
    from dflash_etl.core.rundir import RunDir

    model = RunDir(run).record("tokenize").settings.get("model")
    return model if model and Path(model).is_dir() else None
