"""Acceptance length (tau) of the drafter on held-out prompts: which conversations are held out
(never trained on), the prompt each gives, and the evaluations of one run (train/eval.json)."""

from __future__ import annotations

import hashlib
import sys
from typing import Any


def held_out_ids(ids: list[str], rows_wanted: int, seed: int) -> set[str]:
    """Conversations set aside for evaluation: the first by a seeded hash of their id until they
    hold `rows_wanted` rows (all rows of a conversation stay on one side)."""
    counts: dict[str, int] = {}
    for i in ids:
        counts[i] = counts.get(i, 0) + 1
    ranked = sorted(counts, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())
    chosen, rows = set(), 0
    for i in ranked:
        if rows >= rows_wanted or len(chosen) >= len(counts) - 1:
            break
        chosen.add(i)
        rows += counts[i]
    return chosen


def eval_prompt(input_ids: list[int], loss_mask: list[int]) -> list[int] | None:
    """The row's tokens before its first supervised token: the prompt the reply answers."""
    first = next((k for k, m in enumerate(loss_mask) if m), None)
    return list(input_ids[:first]) if first else None


class TauEvaluator:
    """tau on the held-out prompts at a given step, and every evaluation so far (eval.json's
    history; checkpoints keep it, so a resumed run continues it). Without prompts (`[train]
    eval_prompts = 0`) it measures nothing: tau is then `dflash-etl eval`'s, after training."""

    def __init__(self, target: Any, drafter: Any, prompts: list[list[int]], max_new_tokens: int,
                 history: list[dict[str, Any]]) -> None:
        from dflash_etl.models.acceptance import eos_token_ids

        self.target, self.drafter, self.prompts = target, drafter, prompts
        self.max_new_tokens = max_new_tokens
        self.eos = eos_token_ids(target.model) if prompts else set()
        self.history = history

    def __call__(self, step: int) -> float | None:
        from dflash_etl.models.acceptance import acceptance_length

        if not self.prompts:
            return None

        result = acceptance_length(self.target, self.drafter, self.prompts, self.max_new_tokens,
                                   self.eos)
        self.history.append({"step": step, "tau": result["tau"],
                             "per_prompt": result["per_prompt"]})
        print(f"train: step {step}: tau {result['tau']:.3f} on {len(self.prompts)} held-out "
              "prompts", file=sys.stderr, flush=True)
        return result["tau"]

    def tree(self, budget: int) -> dict[str, Any]:
        """tau on the same prompts when the target verifies a DDTree of at most `budget` drafts
        built from the drafter's per-position distributions (`eval --tree-budget`'s measure),
        and the tokens a verify pass reads per step (the anchor and the drafts: its cost)."""
        from dflash_etl.models.acceptance import drafter_logits
        from dflash_etl.models.tree_verify import tree_decode

        was_training = self.drafter.training
        self.drafter.eval()
        block = drafter_logits(self.target, self.drafter)
        runs = [tree_decode(self.target, block, p, self.max_new_tokens, self.eos, budget)
                for p in self.prompts]
        self.drafter.train(was_training)
        taus = [r.tau for r in runs if r.tau is not None]
        nodes = [n for r in runs for n in r.nodes]
        result = {"budget": budget, "tau": sum(taus) / len(taus) if taus else 1.0,
                  "nodes_per_step": round(sum(nodes) / len(nodes), 3) if nodes else 0.0}
        print(f"train: tau {result['tau']:.3f} with a tree of <= {budget} drafts "
              f"({result['nodes_per_step']} tokens verified per step)", file=sys.stderr,
              flush=True)
        return result

    def document(self, block_size: int) -> dict[str, Any]:
        """eval.json: tau before and after training, and every evaluation between."""
        history = self.history
        return {
            "tau_untrained": history[0]["tau"] if history else None,
            "tau_final": history[-1]["tau"] if history else None,
            "prompts": len(self.prompts), "max_new_tokens": self.max_new_tokens,
            "block_size": block_size, "history": history,
        }
