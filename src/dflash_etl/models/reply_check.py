"""Whether the replies a drafter will learn are the target's own, read from the data: the share
of supervised tokens that the target itself predicts (greedy, teacher-forced) on a sample of
rows. Replies the target wrote greedily agree almost everywhere (sampled ones mostly); the
sources' own replies (regenerate skipped) or another model's agree far less, and a drafter
trained on them learns to predict what the target will not say (acceptance falls).

How the replies were made is known when this pipeline made them (regenerate's settings, in
tokenize's on-policy report): the check then only compares the model that wrote them with the
target. It reads the data when they came from the sources or from another model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SAMPLE_ROWS = 16  # rows the check reads, seeded
SAMPLE_TOKENS = 16384  # at most this many tokens in all: the check is a few forward passes
MIN_AGREEMENT = 0.5  # below: "these replies are not the target's" (greedy own: ~1.0)


def replies_origin(generated_with: dict[str, Any] | None, target_identity: str) -> str:
    """"target": regenerate wrote them with this target; "other_model": with another one;
    "sources": the sources' own (regenerate did not run on them)."""
    if not generated_with:
        return "sources"
    made_by = generated_with.get("model_identity")
    return "target" if made_by in (None, target_identity) else "other_model"


def sample(lengths: list[int], seed: int = 0) -> list[int]:
    """Up to SAMPLE_ROWS row indices, seeded, within SAMPLE_TOKENS tokens (shortest kept)."""
    order = np.random.default_rng(seed).permutation(len(lengths))[:SAMPLE_ROWS * 4]
    picked, tokens = [], 0
    for k in order.tolist():
        if len(picked) == SAMPLE_ROWS:
            break
        if tokens + lengths[k] <= SAMPLE_TOKENS:
            picked.append(k)
            tokens += lengths[k]
    return sorted(picked)


def agreement(target: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The share of the rows' supervised tokens that are the target's greedy next token after
    the tokens before them (one forward pass per row, its logits)."""
    matched = supervised = 0
    for row in rows:
        ids, mask = list(row["input_ids"]), np.asarray(row["loss_mask"], dtype=bool)
        if len(ids) < 2 or not mask[1:].any():
            continue
        logits, _ = target.forward([ids], logits=True)
        predicted = logits[0][:-1].argmax(-1).cpu().numpy()
        wanted = mask[1:]
        matched += int((predicted[wanted] == np.asarray(ids[1:])[wanted]).sum())
        supervised += int(wanted.sum())
    return {"rows": len(rows), "supervised_tokens": supervised,
            "agreement": round(matched / supervised, 4) if supervised else None}


def verdict(origin: str, measured: dict[str, Any] | None, min_agreement: float) -> str:
    """The warning to give ("" when the replies look like the target's)."""
    share = (measured or {}).get("agreement")
    whose = {"sources": "the sources' own (regenerate did not run on them)",
             "other_model": "written by another model than this target (regenerate's "
                            "model_identity differs)"}.get(origin)
    if whose is None or (share is not None and share >= min_agreement and origin == "sources"):
        return ""
    said = (f"; the target predicts {share:.0%} of their supervised tokens itself (greedy, "
            f"{measured['rows']} rows sampled; a target's own greedy replies score near 100%)"
            if share is not None else "")
    return (f"the replies are {whose}{said}: a drafter learns to predict them, not what the "
            "target will say, and acceptance falls; regenerate them with this target "
            "(`dflash-etl regenerate`) unless that is what you want")


def check_replies(rows: list[dict[str, Any]], origin: str, spec: Any = None,
                  target: Any = None) -> dict[str, Any]:
    """Before a stage's work: with `rows` (a sample; none where the target is not to be loaded
    here), the agreement of `target`, or of the target `spec` loads, let go before the workers
    load theirs; the warning printed; the record for the stage's stats."""
    import gc
    import sys

    from dflash_etl.models.target import Target

    measured = None
    if rows and origin != "target" and target is not None:
        measured = agreement(target, rows)
    elif rows and origin != "target":
        loaded = Target(spec)
        try:
            measured = agreement(loaded, rows)
        finally:  # its memory back before the workers load theirs
            del loaded
            gc.collect()
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    warning = verdict(origin, measured, MIN_AGREEMENT)
    if warning:
        print(f"WARNING: {warning}", file=sys.stderr, flush=True)
    return {"origin": origin, **(measured or {}), "warning": warning}
