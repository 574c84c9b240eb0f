"""Suite benchmark: the tokenized great-expectations suite on 1M rows vs the tokenize stage.

1. Tokenize throughput: N synthetic ShareGPT conversations (bench_tokenize.make_data, default
   20k) are ingested (not timed), then `tokenize.run` with data/tokenizer is timed in this process
   (workers: one per core). The stage's own gate (the suite) is subtracted, so the figure is the
   tokenize work alone; the time for 1M rows is extrapolated linearly from it (said so in the
   result).
2. Suite: 1M tokenized rows, made by cycling the real rows tokenize just wrote (with new ids) and
   written exactly as the stage writes them (row Parquet -> io.hf_dataset.save_dataset, plus
   stats.json and settings.json), validated by `suites.run_suite` (features with polars/numpy +
   great_expectations on the flat frames). great_expectations' import is timed separately.

Goal: suite seconds < 10% of the (extrapolated) tokenize seconds for the same rows.
Writes benchmarks/results/suites_1000000.{json,md}.

    python benchmarks/bench_suites.py [--rows 1000000] [--tokenize-rows 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work" / "suites"
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from bench_ingest import machine_info  # noqa: E402
from bench_tokenize import make_data  # noqa: E402


def time_tokenize(n: int, workers: int) -> dict:
    from dflash_etl.stages import ingest, parse_config, tokenize

    base = WORK / f"tok-{n}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    make_data(n, base / "rows.jsonl")
    config = parse_config({"run": {"workers": workers},
                           "sources": [{"name": "synthetic", "path": "rows.jsonl"}],
                           "tokenize": {"model": str(REPO / "data" / "tokenizer"),
                                        "seq_length": 4096}}, base)
    ingest.run(config, base / "run", progress=False)  # also imports great_expectations
    start = time.perf_counter()
    doc = tokenize.run(config, base / "run", workers=workers, progress=False)
    wall = time.perf_counter() - start
    gate = json.loads((base / "run" / "tokenize" / "validation.json").read_text())
    rows = doc["total"]["rows_written"]
    seconds = wall - gate["seconds"]["total"]
    return {"conversations": n, "rows": rows, "tokens": doc["total"]["tokens"],
            "workers": workers, "stage_wall_seconds": round(wall, 3),
            "gate_seconds": gate["seconds"]["total"], "seconds": round(seconds, 3),
            "rows_per_second": round(rows / seconds, 1),
            "dataset": str(base / "run" / "tokenize" / "dataset")}


def write_synthetic(dataset: Path, rows: int, out: Path) -> dict:
    """`rows` tokenized rows cycled from a real tokenize output, written as the stage does."""
    import polars as pl
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_etl.core.schema import TOKENIZED_ROWS
    from dflash_etl.io.hf_dataset import save_dataset

    shutil.rmtree(out, ignore_errors=True)
    chunks = out / "chunks"
    chunks.mkdir(parents=True)
    tables = []
    for path in sorted(dataset.glob("*.arrow")):
        with pa.memory_map(str(path)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    real = pl.from_arrow(pa.concat_tables(tables))
    sources = ["alpha", "beta", "gamma", "delta"]
    per_chunk = 100_000
    files = []
    for k, start in enumerate(range(0, rows, per_chunk)):
        n = min(per_chunk, rows - start)
        take = (pl.int_range(start, start + n, eager=True) % real.height).cast(pl.UInt32)
        part = real[take.to_numpy()].with_columns(
            pl.format("r{}", pl.int_range(start, start + n, eager=True)).alias("id"),
            pl.Series("source", [sources[i % 4] for i in range(start, start + n)]),
            pl.lit(-1, pl.Int32).alias("turn"))
        path = chunks / f"c{k:06d}.rows.parquet"
        pq.write_table(part.to_arrow().cast(TOKENIZED_ROWS), path)
        files.append(path)
    save_dataset(files, out / "dataset")
    shutil.rmtree(chunks)
    per_source = rows // 4
    stats = {name: {"rows_in": per_source + (1 if i < rows % 4 else 0),
                    "rows_out": per_source + (1 if i < rows % 4 else 0),
                    "rows_quarantined": 0, "quarantine_reasons": {}, "rows_filtered": {},
                    "rows_written": per_source + (1 if i < rows % 4 else 0)}
             for i, name in enumerate(sources)}
    (out / "stats.json").write_text(json.dumps({"total": {}, "sources": stats}))
    (out / "settings.json").write_text(json.dumps({"seq_length": 4096,
                                                   "min_supervised_tokens": 2}))
    return {"rows": rows,
            "bytes": sum(p.stat().st_size for p in (out / "dataset").glob("*.arrow"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--tokenize-rows", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    start = time.perf_counter()
    import great_expectations  # noqa: F401  (timed: the gate pays it once per process)

    ge_import = time.perf_counter() - start
    print(f"great_expectations import: {ge_import:.1f} s", flush=True)
    tok = time_tokenize(args.tokenize_rows, args.workers)
    print(f"tokenize: {tok['rows']} rows in {tok['seconds']:.1f} s "
          f"({tok['rows_per_second']:.0f} rows/s; gate {tok['gate_seconds']:.1f} s excluded)",
          flush=True)
    stage = WORK / f"tokenized-{args.rows}"
    t0 = time.perf_counter()
    data = write_synthetic(Path(tok["dataset"]), args.rows, stage)
    print(f"wrote {args.rows} synthetic rows in {time.perf_counter() - t0:.1f} s", flush=True)

    from dflash_etl.validation import suites

    t0 = time.perf_counter()
    result = suites.run_suite(stage, "tokenized", suites.Thresholds())
    suite_s = time.perf_counter() - t0
    assert result["passed"], suites.failure_message(result, None, stage / "validation.json")
    tokens = round(result["profile"]["seq_len"]["mean"] * result["rows"])
    tokenize_extrapolated = args.rows / tok["rows_per_second"]
    share = suite_s / tokenize_extrapolated
    share_with_import = (suite_s + ge_import) / tokenize_extrapolated
    doc = {
        "machine": machine_info(), "load_average": os.getloadavg(),
        "rows": args.rows, "tokens_approx": tokens, "dataset_bytes": data["bytes"],
        "great_expectations_import_seconds": round(ge_import, 3),
        "suite_seconds": round(suite_s, 3), "suite_breakdown": result["seconds"],
        "expectations": result["statistics"],
        "tokenize_measured": {k: v for k, v in tok.items() if k != "dataset"},
        "tokenize_seconds_extrapolated": round(tokenize_extrapolated, 1),
        "extrapolation": f"linear: {args.rows} rows / {tok['rows_per_second']} rows/s "
                         f"measured on {tok['rows']} rows",
        "suite_share_of_tokenize": round(share, 4),
        "suite_share_with_ge_import": round(share_with_import, 4),
        "goal": "suite < 10% of tokenize", "goal_met": share < 0.10,
    }
    RESULTS.mkdir(exist_ok=True)
    name = f"suites_{args.rows}"
    (RESULTS / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    m = doc["machine"]
    md = f"""# Suite benchmark: {args.rows:,} tokenized rows

