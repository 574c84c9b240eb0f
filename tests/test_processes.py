"""A stage command leaves no process behind: its gates run in its own process, its pool workers
end with it. (A gate helper that outlived every command, holding hundreds of MB on a shared
node and queueing every gate of its user behind one lock, is what this replaced.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Runs the command given as its arguments as a child subreaper (Linux): a process the command
# leaves running is re-parented here when the command exits, and listed.
REAPER = r"""
import ctypes, json, os, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
left = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{pid}/stat").read()
        cmdline = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        continue
    if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
        left.append(cmdline)
print(json.dumps({"code": code.returncode, "left": left, "stderr": code.stderr[-3000:]}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux subreaper")
def test_a_gated_stage_command_leaves_no_process_running(tmp_path):
    """`dflash-etl ingest` (two pool workers, the conversations contract and suite) returns, and
    nothing it started is alive: no gate daemon, no worker."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    command = [sys.executable, "-m", "dflash_etl", "ingest", "--config",
               str(REPO / "data" / "pipeline.toml"), "--run", str(tmp_path / "run"),
               "--workers", "2"]
    result = subprocess.run([sys.executable, "-c", REAPER, *command], capture_output=True,
                            text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["code"] == 0, report["stderr"]
    assert report["left"] == []
    assert (tmp_path / "run" / "ingest" / "validation.json").is_file()  # the suite did run
