"""The lifecycle's guards (core/runner.py, lock.py, rundir.py), each tested by breaking things for
real where this machine allows it: a second process, a SIGKILL, a killed worker, a read-only or
full tmpfs, corrupt inputs, damaged outputs, a commit cut between its renames.

After every failure: one paragraph on stderr (no traceback without --debug), exit code 1, the
manifest says `failed` with that message (never `running`), and a plain rerun, the problem fixed,
gives the output of a clean run. The great_expectations gate is stood in for (see
tests/test_ingest_stage.py): it is not what these tests are about, and it costs 10-20 s a run.
"""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tomli_w

from dflash_etl.cli.main import main
from dflash_etl.core import lock as lock_module
from dflash_etl.core import rundir as rundir_module
from dflash_etl.core.lock import run_lock
from dflash_etl.stages import ingest

SRC = Path(__file__).resolve().parents[1] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC)}


@pytest.fixture(autouse=True)
def no_suite_gate(monkeypatch) -> None:
    """No great_expectations gate (nor its helper process): see the module docstring."""
    from dflash_etl.validation import suites

    monkeypatch.setattr(suites, "gate", lambda *args, **kwargs: {"passed": True})


# ---------------------------------------------------------------- helpers
def _chat(k: int, text: str = "") -> dict:
    return {"messages": [{"role": "user", "content": f"question {k}"},
                         {"role": "assistant", "content": f"answer {k} {text}"}]}


def _write_units(base: Path, units: int = 4, rows: int = 10, start: int = 0) -> None:
    for u in range(units):
        lines = [json.dumps(_chat(start + 100 * u + j)) for j in range(rows)]
        (base / f"part{u}.jsonl").write_text("\n".join(lines) + "\n")


def _setup(base: Path, units: int = 4, rows: int = 10, **run) -> str:
    """`units` source files (one work item each) and a pipeline.toml reading them."""
    base.mkdir(parents=True, exist_ok=True)
    _write_units(base, units, rows)
    config = {"run": {"workers": 1, "shard_rows": 10, **run},
              "sources": [{"name": "parts", "path": "part*.jsonl"}]}
    (base / "pipeline.toml").write_text(tomli_w.dumps(config))
    return str(base / "pipeline.toml")


def _cli(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _ingest(capsys, config: str, run: Path, *more: object) -> tuple[int, str, str]:
    return _cli(capsys, "ingest", "--config", config, "--run", run, *more)


def _error(code: int, err: str) -> str:
    """The one paragraph an error ends with (asserting there is exactly that)."""
    assert code == 1, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    assert err.rstrip().endswith(lines[0]), err  # the last word is the error's
    return lines[0].removeprefix("error: ")


def _stage(run: Path, stage: str = "ingest") -> dict:
    return json.loads((run / "manifest.json").read_text())["stages"].get(stage, {})


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _clean(capsys, config: str, base: Path) -> dict[str, bytes]:
    """The ingest output of a clean run of `config` into a fresh directory."""
    run = base / f"clean-{time.monotonic_ns()}"
    code, _, err = _ingest(capsys, config, run)
    assert code == 0, err
    return _files(run / "ingest")


def _assert_usable(run: Path, expected: dict[str, bytes]) -> None:
    """A rerun finished: the output of a clean run, nothing half-made left beside it."""
    assert _files(run / "ingest") == expected
    assert _stage(run)["status"] == "complete" and _stage(run)["error"] is None
    assert not (run / ".ingest.partial").exists() and not (run / ".ingest.old").exists()


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)


def _wait_for(lines: queue.Queue, proc: subprocess.Popen, prefix: str, count: int = 1,
              timeout: float = 120.0) -> list[str]:
    """The first `count` stdout lines of `proc` starting with `prefix`."""
    found: list[str] = []
    deadline = time.monotonic() + timeout
    while len(found) < count:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            pytest.fail(f"no {prefix!r} line from the process in {timeout} s: {found}")
        if line.startswith(prefix):
            found.append(line.strip())
    return found


