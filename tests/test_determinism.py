"""Two runs of the same config give byte-identical data files, wherever the run directory is.

Not data, and so not compared byte for byte:
- manifest.json: when each stage started and finished, its seconds and train's steps/s, the
  package versions; the run's record, not its output.
- docs/: the HTML report, built from the manifest (timings, the run directory's path).
- <stage>/validation.json: the great_expectations result of the stage's suite, which records the
  suite's seconds, great_expectations' own batch load time (batch_markers.ge_load_time) and the
  directory validated. It is compared without those.
- <stage>/files.json: the list of the published files with their sizes and hashes; it lists
  validation.json too, so it is compared without that entry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_etl.io.torch_pickle import save_plain_dict

REPO = Path(__file__).resolve().parents[1]

NOT_DATA = ("manifest.json", "docs/")
REPORTS = ("validation.json",)
# what differs between two validations of the same data (see test_suites' VARYING)
VARYING = {"seconds", "stage_dir", "run_id", "run_time", "validation_time", "batch_id",
           "active_batch_id", "checkpoint_id", "batch_spec", "batch_markers"}


def _files(run: Path) -> set[str]:
    return {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()}


def _without_varying(value):
    if isinstance(value, dict):
        return {k: _without_varying(v) for k, v in value.items() if k not in VARYING}
    if isinstance(value, list):
        return [_without_varying(v) for v in value]
    return value


def differing_files(a: Path, b: Path) -> list[str]:
    """The files under run `a` and run `b` that are not the same (present in one only, or with
    other bytes; reports without their timings), manifest and docs aside."""
    names = {n for n in _files(a) | _files(b) if not n.startswith(NOT_DATA)}
    out = []
    for name in sorted(names):
        fa, fb = a / name, b / name
        if not (fa.is_file() and fb.is_file()):
            out.append(f"{name} (only in {'the first' if fa.is_file() else 'the second'} run)")
        elif Path(name).name == "files.json":
            def listing(path: Path) -> dict:
                return {k: v for k, v in json.loads(path.read_text()).items()
                        if Path(k).name not in REPORTS}

            if listing(fa) != listing(fb):
                out.append(name)
        elif Path(name).name in REPORTS:
            if _without_varying(json.loads(fa.read_text())) != _without_varying(
                    json.loads(fb.read_text())):
                out.append(name)
        elif fa.read_bytes() != fb.read_bytes():
            out.append(name)
    return out


@pytest.mark.slow
def test_two_runs_of_the_default_give_byte_identical_data_files(default_run_dir, tmp_path):
    """`dflash-etl run` twice (the session's shared run in <cwd>/runs/default, and one more into
    another directory): every data file of every stage is byte-identical."""
    second = tmp_path / "elsewhere" / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run([sys.executable, "-m", "dflash_etl", "run", "--run", str(second)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=2400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (second / "train" / "drafter" / "model.safetensors").is_file()
    differing = differing_files(default_run_dir, second)
    assert not differing, f"{len(differing)} data files differ between two runs: {differing}"
    # the timing that left train's stats.json is in the manifest
    stage = json.loads((second / "manifest.json").read_text())["stages"]["train"]
    assert stage["steps_per_s"] > 0 and "steps_per_s" not in stage["counts"]


def test_save_plain_dict_writes_the_same_bytes_and_torch_loads_them(tmp_path, monkeypatch):
    import time
    import zipfile

    mapping = {7: 3, 1: 10, 700: 2, 42: 1}
    a, b = tmp_path / "a" / "token_freq.pt", tmp_path / "b" / "token_freq.pt"
    a.parent.mkdir()
    b.parent.mkdir()
    save_plain_dict(mapping, a)
    later = time.time() + 3 * 86400  # zipfile stamps records with time.localtime() by default
    monkeypatch.setattr(time, "time", lambda: later)
    save_plain_dict(mapping, b)
    assert a.read_bytes() == b.read_bytes()
    assert {i.date_time for i in zipfile.ZipFile(a).infolist()} == {(1980, 1, 1, 0, 0, 0)}
    torch = pytest.importorskip("torch")
    assert torch.load(a) == mapping  # weights_only=True, torch's default
    assert torch.load(a, weights_only=False) == mapping
    assert torch.load(a, mmap=True, map_location="cpu") == mapping
