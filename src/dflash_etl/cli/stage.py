"""One stage's command: its flags, its run and what it prints after; `dflash-etl <stage>` and
`python -m dflash_etl.stages.<stage>` (`stage_main`) both go through here.

It reaches the stage modules through the registry only, so a stage's `main()` can import it
without importing the rest of the CLI (which imports the stages and the hand-off).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_etl.cli.flags import add_settings_flags
from dflash_etl.core.config import ConfigError, load_config
from dflash_etl.core.errors import StageError, Terminated, describe_error
from dflash_etl.core.progress import size_text
from dflash_etl.core.rundir import PLAN_FILE
from dflash_etl.executors.torchrun import relaunch
from dflash_etl.stages import STAGES, StageSpec


def say(text: str = "") -> None:
    print(text, flush=True)


def _counts_line(total: dict[str, Any]) -> str:
    filtered = sum(total["rows_filtered"].values())
    return (
        f"{total['rows_in']} in -> {total['rows_out']} out, "
        f"{total['rows_quarantined']} quarantined {total['quarantine_reasons'] or ''}, "
        f"{filtered} filtered {total['rows_filtered'] or ''}"
    ).replace("  ", " ")


def _state(doc: dict[str, Any]) -> str:
    return "already complete, skipped (use --force to redo)" if doc.get("skipped") else "done"


def settings_overrides(args: argparse.Namespace, settings: type) -> dict[str, Any]:
    """A stage's settings given on the command line (None: not given; the config decides). A
    subcommand without a flag for a setting (e.g. `run`) leaves it to the config."""
    return {f.name: getattr(args, f.name, None) for f in dataclasses.fields(settings)}


def _executor(args: argparse.Namespace) -> dict[str, Any]:
    return {"executor": getattr(args, "executor", None),
            "ray_address": getattr(args, "ray_address", None)}


def run_one(spec: StageSpec, args: argparse.Namespace) -> int:
    """Run one stage with the command line's settings and print what it wrote."""
    config = load_config(args.config) if args.config else None
    options: dict[str, Any] = {"force": args.force}
    if spec.batch:
        options.update(workers=args.workers, **_executor(args))
    if spec.settings_class is not None:
        options.update(settings_overrides(args, spec.settings_class))
    if "launcher" in options:  # --launcher torchrun: the command again, under torchrun
        code = relaunch(config, options, getattr(args, "argv", None), spec.name)
        if code is not None:
            return code
    doc = spec.module().run(config, args.run, **options)
    if not doc:  # a rank other than 0 of a torchrun launch: rank 0 reports
        return 0
    return SUMMARIES.get(spec.name, _summary)(spec.name, Path(args.run), doc)


def cmd_stage(args: argparse.Namespace) -> int:
    return run_one(STAGES[args.command], args)


def _summary(name: str, run: Path, doc: dict[str, Any]) -> int:
    say(f"{name} {_state(doc)}: {_counts_line(doc['total'])}")
    return 0


def _summary_ingest(name: str, run: Path, doc: dict[str, Any]) -> int:
    out = run / "ingest"
    say(f"ingest {_state(doc)}: {_counts_line(doc['total'])}")
    for source, stats in doc["sources"].items():
        say(f"  {source}: {_counts_line(stats)}")
    say(f"  conversations: {out / 'conversations'}")
    say(f"  quarantine:    {out / 'quarantine.parquet'}")
    say(f"  stats:         {out / 'stats.json'}")
    for warning in doc.get("warnings", []):
        say(f"  warning: {warning}")
    return 0


def _summary_tokenize(name: str, run: Path, doc: dict[str, Any]) -> int:
    out = run / "tokenize"
    total = doc["total"]
    say(f"tokenize {_state(doc)}: conversations {_counts_line(total)}")
    say(f"  rows written: {total.get('rows_written')}, tokens: {total.get('tokens')}, "
        f"supervised: {total.get('supervised_tokens')}, strategies: {total.get('strategies')}")
    say(f"  draft vocab: {total.get('draft_vocab')}")
    say(f"  dataset:  {out / 'dataset'}  (datasets.load_from_disk)")
    say(f"  probe:    {out / 'probe.json'}")
    say(f"  stats:    {out / 'stats.json'}")
    return 0


def _summary_regenerate(name: str, run: Path, doc: dict[str, Any]) -> int:
    out = run / "regenerate"
    total = doc["total"]
    say(f"regenerate {_state(doc)}: conversations {_counts_line(total)}")
    dropped = total.get("dropped_replies") or {}
    if "generated_replies" not in total:  # a stage completed by an older version: its counts
        total = {**total, "generated_replies": total.get("generated_turns")}
    say(f"  replies: {total.get('generated_replies')} generated, "
        f"{total.get('generated_turns')} kept, {sum(dropped.values())} filtered or quarantined "
        f"with their conversations {dropped or ''}".rstrip())
    say(f"  finish reasons of the kept: {total.get('finish_reasons')}")
    for mode, cut in (total.get("truncation") or {}).items():
        say(f"  thinking {mode}: {cut['truncated']} of {cut['replies']} replies cut at "
            f"max_new_tokens ({100 * cut['share']:.0f}%)")
    say(f"  conversations: {out / 'conversations'}  (tokenize reads these now)")
    for warning in doc.get("warnings", []):
        say(f"  WARNING: {warning}")
    say(f"  quarantine:    {out / 'quarantine.parquet'}")
    say(f"  stats:         {out / 'stats.json'}")
    return 0


