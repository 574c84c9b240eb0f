"""`dflash-etl check`: contracts and row accounting on any stage output or a whole run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_etl.accounting import AccountingError, Stats
from dflash_etl.contracts import format_failures, load_contract, validate_files

# A stage output is recognised by what it holds: (subdirectory with shards, contract name).
LAYOUTS = {"ingest": ("conversations", "conversations"), "tokenize": ("dataset", "tokenized")}


def _check_stats(stage_dir: Path) -> list[str]:
    path = stage_dir / "stats.json"
    if not path.exists():
        return [f"{path} is missing"]
    doc = json.loads(path.read_text())
    problems = []
    for name, data in [("total", doc["total"]), *doc.get("sources", {}).items()]:
        try:
            Stats.from_dict(data).check(f"{path}: {name}")
        except AccountingError as exc:
            problems.append(str(exc).split(". This is a bug")[0])
    return problems


def check_stage(stage_dir: Path, kind: str) -> dict[str, Any]:
    subdir, contract_name = LAYOUTS[kind]
    files = sorted((stage_dir / subdir).glob("*.parquet")) + sorted(
        (stage_dir / subdir).glob("*.arrow"))
    params = {}
    if (stage_dir / "settings.json").exists():  # limits the stage ran with (vocab, seq_length)
        params = json.loads((stage_dir / "settings.json").read_text())
    report = validate_files(load_contract(contract_name, params), files)
    accounting = _check_stats(stage_dir)
    report["stage"] = kind
    report["path"] = str(stage_dir)
    report["accounting_problems"] = accounting
    report["passed"] = report["passed"] and not accounting
    return report


def _kind(path: Path) -> str | None:
    for kind, (subdir, _) in LAYOUTS.items():
        if (path / subdir).is_dir():
            return kind
    return None


def check_path(path: Path) -> dict[str, Any]:
    """Check one stage output, or every stage output found in a run directory."""
    if not path.exists():
        return {"passed": False, "stages": [], "summary": f"FAIL: {path} does not exist"}
    kind = _kind(path)
    targets = [(path, kind)] if kind else [
        (child, _kind(child)) for child in sorted(path.iterdir()) if child.is_dir()
    ]
    targets = [(p, k) for p, k in targets if k]
    if not targets:
        known = ", ".join(f"{k}/ (with {s}/)" for k, (s, _) in LAYOUTS.items())
        return {"passed": False, "stages": [],
                "summary": f"FAIL: no stage output found in {path}; expected one of: {known}"}
    reports = [check_stage(p, k) for p, k in targets]
    lines = []
    for r in reports:
        status = "PASS" if r["passed"] else "FAIL"
        lines.append(f"{status} {r['stage']} ({r['path']}): contract {r['contract']!r}, "
                     f"{r['rows']} rows in {r['shards']} shards")
        if r["failures"]:
            lines.append(format_failures(r))
        lines.extend(f"  - accounting: {p}" for p in r["accounting_problems"])
    passed = all(r["passed"] for r in reports)
    lines.append("all checks passed" if passed else "checks FAILED")
    return {"passed": passed, "stages": reports, "summary": "\n".join(lines)}
