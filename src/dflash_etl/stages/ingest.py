"""ingest: source files (any supported format) -> canonical conversations + quarantine.

Core: `normalize_records` (records -> rows, quarantine, stats) and mix/sampling.py's `plan_mix`
(which rows to keep: dedup, max_rows, weights) are pure. The stage plans work units (one unit
of one source file each), the runner runs them in worker processes, and `finish` applies the
mix filters and writes the Parquet shards the runner gates and publishes.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_etl.core import schema as S
from dflash_etl.core.accounting import Stats, stats_document
from dflash_etl.core.config import PipelineConfig, SourceConfig
from dflash_etl.core.errors import StageError
from dflash_etl.core.outputs import ConversationsOutput
from dflash_etl.core.rundir import StageRecord, sha256_file
from dflash_etl.core.settings import endpoint_list, fingerprinted, setting
from dflash_etl.core.stage import (
    BatchOutput,
    BatchStage,
    ItemResults,
    StageContext,
    WorkItem,
    counts_line,
    read_item_file,
    state_word,
)
from dflash_etl.formats import RowError, normalize_row
from dflash_etl.io import readers
from dflash_etl.mix import placeholders
from dflash_etl.mix.contamination import MIN_WHOLE, MIN_WORDS, ContaminationIndex
from dflash_etl.mix.sampling import plan_mix

STAGE = "ingest"
CHUNK_RECORDS = 1024  # records normalized (as Python objects) at a time per work item
_ORDER = pa.schema([("_unit", pa.int32()), ("_line", pa.int64())])
UNIT_SCHEMA = pa.schema(list(S.CONVERSATIONS) + list(_ORDER))
# what a work item finds for the mix filters (null where a filter is off or has no verdict):
# the benchmark item a row holds, its MinHash digest and LSH band keys (raw little-endian),
# its short replies (the placeholder count)
_MIX = pa.schema([("_bench", pa.string()), ("_bench_item", pa.string()),
                  ("_bench_shared", pa.string()),
                  ("_minhash", pa.binary(4 * 128)), ("_bands", pa.binary(8 * 16)),
                  ("_replies", pa.list_(pa.string()))])
# of the unit files (4: short replies): a resumed run never reuses another layout's or rule's
UNIT_FORMAT = 4
NEAR_DEDUP = ("near_dedup", (True,))  # the near-dedup filter's settings


@dataclass(frozen=True)
class IngestSettings:
    """[ingest] in pipeline.toml; CLI flags override it. (The per-line limit is [run]
    max_line_bytes, shared with the other stages.)"""

    max_decompressed_bytes: int = setting(
        readers.DEFAULT_MAX_DECOMPRESSED, min=1, metavar="BYTES",
        help="per compressed file: past this many decompressed bytes the rest of the file is "
             "quarantined as decompressed_too_large (a gzip bomb stops here)")
    strict_sources: bool = setting(
        False, help="a source (file or glob) that yields no rows is an error, not a warning")
    decontaminate: tuple[str, ...] = setting(  # their contents are fingerprinted, not paths
        (), metavar="FILE,FILE", fingerprint=False,
        help="benchmark files (MT-Bench, GSM8K, HumanEval, messages/prompt JSONL; relative to "
             "the config) whose items are kept out of the mix: a conversation sharing a run of "
             "decontaminate_ngram words with one is filtered benchmark_contamination")
    decontaminate_ngram: int = setting(13, min=MIN_WORDS, max=200, help="words in a shared run")
    near_dedup: bool = setting(False, help="filter near-duplicate conversations (MinHash LSH): "
                               "of each cluster the first (source, file, line) is kept")
    near_dedup_threshold: float = setting(0.8, above=0, max=1, applies=NEAR_DEDUP,
                                          help="Jaccard similarity of a near-duplicate")
    near_dedup_ngram: int = setting(3, min=1, max=32, applies=NEAR_DEDUP,
                                    help="words per shingle")
    near_dedup_scope: str = setting("prompt", choices=("prompt", "conversation"),
                                    applies=NEAR_DEDUP,
                                    help="compare the user turns, or every message")
    placeholder_replies: str = setting(
        "filter", choices=("filter", "keep"), fingerprint="unless_default",
        help="a short reply given to many prompts (a file padded with \"OK.\"): filter those "
             "conversations (placeholder_reply, listed in placeholders.parquet), or keep them "
             "(a classifier's labels); warned either way")
    placeholder_min_share: float = setting(
        0.01, above=0, max=1, fingerprint="unless_default",
        help="the share of conversations (at least 3) one short reply reaches as a placeholder")
    weight_by: str = setting(
        "rows", choices=("rows", "supervised_tokens"), fingerprint="unless_default",
        help="what the sources' weights are shares of: rows (ingest samples the conversations), "
             "or supervised tokens, what the drafter trains on (ingest keeps the weighted "
             "sources whole and tokenize, which counts them, leaves out conversations, "
             "filtered mix_weight)")

    def __post_init__(self) -> None:
        # one file named as a TOML string (not a list) was read character by character
        object.__setattr__(self, "decontaminate", endpoint_list(self.decontaminate))



# ---------------------------------------------------------------- pure core
def normalize_records(
    records: Iterable[readers.Record], source: SourceConfig, file: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Stats]:
    """Decoded records -> canonical rows, quarantine rows, and their accounting."""
    rows: list[dict[str, Any]] = []
    quarantine: list[dict[str, Any]] = []
    stats = Stats()
    role_mapping: Counter[str] = Counter()
    formats: Counter[str] = Counter()
    keys_seen: Counter[str] = Counter()
    for record in records:
        stats.rows_in += 1
        if record.blank:
            stats.filter(S.F_BLANK_LINE)
            continue
        error = record.error
        if error is None:
            try:
                row, mapping = normalize_row(record.value, source.format, source.fields)
            except RowError as exc:
                error = (exc.code, exc.message)
                if isinstance(record.value, dict) and len(keys_seen) < 50:
                    keys_seen.update(record.value.keys())
            else:
                row.update(source=source.name, file=file, line=record.line)
                rows.append(row)
                role_mapping.update(mapping)
                formats[row["format"]] += 1
                continue
        code, message = error
        raw, raw_bytes = readers.raw_text(record)
        quarantine.append(
            {"source": source.name, "file": file, "line": record.line, "reason": code,
             "message": message, "raw": raw, "raw_bytes": raw_bytes}
        )
        stats.quarantine(code)
    stats.rows_out = len(rows)
    stats.extra = {"role_mapping": role_mapping, "formats": formats, "keys_seen": keys_seen}
    return rows, quarantine, stats


# ---------------------------------------------------------------- shell
def _inputs(config: PipelineConfig) -> list[tuple[SourceConfig, readers.Resolved]]:
    found = []
    for source in config.sources:
        resolved = readers.resolve_source(source.path, config.base_dir)
        if not resolved.paths:
            raise StageError(
                f"source {source.name!r}: path {source.path!r} (relative to "
                f"{config.base_dir}) matched no {'/'.join(readers.SUFFIXES)} files — check the "
                "path in the config"
            )
        found.append((source, resolved))
    return found


FILTER_HINTS = {  # a source read without error whose rows the filters took
    S.F_DUPLICATE: "every row repeats an earlier one (dedup = true)",
    S.F_MAX_ROWS: "its max_rows sample took the rest",
    S.F_MIX_WEIGHT: "its weight in the mix leaves it no rows: raise its weight",
    S.F_BLANK_LINE: "its lines are blank",
    S.F_NEAR_DUPLICATE: "every row is a near-duplicate of another source's (near_dedup)",
    S.F_CONTAMINATED: "its rows hold benchmark items (decontaminate)",
    S.F_PLACEHOLDER: "its replies are one placeholder text (see placeholders.parquet)",
}


def _empty_output_message(per_source: dict[str, Stats], problem: list[str]) -> str:
    lines = []
    for name in problem:
        stats = per_source[name]
        reasons = stats.quarantine_reasons.most_common(3)
        keys = [k for k, _ in stats.extra.get("keys_seen", Counter()).most_common(12)]
        hint = "set format= or [sources.fields]"
        if any(code == S.Q_FORMAT_MISMATCH for code, _ in reasons):
            hint = "the rows are in another format than the configured one: set format='auto'"
        elif stats.rows_filtered and not reasons:  # read fine, then filtered away
            hint = "; ".join(FILTER_HINTS.get(code, code) for code in stats.rows_filtered)
        lines.append(
            f"0 of {stats.rows_in} rows of source {name!r} were kept "
            f"(quarantined: {dict(reasons)}; filtered: {dict(stats.rows_filtered)}); "
            f"keys seen: {keys} — {hint}. See quarantine.parquet for each row's reason."
        )
    return "\n".join(lines)


@dataclass(eq=False)
class IngestStage(BatchStage):
    """Source files -> canonical conversations; a work item is one unit of one source file.
    Its fields are the read limits and mix-filter inputs every worker applies."""

    name: ClassVar[str] = STAGE
    help: ClassVar[str] = "sources -> canonical conversations + quarantine"
    Settings: ClassVar[type] = IngestSettings
    writes: ClassVar[type[ConversationsOutput]] = ConversationsOutput
    item_unit: ClassVar[str] = "source units"
    settings: IngestSettings = dataclasses.field(default_factory=IngestSettings)
    max_line_bytes: int = 0
    max_decompressed_bytes: int = 0
    contamination: ContaminationIndex | None = None  # the benchmarks' grams, when asked
    near_dedup_ngram: int = 0  # 0: near-dedup is off
    near_dedup_scope: str = "prompt"
    sources: list[tuple[SourceConfig, readers.Resolved]] = dataclasses.field(
        default_factory=list)
    benchmarks: list[Path] = dataclasses.field(default_factory=list)

    def prepare(self, ctx: StageContext) -> dict[str, Any]:
        config = _require_config(ctx.config)
        if self.settings.near_dedup and not config.run.dedup:
            raise StageError("[ingest] near_dedup = true with [run] dedup = false would keep every "
                             "exact copy while it removes their near copies: exact copies are "
                             "dedup's; set dedup = true (or near_dedup = false)")
        self.sources = _inputs(config)
        inputs = [
            {"source": s.name, "path": p, "size": os.path.getsize(p), "sha256": sha256_file(p)}
            for s, resolved in self.sources for p in resolved.paths
        ]
        if ctx.rank == 0:  # under torchrun rank 0 alone writes the run directory
            ctx.run.update_manifest(config=config.to_dict(), config_hash=config.digest(),
                                    inputs=inputs)
        self.benchmarks = _benchmark_files(config, self.settings)
        return {"config": config.digest(), "inputs": [i["sha256"] for i in inputs],
                "unit_format": UNIT_FORMAT, "settings": fingerprinted(self.settings),
                "benchmarks": [sha256_file(b) for b in self.benchmarks]}

    def plan(self, ctx: StageContext) -> list[WorkItem]:
        """One item per unit of a source file; the workers' limits and mix-filter inputs."""
        from dflash_etl.io.benchmarks import read_benchmark

        self.max_line_bytes = _require_config(ctx.config).run.max_line_bytes
        self.max_decompressed_bytes = self.settings.max_decompressed_bytes
        if self.benchmarks:
            self.contamination = ContaminationIndex.build(
                (item for path in self.benchmarks for item in read_benchmark(path)),
                self.settings.decontaminate_ngram)
            _require_usable(self.contamination, self.benchmarks)
        self.near_dedup_ngram = self.settings.near_dedup_ngram if self.settings.near_dedup else 0
        self.near_dedup_scope = self.settings.near_dedup_scope
        units = [(source, unit) for source, resolved in self.sources
                 for path in resolved.paths for unit in readers.plan_units(path)]
        return [WorkItem(k, unit) for k, unit in enumerate(units)]

    def load(self, item: WorkItem) -> Any:
        return readers.read_unit(item.payload[1], self.max_line_bytes,
                                 self.max_decompressed_bytes)

    def process_batch(self, batch: Any, item: WorkItem) -> BatchOutput:
        source, unit = item.payload
        # rows become Arrow CHUNK_RECORDS at a time: a whole-file unit (a .json array, a .gz)
        # holds its rows as compact Arrow, never as one Python list of the whole file
        records = iter(batch)
        tables, q_tables = [], []
        stats = Stats()
        while chunk := list(itertools.islice(records, CHUNK_RECORDS)):
            rows, quarantine, part = normalize_records(chunk, source, unit.path)
            for row in rows:
                row["_unit"] = item.index
                row["_line"] = row["line"]
            table = pa.Table.from_pylist(rows, schema=UNIT_SCHEMA)
            for name, column in zip(_MIX.names, self._mix_columns(table), strict=True):
                table = table.append_column(_MIX.field(name), column)
            tables.append(table)
            q_tables.append(pa.Table.from_pylist(quarantine, schema=S.QUARANTINE))
            stats.merge(part)
            del chunk, rows, quarantine
        stats.extra.setdefault("role_mapping", Counter())
        stats.extra.setdefault("formats", Counter())
        # the unit's records (not blank lines) as a per-file count: a file that yields none
        # is named in the warnings
        n_records = stats.rows_in - stats.rows_filtered.get(S.F_BLANK_LINE, 0)
        return BatchOutput(pa.concat_tables(tables) if tables
                           else pa.unify_schemas([UNIT_SCHEMA, _MIX]).empty_table(),
                           pa.concat_tables(q_tables) if q_tables
                           else S.QUARANTINE.empty_table(),
                           {source.name: stats}, {"file": unit.path, "records": n_records})

    def _mix_columns(self, table: pa.Table) -> list[pa.Array]:
        """The rows' `_MIX` columns: what the driver's filters need, found here in parallel
        (from the rows' Arrow `messages`: no Python object per message or word)."""
        n = table.num_rows
        bench: list[list[str | None]] = [[None] * n for _ in range(3)]
        if self.contamination is not None and n:
            for k, hit in self.contamination.match_conversations(
                    table.column("messages"), table.column("tools")).items():
                bench[0][k], bench[1][k], bench[2][k] = hit[0], hit[1], hit[2][:300]
        columns = [pa.array(values, pa.string()) for values in bench]
        replies = placeholders.row_short_replies(table.column("messages"))
        if not self.near_dedup_ngram or not n:
            return columns + [pa.nulls(n, _MIX.field(f).type)
                              for f in ("_minhash", "_bands")] + [replies]
        from dflash_etl.mix.near_dedup import band_keys, message_signatures

        digests, has = message_signatures(table.column("messages"), self.near_dedup_scope,
                                          self.near_dedup_ngram)
        valid = pa.py_buffer(np.packbits(has, bitorder="little").tobytes())
        for values, field in ((digests, "_minhash"), (band_keys(digests), "_bands")):
            data = pa.py_buffer(np.ascontiguousarray(values).astype("<u8" if field == "_bands"
                                                                     else "<u4").tobytes())
            columns.append(pa.Array.from_buffers(_MIX.field(field).type, n, [valid, data],
                                                 null_count=int(n - has.sum())))
        return [*columns, replies]

    def finish(self, ctx: StageContext, results: ItemResults) -> dict[str, Any]:
        doc = _finish(_require_config(ctx.config), results, ctx.partial, self.settings,
                      self.sources)
        if self.contamination is not None:
            removed = doc["total"].get("contamination", {})
            doc["decontamination"] = {  # per benchmark file, in the stats and the report
                path.stem: {"file": str(path), "items": self.contamination.read[path.stem],
                            "indexed": self.contamination.indexed[path.stem],
                            "rows_removed": removed.get(path.stem, 0)}
                for path in self.benchmarks}
        return doc

    @classmethod
    def summary(cls, doc: dict[str, Any], record: StageRecord, out: Path) -> list[str]:
        return [f"ingest {state_word(doc)}: {counts_line(doc['total'])}",
                *(f"  {source}: {counts_line(stats)}" for source, stats in doc["sources"].items()),
                f"  conversations: {out / 'conversations'}",
                f"  quarantine:    {out / 'quarantine.parquet'}",
                f"  stats:         {out / 'stats.json'}",
                *(f"  warning: {warning}" for warning in doc.get("warnings", []))]


