"""The lock: uv.lock is current with pyproject.toml, pylock.toml (PEP 751, what installs read)
is exactly its export of the dev set, it covers every dependency pyproject.toml declares at a
version the declaration allows, the environment the tests run in holds those versions, and
tools/lock_pins.py turns it into the constraints uv and pip take."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "pylock.toml"


def declared() -> list[Requirement]:
    """What the lock is resolved from: pyproject's dependencies, the dev extra's and those of
    the extras it names (`gpu`, with vllm's own torch, is left out)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    dev = [Requirement(line) for line in extras["dev"]]
    named = {e for r in dev if canonicalize_name(r.name) == "dflash-etl" for e in r.extras}
    return [*map(Requirement, project["dependencies"]),
            *(Requirement(line) for extra in sorted(named) for line in extras[extra]),
            *(r for r in dev if canonicalize_name(r.name) != "dflash-etl")]


def locked() -> dict[str, str]:
    packages = tomllib.loads(LOCK.read_text())["packages"]
    return {canonicalize_name(p["name"]): p["version"] for p in packages}


def test_the_lock_holds_every_declared_dependency_at_an_allowed_version():
    pins = locked()
    assert "torch" in pins and pins["torch"].startswith("2.13.0")  # the CPU build, exactly
    for requirement in declared():
        name = canonicalize_name(requirement.name)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        assert name in pins, f"{name} is declared but not locked: run `make lock`"
        assert requirement.specifier.contains(pins[name], prereleases=True), \
            f"{name} {pins[name]} is locked, {requirement.specifier} declared: run `make lock`"


def test_the_tests_run_on_the_locked_versions():
    """`make test` installs from the lock: a declared dependency at another version here means
    the environment was not made by the README's command."""
    pins = locked()
    for requirement in declared():
        name = canonicalize_name(requirement.name)
        if name not in pins:
            continue
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            installed = None
        assert installed == pins[name], (name, installed, pins[name])


UV = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")


def test_uv_lock_is_current_and_pylock_is_its_export(tmp_path):
    """`make lock` writes both; an edit to pyproject.toml without it, or a hand edit of either
    file, fails here (offline: the lock's own metadata suffices)."""
    assert UV, "uv is not installed: `make setup` installs it"
    check = subprocess.run([UV, "lock", "--check", "--offline"], cwd=REPO, capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr[-2000:]
    subprocess.run([UV, "export", "--frozen", "--format", "pylock.toml", "--extra", "dev",
                    "--group", "cpu", "--no-emit-project", "--quiet", "-o",
                    str(tmp_path / "pylock.toml")], cwd=REPO, check=True, capture_output=True)
    exported = tomllib.loads((tmp_path / "pylock.toml").read_text())
    assert exported == tomllib.loads(LOCK.read_text())


def test_the_lock_becomes_constraints_uv_takes(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "tools" / "lock_pins.py")],
                         capture_output=True, text=True, check=True).stdout
    constraints = [Requirement(line) for line in out.splitlines()]
    assert {canonicalize_name(r.name): str(r.specifier).removeprefix("==")
            for r in constraints} == locked()
