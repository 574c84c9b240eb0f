"""The package a user installs: `dflash-etl init` writes the embedded default out, and a built wheel
carries the contracts, the suites and the default (its build hook, setup.py) and runs from them
with no checkout in sight. CI also installs the wheel with its dependencies into a fresh
environment and runs ingest -> tokenize -> check (`make wheel-check`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dflash_etl.cli.main import main
from dflash_etl.stages import load_config

REPO = Path(__file__).resolve().parents[1]
BUNDLED = ("contracts", "expectations", "data")
BUILD_INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "src", *BUNDLED)


def _project_files(names: tuple[str, ...]) -> set[str]:
    """The files the wheel must carry: everything in those folders but data/'s scripts."""
    return {p.relative_to(REPO).as_posix() for name in names for p in (REPO / name).rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc")}


def test_init_writes_the_default_as_files_to_edit(tmp_path, capsys):
    out = tmp_path / "mine"
    assert main(["init", str(out)]) == 0
    written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {f"data/{name}" for name in written} == _project_files(("data",))
    for name in written:
        assert (out / name).read_bytes() == (REPO / "data" / name).read_bytes()
    config = load_config(out / "pipeline.toml")
    assert all((out / s.path).is_file() for s in config.sources)  # relative to the copy
    assert f"cd {out} && dflash-etl run --config pipeline.toml" in capsys.readouterr().out


def test_init_never_writes_over_a_directory_in_use(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["init", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: init writes a new pipeline into") and "not empty" in err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_the_wheel_carries_its_data_and_ingests_with_no_checkout(tmp_path):
    """Built from a copy of the build's inputs (nothing written into this checkout), unpacked
    as an installer would, and run from an empty directory: the contracts, suites and default
    come from the wheel, and ingest passes its gates on the default."""
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools")
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(tmp_path / "dist"), str(source)],
                   check=True, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("dflash_etl-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        prefix = "dflash_etl/_bundled/"
        bundled = {n.removeprefix(prefix) for n in archive.namelist() if n.startswith(prefix)}
        archive.extractall(site)
    assert bundled == _project_files(BUNDLED)

    empty = tmp_path / "empty"
    empty.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run(
        [sys.executable, "-c", "from dflash_etl.core.config import DEFAULT_CONFIG as c; "
         "from dflash_etl.validation.contracts import contracts_dir as d; print(c); print(d())"],
        cwd=empty, env=env, capture_output=True, text=True, check=True, timeout=300)
    config, contracts = where.stdout.split()
    assert config == str(site / "dflash_etl/_bundled/data/pipeline.toml")
    assert contracts == str(site / "dflash_etl/_bundled/contracts")
    ingest = subprocess.run([sys.executable, "-m", "dflash_etl", "ingest", "--config", config,
                             "--run", "runs/x"], cwd=empty, env=env, capture_output=True,
                            text=True, timeout=900)
    assert ingest.returncode == 0, ingest.stderr
    assert (empty / "runs/x/ingest/validation.json").is_file()
