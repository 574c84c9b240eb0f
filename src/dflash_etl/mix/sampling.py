"""Which rows the training mix keeps: exact duplicates dropped (`[run] dedup`), a source over
its `max_rows` sampled down, weighted sources sampled to their shares of rows. Pure: an index
of rows in, the kept keys and the counts of what was filtered out; deterministic for a seed."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import polars as pl

from dflash_etl.core import schema as S
from dflash_etl.core.config import SourceConfig


def plan_mix(
    index: pl.DataFrame, sources: tuple[SourceConfig, ...], seed: int, dedup: bool,
    weight_by: str = "rows",
) -> tuple[pl.DataFrame, dict[str, Counter[str]], dict[str, dict[str, Any]]]:
    """Which rows to keep. `index` has id, source, _unit, _line in output order. Weighted
    sources are sampled to their shares of rows; with weight_by "supervised_tokens" they are
    kept whole here (tokenize mixes them by the supervised tokens it counts).

    Returns the kept (_unit, _line, _occurrence) keys, the filtered counts per source and
    reason, and what
    the mix reached per source. Deterministic for a given seed and input order.
    """
    filtered: dict[str, Counter[str]] = {s.name: Counter() for s in sources}
    frame = index.with_row_index("_pos")
    if dedup:
        first = frame.select(pl.col("id").is_first_distinct()).to_series()
        for name, n in frame.filter(~first).group_by("source").len().iter_rows():
            filtered[name][S.F_DUPLICATE] += n
        frame = frame.filter(first)
    parts: dict[str, pl.DataFrame] = {}
    for k, source in enumerate(sources):
        part = frame.filter(pl.col("source") == source.name)
        if source.max_rows is not None and part.height > source.max_rows:
            part = _sample(part, source.max_rows, seed, k)
            filtered[source.name][S.F_MAX_ROWS] += frame.filter(
                pl.col("source") == source.name
            ).height - part.height
        parts[source.name] = part
    mix = _weigh(parts, sources, seed, weight_by, filtered)
    kept = pl.concat([p for p in parts.values()]).sort("_pos")
    # Without dedup, repeated conversations stay: number them so ids remain unique.
    kept = kept.select(
        "_unit", "_line", pl.col("id").cum_count().over("id").cast(pl.Int32).alias("_occurrence")
    )
    return kept, filtered, mix


def _weigh(parts: dict[str, pl.DataFrame], sources: tuple[SourceConfig, ...], seed: int,
           weight_by: str, filtered: dict[str, Counter[str]]) -> dict[str, dict[str, Any]]:
    """The weighted sources' parts sampled to their shares of rows (in place, the rest counted
    mix_weight), or by supervised tokens kept whole for tokenize; what each reached."""
    mix: dict[str, dict[str, Any]] = {}
    weighted = [s for s in sources if s.weight is not None]
    if weighted and weight_by == "supervised_tokens":
        for source in weighted:
            n = parts[source.name].height
            mix[source.name] = {"weight": source.weight, "weight_by": weight_by,
                                "rows_available": n, "rows_kept": n}
    elif weighted:
        total_weight = sum(s.weight or 0 for s in weighted)
        scale = min(parts[s.name].height / ((s.weight or 0) / total_weight) for s in weighted)
        for k, source in enumerate(sources):
            if source.weight is None:
                continue
            share = source.weight / total_weight
            target = min(parts[source.name].height, int(scale * share + 1e-9))
            available = parts[source.name].height
            if target < available:
                parts[source.name] = _sample(parts[source.name], target, seed, k)
                filtered[source.name][S.F_MIX_WEIGHT] += available - target
            mix[source.name] = {"weight": source.weight, "target_share": round(share, 6),
                                "rows_available": available, "rows_kept": target}
    return mix


def _sample(part: pl.DataFrame, k: int, seed: int, salt: int) -> pl.DataFrame:
    """A seeded sample of k rows that keeps their original order."""
    rng = np.random.default_rng([seed, salt])
    chosen = np.sort(rng.permutation(part.height)[:k])
    return part[chosen]
