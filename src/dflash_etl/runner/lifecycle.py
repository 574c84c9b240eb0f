"""The one lifecycle every stage runs through.

lock -> settings -> (under torchrun: join the ranks) -> prepare (inputs, fingerprint) -> skip if
complete and intact -> partial directory -> execute (the work; a batch stage's items on its
executor) -> accounting, contract, suite -> publish or fail -> report. Under torchrun rank 0
alone holds the lock and writes the run directory; every rank prepares and executes (its
executor gives it its share of the work).
Any error ends with the stage marked `failed` in the manifest, with the same message the user
sees.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_etl.core.accounting import Stats
from dflash_etl.core.config import PipelineConfig
from dflash_etl.core.distributed import DEFAULT_TIMEOUT_S, barrier, join, rank_world
from dflash_etl.core.errors import StageError, Terminated, describe_error
from dflash_etl.core.lock import RunLocked, free_reserve, run_lock, set_lock_stage
from dflash_etl.core.progress import drop_stale_records, progress_record, working
from dflash_etl.core.rundir import RunDir, Timer, output_identity, setting_changes
from dflash_etl.core.settings import dropped_choices
from dflash_etl.core.stage import BatchStage, ItemResults, RunOptions, Stage, StageContext
from dflash_etl.executors import get_executor
from dflash_etl.runner.gate import gate, warming_up
from dflash_etl.runner.settings import stage_settings


def fingerprint_of(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_stage(stage: Stage, config: PipelineConfig | None, run_dir: str | Path, *,
              upstream: tuple[tuple[str, str], ...] = (), force: bool = False,
              progress: bool | None = None, workers: int | None = None,
              executor: str | None = None, ray_address: str | None = None,
              **overrides: Any) -> dict[str, Any]:
    """Run `stage` into `run_dir/<stage>`; returns its stats document (`skipped: True` when it
    was already complete for the same inputs and its published files are intact). `upstream`:
    the (stage, kind of output) before it in its pipeline (`Pipeline.run` passes it), where its
    inputs are read from; `overrides`: its settings given by the caller (None: not given)."""
    rank, world = rank_world()
    run = RunDir(run_dir)
    options = RunOptions.resolve(config, stage.name, {
        "workers": workers, "executor": executor, "ray_address": ray_address})
    ctx = StageContext(
        name=stage.name, run=run, config=config, progress=progress, workers=options.workers,
        executor=options.executor, ray_address=options.ray_address, rank=rank, world=world,
        upstream=upstream,
    )
    lock = run_lock(run.root, stage.name) if rank == 0 else contextlib.nullcontext()
    with lock as stale:
        if rank == 0:
            set_lock_stage(run.root, stage.name)  # `dflash-etl run` holds it across stages
            drop_stale_records(run.root)
        if stale:
            mark_interrupted(run, stale)
        attempt = _Attempt()
        try:
            doc = _attempt(stage, ctx, overrides, force, attempt)
        except BaseException as exc:
            error = exc if isinstance(exc, StageError) else describe_error(exc, stage.name)
            if rank == 0 and run.root.is_dir():
                _record_failure(ctx, error, attempt)
            if error is exc or isinstance(exc, KeyboardInterrupt):
                raise
            raise error from exc
        if doc.get("skipped"):
            return doc
        if rank == 0:
            _publish_docs(ctx)
        barrier(ctx.world)  # rank 0 has published: every rank ends with the output in place
        stage.end(ctx)
        return doc


@dataclass
class _Attempt:
    """How far a stage's run got, for what a failure must leave in the manifest."""

    begun: bool = False  # the partial directory exists
    publishing: bool = False  # the commit has begun: the published output may be the new one
    timer: Timer = field(default_factory=Timer)