def _start(code: str, *args: object) -> tuple[subprocess.Popen, queue.Queue]:
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=ENV,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    return proc, lines


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie is dead, only not reaped (no init in a container)


# ---------------------------------------------------------------- 1. one process per run
HOLD = """
import sys
from dflash_etl.core.lock import run_lock
with run_lock(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes stdin
"""


def test_second_process_is_refused_at_once_naming_the_holder(tmp_path, capsys):
    config = _setup(tmp_path)
    run = tmp_path / "run"
    assert _ingest(capsys, config, run)[0] == 0
    before, manifest = _files(run / "ingest"), (run / "manifest.json").read_bytes()
    holder, lines = _start(HOLD, run, "tokenize")
    try:
        _wait_for(lines, holder, "held")
        started = time.monotonic()
        code, _, err = _ingest(capsys, config, run, "--force")
        waited = time.monotonic() - started
        message = _error(code, err)
        assert waited < 1.0, f"waited {waited:.2f} s for the lock instead of refusing"
        assert f"pid {holder.pid} on {socket.gethostname()}, stage tokenize" in message
        assert str(run) in message and "in use by another dflash-etl process" in message
        # `dflash-etl run` takes the same lock before its first stage
        message = _error(*_cli(capsys, "run", "--config", config, "--run", run)[::2])
        assert f"pid {holder.pid}" in message
        assert _files(run / "ingest") == before  # the holder's outputs are untouched
        assert (run / "manifest.json").read_bytes() == manifest
        assert not (run / ".ingest.partial").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert holder.returncode == 0
    assert ingest.run(ingest_config(config), run).get("skipped") is True  # free again


def ingest_config(path: str):
    from dflash_etl.stages import load_config

    return load_config(path)


# The process that dies: `dflash-etl <command>` whose work items after the first stall, so it
# is killed mid-stage with one item done and two in its (two) workers.
DYING = """
import os, sys, time
from dflash_etl.stages import ingest
from dflash_etl.validation import suites

real = ingest.IngestStage.process_batch

def stall(stage, batch, item):
    if item.index == 0:
        return real(stage, batch, item)
    print(f"working {item.index} {os.getpid()}", flush=True)
    time.sleep(600)

ingest.IngestStage.process_batch = stall
suites.gate = lambda *args, **kwargs: {"passed": True}
from dflash_etl.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["ingest", "run"])
def test_a_killed_holder_is_taken_over_and_its_stage_marked_failed(tmp_path, capsys,
                                                                   monkeypatch, command):
    config = _setup(tmp_path, units=4)
    run = tmp_path / "run"
    proc, lines = _start(DYING, command, "--config", config, "--run", run, "--workers", "2")
    workers: list[int] = []
    try:
        working = _wait_for(lines, proc, "working", count=2)
        workers = [int(line.split()[2]) for line in working]
        assert _stage(run)["status"] == "running"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        # its workers die with it: they would otherwise hold the lock (and write into the
        # partial directory) for as long as they live
        deadline = time.monotonic() + 10
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, workers)), "the killed process's workers outlived it"
        assert _stage(run)["status"] == "running"  # what SIGKILL leaves

        seen: dict = {}
        processed: list[int] = []
        real_prepare, real_batch = ingest.IngestStage.prepare, ingest.IngestStage.process_batch

        def spy_prepare(self, ctx):  # the manifest as the new holder found it
            seen.update(ctx.run.manifest()["stages"]["ingest"])
            return real_prepare(self, ctx)

        def spy_batch(stage, batch, item):
            processed.append(item.index)
            return real_batch(stage, batch, item)

        with monkeypatch.context() as patch:
            patch.setattr(ingest.IngestStage, "prepare", spy_prepare)
            patch.setattr(ingest.IngestStage, "process_batch", spy_batch)
            started = time.monotonic()
            code, _, err = _cli(capsys, command, "--config", config, "--run", run,
                                "--workers", "1")
        assert code == 0, err
        assert time.monotonic() - started < 60
    finally:
        for pid in workers:  # only if the guard failed
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert seen["status"] == "failed", seen
    assert f"pid {proc.pid} on {socket.gethostname()}" in seen["error"]
    assert "died before it finished" in seen["error"]
    assert "died before it finished" in err  # ... and the user is told
    assert processed == [1, 2, 3]  # item 0, finished before the kill, was kept
    _assert_usable(run, _clean(capsys, config, tmp_path))


TAKE = """
import sys
from dflash_etl.core.lock import run_lock
with run_lock(sys.argv[1], "ingest"):
    print("took")
