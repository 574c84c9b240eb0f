"""Load the contracts in contracts/*.toml as pandera (polars) schemas and run them.

The contract files say which columns, types and named checks a stage output must satisfy; the
named checks are polars expressions here, so a contract runs at columnar speed on any output.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from dflash_etl.core.config import project_path
from dflash_etl.core.errors import ContractError
from dflash_etl.core.rundir import write_json_atomic
from dflash_etl.formats import roles

if TYPE_CHECKING:  # pandera (and pandas under it) is imported where a contract is built or run:
    # ~1 s of a stage's start that `read_arrow` and the named checks do not need
    import pandera.polars as pa
    from pandera.errors import SchemaError, SchemaErrors

MESSAGE = pl.Struct(
    {
        "role": pl.String, "content": pl.String, "reasoning": pl.String,
        "tool_calls": pl.String, "tool_call_id": pl.String, "name": pl.String,
    }
)
DTYPES: dict[str, pl.DataType] = {
    "string": pl.String(), "int64": pl.Int64(), "int32": pl.Int32(), "bool": pl.Boolean(),
    "list[message]": pl.List(MESSAGE), "list[int32]": pl.List(pl.Int32),
    "list[int8]": pl.List(pl.Int8), "list[int64]": pl.List(pl.Int64),
}


def contracts_dir() -> Path:
    return project_path("contracts")


# --------------------------------------------------------------- named checks (polars)
def _letters(col: str) -> pl.Expr:
    msg = pl.element()
    return pl.col(col).list.eval(
        pl.when(msg.struct.field("role") == "assistant")
        .then(pl.when(msg.struct.field("tool_calls").is_not_null()).then(pl.lit("C"))
              .otherwise(pl.lit("A")))
        .when(msg.struct.field("role") == "system").then(pl.lit("S"))
        .when(msg.struct.field("role") == "user").then(pl.lit("U"))
        .when(msg.struct.field("role") == "tool").then(pl.lit("T"))
        .otherwise(pl.lit("?"))
    ).list.join("")


def role_letters(frame: pl.DataFrame | pl.LazyFrame, col: str = "messages"):
    """The S/U/A/C/T spelling of every row's roles (see dflash_etl.formats.roles)."""
    return frame.select(_letters(col).alias("letters"))


NAMED_CHECKS: dict[str, tuple[Callable[[str, dict[str, Any]], pl.Expr], str]] = {
    "hex_id": (
        lambda c, p: pl.col(c).str.contains(r"^[0-9a-f]{16,64}(-[0-9]+)?$"),
        "a hex content hash",
    ),
    "non_empty_string": (lambda c, p: pl.col(c).str.len_chars() > 0, "a non-empty string"),
    "roles_known": (lambda c, p: pl.col(c).list.eval(
            pl.element().struct.field("role").is_in(["system", "user", "assistant", "tool"])
        ).list.all(),
        "every role is system, user, assistant or tool",
    ),
    "role_order_valid": (lambda c, p: ~_letters(c).str.contains(roles.ROLE_ORDER_PATTERN),
        "role order: system? user, assistant after user/tool, tool after a tool call",
    ),
    "content_non_empty": (lambda c, p: pl.col(c).list.eval(
            (pl.element().struct.field("content").str.strip_chars().str.len_chars() > 0)
            | ((pl.element().struct.field("role") == "assistant")
               & pl.element().struct.field("tool_calls").is_not_null())
            | (pl.element().struct.field("role") == "tool")
        ).list.all(),
        "non-empty content (except an assistant turn with tool calls, and a tool result: "
        "a tool may return nothing)",
    ),
    "tool_calls_json": (lambda c, p: pl.col(c).list.eval(
            pl.element().struct.field("tool_calls").is_null()
            | pl.element().struct.field("tool_calls").str.starts_with("[")
        ).list.all(),
        "tool_calls is null or JSON text of a list",
    ),
    "json_list_or_null": (lambda c, p: pl.col(c).is_null() | pl.col(c).str.starts_with("["),
        "null or JSON text of a list",
    ),
    "needs_response_matches_last_role": (
        lambda c, p: pl.col(c) == _letters("messages").str.contains(r"[UT]$"),
        "needs_response is true exactly when the last turn is user or tool",
    ),
}


