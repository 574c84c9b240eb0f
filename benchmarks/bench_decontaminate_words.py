"""What Unicode-aware words cost decontamination: the batch match over conversations whose text
is plain ASCII, typographic English (curly quotes, dashes: every message outside ASCII), or
Chinese, against MT-Bench, GSM8K and HumanEval, with this checkout's rule and, in the same run,
an older checkout's (the [a-z0-9] words of content only) as the peer.

    python benchmarks/bench_decontaminate_words.py [--rows 100000] [--peer ../old-checkout]
        [--note "..."]

Each variant is timed in a fresh process (index built first, not timed; the best of 3 passes
of `match_conversations`, or the peer's `match_messages`, over the rows in batches of 5,000,
as ingest's work items take them). Results: benchmarks/results/decontaminate_words.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
EVALSETS = REPO.parent / "shared" / "fixtures" / "evalsets"
ALPACA = REPO.parent / "shared" / "fixtures" / "data" / "alpaca.jsonl"
BATCH = 5000
VARIANTS = ("ascii", "typographic", "chinese")
CHINESE = ("小明有五个苹果，他吃了两个，又买了三个。请问他现在有几个苹果？"
           "请一步一步地解释你的推理过程，并给出最终答案。")


def conversations(rows: int, variant: str) -> list[list[dict]]:
    texts = [v for line in ALPACA.read_text().splitlines()
             for v in json.loads(line).values() if isinstance(v, str) and len(v) > 40]
    out = []
    for k in range(rows):
        turns = [texts[(3 * k + j) % len(texts)] for j in range(3)]
        if variant == "typographic":
            turns = [f"\u201c{t}\u201d \u2014 it\u2019s" for t in turns]
        elif variant == "chinese":
            turns = [CHINESE[k % 7:] + t[:20] for t in turns]
        out.append([{"role": r, "content": t} for r, t in zip(("user", "assistant", "user"),
                                                              turns, strict=True)])
    return out


def measure(rows: int, variant: str) -> dict:
    """In this process: the best of 3 passes over the rows, in batches."""
    import pyarrow as pa

    from dflash_etl.core import schema as S
    from dflash_etl.io.benchmarks import read_benchmark
    from dflash_etl.mix.contamination import ContaminationIndex

    index = ContaminationIndex.build(
        it for name in ("mt_bench_question.jsonl", "gsm8k_test.jsonl", "humaneval.jsonl")
        for it in read_benchmark(EVALSETS / name))
    data = conversations(rows, variant)
    batches = [pa.array([[{f.name: m.get(f.name) for f in S.MESSAGE} for m in r]
                         for r in data[k:k + BATCH]], pa.list_(S.MESSAGE))
               for k in range(0, rows, BATCH)]
    match = getattr(index, "match_conversations", None) or index.match_messages
    best, found = float("inf"), 0
    for _ in range(3):
        start = time.perf_counter()
        found = sum(len(match(b)) for b in batches)
        best = min(best, time.perf_counter() - start)
    import dflash_etl

    return {"seconds": best, "rows_per_s": rows / best, "found": found,
            "module": dflash_etl.__file__}


def run(src: Path, rows: int, variant: str) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", variant, "--rows", str(rows)],
        env={"PYTHONPATH": str(src / "src"), "PATH": "/usr/bin:/bin"}, cwd=src,
        capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode:
        raise SystemExit(f"{variant} at {src}: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.splitlines()[-1])
    if not Path(result["module"]).is_relative_to(src):
        raise SystemExit(f"{src} was not the checkout imported: {result['module']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--peer", type=Path, help="an older checkout to compare with")
    parser.add_argument("--note", default="")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.rows, args.child)))
        return
    checkouts = {"this": REPO, **({"peer": args.peer.resolve()} if args.peer else {})}
    results = {(name, v): run(src, args.rows, v) for v in VARIANTS
               for name, src in checkouts.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    lines = [f"# decontamination's words by script — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
             "", f"Command: `python benchmarks/bench_decontaminate_words.py --rows {args.rows}"
             + (f" --peer {args.peer}`" if args.peer else "`") + f"; {platform.processor() or ''}"
             f" Python {platform.python_version()}, dflash_etl @ {commit}. {args.note}", "",
             "| text | checkout | seconds (best of 3) | conversations/s | found |",
             "|---|---|---:|---:|---:|"]
    for (name, variant), r in results.items():
        lines.append(f"| {variant} | {name} | {r['seconds']:.2f} | {r['rows_per_s']:,.0f} | "
                     f"{r['found']} |")
    out = "\n".join(lines) + "\n"
    print(out)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "decontaminate_words.md").write_text(out)
    (HERE / "results" / "decontaminate_words.json").write_text(json.dumps(
        [{"checkout": n, "text": v, **r} for (n, v), r in results.items()], indent=2) + "\n")


if __name__ == "__main__":
    main()