def _require_config(config: PipelineConfig | None) -> PipelineConfig:
    if config is None:
        raise StageError("ingest needs a config: pass --config pipeline.toml (its [[sources]])")
    return config


def source_warnings(config: PipelineConfig, results: ItemResults,
                    per_source: dict[str, Stats]) -> list[str]:
    """A source, or a file of a source, that yields no rows (only blank lines, or none)."""
    warnings = []
    per_file: Counter[tuple[str, str]] = Counter()
    for result in results:
        for name in result["sources"]:
            if result.get("file"):
                per_file[(name, result["file"])] += result.get("records", 0)
    for source in config.sources:
        stats = per_source[source.name]
        empty_files = sorted(f for (name, f), n in per_file.items()
                             if name == source.name and n == 0)
        if stats.rows_in - stats.rows_filtered.get(S.F_BLANK_LINE, 0) == 0:
            warnings.append(f"source {source.name!r} ({source.path!r}) yielded no rows: its "
                            f"{len(empty_files)} file(s) hold no records (e.g. "
                            f"{empty_files[:3]}) — check the path and the files")
        else:
            warnings.extend(f"source {source.name!r}: file {f} yielded no rows"
                            for f in empty_files[:20])
    return warnings


def _finish(config: PipelineConfig, results: ItemResults, partial: Path,
            settings: IngestSettings,
            sources: list[tuple[SourceConfig, readers.Resolved]]) -> dict[str, Any]:
    per_source = results.per_source(first=[s.name for s in config.sources])
    for source, resolved in sources or []:
        if resolved.skipped:
            per_source[source.name].extra["paths_skipped"] = dict(resolved.skipped)
    warnings = source_warnings(config, results, per_source)
    no_rows = [w for w in warnings if "yielded no rows:" in w]
    if settings.strict_sources and no_rows:
        raise StageError("\n".join(no_rows) + "\n([ingest] strict_sources = true makes this an "
                         "error; remove the source or fix its path)")
    row_files = [str(f) for f in results.row_files()]
    q_files = [str(f) for f in results.quarantine_files()]
    index = pl.concat(
        [pl.read_parquet(f, columns=["id", "source", "_unit", "_line"]) for f in row_files]
    ) if row_files else pl.DataFrame()
    if settings.decontaminate and index.height:
        index = _decontaminate(index, row_files, partial, per_source)
    if settings.near_dedup and index.height:
        index = _near_dedup(index, row_files, results, settings, partial, per_source)
    if index.height:
        index = _placeholders(index, row_files, settings, partial, per_source, warnings)
    kept = _apply_mix(index, config, settings, per_source)
    _write_shards(row_files, kept, partial / "conversations", config.run.shard_rows)
    quarantine = pa.concat_tables([read_item_file(f, S.QUARANTINE) for f in q_files])
    pq.write_table(quarantine, partial / "quarantine.parquet")
    empty = [n for n, s in per_source.items() if s.rows_out == 0 and s.rows_quarantined]
    if kept.height == 0 or empty:
        raise StageError(
            "ingest produced no conversations from some sources:\n"
            + _empty_output_message(per_source, empty or list(per_source))
        )
    for stats in per_source.values():
        stats.extra.pop("keys_seen", None)
    doc = stats_document(per_source, "ingest")
    doc["total"]["shards"] = len(list((partial / "conversations").glob("*.parquet")))
    doc["warnings"] = warnings
    # what the weights are shares of; tokenize reads it (weight_by = "supervised_tokens")
    doc["mix"] = {"weight_by": settings.weight_by, "seed": config.run.seed,
                  "weights": {s.name: s.weight for s in config.sources if s.weight is not None}}
    return doc


