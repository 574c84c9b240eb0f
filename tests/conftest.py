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
