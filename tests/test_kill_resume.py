"""SIGKILL at any moment, then a plain rerun: the same outputs as a run never interrupted.

One run directory is killed several times in sequence (in ingest, as ingest is published, in
regenerate, tokenize, extract, and twice in train, each rerun resuming the previous one's work),
then rerun to completion. After every
kill, `dflash-etl check` passes on whatever was published (exit 0), or says that nothing was
(exit 1, "no stage output found": there is nothing to vouch for). The finished run's data files
are byte-identical to the session's uninterrupted run of the embedded default.

Each kill point is a file the run writes (a work item's done marker, a cache line, a checkpoint)
plus a seeded random delay, so the kills land in the named stage, at varying moments of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from run_compare import differing_files

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO / "src")}
STAGES = ("ingest", "regenerate", "tokenize", "extract", "train")
RUN_TIMEOUT = 1800


def _any(pattern: str) -> Callable[[Path], bool]:
    return lambda run: next(run.glob(pattern), None) is not None


def _lines_at_least(rel: str, n: int) -> Callable[[Path], bool]:
    def ready(run: Path) -> bool:
        try:
            with open(run / rel, "rb") as fh:
                return fh.read().count(b"\n") >= n
        except OSError:
            return False
    return ready


# (stage the kill lands in, when to kill, the most seconds of seeded delay after that)
KILL_POINTS = [
    ("ingest", _any(".ingest.partial/units/*.done.json"), 0.3),
    # the moment ingest/ is renamed in: the manifest update, the report, regenerate's start
    ("ingest's publishing", lambda run: (run / "ingest").is_dir(), 0.0),
    ("regenerate", _lines_at_least(".regenerate.partial/generations.jsonl", 120), 3.0),
    ("tokenize", _any(".tokenize.partial/units/*.done.json"), 0.2),
    ("extract", _any(".extract.partial/units/*.done.json"), 0.0),  # 2 shards: over in a blink
    ("train, before its first checkpoint", _lines_at_least(".train.partial/log.jsonl", 20), 2.0),
    ("train", _any(".train.partial/checkpoints/step-000100/state.json"), 4.0),
]


def _cli(*args: str, cwd: Path, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "dflash_etl", *args], cwd=cwd, env=ENV,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _group_gone(pgid: int, timeout: float = 60) -> None:
    """Every process of the group (pool workers, the suite helper) has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process group {pgid} still alive {timeout} s after SIGKILL")