"""


def test_a_forked_worker_does_not_keep_the_run_locked(tmp_path):
    run = tmp_path / "run"
    with run_lock(run, "ingest"):
        child = mp.get_context("fork").Process(target=time.sleep, args=(60,))
        child.start()
    try:
        result = subprocess.run([sys.executable, "-c", TAKE, str(run)], env=ENV,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == "took"
    finally:
        child.kill()
        child.join()


def test_a_release_that_cannot_clear_the_record_still_frees_the_lock(tmp_path, monkeypatch):
    """The disk went read-only under the stage: the lock is let go all the same, so this
    process (a test session, `dflash-etl run`) can take it again."""
    run = tmp_path / "run"

    def read_only(fd, length):
        raise OSError(errno.EROFS, "Read-only file system")

    with monkeypatch.context() as patch, run_lock(run, "ingest"):
        patch.setattr(lock_module.os, "ftruncate", read_only)  # the release meets EROFS
    with run_lock(run, "tokenize") as stale:
        assert stale is not None and stale["stage"] == "ingest"  # the record it could not clear


def test_the_lock_keeps_room_to_record_a_failure(tmp_path):
    run = tmp_path / "run"
    with run_lock(run, "ingest"):
        size = (run / ".lock").stat().st_size
        assert size >= 16 * 1024  # the reserve a full disk gives back for the manifest
        assert json.loads((run / ".lock").read_text())["stage"] == "ingest"
        lock_module.free_reserve(run)
        assert (run / ".lock").stat().st_size < 1024
        assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    assert (run / ".lock").stat().st_size == 0  # released: nobody holds it


# ---------------------------------------------------------------- 2. errors: one paragraph
def test_a_worker_killed_by_the_os(tmp_path, capsys, monkeypatch):
    config = _setup(tmp_path, units=4)
    run = tmp_path / "run"
    parent = os.getpid()
    real = ingest.IngestStage.process_batch

    def oom_killed(stage, batch, item):
        if item.index == 2 and os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(stage, batch, item)

    with monkeypatch.context() as patch:
        patch.setattr(ingest.IngestStage, "process_batch", oom_killed)
        message = _error(*_ingest(capsys, config, run, "--workers", "2")[::2])
    assert "a worker process died" in message and "--workers" in message
    assert _stage(run) == {**_stage(run), "status": "failed", "error": message}
    code, _, err = _ingest(capsys, config, run, "--workers", "2")
    assert code == 0, err
    _assert_usable(run, _clean(capsys, config, tmp_path))


@pytest.fixture
def tmpfs():
    """mount(path, options): a tmpfs there (the test skips where this machine cannot mount);
    unmounted at the end."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a real read-only or full disk needs root and mount(8) (tmpfs)")
    mounted: list[Path] = []

    def mount(path: Path, options: str = "size=64m") -> Path:
        path.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                capture_output=True, text=True)
        if result.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _remount(path: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], check=True)