def _apply_mix(index: pl.DataFrame, config: PipelineConfig, settings: IngestSettings,
               per_source: dict[str, Stats]) -> pl.DataFrame:
    """plan_mix on the index, its filtered rows and mix counted per source; the kept keys."""
    kept, filtered, mix = plan_mix(index, config.sources, config.run.seed, config.run.dedup,
                                   settings.weight_by)
    for name, counts in filtered.items():
        stats = per_source[name]
        for reason, n in counts.items():
            stats.filter(reason, n)
        stats.rows_out -= sum(counts.values())
        if name in mix:
            stats.extra["mix"] = mix[name]
    return kept


def _benchmark_files(config: PipelineConfig, settings: IngestSettings) -> list[Path]:
    files = [(config.base_dir / f).resolve() for f in settings.decontaminate]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise StageError(f"[ingest] decontaminate: no benchmark file at {', '.join(missing)} "
                         f"(paths are relative to the config, {config.base_dir})")
    return files


def _require_usable(index: ContaminationIndex, files: list[Path]) -> None:
    """A benchmark file none of whose items can be looked for would turn decontamination off
    for that benchmark without a word: an error naming the counts per file."""
    stems = Counter(f.stem for f in files)
    twice = sorted(stem for stem, n in stems.items() if n > 1)
    if twice:
        raise StageError(f"[ingest] decontaminate: two benchmark files are named {twice[0]!r} "
                         "(a file's stem names its benchmark in the counts and the report): "
                         "rename one")
    empty = [f"{f} ({index.read[f.stem]} items, {index.indexed[f.stem]} of "
             f"{MIN_WHOLE} words or more)" for f in files if not index.indexed[f.stem]]
    if empty:
        raise StageError("[ingest] decontaminate: nothing to look for in " + "; ".join(empty)
                         + ": an empty file, or items too short to name a benchmark; fix the "
                         "file or remove it from the list")


