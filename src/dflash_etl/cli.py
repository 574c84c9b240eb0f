"""`dflash-etl`: one subcommand per stage, plus `run` (every stage) and `check` (for CI)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dflash_etl.config import ConfigError, load_config
from dflash_etl.errors import StageError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "data" / "pipeline.toml"


def _say(text: str = "") -> None:
    print(text, flush=True)


def _counts_line(total: dict[str, Any]) -> str:
    filtered = sum(total["rows_filtered"].values())
    return (
        f"{total['rows_in']} in -> {total['rows_out']} out, "
        f"{total['rows_quarantined']} quarantined {total['quarantine_reasons'] or ''}, "
        f"{filtered} filtered {total['rows_filtered'] or ''}"
    ).replace("  ", " ")


def cmd_ingest(args: argparse.Namespace) -> int:
    from dflash_etl.stages import ingest

    config = load_config(args.config)
    doc = ingest.run(config, args.run, force=args.force, workers=args.workers)
    out = Path(args.run) / "ingest"
    state = "already complete, skipped (use --force to redo)" if doc.get("skipped") else "done"
    _say(f"ingest {state}: {_counts_line(doc['total'])}")
    for name, stats in doc["sources"].items():
        _say(f"  {name}: {_counts_line(stats)}")
    _say(f"  conversations: {out / 'conversations'}")
    _say(f"  quarantine:    {out / 'quarantine.parquet'}")
    _say(f"  stats:         {out / 'stats.json'}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Every stage that exists, in order, on one config (the embedded default by default)."""
    args.config = args.config or str(DEFAULT_CONFIG)
    _say(f"config: {args.config}\nrun:    {args.run}")
    code = cmd_ingest(args)
    if code:
        return code
    _say(f"manifest: {Path(args.run) / 'manifest.json'}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from dflash_etl.check import check_path

    report = check_path(Path(args.path))
    _say(report["summary"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["passed"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-etl",
        description="Validation-first ETL for speculative-decoding drafter training data.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def stage_args(p: argparse.ArgumentParser, config_required: bool) -> None:
        p.add_argument("--config", required=config_required, help="pipeline.toml")
        p.add_argument("--run", default="runs/default", help="run directory (default: %(default)s)")
        p.add_argument("--force", action="store_true", help="redo a stage that is complete")
        p.add_argument("--workers", type=int, default=None, help="worker processes (default: cores)")

    p = sub.add_parser("ingest", help="sources -> canonical conversations + quarantine")
    stage_args(p, config_required=True)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("run", help="every stage on a config (default: the embedded data/)")
    stage_args(p, config_required=False)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check", help="contract checks of a stage output or a whole run (exit 0/1)")
    p.add_argument("path", help="a stage output directory (e.g. runs/x/ingest) or a run directory")
    p.add_argument("--json", help="also write the full report as JSON here")
    p.set_defaults(func=cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, StageError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted: completed work is kept; rerun to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
