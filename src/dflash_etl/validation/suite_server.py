"""The suite helper's process, which `suite_helper` starts: it imports great_expectations and
runs the suites; the stage's process only talks to it over a pipe (and stays light)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from dflash_etl.validation import suites


def serve() -> None:
    """The helper's loop: build the GE context now, then answer one request per input line."""
    # an error here fails the request the same way, and the stage validates in-process
    with contextlib.suppress(Exception):
        suites._batch_definition()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            thresholds = suites.Thresholds(**request["thresholds"])
            result = suites.run_suite(Path(request["stage_dir"]), request["suite"], thresholds)
            reply = json.dumps({"ok": True, "result": result}, default=str)
        except Exception as exc:  # the stage reruns the suite in-process and raises it there
            reply = json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        sys.stdout.write(reply + "\n")
        sys.stdout.flush()
