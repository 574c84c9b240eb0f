"""Peak memory of `dflash-etl tokenize` as the dataset grows: the whole process tree (the stage,
with its gates, and its workers) and the stage's own process, sampled every 0.1 s.

The synthetic conversations of bench_tokenize.py (1-3 turns, 10% system), ingested once per size
(not measured); the real Qwen3.6 tokenizer (../shared/fixtures) unless --tokenizer bpe8k.
Goal: peak RSS <= 2 GB for the tree at 1M conversations and <= 1.2x growth from 100k to 1M.

    python benchmarks/bench_tokenize_memory.py [--sizes 100000,1000000] [--tokenizer qwen3.6]

Writes benchmarks/results/tokenize_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from bench_tokenize import (  # noqa: E402
    QWEN,
    WORK,
    make_data,
    stage_env,
    timed,
    train_bpe,
)

MEMORY = WORK.parent / "tokenize_memory"


def measure(run_dir: Path, model: Path) -> dict:
    """One tokenize run, its gates included (they validate in the stage's process)."""
    cmd = [sys.executable, "-m", "dflash_etl", "tokenize", "--run", str(run_dir), "--model",
           str(model), "--force", "--seq-length", "4096"]
    result = timed(cmd, stage_env())
    stats = json.loads((run_dir / "tokenize" / "stats.json").read_text())["total"]
    return {"seconds": round(result["seconds"], 1), "peak_tree_mb": round(result["peak_rss_mb"]),
            "peak_stage_process_mb": round(result["peak_own_rss_mb"]),
            "conversations": stats["rows_in"], "rows_written": stats["rows_written"],
            "tokens": stats["tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--tokenizer", choices=("qwen3.6", "bpe8k"), default="qwen3.6")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    MEMORY.mkdir(parents=True, exist_ok=True)
    model = QWEN
    if args.tokenizer == "bpe8k":
        model = WORK / "bpe8k"
        if not (model / "tokenizer.json").exists():
            corpus = MEMORY / "bpe_corpus.jsonl"
            make_data(20000, corpus)
            train_bpe(corpus, model)
    results = {"date": dt.date.today().isoformat(), "tokenizer": args.tokenizer, "machine": {
        "cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(), "load_avg_at_start": os.getloadavg()[0]},
        "runs": []}
    for n in sizes:
        source = MEMORY / f"sharegpt_{n}.jsonl"
        if not source.exists():
            make_data(n, source)
        run_dir = MEMORY / f"run_{n}"
        if not (run_dir / "ingest" / "conversations").is_dir():
            config = MEMORY / f"bench_{n}.toml"
            config.write_text(f'[run]\ndedup = false\n[[sources]]\nname = "sharegpt"\n'
                              f'path = "{source.name}"\n')
            subprocess.run([sys.executable, "-m", "dflash_etl", "ingest", "--config",
                            str(config), "--run", str(run_dir)], check=True,
                           stdout=subprocess.DEVNULL, env=stage_env())
        result = measure(run_dir, model)
        results["runs"].append(result)
        print(json.dumps(result), flush=True)
    results["machine"]["load_avg_at_end"] = os.getloadavg()[0]
    first, last = results["runs"][0], results["runs"][-1]
    results["growth"] = round(last["peak_tree_mb"] / first["peak_tree_mb"], 2)
    (HERE / "results" / "tokenize_memory.json").write_text(json.dumps(results, indent=2) + "\n")
    m = results["machine"]
    lines = [f"# tokenize peak memory ({results['date']}, {m['cores']} cores, load "
             f"{m['load_avg_at_start']:.1f} -> {m['load_avg_at_end']:.1f}, {args.tokenizer})", "",
             "| conversations | tokens | seconds | peak RSS, process tree | peak RSS, stage "
             "process |", "|---:|---:|---:|---:|---:|"]
    for r in results["runs"]:
        lines.append(f"| {r['conversations']} | {r['tokens']} | {r['seconds']} | "
                     f"{r['peak_tree_mb']} MB | {r['peak_stage_process_mb']} MB |")
    lines += ["", f"Growth of the tree's peak from {first['conversations']} to "
              f"{last['conversations']} conversations: **{results['growth']}x** (goal <= 1.2x; "
              "peak <= 2 GB at 1M). Command: `python benchmarks/bench_tokenize_memory.py`."]
    (HERE / "results" / "tokenize_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
