"""The local executor: the items in forked worker processes on this machine (or in this process
when one worker is enough)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import sys
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from dflash_etl.core.progress import progress_bar
from dflash_etl.core.stage import (
    BatchStage,
    StageContext,
    WorkItem,
    run_item,
    split_done,
)

_WORKER: dict[str, Any] = {}
IN_FLIGHT_PER_WORKER = 4  # items submitted ahead: workers never wait, the parent holds few


def _init_worker(parent: int) -> None:
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
    return run_item(_WORKER["stage"], _WORKER["worker"], item, Path(work_dir))


class LocalExecutor:
    def map(self, stage: BatchStage, ctx: StageContext, items: list[WorkItem],
            work_dir: Path) -> list[dict[str, Any]]:
        results, todo = split_done(items, work_dir)
        n_workers = max(1, min(ctx.n_workers(), len(todo)))
        with progress_bar(stage.name, total=len(items), enabled=ctx.progress) as bar:
            bar.advance(len(results))
            if todo:
                # set up once here: forked workers inherit the loaded tokenizer or model
                _WORKER["stage"] = type(stage)
                _WORKER["worker"] = type(stage).setup(*stage.worker_args(ctx))
            try:
                if n_workers == 1:
                    for item in todo:
                        results[item.index] = _work(item, str(work_dir))
                        bar.advance(1)
                elif todo:
                    self._pool(todo, str(work_dir), n_workers, results, bar, ctx)
            finally:
                _WORKER.clear()
        return [results[k] for k in sorted(results)]

    @staticmethod
    def _pool(todo: list[WorkItem], work_dir: str, n_workers: int,
              results: dict[int, dict[str, Any]], bar: Any, ctx: StageContext) -> None:
        # Frozen objects are never traversed by the collector: the workers' collections skip
        # (and do not copy-on-write) the whole inherited heap, tokenizer and all.
        gc.freeze()
        try:
            with ProcessPoolExecutor(n_workers, mp_context=mp.get_context("fork"),
                                     initializer=_init_worker,
                                     initargs=(os.getpid(),)) as pool:
                in_flight: deque[Future[dict[str, Any]]] = deque()
                for k, item in enumerate(todo):
                    in_flight.append(pool.submit(_work, item, work_dir))
                    if k == 0:
                        ctx.state.get("on_forked", lambda: None)()  # every worker exists now
                    if len(in_flight) >= IN_FLIGHT_PER_WORKER * n_workers:
                        result = in_flight.popleft().result()
                        results[result["index"]] = result
                        bar.advance(1)
                while in_flight:
                    result = in_flight.popleft().result()
                    results[result["index"]] = result
                    bar.advance(1)
        finally:
            gc.unfreeze()
