"""What the report shows, read from a run directory's files (never from the data itself, except
a few quarantine example rows): manifest, stats, probe, settings, contract and suite results."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from dflash_etl.core.errors import StageError
from dflash_etl.core.rundir import RunDir, StageRecord
from dflash_etl.validation.suites import RESULT_FILE

EXAMPLES_PER_REASON = 2
TOP_REASONS = 10


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass
class StageInfo:
    """One stage as the report sees it: where its files are and what they say."""

    name: str
    directory: Path
    status: str
    partial: bool
    manifest: dict[str, Any]
    stats: dict[str, Any] | None = None
    validation: dict[str, Any] | None = None
    contract: dict[str, Any] | None = None
    probe: dict[str, Any] | None = None
    settings: dict[str, Any] | None = None
    draft_vocab: dict[str, Any] | None = None
    token_freq: dict[str, Any] | None = None
    evaluation: dict[str, Any] | None = None
    train_log: list[dict[str, Any]] = field(default_factory=list)
    quarantine: list[dict[str, Any]] = field(default_factory=list)
    mix_filters: dict[str, Any] = field(default_factory=dict)

    @property
    def gate_passed(self) -> bool | None:
        """True/False when the suite ran; None when there is no suite result."""
        return None if self.validation is None else bool(self.validation.get("passed"))

    @property
    def contract_passed(self) -> bool | None:
        return None if self.contract is None else bool(self.contract.get("passed"))


def _jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def quarantine_examples(path: Path) -> list[dict[str, Any]]:
    """The most common quarantine reasons, each with a count and a few example rows."""
    if not path.exists():
        return []
    try:
        frame = pl.read_parquet(path)
    except Exception:  # a failed stage's partial file, cut by a kill: nothing to show from it
        return []
    if frame.height == 0 or "reason" not in frame.columns:
        return []
    counts = frame.group_by("reason").len().sort(["len", "reason"], descending=[True, False])
    out = []
    keep = [c for c in ("source", "id", "file", "line", "message", "raw") if c in frame.columns]
    for reason, n in counts.head(TOP_REASONS).iter_rows():
        examples = frame.filter(pl.col("reason") == reason).head(EXAMPLES_PER_REASON)
        out.append({"reason": reason, "count": n, "examples": examples.select(keep).to_dicts()})
    return out


def stage_info(run_root: Path, record: StageRecord, stale: bool) -> StageInfo | None:
    """The stage's published output, or its partial output when the stage failed."""
    name, info = record.name, record.entry
    status = record.status or "unknown"
    final, partial = run_root / name, run_root / f".{name}.partial"
    if status != "complete" and partial.is_dir():
        directory, is_partial = partial, True
    elif final.is_dir():
        directory, is_partial = final, False
    else:
        return None
    if stale:
        status = "stale"  # complete, but built on an upstream output since replaced
    return StageInfo(
        name=name, directory=directory, status=status, partial=is_partial, manifest=info,
        stats=_json(directory / "stats.json"), validation=_json(directory / RESULT_FILE),
        contract=_json(directory / "contract.json"), probe=_json(directory / "probe.json"),
        settings=_json(directory / "settings.json"),
        draft_vocab=_json(directory / "draft_vocab.json"),
        token_freq=_json(directory / "token_freq.json"),
        evaluation=_json(directory / "eval.json"), train_log=_jsonl(directory / "log.jsonl"),
        quarantine=quarantine_examples(directory / "quarantine.parquet"),
        mix_filters=mix_filters(directory, _json(directory / "stats.json"))
        if name == "ingest" else {},
    )


def collect(run_root: Path) -> tuple[dict[str, Any], list[StageInfo]]:
    """The manifest (for the run's header) and every stage it records, in the order they first
    ran (a run's stages run in pipeline order; a manifest that cannot be read shows none)."""
    run = RunDir(run_root)
    try:
        manifest, records, stale = run.manifest(), run.records(), run.stale()
    except StageError:
        manifest, records, stale = {}, {}, {}
    stages = [s for s in (stage_info(run.root, r, r.name in stale) for r in records.values())
              if s is not None]
    return manifest, stages


def coverage_curve(token_freq: dict[str, Any], points: int = 60) -> list[tuple[float, float]]:
    """Share of supervised tokens covered by the k most frequent tokens, for k up to all."""
    counts = sorted((int(v) for v in token_freq.get("frequencies", {}).values()), reverse=True)
    total = sum(counts)
    if not total:
        return []
    step = max(1, len(counts) // points)
    curve, running = [(0.0, 0.0)], 0
    for k, c in enumerate(counts, start=1):
        running += c
        if k % step == 0 or k == len(counts):
            curve.append((float(k), running / total))
    return curve


MIX_EXAMPLES = 5


def mix_filters(ingest_dir: Path, stats: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ingest's mix filters removed (contamination.parquet, near_duplicates.parquet):
    counts per benchmark or per source, and the first few removals, each near-duplicate with
    the text of the row it repeats (read from the conversations ingest wrote); what each
    benchmark file gave decontamination to look for (stats.json)."""
    out: dict[str, Any] = {}
    if (stats or {}).get("decontamination"):
        out["benchmarks"] = [[name, b["file"], b["items"], b["indexed"], b["rows_removed"]]
                             for name, b in stats["decontamination"].items()]
    path = ingest_dir / "contamination.parquet"
    if path.is_file():
        frame = pl.read_parquet(path)
        out["contamination"] = {
            "per": frame.group_by("benchmark", "source").len()
            .sort("benchmark", "source").rows(),
            "examples": frame.head(MIX_EXAMPLES).to_dicts()}
    path = ingest_dir / "near_duplicates.parquet"
    if path.is_file():
        frame = pl.read_parquet(path)
        examples = frame.sort("similarity").head(MIX_EXAMPLES)  # the least alike first
        kept = _kept_rows(ingest_dir / "conversations", examples["kept_id"].to_list())
        out["near_duplicates"] = {
            "rows": frame.height, "clusters": frame["kept_id"].n_unique(),
            "per_source": frame.group_by("source").len().sort("source").rows(),
            "examples": [{**ex, "kept": kept.get(ex["kept_id"]),
                          "raw": source_line(ex["file"], ex["line"])}
                         for ex in examples.to_dicts()]}
    return out


def source_line(path: str | None, line: int | None, max_bytes: int = 65536) -> str | None:
    """A removed row's line in its JSONL source (its first `max_bytes`), or None: the row is
    not in any output, only in its source."""
    if not path or not line or not str(path).endswith(".jsonl"):
        return None
    try:
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, 1):
                if number == line:
                    return raw[:max_bytes].decode("utf-8", "replace").strip()
    except OSError:
        return None
    return None


def _kept_rows(conversations: Path, ids: list[str]) -> dict[str, dict[str, Any]]:
    """The kept rows' source, origin and first user message, by id."""
    if not ids or not any(conversations.glob("*.parquet")):
        return {}
    try:
        frame = (pl.scan_parquet(conversations / "*.parquet")
                 .filter(pl.col("id").is_in(ids)).select("id", "source", "file", "line",
                                                          "messages").collect())
    except Exception:  # a cut or foreign file: the counts still show
        return {}
    rows = {}
    for row in frame.to_dicts():
        users = [m["content"] for m in row.pop("messages") if m["role"] == "user"]
        rows[row["id"]] = {**row, "text": users[0] if users else ""}
    return rows