def _longest_run_at_least(col: str, k: int) -> pl.Expr:
    return pl.col(col).list.eval(
        pl.element().cast(pl.Int32).rolling_sum(k).max()
    ).list.first().fill_null(0) >= k


NAMED_CHECKS.update({
    "non_empty_list": (lambda c, p: pl.col(c).list.len() > 0, "a non-empty list"),
    "ids_below_vocab": (
        lambda c, p: (pl.col(c).list.max() < p["vocab_size"]) & (pl.col(c).list.min() >= 0),
        "token ids in [0, vocab_size)",
    ),
    "binary_mask": (lambda c, p: pl.col(c).list.eval(pl.element().is_in([0, 1])).list.all(),
                    "loss_mask holds only 0 and 1"),
    "same_length_as_input_ids": (
        lambda c, p: pl.col(c).list.len() == pl.col("input_ids").list.len(),
        "len(loss_mask) == len(input_ids)",
    ),
    "enough_supervised": (
        lambda c, p: _longest_run_at_least(c, max(1, int(p.get("min_supervised_tokens", 2)))),
        "at least min_supervised_tokens consecutive supervised tokens",
    ),
    "seq_len_matches": (lambda c, p: pl.col(c) == pl.col("input_ids").list.len(),
                        "seq_len == len(input_ids)"),
    "seq_len_within_limit": (lambda c, p: pl.col(c) <= p.get("seq_length", 2**31 - 1),
                             "seq_len <= the configured seq_length"),
})


def register_check(
    name: str, expr: Callable[[str, dict[str, Any]], pl.Expr], description: str
) -> None:
    """Later stages add their own named checks here."""
    NAMED_CHECKS[name] = (expr, description)


def _pandera_check(name: str, params: dict[str, Any]) -> pa.Check:
    import pandera.polars as pa

    if name not in NAMED_CHECKS:
        raise KeyError(f"contract names an unknown check {name!r}; known: {sorted(NAMED_CHECKS)}")
    build, _ = NAMED_CHECKS[name]

    def check(data: Any) -> pl.LazyFrame:
        return data.lazyframe.select(build(data.key, params))

    return pa.Check(check, name=name)


# --------------------------------------------------------------- contract files
@dataclass(frozen=True)
class Contract:
    name: str
    schema: pa.DataFrameSchema
    unique: tuple[tuple[str, ...], ...]
    min_rows: int
    spec: dict[str, Any]


def load_contract(name: str, params: dict[str, Any] | None = None) -> Contract:
    """A contract file as a pandera schema; `params` fill its limits (vocab_size, seq_length…)."""
    import pandera.polars as pa

    params = params or {}
    path = contracts_dir() / f"{name}.toml"
    spec = tomllib.loads(path.read_text())
    columns = {}
    unique: list[tuple[str, ...]] = [tuple(k) for k in spec.get("unique_together", [])]
    for col, cspec in spec["columns"].items():
        checks = [_pandera_check(c, params) for c in cspec.get("checks", [])]
        if "isin" in cspec:
            checks.append(pa.Check.isin(cspec["isin"]))
        if "ge" in cspec:
            checks.append(pa.Check.ge(cspec["ge"]))
        if "le" in cspec:
            checks.append(pa.Check.le(cspec["le"]))
        if cspec.get("unique"):
            unique.append((col,))
        columns[col] = pa.Column(
            DTYPES[cspec["dtype"]], checks=checks, nullable=cspec.get("nullable", False),
            required=cspec.get("required", True),
        )
    schema = pa.DataFrameSchema(columns, strict=spec.get("strict", False), name=spec["name"])
    return Contract(spec["name"], schema, tuple(unique), int(spec.get("min_rows", 1)), spec)


