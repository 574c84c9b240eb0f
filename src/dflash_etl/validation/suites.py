"""Great-expectations suites (expectations/*.json) as stage gates.

Why this shape: GE validates pandas frames, and a stage output (nested messages, token lists) is
neither flat nor small. So the per-row features a suite needs (role order valid, first role, turns,
supervised tokens, longest supervised run, supervised fraction, seq_len, source) are computed here
with polars/numpy, and the per-source aggregates (quarantine rate, share of the mix) from
stats.json; GE then checks those small flat frames. great_expectations is imported only inside
`run_suite`, once per process (the import alone takes seconds, minutes on slow machines); a batch
stage imports it ahead of its gate with `warming_up`, while its worker processes are busy.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from dflash_etl.core.config import ConfigError, project_path
from dflash_etl.core.errors import StageError
from dflash_etl.core.outputs import OUTPUTS, TokenizedOutput
from dflash_etl.formats import roles
from dflash_etl.validation.contracts import arrow_slices, read_arrow
from dflash_etl.validation.row_features import (
    capped_replies,
    mid_text_endings,
    tokenized_features,
)

# suite -> the folder of an output of its kind that holds the shards (the contract of the same
# name checks them)
OUTPUT_DIRS = {o.suite: o.marker for o in OUTPUTS if o.suite}
RESULT_FILE = "validation.json"
SAMPLES = 5  # unexpected values / rows kept per failing expectation

# [expectations] in pipeline.toml; these are the defaults.
DEFAULTS: dict[str, float] = {
    "max_quarantine_rate": 0.05,
    "share_tolerance": 0.05,
    "min_mean_supervised_fraction": 0.05,
    "max_mean_supervised_fraction": 0.95,
    "max_capped_reply_share": 0.05,
}
PER_SOURCE_KEY = "max_quarantine_rate_per_source"
# Row-frame columns that identify a row in the samples of a failing expectation.
INDEX_COLUMNS = {"rows": ["id"], "sources": ["source"]}


class SuiteError(StageError):
    """A stage output failed its great-expectations suite; `result` is the validation result."""

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class Thresholds:
    """The suite parameters of one run: [expectations] over DEFAULTS, plus per-source limits."""

    values: dict[str, float] = field(default_factory=lambda: dict(DEFAULTS))
    max_quarantine_rate_per_source: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_section(cls, section: dict[str, Any] | None,
                     run_section: dict[str, Any] | None = None) -> Thresholds:
        """Parse [expectations]; [run] max_quarantine_rate is the fallback default."""
        section = dict(section or {})
        per_source = section.pop(PER_SOURCE_KEY, {}) or {}
        unknown = set(section) - set(DEFAULTS)
        if unknown:
            raise ConfigError(f"[expectations]: unknown keys {sorted(unknown)}; known: "
                              f"{sorted([*DEFAULTS, PER_SOURCE_KEY])}")
        values = dict(DEFAULTS)
        if run_section and "max_quarantine_rate" in run_section:
            values["max_quarantine_rate"] = run_section["max_quarantine_rate"]
        values.update(section)
        for key, value in [*values.items(), *per_source.items()]:
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"[expectations] {key} = {value!r}: use a number >= 0")
        if values["min_mean_supervised_fraction"] > values["max_mean_supervised_fraction"]:
            raise ConfigError("[expectations]: min_mean_supervised_fraction is above "
                              "max_mean_supervised_fraction")
        return cls({k: float(v) for k, v in values.items()},
                   {k: float(v) for k, v in per_source.items()})

    @classmethod
    def from_config(cls, config: Any) -> Thresholds:
        """From a PipelineConfig ([expectations], [run] max_quarantine_rate)."""
        return cls.from_section(config.section("expectations"),
                                {"max_quarantine_rate": config.run.max_quarantine_rate})

    @classmethod
    def from_manifest(cls, run_root: Path) -> Thresholds:
        """The thresholds a run was configured with (its manifest), or the defaults; a manifest
        that cannot be read is a StageError naming it."""
        from dflash_etl.core.rundir import RunDir

        run = RunDir(run_root)
        if not run.manifest_path.exists():
            return cls()
        config = run.manifest().get("config") or {}
        return cls.from_section(config.get("sections", {}).get("expectations"),
                                config.get("run"))

    def quarantine_limit(self, source: str) -> float:
        return self.max_quarantine_rate_per_source.get(source, self.values["max_quarantine_rate"])


# --------------------------------------------------------------- suite files
def expectations_dir() -> Path:
    return project_path("expectations")


def load_suite(name: str) -> dict[str, Any]:
    path = expectations_dir() / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in expectations_dir().glob("*.json"))
        raise StageError(f"no suite {name!r} in {expectations_dir()}; known: {known}")
    return json.loads(path.read_text())


def resolve(value: Any, params: dict[str, Any], where: str) -> Any:
    """Replace {"$PARAMETER": name} (GE's own spelling) by the run's value."""
    if isinstance(value, dict) and set(value) == {"$PARAMETER"}:
        name = value["$PARAMETER"]
        if name not in params:
            raise StageError(f"{where}: unknown parameter {name!r}; known: {sorted(params)}")
        return params[name]
    if isinstance(value, dict):
        return {k: resolve(v, params, where) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, params, where) for v in value]
    return value


# --------------------------------------------------------------- features (polars)
def output_files(stage_dir: Path, kind: str) -> list[Path]:
    directory = Path(stage_dir) / OUTPUT_DIRS[kind]
    return sorted(directory.glob("*.parquet")) + sorted(directory.glob("*.arrow"))


def conversation_features(frame: pl.DataFrame) -> pl.DataFrame:
    """One row per conversation: identity columns plus role features."""
    from dflash_etl.validation.contracts import role_letters

    keep = [c for c in ("id", "source", "format", "needs_response", "file", "line")
            if c in frame.columns]
    out = frame.select(keep)
    if "messages" in frame.columns:
        letters = role_letters(frame)["letters"]
        out = out.with_columns(
            frame["messages"].list.len().cast(pl.Int32).alias("n_turns"),
            frame["messages"].list.first().struct.field("role").alias("first_role"),
            letters.alias("roles"),
            (~letters.str.contains(roles.ROLE_ORDER_PATTERN)
             & ~letters.str.contains("?", literal=True)).alias("role_order_valid"),
        )
    return out


def row_features(stage_dir: Path, kind: str) -> pl.DataFrame:
    """The suite's row frame for a stage output, shard by shard.

    Text columns other than the id (source, file, roles, ...) repeat from row to row and are kept
    as categoricals: as strings, and as Python strings once handed to GE, they made the frame for
    1M conversations several hundred MB and the stage's peak memory grow with the dataset.
    """
    parts = []
    markers = TokenizedOutput.read(Path(stage_dir)) if kind == "tokenized" and (
        Path(stage_dir) / "settings.json").exists() else None
    for path in output_files(stage_dir, kind):
        if kind == "conversations":
            part = conversation_features(_conversation_columns(path))
        else:  # slice by slice: a shard's whole list columns (and temporaries) took GBs
            part = pl.concat([tokenized_features(t, markers) for t in arrow_slices(path)]) \
                if str(path).endswith(".arrow") else tokenized_features(read_arrow(path),
                                                                        markers)
        repetitive = [c for c, dtype in part.schema.items() if dtype == pl.String and c != "id"]
        parts.append(part.with_columns(pl.col(repetitive).cast(pl.Categorical)))
    if not parts:
        return pl.DataFrame()
    return pl.concat(parts, how="diagonal_relaxed")


def _conversation_columns(path: Path) -> pl.DataFrame:
    """The columns the conversation features read: of the messages only role and tool_calls,
    not the contents (a tenth of the shard's memory)."""
    if path.suffix != ".parquet":
        return pl.from_arrow(read_arrow(path))
    import pyarrow.parquet as pq

    shard = pq.ParquetFile(path)
    leaves = [shard.schema.column(i).path for i in range(len(shard.schema))]
    columns = [leaf for leaf in leaves
               if leaf in ("id", "source", "format", "needs_response", "file", "line")
               or (leaf.startswith("messages.") and leaf.rsplit(".", 1)[1] in ("role",
                                                                             "tool_calls"))]
    return pl.from_arrow(shard.read(columns=columns))


def source_frame(stage_dir: Path, kind: str, rows: pl.DataFrame,
                 thresholds: Thresholds) -> pl.DataFrame | None:
    """One row per source: stats.json's accounting next to what the output holds."""
    path = Path(stage_dir) / "stats.json"
    if not path.exists():
        return None
    stats = json.loads(path.read_text()).get("sources", {})
    counted: dict[str, int] = {}
    if "source" in rows.columns:
        counted = dict(rows.group_by("source").len().iter_rows())
    names = list(stats) + sorted(n for n in counted if n not in stats and n is not None)
    capped = capped_replies(rows, _mid_text(stage_dir)) if kind == "tokenized" else {}
    records = []
    for name in names:
        s = stats.get(name, {})
        rows_in = int(s.get("rows_in", 0))
        quarantined = int(s.get("rows_quarantined", 0))
        record = {
            "source": name, "rows_in": rows_in, "rows_out": int(s.get("rows_out", 0)),
            "rows_quarantined": quarantined,
            "quarantine_rate": quarantined / rows_in if rows_in else 0.0,
            "max_quarantine_rate": thresholds.quarantine_limit(name),
            "rows_in_output": counted.get(name, 0),
        }
        if kind == "tokenized":
            record["rows_written"] = int(s.get("rows_written", 0))
            record.update(capped.get(name) or {"longest_reply": 0, "rows_at_longest_reply": 0,
                                               "ending_mid_text": 0,
                                               "capped_reply_share": 0.0})
        else:
            mix = s.get("mix") or {}
            record["weight"] = mix.get("weight")
            record["target_share"] = mix.get("target_share")
        records.append(record)
    frame = pl.DataFrame(records, infer_schema_length=None)
    if kind == "conversations":
        weighted = frame.filter(pl.col("target_share").is_not_null())
        total = weighted["rows_in_output"].sum() if weighted.height else 0
        frame = frame.with_columns(
            pl.when(pl.col("target_share").is_not_null() & (pl.lit(total) > 0))
            .then(pl.col("rows_in_output") / pl.lit(max(total, 1))).otherwise(None)
            .alias("share"))
        frame = frame.with_columns(
            (pl.col("share") - pl.col("target_share")).abs().alias("share_error"))
    return frame


def _mid_text(stage_dir: Path) -> Callable[[list[int]], list[bool]]:
    """How tokenize's tokenizer decodes a reply's last token, loaded only when a source's rows
    pile up at its longest reply; where it cannot be loaded, every such token counts as cut."""
    def ends_mid_text(ids: list[int]) -> list[bool]:
        from dflash_etl.models.tokenizer import load_tokenizer

        try:
            model = json.loads((Path(stage_dir) / "settings.json").read_text())["model"]
            return mid_text_endings(load_tokenizer(model))(ids)
        except (OSError, ValueError, KeyError, StageError):
            return [True] * len(ids)
    return ends_mid_text


# recorded in the conversations suites' parameters since before tokenize wrote its limits; no
# expectation of theirs reads them (validation.json keeps its bytes)
CONVERSATION_LIMITS = {"seq_length": 4096, "min_supervised_tokens": 2}


def stage_parameters(stage_dir: Path, suite_name: str, thresholds: Thresholds
                     ) -> dict[str, Any]:
    """Suite parameters: thresholds plus, for the tokenized rows, the limits tokenize made them
    with (its typed output: no default of the suite's own)."""
    params: dict[str, Any] = dict(thresholds.values)
    if suite_name != "tokenized":
        return {**params, **CONVERSATION_LIMITS}
    limits = TokenizedOutput.read(Path(stage_dir))
    params.update(seq_length=limits.seq_length,
                  min_supervised_tokens=limits.min_supervised_tokens)
    return params


# --------------------------------------------------------------- running a suite with GE
def _expectation(spec: dict[str, Any], params: dict[str, Any], where: str) -> Any:
    from great_expectations.expectations.expectation_configuration import (
        ExpectationConfiguration,
    )

    kwargs = resolve(spec.get("kwargs", {}), params, where)
    config = ExpectationConfiguration(type=spec["type"], kwargs=kwargs,
                                      meta=dict(spec.get("meta", {})))
    try:
        return config.to_domain_obj()
    except Exception as exc:  # GE raises several types for a bad configuration
        raise StageError(f"{where}: expectation {spec['type']} {kwargs} is not valid: {exc}") \
            from exc


_GX: dict[str, Any] = {}
_GX_LOCK = threading.Lock()  # the warm-up thread and the gate may both ask for the context


def _batch_definition() -> Any:
    """One ephemeral GE context per process, with a pandas datasource whose batch is the whole
    dataframe passed at validation time (contexts are slow to build; frames differ per call)."""
    with _GX_LOCK:
        if "batch_definition" not in _GX:
            import logging

            logging.getLogger("great_expectations").setLevel(logging.ERROR)
            os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
            import great_expectations as gx
            from great_expectations.data_context.types.base import ProgressBarsConfig

            context = gx.get_context(mode="ephemeral")
            context.variables.progress_bars = ProgressBarsConfig(globally=False)
            asset = context.data_sources.add_pandas("dflash_etl").add_dataframe_asset("frame")
            _GX["context"] = context
            _GX["batch_definition"] = asset.add_batch_definition_whole_dataframe("whole")
        return _GX["batch_definition"]


def _validate_frame(suite_name: str, frame_name: str, spec: dict[str, Any],
                    frame: pl.DataFrame, params: dict[str, Any]) -> dict[str, Any]:
    """GE validation of one flat frame with the expectations of one frame of a suite file."""
    batch_definition = _batch_definition()
    import great_expectations as gx

    where = f"expectations/{suite_name}.json frames.{frame_name}"
    expectations = []
    for order, item in enumerate(spec["expectations"]):
        item = {**item, "meta": {**item.get("meta", {}), "order": order}}
        expectations.append(_expectation(item, params, where))
    suite = gx.ExpectationSuite(name=f"{suite_name}.{frame_name}", expectations=expectations)
    index = [c for c in INDEX_COLUMNS[frame_name] if c in frame.columns]
    result_format: dict[str, Any] = {"result_format": "SUMMARY",
                                     "partial_unexpected_count": SAMPLES}
    if index:
        result_format["unexpected_index_column_names"] = index
    batch = batch_definition.get_batch(batch_parameters={"dataframe": frame.to_pandas()})
    return batch.validate(suite, result_format=result_format).to_json_dict()


def _summarize(frame_name: str, ge_result: dict[str, Any],
               frame: pl.DataFrame) -> list[dict[str, Any]]:
    """GE's result per expectation, flattened for messages and the report, in the order of the
    suite file (GE returns them in its own order; meta.order keeps ours)."""
    out = []
    results = sorted(ge_result["results"],
                     key=lambda r: (r.get("expectation_config") or {}).get("meta", {})
                     .get("order", 0))
    for res in results:
        config = res.get("expectation_config") or {}
        meta = config.get("meta") or {}
        kwargs = config.get("kwargs", {})
        body = res.get("result") or {}
        exc = res.get("exception_info") or {}
        error = exc.get("exception_message") if exc.get("raised_exception") else None
        columns = [kwargs[k] for k in ("column", "column_A", "column_B") if k in kwargs]
        entry: dict[str, Any] = {
            "frame": frame_name, "type": config.get("type"),
            "columns": columns, "kwargs": {k: v for k, v in kwargs.items()
                                           if k not in ("column", "column_A", "column_B",
                                                        "batch_id")},
            "success": bool(res.get("success")), "why": meta.get("why", ""),
            "observed_value": body.get("observed_value"),
            "element_count": body.get("element_count"),
            "unexpected_count": body.get("unexpected_count"),
            "unexpected_percent": body.get("unexpected_percent"),
            "samples": body.get("partial_unexpected_list", [])[:SAMPLES],
            "error": error,
        }
        ids = body.get("partial_unexpected_index_list") or []
        key = INDEX_COLUMNS[frame_name][0]
        keys = [i.get(key) for i in ids if isinstance(i, dict)][:SAMPLES]
        if keys and key in frame.columns:
            # the checked columns first, then what says which row it is, then the rest
            first = [*columns, "roles", "source", "id"]
            order = [c for c in first if c in frame.columns]
            order += [c for c in frame.columns if c not in order]
            sample = frame.filter(pl.col(key).is_in(keys)).head(SAMPLES).select(
                list(dict.fromkeys(order)))
            entry["sample_rows"] = json.loads(sample.write_json())
        out.append(entry)
    return out


def run_suite(stage_dir: Path, suite_name: str, thresholds: Thresholds) -> dict[str, Any]:
    """Validate one stage output with its suite; returns the validation result (not raised)."""
    import time

    start = time.perf_counter()
    spec = load_suite(suite_name)
    params = stage_parameters(stage_dir, suite_name, thresholds)
    rows = row_features(stage_dir, suite_name)
    frames: dict[str, pl.DataFrame | None] = {
        "rows": rows, "sources": source_frame(stage_dir, suite_name, rows, thresholds)}
    features_s = time.perf_counter() - start
    expectations: list[dict[str, Any]] = []
    ge_results: dict[str, Any] = {}
    for frame_name, frame_spec in spec["frames"].items():
        frame = frames.get(frame_name)
        if frame is None:
            expectations.append({
                "frame": frame_name, "type": "stats_json_present", "columns": [],
                "kwargs": {}, "success": False, "samples": [], "error": None,
                "why": f"{Path(stage_dir) / 'stats.json'} is missing: the per-source checks "
                       "need the stage's accounting", "observed_value": None})
            continue
        ge_results[frame_name] = _validate_frame(suite_name, frame_name, frame_spec, frame,
                                                 params)
        expectations.extend(_summarize(frame_name, ge_results[frame_name], frame))
    failed = [e for e in expectations if not e["success"]]
    return {
        "suite": suite_name, "stage_dir": str(stage_dir), "passed": not failed,
        "parameters": params, "rows": rows.height,
        "statistics": {"evaluated": len(expectations), "successful": len(expectations)
                       - len(failed), "failed": len(failed)},
        "seconds": {"features": round(features_s, 3),
                    "total": round(time.perf_counter() - start, 3)},
        "expectations": expectations,
        "sources": json.loads(frames["sources"].write_json()) if frames["sources"] is not None
        else [],
        "profile": profile(rows, suite_name),
        "great_expectations": ge_results,
    }


# --------------------------------------------------------------- histograms for the report
def histogram(values: np.ndarray, bins: int = 20, integer: bool = False) -> dict[str, Any]:
    """Counts per bin of a numeric column (the report draws them; the data is not re-read)."""
    values = values[~np.isnan(values)] if values.dtype.kind == "f" else values
    if len(values) == 0:
        return {"edges": [], "counts": [], "n": 0}
    lo, hi = float(values.min()), float(values.max())
    if integer and hi - lo + 1 <= bins:
        edges = np.arange(lo, hi + 2) - 0.5
    else:
        edges = np.linspace(lo, hi if hi > lo else lo + 1, bins + 1)
    counts, edges = np.histogram(values, bins=edges)
    return {"edges": [round(float(e), 4) for e in edges], "counts": counts.tolist(),
            "n": len(values), "mean": round(float(values.mean()), 4),
            "min": lo, "max": hi}


def profile(rows: pl.DataFrame, suite_name: str) -> dict[str, Any]:
    wanted = {"conversations": [("n_turns", True)],
              "tokenized": [("seq_len", True), ("supervised_tokens", True),
                            ("supervised_fraction", False)]}[suite_name]
    return {name: histogram(rows[name].drop_nulls().to_numpy(), integer=integer)
            for name, integer in wanted if name in rows.columns}


# --------------------------------------------------------------- messages and the gate
def _fmt(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe_failure(entry: dict[str, Any]) -> str:
    """One failing expectation: what, on which column, sample values, why."""
    cols = ", ".join(repr(c) for c in entry["columns"])
    where = f"column {cols}" if len(entry["columns"]) == 1 else (
        f"columns {cols}" if entry["columns"] else "the table")
    line = f"  - {entry['type']} on {where} ({entry['frame']} frame)"
    limits = {k: v for k, v in entry["kwargs"].items() if k not in ("result_format",)}
    if limits:
        line += f" {_fmt(limits)}"
    if entry.get("error"):
        line += f": could not run: {entry['error'][:300]}"
    elif entry.get("unexpected_count") is not None:
        line += (f": {entry['unexpected_count']} of {entry.get('element_count')} unexpected; "
                 f"e.g. {_fmt(entry['samples'])}")
    elif entry.get("observed_value") is not None:
        line += f": observed {_fmt(entry['observed_value'])}"
    for row in (entry.get("sample_rows") or [])[:3]:
        line += f"\n      row: {_fmt(row, 240)}"
    if entry.get("why"):
        line += f"\n      why: {entry['why']}"
    return line


def _stage_warnings(stage_dir: Path) -> list[str]:
    """The warnings in the stage's stats.json (written before its gate), if any."""
    try:
        warnings = json.loads((stage_dir / "stats.json").read_text()).get("warnings") or []
    except (OSError, ValueError, AttributeError):
        return []
    return [str(w) for w in warnings] if isinstance(warnings, list) else []


def failure_message(result: dict[str, Any], report: Path | None, result_path: Path) -> str:
    failed = [e for e in result["expectations"] if not e["success"]]
    lines = [f"the {result['suite']} suite failed on {result['stage_dir']}: "
             f"{len(failed)} of {result['statistics']['evaluated']} expectations"]
    lines += [describe_failure(e) for e in failed[:8]]
    if len(failed) > 8:
        lines.append(f"  … and {len(failed) - 8} more")
    if report is not None:
        lines.append(f"Report: {report}")
    lines.append(f"Validation result: {result_path}")
    warned = _stage_warnings(Path(result["stage_dir"]))
    if warned:  # what the stage itself knew about its data: often the fix
        lines.append("The stage warned:")
        lines += [f"  - {w}" for w in warned[:4]]
    lines.append("Fix the data, or the thresholds in [expectations] of pipeline.toml, and rerun.")
    return "\n".join(lines)


def report_path(run_root: Path, stage: str) -> Path:
    """Where the run report shows a stage's validation (built by dflash_etl.report)."""
    return Path(run_root) / "docs" / "validations" / f"{stage}.html"


@contextlib.contextmanager
def warming_up(modules: tuple[str, ...] = ()) -> Iterator[Callable[[], None]]:
    """Yields `start()`, which imports `modules` (the contract's engine) and great_expectations
    with its context in a thread, joined on leaving: a batch stage calls it once its worker
    processes are forked, so the seconds these imports take overlap the work instead of
    following it. (Started before the fork, a child could inherit an import lock held by the
    thread.) Errors are left for the gate itself to raise with context."""
    threads: list[threading.Thread] = []

    def warm() -> None:
        try:
            for name in modules:
                importlib.import_module(name)
            _batch_definition()
        except Exception:  # the gate itself reports what is wrong
            pass

    def start() -> None:
        if not threads:
            threads.append(threading.Thread(target=warm, name="dflash-etl-warm-up", daemon=True))
            threads[0].start()

    try:
        yield start
    finally:
        for thread in threads:
            thread.join()


def gate(stage: str, suite: str, stage_dir: Path, run_root: Path, thresholds: Thresholds
         ) -> dict[str, Any]:
    """Run `suite` on a stage's (partial) output and save the result there; raise SuiteError
    when it fails. The stage then marks itself failed and builds the report the message names."""
    from dflash_etl.core.rundir import write_json_atomic

    result = run_suite(stage_dir, suite, thresholds)
    result_path = Path(stage_dir) / RESULT_FILE
    write_json_atomic(result_path, result)
    if not result["passed"]:
        raise SuiteError(failure_message(result, report_path(run_root, stage), result_path),
                         result)
    return result
