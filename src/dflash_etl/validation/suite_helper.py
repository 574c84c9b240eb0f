"""The gates in a helper process that stays: great_expectations and pandera imported once, not
once per stage process.

Importing great_expectations costs ~4 s of CPU on a 2-core machine here (minutes on slower ones),
pandera with pandas under it ~1 s more: a fifth of a 20k-conversation tokenize's CPU. So the first
gated stage starts a helper process that imports them on the idle core while the stage loads, and
the helper stays for later stages and later commands (`dflash-etl ingest`, then `tokenize` …): it
listens on a Unix socket in a private per-user folder, named by a key of this interpreter and this
package's code (a changed checkout gets a fresh helper), and exits after
`DFLASH_ETL_SUITE_HELPER_IDLE_S` seconds (default 600) without a request. It runs the suites and
the pandera contracts on a stage's (partial) output folder, one request at a time.

Anything wrong with the helper (it could not start, it died, it answered nonsense or not within
`DFLASH_ETL_SUITE_HELPER_TIMEOUT_S`) makes the gate validate in the stage's own process, which
raises its own errors with context. `DFLASH_ETL_SUITE_HELPER=0` keeps the gates in-process;
`DFLASH_ETL_SUITE_HELPER_DIR` moves the socket folder (the test suite keeps its own);
`python -m dflash_etl.validation.suite_helper --status | --stop` shows or ends the helper. Its log:
`helper-KEY.log` in that folder.

Only the standard library here: the CLI starts the helper before it imports anything heavy.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parents[1]
START_DEADLINE_S = 10.0  # a new helper binds its socket before its heavy imports
_CONNECTION: list[socket.socket] = []  # this process's connection to the helper, when open
_READER: list[Any] = []  # its line reader
_WARNED: list[Path] = []  # a helper folder found unsafe, said once


def enabled() -> bool:
    return os.environ.get("DFLASH_ETL_SUITE_HELPER", "1") != "0"


def idle_seconds() -> float:
    return _seconds("DFLASH_ETL_SUITE_HELPER_IDLE_S", 600.0)


def reply_deadline() -> float:
    """How long a gate waits for the helper's answer before validating in-process."""
    return _seconds("DFLASH_ETL_SUITE_HELPER_TIMEOUT_S", 1800.0)


def _seconds(name: str, default: float) -> float:
    try:
        return max(0.1, float(os.environ.get(name, default)))
    except ValueError:
        return default


def helper_dir() -> Path | None:
    """The private folder of this user's helpers (created 0700), or None when it is not safe
    to use: another user's, or open to others."""
    base = os.environ.get("DFLASH_ETL_SUITE_HELPER_DIR") or str(
        Path(tempfile.gettempdir()) / f"dflash-etl-{os.getuid()}")
    path = Path(base)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError:
        return None
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        if not _WARNED:
            _WARNED.append(path)
            print(f"note: the gates run in this process, not in the gate helper: {path} is "
                  "open to other users or not yours (set DFLASH_ETL_SUITE_HELPER_DIR to a "
                  "private folder)", file=sys.stderr)
        return None
    return path


def code_key() -> str:
    """This interpreter and the package's code, contracts and suites as they are on disk: a
    helper serves only the processes that would validate exactly as it does."""
    digest = hashlib.sha256(f"{sys.executable}\0{PACKAGE_DIR}\0".encode())
    from dflash_etl.core.config import project_path  # standard library only, like this module

    for folder in (PACKAGE_DIR, project_path("contracts"), project_path("expectations")):
        for path in sorted(folder.rglob("*")):
            if path.suffix in (".py", ".toml", ".json") and "__pycache__" not in path.parts:
                info = path.stat()
                digest.update(f"{path}\0{info.st_mtime_ns}\0{info.st_size}\0".encode())
    return digest.hexdigest()[:16]


def paths(key: str | None = None) -> dict[str, Path] | None:
    folder = helper_dir()
    if folder is None:
        return None
    key = key or code_key()
    found = {name: folder / f"helper-{key}.{name}" for name in ("sock", "lock", "log")}
    if len(os.fsencode(found["sock"])) > 100:  # a Unix socket's path holds 104-108 bytes
        return None
    return found


def start() -> None:
    """Connect this process to the helper, starting one if none runs (it then imports on the
    idle core while the stage loads). Does nothing when switched off or already connected."""
    if not enabled() or running():
        return
    with contextlib.suppress(OSError):
        _connect_or_launch()


def _connect_or_launch() -> None:
    where = paths()
    if where is None:
        return
    with _locked(where["lock"]):
        connection = _connect(where["sock"])
        if connection is None:
            helper = _launch(where)
            deadline = time.monotonic() + START_DEADLINE_S
            while connection is None and time.monotonic() < deadline and helper.poll() is None:
                time.sleep(0.02)
                connection = _connect(where["sock"])
    if connection is not None:
        _CONNECTION[:] = [connection]
        _READER[:] = [connection.makefile("r", encoding="utf-8")]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process at a time finds or starts the helper (two would start two)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _connect(path: Path) -> socket.socket | None:
    if not path.exists():
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(5.0)
        connection.connect(str(path))
    except OSError:
        connection.close()
        return None
    connection.settimeout(reply_deadline())
    return connection


