"""extract --plan against the run it projects: the embedded default (data/pipeline.toml, its
tiny target) through ingest -> regenerate -> tokenize (not timed), then `extract --plan` (a
few batches measured) and the real extract; the plan's projected bytes, tokens and seconds
against what the run wrote and took. Writes the "Plan" section of results/extract.md (the rest
of that file is bench_extract.py's) and results/extract_plan.json.

    python benchmarks/bench_extract_plan.py [--plan-batches 4] [--format native|speculators]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work" / "extract_plan"
MARK = "<!-- bench_extract_plan.py -->"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan-batches", type=int, default=4)
    parser.add_argument("--format", default="native", choices=("native", "speculators"))
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    from dflash_etl.stages import extract, ingest, load_config, regenerate, tokenize

    config = load_config(REPO / "data" / "pipeline.toml")
    run_dir = WORK / "run"
    for stage in (ingest, regenerate, tokenize):
        stage.run(config, run_dir, progress=False)
    shutil.rmtree(run_dir / "extract", ignore_errors=True)
    plan = extract.run(config, run_dir, progress=False, plan=True,
                       plan_batches=args.plan_batches, format=args.format)
    shard_s = [0.0]  # the run's own share of the work the plan projects: its shards
    write_shard = extract._write_shard

    def timed(*a, **kw):
        start = time.perf_counter()
        try:
            return write_shard(*a, **kw)
        finally:
            shard_s[0] += time.perf_counter() - start

    extract._write_shard = timed
    doc = extract.run(config, run_dir, force=True, progress=False, format=args.format)
    extract._write_shard = write_shard
    out = run_dir / "extract"
    written = sum(f.stat().st_size for f in (out / "hidden_states").iterdir()) + (
        out / "index.parquet").stat().st_size
    stage_s = json.loads((run_dir / "manifest.json").read_text())["stages"]["extract"]["seconds"]
    projected = plan["projected"]
    result = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                          "device": plan["device"]},
              "format": args.format, "plan": plan,
              "actual": {"bytes": written, "tokens": doc["total"]["tokens"],
                         "rows": doc["total"]["rows_in"], "stage_seconds": stage_s,
                         "shard_seconds": round(shard_s[0], 3)}}
    (HERE / "results" / "extract_plan.json").write_text(json.dumps(result, indent=2) + "\n")

    load = plan["measured"]["load_seconds"]
    whole = projected["seconds"] + load

    def off(a: float, b: float) -> str:
        return f"{100 * (a - b) / b:+.1f}%"

    lines = [MARK, f"## Plan (`extract --plan`) against the run — {result['date']}", "",
             f"{os.cpu_count()} cores, Python {platform.python_version()}, device "
             f"{plan['device']}; the embedded default after regenerate ({plan['dataset']['rows']}"
             f" rows, {plan['dataset']['tokens']} tokens, {plan['dataset']['batches']} batches); "
             f"its tiny target (hidden {plan['hidden_size']}, {plan['n_layers']} layers), layers "
             f"{plan['stored_layers']}, {plan['dtype']}, {args.format}. The plan measured "
             f"{plan['measured']['batches']} batches ({plan['measured']['tokens']} tokens, "
             f"{plan['measured']['tokens_per_s']} tokens/s). Command: "
             f"`python benchmarks/bench_extract_plan.py --plan-batches {args.plan_batches}"
             f"{' --format speculators' if args.format != 'native' else ''}`.", "",
             "| | plan (projected) | run (actual) | off by |", "|---|---:|---:|---:|",
             f"| tokens | {plan['dataset']['tokens']} | {doc['total']['tokens']} | "
             f"{off(plan['dataset']['tokens'], doc['total']['tokens'])} |",
             f"| bytes on disk (hidden states + index) | {projected['bytes']} | {written} | "
             f"{off(projected['bytes'], written)} |",
             f"| seconds of the shards' work (forward passes, writing, health check) | "
             f"{projected['seconds']} | {shard_s[0]:.3f} | {off(projected['seconds'], shard_s[0])}"
             " |",
             f"| seconds of the whole stage (plan: + loading the target, {load} s; run: also "
             f"imports, contract) | {whole:.3f} | {stage_s} | {off(whole, stage_s)} |",
             "",
             "Seconds on cores shared with other jobs vary from one moment to the next (the "
             "plan's batches and the run's are timed at different moments); the bytes do not.",
             "",
             f"Disk: {plan['advice']}.", ""]
    path = HERE / "results" / "extract.md"
    text = path.read_text() if path.exists() else ""
    text = re.sub(re.escape(MARK) + r".*", "", text, flags=re.S).rstrip("\n")
    path.write_text(text + "\n\n" + "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
