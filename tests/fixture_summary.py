"""Print, per fixture file, how many rows ingest accepts / quarantines and why.

Not a test (no test_ prefix): run `python tests/fixture_summary.py [FIXTURES_DIR]` to get the
table for a closing note. It reads the real rows under ../shared/fixtures/data through the same
reader and normalizer that ingest uses.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from dflash_etl.core.config import SourceConfig
from dflash_etl.io import readers
from dflash_etl.stages.ingest import normalize_records

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "fixtures"


def summarize(path: Path) -> tuple[int, int, Counter[str], Counter[str], Counter[str]]:
    source = SourceConfig(name=path.stem, path=str(path))
    records = readers.read_unit(readers.Unit(str(path)), 16 * 1024 * 1024)
    rows, _quarantine, stats = normalize_records(records, source, str(path))
    formats = Counter(row["format"] for row in rows)
    prompts = Counter("needs_response" for row in rows if row["needs_response"])
    return stats.rows_in, stats.rows_out, stats.quarantine_reasons, formats, prompts


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else DEFAULT
    data = root / "data" if (root / "data").is_dir() else root
    files = sorted(data.glob("*.jsonl"))
    if not files:
        print(f"no fixture files under {data}", file=sys.stderr)
        return 1
    header = ("file", "rows", "accepted", "quarantined", "reasons", "formats", "needs_response")
    table = [header]
    for path in files:
        rows_in, rows_out, reasons, formats, prompts = summarize(path)
        table.append((
            path.name,
            str(rows_in),
            str(rows_out),
            str(sum(reasons.values())),
            ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items())) or "-",
            ", ".join(f"{k}: {v}" for k, v in sorted(formats.items())) or "-",
            str(prompts["needs_response"]),
        ))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for k, row in enumerate(table):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if k == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