def test_a_read_only_run_directory(tmp_path, capsys, tmpfs):
    config = _setup(tmp_path)
    mnt = tmpfs(tmp_path / "mnt")
    run = mnt / "run"
    assert _ingest(capsys, config, run)[0] == 0
    before, manifest = _files(run / "ingest"), (run / "manifest.json").read_bytes()
    _remount(mnt, "ro")
    message = _error(*_ingest(capsys, config, run, "--force")[::2])
    assert "Read-only file system" in message and str(run) in message
    assert "make the run directory writable" in message
    # nothing could be written: the manifest still says what it said (complete, not running)
    assert (run / "manifest.json").read_bytes() == manifest
    assert _files(run / "ingest") == before
    _remount(mnt, "rw")
    code, _, err = _ingest(capsys, config, run, "--force")
    assert code == 0, err
    _assert_usable(run, _clean(capsys, config, tmp_path))


def test_a_directory_going_read_only_mid_stage(tmp_path, capsys, monkeypatch, tmpfs):
    config = _setup(tmp_path)
    run = tmp_path / "run"
    units = run / ".ingest.partial" / "units"
    real = ingest.IngestStage.process_batch

    def goes_read_only(stage, batch, item):
        if item.index == 1:
            tmpfs(units, "ro")  # from here on, the stage's writes there fail with EROFS
        return real(stage, batch, item)

    with monkeypatch.context() as patch:
        patch.setattr(ingest.IngestStage, "process_batch", goes_read_only)
        message = _error(*_ingest(capsys, config, run)[::2])
    assert "Read-only file system" in message
    assert _stage(run)["status"] == "failed" and _stage(run)["error"] == message
    _umount(units)
    code, _, err = _ingest(capsys, config, run)
    assert code == 0, err
    _assert_usable(run, _clean(capsys, config, tmp_path))


def _big_source(base: Path) -> str:
    """~2.5 MB of incompressible conversations."""
    base.mkdir(parents=True, exist_ok=True)
    rows = [json.dumps(_chat(k, os.urandom(400).hex())) for k in range(3000)]
    (base / "part0.jsonl").write_text("\n".join(rows) + "\n")
    config = {"run": {"workers": 1},
              "sources": [{"name": "parts", "path": "part*.jsonl"}]}
    (base / "pipeline.toml").write_text(tomli_w.dumps(config))
    return str(base / "pipeline.toml")


def test_a_disk_too_small_for_the_output(tmp_path, capsys, tmpfs):
    config = _big_source(tmp_path)
    mnt = tmpfs(tmp_path / "mnt", "size=1m")
    run = mnt / "run"
    message = _error(*_ingest(capsys, config, run)[::2])
    assert "the disk is full" in message and "free space and rerun" in message
    assert _stage(run)["status"] == "failed" and _stage(run)["error"] == message
    _remount(mnt, "size=64m")
    code, _, err = _ingest(capsys, config, run)
    assert code == 0, err
    _assert_usable(run, _clean(capsys, config, tmp_path))