def _decontaminate(index: pl.DataFrame, row_files: list[str], partial: Path,
                   per_source: dict[str, Stats]) -> pl.DataFrame:
    """The index less the conversations that hold a benchmark item (the work items found
    them), each filtered benchmark_contamination and listed in contamination.parquet with the
    item it holds."""
    columns = ["id", "source", "file", "line", "_bench", "_bench_item", "_bench_shared",
               "_unit", "_line"]
    found = pl.concat([pl.scan_parquet(f).select(columns).filter(pl.col("_bench").is_not_null())
                       .collect() for f in row_files])
    found = found.join(index.select("_unit", "_line"), on=["_unit", "_line"], how="semi")
    found.drop("_unit", "_line").rename(
        {"_bench": "benchmark", "_bench_item": "item", "_bench_shared": "shared"}
    ).write_parquet(partial / "contamination.parquet")
    for name, n in found.group_by("source").len().iter_rows():
        per_source[name].filter(S.F_CONTAMINATED, n)
        per_source[name].rows_out -= n
    for name, stats in per_source.items():
        mine = found.filter(pl.col("source") == name)
        stats.extra["contamination"] = dict(Counter(mine["_bench"].to_list()))
    return index.join(found.select("_unit", "_line"), on=["_unit", "_line"], how="anti")


