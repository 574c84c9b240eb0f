"""The Ray executor: a batch stage's work items as Ray Data `map_batches` over an actor pool.

Each actor receives the stage object (pickled once: its fields are settings), runs its `setup`
once (the tokenizer is loaded per actor, not per batch) and then the same `run_item` the local
executor runs, writing the item's files into the partial directory, which must be on storage
every node sees (one machine, or a shared filesystem). Only the items' small results travel
back to the driver, so its memory does not grow with the data. An actor that dies is restarted
by Ray and its items are retried (Ray Data's actor pools retry tasks); items write their files
atomically, done marker last, so a retry is harmless.
"""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError
from dflash_etl.core.progress import progress_bar, progress_record
from dflash_etl.core.stage import (
    BatchStage,
    StageContext,
    WorkItem,
    done_result,
    run_item,
    split_done,
)

INSTALL_HINT = "pip install 'dflash-etl[ray]'"
# Items per Ray task: each task costs Ray Data ~10 ms of CPU (driver and actor) on top of its
# items, so many small items (tokenize's chunks) go several to a task, while at least
# TASKS_PER_ACTOR tasks per actor keep the actors evenly busy to the end and the progress bar
# moving. Big items (ingest's 32 MB units) stay one to a task.
MAX_ITEMS_PER_TASK = 8
TASKS_PER_ACTOR = 16


def items_per_task(n_items: int, actors: int) -> int:
    return max(1, min(MAX_ITEMS_PER_TASK, n_items // (actors * TASKS_PER_ACTOR)))


def actors_fitting(cluster: dict[str, float], cpus: float, gpus: float) -> int:
    """How many actors of `cpus` CPUs and `gpus` GPUs each the cluster holds at once (at least
    one: Ray then waits for the resources, and says so)."""
    fits = [cluster.get("CPU", 1) / cpus] if cpus else []
    if gpus:
        fits.append(cluster.get("GPU", 0) / gpus)
    return max(1, int(min(fits, default=1)))


def import_ray() -> Any:
    try:
        import ray
        import ray.data
    except ImportError as exc:
        raise StageError(f"executor 'ray' needs Ray Data, which is not installed: "
                         f"{INSTALL_HINT} (or use the default executor 'local')") from exc
    return ray


def init_ray(address: str | None, num_cpus: int | None = None) -> Any:
    """Connect to the cluster at `address` ("auto", "HOST:PORT"), or start a local one; a Ray
    this process already joined is used as it is.

    Without an address Ray itself would join the cluster a `ray start` on this machine left in
    /tmp/ray (someone else's, perhaps, and with num_cpus it refuses to): "local" starts this
    run's own Ray instead. RAY_ADDRESS, where set (`ray job submit` sets it), is still obeyed."""
    import os

    if not address:  # a Ray of this machine alone: its processes talk over loopback only
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray = import_ray()
    if ray.is_initialized():
        return ray
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                              "configure_logging": False}
    if address:
        kwargs["address"] = address
    elif not os.environ.get("RAY_ADDRESS"):  # where it is set, Ray connects there itself
        kwargs["address"] = "local"
        if num_cpus:
            kwargs["num_cpus"] = num_cpus
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise StageError(f"cannot connect to the Ray cluster at {address!r}: {exc}. Start it "
                         "with `ray start --head` (and `ray start --address HEAD:PORT` on the "
                         "other nodes), or leave [run] ray_address unset for a local Ray"
                         ) from exc
    return ray


class _Actor:
    """One Ray Data actor: the stage, set up once."""

    def __init__(self, stage: BatchStage, work_dir: str) -> None:
        import os

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one CPU per actor
        self.stage, self.work_dir = stage, Path(work_dir)
        stage.setup()

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        results = []
        for blob in batch["item"]:
            item: WorkItem = pickle.loads(blob)
            result = done_result(self.work_dir, item.index)  # a retried batch's finished items
            if result is None:
                result = run_item(self.stage, item, self.work_dir)
            results.append(json.dumps(result))
        return {"result": np.array(results, dtype=object)}


class RayExecutor:
    def __init__(self, address: str | None) -> None:
        self.address = address

    def map(self, stage: BatchStage, ctx: StageContext, items: list[WorkItem], work_dir: Path,
            workers_started: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
        """`workers_started` is not called: the actors are not this process's children, and
        the parent is busy driving Ray Data."""
        results, todo = split_done(items, work_dir)
        with progress_bar(stage.name, total=len(items), enabled=ctx.progress,
                          record=progress_record(ctx.run.root, stage.name),
                          unit=stage.item_unit) as bar:
            bar.advance(len(results))
            if todo:
                for result in self._run(stage, ctx, todo, work_dir):
                    results[result["index"]] = result
                    bar.advance(1)
        return [results[k] for k in sorted(results)]

    def _run(self, stage: BatchStage, ctx: StageContext, todo: list[WorkItem],
             work_dir: Path):
        ray = init_ray(self.address, ctx.workers or None)
        from ray.data import DataContext

        DataContext.get_current().enable_progress_bars = False  # ours is drawn instead
        logging.getLogger("ray.data").setLevel(logging.WARNING)  # a line per dataset, per stage
        need = stage.resources()
        actors = max(1, min(ctx.workers or actors_fitting(ray.cluster_resources(), need.cpus,
                                                           need.gpus), len(todo)))
        per_task = items_per_task(len(todo), actors)
        rows = [{"item": pickle.dumps(item)} for item in todo]
        dataset = ray.data.from_items(rows, override_num_blocks=-(-len(rows) // per_task))
        mapped = dataset.map_batches(
            _Actor, fn_constructor_args=(stage, str(work_dir)),
            batch_size=per_task, compute=ray.data.ActorPoolStrategy(size=actors),
            num_cpus=need.cpus, num_gpus=need.gpus or None, batch_format="numpy")
        try:
            for row in mapped.iter_rows():
                yield json.loads(row["result"])
        except Exception as exc:
            cause = getattr(exc, "cause", None) or exc.__cause__
            if isinstance(cause, StageError):
                raise cause from None
            raise StageError(f"{stage.name}: the Ray job failed: {type(exc).__name__}: "
                             f"{str(exc)[:1500]}. Items finished so far are kept: rerun to "
                             "resume") from exc