def _fill(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_disk_filled_by_someone_else_mid_stage(tmp_path, capsys, monkeypatch, tmpfs):
    """Not one byte left when the stage fails: the failure still reaches the manifest."""
    config = _setup(tmp_path)
    mnt = tmpfs(tmp_path / "mnt", "size=4m")
    run = mnt / "run"
    real = ingest.IngestStage.process_batch

    def disk_fills(stage, batch, item):
        if item.index == 1:
            _fill(mnt / "filler")
        return real(stage, batch, item)

    with monkeypatch.context() as patch:
        patch.setattr(ingest.IngestStage, "process_batch", disk_fills)
        message = _error(*_ingest(capsys, config, run)[::2])
    assert "the disk is full" in message
    assert _stage(run)["status"] == "failed" and _stage(run)["error"] == message
    (mnt / "filler").unlink()
    code, _, err = _ingest(capsys, config, run)
    assert code == 0, err
    _assert_usable(run, _clean(capsys, config, tmp_path))


def test_a_config_that_is_not_utf8(tmp_path, capsys):
    config = _setup(tmp_path)
    run = tmp_path / "run"
    assert _ingest(capsys, config, run)[0] == 0
    before = _files(run)
    good = Path(config).read_bytes()
    Path(config).write_bytes(b"# caf\xe9\n" + good)
    message = _error(*_ingest(capsys, config, run)[::2])
    assert message.startswith(f"{config}: not UTF-8") and "line 1" in message
    assert _files(run) == before  # refused before the run directory is touched
    Path(config).write_bytes(good)
    code, out, err = _ingest(capsys, config, run)
    assert code == 0 and "already complete, skipped" in out, err
    _assert_usable(run, _clean(capsys, config, tmp_path))


def test_a_corrupt_parquet_source(tmp_path, capsys):
    config = _setup(tmp_path, units=2)
    table = pa.Table.from_pylist([_chat(1000 + k) for k in range(20)])
    source = tmp_path / "part9.parquet"
    pq.write_table(table, source)
    good = source.read_bytes()
    text = Path(config).read_text().replace('"part*.jsonl"', '"part*"')
    Path(config).write_text(text)
    run = tmp_path / "run"
    source.write_bytes(good[: len(good) // 2])  # cut short, as by an interrupted download
    # the file is one quarantined row with the reader's message; the other files go on
    code, _, err = _ingest(capsys, config, run, "--workers", "2")
    assert code == 0 and "Traceback" not in err, err
    stats = json.loads((run / "ingest" / "stats.json").read_text())
    assert stats["total"]["quarantine_reasons"] == {"unreadable_file": 1}
    (row,) = pq.read_table(run / "ingest" / "quarantine.parquet").to_pylist()
    assert row["file"] == str(source) and "cannot read it as Parquet" in row["message"]
    source.write_bytes(good)
    code, _, err = _ingest(capsys, config, run, "--workers", "2")
    assert code == 0, err
    _assert_usable(run, _clean(capsys, config, tmp_path))


# ---------------------------------------------------------------- 3. skip only when intact
def _delete(path: Path) -> None:
    path.unlink()


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


@pytest.mark.parametrize(("damage", "said"), [
    (_delete, "conversations/part-00001.parquet: missing"),
    (_flip_a_byte, "conversations/part-00001.parquet: content changed"),
    (_truncate, "conversations/part-00001.parquet: 100 bytes, published"),
])
def test_a_damaged_output_is_redone_not_skipped(tmp_path, capsys, damage, said):
    config = _setup(tmp_path)
    run = tmp_path / "run"
    assert _ingest(capsys, config, run)[0] == 0
    before = _files(run / "ingest")
    code, out, _ = _ingest(capsys, config, run)  # untouched: skipped
    assert code == 0 and "already complete, skipped" in out
    assert ingest.run(ingest_config(config), run).get("skipped") is True
    damage(run / "ingest" / "conversations" / "part-00001.parquet")
    code, out, err = _ingest(capsys, config, run)
    assert code == 0, err
    assert "ingest: the published output changed since it was made" in err
    assert said in err and "redoing the stage" in err
    assert "ingest done" in out and "skipped" not in out
    _assert_usable(run, before)
    code, out, _ = _ingest(capsys, config, run)
    assert code == 0 and "already complete, skipped" in out


def test_an_edited_file_listing_is_redone(tmp_path, capsys):
    config = _setup(tmp_path)
    run = tmp_path / "run"
    assert _ingest(capsys, config, run)[0] == 0
    before = _files(run / "ingest")
    listing = run / "ingest" / "files.json"
    listing.write_text(listing.read_text().replace('"size": ', '"size":  '))
    code, _, err = _ingest(capsys, config, run)
    assert code == 0 and "files.json was edited" in err
    _assert_usable(run, before)


# ---------------------------------------------------------------- 4. never half published
@pytest.mark.parametrize("failing", ["old moved away", "new moved in", "manifest written"])
def test_a_commit_cut_short_leaves_a_whole_output(tmp_path, capsys, monkeypatch, failing):
    config = _setup(tmp_path)
    run = tmp_path / "run"
    assert _ingest(capsys, config, run)[0] == 0
    old = _files(run / "ingest")
    _write_units(tmp_path, start=5000)  # new inputs: the stage is redone into a new output
    new = _clean(capsys, config, tmp_path)
    assert new != old
    final, partial, moved = run / "ingest", run / ".ingest.partial", run / ".ingest.old"
    real_replace, real_commit = os.replace, rundir_module.RunDir.commit
    in_commit: list[bool] = []

    def replace(src, dst):
        src, dst = Path(src), Path(dst)
        target = {"old moved away": (src == final and dst == moved),
                  "new moved in": (src == partial and dst == final),
                  "manifest written": dst == run / "manifest.json"}[failing]
        if in_commit and target:
            in_commit.clear()  # once
            raise OSError(errno.EIO, "Input/output error", str(dst))
        return real_replace(src, dst)

    def commit(self, *args, **kwargs):
        in_commit.append(True)
        return real_commit(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(rundir_module.os, "replace", replace)
        patch.setattr(rundir_module.RunDir, "commit", commit)
        message = _error(*_ingest(capsys, config, run)[::2])
    assert "Input/output error" in message
    assert _files(final) in (old, new), sorted(_files(final))  # a whole output, old or new
    assert _stage(run)["status"] == "failed" and _stage(run)["error"] == message
    code, _, err = _ingest(capsys, config, run)
    assert code == 0, err
    _assert_usable(run, new)


def test_a_process_killed_between_the_renames_is_recovered(tmp_path, capsys):
    """`<stage>/` already renamed away, the new output not yet in: the next run puts the old one
    back before anything else, and finds it intact."""
    config = _setup(tmp_path)
    run = tmp_path / "run"
    assert _ingest(capsys, config, run)[0] == 0
    before = _files(run / "ingest")
    os.replace(run / "ingest", run / ".ingest.old")
    code, out, err = _ingest(capsys, config, run)
    assert code == 0 and "already complete, skipped" in out, err
    _assert_usable(run, before)


def test_a_killed_rerun_of_a_complete_stage_leaves_it_complete(tmp_path):
    """A forced rerun SIGKILLed mid-way left the stage `running` over its complete output; the
    next holder of the lock marked it `failed`, and every later stage refused the run. Now the
    entry from before (kept under `published` while the rerun runs) comes back, complete."""
    from dflash_etl.core.rundir import RunDir
    from dflash_etl.runner import lifecycle as runner

    run = RunDir(tmp_path / "run")
    partial = run.begin("fake", "f1")
    (partial / "rows.txt").write_text("one")
    run.commit("fake", {"rows_out": 1}, 0.1)
    complete = run.manifest()["stages"]["fake"]
    assert "published" not in complete
    run.begin("fake", "f2")  # the rerun, killed before it published
    assert run.manifest()["stages"]["fake"]["published"]["fingerprint"] == "f1"
    runner.mark_interrupted(run, {"pid": 123, "host": "h"})
    entry = run.manifest()["stages"]["fake"]
    assert {k: v for k, v in entry.items() if k != "last_attempt"} == complete
    assert "pid 123" in entry["last_attempt"]["error"]
    assert (run.stage_dir("fake") / "rows.txt").read_text() == "one"
    partial = run.begin("fake", "f2")  # resumes the killed rerun; its publish clears the record
    (partial / "rows.txt").write_text("two")
    run.commit("fake", {"rows_out": 1}, 0.1)
    entry = run.manifest()["stages"]["fake"]
    assert entry["fingerprint"] == "f2" and not {"published", "last_attempt"} & set(entry)
    never = RunDir(tmp_path / "other")  # a stage that never completed is marked failed
    never.begin("fake", "f1")
    runner.mark_interrupted(never, {"pid": 1, "host": "h"})
    assert never.manifest()["stages"]["fake"]["status"] == "failed"


def test_a_killed_forced_rerun_is_settled_by_the_next_check(tmp_path, capsys):
    """`ingest --force` SIGKILLed mid-stage left ingest `running` over its complete output, and
    `check` failed ("left running by a process that died") until the next stage command. Now
    check settles it as a stage would: the earlier output complete, the dead pid named; while
    the holder lives, check says it is running and changes nothing."""
    config = _setup(tmp_path, units=4)
    run = tmp_path / "run"
    assert _ingest(capsys, config, run)[0] == 0
    complete = _stage(run)
    proc, lines = _start(DYING, "ingest", "--config", config, "--run", run, "--workers", "1",
                         "--force")
    try:
        _wait_for(lines, proc, "working")
        code, out, _ = _cli(capsys, "check", run)
        assert code == 1 and f"running now (pid {proc.pid} on" in out
        assert _stage(run)["status"] == "running"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _stage(run)["status"] == "running"  # what SIGKILL leaves
    code, out, err = _cli(capsys, "check", run)
    assert code == 0, out + err
    assert f"ingest: the process running it (pid {proc.pid} on" in err
    entry = _stage(run)
    assert {k: v for k, v in entry.items() if k != "last_attempt"} == complete
    assert _cli(capsys, "check", run)[2] == ""  # settled once: the next read says nothing


def test_a_stage_never_replaces_a_folder_it_did_not_publish(tmp_path, monkeypatch):
    """`mkdir -p D/ingest && echo mine > D/ingest/x; dflash-etl ingest --run D` deleted the
    user's folder (rc 0). Now the stage refuses before any work and leaves it, and a stage
    folder that is a symlink to another disk is refused rather than replaced by a folder."""
    from dflash_etl.stages import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}) + "\n")
    (tmp_path / "pipeline.toml").write_text('[[sources]]\nname = "a"\npath = "rows.jsonl"\n')
    run = tmp_path / "D"
    (run / "ingest").mkdir(parents=True)
    (run / "ingest" / "x").write_text("mine")
    assert main(["ingest", "--config", "pipeline.toml", "--run", str(run)]) == 1
    assert (run / "ingest" / "x").read_text() == "mine"
    assert not (run / ".ingest.partial").exists()
    shutil.rmtree(run / "ingest")
    elsewhere = tmp_path / "other-disk"
    elsewhere.mkdir()
    (run / "ingest").symlink_to(elsewhere)
    with pytest.raises(Exception, match="is a symlink"):
        ingest.run(load_config(tmp_path / "pipeline.toml"), run, workers=1, progress=False)
    assert (run / "ingest").is_symlink()
    (run / "ingest").unlink()
    doc = ingest.run(load_config(tmp_path / "pipeline.toml"), run, workers=1, progress=False)
    assert doc["total"]["rows_out"] == 1
    again = ingest.run(load_config(tmp_path / "pipeline.toml"), run, workers=1, progress=False,
                       force=True)  # its own output: replaced as before
    assert again["total"]["rows_out"] == 1


def test_sigterm_is_handled_as_ctrl_c_is(tmp_path, capsys):
    """`timeout`, Kubernetes, Slurm and `docker stop` send SIGTERM, to this process alone. It
    exited 143 with no word and left the stage `running`. Now: the workers stalled mid-item are
    not waited for, the stage is `failed: terminated`, the lock is released, exit 143 with a
    message, and a rerun resumes from the finished item."""
    config = _setup(tmp_path, units=4)
    run = tmp_path / "run"
    proc, lines = _start(DYING, "ingest", "--config", config, "--run", run, "--workers", "2")
    workers: list[int] = []
    try:
        working = _wait_for(lines, proc, "working", count=2)
        workers = [int(line.split()[2]) for line in working]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        said = []
        while not lines.empty():
            said.append(lines.get())
        deadline = time.monotonic() + 10
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, workers))
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 143, "".join(said)
    assert any(line.startswith("terminated (SIGTERM)") for line in said), said
    stage = _stage(run)
    assert stage["status"] == "failed" and stage["error"].startswith("terminated (SIGTERM)")
    assert (run / ".lock").read_text() == ""  # released
    code, _, err = _cli(capsys, "ingest", "--config", config, "--run", run, "--workers", "1")
    assert code == 0, err
    _assert_usable(run, _clean(capsys, config, tmp_path))


