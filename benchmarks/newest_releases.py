"""Which newest release of the libraries whose internals the code touches breaks what: each one,
alone, over the locked environment, against the tests that exercise it.

Why: installs are locked (pylock.toml), so a new release never reaches a user of the
README's commands unannounced; this is how the lock learns about it before it moves (`make
lock`). A scratch environment is made from the lock (uv, torch's local CPU wheel); then for each
library its newest release is installed in place of the locked one, its tests run, and the
locked version goes back. Nothing here touches `.venv`.

    python benchmarks/newest_releases.py [--only transformers,datasets] [--keep]
        [--release transformers==5.26.0rc1]

Writes benchmarks/results/newest_releases.{json,md}: per library, the locked and the newest
version and the tests that fail with the newest (their first error line).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work" / "newest_releases"
LOCK = REPO / "pylock.toml"
sys.path.insert(0, str(REPO / "tools"))
from lock_pins import pins  # noqa: E402  (the lock's versions: tools/lock_pins.py)

TORCH_WHEELS = os.environ.get("TORCH_WHEELS") or os.environ.get("PIP_FIND_LINKS") or "/opt/wheels"

# library -> the tests that exercise the internals we use (-m "not slow": minutes, not an hour)
CHECKS = {
    "transformers": ["tests/test_qwen3_5.py", "tests/test_template_render.py",
                     "tests/test_train_stage.py", "tests/test_extract_stage.py"],
    "datasets": ["tests/test_tokenize_stage.py", "tests/test_handoff.py"],
    "great-expectations": ["tests/test_suites.py", "tests/test_ingest_stage.py"],
    "pandera": ["tests/test_readers.py", "tests/test_suites.py"],
    "polars": ["tests/test_ingest_stage.py", "tests/test_near_dedup.py",
               "tests/test_decontamination.py"],
    "pyarrow": ["tests/test_tokenize_stage.py", "tests/test_outputs.py"],
    "tokenizers": ["tests/test_masks.py", "tests/test_tokenize_stage.py"],
}


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def locked(name: str) -> str:
    for locked_name, version in pins(LOCK).items():
        if locked_name.lower() == name.lower():
            return version
    raise SystemExit(f"{name} is not in {LOCK}")


def newest(uv: str, python: str, name: str) -> str:
    """The newest release on the index (a dry-run install of it alone, no dependencies)."""
    # --reinstall: with the newest already installed, uv prints no "+ name==" line without it
    out = run([uv, "pip", "install", "--python", python, "--dry-run", "--no-deps", "--reinstall",
               "-U", name])
    found = re.search(rf"\+ {re.escape(name.lower())}==(\S+)", (out.stdout + out.stderr).lower())
    if not found:
        raise SystemExit(f"cannot tell {name}'s newest release: {out.stderr[-500:]}")
    return found.group(1)


def environment() -> tuple[str, str]:
    """A scratch venv with the lock and the package (editable: the checkout's code)."""
    venv = WORK / "venv"
    python = str(venv / "bin" / "python")
    uv = shutil.which("uv") or str(REPO / ".venv" / "bin" / "uv")
    if not Path(python).exists():
        run([uv, "venv", "--python", sys.executable, str(venv)], check=True)
        run([uv, "pip", "install", "--python", python, "--find-links", TORCH_WHEELS, "-r",
             str(LOCK)], check=True)
        run([uv, "pip", "install", "--python", python, "--no-deps", "-e", str(REPO)], check=True)
    return uv, python


def failures(python: str, tests: list[str]) -> tuple[list[str], float]:
    start = time.perf_counter()
    out = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
               "-x", "--tb=line", *tests], cwd=REPO, timeout=3600)
    failed = [line for line in out.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if out.returncode not in (0, 1) and not failed:  # a collection error, a crash
        failed = [out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-300:]]
    return failed, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated libraries (default: all of CHECKS)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch environment")
    parser.add_argument("--release", action="append", default=[], metavar="NAME==VERSION",
                        help="try this release instead of the newest (a candidate, an older "
                             "one); repeatable")
    args = parser.parse_args()
    chosen = dict(r.split("==", 1) for r in args.release)
    names = (args.only.split(",") if args.only else list(chosen) or list(CHECKS))
    WORK.mkdir(parents=True, exist_ok=True)
    uv, python = environment()
    rows = []
    for name in names:
        pinned, latest = locked(name), chosen.get(name) or newest(uv, python, name)
        row = {"library": name, "locked": pinned, "newest": latest, "tests": CHECKS[name],
               "tried": "given" if name in chosen else "newest"}
        if latest == pinned:
            row.update(failed=[], seconds=0.0, note="the lock has the newest")
        else:
            run([uv, "pip", "install", "--python", python, "--no-deps", f"{name}=={latest}"],
                check=True)
            row["failed"], row["seconds"] = failures(python, CHECKS[name])
            run([uv, "pip", "install", "--python", python, "--no-deps", f"{name}=={pinned}"],
                check=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not args.keep:
        shutil.rmtree(WORK / "venv", ignore_errors=True)
    results = {"date": dt.date.today().isoformat(), "lock": str(LOCK.relative_to(REPO)),
               "libraries": rows}
    (HERE / "results" / "newest_releases.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# the newest releases against the lock ({results['date']})", "",
             "Each library's newest release alone over pylock.toml, its tests "
             "(`-m \"not slow\"`, stopping at the first failure). Command: `python "
             "benchmarks/newest_releases.py`.", "",
             "| library | locked | tried | tests | result |", "|---|---|---|---|---|"]
    for r in rows:
        result = r.get("note") or ("pass" if not r["failed"] else
                                   "**breaks**: " + "; ".join(r["failed"][:3]))
        lines.append(f"| {r['library']} | {r['locked']} | {r['newest']} ({r['tried']}) | "
                     f"{', '.join(Path(t).name for t in r['tests'])} | {result} |")
    (HERE / "results" / "newest_releases.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
