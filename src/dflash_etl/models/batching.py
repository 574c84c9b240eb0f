"""How a target's forward passes group the rows: sorted by length into batches of at most
`batch_tokens` padded tokens (little padding), shards of `shard_rows` (the same whoever extracts
them), and the few batches a dry run measures. Pure: lists of lengths in, row indices out."""

from __future__ import annotations


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


def shard_plan(lengths: list[int], shard_rows: int) -> list[list[int]]:
    """Row indices per shard: rows sorted by length, `shard_rows` at a time, so each shard's
    batches pad little. The plan depends on the rows alone, never on the number of ranks: a
    shard (and its file) is the same whoever extracts it."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[k:k + shard_rows] for k in range(0, len(order), shard_rows)]


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


def run_batches(lengths: list[int], shard_rows: int, batch_tokens: int) -> list[list[int]]:
    """Every forward batch of a run (row indices), in the order execute runs them: rows sorted
    by length, cut into shards of shard_rows, each shard into length buckets."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches = []
    for k in range(0, len(order), shard_rows):
        members = order[k:k + shard_rows]
        batches += [[members[i] for i in b]
                    for b in length_batches([lengths[i] for i in members], batch_tokens)]
    return batches