# --------------------------------------------------------------- running a contract
def _failures(exc: SchemaErrors | SchemaError, shard: str) -> list[dict[str, Any]]:
    cases = getattr(exc, "failure_cases", None)
    if cases is None or not isinstance(cases, pl.DataFrame) or cases.height == 0:
        return [{"shard": shard, "check": "schema", "column": None, "count": 1,
                 "samples": [str(exc)[:500]]}]
    out = []
    for (check, column), group in cases.group_by(["check", "column"], maintain_order=True):
        samples = [str(v)[:300] for v in group["failure_case"].head(5).to_list()]
        rows = group["index"].head(5).to_list() if "index" in group.columns else []
        description = NAMED_CHECKS.get(str(check), (None, ""))[1]
        out.append({"shard": shard, "check": str(check), "description": description,
                    "column": column,
                    "count": group.height, "samples": samples, "rows": rows})
    return out


def read_arrow(path: Path) -> Any:
    """A Parquet shard, or an Arrow stream file as `datasets.save_to_disk` writes them, as a
    pyarrow Table."""
    import pyarrow as pa_arrow

    if str(path).endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path)
    with pa_arrow.memory_map(str(path)) as source:
        return pa_arrow.ipc.open_stream(source).read_all()


def read_table(path: Path, columns: list[str] | None = None) -> pl.DataFrame:
    """A stage shard as a polars frame (see `read_arrow`)."""
    if str(path).endswith(".parquet"):
        return pl.read_parquet(path, columns=columns)
    table = read_arrow(path)  # memory-mapped: only the columns selected are read
    frame = pl.from_arrow(table.select(columns) if columns else table)
    return frame


SLICE_BYTES = 16 * 2**20


def arrow_slices(path: Path, max_bytes: int | None = None) -> Any:
    """An Arrow stream shard (500 MB, as datasets writes them) as pyarrow tables of about
    `max_bytes` each, read batch by batch (read, not memory-mapped: mapped pages stay in the
    process until the map closes): whatever is computed per slice (the contract's checks, ~5x
    the slice; the suite's features) needs a slice's memory, not the shard's."""
    import pyarrow as pa_arrow

    max_bytes = max_bytes or SLICE_BYTES
    with pa_arrow.OSFile(str(path)) as source:
        reader = pa_arrow.ipc.open_stream(source)
        batches: list[Any] = []
        size, made = 0, False
        for batch in reader:
            batches.append(batch)
            size += batch.nbytes
            if size >= max_bytes:
                yield pa_arrow.Table.from_batches(batches)
                batches, size, made = [], 0, True
        if batches or not made:
            yield pa_arrow.Table.from_batches(batches, schema=reader.schema)


def _slices(path: Path, max_bytes: int | None = None) -> Any:
    """A shard as polars frames of about `max_bytes` each (`arrow_slices`); Parquet shards
    (bounded by [run] shard_rows) are read whole."""
    if str(path).endswith(".parquet"):
        yield read_table(path)
        return
    for table in arrow_slices(path, max_bytes):
        yield pl.from_arrow(table)