def _placeholders(index: pl.DataFrame, row_files: list[str], settings: IngestSettings,
                  partial: Path, per_source: dict[str, Stats], warnings: list[str]
                  ) -> pl.DataFrame:
    """The index less the conversations with a placeholder reply (mix/placeholders.py), each
    filtered placeholder_reply and listed in placeholders.parquet with the reply; warned, and
    with placeholder_replies = "keep" only warned."""
    keys = index.select("_unit", "_line")
    replies = pl.concat([placeholders.short_replies(pl.scan_parquet(f))
                         .join(keys.lazy(), on=["_unit", "_line"], how="semi").collect()
                         for f in row_files])
    texts = placeholders.placeholder_texts(replies, index.height, placeholders.MIN_REPEATS,
                                           settings.placeholder_min_share)
    if not texts.height:
        return index
    found = (replies.join(texts.select("reply"), on="reply", how="semi")
             .unique(["_unit", "_line"], keep="first", maintain_order=True))
    keep = settings.placeholder_replies == "keep"
    warnings.append(placeholders.placeholder_warning(texts, found.height,
                                                     settings.placeholder_min_share, keep))
    if keep:
        return index
    pl.concat([pl.scan_parquet(f).select("id", "file", "line", "_unit", "_line")
               .join(found.lazy().select("_unit", "_line", "source", "reply"),
                     on=["_unit", "_line"]).collect() for f in row_files]
              ).drop("_unit", "_line").write_parquet(partial / "placeholders.parquet")
    for name, n in found.group_by("source").len().iter_rows():
        per_source[name].filter(S.F_PLACEHOLDER, n)
        per_source[name].rows_out -= n
    return index.join(found.select("_unit", "_line"), on=["_unit", "_line"], how="anti")


