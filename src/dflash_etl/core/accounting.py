"""Row accounting: every stage proves rows_in == rows_out + rows_quarantined + filtered."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


class AccountingError(RuntimeError):
    """Rows went missing between a stage's input and its outputs: a bug, never a data problem."""


@dataclass
class Stats:
    """Counts for one source (or the total) of one stage."""

    rows_in: int = 0
    rows_out: int = 0
    quarantine_reasons: Counter[str] = field(default_factory=Counter)
    rows_filtered: Counter[str] = field(default_factory=Counter)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rows_quarantined(self) -> int:
        return sum(self.quarantine_reasons.values())

    @property
    def filtered_total(self) -> int:
        return sum(self.rows_filtered.values())

    def quarantine(self, reason: str, n: int = 1) -> None:
        self.quarantine_reasons[reason] += n

    def filter(self, reason: str, n: int = 1) -> None:
        if n:
            self.rows_filtered[reason] += n

    def merge(self, other: Stats) -> None:
        self.rows_in += other.rows_in
        self.rows_out += other.rows_out
        self.quarantine_reasons.update(other.quarantine_reasons)
        self.rows_filtered.update(other.rows_filtered)
        for key, value in other.extra.items():
            if isinstance(value, dict):
                bucket = self.extra.setdefault(key, Counter())
                bucket.update(value)
            elif isinstance(value, int | float) and not isinstance(value, bool):
                self.extra[key] = self.extra.get(key, 0) + value

    def check(self, where: str) -> None:
        balance = self.rows_out + self.rows_quarantined + self.filtered_total
        if self.rows_in != balance:
            raise AccountingError(
                f"{where}: rows_in={self.rows_in} but out={self.rows_out} + "
                f"quarantined={self.rows_quarantined} + filtered={self.filtered_total} = "
                f"{balance}. "
                "This is a bug in dflash_etl; please report it with the run's manifest.json."
            )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rows_in": self.rows_in,
            "rows_out": self.rows_out,
            "rows_quarantined": self.rows_quarantined,
            "quarantine_reasons": dict(sorted(self.quarantine_reasons.items())),
            "rows_filtered": dict(sorted(self.rows_filtered.items())),
        }
        for key, value in self.extra.items():
            out[key] = dict(sorted(value.items())) if isinstance(value, dict) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Stats:
        known = {"rows_in", "rows_out", "rows_quarantined", "quarantine_reasons", "rows_filtered"}
        return cls(
            rows_in=int(data["rows_in"]),
            rows_out=int(data["rows_out"]),
            quarantine_reasons=Counter(data.get("quarantine_reasons", {})),
            rows_filtered=Counter(data.get("rows_filtered", {})),
            extra={k: v for k, v in data.items() if k not in known},
        )


def stats_document(per_source: dict[str, Stats], where: str) -> dict[str, Any]:
    """The stats.json shape every stage writes: {"total": {...}, "sources": {name: {...}}}."""
    total = Stats()
    for name, stats in per_source.items():
        stats.check(f"{where}, source {name!r}")
        total.merge(stats)
    total.check(f"{where}, total")
    return {
        "total": total.to_dict(),
        "sources": {name: s.to_dict() for name, s in per_source.items()},
    }
