"""Shared fixtures: the real third-party rows under ../shared/fixtures (skipped when absent)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The repository is <root>/main (or any checkout name); fixtures live next to it in
# <root>/shared/fixtures, locally and in CI.
FIXTURES_DIR = Path(__file__).resolve().parents[2] / "shared" / "fixtures"


def require_fixtures_dir() -> Path:
    """The fixtures folder, or a skip that says where it was expected."""
    if not (FIXTURES_DIR / "data").is_dir():
        pytest.skip(
            f"real fixture rows not found at {FIXTURES_DIR / 'data'} "
            "(expected ../shared/fixtures next to the repository)"
        )
    return FIXTURES_DIR


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """../shared/fixtures; tests using it skip with a clear reason when it is absent."""
    return require_fixtures_dir()


@pytest.fixture(scope="session")
def fixture_data(fixtures_dir: Path) -> Path:
    """../shared/fixtures/data: real conversation rows in every supported format."""
    return fixtures_dir / "data"


# ---------------------------------------------------------------- runs shared by the suite and
# report tests: one in-process run of the embedded default (great_expectations is imported once
# per pytest process; its import alone can take a minute on a slow machine).
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def default_cli_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`python -m dflash_etl run` exactly as the README's `make run` calls it (default config,
    default workers, its gates and report), once per session in a fresh working directory.

    DFLASH_TEST_DEFAULT_RUN=DIR reuses a copy of such a run (for iterating on the tests; the
    run takes minutes on a slow machine)."""
    cwd = tmp_path_factory.mktemp("cwd")
    run = cwd / "runs" / "default"
    if os.environ.get("DFLASH_TEST_DEFAULT_RUN"):
        shutil.copytree(os.environ["DFLASH_TEST_DEFAULT_RUN"], run)
        out = f"ingest done\n{run / 'ingest' / 'conversations'}"
        done = subprocess.CompletedProcess([], 0, out, "")
        return cwd, done
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    result = subprocess.run(
        [sys.executable, "-m", "dflash_etl", "run"], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=2400,  # a loaded 2-core machine; great_expectations' import is slow
    )
    return cwd, result


@pytest.fixture(scope="session")
def default_run_dir(default_cli_run) -> Path:
    """The embedded default's run directory (ingest + tokenize, gates passed, report built)."""
    cwd, result = default_cli_run
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "runs" / "default"


@pytest.fixture(scope="session")
def failed_gate_run(tmp_path_factory) -> tuple[Path, int, str]:
    """`dflash-etl ingest` on the default sources with an impossible quarantine limit (0%):
    the conversations suite fails. Returns (run dir, exit code, stderr)."""
    import contextlib
    import io
    import tomllib

    import tomli_w

    from dflash_etl.cli import main

    base = tmp_path_factory.mktemp("failed-gate")
    config = tomllib.loads((REPO_ROOT / "data" / "pipeline.toml").read_text())
    for source in config["sources"]:
        source["path"] = str(REPO_ROOT / "data" / source["path"])
    config["expectations"]["max_quarantine_rate"] = 0.0
    config["expectations"]["max_quarantine_rate_per_source"] = {}
    (base / "pipeline.toml").write_text(tomli_w.dumps(config))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["ingest", "--config", str(base / "pipeline.toml"), "--run",
                     str(base / "run"), "--workers", "1"])
    return base / "run", code, err.getvalue()
