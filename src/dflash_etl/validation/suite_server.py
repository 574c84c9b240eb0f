"""The gate helper's process, which `suite_helper` starts: it binds its socket first (a stage
can connect and queue its request at once), then imports great_expectations and pandera and
answers one request at a time, from any number of stage processes, until it has been idle
for its idle time or is asked to stop."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

_LOCK = threading.Lock()  # one validation at a time: GE's context is not shared between threads
_STATE: dict[str, Any] = {"open": 0, "last": time.monotonic(), "stop": False, "validations": 0}


def serve(argv: list[str] | None = None) -> None:
    """`suite_server SOCKET IDLE_S`: listen, load, answer; remove the socket when done."""
    path, idle_s = (argv or sys.argv[1:])[:2]
    listener = _bind(Path(path))
    if listener is None:
        return
    _load()
    inode = os.stat(path).st_ino
    try:
        _accept(listener, float(idle_s))
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode:  # not a successor's socket
                os.unlink(path)


def _bind(path: Path) -> socket.socket | None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        listener.bind(str(path))
    except OSError as exc:  # another helper took it: it serves instead
        print(f"gate helper: not serving {path}: {exc}", flush=True)
        listener.close()
        return None
    finally:
        os.umask(old)
    listener.listen(64)
    print(f"gate helper {os.getpid()}: serving {path}", flush=True)
    return listener


def _load() -> None:
    """The imports the gates need, done once for every stage that asks."""
    from dflash_etl.validation import suites

    with contextlib.suppress(Exception):  # an error here fails the request, which then reruns
        suites._batch_definition()        # in-process and raises there with context
        import pandera.polars  # noqa: F401


def _accept(listener: socket.socket, idle_s: float) -> None:
    listener.settimeout(min(idle_s, 1.0))
    while not _STATE["stop"]:
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            with _LOCK:
                if _STATE["open"] == 0 and time.monotonic() - _STATE["last"] > idle_s:
                    print(f"gate helper {os.getpid()}: idle {idle_s:.0f} s, exiting", flush=True)
                    return
            continue
        with _LOCK:
            _STATE["open"] += 1
        threading.Thread(target=_converse, args=(connection,), daemon=True).start()


def _converse(connection: socket.socket) -> None:
    """One stage process's requests, in order, each answered on its own line."""
    try:  # read and write apart: a text stream's write drops the lines it has read ahead
        with connection, connection.makefile("r", encoding="utf-8") as lines:
            for line in lines:
                with _LOCK:
                    reply = _answer(line)
                    _STATE["last"] = time.monotonic()
                connection.sendall((reply + "\n").encode())
                if _STATE["stop"]:
                    return
    except OSError:
        pass  # the stage went away; its next request, if any, reconnects
    finally:
        with _LOCK:
            _STATE["open"] -= 1
            _STATE["last"] = time.monotonic()


def _answer(line: str) -> str:
    try:
        request = json.loads(line)
        if request.get("kind") == "stop":
            _STATE["stop"] = True
            return json.dumps({"ok": True, "result": {"stopping": os.getpid()}})
        result = HANDLERS[request["kind"]](request)
        if request["kind"] != "hello":
            _STATE["validations"] += 1
            _release_memory()
        return json.dumps({"ok": True, "result": result}, default=str)
    except Exception as exc:  # the stage reruns it in-process and raises it there
        return json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def _release_memory() -> None:
    """Give back what a validation freed: the helper waits between stages, and the allocators
    keep freed pages (after a 1M-row suite it held 310 MB more than after its imports)."""
    import gc

    gc.collect()
    with contextlib.suppress(Exception):
        import pyarrow

        pyarrow.default_memory_pool().release_unused()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _suite(request: dict[str, Any]) -> dict[str, Any]:
    from dflash_etl.validation import suites

    thresholds = suites.Thresholds(**request["thresholds"])
    return suites.run_suite(Path(request["stage_dir"]), request["suite"], thresholds)


def _contract(request: dict[str, Any]) -> dict[str, Any]:
    from dflash_etl.core.errors import ContractError
    from dflash_etl.validation.contracts import validate_output

    try:
        return {"report": validate_output(request["contract"], Path(request["stage_dir"]),
                                          request["params"])}
    except ContractError as exc:
        return {"report": exc.report, "error": str(exc)}


def _hello(request: dict[str, Any]) -> dict[str, Any]:
    """Who answers, and the memory it holds between stages: `suite_helper --status`."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        now = round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        now = None
    return {"pid": os.getpid(), "validations": _STATE["validations"], "rss_mb": now,
            "peak_rss_mb": round(peak, 1)}


HANDLERS = {"suite": _suite, "contract": _contract, "hello": _hello}