def _launch(where: dict[str, Path]) -> subprocess.Popen[bytes]:
    """A helper of its own session (it outlives this process, and a Ctrl-C here does not reach
    it), its output to its log, no descriptor of this process kept open."""
    with contextlib.suppress(FileNotFoundError):
        where["sock"].unlink()  # a dead helper's
    path = os.pathsep.join(p for p in (str(PACKAGE_DIR.parent), os.environ.get("PYTHONPATH"))
                           if p)  # the package this process runs, wherever it came from
    with open(where["log"], "a") as log:
        return subprocess.Popen(
            [sys.executable, "-c", "from dflash_etl.validation.suite_server import serve; serve()",
             str(where["sock"]), str(idle_seconds())],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            close_fds=True, cwd="/", env={**os.environ, "PYTHONPATH": path},
        )


def running() -> bool:
    """Whether this process is connected to a helper (which then holds great_expectations)."""
    return bool(_CONNECTION)


def request(kind: str, **fields: Any) -> Callable[[], dict[str, Any] | None]:
    """Send a request now; the returned function waits for its answer (None: no working helper;
    the caller then validates in-process). Answers come back in the order asked: each returned
    function must be called, in that order."""
    if not running():
        return lambda: None
    connection = _CONNECTION[0]
    try:
        connection.sendall((json.dumps({"kind": kind, **fields}) + "\n").encode())
    except OSError:
        stop()
        return lambda: None

    def answer() -> dict[str, Any] | None:
        if not running():
            return None
        try:
            reply = json.loads(_READER[0].readline() or "null")
        except (OSError, ValueError):
            reply = None
        if not isinstance(reply, dict) or not reply.get("ok"):
            stop()  # validating in-process from now on: it reports what went wrong
            return None
        return reply["result"]

    return answer


def request_suite(stage_dir: Path, suite_name: str, thresholds: dict[str, Any]
                  ) -> Callable[[], dict[str, Any] | None]:
    """`suites.run_suite` in the helper (see `request`)."""
    return request("suite", stage_dir=str(Path(stage_dir).resolve()), suite=suite_name,
                   thresholds=thresholds)


def run_suite(stage_dir: Path, suite_name: str, thresholds: dict[str, Any]
              ) -> dict[str, Any] | None:
    """The suite's result from the helper, or None when there is no working helper."""
    return request_suite(stage_dir, suite_name, thresholds)()


def request_contract(contract: str, stage_dir: Path, params: dict[str, Any]
                     ) -> Callable[[], dict[str, Any] | None]:
    """`contracts.validate_output` in the helper: its answer is {"report": …} and, when the
    contract failed, "error" with ContractError's message (see `request`)."""
    return request("contract", contract=contract, stage_dir=str(Path(stage_dir).resolve()),
                   params=params)


def stop() -> None:
    """Close this process's connection (the helper stays for the next stage)."""
    while _READER:
        with contextlib.suppress(OSError):
            _READER.pop().close()
    while _CONNECTION:
        with contextlib.suppress(OSError):
            _CONNECTION.pop().close()


def shutdown(key: str | None = None) -> bool:
    """Ask the helper of `key` (this code's by default) to exit; True when one answered."""
    stop()
    return _ask_once("stop", key) is not None


def status() -> dict[str, Any] | None:
    """The running helper of this code ({"pid", "validations"}), or None; starts nothing."""
    return _ask_once("hello")


def _ask_once(kind: str, key: str | None = None) -> dict[str, Any] | None:
    """One request on a connection of its own (not this process's), answered within 10 s;
    the answer's result, or None when no helper answered."""
    where = paths(key)
    connection = _connect(where["sock"]) if where else None
    if connection is None:
        return None
    with connection:
        connection.settimeout(10.0)
        try:
            connection.sendall((json.dumps({"kind": kind}) + "\n").encode())
            reply = json.loads(connection.makefile("r").readline() or "null")
        except (OSError, ValueError):
            return None
    return reply.get("result") if isinstance(reply, dict) and reply.get("ok") else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--stop"]:
        print("stopped the gate helper" if shutdown() else "no gate helper was running")
        return 0
    if args == ["--status"]:
        found = status()
        where = paths()
        print(f"gate helper {found['pid']}: {found['validations']} validations, "
              f"{found.get('rss_mb')} MB resident (peak {found.get('peak_rss_mb')} MB), log "
              f"{where['log'] if where else '?'}" if found else "no gate helper is running")
        return 0
    print("usage: python -m dflash_etl.validation.suite_helper --status | --stop",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