def validate_files(contract: Contract, files: list[Path]) -> dict[str, Any]:
    """Run a contract shard by shard (bounded memory) plus the cross-shard checks."""
    from pandera.config import ValidationDepth, config_context
    from pandera.errors import SchemaError, SchemaErrors

    failures: list[dict[str, Any]] = []
    rows = 0
    with config_context(validation_depth=ValidationDepth.SCHEMA_AND_DATA):
        for path in files:
            for frame in _slices(path):
                try:
                    contract.schema.validate(frame, lazy=True)
                except (SchemaErrors, SchemaError) as exc:
                    found = _failures(exc, path.name)
                    for failure in found:  # row numbers within the shard, not the slice
                        failure["rows"] = [rows + r for r in failure.get("rows") or []]
                    failures.extend(found)
                rows += frame.height
    for key in contract.unique:
        if not files:
            break
        dupes = _duplicates(files, list(key))
        if dupes.height:
            failures.append({"shard": "*", "check": "unique", "column": ",".join(key),
                             "count": dupes.height, "samples": dupes.head(5).rows()})
    if rows < contract.min_rows:
        failures.append({"shard": "*", "check": "min_rows", "column": None, "count": rows,
                         "samples": [f"{rows} rows; the contract needs >= {contract.min_rows}"]})
    return {"contract": contract.name, "rows": rows, "shards": len(files),
            "passed": not failures, "failures": failures}


def _duplicates(files: list[Path], key: list[str]) -> pl.DataFrame:
    """The key values found more than once across the shards. Their hashes are compared first
    (8 bytes a row: the keys of 1M rows as strings took ~600 MB), and only the rows whose hash
    repeats are read again and compared by value (a hash collision is no duplicate)."""
    hashes = pl.concat([read_table(f, key).select(pl.struct(key).hash().alias("h"))
                        for f in files])["h"]
    repeated = hashes.filter(hashes.is_duplicated()).unique()
    if repeated.is_empty():
        return pl.DataFrame()
    candidates = pl.concat([
        frame.filter(pl.struct(key).hash().is_in(repeated.implode()))
        for frame in (read_table(f, key) for f in files)])
    return candidates.filter(pl.struct(key).is_duplicated()).unique()


def format_failures(report: dict[str, Any], limit: int = 8) -> str:
    lines = []
    for f in report["failures"][:limit]:
        where = f"column {f['column']!r}" if f.get("column") else "table"
        lines.append(
            f"  - {f['check']} on {where} in {f['shard']}: {f['count']} failing; "
            f"e.g. {f['samples'][:3]}"
        )
    extra = len(report["failures"]) - limit
    if extra > 0:
        lines.append(f"  … and {extra} more")
    return "\n".join(lines)


def validate_conversations(conversations_dir: Path, report_dir: Path | None = None) -> dict:
    """The conversations contract on a directory of shards; raises ContractError on failure."""
    contract = load_contract("conversations")
    files = sorted(Path(conversations_dir).glob("*.parquet"))
    report = validate_files(contract, files)
    if report_dir is not None:
        (Path(report_dir) / "contract.json").write_text(json.dumps(report, indent=2, default=str))
    if not report["passed"]:
        raise ContractError(
            f"the conversations contract failed on {conversations_dir}:\n"
            + format_failures(report)
            + f"\nFull report: {Path(report_dir or conversations_dir) / 'contract.json'}",
            report,
        )
    return report


def validate_tokenized(stage_dir: Path, params: dict[str, Any]) -> dict:
    """The tokenized contract on a tokenize output's dataset shards, with the limits it ran
    with (`params`: vocab_size, seq_length, min_supervised_tokens); raises ContractError."""
    files = sorted((Path(stage_dir) / "dataset").glob("*.arrow"))
    report = validate_files(load_contract("tokenized", params), files)
    write_json_atomic(Path(stage_dir) / "contract.json", report)
    if not report["passed"]:
        raise ContractError("the tokenized contract failed:\n" + format_failures(report), report)
    return report


def validate_output(contract: str, stage_dir: Path, params: dict[str, Any]) -> dict:
    """The contract the stage registry names for a stage output, on that (partial) output
    directory; its report goes to contract.json there."""
    if contract == "conversations":
        return validate_conversations(Path(stage_dir) / "conversations", stage_dir)
    if contract == "tokenized":
        return validate_tokenized(stage_dir, params)
    raise ValueError(f"no contract file named {contract!r} (contracts/: conversations, tokenized)")
