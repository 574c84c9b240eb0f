"""What one very long message costs tokenize: a 12 MB reply (under ingest's 16 MiB line limit)
among ordinary conversations, `dflash-etl tokenize --seq-length 8192` with this checkout and,
in the same run, an older checkout's (which tokenized every text whole before the cut) as the
peer.

    python benchmarks/bench_tokenize_long_message.py [--mb 12] [--peer ../old-checkout]
        [--note "..."]

Each checkout ingests the same JSONL (not timed), then its tokenize runs as a fresh process
tree with one worker (bench_ingest.measure: wall seconds, peak tree RSS), and its rows are
compared: the same input_ids and loss masks in both. Results:
benchmarks/results/tokenize_long_message.md.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import bench_ingest as B  # noqa: E402

FIXTURES = REPO.parent / "shared" / "fixtures"
TOKENIZER = FIXTURES / "qwen36-tokenizer"
WORK = HERE / "work" / "tokenize_long_message"


def write_source(path: Path, mb: float) -> None:
    rng = random.Random(0)
    words = ["the", "drafter", "accepts", "tokens", "def", "return", "x", "=", "1", "\n", "并且"]
    reply = []
    size = 0
    while size < mb * 2**20:
        word = rng.choice(words)
        reply.append(word)
        size += len(word.encode()) + 1
    rows = [json.loads(line) for line in (FIXTURES / "data" / "sharegpt.jsonl").read_text()
            .splitlines()]
    rows.append({"conversations": [{"from": "human", "value": "Write it all out."},
                                   {"from": "gpt", "value": " ".join(reply)}]})
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def run(name: str, src: Path, data: Path) -> dict:
    run_dir = WORK / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "pipeline.toml").write_text(
        f'[[sources]]\nname = "long"\npath = "{data}"\n')
    env = {"PYTHONPATH": str(src / "src"), "PATH": "/usr/bin:/bin", "HOME": str(WORK)}
    python = sys.executable
    ingest = B.measure(f"{name} ingest", [python, "-m", "dflash_etl", "ingest", "--config",
                                          str(run_dir / "pipeline.toml"), "--run",
                                          str(run_dir / "run"), "--workers", "1"],
                       run_dir / "ingest.log", env=env)
    if ingest["rc"]:
        raise SystemExit(f"{name}: ingest failed, see {run_dir / 'ingest.log'}")
    result = B.measure(f"{name} tokenize", [python, "-m", "dflash_etl", "tokenize", "--run",
                                            str(run_dir / "run"), "--model", str(TOKENIZER),
                                            "--seq-length", "8192", "--workers", "1"],
                       run_dir / "tokenize.log", env=env)
    if result["rc"]:
        raise SystemExit(f"{name}: tokenize failed, see {run_dir / 'tokenize.log'}")
    return result


def rows(name: str) -> list[tuple]:
    import datasets

    table = datasets.load_from_disk(str(WORK / name / "run" / "tokenize" / "dataset")
                                    ).with_format(None)
    return sorted(zip(table["id"], table["turn"], table["input_ids"], table["loss_mask"],
                      strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=12)
    parser.add_argument("--peer", type=Path, help="an older checkout to compare with")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    data = WORK / f"long_{args.mb:g}mb.jsonl"
    write_source(data, args.mb)
    checkouts = {"this": REPO, **({"peer": args.peer.resolve()} if args.peer else {})}
    results = {name: run(name, src, data) for name, src in checkouts.items()}
    same = rows("this") == rows("peer") if args.peer else None
    info = B.machine_info()
    lines = [f"# tokenize with one {args.mb:g} MB message — {datetime.now(UTC):%Y-%m-%d %H:%M} "
             "UTC", "", f"Command: `python benchmarks/bench_tokenize_long_message.py --mb "
             f"{args.mb:g}" + (f" --peer {args.peer}`" if args.peer else "`")
             + f"; {info['cpu']}, {info['nproc']} CPUs, {info['memory']}, Python "
             f"{info['python']}, dflash_etl {info['dflash_etl']}. {args.note}", "",
             "| checkout | tokenize wall s | peak tree RSS |", "|---|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['wall_s']:.1f} | {r['peak_tree_rss_bytes'] / 2**20:,.0f} "
                     "MiB |")
    if same is not None:
        lines += ["", f"The two checkouts' rows (ids, turns, input_ids, loss masks): "
                      f"{'identical' if same else 'DIFFERENT'}."]
    out = "\n".join(lines) + "\n"
    print(out)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "tokenize_long_message.md").write_text(out)
    (HERE / "results" / "tokenize_long_message.json").write_text(json.dumps(
        {"mb": args.mb, "rows_identical": same, "machine": info,
         "runs": {n: {k: v for k, v in r.items() if k != "samples"}
                  for n, r in results.items()}}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
