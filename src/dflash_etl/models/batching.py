"""How a target's forward passes group the rows: sorted by length into batches of at most
`batch_tokens` padded tokens (little padding), shards of `shard_rows` (the same whoever extracts
them), the few batches a dry run measures and what it projects from them. Pure: lists of
lengths in, row indices out; figures in, figures and lines out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_etl.core.progress import size_text
from dflash_etl.core.rundir import PLAN_FILE


def length_batches(lengths: list[int], batch_tokens: int,
                   max_padding: float = 0.04) -> list[list[int]]:
    """Row indices grouped so that (longest row x rows) <= batch_tokens, rows sorted by length,
    and a batch starts anew rather than let padding exceed `max_padding` of its tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in order:
        padded = lengths[i] * (len(current) + 1)  # sorted: this row is the batch's longest
        if current and (padded > batch_tokens
                        or padded - real - lengths[i] > max_padding * padded):
            batches.append(current)
            current, real = [], 0
        current.append(i)
        real += lengths[i]
    if current:
        batches.append(current)
    return batches


def padding_share(lengths: list[int], batches: list[list[int]]) -> float:
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return 1 - sum(lengths) / padded if padded else 0.0


def shard_plan(lengths: list[int], shard_rows: int, shard_tokens: int | None = None
               ) -> list[list[int]]:
    """Row indices per shard: rows sorted by length, at most `shard_rows` at a time and (where
    given) at most `shard_tokens` tokens (a longer row alone), so each shard's batches pad
    little and its states fit in memory. The plan depends on the rows alone, never on the
    number of ranks: a shard (and its file) is the same whoever extracts it."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    shards: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in order:
        if current and (len(current) == shard_rows
                        or (shard_tokens is not None and tokens + lengths[i] > shard_tokens)):
            shards.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    return [*shards, current] if current else shards


def state_bytes(stored_layers: int, hidden: int, dtype: str) -> int:
    """The bytes of one token's stored states (extract's dtype: bf16 or fp32)."""
    return stored_layers * hidden * (2 if dtype == "bf16" else 4)


def shard_tokens(shard_mb: int, stored_layers: int, hidden: int, dtype: str) -> int:
    """The most tokens a shard may hold: `shard_mb` of states at this width and dtype."""
    return max(1, shard_mb * (1 << 20) // state_bytes(stored_layers, hidden, dtype))


def shard_cost(lengths: list[int], batch_tokens: int) -> int:
    """The padded tokens a shard's forward passes run: what its extraction costs."""
    return sum(max(lengths[i] for i in b) * len(b) for b in length_batches(lengths, batch_tokens))


def plan_sample(batches: list[list[int]], wanted: int) -> list[int]:
    """Which of the run's batches (in length order) the plan measures: `wanted` of them spread
    evenly from the shortest to the longest, so the projection sees the whole length range."""
    n = len(batches)
    if wanted >= n:
        return list(range(n))
    if wanted == 1:
        return [n // 2]
    return sorted({round(k * (n - 1) / (wanted - 1)) for k in range(wanted)})


def run_batches(lengths: list[int], shard_rows: int, batch_tokens: int,
                shard_tokens: int | None = None) -> list[list[int]]:
    """Every forward batch of a run (row indices), in the order execute runs them: the shards
    of `shard_plan`, each cut into length buckets."""
    return [[members[i] for i in b]
            for members in shard_plan(lengths, shard_rows, shard_tokens)
            for b in length_batches([lengths[i] for i in members], batch_tokens)]


# ---------------------------------------------------------------- the dry run (--plan)
def project(total: dict[str, int], sample: dict[str, float], free: int) -> dict[str, Any]:
    """The whole dataset's bytes and hours from the measured sample (bytes scale with tokens,
    time with padded tokens), and whether the output fits in `free` bytes."""
    bytes_ = round(sample["bytes"] * total["tokens"] / sample["tokens"])
    seconds = sample["seconds"] * total["padded_tokens"] / sample["padded_tokens"]
    return {"bytes": bytes_, "seconds": round(seconds, 3), "hours": round(seconds / 3600, 4),
            "free_bytes": free, "fits": bytes_ <= free, "short_by_bytes": max(0, bytes_ - free)}


def plan_advice(doc: dict[str, Any]) -> str:
    """One sentence: it fits (and with what left), or by how much it does not and what to do."""
    p = doc["projected"]
    if p["fits"]:
        return (f"fits: ~{size_text(p['bytes'])} of the {size_text(p['free_bytes'])} free on "
                f"{doc['disk_path']} ({size_text(p['free_bytes'] - p['bytes'])} left)")
    return (f"does NOT fit: ~{size_text(p['bytes'])} needed, {size_text(p['free_bytes'])} "
            f"free on {doc['disk_path']}, short by {size_text(p['short_by_bytes'])}: skip "
            f"extract and train with `dflash-etl train --run {doc['run']} --online` (the "
            "target computes the states each step; nothing is stored), or store fewer --layers "
            "/ --dtype bf16")


def plan_summary(doc: dict[str, Any], run: Path) -> list[str]:
    data, sample, projected = doc["dataset"], doc["measured"], doc["projected"]
    return [f"extract plan (a dry run: nothing extracted or published) on {doc['device']}:",
            f"  dataset: {data['rows']} rows, {data['tokens']} tokens in {data['batches']} "
            f"batches (padding {doc['padding_share']})",
            f"  layers {doc['stored_layers']} of {doc['n_layers']} stored, hidden "
            f"{doc['hidden_size']}, {doc['dtype']}, {doc['format']}",
            f"  measured: {sample['batches']} batches, {sample['tokens']} tokens in "
            f"{sample['seconds']} s ({sample['tokens_per_s']} tokens/s), "
            f"{size_text(sample['bytes'])} written",
            f"  projected: {size_text(projected['bytes'])} on disk, {projected['hours']} hours "
            f"({projected['seconds']} s) on this device",
            f"  disk: {doc['advice']}",
            f"  plan: {run / PLAN_FILE}"]