Machine: {m['cpu']}, {m['nproc']} cores, {m['memory']}; {m['date']}; load average (1, 5, 15 min)
at the end {', '.join(f'{x:.1f}' for x in doc['load_average'])}. dflash_etl {m['dflash_etl']},
Python {m['python']}, polars {m['polars']}.

Command: `python benchmarks/bench_suites.py --rows {args.rows} --tokenize-rows \
{args.tokenize_rows}`

| what | seconds |
|---|---|
| tokenized suite on {args.rows:,} rows (features + GE, {result['statistics']['evaluated']} \
expectations) | {suite_s:.1f} |
| of which per-row features (polars/numpy) | {result['seconds']['features']:.1f} |
| great_expectations import (once per process) | {ge_import:.1f} |
| tokenize, measured on {tok['rows']:,} rows ({tok['workers']} workers, gate excluded) | \
{tok['seconds']:.1f} ({tok['rows_per_second']:.0f} rows/s) |
| tokenize for {args.rows:,} rows, **extrapolated linearly** | {tokenize_extrapolated:.0f} |

Suite / tokenize: **{share:.2%}** ({share_with_import:.2%} counting the GE import);
goal < 10%: {'met' if doc['goal_met'] else 'NOT met'}.

The 1M rows cycle the real rows tokenize wrote for the measurement (new ids, 4 sources) and are
written by the stage's own writer (`io.hf_dataset.save_dataset`, {data['bytes'] / 2**20:,.0f} MiB of
Arrow).
"""
    (RESULTS / f"{name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
