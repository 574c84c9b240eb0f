"""Shared fixtures: the real third-party rows under ../shared/fixtures (skipped when absent)."""

from __future__ import annotations

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
def default_run_dir(tmp_path_factory) -> Path:
    """ingest + tokenize (with their gates and the report) on data/pipeline.toml.

    DFLASH_TEST_DEFAULT_RUN=DIR reuses a copy of such a run (for iterating on the tests; the
    run takes minutes on a slow machine)."""
    import os
    import shutil

    from dflash_etl.config import load_config
    from dflash_etl.stages import ingest, tokenize

    config = load_config(REPO_ROOT / "data" / "pipeline.toml")
    run = tmp_path_factory.mktemp("default-run") / "run"
    if os.environ.get("DFLASH_TEST_DEFAULT_RUN"):
        shutil.copytree(os.environ["DFLASH_TEST_DEFAULT_RUN"], run)
        return run
    ingest.run(config, run, workers=1, progress=False)
    tokenize.run(config, run, workers=1, progress=False)
    return run


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
