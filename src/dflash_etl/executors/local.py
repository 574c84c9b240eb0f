"""The local executor: the items in forked worker processes on this machine (or in this process
when one worker is enough)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import sys
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from dflash_etl.core.progress import progress_bar, progress_record
from dflash_etl.core.stage import (
    BatchStage,
    StageContext,
    WorkItem,
    run_item,
    split_done,
)

IN_FLIGHT_PER_WORKER = 4  # items submitted ahead: workers never wait, the parent holds few
# In a worker process only: the stage its initializer received. The pool calls `_work` by name
# with only the item, so the stage (tokenizer and all) is inherited once by the fork instead of
# pickled with every item.
_worker_stage: BatchStage | None = None


def _init_worker(parent: int, stage: BatchStage) -> None:
    global _worker_stage
    _worker_stage = stage
    _one_thread_per_worker()
    _die_with(parent)


def _one_thread_per_worker() -> None:
    """The workers already use every core: libraries' own thread pools (the tokenizer's batch
    encode) run serially in each, instead of competing with the other workers."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _die_with(parent: int) -> None:
    """A worker whose parent was killed (SIGKILL, the OOM killer) would wait on its queue
    forever, or finish its item into a partial directory the next run may be rewriting: on
    Linux the kernel kills it with its parent (PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it died before the request above
        os._exit(1)


def _work(item: WorkItem, work_dir: str) -> dict[str, Any]:
    assert _worker_stage is not None, "_work runs in a pool worker, after _init_worker"
    return run_item(_worker_stage, item, Path(work_dir))


class LocalExecutor:
    def map(self, stage: BatchStage, ctx: StageContext, items: list[WorkItem], work_dir: Path,
            workers_started: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
        results, todo = split_done(items, work_dir)
        cap = stage.resources().local_workers or len(todo)  # a model replica: this process
        n_workers = max(1, min(ctx.n_workers(), len(todo), cap))
        with progress_bar(stage.name, total=len(items), enabled=ctx.progress,
                          record=progress_record(ctx.run.root, stage.name),
                          unit=stage.item_unit) as bar:
            bar.advance(len(results))
            if todo:
                stage.setup()  # once, here: forked workers inherit the loaded tokenizer or model
            if n_workers == 1:
                workers_started()  # no fork follows: the gate's imports may overlap the items
                for item in todo:
                    results[item.index] = run_item(stage, item, work_dir)
                    bar.advance(1)
            elif todo:
                self._pool(stage, todo, str(work_dir), n_workers, results, bar, workers_started)
        return [results[k] for k in sorted(results)]

    @staticmethod
    def _pool(stage: BatchStage, todo: list[WorkItem], work_dir: str, n_workers: int,
              results: dict[int, dict[str, Any]], bar: Any,
              workers_started: Callable[[], None]) -> None:
        # Frozen objects are never traversed by the collector: the workers' collections skip
        # (and do not copy-on-write) the whole inherited heap, tokenizer and all.
        gc.freeze()
        try:
            # forked, the initializer's arguments are inherited, not pickled
            with ProcessPoolExecutor(n_workers, mp_context=mp.get_context("fork"),
                                     initializer=_init_worker,
                                     initargs=(os.getpid(), stage)) as pool:
                try:
                    LocalExecutor._drain(pool, todo, work_dir, n_workers, results, bar,
                                         workers_started)
                except BaseException:
                    _stop_workers(pool)
                    raise
        finally:
            gc.unfreeze()

    @staticmethod
    def _drain(pool: ProcessPoolExecutor, todo: list[WorkItem], work_dir: str, n_workers: int,
               results: dict[int, dict[str, Any]], bar: Any,
               workers_started: Callable[[], None]) -> None:
        """Submit the items a few ahead of the workers and collect their results."""
        in_flight: deque[Future[dict[str, Any]]] = deque()
        for k, item in enumerate(todo):
            in_flight.append(pool.submit(_work, item, work_dir))
            if k == 0:
                workers_started()  # the first submit forked every worker
            if len(in_flight) >= IN_FLIGHT_PER_WORKER * n_workers:
                result = in_flight.popleft().result()
                results[result["index"]] = result
                bar.advance(1)
        while in_flight:
            result = in_flight.popleft().result()
            results[result["index"]] = result
            bar.advance(1)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """An error or an interrupt (SIGTERM reaches this process alone): the workers' items in
    flight are not waited for but killed (an item's files are renamed in whole, its done marker
    last, so a killed one is simply done again by the rerun)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())  # shutdown drops it
    for process in processes:
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)
