"""The torchrun launcher: a stage's command again under `python -m torch.distributed.run`.

Only the launch lives here; the ranks themselves (joining the group, barriers, agreeing on
failure) are `core/distributed.py`'s. extract is the stage that takes `--launcher`.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from typing import Any

from dflash_etl.core.config import PipelineConfig
from dflash_etl.core.distributed import under_launcher
from dflash_etl.core.errors import StageError


def relaunch(config: PipelineConfig | None, overrides: dict[str, Any], argv: list[str] | None,
             stage: str = "extract") -> int | None:
    """`--launcher torchrun`: this stage's command again under `python -m torch.distributed.run
    --standalone` (one node), whose exit status it returns; None when the stage runs here (no
    launcher asked for, this process already is a rank, or a `plan` dry run, which measures one
    replica in this process)."""
    section = config.section(stage) if config else {}
    launcher = overrides.get("launcher") or section.get("launcher") or "none"
    plan = overrides["plan"] if overrides.get("plan") is not None else section.get("plan")
    if launcher != "torchrun" or under_launcher() or plan:
        return None
    if argv is None:
        raise StageError(f"[{stage}] launcher = 'torchrun' re-runs the `dflash-etl {stage}` "
                         f"command under torchrun; `dflash-etl run` cannot: run `dflash-etl "
                         f"{stage} --launcher torchrun` on the run, then `dflash-etl run` for "
                         f"the rest (it skips the finished {stage})")
    nproc = overrides.get("nproc_per_node") or section.get("nproc_per_node") or 0
    if not nproc:
        import torch

        nproc = torch.cuda.device_count() or 1
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", "--", f"dflash_etl.stages.{stage}", *argv]
    print(f"{stage}: {shlex.join(command)}", file=sys.stderr, flush=True)
    # each rank's collectives have a deadline (--dist-timeout-s): a lost rank ends the launch
    return subprocess.run(command, check=False).returncode