def _attempt(stage: Stage, ctx: StageContext, overrides: dict[str, Any], force: bool,
             attempt: _Attempt) -> dict[str, Any]:
    """settings -> (join) -> prepare -> skip, or partial -> execute -> gate -> publish."""
    run, rank = ctx.run, ctx.rank
    if rank == 0:
        _recover(run, stage.name)
    stage.settings = stage_settings(type(stage), ctx.config, run.root, overrides)
    # under torchrun every rank joins here, after rank 0's recovery; the launch's deadline for
    # a lost rank is the stage's dist_timeout_s
    ctx.rank, ctx.world = join(getattr(stage.settings, "dist_timeout_s", DEFAULT_TIMEOUT_S))
    prepared = stage.prepare(ctx)
    ctx.fingerprint = fingerprint_of(prepared)
    if not force and (done := run.completed_stats(stage.name, ctx.fingerprint, say=_say)):
        why = stage.redo_complete(ctx, done)
        if why is None:
            return done
        _say(f"{stage.name}: {why}")
    _refuse_dropped_choices(stage, ctx, overrides)
    resolved = {k: v for k, v in prepared.items() if k != "inputs"}
    if rank == 0:
        _say_what_changes(run, stage.name, resolved)
    ctx.partial = (run.begin(stage.name, ctx.fingerprint) if rank == 0
                   else run.partial_dir(stage.name))
    attempt.begun = True
    if rank == 0:
        run.update_stage(stage.name, resolved=json.loads(json.dumps(resolved, default=str)))
        stage.begin(ctx)
    barrier(ctx.world)  # rank 0 has made (or kept, to resume) the partial directory
    with working(stage.name, ctx.progress if rank == 0 else False,
                 record=progress_record(run.root, stage.name) if rank == 0 else None) as steps:
        doc = _execute(stage, ctx, steps.now)
        if rank == 0:  # publishing can fail too (a rename, a full disk): the same path
            steps.now("checking the accounting")
            check_accounting(doc, stage.name)
            gate(stage, ctx, doc, steps.now)
            steps.now("publishing")
            _publish(stage, ctx, doc, attempt)
    return doc


def _publish(stage: Stage, ctx: StageContext, doc: dict[str, Any], attempt: _Attempt) -> None:
    run = ctx.run
    stage.cleanup(ctx)
    doc["total"].update(ctx.call_totals)
    # a resumed stage's seconds include the earlier calls' work it resumed from
    seconds = attempt.timer.seconds + ctx.timings.pop("earlier_seconds", 0.0)
    attempt.publishing = True
    records = run.records()
    built_on = {up: identity for up in ctx.read_from
                if (identity := output_identity(records[up].entry if up in records
                                                else None))}
    run.commit(stage.name, doc["total"], seconds, built_on=built_on, **ctx.timings)


def _execute(stage: Stage, ctx: StageContext, step: Callable[[str], None]) -> dict[str, Any]:
    """The stage's work; a batch stage's items on its executor, then its `finish` (on rank 0:
    under torchrun the others return nothing), the gate's imports on a thread meanwhile."""
    if not isinstance(stage, BatchStage):
        return stage.execute(ctx)
    work_dir = ctx.partial / "units"
    work_dir.mkdir(exist_ok=True)
    with warming_up(stage, ctx.rank) as workers_started:
        items = stage.plan(ctx)
        results = get_executor(ctx).map(stage, ctx, items, work_dir, workers_started)
        if ctx.rank != 0:
            return {}
        step("merging the work items' results")
        return stage.finish(ctx, ItemResults(results, work_dir))


def _refuse_dropped_choices(stage: Stage, ctx: StageContext, overrides: dict[str, Any]) -> None:
    """A complete stage is not redone with another value of a choice the command does not give
    (`setting(kept=True)`: extract's layers): `extract --model M` alone after `--layers 1,3`
    would re-extract the default layers, and every stage built on them would follow."""
    entry = ctx.run.published_entry(stage.name)
    if entry is None or stage.settings is None:
        return
    given = {*overrides, *(ctx.config.section(stage.name) if ctx.config else {})}
    before = (entry.get("resolved") or {}).get("settings") or {}
    dropped = dropped_choices(stage.settings, given, before)
    if dropped:
        raise StageError(f"{stage.name}: its published output was made with "
                         f"{'; '.join(dropped)}; this command does not give "
                         f"{'them' if len(dropped) > 1 else 'it'}, so it would be redone "
                         "otherwise: give the value to keep (or the new one to change it)")


def _say_what_changes(run: RunDir, name: str, resolved: dict[str, Any]) -> None:
    """Before a complete stage is redone with other settings: which, and which complete stages
    were built on its output (they will be stale: `check` says so until they are rerun; a
    forced rerun with the same settings says nothing, and `check` compares the outputs)."""
    entry = run.published_entry(name)
    if entry is None:
        return
    changes = setting_changes(entry.get("resolved"), json.loads(json.dumps(resolved,
                                                                           default=str)))
    dependents = [other for other, record in run.records().items()
                  if record.complete and name in record.built_on]
    if not changes:  # forced with the same settings: the same output, most likely
        return
    what = f"other settings than its published output: {'; '.join(changes[:8])}"
    after = (f"; {', '.join(dependents)} {'was' if len(dependents) == 1 else 'were'} built on "
             f"that output and will be stale: rerun {'it' if len(dependents) == 1 else 'them'} "
             "after this (`dflash-etl check` reports stale stages)" if dependents else "")
    _say(f"{name}: redoing with {what}{after}")