def _fixed_width(column: pa.ChunkedArray, dtype: str, width: int) -> np.ndarray:
    """A fixed-size binary column's values as a [rows, width] numpy array (null rows: zeros)."""
    array = column.combine_chunks()
    data = np.frombuffer(array.buffers()[1], dtype=dtype)
    return data[array.offset * width:(array.offset + len(array)) * width].reshape(-1, width)


def _near_dedup(index: pl.DataFrame, row_files: list[str], results: ItemResults,
                settings: IngestSettings, partial: Path, per_source: dict[str, Stats]
                ) -> pl.DataFrame:
    """The index less the near-duplicates of earlier rows (source, file, line order), each
    filtered near_duplicate and listed in near_duplicates.parquet with the row it repeats.
    Exact duplicates are left to dedup (counted `duplicate`): of each id the first row alone
    takes part. Only the band keys of every row are read; the digests, of the candidates; a
    unit's source file is its result's, its lines are the rows' `line`."""
    from dflash_etl.mix.near_dedup import candidates, near_duplicates

    order = (index.select("_unit", "_line", "id", "source").sort("_unit", "_line")
             .unique("id", keep="first", maintain_order=True))
    units, lines = order["_unit"].to_numpy(), order["_line"].to_numpy()
    bounds = np.searchsorted(units, np.arange(len(row_files) + 1))  # units ascend in order
    keys, has = _unit_columns(row_files, lines, bounds, "_bands")
    rows = candidates(keys, has)
    digests, _ = _unit_columns(row_files, lines, bounds, "_minhash", rows)
    pairs = near_duplicates(keys[rows], digests, settings.near_dedup_threshold)
    at = rows[[r for r, _, _ in pairs]]
    ids = order["id"]
    frame = pl.DataFrame({
        "id": ids.gather(at), "source": order["source"].gather(at),
        "file": pl.Series([results[u].get("file") for u in units[at].tolist()],
                          dtype=pl.String),
        "line": pl.Series(lines[at], dtype=pl.Int64),
        "kept_id": ids.gather(rows[[k for _, k, _ in pairs]]),
        "similarity": pl.Series([round(sim, 4) for _, _, sim in pairs], dtype=pl.Float64)})
    frame.write_parquet(partial / "near_duplicates.parquet")
    for name, n in frame.group_by("source").len().iter_rows():
        per_source[name].filter(S.F_NEAR_DUPLICATE, n)
        per_source[name].rows_out -= n
    found = pl.DataFrame({"_unit": pl.Series(units[at], dtype=pl.Int32),
                          "_line": pl.Series(lines[at], dtype=pl.Int64)})
    return index.join(found, on=["_unit", "_line"], how="anti")


