"""train: optimizer steps/s reading extracted hidden states (offline) against computing them from
the target every step (online, the baseline), in the same run, plus tau before and after.

The embedded default (data/) goes through ingest -> regenerate -> tokenize -> extract with the
default's tiny target (not timed); then `train.run` trains the default's drafter twice with the
same settings and seed: offline and --online. steps/s is the training loop's (batches, forward,
backward, optimizer, checkpoints), not the evaluation's.

    python benchmarks/bench_train.py [--steps 200] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work" / "train"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    from dflash_etl.stages import extract, ingest, load_config, regenerate, tokenize, train

    config = load_config(REPO / "data" / "pipeline.toml")
    run_dir = WORK / "run"
    for stage in (ingest, regenerate, tokenize, extract):
        stage.run(config, run_dir, progress=False)
    section = config.section("train")
    results = {}
    for mode in ("offline", "online"):
        shutil.rmtree(run_dir / "train", ignore_errors=True)
        start = time.perf_counter()
        doc = train.run(config, run_dir, force=True, progress=False, steps=args.steps,
                        online=mode == "online", device=args.device, save_every=args.steps)
        total = doc["total"]
        timing = json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]
        results[mode] = {"stage_s": round(time.perf_counter() - start, 2),
                         "steps_per_s": timing["steps_per_s"], "final_loss": total["final_loss"],
                         "tau_untrained": round(total["tau_untrained"], 3),
                         "tau_final": round(total["tau_final"], 3)}
    tokens = json.loads((run_dir / "tokenize" / "stats.json").read_text())["total"]["tokens"]
    blocks = section["batch_rows"] * section["anchors_per_row"]
    result = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
              "steps": args.steps, "device": args.device, "dataset_tokens": tokens,
              "blocks_per_step": blocks, "block_size": section["block_size"], **results,
              "ratio": round(results["offline"]["steps_per_s"]
                             / results["online"]["steps_per_s"], 2)}
    out = HERE / "results"
    (out / "train.json").write_text(json.dumps(result, indent=2) + "\n")
    off, on = results["offline"], results["online"]
    lines = [f"# train benchmark — {result['date']}", "",
             f"{os.cpu_count()} cores, Python {platform.python_version()}, device "
             f"{args.device}; the embedded default after regenerate ({tokens} tokens); target: "
             "the default's tiny random Qwen2 (hidden 64, 4 layers, untied head); drafter: 1 "
             f"layer, block {section['block_size']}, {section['batch_rows']} rows x "
             f"{section['anchors_per_row']} anchors = {blocks} blocks "
             f"({blocks * (section['block_size'] - 1)} predicted tokens) per step, fp32. "
             "Command: `python benchmarks/bench_train.py`.", "",
             "| run | steps/s | stage seconds | final loss | tau untrained -> trained |",
             "|---|---:|---:|---:|---|",
             f"| offline: extract's hidden states | {off['steps_per_s']} | {off['stage_s']} | "
             f"{off['final_loss']} | {off['tau_untrained']} -> {off['tau_final']} |",
             f"| online: the target's forward every step (baseline) | {on['steps_per_s']} | "
             f"{on['stage_s']} | {on['final_loss']} | {on['tau_untrained']} -> "
             f"{on['tau_final']} |", "",
             f"Offline / online: **{result['ratio']}x** steps/s. Same seed, same batches: the "
             "two runs differ only in where the hidden states come from (their losses agree "
             "to float rounding), so the gap is the target's forward pass per step."]
    previous = (out / "train.md").read_text() if (out / "train.md").exists() else ""
    marker = "## At a 248k vocabulary"  # bench_train_vocab.py's section: kept
    kept = previous[previous.index(marker):] if marker in previous else ""
    (out / "train.md").write_text("\n".join(lines) + "\n" + ("\n" + kept if kept else ""))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