def _kill_when(process: subprocess.Popen, run: Path, ready: Callable[[Path], bool],
               delay: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while not ready(run):
        if process.poll() is not None:
            raise AssertionError(f"the run ended (exit {process.returncode}) before the kill "
                                 f"point in {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError(f"the kill point in {what} never came")
        time.sleep(0.01)
    time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    _group_gone(process.pid)


def _check(run: Path, cwd: Path, log: Path) -> tuple[int, str]:
    result = subprocess.run([sys.executable, "-m", "dflash_etl", "check", str(run)], cwd=cwd,
                            env=ENV, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    with open(log, "a") as out:
        out.write(f"--- check\n{result.stdout}{result.stderr}")
    return result.returncode, result.stdout + result.stderr


def _published(run: Path) -> list[str]:
    return [s for s in STAGES if (run / s).is_dir()]


@pytest.mark.slow
def test_sigkill_in_every_stage_then_rerun_gives_the_uninterrupted_outputs(
        default_run_dir_later, tmp_path):
    """The session's uninterrupted run (in the background meanwhile) is waited for at the end."""
    rng = random.Random(20240611)
    run, log = tmp_path / "run", tmp_path / "log.txt"
    history = []
    began = time.monotonic()
    for stage, ready, most in KILL_POINTS:
        with open(log, "a") as out:
            out.write(f"=== run, killed in {stage} ({time.monotonic() - began:.0f} s in)\n")
        process = _cli("run", "--run", str(run), cwd=tmp_path, log=log)
        _kill_when(process, run, ready, rng.uniform(0, most), stage, log)
        published = _published(run)
        history.append((stage, published))
        # whatever the kill left: the manifest is whole JSON, published outputs pass check
        manifest = json.loads((run / "manifest.json").read_text())
        with open(log, "a") as out:  # where the kill landed
            out.write(f"--- killed: published {published}, manifest says "
                      f"{ {s: i.get('status') for s, i in manifest['stages'].items()} }\n")
        code, output = _check(run, tmp_path, log)
        if published:
            # the published outputs pass; a stage the kill left `running` is named, not passed
            unfinished = [s for s, i in manifest["stages"].items()
                          if i.get("status") == "running"]
            assert all(f"PASS {s} (" in output for s in published), output[-4000:]
            assert code == (1 if unfinished else 0), \
                f"check after a kill in {stage} ({published} published):\n{output[-4000:]}"
            # check settles what the dead process left, as the next stage would: named
            assert all(f"FAIL {s} (manifest.json): the stage failed: the process running it "
                       "(pid" in output and "a rerun resumes it" in output
                       for s in unfinished), output[-4000:]
        else:
            assert code == 1 and "no stage output found" in output, output[-2000:]
    # the kills landed where they were meant to: the first before anything was published, each
    # later one no earlier than the one before
    counts = [len(p) for _, p in history]
    assert counts[0] == 0 and counts == sorted(counts), history
    assert history[-1][1] == ["ingest", "regenerate", "tokenize", "extract"], history
    with open(log, "a") as out:
        out.write(f"=== final run ({time.monotonic() - began:.0f} s in)\n")
    final = _cli("run", "--run", str(run), cwd=tmp_path, log=log)
    assert final.wait(timeout=RUN_TIMEOUT) == 0, log.read_text()[-4000:]
    assert _published(run) == list(STAGES)
    code, output = _check(run, tmp_path, log)
    assert code == 0, output[-4000:]
    differing = differing_files(default_run_dir_later(), run)
    assert not differing, (f"{len(differing)} data files differ from the uninterrupted run "
                           f"after kills in {[s for s, _ in history]}: {differing}")
    manifest = json.loads((run / "manifest.json").read_text())
    assert {s: manifest["stages"][s]["status"] for s in STAGES} == dict.fromkeys(STAGES,
                                                                               "complete")


# ---------------------------------------------------------------- kills at exact moments (fast)
# A child process runs a stage and dies with os._exit (as under SIGKILL: no except, finally or
# atexit runs) just before its k-th rename or tree removal, for every k the run makes.

class _Fake:
    """A stage that writes a few files; `version` is its input (and so its fingerprint)."""

    executed = 0

    @staticmethod
    def make(version: int):
        from dflash_etl.core.rundir import write_json_atomic
        from dflash_etl.core.stage import Stage

        class Fake(Stage):
            name = "fake"

            def prepare(self, ctx):
                return {"version": version}

            def execute(self, ctx):
                _Fake.executed += 1
                (ctx.partial / "rows").mkdir(exist_ok=True)
                write_json_atomic(ctx.partial / "rows" / "a.json", {"v": version, "n": [1] * 50})
                (ctx.partial / "blob.bin").write_bytes(bytes([version]) * 5000)
                doc = {"total": {"rows_in": 50, "rows_out": 50, "version": version}}
                write_json_atomic(ctx.partial / "stats.json", doc)
                return doc

        return Fake()


def _events(monkeypatch, die_at: int | None) -> list[str]:
    """Count renames and tree removals; die (os._exit) just before the `die_at`-th."""
    import shutil

    seen: list[str] = []
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def event(name, real):
        def wrapper(*args, **kwargs):
            seen.append(f"{name} {args[0]}")
            if die_at is not None and len(seen) == die_at:
                os._exit(137)
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(os, "replace", event("replace", real_replace))
    monkeypatch.setattr(shutil, "rmtree", event("rmtree", real_rmtree))
    return seen


def _in_child(work: Callable[[], None]) -> int:
    """Run `work` in a forked child; its exit status (137: it died where it was told to)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            work()
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _published_whole(run: Path) -> None:
    """`fake/` is absent or exactly what its files.json lists (one version, never a mix)."""
    from dflash_etl.core.rundir import FILES_JSON, list_files

    final = run / "fake"
    if final.exists():
        listing = json.loads((final / FILES_JSON).read_text())
        assert list_files(final) == listing
        versions = {json.loads((final / "rows" / "a.json").read_text())["v"],
                    (final / "blob.bin").read_bytes()[0]}
        assert len(versions) == 1, versions


@pytest.mark.parametrize("previous", [False, True], ids=["first", "replacing"])
def test_a_kill_at_any_rename_of_a_stage_leaves_whole_outputs_and_a_rerun_finishes(
        tmp_path, monkeypatch, previous):
    from dflash_etl.core.rundir import RunDir
    from dflash_etl.runner import lifecycle as runner

    monkeypatch.setattr(runner, "_publish_docs", lambda run: None)  # not what is tested here

    def fresh(k: int | None) -> Path:
        run = tmp_path / f"run-{k}"
        if previous:  # an output of other inputs is published already
            assert _in_child(lambda: runner.run_stage(_Fake.make(1), None, run)) == 0
        return run

    def second(k: int | None, run: Path) -> None:
        _events(monkeypatch, k)
        runner.run_stage(_Fake.make(2), None, run)

    reference = fresh(None)

    def count() -> None:
        seen = _events(monkeypatch, None)
        runner.run_stage(_Fake.make(2), None, reference)
        (tmp_path / "events.json").write_text(json.dumps(seen))

    assert _in_child(count) == 0
    events = json.loads((tmp_path / "events.json").read_text())
    assert len(events) >= 5, events
    for k in range(1, len(events) + 1):
        run = fresh(k)
        assert _in_child(lambda run=run, k=k: second(k, run)) == 137, (k, events[k - 1])
        _published_whole(run)
        status = RunDir(run).manifest().get("stages", {}).get("fake", {}).get("status")
        (tmp_path / "executed").unlink(missing_ok=True)

        def rerun(run=run) -> None:
            runner.run_stage(_Fake.make(2), None, run)
            (tmp_path / "executed").write_text(str(_Fake.executed))

        _Fake.executed = 0
        assert _in_child(rerun) == 0, (k, events[k - 1])
        where = f"killed before {events[k - 1]} (event {k}), status then {status}"
        if status == "publishing":  # the work was done and verified: only published now
            assert (tmp_path / "executed").read_text() == "0", where
        run_dir = RunDir(run)
        info = run_dir.manifest()["stages"]["fake"]
        assert info["status"] == "complete" and info["error"] is None, where
        assert run_dir.changed_files("fake") == [], where
        assert sorted(p.name for p in run.iterdir()) == sorted(
            p.name for p in reference.iterdir()), where  # no .fake.partial, .fake.old
        assert differing_files(reference, run) == [], where


def test_a_dead_holder_under_dflash_etl_run_has_its_running_stage_marked(tmp_path, monkeypatch):
    """`dflash-etl run` holds the lock across its stages (the stages re-enter it): a run killed
    in a stage leaves it `running`; the next run's first stage says the holder died."""
    from dflash_etl.core.lock import run_lock
    from dflash_etl.core.rundir import RunDir
    from dflash_etl.runner import lifecycle as runner

    monkeypatch.setattr(runner, "_publish_docs", lambda run: None)
    run = tmp_path / "run"

    def killed() -> None:
        stage = _Fake.make(1)
        stage.execute = lambda ctx: os._exit(137)
        with run_lock(run, "run"):
            runner.run_stage(stage, None, run)

    assert _in_child(killed) == 137
    assert RunDir(run).manifest()["stages"]["fake"]["status"] == "running"
    assert json.loads((run / ".lock").read_text())["stage"] == "fake"  # the record names it

    class Other(type(_Fake.make(1))):
        name = "other"

    with run_lock(run, "run"):
        runner.run_stage(Other(), None, run)
    info = RunDir(run).manifest()["stages"]["fake"]
    assert info["status"] == "failed" and "died before it finished" in info["error"]
    assert (run / ".lock").read_text() == ""  # released: nobody holds it


def test_begin_drops_what_a_killed_writer_left_half_written(tmp_path):
    from dflash_etl.core.rundir import RunDir

    run = RunDir(tmp_path / "run")
    partial = run.begin("fake", "f1")
    (partial / "units").mkdir()
    (partial / "units" / "u000001.done.json").write_text("{}")
    (partial / "units" / ".u000002.rows.parquet.123.tmp").write_text("cut")
    (partial / "hidden_states").mkdir()
    (partial / "hidden_states" / "shard-00001.tmp").write_text("cut")
    (partial / ".stats.json.tmp").write_text("{")
    (partial / "checkpoints" / ".step-000200.tmp").mkdir(parents=True)
    assert run.begin("fake", "f1") == partial  # resumed, same inputs
    left = sorted(p.relative_to(partial).as_posix() for p in partial.rglob("*"))
    assert left == ["FINGERPRINT", "checkpoints", "hidden_states", "units",
                    "units/u000001.done.json"]


def test_the_regenerate_cache_drops_a_line_cut_by_a_kill(tmp_path):
    from dflash_etl.models.generation.conversations import ReplyCache as _Cache

    path = tmp_path / "generations.jsonl"
    whole = [json.dumps({"key": k, "text": f"reply {k}"}) + "\n" for k in ("a", "b")]
    path.write_text("".join(whole) + '{"key": "c", "te')  # the kill came mid-line
    cache = _Cache(path)
    assert set(cache.entries) == {"a", "b"}
    assert path.read_text() == "".join(whole)  # appending now starts on a line of its own
    cache.add([{"key": "c", "text": "reply c"}])
    assert set(_Cache(path).entries) == {"a", "b", "c"}
    assert path.read_text().count("\n") == 3


def test_train_resume_tidies_checkpoints_and_log_left_by_a_kill(tmp_path):
    from dflash_etl.models.training.checkpoints import list_checkpoints as _checkpoints
    from dflash_etl.models.training.checkpoints import log_through as _log_through
    from dflash_etl.models.training.checkpoints import tidy_checkpoints as _tidy_checkpoints

    ckpt = tmp_path / "checkpoints"
    for name in ("step-000100", "step-000200"):
        (ckpt / name).mkdir(parents=True)
        (ckpt / name / "model.safetensors").write_bytes(b"w")
        (ckpt / name / "state.json").write_text("{}")
    (ckpt / "step-000300").mkdir()  # half deleted: its state.json went first
    (ckpt / "step-000300" / "model.safetensors").write_bytes(b"w")
    (ckpt / ".step-000400.tmp").mkdir()  # killed while it was written
    (ckpt / ".step-000100.del.tmp").mkdir()  # killed while it was deleted
    _tidy_checkpoints(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000100", "step-000200"]
    assert [p.name for p in _checkpoints(ckpt)] == ["step-000100", "step-000200"]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3))
                   + '{"step": 4, "lo')
    assert [e["step"] for e in _log_through(log, 2)] == [1, 2]
    assert [e["step"] for e in _log_through(log, 10)] == [1, 2, 3]


def test_a_done_marker_whose_files_a_kill_removed_is_not_done(tmp_path):
    """cleanup deletes units/ before the publish; a kill in the middle of that must not leave
    done markers whose row files are gone (finish would then fail on every rerun)."""
    from dflash_etl.core.rundir import drop_temporaries, remove_tree
    from dflash_etl.core.stage import done_result, item_paths

    units = tmp_path / "units"
    units.mkdir()
    for index in (0, 1):
        rows, quarantine, done = item_paths(units, index)
        rows.write_bytes(b"rows")
        quarantine.write_bytes(b"q")
        done.write_text(json.dumps({"index": index}))
    item_paths(units, 1)[0].unlink()  # the rmtree got that far
    assert done_result(units, 0) == {"index": 0}
    assert done_result(units, 1) is None
    remove_tree(units)
    assert not units.exists()
    (tmp_path / ".units.del.tmp").mkdir()  # a kill in the middle of remove_tree leaves this
    drop_temporaries(tmp_path)
    assert list(tmp_path.iterdir()) == []
