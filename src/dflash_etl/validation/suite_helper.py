"""The great-expectations gate in a helper process, started when a gated stage starts.

Importing great_expectations costs ~3.5 s of CPU on a 2-core machine here, minutes on slower ones
(5.6 s without `suites.DEFERRED_IMPORTS`, the modules of expectations no suite runs).
A stage spends its first seconds on one core (imports, loading a tokenizer) and then keeps every
core busy, so the helper imports GE and builds its context on the idle core during the first
phase, then validates the stage's output when the gate asks. One helper per process serves every
stage it runs (`dflash-etl run`, a test session). Anything wrong with the helper (it could not
start, it died, it answered nonsense) makes the gate validate in-process, which raises its own
errors with context. `DFLASH_ETL_SUITE_HELPER=0` keeps the gate in-process.

Only the standard library here: the CLI starts the helper before it imports anything heavy.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_PROCESS: list[subprocess.Popen[str]] = []


def start() -> None:
    """Start the helper unless one runs, GE is loaded here already, or it is switched off."""
    if os.environ.get("DFLASH_ETL_SUITE_HELPER", "1") == "0" or "great_expectations" in sys.modules:
        return
    if not running():
        _launch()


def _launch() -> None:
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", "from dflash_etl.validation.suite_server import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
    except OSError:
        return
    if not _PROCESS:
        atexit.register(stop)
    _PROCESS[:] = [process]


def running() -> bool:
    return bool(_PROCESS) and _PROCESS[0].poll() is None


def run_suite(
    stage_dir: Path, suite_name: str, thresholds: dict[str, Any]
) -> dict[str, Any] | None:
    """The suite's result from the helper, or None when there is no working helper."""
    return request_suite(stage_dir, suite_name, thresholds)()


def request_suite(
    stage_dir: Path, suite_name: str, thresholds: dict[str, Any]
) -> Callable[[], dict[str, Any] | None]:
    """Send the request now; the returned function waits for the result (None: no working
    helper). It must be called before the next request: the replies come back in order."""
    if not running():
        return lambda: None
    process = _PROCESS[0]
    assert process.stdin is not None and process.stdout is not None
    request = {"stage_dir": str(Path(stage_dir).resolve()), "suite": suite_name,
               "thresholds": thresholds}
    try:
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
    except OSError:
        stop()
        return lambda: None

    def result() -> dict[str, Any] | None:
        try:
            reply = json.loads(process.stdout.readline() or "null")
        except (OSError, ValueError):
            reply = None
        if not isinstance(reply, dict) or not reply.get("ok"):
            stop()  # validating in-process from now on: it reports what went wrong
            return None
        return reply["result"]

    return result


def stop() -> None:
    """End the helper (it exits when its input closes)."""
    while _PROCESS:
        process = _PROCESS.pop()
        try:
            if process.stdin is not None:
                process.stdin.close()
            process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
