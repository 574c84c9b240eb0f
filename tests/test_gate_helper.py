"""The gate helper: one process that has imported great_expectations and pandera serves the
gates of every stage process (each its own `dflash-etl` command) while it is warm, with the
results they would compute themselves; anything wrong with it sends the gate back in-process."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import pytest

from dflash_etl.core.errors import ContractError
from dflash_etl.validation import contracts, suite_helper, suites

try:
    from tests.test_suites import DEFAULT_LIMITS, _rewrite_dataset, _without_timing
except ImportError:  # tests/ is not a package: pytest put tests/ itself on sys.path
    from test_suites import DEFAULT_LIMITS, _rewrite_dataset, _without_timing

SRC = Path(__file__).resolve().parents[1] / "src"
DEFAULT_TOKENIZER = Path(__file__).resolve().parents[1] / "data" / "tokenizer"


@pytest.fixture
def own_helper(monkeypatch):
    """A helper folder of this test's own (short: a socket's path is limited), and its helper
    ended afterwards; the session's helper is left alone."""
    folder = Path(tempfile.mkdtemp(prefix="dflash-gh-"))
    os.chmod(folder, 0o700)
    suite_helper.stop()
    monkeypatch.setenv("DFLASH_ETL_SUITE_HELPER_DIR", str(folder))
    monkeypatch.delenv("DFLASH_ETL_SUITE_HELPER", raising=False)
    yield folder
    suite_helper.shutdown()
    suite_helper.stop()


def _hello() -> dict:
    reply = suite_helper.request("hello")()
    assert reply is not None, "no helper answered"
    return reply


