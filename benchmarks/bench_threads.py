"""What torch's thread count costs the embedded default on a busy machine: `dflash-etl run` on
`data/` (ingest, regenerate, tokenize, extract, train with its tau evaluation on the tiny
target) by this revision and by REV, quiet and with every core given a busy competitor
process, in one run.

    python benchmarks/bench_threads.py --base REV [--this REV] [--load N] [--note "..."]

Both revisions are taken with `git archive` (benchmarks/work/threads/); each command runs as
a fresh process tree (bench_ingest.measure); the per-stage seconds come from the manifest.
The load is N processes spinning in Python (default: one per core), started before the command
and stopped after it. Order: base quiet, this quiet, this loaded, base loaded. Results:
benchmarks/results/threads.md (+ json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
from datetime import UTC, datetime
from io import BytesIO
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import bench_ingest as B  # noqa: E402

WORK = HERE / "work" / "threads"
STAGES = ("ingest", "regenerate", "tokenize", "extract", "train")


def checkout(rev: str, name: str) -> Path:
    """REV's package (src/, importable with PYTHONPATH) and the files it reads from its
    checkout (contracts, expectations, data, pyproject.toml) under WORK/name: a commit, never
    the working tree being edited."""
    into = WORK / name
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    blob = subprocess.run(["git", "archive", "--format=tar", rev, "src", "contracts",
                           "expectations", "data", "pyproject.toml"], cwd=REPO,
                          capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run(name: str, tree: Path, load: int) -> dict:
    out = WORK / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = str(tree / "src")
    spinners = busy(load)
    try:
        result = B.measure(name, [sys.executable, "-m", "dflash_etl", "run", "--config",
                                  str(REPO / "data" / "pipeline.toml"), "--run",
                                  str(out / "run")], out / "run.log", env=env)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    stages = json.loads((out / "run" / "manifest.json").read_text())["stages"]
    result["stage_seconds"] = {s: round(stages[s].get("seconds", 0.0), 1) for s in STAGES
                               if s in stages}
    result["tau"] = json.loads((out / "run" / "train" / "eval.json").read_text())["tau_final"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the git revision to compare with")
    parser.add_argument("--this", default="HEAD", help="the revision measured (default HEAD)")
    parser.add_argument("--load", type=int, default=len(os.sched_getaffinity(0)),
                        help="busy processes while loaded (default: one per core)")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    trees = {"base": checkout(args.base, "base"), "this": checkout(args.this, "this")}
    order = [("base", 0), ("this", 0), ("this", args.load), ("base", args.load)]
    results = {}
    for name, load in order:
        key = f"{name} {'loaded' if load else 'quiet'}"
        results[key] = run(key.replace(" ", "-"), trees[name], load)
    commits = {name: subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO,
                                    capture_output=True, text=True).stdout.strip()
               for name, rev in (("base", args.base), ("this", args.this))}
    info = B.machine_info()
    lines = [f"# the embedded default, quiet and with {args.load} busy processes — "
             f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC", "",
             f"Command: `python benchmarks/bench_threads.py --base {args.base} --this "
             f"{args.this} --load {args.load}` (base {commits['base']}, this "
             f"{commits['this']}); {info['cpu']}, {info['nproc']} CPUs, {info['memory']}, Python "
             f"{info['python']}, dflash_etl {info['dflash_etl']}. {args.note}", "",
             "| checkout | machine | wall s | " + " | ".join(f"{s} s" for s in STAGES)
             + " | tau |", "|---|---|---:|" + "---:|" * len(STAGES) + "---:|"]
    for key, r in results.items():
        tree, state = key.split()
        tau = f"{r['tau']:.3f}" if isinstance(r["tau"], int | float) else str(r["tau"])
        lines.append(f"| {tree} | {state} | {r['wall_s']:.1f} | " + " | ".join(
            str(r["stage_seconds"].get(s, "")) for s in STAGES) + f" | {tau} |")
    for tree in ("base", "this"):
        quiet, loaded = results[f"{tree} quiet"], results[f"{tree} loaded"]
        lines.append("")
        lines.append(f"{tree}: loaded / quiet = {loaded['wall_s'] / quiet['wall_s']:.2f}x")
    out = "\n".join(lines) + "\n"
    print(out)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "threads.md").write_text(out)
    (HERE / "results" / "threads.json").write_text(json.dumps(
        {"base": args.base, "this": args.this, "commits": commits, "load": args.load,
         "machine": info,
         "runs": {k: {f: v for f, v in r.items() if f != "samples"}
                  for k, r in results.items()}}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
