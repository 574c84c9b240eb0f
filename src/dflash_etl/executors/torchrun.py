"""The torchrun executor: a batch stage's work items over the ranks of a torchrun launch.

Every rank runs the whole lifecycle (the runner joins the process group; rank 0 alone owns the
run directory); here each rank takes its share of the items, balanced by their declared cost and
the same on every rank without talking, runs them with the same `run_item` the other executors
run (skipping those done before, so a rerun on any number of ranks resumes), and then every rank
says whether its share succeeded: when one failed, all fail, and rank 0 names the failing ranks.
Rank 0 then reads every item's result from the shared partial directory, in item order, so what
`finish` sees is what one process would have made. `relaunch` starts the launch itself.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_etl.core.config import PipelineConfig
from dflash_etl.core.distributed import agree, assign_by_cost, under_launcher
from dflash_etl.core.errors import StageError
from dflash_etl.core.progress import progress_bar, progress_record
from dflash_etl.core.stage import (
    BatchStage,
    RunOptions,
    StageContext,
    WorkItem,
    done_result,
    run_item,
)


class TorchrunExecutor:
    def map(self, stage: BatchStage, ctx: StageContext, items: list[WorkItem], work_dir: Path,
            workers_started: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
        mine = [items[k] for k in assign_by_cost([i.cost for i in items], ctx.world)[ctx.rank]]
        error = None
        try:
            self._run_share(stage, ctx, mine, work_dir)
        except Exception as exc:  # every rank hears of it, and rank 0 records it
            error = exc
        agree(error, ctx.world, stage.name)
        if ctx.rank != 0:
            return []
        results = []
        for item in items:
            result = done_result(work_dir, item.index)
            if result is None:
                raise StageError(f"{stage.name}: work item {item.index}'s files in {work_dir} "
                                 "are missing or unreadable after every rank finished; rerun "
                                 "to redo it")
            results.append(result)
        return results

    @staticmethod
    def _run_share(stage: BatchStage, ctx: StageContext, mine: list[WorkItem], work_dir: Path
                   ) -> None:
        """This rank's items, in this process; the stage is set up only if one is left to do
        (a model takes minutes to load)."""
        todo = [item for item in mine if done_result(work_dir, item.index) is None]
        with progress_bar(stage.name, total=len(mine),
                          enabled=ctx.progress if ctx.rank == 0 else False,
                          record=progress_record(ctx.run.root, stage.name)
                          if ctx.rank == 0 else None, unit=stage.item_unit) as bar:
            bar.advance(len(mine) - len(todo))
            if todo:
                stage.setup()
            for item in todo:
                run_item(stage, item, work_dir)
                bar.advance(1)


def relaunch(config: PipelineConfig | None, overrides: dict[str, Any], argv: list[str] | None,
             stage: str = "extract") -> int | None:
    """`--launcher torchrun` (extract, train): this stage's command again under `python -m
    torch.distributed.run --standalone` (one node), whose exit status it returns; None when the
    stage runs here (no launcher asked for, this process already is a rank, or extract's `plan`
    dry run, which measures one replica in this process). The launch options are
    resolved by `RunOptions`, as the runner's are."""
    section = config.section(stage) if config else {}
    options = RunOptions.resolve(config, stage, overrides)
    plan = overrides["plan"] if overrides.get("plan") is not None else section.get("plan")
    if options.launcher != "torchrun" or under_launcher() or plan:
        return None
    if argv is None:
        raise StageError(f"[{stage}] launcher = 'torchrun' re-runs the `dflash-etl {stage}` "
                         f"command under torchrun; `dflash-etl run` cannot: run `dflash-etl "
                         f"{stage} --launcher torchrun` on the run, then `dflash-etl run` for "
                         f"the rest (it skips the finished {stage})")
    nproc = options.nproc_per_node
    if not nproc:
        import torch

        nproc = torch.cuda.device_count() or 1
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", "--", "dflash_etl", stage, *argv]
    print(f"{stage}: {shlex.join(command)}", file=sys.stderr, flush=True)
    # each rank's collectives have a deadline (--dist-timeout-s): a lost rank ends the launch
    return subprocess.run(command, check=False).returncode
