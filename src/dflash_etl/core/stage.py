"""What a stage is: its settings, what it reads, and its work. The runner owns the rest.

A stage says how to make its settings, `prepare` (find its inputs; what its fingerprint covers),
and `execute` (write its output into the partial directory and return its stats document).
Stages that split into independent work items are `BatchStage`s: an object whose fields are
what its workers need (`bind` sets them), a per-worker `setup`, a `load` of one item's input, a
pure `process_batch`, and a `finish` over all items' results; an executor (local process pool, Ray
Data, or the ranks of a torchrun launch) sends the stage object to its workers and runs the items,
so the stage never sees how.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_etl.core.accounting import Stats
from dflash_etl.core.config import PipelineConfig
from dflash_etl.core.errors import StageError
from dflash_etl.core.rundir import RunDir, remove_tree, write_json_atomic


@dataclass(frozen=True)
class RunOptions:
    """How a stage's work runs, never what it makes (none of it is in a fingerprint), resolved
    here alone: the command line (a caller's keywords) over the stage's config section over
    [run]. `workers` 0: one per core locally, one per CPU (or GPU) on Ray."""

    workers: int = 0
    executor: str = "local"
    ray_address: str | None = None
    launcher: str = "none"  # extract, train: "torchrun" re-runs the command under torchrun
    nproc_per_node: int = 0  # --launcher torchrun: 0 is one per visible GPU

    @classmethod
    def resolve(cls, config: PipelineConfig | None, stage: str, given: dict[str, Any]
                ) -> RunOptions:
        run = config.run if config else None
        section = config.section(stage) if config else {}

        def pick(key: str, default: Any) -> Any:
            for value in (given.get(key), section.get(key), getattr(run, key, None)):
                if value is not None and value != "":
                    return value
            return default

        return cls(workers=int(given.get("workers") or (run.workers if run else 0) or 0),
                   executor=pick("executor", "local"), ray_address=pick("ray_address", None),
                   launcher=pick("launcher", "none"),
                   nproc_per_node=int(pick("nproc_per_node", 0)))


@dataclass
class StageContext:
    """One stage run: what the runner knows, and what `prepare` found for `execute`."""

    name: str
    run: RunDir
    config: PipelineConfig | None
    progress: bool | None = None
    workers: int | None = None
    executor: str = "local"
    ray_address: str | None = None
    settings: Any = None
    fingerprint: str = ""
    partial: Path = Path()
    rank: int = 0
    world: int = 1
    shell: Shell = field(default_factory=lambda: Shell())
    state: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)  # kept in the manifest, not the data
    # this call's figures (train's steps_this_run): the returned document's total and the
    # manifest show them; stats.json, which is data, does not
    call_totals: dict[str, Any] = field(default_factory=dict)

    def n_workers(self) -> int:
        """--workers, else [run] workers (RunOptions), else one per core."""
        return max(1, self.workers or os.cpu_count() or 1)


class Stage:
    """A stage of the pipeline. Subclasses set `name` and implement `prepare` and `execute`."""

    name: ClassVar[str]
    reads: ClassVar[tuple[str, ...]] = ()  # the stages whose outputs it reads

    def prepare(self, ctx: StageContext) -> dict[str, Any]:
        """Read what the stage needs to decide whether it must run; returns what the fingerprint
        covers (settings, input hashes, model identity)."""
        raise NotImplementedError

    def upstream(self, ctx: StageContext) -> tuple[str, ...]:
        """The stages whose published outputs this one reads (recorded as `built_on`, so a
        later rerun of one of them shows this stage stale)."""
        return self.reads

    def redo_complete(self, ctx: StageContext, done: dict[str, Any]) -> str | None:
        """Why a stage already complete for these inputs (`done`: its stats) runs again, or
        None (it is skipped): e.g. rows whose generation failed on a server, worth retrying."""
        return None

    def begin(self, ctx: StageContext) -> None:
        """The partial directory exists (and may hold an interrupted run's work); on rank 0
        alone, before the other ranks go on: what it writes, they see."""

    def execute(self, ctx: StageContext) -> dict[str, Any]:
        """Write the output into ctx.partial; returns the stats document (the runner checks its
        accounting and gates the output with the contract and suite the registry names)."""
        raise NotImplementedError

    def contract_params(self, ctx: StageContext) -> dict[str, Any]:
        """The limits the output's contract checks against (vocab size, seq_length...)."""
        return {}

    def cleanup(self, ctx: StageContext) -> None:
        """Remove work files from ctx.partial before it is published."""

    def end(self, ctx: StageContext) -> None:
        """After the output was published (or, on ranks other than 0, after the work)."""


@dataclass(frozen=True)
class WorkItem:
    """One independent piece of a batch stage's input (a file unit, a row range): small and
    picklable, so an executor can send it anywhere; `index` orders the results."""

    index: int
    payload: Any
    cost: int = 1  # what running it costs (padded tokens...): the torchrun executor balances it


@dataclass(frozen=True)
class Resources:
    """What one worker of a batch stage holds: the executors size their workers from it (Ray
    actors ask for these CPUs and GPUs; `local_workers` caps the local process pool, 1 for a
    stage whose worker holds a model replica: it runs in this process)."""

    cpus: float = 1
    gpus: float = 0
    local_workers: int | None = None


@dataclass
class BatchOutput:
    """What `process_batch` makes of one item: rows, quarantined rows, per-source accounting,
    and anything `finish` adds up (JSON-able)."""

    rows: pa.Table
    quarantine: pa.Table
    stats: dict[str, Stats]
    extra: dict[str, Any] = field(default_factory=dict)


class BatchStage(Stage):
    """A stage made of independent work items; `execute` runs them on the chosen executor.

    The executor sends the stage object itself to every worker (forked, or pickled into a Ray
    actor): its fields are what the workers need, set by `bind` (picklable: settings and the
    few values `prepare` found), and `setup` adds, in each worker, what is loaded there."""

    def plan(self, ctx: StageContext) -> list[WorkItem]:
        raise NotImplementedError

    def resources(self) -> Resources:
        """What each worker needs (after `bind`): one CPU, unless the stage says otherwise."""
        return Resources()

    def bind(self, ctx: StageContext) -> None:
        """Set the fields the workers need from what the runner and `prepare` found."""

    def setup(self) -> None:
        """Per worker, once: load the tokenizer or model into the stage's fields."""

    def load(self, item: WorkItem) -> Any:
        """The item's input (I/O, in the worker)."""
        raise NotImplementedError

    def process_batch(self, batch: Any, item: WorkItem) -> BatchOutput:
        """The pure transform of one item's input."""
        raise NotImplementedError

    def while_working(self) -> AbstractContextManager[Callable[[], None]]:
        """What the parent does while the items run (the gate's imports): yields what the
        executor calls once every worker process exists, and ends after `finish`."""
        return nullcontext(lambda: None)

    def finish(self, ctx: StageContext, results: list[dict[str, Any]], work_dir: Path
               ) -> dict[str, Any]:
        """Whole-dataset steps over every item's result (mix, dedup, vocabulary), the output
        files and the gates; returns the stats document."""
        raise NotImplementedError

    def execute(self, ctx: StageContext) -> dict[str, Any]:
        work_dir = ctx.partial / "units"
        work_dir.mkdir(exist_ok=True)
        with self.while_working() as workers_started:
            items = self.plan(ctx)
            self.bind(ctx)
            results = ctx.shell.executor(ctx).map(self, ctx, items, work_dir, workers_started)
            if ctx.rank != 0:  # under torchrun rank 0 alone finishes, gates and publishes
                return {}
            return self.finish(ctx, results, work_dir)

    def cleanup(self, ctx: StageContext) -> None:
        remove_tree(ctx.partial / "units")  # a kill meanwhile leaves no done marker without data


class Executor(Protocol):
    """Runs a batch stage's work items (skipping those done before) and returns their results
    in item order (on rank 0: the others' list is empty); it never changes what an item
    produces."""

    def map(self, stage: BatchStage, ctx: StageContext, items: list[WorkItem], work_dir: Path,
            workers_started: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
        """`workers_started` is called in this process once the workers exist (forked)."""


def _no_executor(ctx: StageContext) -> Executor:
    raise StageError(f"{ctx.name}: no executor: run batch stages with dflash_etl.stages.shell's "
                     "run_stage")


@dataclass(frozen=True)
class Shell:
    """What core's lifecycle takes from the layers above it, which core never imports: a
    stage's settings, the executor its items run on, the gate (its early start, and the
    contract and suite its output must pass, as the stage registry declares them) and the
    run's report. `dflash_etl.stages.shell.run_stage` passes the real one; core's `run_stage`
    alone runs a stage with no settings, gate, report or executor (core's own tests)."""

    # a stage's settings (name, config, run directory, the command line's overrides)
    settings: Callable[[str, PipelineConfig | None, Path, dict[str, Any]], Any] = (
        lambda stage, config, run_dir, overrides: None)
    executor: Callable[[StageContext], Executor] = _no_executor
    gate: Callable[[StageContext, dict[str, Any], dict[str, Any]], None] = (
        lambda ctx, doc, contract_params: None)
    publish_docs: Callable[[Path], None] = lambda run_root: None


def item_paths(work_dir: Path, index: int) -> tuple[Path, Path, Path]:
    base = work_dir / f"u{index:06d}"
    return (Path(f"{base}.rows.parquet"), Path(f"{base}.q.parquet"), Path(f"{base}.done.json"))


def read_item_file(path: Path, schema: pa.Schema | None = None,
                   columns: list[str] | None = None) -> pa.Table:
    """An item's rows or quarantine file (as `run_item` wrote it), cast to `schema` when given.
    Not `pq.read_table`: it imports pyarrow.dataset and pandas with it, half a second of a
    stage's single-core finish."""
    table = pq.ParquetFile(path).read(columns=columns)
    return table if schema is None else table.cast(schema)


def done_result(work_dir: Path, index: int) -> dict[str, Any] | None:
    """The result of an item finished before (resume), or None (also when its files are gone:
    the item is done again)."""
    rows, quarantine, done = item_paths(work_dir, index)
    if not (done.exists() and rows.exists() and quarantine.exists()):
        return None
    try:
        return json.loads(done.read_text())
    except ValueError:  # cut by a crash: the item is done again
        return None


def split_done(items: list[WorkItem], work_dir: Path
               ) -> tuple[dict[int, dict[str, Any]], list[WorkItem]]:
    """(results of the items finished before, by index; the items still to do): resume."""
    results: dict[int, dict[str, Any]] = {}
    todo = []
    for item in items:
        done = done_result(work_dir, item.index)
        if done is not None:
            results[item.index] = done
        else:
            todo.append(item)
    return results, todo


def run_item(stage: BatchStage, item: WorkItem, work_dir: Path) -> dict[str, Any]:
    """Load, process and write one item (in whatever worker runs it). Files are renamed into
    place and done.json comes last, so an item retried after a crash is written whole once."""
    output = stage.process_batch(stage.load(item), item)
    rows_path, q_path, done_path = item_paths(work_dir, item.index)
    for table, path in ((output.rows, rows_path), (output.quarantine, q_path)):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    result = {"index": item.index,
              "sources": {name: s.to_dict() for name, s in output.stats.items()},
              **output.extra}
    write_json_atomic(done_path, result)
    return result