def test_check_says_a_stage_is_running_and_whether_its_process_lives(tmp_path, capsys):
    """`check` said "all checks passed" over a run whose stage was `running` (a live process on
    it, or one SIGTERMed or killed): now it fails, saying which."""
    from dflash_etl.core.rundir import RunDir
    from dflash_etl.validation.check import check_path

    config = _setup(tmp_path, units=2)
    run = tmp_path / "run"
    code, _, err = _cli(capsys, "ingest", "--config", config, "--run", run)
    assert code == 0, err
    assert check_path(run, suites=False)["passed"]
    RunDir(run).update_stage("regenerate", status="running")  # as a killed process left it
    report = check_path(run, suites=False)
    assert not report["passed"]
    assert "FAIL regenerate (manifest.json): the stage is not finished: left running by a " \
        "process that died" in report["summary"]
    proc, lines = _start(HOLD, run, "regenerate")
    try:
        _wait_for(lines, proc, "held")
        report = check_path(run, suites=False)
        assert f"running now (pid {proc.pid} on" in report["summary"]
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_a_corrupt_manifest_is_named_with_what_to_do(tmp_path, capsys):
    config = _setup(tmp_path, units=1)
    run = tmp_path / "run"
    code, _, err = _cli(capsys, "ingest", "--config", config, "--run", run)
    assert code == 0, err
    (run / "manifest.json").write_text('{"stages": {"ingest": ')  # cut by a full disk
    for argv in (["ingest", "--config", config, "--run", run], ["docs", "--run", run]):
        code, _, err = _cli(capsys, *argv)
        message = _error(code, err)
        assert str(run / "manifest.json") in message and "not valid JSON" in message
        assert "internal error" not in message


