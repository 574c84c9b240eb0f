"""`dflash-etl status RUN`: where a run stands, from another terminal — each stage's state and,
for one running now, its progress as the stage records it (core/progress.py). Reads only."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError
from dflash_etl.core.lock import live_holder
from dflash_etl.core.progress import progress_record, record_text
from dflash_etl.core.rundir import RunDir
from dflash_etl.stages import PIPELINE


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="where a run stands: each stage, and the progress of one "
                                      "running now (reads only)")
    p.add_argument("run", nargs="?", default="runs/default",
                   help="run directory (default: %(default)s)")
    p.set_defaults(func=cmd_status)


def stage_lines(run_dir: Path) -> list[str]:
    """One line per stage of the pipeline the run has a record of, in pipeline order."""
    run = RunDir(run_dir)
    if not run.manifest_path.is_file():
        raise StageError(f"{run_dir} is not a run directory (no manifest.json): give the --run "
                         "directory a `dflash-etl run` or stage wrote")
    records, stale = run.records(), run.stale()
    holder = live_holder(run_dir)
    lines = []
    for name in [*PIPELINE.names(), *sorted(set(records) - set(PIPELINE.names()))]:
        record = records.get(name)
        if record is None:
            lines.append(f"{name:<11} not run")
            continue
        state = "stale" if name in stale else (record.status or "unknown")
        line = f"{name:<11} {state}"
        if record.entry.get("seconds") is not None and record.complete:
            line += f" ({record.entry['seconds']:.1f} s)"
        if record.status == "running":
            line += " " + _running(run_dir, name, holder)
        elif record.status == "failed" and record.error:
            line += f": {str(record.error).splitlines()[0][:160]}"
        lines.append(line)
    return lines


def _running(run_dir: Path, stage: str, holder: dict[str, Any] | None) -> str:
    if holder is None:
        return ("— but no process holds the run: the one running it died; the next command "
                "(a stage, check, export) settles it")
    who = f"now (pid {holder.get('pid')} on {holder.get('host')})"
    path = progress_record(run_dir, stage)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = {}
    if doc.get("pid") != holder.get("pid"):  # none yet, or an earlier run's
        return f"{who}: no progress recorded yet (loading, or planning its work)"
    ago = time.time() - float(doc.get("updated", 0))
    return f"{who}: {record_text(doc, stage)} " \
           f"(updated {ago:.0f} s ago)"


def cmd_status(args: argparse.Namespace) -> int:
    print(f"run: {args.run}")
    for line in stage_lines(Path(args.run)):
        print(line)
    return 0
