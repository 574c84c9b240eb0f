"""Executors run a batch stage's work items; they never change what the items produce.

`local` (the default) forks a process pool on this machine; `ray` runs the same items as Ray
Data `map_batches` over a Ray cluster; under a torchrun launch (WORLD_SIZE > 1) the items are
split over its ranks, whatever the executor setting. Each skips items finished before (resume)
and returns the items' results in item order, so `finish` and the outputs are the same on any.
"""

from __future__ import annotations

from dflash_etl.core.errors import StageError
from dflash_etl.core.stage import Executor, StageContext

EXECUTORS = ("local", "ray")


def get_executor(ctx: StageContext) -> Executor:
    if ctx.world > 1:  # this process is one rank of a launch: the ranks are the workers
        from dflash_etl.executors.torchrun import TorchrunExecutor

        return TorchrunExecutor()
    if ctx.executor == "local":
        from dflash_etl.executors.local import LocalExecutor

        return LocalExecutor()
    if ctx.executor == "ray":
        from dflash_etl.executors.ray import RayExecutor

        return RayExecutor(ctx.ray_address)
    raise StageError(f"executor {ctx.executor!r} is not known; use one of {list(EXECUTORS)} "
                     "([run] executor or --executor)")