def _summary_extract(name: str, run: Path, doc: dict[str, Any]) -> int:
    if doc.get("plan"):
        return _summary_extract_plan(run, doc)
    out = run / "extract"
    total = doc["total"]
    say(f"extract {_state(doc)}: rows {_counts_line(total)}")
    say(f"  layers {total.get('layers')} of {total.get('n_layers')}, hidden "
        f"{total.get('hidden_size')}, {total.get('dtype')}, {total.get('tokens')} tokens, "
        f"padding {total.get('padding_share')}")
    say(f"  hidden states: {out / 'hidden_states'}  ({total.get('format')})")
    say(f"  index:         {out / 'index.parquet'}")
    from dflash_etl.core.rundir import RunDir

    ranks = RunDir(run).manifest().get("stages", {}).get("extract", {}).get("ranks") or 1
    if ranks > 1 and not doc.get("skipped"):  # the manifest's record: stats.json is the data's
        say(f"  ranks:         {ranks} (torchrun; the output is one process's, byte for byte)")
    return 0


def _summary_extract_plan(run: Path, doc: dict[str, Any]) -> int:
    data, sample, projected = doc["dataset"], doc["measured"], doc["projected"]
    say(f"extract plan (a dry run: nothing extracted or published) on {doc['device']}:")
    say(f"  dataset: {data['rows']} rows, {data['tokens']} tokens in {data['batches']} batches "
        f"(padding {doc['padding_share']})")
    say(f"  layers {doc['stored_layers']} of {doc['n_layers']} stored, hidden "
        f"{doc['hidden_size']}, {doc['dtype']}, {doc['format']}")
    say(f"  measured: {sample['batches']} batches, {sample['tokens']} tokens in "
        f"{sample['seconds']} s ({sample['tokens_per_s']} tokens/s), "
        f"{size_text(sample['bytes'])} written")
    say(f"  projected: {size_text(projected['bytes'])} on disk, {projected['hours']} hours "
        f"({projected['seconds']} s) on this device")
    say(f"  disk: {doc['advice']}")
    say(f"  plan: {run / PLAN_FILE}")
    return 0


def _summary_train(name: str, run: Path, doc: dict[str, Any]) -> int:
    from dflash_etl.core.rundir import RunDir

    out = run / "train"
    total = doc["total"]
    # timings live in the manifest, not in stats.json (whose bytes do not depend on the machine)
    timing = RunDir(run).manifest().get("stages", {}).get("train", {})
    say(f"train {_state(doc)}: rows {_counts_line(total)}")
    say(f"  {total.get('steps')} steps ({total.get('steps_this_run')} this run, "
        f"{timing.get('steps_per_s')} steps/s), final loss {total.get('final_loss')}, "
        f"{total.get('drafter_parameters')} drafter parameters")
    say(f"  acceptance length tau on {total.get('eval_prompts')} held-out prompts: "
        f"{_fmt(total.get('tau_untrained'))} untrained -> {_fmt(total.get('tau_final'))} "
        f"trained (block {total.get('block_size')})")
    say(f"  drafter: {out / 'drafter'}")
    say(f"  eval:    {out / 'eval.json'}")
    return 0


# what each stage's subcommand prints after it ran (a stage without one: its counts)
SUMMARIES: dict[str, Callable[[str, Path, dict[str, Any]], int]] = {
    "ingest": _summary_ingest, "regenerate": _summary_regenerate,
    "tokenize": _summary_tokenize, "extract": _summary_extract, "train": _summary_train,
}


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def stage_args(p: argparse.ArgumentParser, config_required: bool) -> None:
    """What every stage subcommand (and `run`) takes, besides its settings."""
    p.add_argument("--config", required=config_required, help="pipeline.toml")
    p.add_argument("--run", default="runs/default", help="run directory (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="redo a stage that is complete")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes (default: [run] workers, else one per core)")
    p.add_argument("--executor", choices=["local", "ray"], default=None,
                   help="where ingest's and tokenize's work items run (default: [run] "
                        "executor, else local)")
    p.add_argument("--ray-address", default=None,
                   help="--executor ray: 'auto' or HOST:PORT of a running cluster "
                        "(default: start a local Ray)")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error")


def stage_parser(p: argparse.ArgumentParser, spec: StageSpec) -> argparse.ArgumentParser:
    """One stage's flags: the common ones and one per field of its settings dataclass."""
    stage_args(p, config_required=spec.needs_config)
    settings = spec.settings_class
    if settings is not None:
        add_settings_flags(p, settings, spec.section or spec.name)
    p.set_defaults(func=cmd_stage, command=spec.name)
    return p


def module_main(argv: list[str] | None, add_arguments: Any, run_from_args: Any, prog: str,
                doc: str | None, command: str) -> int:
    """A `python -m` entry of a command that is not a stage (export, eval, show): its parser,
    then `execute`."""
    parser = add_arguments(argparse.ArgumentParser(prog=prog,
                                                   description=(doc or "").splitlines()[0]))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.func, args.command = run_from_args, command
    return execute(args)


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


def stage_main(name: str, argv: list[str] | None = None) -> int:
    """`python -m dflash_etl.stages.<name>`: the stage's subcommand, with only its parser."""
    spec = STAGES[name]
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=f"python -m {spec.module_path}", description=spec.help)
    args = stage_parser(parser, spec).parse_args(argv)
    args.argv = argv  # what --launcher torchrun runs again
    return execute(args)
