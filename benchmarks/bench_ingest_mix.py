"""ingest's mix filters at scale: `[ingest] decontaminate` (against MT-Bench, GSM8K and HumanEval)
and `[ingest] near_dedup`, each against plain ingest on the same synthetic conversations
(bench_ingest.py's dataset: five formats, malformed lines mixed in), in one run.

Goals (issues 27 and 29): decontaminating 1M rows against all three sets costs <= 30% of
ingest's wall time; near-dedup adds <= 50% to it, with peak RSS <= 2.5 GB and its added time per
row at 1M within 1.3x of that at 100k. Each run is a fresh `dflash-etl ingest` process tree
(bench_ingest.measure: wall, peak tree RSS, CPU).

    python benchmarks/bench_ingest_mix.py [--rows 1000000] [--small-rows 100000]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_ingest as B  # noqa: E402

EVALSETS = HERE.parents[1] / "shared" / "fixtures" / "evalsets"
BENCHMARKS = ("mt_bench_question.jsonl", "gsm8k_test.jsonl", "humaneval.jsonl")


def ingest(data: Path, tag: str, extra: list[str]) -> dict[str, Any]:
    config = B.write_config(data, "bench")
    run_dir = B.WORK / "out" / f"mix-{tag}"
    cmd = [sys.executable, "-m", "dflash_etl", "ingest", "--config", str(config), "--run",
           str(run_dir), "--force", *extra]
    result = B.measure(f"ingest {tag}", cmd, B.WORK / "out" / f"mix-{tag}.log")
    if result["rc"] != 0:
        raise SystemExit(f"ingest {tag} failed: see {B.WORK / 'out' / f'mix-{tag}.log'}")
    total = json.loads((run_dir / "ingest" / "stats.json").read_text())["total"]
    result["rows_out"], result["rows_filtered"] = total["rows_out"], total["rows_filtered"]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--small-rows", type=int, default=100_000)
    args = ap.parse_args(argv)
    files = [EVALSETS / name for name in BENCHMARKS]
    if not all(f.is_file() for f in files):
        raise SystemExit(f"the benchmark files are not in {EVALSETS} (../shared/fixtures)")
    (B.WORK / "out").mkdir(parents=True, exist_ok=True)
    variants = {"plain": [], "decontaminate": ["--decontaminate", ",".join(map(str, files))],
                "near_dedup": ["--near-dedup"]}
    res: dict[str, Any] = {"command": "python benchmarks/bench_ingest_mix.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "machine": B.machine_info(), "runs": {}}
    for rows in (args.small_rows, args.rows):
        B.generate(rows, 0, 0.001)
        data = B.dataset_dir(rows, 0, 0.001)
        B.warm_cache(data)
        wanted = variants if rows == args.rows else {k: variants[k] for k in
                                                     ("plain", "near_dedup")}
        res["runs"][str(rows)] = {name: ingest(data, f"{name}-{rows}", extra)
                                  for name, extra in wanted.items()}
    res["goals"] = goals(res["runs"], args.rows, args.small_rows)
    (B.RESULTS / "ingest_mix.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    md = markdown(res, args.rows, args.small_rows)
    (B.RESULTS / "ingest_mix.md").write_text(md)
    print(md)
    return 0


def goals(runs: dict[str, Any], rows: int, small: int) -> dict[str, Any]:
    big, little = runs[str(rows)], runs[str(small)]
    plain = big["plain"]["wall_s"]
    added = (big["near_dedup"]["wall_s"] - plain) / rows
    added_small = (little["near_dedup"]["wall_s"] - little["plain"]["wall_s"]) / small
    return {
        "decontaminate_added_share": round(big["decontaminate"]["wall_s"] / plain - 1, 3),
        "near_dedup_added_share": round(big["near_dedup"]["wall_s"] / plain - 1, 3),
        "near_dedup_peak_rss_bytes": big["near_dedup"]["peak_tree_rss_bytes"],
        "near_dedup_growth_per_row": round(added / added_small, 2) if added_small > 0 else None,
    }


def markdown(res: dict[str, Any], rows: int, small: int) -> str:
    g, m = res["goals"], res["machine"]
    lines = [f"# ingest's mix filters at scale — {m.get('date', '')}", "",
             f"Command: `{res['command']}`; {m.get('nproc')} CPUs ({m.get('cpu')}), "
             f"{m.get('memory')}, Python {m.get('python')}, dflash_etl {m.get('dflash_etl')}. "
             "The dataset: benchmarks/bench_ingest.py's synthetic conversations.", "",
             "| rows | run | wall s | peak tree RSS | CPU s | rows out | filtered |",
             "|---:|---|---:|---:|---:|---:|---|"]
    for size, named in res["runs"].items():
        for name, r in named.items():
            lines.append(f"| {int(size):,} | {name} | {r['wall_s']:.1f} | "
                         f"{r['peak_tree_rss_bytes'] / 2**20:,.0f} MiB | "
                         f"{r.get('user_s', 0) + r.get('sys_s', 0):.1f} | {r['rows_out']:,} | "
                         f"{r['rows_filtered']} |")
    rss = g["near_dedup_peak_rss_bytes"] / 2**30
    lines += ["", "| goal | value | target | met |", "|---|---:|---|---|",
              f"| decontaminate (3 benchmarks) adds | {100 * g['decontaminate_added_share']:.0f}%"
              f" | <= 30% | {'yes' if g['decontaminate_added_share'] <= 0.30 else 'no'} |",
              f"| near_dedup adds | {100 * g['near_dedup_added_share']:.0f}% | <= 50% | "
              f"{'yes' if g['near_dedup_added_share'] <= 0.50 else 'no'} |",
              f"| near_dedup peak RSS at {rows:,} | {rss:.2f} GiB | <= 2.5 GB | "
              f"{'yes' if rss <= 2.5e9 / 2**30 else 'no'} |",
              f"| near_dedup added time per row, {rows:,} / {small:,} | "
              f"{g['near_dedup_growth_per_row'] or 'n/a'}x | <= 1.3x | "
              f"{'yes' if (g['near_dedup_growth_per_row'] or 0) <= 1.3 else 'no'} |"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
