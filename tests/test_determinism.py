"""Two runs of the same config give byte-identical data files, wherever the run directory is
(what is not data: see run_compare)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash_etl.io.torch_pickle import save_plain_dict
from run_compare import differing_files


@pytest.mark.slow
def test_two_runs_of_the_default_give_byte_identical_data_files(default_run_dir, default_run_env,
                                                               tmp_path):
    """`dflash-etl run` twice (the session's shared run in <cwd>/runs/default, and one more into
    another directory, in the environment the first ran in: training's sums depend on the
    thread count, OMP_NUM_THREADS): every data file of every stage is byte-identical."""
    second = tmp_path / "elsewhere" / "run"
    env = default_run_env
    result = subprocess.run([sys.executable, "-m", "dflash_etl", "run", "--run", str(second)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=2400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (second / "train" / "drafter" / "model.safetensors").is_file()
    differing = differing_files(default_run_dir, second)
    assert not differing, f"{len(differing)} data files differ between two runs: {differing}"
    # the timing that left train's stats.json is in the manifest
    stage = json.loads((second / "manifest.json").read_text())["stages"]["train"]
    assert stage["steps_per_s"] > 0 and "steps_per_s" not in stage["counts"]

    # moved (its tiny target inside it): every stage is still complete, none is redone (the
    # target's path was in the fingerprints of regenerate, extract and train)
    moved = tmp_path / "moved" / "run"
    moved.parent.mkdir()
    second.rename(moved)
    again = subprocess.run([sys.executable, "-m", "dflash_etl", "run", "--run", str(moved)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=2400)
    assert again.returncode == 0, again.stderr[-3000:]
    for name in ("ingest", "regenerate", "tokenize", "extract", "train"):
        assert f"{name} already complete, skipped" in again.stdout + again.stderr, name


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