def _unit_columns(row_files: list[str], lines: np.ndarray, bounds: np.ndarray, column: str,
                  rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A fixed-width mix column (`_bands` or `_minhash`) of the ordered rows (or of `rows`
    among them) read from the unit files, as [n, width] (null rows zeros), and its validity."""
    from dflash_etl.mix.near_dedup import BANDS, NUM_PERM

    dtype, width = ("<u8", BANDS) if column == "_bands" else ("<u4", NUM_PERM)
    wanted = np.arange(len(lines)) if rows is None else rows
    out = np.zeros((len(wanted), width), dtype=dtype)
    valid = np.zeros(len(wanted), dtype=bool)
    cuts = np.searchsorted(wanted, bounds)
    for k, path in enumerate(row_files):
        mine = wanted[cuts[k]:cuts[k + 1]]
        if not len(mine):
            continue
        table = read_item_file(path, columns=["_line", column])
        at = np.searchsorted(table.column("_line").to_numpy(), lines[mine])  # lines ascend
        out[cuts[k]:cuts[k + 1]] = _fixed_width(table.column(column), dtype, width)[at]
        valid[cuts[k]:cuts[k + 1]] = table.column(column).is_valid().to_numpy(
            zero_copy_only=False)[at]
    return out, valid


def _write_shards(row_files: list[str], kept: pl.DataFrame, out: Path, shard_rows: int) -> None:
    """Stream the kept rows, unit by unit, into part-NNNNN.parquet shards."""
    out.mkdir(exist_ok=True)
    by_unit = kept.partition_by("_unit", as_dict=True)
    writer: pq.ParquetWriter | None = None
    shard, in_shard = 0, 0
    for k, path in enumerate(row_files):
        keys = by_unit.get((k,))
        if keys is None:
            continue
        frame = pl.read_parquet(path, columns=UNIT_SCHEMA.names).join(
            keys, on=["_unit", "_line"], how="inner")
        frame = frame.with_columns(
            pl.when(pl.col("_occurrence") > 1)
            .then(pl.concat_str("id", pl.lit("-"), pl.col("_occurrence").cast(pl.String)))
            .otherwise(pl.col("id"))
            .alias("id")
        )
        table = frame.drop("_unit", "_line", "_occurrence").to_arrow().cast(S.CONVERSATIONS)
        offset = 0
        while offset < table.num_rows:
            if writer is None:
                writer = pq.ParquetWriter(out / f"part-{shard:05d}.parquet", S.CONVERSATIONS)
            take = min(shard_rows - in_shard, table.num_rows - offset)
            writer.write_table(table.slice(offset, take), row_group_size=S.ROW_GROUP_ROWS)
            offset += take
            in_shard += take
            if in_shard >= shard_rows:
                writer.close()
                writer, shard, in_shard = None, shard + 1, 0
    if writer is not None:
        writer.close()
