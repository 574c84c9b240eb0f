"""train --online --states-from server: the trainer's memory over 10k rows stays flat (the
prefetch window holds two batches' states at most), against offline training on the same rows.

A synthetic dataset of short conversations (seeded random words, default 10,000) is ingested and
tokenized with the embedded default's tokenizer and tiny target (not timed), and extracted with
the hooks backend for the offline baseline. Then `dflash-etl train` runs twice in its own
process with the same settings and enough steps for `--steps x --batch-rows` rows to pass
(default 625 x 16 = 10,000): offline (extract's files), and --online --states-from server
against the dev server (`python -m dflash_etl.models.devserver --extract-hidden-states`, a
process of its own, one torch thread: on a shared 2-core machine more threads spin against the
other jobs). The trainer's RSS is sampled every 0.25 s with the step it had logged, so the memory
by 1k rows can be set beside the memory over the last 1k of 10k.

    python benchmarks/bench_train_server_memory.py [--rows 10000] [--steps 625]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work" / "train_server_memory"
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "seven",
         "green", "quiet", "market", "bridge", "window", "number", "garden", "yellow",
         "simple", "letter", "winter", "mountain", "silver", "circle", "orange", "history",
         "engine", "planet", "signal", "forest", "memory", "travel", "pocket", "string",
         "rocket")
TRAIN = {"batch_rows": 16, "anchors_per_row": 8, "block_size": 8, "draft_layers": 1,
         "eval_prompts": 2, "eval_new_tokens": 8, "lr": 3e-3, "layers": "2"}


def _conversations(path: Path, n: int) -> None:
    """n distinct short conversations (a user question, an assistant answer), seeded."""
    rng = random.Random(0)
    with path.open("w") as out:
        for k in range(n):
            ask = " ".join(rng.choices(WORDS, k=rng.randint(6, 14)))
            say = " ".join(rng.choices(WORDS, k=rng.randint(12, 30)))
            out.write(json.dumps({"messages": [
                {"role": "user", "content": f"Question {k}: {ask}?"},
                {"role": "assistant", "content": f"{say}."}]}) + "\n")


def _config(n: int) -> Path:
    source = WORK / "conversations.jsonl"
    if not source.exists() or sum(1 for _ in source.open()) != n:
        _conversations(source, n)
    config = WORK / "pipeline.toml"
    config.write_text(
        f'[[sources]]\nname = "synthetic"\npath = "{source}"\n\n'
        "[target]\ntiny = { hidden_size = 64, layers = 4, seed = 0, "
        "tie_word_embeddings = false }\n\n"
        f'[tokenize]\nmodel = "{REPO / "data" / "tokenizer"}"\nseq_length = 256\n'
        "draft_vocab_size = 512\n\n[extract]\nlayers = \"2\"\n")
    return config


def _sample(process: Any, log: Path, until: subprocess.Popen, every: float = 0.25
            ) -> list[tuple[float, int, int]]:
    """(seconds, RSS bytes, step logged) of `process` every `every` s until `until` exits."""
    import psutil

    samples, start = [], time.monotonic()
    while until.poll() is None:
        try:
            rss = process.memory_info().rss
        except psutil.Error:
            break
        step = sum(1 for _ in log.open()) if log.exists() else 0
        samples.append((round(time.monotonic() - start, 2), rss, step))
        time.sleep(every)
    return samples


def _train(config: Path, run: Path, steps: int, extra: list[str],
           train: dict[str, Any] | None = None, save_every: int = 0) -> dict[str, Any]:
    """One `dflash-etl train` in its own process, its RSS sampled (`train`: its settings,
    default TRAIN; `save_every`: default a checkpoint at the last step)."""
    import psutil

    shutil.rmtree(run / "train", ignore_errors=True)
    shutil.rmtree(run / ".train.partial", ignore_errors=True)
    argv = [sys.executable, "-m", "dflash_etl", "train", "--config", str(config), "--run",
            str(run), "--steps", str(steps), "--save-every", str(save_every or steps),
            "--device", "cpu",
            *[f"--{k.replace('_', '-')}={v}" for k, v in (train or TRAIN).items()], *extra]
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples = _sample(psutil.Process(child.pid), run / ".train.partial" / "log.jsonl", child)
    err = child.communicate()[1]
    if child.returncode:
        raise SystemExit(f"train failed ({child.returncode}): {err[-2000:]}")
    counts = json.loads((run / "manifest.json").read_text())["stages"]["train"]["counts"]
    return {"wall_s": round(time.perf_counter() - start, 1), "samples": samples,
            "states_server": counts.get("states_server")}


def _at_rows(samples: list[tuple[float, int, int]], rows: int, batch: int) -> int | None:
    """The largest RSS sampled by the time `rows` rows had been trained on."""
    seen = [rss for _, rss, step in samples if 0 < step * batch <= rows]
    return max(seen) if seen else None


def _summary(result: dict[str, Any], rows_total: int) -> dict[str, Any]:
    samples, batch = result["samples"], TRAIN["batch_rows"]
    training = [rss for _, rss, step in samples if step > 0]
    mib = 1024 * 1024
    first_1k = _at_rows(samples, 1000, batch)
    last = [rss for _, rss, step in samples if step * batch > rows_total - 1000]
    return {"wall_s": result["wall_s"], "samples": len(samples),
            "peak_mib": round(max(r for _, r, _ in samples) / mib, 1),
            "peak_training_mib": round(max(training) / mib, 1) if training else None,
            "rss_by_1k_rows_mib": round(first_1k / mib, 1) if first_1k else None,
            "rss_last_1k_rows_mib": round(max(last) / mib, 1) if last else None,
            "growth_1k_to_end_mib": round((max(last) - first_1k) / mib, 1)
            if last and first_1k else None,
            "states_server": result["states_server"]}


def _start_server(model: Path, states: Path) -> tuple[subprocess.Popen, str]:
    sys.path.insert(0, str(HERE))
    from bench_extract_server import _free_port, _wait_ready

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "dflash_etl.models.devserver", "--model", str(model),
         "--port", str(port), "--extract-hidden-states", "3,4", "--states-dir", str(states)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}/v1"
    _wait_ready(url, server)
    return server, url


def _prepare(config_path: Path, run: Path) -> tuple[Path, int]:
    """Ingest, tokenize and extract (hooks) once; the tiny target's directory, the rows."""
    from dflash_etl.stages import extract, ingest, load_config, tokenize

    config = load_config(config_path)
    for stage in (ingest, tokenize, extract):
        stage.run(config, run, progress=False)
    rows = json.loads((run / "tokenize" / "stats.json").read_text())["total"]["rows_out"]
    return run / "target", rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=625)
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    import psutil

    WORK.mkdir(parents=True, exist_ok=True)
    config = _config(args.rows)
    run = WORK / "run"
    model, rows = _prepare(config, run)
    results = {"offline": _train(config, run, args.steps, [])}
    states = WORK / "server-states"
    shutil.rmtree(states, ignore_errors=True)
    server, url = _start_server(model, states)
    try:
        results["server"] = _train(config, run, args.steps, [
            "--online", "--states-from", "server", "--states-endpoint", url,
            "--states-dir", str(states)])
        server_rss = psutil.Process(server.pid).memory_info().rss
    finally:
        server.terminate()
        server.wait(30)
    trained = args.steps * TRAIN["batch_rows"]
    _record(args, rows, trained, results, server_rss)