def _other_process(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout


def _wait_gone(pid: int, deadline_s: float = 20.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:  # a helper this process started stays a zombie until reaped
            if os.waitpid(pid, os.WNOHANG)[0]:
                return True
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_one_helper_serves_every_stage_process_and_outlives_them(own_helper):
    suite_helper.start()
    pid = _hello()["pid"]
    answered = _other_process(
        "from dflash_etl.validation import suite_helper as h; h.start(); "
        "print(h.request('hello')()['pid'])")
    assert int(answered) == pid  # the other process found it; it did not start its own
    suite_helper.stop()
    assert suite_helper.status()["pid"] == pid  # the connections closed, the helper stays
    assert [p.name.split(".")[-1] for p in own_helper.iterdir()].count("sock") == 1
    assert suite_helper.shutdown() and _wait_gone(pid)
    assert suite_helper.status() is None and not list(own_helper.glob("*.sock"))


@pytest.mark.slow
def test_the_helper_gives_the_in_process_results_and_errors(own_helper, default_run_dir,
                                                            tmp_path, copy_run):
    """Suites and contracts, passing and failing, asked back to back (the second request is
    read while the first is answered) equal what the stage's own process computes."""
    thresholds = suites.Thresholds.from_section(DEFAULT_LIMITS)
    params = {"vocab_size": 10**6, "seq_length": 8192, "min_supervised_tokens": 2}
    good = copy_run(default_run_dir / "tokenize", tmp_path / "good")
    bad = copy_run(default_run_dir / "tokenize", tmp_path / "bad")

    def break_first_row(frame: pl.DataFrame) -> pl.DataFrame:
        masks = frame["loss_mask"].to_list()
        masks[0] = [0] * (len(masks[0]) - 1) + [1]  # one supervised token: both gates fail
        return frame.with_columns(pl.Series("loss_mask", masks))

    _rewrite_dataset(bad, break_first_row)
    suite_helper.start()
    pid = _hello()["pid"]
    for stage in (good, bad):
        contract_answer = suite_helper.request_contract("tokenized", stage, params)
        suite_answer = suite_helper.request_suite(stage, "tokenized",
                                                  dataclasses.asdict(thresholds))
        from_helper = contract_answer(), suite_answer()
        try:
            contract_here: dict = {"report": contracts.validate_output("tokenized", stage,
                                                                       params)}
        except ContractError as exc:
            contract_here = {"report": exc.report, "error": str(exc)}
        suite_here = suites.run_suite(stage, "tokenized", thresholds)
        assert json.loads(json.dumps(from_helper[0], default=str)) == \
            json.loads(json.dumps(contract_here, default=str))
        assert _without_timing(from_helper[1]) == _without_timing(suite_here)
    assert "error" in contract_here and not suite_here["passed"]  # the bad copy failed both
    # the stage's own entry raises the helper's verdict with the in-process message
    with pytest.raises(ContractError, match="enough_supervised"):
        contracts.start_output_validation("tokenized", bad, params)()
    with pytest.raises(suites.SuiteError, match="longest_supervised_run"):
        suites.gate("tokenize", bad, tmp_path, thresholds)
    hello = _hello()
    assert (hello["pid"], hello["validations"]) == (pid, 6) and hello["rss_mb"] > 0


@pytest.mark.slow
def test_a_dead_helper_sends_the_gate_in_process_and_the_next_stage_starts_another(
        own_helper, default_run_dir, tmp_path, copy_run):
    thresholds = suites.Thresholds.from_section(DEFAULT_LIMITS)
    good = copy_run(default_run_dir / "tokenize", tmp_path / "good")
    suite_helper.start()
    pid = _hello()["pid"]
    os.kill(pid, signal.SIGKILL)
    assert _wait_gone(pid)
    assert list(own_helper.glob("*.sock")), "a killed helper leaves its socket file behind"
    assert suites.gate("tokenize", good, tmp_path, thresholds)["passed"]  # in-process
    assert not suite_helper.running()
    suite_helper.start()  # the next stage: the stale socket is replaced by a new helper's
    assert _hello()["pid"] != pid


def test_an_idle_helper_exits_and_removes_its_socket(own_helper, monkeypatch):
    monkeypatch.setenv("DFLASH_ETL_SUITE_HELPER_IDLE_S", "1")
    suite_helper.start()
    pid = _hello()["pid"]
    time.sleep(2.5)
    assert suite_helper.status()["pid"] == pid, "a connected stage keeps it"
    suite_helper.stop()
    assert _wait_gone(pid), "the helper did not exit once idle"
    assert not list(own_helper.glob("*.sock"))
    assert "idle 1 s, exiting" in next(own_helper.glob("*.log")).read_text()


def test_a_folder_others_can_open_is_not_used(own_helper, default_tokenized, tmp_path,
                                              copy_run, monkeypatch, capsys):
    os.chmod(own_helper, 0o777)
    monkeypatch.setattr(suite_helper, "_WARNED", [])
    assert suite_helper.helper_dir() is None
    assert "open to other users" in capsys.readouterr().err  # said, once
    assert suite_helper.helper_dir() is None and not capsys.readouterr().err
    suite_helper.start()
    assert not suite_helper.running() and not list(own_helper.iterdir())
    params = {"vocab_size": 10**6, "seq_length": 8192, "min_supervised_tokens": 2}
    stage = copy_run(default_tokenized / "tokenize", tmp_path / "t")
    report = contracts.start_output_validation("tokenized", stage, params)()
    assert report["passed"]  # validated here, in-process


def test_a_cli_stage_imports_neither_ge_nor_pandera_when_a_helper_runs(own_helper, ingest_rows):
    """What the helper is for: `dflash-etl tokenize` after `ingest` pays neither import; the
    helper ran its contract and its suite."""
    rows = [{"messages": [{"role": "user", "content": f"What is {k} + {k}?"},
                          {"role": "assistant", "content": f"It is {2 * k}."}]}
            for k in range(40)]
    run = ingest_rows(rows, "sums")
    suite_helper.start()
    before = _hello()
    code = ("import json, sys; from dflash_etl.cli.main import main; "
            f"rc = main(['tokenize', '--run', {str(run)!r}, '--model', "
            f"{str(DEFAULT_TOKENIZER)!r}, '--workers', '1']); "
            "print(json.dumps([rc, sorted({m.split('.')[0] for m in sys.modules} "
            "& {'great_expectations', 'pandera', 'pandas'})]))")
    rc, imported = json.loads(_other_process(code).splitlines()[-1])
    assert rc == 0 and imported == []
    after = _hello()
    assert (after["pid"], after["validations"]) == (before["pid"], before["validations"] + 2)
    assert json.loads((run / "tokenize" / "validation.json").read_text())["passed"]
    assert json.loads((run / "tokenize" / "contract.json").read_text())["rows"] == 40
