"""`dflash-etl check`: contracts, row accounting and suites on any stage output or a whole run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_etl.core.accounting import AccountingError, Stats
from dflash_etl.core.errors import StageError
from dflash_etl.core.outputs import OUTPUTS, HiddenStatesOutput, Output, TokenizedOutput
from dflash_etl.core.rundir import RunDir
from dflash_etl.validation.contracts import format_failures, load_contract, validate_files
from dflash_etl.validation.suites import Thresholds, describe_failure, output_files, run_suite

# A stage output is recognised by what it holds: its kind's marker (core/outputs.py), a folder
# of shards for the kinds with a suite (its contract and suite share its name), a file for
# hidden states and a drafter; it is named by its directory (ingest/, tokenize/, ...).
SUITES = tuple(o.suite for o in OUTPUTS if o.suite)


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


def check_stage(stage_dir: Path, kind: type[Output], suites: bool = True) -> dict[str, Any]:
    """The contract, accounting and (with `suites`) the suite of an output with a suite."""
    assert kind.suite is not None
    files = output_files(stage_dir, kind.suite)
    # the tokenized rows are checked against the limits tokenize made them with
    params = (TokenizedOutput.read(stage_dir).contract_params() if kind is TokenizedOutput
              else {})
    report = validate_files(load_contract(kind.contract, params), files)
    accounting = _check_stats(stage_dir)
    report["stage"] = stage_dir.name
    report["path"] = str(stage_dir)
    report["accounting_problems"] = accounting
    report["passed"] = report["passed"] and not accounting
    if suites:  # thresholds: the run's [expectations] (its manifest), else the defaults
        suite = run_suite(stage_dir, kind.suite, Thresholds.from_manifest(stage_dir.parent))
        report["suite_result"] = suite
        report["passed"] = report["passed"] and suite["passed"]
    return report


def check_model_stage(stage_dir: Path, kind: type[Output]) -> dict[str, Any]:
    """Hidden states (shape, finite, token ids) or a drafter (it loads, finite weights, tau in
    range): their contracts, and the row accounting."""
    from dflash_etl.validation.model_outputs import check_drafter, check_states

    contract = kind.contract
    states = kind is HiddenStatesOutput
    check_output = check_states if states else check_drafter
    accounting = _check_stats(stage_dir)  # says so when stats.json is missing
    rows, shards, problems = (check_output(stage_dir) if (stage_dir / "stats.json").exists()
                              else (0, 0, []))
    return {"stage": stage_dir.name, "path": str(stage_dir), "contract": contract, "rows": rows,
            "shards": shards, "unit": "shard files" if states else "checkpoints",
            "accounting_problems": accounting,
            "failures": [{"check": contract, "column": None, "shard": stage_dir.name,
                          "count": 1, "samples": [p]} for p in problems],
            "passed": not problems and not accounting}


FOREIGN_STATES = "speculators hidden states"  # a directory of hs_<i>.safetensors from anywhere
MAX_LISTED = 20  # problems listed per check (every file is still checked)


def foreign_states_dir(path: Path) -> Path | None:
    """The directory of speculators-format states (`hs_<i>.safetensors`, as its data generation
    or our export writes them) in `path` or its hidden_states/, when `path` is no stage output
    of ours."""
    for directory in (path, path / "hidden_states"):
        if directory.is_dir() and next(directory.glob("hs_*.safetensors"), None) is not None:
            return directory
    return None


def check_foreign_states(directory: Path) -> dict[str, Any]:
    """The hidden-state health check on states made elsewhere (no model, so no reference
    check): per file and stored layer, non-finite values, the share of exact zeros and all-zero
    layers; what speculators' own check (shape, token count) would pass on a serving engine's
    all-zero states. The dtype's limits apply (bf16: as extract's)."""
    from safetensors import safe_open

    from dflash_etl.validation.health import HealthLimits, layer_health, shard_problems

    problems: list[str] = []
    files = sorted(directory.glob("hs_*.safetensors"))
    failed = 0
    for path in files:
        try:
            with safe_open(str(path), "pt") as f:
                states = f.get_tensor("hidden_states")
        except Exception as exc:  # a truncated or foreign file: the reader's own message
            found = [f"cannot be read as speculators states ({type(exc).__name__}: {exc})"]
        else:
            if states.ndim != 3:
                found = [f"hidden_states has shape {tuple(states.shape)}, not [tokens, "
                         "layers, hidden]"]
            else:
                health = layer_health(states, range(states.shape[1]))
                limits = HealthLimits.for_dtype("bf16" if "bfloat16" in str(states.dtype)
                                                else "fp32")
                found = [f"stored layer {h['layer']}: {h['non_finite']} non-finite values"
                         for h in health if h["non_finite"]]
                found += shard_problems(health, None, limits)
        if found:
            failed += 1
            problems += [f"{path.name}: {p}" for p in found][:max(0, MAX_LISTED - len(problems))]
    if failed:
        problems.append(f"{failed} of {len(files)} files fail")
    return {"stage": FOREIGN_STATES, "path": str(directory), "contract": "hidden_state_health",
            "rows": len(files), "shards": len(files), "unit": "hs files",
            "accounting_problems": [],
            "failures": [{"check": "hidden_state_health", "column": None,
                          "shard": directory.name, "count": 1, "samples": [p]}
                         for p in problems],
            "passed": not problems}


def _kind(path: Path) -> type[Output] | None:
    return next((kind for kind in OUTPUTS if kind.found_in(path)), None)


def manifest_failures(run_dir: Path) -> list[dict[str, str]]:
    """The stages a run directory's manifest records as failed, with their messages, and those
    still `running` (a live process on them, or one that died): their output is missing (or an
    older one is stale), and complete stages built on an upstream output since replaced (stale):
    the run is not whole even when every published output passes."""
    run = RunDir(run_dir)
    try:
        records = run.records()
    except StageError as exc:
        return [{"stage": "manifest", "error": f"{run.manifest_path} cannot be read: {exc}"}]
    failures = [{"stage": name, "error": str(record.error or "no message recorded")}
                for name, record in records.items() if record.status == "failed"]
    running = [name for name, record in records.items() if record.status == "running"]
    if running:
        from dflash_etl.core.lock import live_holder

        holder = live_holder(run_dir)
        why = (f"running now (pid {holder.get('pid')} on {holder.get('host')}): its output is not "
               "published yet; check again when that process ends" if holder else
               "left running by a process that died (SIGKILL, a lost machine): rerun the stage "
               "to resume it")
        failures += [{"stage": name, "error": why, "state": "running"} for name in running]
    for name, why in run.stale().items():
        failures.append({"stage": name, "state": "stale", "error": (
            f"{why}: its output no longer follows from the run's; rerun `dflash-etl {name} "
            f"--run {run_dir}`")})
    return failures


def check_path(path: Path, suite: str | None = None, suites: bool = True) -> dict[str, Any]:
    """Check one stage output, or every stage output found in a run directory; `suite` limits
    the check to the outputs of that suite (conversations, tokenized). extract and train
    outputs have contracts and accounting but no suite."""
    if suite is not None and suite not in SUITES:
        return {"passed": False, "stages": [], "summary":
                f"FAIL: unknown suite {suite!r}; known: {sorted(SUITES)}"}
    if not path.exists():
        return {"passed": False, "stages": [], "summary": f"FAIL: {path} does not exist"}
    kind = _kind(path)
    foreign = foreign_states_dir(path) if kind is None and suite is None else None
    if foreign is not None and not (path / "manifest.json").exists():
        report = check_foreign_states(foreign)
        status = "PASS" if report["passed"] else "FAIL"
        lines = [f"{status} {FOREIGN_STATES} ({foreign}): hidden-state health of "
                 f"{report['rows']} files (zeros, non-finite; no reference without the model)"]
        if report["failures"]:
            lines.append(format_failures(report, limit=MAX_LISTED))
        lines.append("all checks passed" if report["passed"] else "checks FAILED")
        return {"passed": report["passed"], "stages": [report], "manifest_failures": [],
                "summary": "\n".join(lines)}
    broken = [] if kind or suite else manifest_failures(path)
    state_words = {"running": "is not finished", "stale": "is stale"}
    failed_lines = [f"FAIL {f['stage']} (manifest.json): the stage "
                    f"{state_words.get(f.get('state', ''), 'failed')}: {f['error']}"
                    for f in broken]
    targets = [(path, kind)] if kind else [
        (child, _kind(child)) for child in sorted(path.iterdir())
        if child.is_dir() and not child.name.startswith(".")  # .<stage>.partial: unpublished
    ]
    targets = [(p, k) for p, k in targets if k and (suite is None or k.suite == suite)]
    if not targets:
        known = ", ".join(f"a stage directory with {o.marker} ({o.kind})" for o in OUTPUTS)
        return {"passed": False, "stages": [], "manifest_failures": broken,
                "summary": "\n".join([*failed_lines, f"FAIL: no stage output found in {path}; "
                                      f"expected one of: {known}"])}
    reports = [check_model_stage(p, k) if k.suite is None else check_stage(p, k, suites)
               for p, k in targets]
    lines = []
    for r in reports:
        status = "PASS" if r["passed"] else "FAIL"
        lines.append(f"{status} {r['stage']} ({r['path']}): contract {r['contract']!r}, "
                     f"{r['rows']} rows in {r['shards']} {r.get('unit', 'shards')}")
        if r["failures"]:
            lines.append(format_failures(r))
        lines.extend(f"  - accounting: {p}" for p in r["accounting_problems"])
        result = r.get("suite_result")
        if result:
            stats = result["statistics"]
            lines.append(f"{'PASS' if result['passed'] else 'FAIL'} {r['stage']}: suite "
                         f"{result['suite']!r}, {stats['successful']} of {stats['evaluated']} "
                         f"expectations passed on {result['rows']} rows")
            failed = [e for e in result["expectations"] if not e["success"]]
            lines.extend(describe_failure(e) for e in failed[:6])
            if len(failed) > 6:
                lines.append(f"  … and {len(failed) - 6} more (see --report / --json)")
    lines.extend(failed_lines)
    passed = all(r["passed"] for r in reports) and not broken
    lines.append("all checks passed" if passed else "checks FAILED")
    return {"passed": passed, "stages": reports, "manifest_failures": broken,
            "summary": "\n".join(lines)}