def check_accounting(doc: dict[str, Any], stage: str) -> None:
    """Every row the stage read is out, quarantined or filtered, in total and per source."""
    for name, counts in [("total", doc["total"]), *doc.get("sources", {}).items()]:
        Stats.from_dict(counts).check(f"{stage} ({name})")


def _record_failure(ctx: StageContext, error: BaseException, attempt: _Attempt) -> None:
    """The manifest says `failed` with the message (never `running`); the report shows it. A
    stage that was complete before this attempt (a forced rerun, new settings, a typo on the
    command line) stays complete with its output, the attempt recorded under `last_attempt`,
    unless the attempt had begun to publish: a failed command never breaks a complete stage."""
    run, stage = ctx.run, ctx.name
    message = str(error) or type(error).__name__
    if isinstance(error, KeyboardInterrupt):
        what = "terminated (SIGTERM)" if isinstance(error, Terminated) else "interrupted"
        message = f"{what}: completed work is kept in the partial directory; rerun to resume"
    kept = None if attempt.publishing else run.published_entry(stage)

    def record() -> None:
        if kept is None:
            run.fail(stage, message)
        else:
            run.keep_complete(stage, kept, message)
            _say(f"{stage}: the complete output published before is kept (the manifest's "
                 "last_attempt records this failure)")

    try:
        record()
    except OSError as exc:
        if exc.errno == errno.ENOSPC:  # the lock's reserve makes room for the manifest
            free_reserve(run.root)
            with contextlib.suppress(OSError):
                record()
    if attempt.begun:
        _publish_docs(ctx)


def _publish_docs(ctx: StageContext) -> None:
    from dflash_etl.report import publish_docs  # the report's pages: loaded when one is due

    publish_docs(ctx.run.root)


def _recover(run: RunDir, name: str) -> None:
    """Finish the publishing a killed process left half done: this stage's, and any other's
    (a later stage reads its inputs' status)."""
    for other in [s for s, record in run.records().items() if record.status == "publishing"
                  and s != name] + [name]:
        if recovered := run.recover(other):
            _say(recovered)


def settle_interrupted(run_root: str | Path, reader: str) -> None:
    """For a command that only reads a run (check, export, docs): what a process that died left
    — a stage `running`, a publish half done — settled as the next stage command would settle
    it, so no stage reads `running` after its process died (a killed `--force` rerun leaves
    the earlier output complete). Nothing is done while a live process holds the run, or where
    the run cannot be written (an archived run: the reader says what it found)."""
    run = RunDir(run_root)
    if not run.manifest_path.is_file():
        return
    try:
        records = run.records()
    except StageError:  # the reader names the corrupt manifest
        return
    if not any(r.status in ("running", "publishing") for r in records.values()):
        return
    try:
        with run_lock(run.root, reader) as stale:
            settle(run, stale or {})
    except (RunLocked, OSError):  # a live holder, or a read-only run
        return


def settle(run: RunDir, stale: dict[str, Any]) -> None:
    """Under the run lock, what the dead holder `stale` left: a half-done publish finished,
    then every stage still `running` marked (the earlier output kept complete)."""
    for stage in [s for s, r in run.records().items() if r.status == "publishing"]:
        if recovered := run.recover(stage):
            _say(recovered)
    mark_interrupted(run, stale)


def mark_interrupted(run: RunDir, stale: dict[str, Any]) -> None:
    """A holder that died (SIGKILL, OOM) left its stage `running`: say what happened. Every
    stage still `running` is its (the record names `run` under `dflash-etl run`, or the stage it
    was on when it died; we hold the lock now, so no other process runs one)."""
    for stage, record in run.records().items():
        if record.status == "running":
            message = (f"the process running it (pid {stale.get('pid')} on {stale.get('host')}) "
                       "died before it finished; its completed work is kept and a rerun resumes it")
            if (kept := run.published_entry(stage)) is not None:  # a rerun of a complete stage
                run.keep_complete(stage, kept, message)
            else:
                run.fail(stage, message)
            _say(f"{stage}: {message}")
