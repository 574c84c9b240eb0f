"""A benchmark's results page: the table a script writes, and the hand-written `## Findings`
below it, which a rerun keeps."""

from __future__ import annotations

from pathlib import Path

FINDINGS = "## Findings"


def write_keeping_findings(md: Path, lines: list[str]) -> None:
    """Write `lines` to `md`, followed by the `## Findings` section `md` already holds."""
    text = md.read_text() if md.exists() else ""
    notes = text[text.index(FINDINGS):] if FINDINGS in text else ""
    md.write_text("\n".join(lines) + "\n" + ("\n" + notes if notes else ""))
