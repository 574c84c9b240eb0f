"""extract: tokens/s of the stage against a naive one-row-at-a-time loop, in the same run.

The embedded default (data/) is ingested and tokenized once (not timed); the target is a small
random-weight Qwen2 built from a config with the project's tokenizer (hidden 256, 4 layers).
  stage: `extract.run(...)` in this process: loading the target, bucketing, forward passes,
         writing the safetensors shards and index, the contract check;
  naive: one row per forward pass with transformers' output_hidden_states (what a plain script
         does: the whole model, every layer), nothing written;
  one row: the stage's own Target (hooks, early stop), one row per pass: batching's share.
Reports tokens/s of each, the ratio stage/naive (goal >= 3x) and the stage's padding share.

    python benchmarks/bench_extract.py [--batch-tokens 8192]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work" / "extract"


def target(out: Path) -> Path:
    from dflash_etl.models.tiny_model import build_tiny_qwen2

    return build_tiny_qwen2(out, hidden_size=256, layers=4, heads=4, kv_heads=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-tokens", type=int, default=8192)
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    from dflash_etl.models.target import Target
    from dflash_etl.stages import extract, ingest, load_config, tokenize

    model = target(WORK / "target")
    run_dir = WORK / "run"
    config = load_config(REPO / "data" / "pipeline.toml")
    ingest.run(config, run_dir, progress=False)
    tokenize.run(config, run_dir, progress=False)

    settings = extract.ExtractSettings(model=str(model), layers="1,2",
                                       batch_tokens=args.batch_tokens)
    import datasets

    rows = datasets.load_from_disk(str(run_dir / "tokenize" / "dataset")).with_format(None)[
        "input_ids"]
    tokens = sum(len(r) for r in rows)
    import torch

    hooked = Target(settings)
    plain = hooked.model
    with torch.no_grad():  # warm-up
        plain(input_ids=torch.tensor([rows[0]]), output_hidden_states=True)
    start = time.perf_counter()
    with torch.no_grad():
        for r in rows:  # what a plain script does: the whole model, every layer's states
            out = plain(input_ids=torch.tensor([r]), output_hidden_states=True)
            torch.stack([out.hidden_states[i + 1][0] for i in (1, 2)], dim=1)
    naive_s = time.perf_counter() - start
    start = time.perf_counter()
    for r in rows:  # the stage's own hooks and early stop, but one row per pass
        hooked.states([r])
    one_row_s = time.perf_counter() - start

    start = time.perf_counter()
    doc = extract.run(None, run_dir, force=True, progress=False, model=str(model), layers="1,2",
                      batch_tokens=args.batch_tokens)
    stage_s = time.perf_counter() - start
    manifest = json.loads((run_dir / "manifest.json").read_text())
    total = doc["total"]
    result = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
              "rows": len(rows), "tokens": tokens, "batch_tokens": args.batch_tokens,
              "naive_s": round(naive_s, 3), "one_row_hooked_s": round(one_row_s, 3),
              "stage_s": round(stage_s, 3),
              "stage_in_stage_s": manifest["stages"]["extract"]["seconds"],
              "naive_tokens_per_s": round(tokens / naive_s), "stage_tokens_per_s":
              round(tokens / stage_s), "ratio": round(naive_s / stage_s, 2),
              "padding_share": total["padding_share"]}
    out = HERE / "results"
    (out / "extract.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# extract benchmark — {result['date']}", "",
             f"{os.cpu_count()} cores, Python {platform.python_version()}; the embedded default "
             f"tokenized ({len(rows)} rows, {tokens} tokens); target: random Qwen2, hidden 256, "
             "4 layers, layers 1,2 extracted, fp32, CPU. Command: "
             "`python benchmarks/bench_extract.py`.", "",
             "| run | seconds | tokens/s |", "|---|---:|---:|",
             f"| naive: one row per forward pass, `output_hidden_states=True` (the whole "
             f"model), nothing written | {naive_s:.2f} | {result['naive_tokens_per_s']} |",
             f"| one row per forward pass through the stage's Target (hooks, stops after the "
             f"last wanted layer), nothing written | {one_row_s:.2f} | "
             f"{round(tokens / one_row_s)} |",
             f"| `extract.run` (batch_tokens {args.batch_tokens}, writing + contract) | "
             f"{stage_s:.2f} | {result['stage_tokens_per_s']} |", "",
             f"Stage / naive: **{result['ratio']}x** (goal >= 3x: "
             f"{'met' if result['ratio'] >= 3 else 'not met'}); padding share "
             f"{100 * result['padding_share']:.1f}% of the forward passes' tokens.", "",
             f"Batching alone (one-row Target / stage): {one_row_s / stage_s:.2f}x. The stage "
             "computes only up to the last wanted layer (here 3 of the 4 layers, no LM head) and "
             "batches length-sorted rows; on 2 CPU cores the matmuls are compute-bound already "
             "at one row of ~100 tokens, so batching saves only per-call overhead. The 3x goal "
             "is about GPUs, where one row leaves the device idle; not measured on a GPU (none "
             "was lent to this task)."]
    (out / "extract.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
