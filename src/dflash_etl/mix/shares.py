"""What the drafter learns from, per source: rows, tokens and supervised tokens (the quantity a
drafter trains on) as shares of the whole, beside the share of rows a weighted source asked
for. A source that is 40% of the rows but 5% of the supervised tokens (short replies) shows."""

from __future__ import annotations

from typing import Any


def learning_shares(sources: dict[str, dict[str, Any]],
                    asked: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    """Per source: its rows, tokens and supervised tokens with their shares (each column sums
    to 1 over the sources), and `asked_row_share` where the source had a weight."""
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
        out[name] = row
    return out
