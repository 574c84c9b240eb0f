"""One stage's command, `dflash-etl <stage>` (and `python -m dflash_etl <stage>`): its flags from
its class (the common ones, one per setting), its run through the pipeline, and what it prints
after; `execute` runs any parsed command with errors as one line."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import traceback
from typing import Any

from dflash_etl.cli.flags import add_settings_flags
from dflash_etl.core.config import ConfigError
from dflash_etl.core.distributed import leave
from dflash_etl.core.errors import StageError, Terminated, describe_error
from dflash_etl.core.rundir import RunDir
from dflash_etl.core.stage import BatchStage, RunOptions, Stage
from dflash_etl.executors.torchrun import relaunch
from dflash_etl.runner import Pipeline

# how a batch stage's work items run: flags of the batch stages (and of `run`) alone
WORK_ITEM_FLAGS = {"workers": "--workers", "executor": "--executor",
                   "ray_address": "--ray-address"}


def say(text: str = "") -> None:
    print(text, flush=True)


def settings_overrides(args: argparse.Namespace, settings: type) -> dict[str, Any]:
    """A stage's settings given on the command line (None: not given; the config decides). A
    subcommand without a flag for a setting (e.g. `run`) leaves it to the config."""
    return {f.name: getattr(args, f.name, None) for f in dataclasses.fields(settings)}


def run_one(stage: type[Stage], args: argparse.Namespace, pipeline: Pipeline) -> int:
    """Run one stage with the command line's settings and print what it wrote."""
    config = pipeline.load_config(args.config) if args.config else None
    options: dict[str, Any] = {"force": args.force}
    given = {key: getattr(args, key, None) for key in WORK_ITEM_FLAGS}
    if issubclass(stage, BatchStage):
        _refuse_ray_address(given, RunOptions.resolve(config, stage.name, given))
        options.update(given)
    elif any(value is not None for value in given.values()) and args.command == stage.name:
        _refuse_work_item_flags(stage, given, pipeline)
    if stage.Settings is not None:
        options.update(settings_overrides(args, stage.Settings))
    if "launcher" in options:  # --launcher torchrun: the command again, under torchrun
        code = relaunch(config, options, getattr(args, "argv", None), stage.name)
        if code is not None:
            return code
    doc = pipeline.run(stage.name, config, args.run, **options)
    if not doc:  # a rank other than 0 of a torchrun launch: rank 0 reports
        return 0
    run = RunDir(args.run)
    for line in stage.summary(doc, run.record(stage.name), run.stage_dir(stage.name)):
        say(line)
    return 0


def _refuse_work_item_flags(stage: type[Stage], given: dict[str, Any], pipeline: Pipeline
                            ) -> None:
    """A stage that does not split into work items has no use for how they run."""
    flags = ", ".join(WORK_ITEM_FLAGS[k] for k, v in given.items() if v is not None)
    batch = [s.name for s in pipeline if issubclass(s, BatchStage)]
    launch = (" (it runs on several processes with --launcher torchrun)"
              if stage.Settings and "launcher" in {f.name for f in
                                                  dataclasses.fields(stage.Settings)} else "")
    raise StageError(f"{stage.name} does not take {flags}: they say how work items run in "
                     f"worker processes ({', '.join(batch)}), and {stage.name} has none{launch}")


def _refuse_ray_address(given: dict[str, Any], options: RunOptions) -> None:
    if given.get("ray_address") and options.executor != "ray":
        raise StageError(f"--ray-address {given['ray_address']} applies to the Ray executor: add "
                         "--executor ray (or [run] executor = \"ray\" in the config)")


def cmd_stage(args: argparse.Namespace) -> int:
    return run_one(args.pipeline[args.command], args, args.pipeline)


def stage_args(p: argparse.ArgumentParser, config_required: bool, work_items: bool) -> None:
    """What every stage subcommand (and `run`) takes, besides its settings; `work_items`: the
    flags of how a batch stage's items run (on another stage they are refused, naming why)."""
    p.add_argument("--config", required=config_required, help="pipeline.toml")
    p.add_argument("--run", default="runs/default", help="run directory (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="redo a stage that is complete")
    shown = (lambda text: text) if work_items else (lambda text: argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=None,
                   help=shown("worker processes (default: [run] workers, else one per core)"))
    p.add_argument("--executor", choices=["local", "ray"], default=None,
                   help=shown("where the work items run (default: [run] executor, else local)"))
    p.add_argument("--ray-address", default=None,
                   help=shown("--executor ray: 'auto' or HOST:PORT of a running cluster "
                              "(default: start a local Ray)"))
    p.add_argument("--debug", action="store_true", help="print the traceback of an error")


def stage_parser(p: argparse.ArgumentParser, stage: type[Stage], pipeline: Pipeline
                 ) -> argparse.ArgumentParser:
    """One stage's flags: the common ones and one per field of its settings class. A stage that
    reads no stage's output reads the config's sources: it needs --config."""
    stage_args(p, config_required=not stage.reads,
               work_items=issubclass(stage, BatchStage))
    if stage.Settings is not None:
        add_settings_flags(p, stage.Settings, stage.name)
    p.set_defaults(func=cmd_stage, command=stage.name, pipeline=pipeline)
    return p


def execute(args: argparse.Namespace) -> int:
    """Run a parsed command: a user error is one line and exit 1, never a traceback."""
    terminate_as_interrupt()
    try:
        return int(args.func(args) or 0)
    except Terminated:
        print("terminated (SIGTERM): completed work is kept; rerun to resume", file=sys.stderr,
              flush=True)
        return 143
    except (ConfigError, StageError) as exc:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted: completed work is kept; rerun to resume", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug, or an error outside a stage: one paragraph, not a trace
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"error: {describe_error(exc, args.command)}", file=sys.stderr, flush=True)
        return 1
    finally:
        leave()


def terminate_as_interrupt() -> None:
    """SIGTERM raises Terminated in this process (a KeyboardInterrupt: the stage is marked
    failed, the lock released, exit 143 with a message) instead of ending it with the stage left
    `running`; processes forked from it (pool workers) keep the default, dying at once."""
    if threading.current_thread() is not threading.main_thread():
        return  # signals are the main thread's; an embedding caller keeps its own
    main = os.getpid()

    def on_sigterm(signum: int, frame: Any) -> None:
        if os.getpid() != main:  # a forked worker: the default, as if no handler were here
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated()

    signal.signal(signal.SIGTERM, on_sigterm)

