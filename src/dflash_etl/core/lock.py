"""One process at a time on a run directory.

`<run>/.lock` is held with flock(2) for as long as a stage runs: the kernel releases it when the
holder dies however it dies (SIGKILL, OOM), so a stale lock is never mistaken for a live one. The
file also says who holds it (pid, host, stage), so the second process can name the holder.
Locks are re-entrant within a process: `dflash-etl run` holds it across its stages.
"""

from __future__ import annotations

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
_GUARD = threading.Lock()


class RunLocked(StageError):
    """Another process is working on this run directory."""


def _holder(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


@contextmanager
def run_lock(run_root: str | Path, stage: str) -> Iterator[dict[str, Any] | None]:
    """Hold `<run>/.lock` for the block; yields the stale holder's record it took over, if any."""
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
    if reentered:
        set_lock_stage(root, stage)  # the holder record names the stage now running
        try:
            yield None
        finally:
            with _GUARD:
                fd, depth = _HELD[key]
                _HELD[key] = (fd, depth - 1)
        return
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
    stale = _holder(path) or None  # a record left by a holder that died
    from dflash_etl.core.rundir import now

    record = {"pid": os.getpid(), "host": socket.gethostname(), "stage": stage, "since": now()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    with _GUARD:
        _HELD[key] = (fd, 1)
    try:
        yield stale
    finally:
        with _GUARD:
            _HELD.pop(key, None)
        os.ftruncate(fd, 0)  # an empty file: nobody holds it
        os.close(fd)


def set_lock_stage(run_root: str | Path, stage: str) -> None:
    """Say which stage the holder is on now (`dflash-etl run` moves through several)."""
    key = str((Path(run_root) / ".lock").resolve())
    with _GUARD:
        held = _HELD.get(key)
    if held is None:
        return
    fd = held[0]
    from dflash_etl.core.rundir import now

    record = {"pid": os.getpid(), "host": socket.gethostname(), "stage": stage, "since": now()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