def test_a_rerun_that_makes_the_same_data_leaves_the_stages_built_on_it_current(tmp_path):
    """`tokenize --force` with byte-identical data marked extract and train stale for good
    (reliability issue, item 5): the output identity hashed files.json, which hashes
    validation.json, whose great_expectations run record differs every validation. The
    identity is the data's: the same data is current, other data is stale."""
    from dflash_etl.core.rundir import RunDir, output_identity

    run = RunDir(tmp_path / "run")

    def publish(stage: str, data: bytes, record: str, built_on: dict) -> None:
        partial = run.begin(stage, f"fingerprint-{stage}")
        (partial / "rows.bin").write_bytes(data)
        (partial / "validation.json").write_text(json.dumps({"run_id": record}))
        run.commit(stage, {"rows_in": 1, "rows_out": 1}, 0.1, built_on=built_on)

    publish("tokenize", b"rows", "first validation", {})
    publish("extract", b"states", "x", {"tokenize": output_identity(
        run.record("tokenize").entry)})
    publish("tokenize", b"rows", "second validation", {})  # forced: the same data
    assert run.stale() == {}
    publish("tokenize", b"other rows", "third validation", {})
    assert "extract" in run.stale()


def test_a_full_disk_in_a_librarys_own_words_is_said_as_a_full_disk():
    """extract's shard write (safetensors, in Rust) and the export's (torch's zip writer) said
    a full disk as an internal error (reliability issue, item 12)."""
    from dflash_etl.core.errors import describe_error

    rust = RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                        'message: "No space left on device" })')
    torch_zip = RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter "
                             "failed writing file data/0: file write failed ... unexpected pos")
    for exc in (rust, torch_zip):
        message = str(describe_error(exc, "extract"))
        assert "the disk is full" in message and "free space and rerun" in message
        assert "internal error" not in message
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise ValueError("while saving") from inner
    except ValueError as wrapped:
        assert "the disk is full" in str(describe_error(wrapped, "export"))
    assert "internal error" in str(describe_error(RuntimeError("another bug"), "extract"))
