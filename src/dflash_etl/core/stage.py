"""What a stage is. Its class is its one declaration: its name and help, its settings class (the
schema of its config section and its CLI flags), the kind of output it writes and the kinds it
reads (core/outputs.py: contract, suite, where the files are), and its work: `prepare` (find its
inputs, keep them as typed fields of the instance, return what the fingerprint covers) and
`execute` (write its output into the partial directory and return its stats document).

Stages that split into independent work items are `BatchStage`s: `plan` the items, a per-worker
`setup`, a `load` of one item's input, a pure `process_batch`, and a `finish` over all items'
results; an executor (local process pool, Ray Data, or the ranks of a torchrun launch) sends the
stage object to its workers and runs the items, so the stage never sees how. Everything else (the
lock, skip and resume, the gates, publishing, the report) is the runner's (dflash_etl.runner).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_etl.core.accounting import Stats
from dflash_etl.core.config import PipelineConfig
from dflash_etl.core.outputs import Output
from dflash_etl.core.rundir import RunDir, StageRecord, remove_tree, write_json_atomic

CGROUP = Path("/sys/fs/cgroup")


def usable_cores(cgroup: Path | None = None) -> int:
    """The cores this process may run on: its CPU affinity (taskset, a cpuset), capped by a
    cgroup CPU quota (a container's --cpus, a Slurm or Kubernetes limit). os.cpu_count() sees
    the host's cores: 64 workers on a 2-CPU quota each get 1/32 of a core and thrash."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    cgroup = cgroup or CGROUP
    quota = cpu_quota(_read(cgroup / "cpu.max"), _read(cgroup / "cpu" / "cpu.cfs_quota_us"),
                      _read(cgroup / "cpu" / "cpu.cfs_period_us"))
    return max(1, min(cores, quota) if quota else cores)


def cpu_quota(v2: str, v1_quota: str = "", v1_period: str = "") -> int | None:
    """The quota in whole cores (rounded up) from cgroup v2's cpu.max (`200000 100000`, `max
    100000`) or v1's cfs_quota_us and cfs_period_us (-1: none); None where there is none."""
    try:
        if v2:
            quota, period = v2.split()[:2]
            return None if quota == "max" else -(-int(quota) // int(period))
        if v1_quota and int(v1_quota) > 0 and v1_period:
            return -(-int(v1_quota) // int(v1_period))
    except ValueError:
        return None
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


OutputT = TypeVar("OutputT", bound=Output)


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
    """One stage run, as the runner knows it: the run directory and config, how the work runs,
    the fingerprint and partial directory, and the outputs the stage read (`read`)."""

    name: str
    run: RunDir
    config: PipelineConfig | None
    progress: bool | None = None
    workers: int | None = None
    executor: str = "local"
    ray_address: str | None = None
    fingerprint: str = ""
    partial: Path = Path()
    rank: int = 0
    world: int = 1
    # (stage, kind of output it writes) of the stages before this one, in pipeline order
    upstream: tuple[tuple[str, str], ...] = ()
    read_from: list[str] = field(default_factory=list)  # the stages whose outputs it read
    timings: dict[str, Any] = field(default_factory=dict)  # kept in the manifest, not the data
    # this call's figures (train's steps_this_run): the returned document's total and the
    # manifest show them; stats.json, which is data, does not
    call_totals: dict[str, Any] = field(default_factory=dict)

    def n_workers(self) -> int:
        """--workers, else [run] workers (RunOptions), else one per core it may use."""
        return max(1, self.workers or usable_cores())

    def writers(self, kind: type[Output]) -> list[str]:
        """The stages before this one that write `kind`, in pipeline order."""
        return [name for name, written in self.upstream if written == kind.kind]

    def read(self, kind: type[OutputT], stale: str = "error", hint: str = "",
             stale_hint: str = "") -> OutputT:
        """The current output of `kind` (`RunDir.output`: the last stage before this one that
        writes it and ran here), recorded as what this stage is built on."""
        output = self.run.output(kind, self.writers(kind), self.name, stale, hint, stale_hint)
        if output.stage_dir.name not in self.read_from:
            self.read_from.append(output.stage_dir.name)
        return output

    def origin(self, kind: type[OutputT]) -> OutputT | None:
        """The output of the first stage that writes `kind` (ingest for conversations: where the
        rows came from, and their mix), when it is published; not a dependency of its own."""
        first = next(iter(self.writers(kind)), None)
        if first is None or not self.run.stage_dir(first).is_dir():
            return None
        return kind.read(self.run.stage_dir(first))


class Stage:
    """A stage of the pipeline; a subclass declares the class variables and implements `prepare`
    and `execute` (a BatchStage: `plan`, `load`, `process_batch`, `finish`)."""

    name: ClassVar[str]
    help: ClassVar[str] = ""  # the subcommand's help line
    Settings: ClassVar[type | None] = None  # its settings dataclass: [name] and the CLI flags
    # the kind of output it publishes (None: no contract checks it; a pipeline refuses that)
    writes: ClassVar[type[Output] | None] = None
    reads: ClassVar[tuple[type[Output], ...]] = ()  # none: it reads the config's [[sources]]
    settings: Any = None  # this run's Settings instance, set by the runner before `prepare`

    def prepare(self, ctx: StageContext) -> dict[str, Any]:
        """Read what the stage needs to decide whether it must run (its inputs through
        `ctx.read`), kept as fields of the instance; returns what the fingerprint covers
        (settings, input hashes, model identity)."""
        raise NotImplementedError

    def redo_complete(self, ctx: StageContext, done: dict[str, Any]) -> str | None:
        """Why a stage already complete for these inputs (`done`: its stats) runs again, or
        None (it is skipped): e.g. rows whose generation failed on a server, worth retrying."""
        return None

    def begin(self, ctx: StageContext) -> None:
        """The partial directory exists (and may hold an interrupted run's work); on rank 0
        alone, before the other ranks go on: what it writes, they see."""

    def execute(self, ctx: StageContext) -> dict[str, Any]:
        """Write the output into ctx.partial; returns the stats document (the runner checks its
        accounting and gates the output with its kind's contract and suite)."""
        raise NotImplementedError

    def contract_params(self, ctx: StageContext) -> dict[str, Any]:
        """The limits the output's contract checks against (vocab size, seq_length...)."""
        return {}

    def cleanup(self, ctx: StageContext) -> None:
        """Remove work files from ctx.partial before it is published."""

    def end(self, ctx: StageContext) -> None:
        """After the output was published (or, on ranks other than 0, after the work)."""

    @classmethod
    def summary(cls, doc: dict[str, Any], record: StageRecord, out: Path) -> list[str]:
        """What its command prints after it ran (`out`: its published directory)."""
        return [f"{cls.name} {state_word(doc)}: {counts_line(doc['total'])}"]

    @classmethod
    def dry_run(cls, ctx: StageContext, overrides: dict[str, Any]) -> dict[str, Any] | None:
        """A run that publishes nothing, asked for by the settings (`overrides`, the config):
        extract's `plan`. Its document instead of the stage; None (the default): the stage
        runs."""
        return None


def counts_line(total: dict[str, Any]) -> str:
    filtered = sum(total["rows_filtered"].values())
    return (
        f"{total['rows_in']} in -> {total['rows_out']} out, "
        f"{total['rows_quarantined']} quarantined {total['quarantine_reasons'] or ''}, "
        f"{filtered} filtered {total['rows_filtered'] or ''}"
    ).replace("  ", " ")


def state_word(doc: dict[str, Any]) -> str:
    return "already complete, skipped (use --force to redo)" if doc.get("skipped") else "done"


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


@dataclass
class ItemResults:
    """Every work item's result, in item order (whichever worker made it), and its files."""

    results: list[dict[str, Any]]
    work_dir: Path

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.results[index]

    def per_source(self, first: Iterable[str] = ()) -> dict[str, Stats]:
        """The items' accounting merged per source: the `first` names in their order (each
        present even with no rows), then the others as they first appear."""
        merged = {name: Stats() for name in first}
        for result in self.results:
            for name, data in result["sources"].items():
                merged.setdefault(name, Stats()).merge(Stats.from_dict(data))
        return merged

    def row_files(self) -> list[Path]:
        return [item_paths(self.work_dir, r["index"])[0] for r in self.results]

    def quarantine_files(self) -> list[Path]:
        return [item_paths(self.work_dir, r["index"])[1] for r in self.results]


class BatchStage(Stage):
    """A stage made of independent work items, which the runner runs on the chosen executor.

    The executor sends the stage object itself to every worker (forked, or pickled into a Ray
    actor): its fields, set in `prepare`, are what the workers need (picklable), and `setup`
    adds, in each worker, what is loaded there."""

    item_unit: ClassVar[str] = "items"  # what a work item is, for progress (extract: shards)

    def plan(self, ctx: StageContext) -> list[WorkItem]:
        raise NotImplementedError

    def resources(self) -> Resources:
        """What each worker needs: one CPU, unless the stage says otherwise."""
        return Resources()

    def setup(self) -> None:
        """Per worker, once: load the tokenizer or model into the stage's fields."""

    def load(self, item: WorkItem) -> Any:
        """The item's input (I/O, in the worker)."""
        raise NotImplementedError

    def process_batch(self, batch: Any, item: WorkItem) -> BatchOutput:
        """The pure transform of one item's input."""
        raise NotImplementedError

    def finish(self, ctx: StageContext, results: ItemResults) -> dict[str, Any]:
        """Whole-dataset steps over every item's result (mix, dedup, vocabulary) and the output
        files; returns the stats document."""
        raise NotImplementedError

    def cleanup(self, ctx: StageContext) -> None:
        remove_tree(ctx.partial / "units")  # a kill meanwhile leaves no done marker without data


class Executor(Protocol):
    """Runs a batch stage's work items (skipping those done before) and returns their results
    in item order (on rank 0: the others' list is empty); it never changes what an item
    produces."""

    def map(self, stage: BatchStage, ctx: StageContext, items: list[WorkItem], work_dir: Path,
            workers_started: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
        """`workers_started` is called in this process once the workers exist (forked)."""


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
