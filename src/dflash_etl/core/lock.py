"""One process at a time on a run directory.

`<run>/.lock` is held with flock(2) for as long as a stage runs: the kernel releases it when the
holder dies however it dies (SIGKILL, OOM), so a stale lock is never mistaken for a live one. The
file also says who holds it (pid, host, stage), so the second process can name the holder.
Locks are re-entrant within a process: `dflash-etl run` holds it across its stages, and its first
stage is told about a holder that died before (the outer taker found its record). Forked
children (the local executor's workers) close their copy of the descriptor, so they never keep
the lock after the holder died. The record is padded to RESERVE_BYTES: on a full disk the
holder gives that space back (`free_reserve`) so the failure can still be written to the
manifest.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError

_HELD: dict[str, tuple[int, int]] = {}  # resolved path -> (fd, depth)
_STALE: dict[str, dict[str, Any]] = {}  # resolved path -> the dead holder's record taken over
_GUARD = threading.Lock()
RESERVE_BYTES = 64 * 1024


def _forget_in_child() -> None:
    """A forked child closes its copies of the held descriptors: the parent's lock stays (flock
    belongs to the open file, released once every descriptor of it is closed), and a worker
    that outlives a killed parent does not keep the run locked."""
    global _GUARD
    for fd, _ in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()
    _STALE.clear()
    _GUARD = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_forget_in_child)


class RunLocked(StageError):
    """Another process is working on this run directory."""


def _holder(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


@contextmanager
def run_lock(run_root: str | Path, stage: str) -> Iterator[dict[str, Any] | None]:
    """Hold `<run>/.lock` for the block; yields the stale holder's record it took over, if any
    (to the outermost holder in this process, and once more to the first re-entry)."""
    root = Path(run_root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / ".lock"
    key = str(path.resolve())
    with _GUARD:
        if key in _HELD:
            fd, depth = _HELD[key]
            _HELD[key] = (fd, depth + 1)
            reentered = True
        else:
            reentered = False
    if reentered:  # the first stage inside `dflash-etl run` is told about a dead holder
        with _GUARD:
            stale = _STALE.pop(key, None)
        try:
            yield stale
        finally:
            with _GUARD:
                fd, depth = _HELD[key]
                _HELD[key] = (fd, depth - 1)
        return
    fd = _take(path, root)
    stale = _holder(path) or None  # a record left by a holder that died
    _write_record(fd, stage)
    with _GUARD:
        _HELD[key] = (fd, 1)
        if stale:
            _STALE[key] = stale
    try:
        yield stale
    finally:
        with _GUARD:
            _HELD.pop(key, None)
            _STALE.pop(key, None)
        try:
            os.ftruncate(fd, 0)  # an empty file: nobody holds it
        except OSError:  # a disk gone read-only: the record stays (and reads as stale)
            pass
        finally:
            os.close(fd)  # the lock is let go however the record fared


def live_holder(run_root: str | Path) -> dict[str, Any] | None:
    """The record of the process holding the run's lock now (pid, host, stage), or None when
    no live process holds it (a record a dead holder left is stale: None)."""
    path = Path(run_root) / ".lock"
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(path) or {"pid": "?", "host": "?", "stage": "?"}
    finally:
        os.close(fd)  # closing lets a lock this call took go
    return None


def _take(path: Path, root: Path) -> int:
    """The lock file's descriptor, locked; another live holder is a RunLocked naming it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        who = _holder(path)
        raise RunLocked(
            f"{root} is in use by another dflash-etl process (pid {who.get('pid', '?')} on "
            f"{who.get('host', '?')}, stage {who.get('stage', '?')}, since "
            f"{who.get('since', '?')}): wait for it to finish, or stop it; two processes on one "
            "run directory would mix their outputs"
        ) from None
    return fd


def _write_record(fd: int, stage: str) -> None:
    """Who holds the lock, padded with whitespace (still JSON) to RESERVE_BYTES; written in
    place, so an update needs no new space. On a disk too full for the padding, the record
    alone; too full for that, none (the refusal then names no holder). Never empty meanwhile:
    empty means nobody holds it, so a kill there would hide a dead holder from the next one."""
    from dflash_etl.core.rundir import now

    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "stage": stage,
                         "since": now()}).encode()
    try:
        os.pwrite(fd, record.ljust(RESERVE_BYTES), 0)
    except OSError:
        with contextlib.suppress(OSError):
            os.pwrite(fd, record, 0)
            os.ftruncate(fd, len(record))


def free_reserve(run_root: str | Path) -> None:
    """Give the lock file's padding back to a full disk (the record stays): room to write the
    manifest saying the stage failed. Only in the process holding the lock."""
    key = str((Path(run_root) / ".lock").resolve())
    with _GUARD:
        held = _HELD.get(key)
    if held is None:
        return
    fd = held[0]
    with contextlib.suppress(OSError):
        os.ftruncate(fd, len(os.pread(fd, RESERVE_BYTES, 0).rstrip()))


def set_lock_stage(run_root: str | Path, stage: str) -> None:
    """Say which stage the holder is on now (`dflash-etl run` moves through several)."""
    key = str((Path(run_root) / ".lock").resolve())
    with _GUARD:
        held = _HELD.get(key)
    if held is None:
        return
    _write_record(held[0], stage)