def _record(args: argparse.Namespace, rows: int, trained: int, results: dict[str, Any],
            server_rss: int) -> None:
    summary = {k: _summary(v, trained) for k, v in results.items()}
    load = os.getloadavg()
    result = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                          "load_avg_1_5_15": [round(x, 2) for x in load]},
              "command": f"python benchmarks/bench_train_server_memory.py --rows {args.rows} "
                         f"--steps {args.steps}",
              "dataset_rows": rows, "rows_trained": trained, "train": TRAIN,
              "server_rss_mib": round(server_rss / 2**20, 1), "summary": summary,
              # every 4th sample (1 s apart) of (seconds, RSS bytes, step): the figures above
              # are from all of them
              "samples": {k: v["samples"][::4] for k, v in results.items()}}
    out = HERE / "results"
    (out / "train_server_memory.json").write_text(json.dumps(result, indent=1) + "\n")
    off, srv = summary["offline"], summary["server"]
    lines = [f"# train --online --states-from server: memory — {result['date']}", "",
             f"{os.cpu_count()} cores shared with other jobs (load average at the end "
             f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}), Python "
             f"{platform.python_version()}; {rows} synthetic short conversations tokenized "
             f"(the default's tokenizer, seq_length 256); target: tiny random Qwen2 (hidden 64, "
             f"4 layers), layer 2; drafter 1 layer, block {TRAIN['block_size']}, "
             f"{TRAIN['batch_rows']} rows x {TRAIN['anchors_per_row']} anchors per step, "
             f"{args.steps} steps = {trained} rows trained on; each run `dflash-etl train` in "
             "its own process, its RSS sampled every 0.25 s with the step it had logged; the "
             "dev server in a process of its own (OMP_NUM_THREADS=1). Command: "
             f"`{result['command']}`.", "",
             "| run | wall s | RSS by 1k rows (MiB) | RSS over the last 1k rows (MiB) | growth "
             "(MiB) | peak (MiB) |", "|---|---:|---:|---:|---:|---:|",
             f"| offline: extract's files (baseline) | {off['wall_s']} | "
             f"{off['rss_by_1k_rows_mib']} | {off['rss_last_1k_rows_mib']} | "
             f"{off['growth_1k_to_end_mib']} | {off['peak_mib']} |",
             f"| --online --states-from server | {srv['wall_s']} | "
             f"{srv['rss_by_1k_rows_mib']} | {srv['rss_last_1k_rows_mib']} | "
             f"{srv['growth_1k_to_end_mib']} | {srv['peak_mib']} |", "",
             f"The states server gave {srv['states_server']}; its own process held "
             f"{result['server_rss_mib']} MiB at the end. The growth column is the trainer's "
             "largest RSS over the last 1k rows minus its largest by the first 1k: the memory "
             "the run's length adds. The samples are in train_server_memory.json."]
    (out / "train_server_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
