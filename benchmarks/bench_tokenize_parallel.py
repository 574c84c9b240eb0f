"""Two `dflash-etl tokenize` commands started together on two runs: each one's wall time against
the same command alone, with this tree's in-process gates and, with --base REV, a revision's.

Why: a gate helper process served every gated command of a user behind one lock (revisions up
to b0cad19): a second command's gates waited for the first's. With the gates in each command's
own process, two commands share only the cores. Each command gets `--workers 1`, so two of them
fit the 2 cores of the machine this runs on and "together" costs nothing but the shared memory
bandwidth: a wall time beside alone's is the figure. N synthetic ShareGPT conversations (as
bench_tokenize.py makes them), the 8k-BPE ChatML tokenizer, ingested once (not timed); alone and
together alternate, `--repeats` each, medians. No process is left running by either: nothing is
resident before a run.

    python benchmarks/bench_tokenize_parallel.py [--conversations 20000] [--repeats 3]
        [--base b0cad19]

Writes benchmarks/results/tokenize_parallel.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from bench_tokenize import WORK, make_data, stage_env, train_bpe, warm_up  # noqa: E402

PARALLEL = WORK.parent / "tokenize_parallel"


def tokenize(run_dir: Path, model: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_etl", "tokenize", "--run", str(run_dir), "--model",
         str(model), "--force", "--workers", "1", "--seq-length", "4096"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def timed_runs(runs: list[Path], model: Path, env: dict[str, str]) -> list[float]:
    """Start one tokenize per run at once; each one's wall seconds (a failure ends the bench)."""
    start = time.perf_counter()
    procs = [tokenize(run, model, env) for run in runs]
    walls: list[float] = [0.0] * len(procs)

    def wait(k: int) -> None:
        procs[k].wait()
        walls[k] = time.perf_counter() - start

    threads = [threading.Thread(target=wait, args=(k,)) for k in range(len(procs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for proc in procs:
        if proc.returncode:
            raise SystemExit(f"tokenize failed: {proc.stderr.read()[-3000:]}")
    return [round(w, 2) for w in walls]


def base_tree(revision: str) -> Path:
    """REV's src/, contracts/ and expectations/ (a checkout the stage finds its files in)."""
    base = PARALLEL / "base"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "src", "contracts",
                              "expectations", "pyproject.toml"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    return base / "src"


def measure(name: str, src: Path, runs: list[Path], model: Path, repeats: int,
            env: dict[str, str]) -> dict:
    alone, together = [], []
    warm_up(src)
    for k in range(repeats):
        for mode in (("alone", "together") if k % 2 == 0 else ("together", "alone")):
            if mode == "alone":
                alone.append(timed_runs(runs[:1], model, env)[0])
            else:
                together.append(timed_runs(runs, model, env))
        print(name, "alone", alone, "together", together, flush=True)
    second = [max(pair) for pair in together]
    return {"alone_s": alone, "together_s": together,
            "alone_median_s": statistics.median(alone),
            "second_median_s": statistics.median(second),
            "second_vs_alone": round(statistics.median(second) / statistics.median(alone), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base", help="also measure this git revision (its gate helper)")
    args = parser.parse_args()
    PARALLEL.mkdir(parents=True, exist_ok=True)
    source = PARALLEL / f"sharegpt_{args.conversations}.jsonl"
    if not source.exists():
        make_data(args.conversations, source)
    model = PARALLEL / "bpe8k"
    if not (model / "tokenizer.json").exists():
        train_bpe(source, model)
    config = PARALLEL / "bench.toml"
    config.write_text(f'[run]\ndedup = false\n[[sources]]\nname = "sharegpt"\n'
                      f'path = "{source.name}"\n')
    runs = [PARALLEL / f"run_{k}" for k in (1, 2)]
    for run in runs:
        if not (run / "ingest").is_dir():
            subprocess.run([sys.executable, "-m", "dflash_etl", "ingest", "--config",
                            str(config), "--run", str(run)], check=True, env=stage_env(),
                           stdout=subprocess.DEVNULL)
    results = {"date": dt.date.today().isoformat(), "conversations": args.conversations,
               "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                           "cpu": platform.processor() or platform.machine(),
                           "load_avg_at_start": os.getloadavg()[0]}, "trees": {}}
    results["trees"]["this tree"] = measure("this tree", REPO / "src", runs, model, args.repeats,
                                            stage_env())
    if args.base:
        src = base_tree(args.base)
        env = {**stage_env(src), "DFLASH_ETL_SUITE_HELPER_DIR": str(PARALLEL / "helper")}
        (PARALLEL / "helper").mkdir(mode=0o700, exist_ok=True)
        try:
            results["trees"][args.base] = measure(args.base, src, runs, model, args.repeats, env)
        finally:  # the base revision's gate helper outlives its commands: end it here
            subprocess.run([sys.executable, "-m", "dflash_etl.validation.suite_helper",
                            "--stop"], env=env, check=False, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    results["machine"]["load_avg_at_end"] = os.getloadavg()[0]
    (HERE / "results" / "tokenize_parallel.json").write_text(json.dumps(results, indent=2) + "\n")
    m = results["machine"]
    lines = [f"# two tokenize commands at once ({results['date']}, {m['cores']} cores, 1-min "
             f"load {m['load_avg_at_start']:.1f} -> {m['load_avg_at_end']:.1f})", "",
             f"{args.conversations} synthetic ShareGPT conversations per run, 8k-BPE ChatML, "
             "`--workers 1` each; alone and together alternate, medians. Command: `python "
             f"benchmarks/bench_tokenize_parallel.py --repeats {args.repeats}"
             + (f" --base {args.base}`." if args.base else "`."), "",
             "| tree | alone s (runs) | together: both walls (runs) | the second's wall, "
             "median | second / alone |", "|---|---|---|---:|---:|"]
    for name, r in results["trees"].items():
        lines.append(f"| {name} | {' / '.join(map(str, r['alone_s']))} | "
                     f"{' / '.join(f'{a}+{b}' for a, b in r['together_s'])} | "
                     f"{r['second_median_s']} | **{r['second_vs_alone']}x** |")
    if args.base:
        ours, base = results["trees"]["this tree"], results["trees"][args.base]
        extra = ours["alone_median_s"] - base["alone_median_s"]
        lines += ["", f"Alone, this tree's command takes {extra:+.1f} s against {args.base}'s "
                  "with its gate helper warm (the helper had imported "
                  "great_expectations and pandera before; here each command imports them: "
                  "seconds that matter at this size, not at the sizes in tokenize_peer*.md). "
                  "Together, neither tree's commands wait on the other's gates beyond sharing "
                  "the cores."]
    (HERE / "results" / "tokenize_parallel.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
