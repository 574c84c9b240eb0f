"""A benchmark's rerun rewrites its table and keeps the findings written by hand below it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_a_rerun_replaces_the_table_and_keeps_the_findings(tmp_path):
    from results_page import write_keeping_findings

    md = tmp_path / "bench.md"
    write_keeping_findings(md, ["# bench", "| a | 1 |"])
    assert md.read_text() == "# bench\n| a | 1 |\n"
    md.write_text(md.read_text() + "\n## Findings\n\nwritten by hand\n")
    write_keeping_findings(md, ["# bench", "| a | 2 |"])
    assert md.read_text() == "# bench\n| a | 2 |\n\n## Findings\n\nwritten by hand\n"
