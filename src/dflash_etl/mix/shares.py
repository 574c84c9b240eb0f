"""What the drafter learns from, per source: rows, tokens and supervised tokens (the quantity a
drafter trains on) as shares of the whole, beside the share of rows a weighted source asked
for. A source that is 40% of the rows but 5% of the supervised tokens (short replies) shows.
With `[ingest] weight_by = "supervised_tokens"` tokenize mixes by them (plan_supervised_mix)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from dflash_etl.core.accounting import Stats
from dflash_etl.core.errors import StageError
from dflash_etl.core.schema import F_MIX_WEIGHT


def learning_shares(sources: dict[str, dict[str, Any]], asked: dict[str, float | None],
                    supervised_mix: dict[str, dict[str, Any]] | None = None
                    ) -> dict[str, dict[str, Any]]:
    """Per source: its rows, tokens and supervised tokens with their shares (each column sums
    to 1 over the sources), and where the source had a weight, `asked_row_share` (mixed by
    rows) or, mixed by supervised tokens, `asked_supervised_share` and
    `achieved_supervised_share` (of the weighted sources' supervised tokens)."""
    keys = ("rows_written", "tokens", "supervised_tokens")
    totals = {k: sum(int(s.get(k) or 0) for s in sources.values()) for k in keys}
    out = {}
    for name, stats in sorted(sources.items()):
        row: dict[str, Any] = {}
        for k in keys:
            n = int(stats.get(k) or 0)
            row[k] = n
            row[f"{k}_share"] = round(n / totals[k], 4) if totals[k] else 0.0
        if asked.get(name) is not None:
            row["asked_row_share"] = asked[name]
        if supervised_mix and name in supervised_mix:
            row["asked_supervised_share"] = supervised_mix[name]["asked_share"]
            row["achieved_supervised_share"] = supervised_mix[name]["achieved_share"]
        out[name] = row
    return out


def plan_supervised_mix(conversations: Any, weights: dict[str, float], seed: int
                        ) -> tuple[np.ndarray, dict[str, dict[str, Any]]]:
    """`weight_by = "supervised_tokens"`: which conversations to leave out so that each
    weighted source's share of the weighted sources' supervised tokens is its weight / the sum
    of the weights, keeping as many as the scarcest source allows (never duplicating).

    `conversations` (polars: id, source, supervised = the supervised tokens of all its rows).
    Per source, in a seeded order (its ids sorted, then a permutation salted by the source's
    place among the weighted names: the same for any executor or chunking), the prefix whose
    supervised tokens come closest to the source's target is kept; the scarcest source is kept
    whole. So a source's kept tokens miss its target by at most half of one conversation.
    Returns the ids left out and, per weighted source, what was asked and reached."""
    import polars as pl

    names = sorted(weights)
    total_weight = sum(weights.values())
    asked = {name: weights[name] / total_weight for name in names}
    parts = {name: conversations.filter(pl.col("source") == name).sort("id") for name in names}
    available = {name: int(parts[name]["supervised"].sum() or 0) for name in names}
    scale = min(available[name] / asked[name] for name in names)
    dropped: list[np.ndarray] = []
    plan: dict[str, dict[str, Any]] = {}
    for salt, name in enumerate(names):
        part = parts[name]
        order = np.random.default_rng([seed, salt]).permutation(part.height)
        sums = np.cumsum(part["supervised"].to_numpy()[order])
        target = scale * asked[name]
        n = int(np.searchsorted(sums, target, side="right"))  # sums[:n] <= target
        if n < len(sums) and (n == 0 or sums[n] - target < target - sums[n - 1]):
            n += 1  # one more comes closer
        dropped.append(part["id"].to_numpy()[order[n:]])
        plan[name] = {"weight": weights[name], "asked_share": round(asked[name], 6),
                      "conversations_available": part.height, "conversations_kept": n,
                      "supervised_available": available[name],
                      "supervised_kept": int(sums[n - 1]) if n else 0}
    kept = sum(p["supervised_kept"] for p in plan.values())
    for p in plan.values():
        p["achieved_share"] = round(p["supervised_kept"] / kept, 6) if kept else 0.0
    ids = np.concatenate(dropped) if dropped else np.zeros(0, dtype=object)
    return ids, plan


def conversation_counts(row_files: list[Path]) -> Any:
    """Per conversation (id): its source, rows, tokens and supervised tokens, over its rows (a
    polars frame; polars is imported here, in the parent after the workers, never before a
    fork: its thread pool does not survive one)."""
    import polars as pl

    frames = [pl.read_parquet(f, columns=["id", "source", "seq_len", "loss_mask"])
              for f in row_files]
    return pl.concat(frames).group_by("id", maintain_order=True).agg(
        pl.col("source").first(), pl.len().alias("rows"),
        pl.col("seq_len").cast(pl.Int64).sum().alias("tokens"),
        pl.col("loss_mask").list.eval(pl.element().cast(pl.Int64)).list.sum().sum()
        .alias("supervised"))


def leave_out_by_supervised_tokens(row_files: list[Path], mix: dict[str, Any],
                              per_source: dict[str, Stats]
                              ) -> tuple[pa.Array, dict[str, dict[str, Any]]]:
    """[ingest] weight_by = "supervised_tokens": the conversations the mix leaves out (their
    ids), each filtered mix_weight in its source's accounting (its rows, tokens and supervised
    tokens taken off what the source wrote), and the mix per weighted source."""
    import polars as pl

    conversations = conversation_counts(row_files)
    weights = {k: float(v) for k, v in mix["weights"].items()}
    empty = [name for name in sorted(weights)
             if not conversations.filter(pl.col("source") == name)["supervised"].sum()]
    if empty:
        raise StageError(
            f"[ingest] weight_by = \"supervised_tokens\": the weighted source(s) {empty} have no "
            "supervised tokens after tokenize, so their weights leave the other weighted "
            "sources none: remove their weights, or see quarantine.parquet for why their rows "
            "were refused")
    ids, plan = plan_supervised_mix(conversations, weights, int(mix.get("seed", 0)))
    left_out = conversations.join(pl.DataFrame({"id": ids.tolist()}, schema={"id": pl.String}),
                                  on="id", how="semi")
    for name, n, rows, tokens, supervised in left_out.group_by("source").agg(
            pl.len(), pl.col("rows").sum(), pl.col("tokens").sum(),
            pl.col("supervised").sum()).iter_rows():
        stats = per_source[name]
        stats.filter(F_MIX_WEIGHT, n)
        stats.rows_out -= n
        stats.extra["rows_written"] -= rows
        stats.extra["tokens"] -= tokens
        stats.extra["supervised_tokens"] -= supervised
        plan[name].update(conversations_left_out=n, rows_left_out=rows,
                          supervised_left_out=supervised)
    return pa.array(ids.tolist(), pa.string()), plan
