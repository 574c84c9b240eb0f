"""Comparing two run directories' data files (test_determinism, test_kill_resume).

Not data, and so not compared byte for byte:
- manifest.json: when each stage started and finished, its seconds and train's steps/s, the
  package versions; the run's record, not its output.
- docs/: the HTML report, built from the manifest (timings, the run directory's path).
- <stage>/validation.json: the great_expectations result of the stage's suite, which records the
  suite's seconds, great_expectations' own batch load time (batch_markers.ge_load_time) and the
  directory validated. It is compared without those, and so is each stage's files.json (the
  list of published files) without the size and hash of its validation.json.
"""

from __future__ import annotations

import json
from pathlib import Path

NOT_DATA = ("manifest.json", "docs/")
REPORTS = ("validation.json",)
FILES_JSON = "files.json"
# what differs between two validations of the same data (see test_suites' VARYING)
VARYING = {"seconds", "stage_dir", "run_id", "run_time", "validation_time", "batch_id",
           "active_batch_id", "checkpoint_id", "batch_spec", "batch_markers"}


def _files(run: Path) -> set[str]:
    return {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()}


def without_keys(value, keys: set[str]):
    """`value` (parsed JSON) with every dict entry named in `keys` dropped, at any depth."""
    if isinstance(value, dict):
        return {k: without_keys(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [without_keys(v, keys) for v in value]
    return value


def _listing(path: Path) -> dict:
    """A stage's files.json without the sizes and hashes of its reports (their timings vary)."""
    listing = json.loads(path.read_text())
    return {rel: entry if Path(rel).name not in REPORTS else None
            for rel, entry in listing.items()}


def differing_files(a: Path, b: Path) -> list[str]:
    """The files under run `a` and run `b` that are not the same (present in one only, or with
    other bytes; reports without their timings), manifest and docs aside."""
    names = {n for n in _files(a) | _files(b) if not n.startswith(NOT_DATA)
             and not (n.startswith(".") and n.endswith(".progress.json"))}  # a run's record
    out = []
    for name in sorted(names):
        fa, fb = a / name, b / name
        if not (fa.is_file() and fb.is_file()):
            out.append(f"{name} (only in {'the first' if fa.is_file() else 'the second'} run)")
        elif Path(name).name in REPORTS:
            if without_keys(json.loads(fa.read_text()), VARYING) != without_keys(
                    json.loads(fb.read_text()), VARYING):
                out.append(name)
        elif Path(name).name == FILES_JSON:
            if _listing(fa) != _listing(fb):
                out.append(name)
        elif fa.read_bytes() != fb.read_bytes():
            out.append(name)
    return out
