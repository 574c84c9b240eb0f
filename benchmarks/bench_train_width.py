"""train --online --states-from server at Qwen3.6-27B width: the trainer's memory over a run.

The target is the config of Qwen3.6-27B's text model (64 layers x 5120, vocab 248,320, bf16)
beside the Qwen3.6 tokenizer and template, with a checkpoint holding only its input embedding
and LM head (seeded random, 2 x 2.5 GB): what a trainer fed by a states server reads of a 27B
checkpoint (`[train] eval_prompts = 0`: no tau here, so no decoder). The dev server answers in
its width mode (`--synthetic-states`: no model, seeded states at the config's width) for the 5
layers [extract]'s rule picks, plus the last; the rows are bench_states_width's (ShareGPT
conversations of ~`--tokens` tokens, tokenized with the Qwen3.6 template). `dflash-etl train`
runs in its own process (a one-layer drafter at the target's width, fp32, AdamW), its RSS
sampled every 0.25 s with the step it had logged (bench_train_server_memory's sampler); the
server in another process on the same cores.

Measured: the trainer's RSS before its first step, at each step and its growth from the second
step to the last (the prefetch window holds two batches' states at most: flat is the goal), set
beside what it holds by arithmetic (embedding and head, the drafter with its gradients and AdamW
moments, the states of two batches); seconds a step; the states' MB/s into the trainer.

    python benchmarks/bench_train_width.py [--rows 24] [--tokens 1000] [--steps 8]

Needs ~13 GB of memory and ~6 GB of disk under benchmarks/work/; ~10 min on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_states_width import (  # noqa: E402
    TARGET_LAYERS,
    WIDTH,
    WORK,
    served_run,
    width_model,
)
from bench_train_server_memory import _train  # noqa: E402

TRAIN = {"draft_layers": 1, "block_size": 16, "batch_rows": 2, "anchors_per_row": 8,
         "dtype": "bf16", "lr": 5e-5}


def head_checkpoint(out: Path) -> Path:
    """The width model directory with a checkpoint of its embedding and LM head alone."""
    import torch
    from safetensors.torch import save_file

    if (out / "model.safetensors").is_file():
        return out
    width_model(out)
    generator = torch.Generator().manual_seed(0)
    shape = (WIDTH["vocab_size"], WIDTH["hidden_size"])
    weights = {name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
               for name in ("model.embed_tokens.weight", "lm_head.weight")}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def held_bytes(rows: list[int], stored_layers: int) -> dict[str, int]:
    """What the trainer holds by arithmetic: the bf16 embedding and head, the fp32 drafter
    (one layer at the target's width, `fc` over the target layers) with its gradients and two
    AdamW moments, and the prefetch window (two batches' bf16 states of the longest rows)."""
    h, i = WIDTH["hidden_size"], WIDTH["intermediate_size"]
    q, kv = WIDTH["num_attention_heads"] * WIDTH["head_dim"], \
        WIDTH["num_key_value_heads"] * WIDTH["head_dim"]
    layer = h * q * 2 + h * kv * 2 + 3 * h * i + 2 * WIDTH["head_dim"] + 2 * h
    drafter = TRAIN["draft_layers"] * layer + TARGET_LAYERS * h * h + 2 * h
    longest = sorted(rows)[-2 * TRAIN["batch_rows"]:]
    return {"embedding_and_head": 2 * WIDTH["vocab_size"] * h * 2,
            "drafter_parameters": drafter,
            "drafter_with_grads_and_adamw": drafter * 4 * 4,
            "prefetch_window": sum(longest) * stored_layers * h * 2}


def train_run(model: Path, run: Path, url: str, states: Path, steps: int) -> dict[str, Any]:
    """One `dflash-etl train --online --states-from server` in its own process, sampled
    (bench_train_server_memory's runner), with its stats and losses."""
    config = run / "train-width.toml"
    # tokenized_run's config (its source, its tokenizer) with the server client's [extract]
    config.write_text((WORK / "pipeline.toml").read_text() + f'\n[extract]\ndraft_layers = '
                      f'{TARGET_LAYERS}\nspot_check = "off"\nrequest_deadline_s = 600.0\n')
    result = _train(config, run, steps, [
        "--target", str(model), "--online", "--states-from", "server", "--states-endpoint",
        url, "--states-dir", str(states), "--eval-prompts", "0"], TRAIN, save_every=10 * steps)
    log = [json.loads(x) for x in (run / "train" / "log.jsonl").read_text().splitlines()]
    return {**result, "losses": [round(e["loss"], 4) for e in log],
            "stats": json.loads((run / "train" / "stats.json").read_text())["total"]}


def summarise(result: dict[str, Any], steps: int) -> dict[str, Any]:
    """The largest RSS while each step ran (key: the steps logged before it; `steps`: after
    the last, saving), the growth from the first two steps to the last two, and the seconds a
    step (the steps' span in the samples)."""
    gib = 2 ** 30
    samples = result["samples"]
    by_step: dict[int, int] = {}
    for _, rss, step in samples:
        by_step[step] = max(by_step.get(step, 0), rss)
    timed = [(t, step) for t, _, step in samples if 1 <= step < steps]
    span = (timed[-1][0] - timed[0][0]) / max(1, timed[-1][1] - timed[0][1]) if timed else None
    first = max(by_step.get(k, 0) for k in (1, 2))
    last = max(by_step.get(k, 0) for k in (steps - 2, steps - 1))
    trained = [(k, v / gib) for k, v in sorted(by_step.items()) if 1 <= k < steps]
    slope = None
    if len(trained) > 2:  # least squares of the per-step maxima: GiB a step
        mk = sum(k for k, _ in trained) / len(trained)
        mv = sum(v for _, v in trained) / len(trained)
        slope = sum((k - mk) * (v - mv) for k, v in trained) / sum(
            (k - mk) ** 2 for k, _ in trained)
    return {"wall_s": result["wall_s"],
            "rss_first_step_gib": round(by_step.get(0, 0) / gib, 2),
            "rss_by_step_gib": {k: round(v / gib, 2) for k, v in sorted(by_step.items())},
            "peak_gib": round(max(r for _, r, _ in samples) / gib, 2),
            "growth_gib": round((last - first) / gib, 3) if first and last else None,
            "spread_gib": round(max(v for _, v in trained) - min(v for _, v in trained), 3)
            if trained else None,
            "slope_mib_per_step": round(slope * 1024, 1) if slope is not None else None,
            "s_per_step": round(span, 1) if span else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    import psutil

    WORK.mkdir(parents=True, exist_ok=True)
    model = head_checkpoint(WORK / "qwen36-27b-head")
    run, states = WORK / "train-run", WORK / "served-train"
    layers, process, url = served_run(model, args.rows, args.tokens, run, states,
                                      ("extract", "train"))
    try:
        result = train_run(model, run, url, states, args.steps)
        server_cpu = sum(psutil.Process(process.pid).cpu_times()[:2])
    finally:
        process.terminate()
        process.wait(30)
    record(args, run, layers, result, server_cpu)


def _row_lengths(run: Path) -> list[int]:
    """The tokenized rows' lengths (train's held-out split is empty: eval_prompts 0)."""
    from dflash_etl.validation.contracts import read_arrow

    return [len(ids) for f in sorted((run / "tokenize" / "dataset").glob("*.arrow"))
            for ids in read_arrow(f).column("input_ids").to_pylist()]


def record(args: argparse.Namespace, run: Path, layers: list[int], result: dict[str, Any],
           server_cpu: float) -> None:
    s = summarise(result, args.steps)
    stats = result["stats"]
    lengths = _row_lengths(run)
    held = held_bytes(lengths, len(layers) + 1)
    per_token = (len(layers) + 1) * WIDTH["hidden_size"] * 2
    rows_trained = args.steps * TRAIN["batch_rows"]
    mean_tokens = sum(lengths) / len(lengths)
    states_mb_s = (rows_trained * mean_tokens * per_token / 1e6 / s["wall_s"]
                   if s["wall_s"] else None)
    doc = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                       "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()]},
           "command": f"python benchmarks/bench_train_width.py --rows {args.rows} --tokens "
                      f"{args.tokens} --steps {args.steps}",
           "width": WIDTH, "layers": layers, "train": TRAIN, "rows": len(lengths),
           "mean_tokens": round(mean_tokens), "rows_trained": rows_trained,
           "target_loaded": stats.get("target_loaded"),
           "drafter_parameters": stats.get("drafter_parameters"),
           "held_bytes": held, "summary": s, "losses": result["losses"],
           "states_server": result["states_server"],
           "server_cpu_s": round(server_cpu, 1),
           "states_mb_per_s_into_trainer": round(states_mb_s, 1) if states_mb_s else None}
    out = HERE / "results"
    (out / "train_width.json").write_text(json.dumps(doc, indent=1) + "\n")
    gib = 2 ** 30
    arithmetic = sum(v for k, v in held.items() if k != "drafter_parameters") / gib
    lines = [
        f"# train --online --states-from server at Qwen3.6-27B width — {doc['date']}", "",
        f"{os.cpu_count()} cores, Python {platform.python_version()}; command: "
        f"`{doc['command']}`. Target: Qwen3.6-27B's text config (64 x 5120, vocab 248,320), "
        f"its checkpoint the bf16 embedding and LM head alone; target layers {layers} (+ the "
        f"last, as extract stores); {len(lengths)} rows of {doc['mean_tokens']} tokens on "
        f"average (Qwen3.6 template); drafter {TRAIN['draft_layers']} layer at 5120 wide, "
        f"{stats.get('drafter_parameters'):,} parameters, fp32 AdamW; {TRAIN['batch_rows']} "
        f"rows x {TRAIN['anchors_per_row']} blocks of {TRAIN['block_size']} a step, "
        f"{args.steps} steps; the dev server's width mode on the same cores.", "",
        "| | GiB |", "|---|---:|",
        f"| trainer RSS through its first step (loading, AdamW's moments) | "
        f"{s['rss_first_step_gib']} |",
        f"| trainer RSS, peak | {s['peak_gib']} |",
        f"| growth: steps {args.steps - 1}-{args.steps} against steps 2-3 | {s['growth_gib']} |",
        f"| spread of the per-step peaks, steps 2-{args.steps} (trend: "
        f"{s['slope_mib_per_step']} MiB a step) | {s['spread_gib']} |",
        f"| by arithmetic: embedding + head {held['embedding_and_head'] / gib:.2f}, drafter "
        f"with grads and AdamW {held['drafter_with_grads_and_adamw'] / gib:.2f}, prefetch "
        f"window {held['prefetch_window'] / gib:.2f} | {arithmetic:.2f} |",
        f"| the whole target in bf16 (what train loaded before for its head) | "
        f"{27e9 * 2 / gib:.0f} (estimate: 27 B parameters) |", "",
        f"RSS while each step ran (GiB; key: steps done before it, {args.steps}: saving): "
        f"{s['rss_by_step_gib']}. Seconds a step: {s['s_per_step']} "
        f"(2 CPU cores); states into the trainer {doc['states_mb_per_s_into_trainer']} MB/s "
        f"({per_token} bytes a token); the server: {doc['states_server']}, "
        f"{doc['server_cpu_s']} CPU s. Losses: {result['losses']}."]
    from results_page import write_keeping_findings

    write_keeping_findings(out / "train_width.md", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
