"""train at a realistic vocabulary: optimizer steps/s of the drafter with a 248k-row LM head (a
Qwen3.5/3.6-sized vocabulary, tiny hidden size) in one run, three ways:

- before: the loss as it was (chunks of 4,096 positions, each chunk's logits recomputed under
  activation checkpointing for the backward pass), full vocabulary;
- after, full vocabulary: drafter.head_cross_entropy (chunks sized to 2^26 logits, the gradient
  computed in the same pass, nothing recomputed);
- after, draft vocabulary: the same over a 32k-token t2d (`--head-vocab draft`).

Each step: the batch's blocks through the drafter, the head's loss, backward, AdamW; random
weights and tokens (the speed does not depend on them). Writes results/train_vocab.{json,md}
and the last section of results/train.md.

    python benchmarks/bench_train_vocab.py [--vocab 248320] [--steps 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
VOCAB_SECTION = "## At a 248k vocabulary (bench_train_vocab.py)"


def before_block_loss(drafter: Any, embed: Any, lm_head: Any, batch: dict[str, Any],
                      weights: Any, chunk: int = 4096) -> Any:
    """The loss before this change (train.block_loss as it was), for the comparison."""
    import torch
    from torch.utils.checkpoint import checkpoint

    with torch.no_grad():
        block_embeds = embed(batch["block_ids"]).float()
    hidden = drafter(batch["hidden"], batch["valid"], block_embeds, batch["anchors"])
    ok = batch["label_ok"][:, :, 1:]
    w = (weights[1:] * ok)[ok]
    labels = batch["labels"][:, :, 1:][ok]
    states = hidden[:, :, 1:][ok]

    def chunk_loss(h: Any, y: Any, wy: Any) -> tuple[Any, Any]:
        logits = lm_head(h.to(lm_head.weight.dtype)).float()
        ce = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        return (ce * wy).sum(), (logits.argmax(-1) == y)

    total = states.new_zeros(())
    for a in range(0, len(labels), chunk):
        part, _hit = checkpoint(chunk_loss, states[a:a + chunk], labels[a:a + chunk],
                                w[a:a + chunk], use_reentrant=False)
        total = total + part
    return total / (w.sum() + 1e-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=248_320)
    parser.add_argument("--draft-vocab", type=int, default=32_000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--anchors", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    import torch

    from dflash_etl.models.drafter import DFlashDrafter, DrafterConfig, block_loss_weights
    from dflash_etl.stages import train

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    h, v = args.hidden, args.vocab
    config = DrafterConfig(hidden_size=h, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=h // 4, intermediate_size=4 * h,
                           vocab_size=v, target_layer_ids=[1, 2, 3], mask_token_id=v - 1,
                           block_size=args.block_size)
    embed = torch.nn.Embedding(v, h).requires_grad_(False)
    lm_head = torch.nn.Linear(h, v, bias=False).requires_grad_(False)
    rows = [{"input_ids": rng.integers(0, v - 1, 512).tolist(),
             "loss_mask": [0] * 64 + [1] * 448} for _ in range(args.rows)]
    states = [torch.randn(512, 3, h) for _ in rows]
    t2d = np.zeros(v, dtype=bool)
    t2d[rng.choice(v - 1, args.draft_vocab, replace=False)] = True
    vocab = train.DraftVocab(t2d, v)
    weights = block_loss_weights(args.block_size, 7.0)

    def loss_of(mode: str, drafter: Any, batch: dict[str, Any], anchors: list) -> Any:
        if mode == "before":
            return before_block_loss(drafter, embed, lm_head, batch, weights)
        if mode == "after_full":
            return train.block_loss(drafter, embed, lm_head, batch, weights)[0]
        norm = train.loss_weight_total(rows, anchors, weights.numpy(), vocab.inside)
        return train.block_loss(drafter, embed, lm_head, batch, weights, normalizer=norm,
                                vocab=vocab)[0]

    # the modes take turns step by step, so that a shared machine's changing load falls on all
    # three alike; the median step time is reported
    modes = ("before", "after_full", "after_draft")
    trainers = {}
    for mode in modes:
        torch.manual_seed(0)
        drafter = DFlashDrafter(config)
        trainers[mode] = (drafter, torch.optim.AdamW(drafter.parameters(), lr=1e-4))
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    losses: dict[str, list[float]] = {m: [] for m in modes}
    for step in range(args.steps + 1):  # the first step warms up (allocations)
        anchors = train.sample_anchors(rows, args.anchors, np.random.default_rng(step))
        batch = train.make_batch(rows, states, anchors, args.block_size, v - 1)
        for mode in modes:
            drafter, optimizer = trainers[mode]
            start = time.perf_counter()
            loss = loss_of(mode, drafter, batch, anchors)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step:
                seconds[mode].append(time.perf_counter() - start)
            losses[mode].append(round(float(loss.detach()), 6))
        print(step, {m: round(seconds[m][-1], 3) for m in modes if seconds[m]}, flush=True)
    results: dict[str, Any] = {}
    for mode in modes:
        median = float(np.median(seconds[mode]))
        results[mode] = {"steps_per_s": round(1 / median, 4), "s_per_step": round(median, 3),
                         "s_per_step_all": [round(x, 3) for x in seconds[mode]],
                         "losses": losses[mode]}
    positions = args.rows * args.anchors * (args.block_size - 1)
    load = os.getloadavg()
    result = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__, "threads": torch.get_num_threads(),
                          "load_avg_1_5_15": [round(x, 2) for x in load]},
              "vocab": v, "draft_vocab": args.draft_vocab, "hidden": h,
              "predicted_positions_per_step": positions, "steps": args.steps, **results,
              "speedup_full": round(results["after_full"]["steps_per_s"]
                                    / results["before"]["steps_per_s"], 2),
              "speedup_draft": round(results["after_draft"]["steps_per_s"]
                                     / results["before"]["steps_per_s"], 2)}
    out = HERE / "results"
    (out / "train_vocab.json").write_text(json.dumps(result, indent=2) + "\n")
    b, f, d = results["before"], results["after_full"], results["after_draft"]
    lines = [f"# train at a 248k vocabulary — {result['date']}", "",
             f"{os.cpu_count()} cores (load average {load[0]:.2f} / {load[1]:.2f} / "
             f"{load[2]:.2f} while it ran, the machine shared), Python "
             f"{platform.python_version()}, torch {torch.__version__}, CPU, fp32. Drafter: 1 "
             f"layer, hidden {h}, block {args.block_size}; LM head {v} x {h}; {args.rows} rows "
             f"x {args.anchors} anchors = {positions} predicted positions per step; median of "
             f"{args.steps} steps after a warm-up step, the three taking turns step by step. "
             "Command: `python benchmarks/bench_train_vocab.py`.", "",
             "| loss | steps/s | s/step | vs before |", "|---|---:|---:|---:|",
             f"| before: 4,096-position chunks, recomputed under checkpointing, full vocab | "
             f"{b['steps_per_s']} | {b['s_per_step']} | 1.0x |",
             f"| after: head_cross_entropy, full vocab ({v}) | {f['steps_per_s']} | "
             f"{f['s_per_step']} | {result['speedup_full']}x |",
             f"| after: head_cross_entropy, draft vocab ({args.draft_vocab}, --head-vocab "
             f"draft) | {d['steps_per_s']} | {d['s_per_step']} | {result['speedup_draft']}x |",
             "", "Before and after over the full vocabulary compute the same loss (the first "
             f"step's: {b['losses'][0]} vs {f['losses'][0]}); the draft vocabulary's is a "
             "different loss (over its rows only)."]
    (out / "train_vocab.md").write_text("\n".join(lines) + "\n")
    # and as the last section of train.md (bench_train.py keeps it when it rewrites the rest)
    train_md = out / "train.md"
    head = train_md.read_text().split(VOCAB_SECTION)[0].rstrip() if train_md.exists() else ""
    body = "\n".join(["", f"{VOCAB_SECTION} — {result['date']}", "", *lines[2:]])
    train_md.write_text((head + "\n" if head else "") + body + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
