"""Progress where a person looks: a line every LOG_EVERY_S seconds in a log (stderr not a
terminal: nohup, a cluster job), quiet for a short stage, and `dflash-etl status` reading a
running stage's progress from another process."""

from __future__ import annotations

import io
import json
import signal
import time

from dflash_etl.cli.main import main
from dflash_etl.core import progress
from test_lifecycle import DYING, _setup, _start, _wait_for


def test_a_log_gets_a_line_every_interval_and_a_short_stage_none(monkeypatch):
    log = io.StringIO()  # not a terminal
    monkeypatch.setattr("sys.stderr", log)
    monkeypatch.setattr(progress, "LOG_EVERY_S", 1e9)
    with progress.progress_bar("tokenize", total=3, unit="chunks") as bar:
        bar.advance(3)
    assert log.getvalue() == ""  # done before the first interval: nothing to say
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    with progress.progress_bar("tokenize", total=3, unit="chunks") as bar:
        bar.advance(1)
        bar.advance(2)
    lines = log.getvalue().splitlines()
    heads = [h for h in (line.split(",")[0] for line in lines)  # the ticker's lines between
             if h != "tokenize: 0/3 chunks (0%)"]
    lines = [line for line in lines if not line.startswith("tokenize: 0/3")]
    assert heads[0] == "tokenize: 1/3 chunks (33%)" and heads[-1] == "tokenize: 3/3 chunks (100%)"
    assert set(heads) <= {"tokenize: 1/3 chunks (33%)", "tokenize: 3/3 chunks (100%)"}
    assert "/s, " in lines[0] and "so far, ETA " in lines[0] and "ETA" not in lines[-1]
    log.truncate(0)
    with progress.progress_bar("tokenize", total=3, enabled=False) as bar:
        bar.advance(3)
    assert log.getvalue() == ""  # progress=False (tests, the Python API): silent


def test_the_record_follows_the_work(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "RECORD_EVERY_S", 0.0)
    record = tmp_path / ".extract.progress.json"
    with progress.progress_bar("extract", total=4, enabled=False, record=record,
                               unit="shards") as bar:
        assert json.loads(record.read_text())["done"] == 0
        bar.advance(3)
        doc = json.loads(record.read_text())
        assert (doc["done"], doc["total"], doc["unit"]) == (3, 4, "shards")
        assert doc["eta_s"] is not None and doc["rate_per_s"] > 0
    assert json.loads(record.read_text())["done"] == 3


# `dflash-etl ingest` whose second item stalls (test_lifecycle's), the intervals short
STALLING = ("from dflash_etl.core import progress\n"
            "progress.LOG_EVERY_S, progress.RECORD_EVERY_S = 0.2, 0.0\n" + DYING)


def test_a_stage_in_a_log_says_how_far_it_is_and_status_reads_it(tmp_path, capsys):
    config = _setup(tmp_path, units=4)
    run = tmp_path / "run"
    proc, lines = _start(STALLING, "ingest", "--config", config, "--run", run, "--workers", "1")
    try:
        _wait_for(lines, proc, "working")
        said = _wait_for(lines, proc, "ingest: 1/4 source units (25%)")
        assert "so far, ETA " in said[0]
        assert main(["status", str(run)]) == 0
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("ingest"))
        assert f"running now (pid {proc.pid} on " in line
        assert "ingest: 1/4 source units (25%)" in line and "updated " in line
        assert "tokenize    not run" in out
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert main(["status", str(run)]) == 0
    assert "no process holds the run: the one running it died" in capsys.readouterr().out


def test_a_record_half_written_by_a_killed_stage_is_removed_by_the_next(tmp_path):
    """A stage killed between writing its progress record's temporary and renaming it left
    `.extract.progress.json.<pid>.tmp` in the run (CI's kill-and-rerun test found one): the
    next stage of the run, under the run's lock, removes it."""
    from dflash_etl.stages import ingest, load_config

    config = load_config(_setup(tmp_path, units=1))
    run = tmp_path / "run"
    run.mkdir()
    stale = run / ".extract.progress.json.6864.tmp"
    stale.write_text('{"label": "extract"')
    ingest.run(config, run, progress=False)
    assert not stale.exists()


def test_the_steps_after_the_work_keep_the_log_and_the_record_going(tmp_path, monkeypatch):
    """A million rows' contract and suite take a minute after the last item: the log and
    `status` say which check runs, not nothing."""
    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    monkeypatch.setattr(progress, "LOG_EVERY_S", 1e9)
    record = tmp_path / ".tokenize.progress.json"
    with progress.working("tokenize", record=record) as steps:
        steps.now("checking the tokenized contract")
        doc = json.loads(record.read_text())
        assert doc["step"] == "checking the tokenized contract"
        assert progress.record_text(doc, "tokenize").startswith(
            "tokenize: checking the tokenized contract, 0 s so far")
    assert log.getvalue() == ""  # not due: a short check stays quiet
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.5)
    monkeypatch.setattr(progress, "_last_line", [0.0])  # the last line long ago: one is due
    with progress.working("tokenize", record=record) as steps:
        steps.now("running the tokenized expectation suite")
        time.sleep(1.3)  # the ticker's next line, half a second after the first
    lines = log.getvalue().splitlines()
    assert len(lines) >= 2, lines
    assert all(x.startswith("tokenize: running the tokenized expectation suite, ") for x in lines)
    with progress.working("tokenize", enabled=False) as steps:
        steps.now("publishing")
    assert len(log.getvalue().splitlines()) == len(lines)  # progress=False: silent


# a whole `dflash-etl ingest` in a log, every interval due at once
EVERY_STEP = ("from dflash_etl.core import progress\nprogress.LOG_EVERY_S = 0.0\n"
              "import sys\nfrom dflash_etl.cli.main import main\nsys.exit(main(sys.argv[1:]))\n")


def test_a_stage_in_a_log_names_each_step_after_its_items(tmp_path):
    config = _setup(tmp_path, units=2)
    proc, lines = _start(EVERY_STEP, "ingest", "--config", config, "--run", tmp_path / "run")
    try:
        said = [_wait_for(lines, proc, f"ingest: {step}")[0] for step in (
            "merging the work items' results", "checking the accounting",
            "checking the conversations contract", "running the conversations expectation "
            "suite", "publishing")]
        assert all(x.endswith(" s so far") for x in said)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
