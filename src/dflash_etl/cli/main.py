"""`dflash-etl`: one subcommand per stage, plus `run` (every stage), `check` (for CI) and `docs`
(the run's HTML report)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_etl.cli import init
from dflash_etl.cli.flags import add_settings_flags, field_help
from dflash_etl.core.config import DEFAULT_CONFIG, ConfigError, PipelineConfig, load_config
from dflash_etl.core.errors import StageError
from dflash_etl.stages import STAGES, StageSpec


def _say(text: str = "") -> None:
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


def _overrides(args: argparse.Namespace, settings: type) -> dict[str, Any]:
    """A stage's settings given on the command line (None: not given; the config decides). A
    subcommand without a flag for a setting (e.g. `run`) leaves it to the config."""
    return {f.name: getattr(args, f.name, None) for f in dataclasses.fields(settings)}


def _executor(args: argparse.Namespace) -> dict[str, Any]:
    return {"executor": getattr(args, "executor", None),
            "ray_address": getattr(args, "ray_address", None)}


def _run_one(spec: StageSpec, args: argparse.Namespace) -> int:
    """Run one stage with the command line's settings and print what it wrote."""
    config = load_config(args.config) if args.config else None
    options: dict[str, Any] = {"force": args.force}
    if spec.batch:
        options.update(workers=args.workers, **_executor(args))
    if spec.settings_class is not None:
        options.update(_overrides(args, spec.settings_class))
    if spec.name == "extract":  # --launcher torchrun: the command again, under torchrun
        from dflash_etl.stages.extract import relaunch

        code = relaunch(config, options, getattr(args, "argv", None))
        if code is not None:
            return code
    doc = spec.module().run(config, args.run, **options)
    return SUMMARIES.get(spec.name, _summary)(spec.name, Path(args.run), doc)


def cmd_stage(args: argparse.Namespace) -> int:
    return _run_one(STAGES[args.command], args)


def _summary(name: str, run: Path, doc: dict[str, Any]) -> int:
    _say(f"{name} {_state(doc)}: {_counts_line(doc['total'])}")
    return 0


def _summary_ingest(name: str, run: Path, doc: dict[str, Any]) -> int:
    out = run / "ingest"
    _say(f"ingest {_state(doc)}: {_counts_line(doc['total'])}")
    for source, stats in doc["sources"].items():
        _say(f"  {source}: {_counts_line(stats)}")
    _say(f"  conversations: {out / 'conversations'}")
    _say(f"  quarantine:    {out / 'quarantine.parquet'}")
    _say(f"  stats:         {out / 'stats.json'}")
    for warning in doc.get("warnings", []):
        _say(f"  warning: {warning}")
    return 0


def _summary_tokenize(name: str, run: Path, doc: dict[str, Any]) -> int:
    out = run / "tokenize"
    total = doc["total"]
    _say(f"tokenize {_state(doc)}: conversations {_counts_line(total)}")
    _say(f"  rows written: {total.get('rows_written')}, tokens: {total.get('tokens')}, "
         f"supervised: {total.get('supervised_tokens')}, strategies: {total.get('strategies')}")
    _say(f"  draft vocab: {total.get('draft_vocab')}")
    _say(f"  dataset:  {out / 'dataset'}  (datasets.load_from_disk)")
    _say(f"  probe:    {out / 'probe.json'}")
    _say(f"  stats:    {out / 'stats.json'}")
    return 0


def _summary_regenerate(name: str, run: Path, doc: dict[str, Any]) -> int:
    out = run / "regenerate"
    total = doc["total"]
    _say(f"regenerate {_state(doc)}: conversations {_counts_line(total)}")
    dropped = total.get("dropped_replies") or {}
    if "generated_replies" not in total:  # a stage completed by an older version: its counts
        total = {**total, "generated_replies": total.get("generated_turns")}
    _say(f"  replies: {total.get('generated_replies')} generated, "
         f"{total.get('generated_turns')} kept, {sum(dropped.values())} filtered or quarantined "
         f"with their conversations {dropped or ''}".rstrip())
    _say(f"  finish reasons of the kept: {total.get('finish_reasons')}")
    for mode, cut in (total.get("truncation") or {}).items():
        _say(f"  thinking {mode}: {cut['truncated']} of {cut['replies']} replies cut at "
             f"max_new_tokens ({100 * cut['share']:.0f}%)")
    _say(f"  conversations: {out / 'conversations'}  (tokenize reads these now)")
    for warning in doc.get("warnings", []):
        _say(f"  WARNING: {warning}")
    _say(f"  quarantine:    {out / 'quarantine.parquet'}")
    _say(f"  stats:         {out / 'stats.json'}")
    return 0


def _summary_extract(name: str, run: Path, doc: dict[str, Any]) -> int:
    if not doc:  # a torchrun rank other than 0: rank 0 reports
        return 0
    if doc.get("plan"):
        return _summary_extract_plan(run, doc)
    out = run / "extract"
    total = doc["total"]
    _say(f"extract {_state(doc)}: rows {_counts_line(total)}")
    _say(f"  layers {total.get('layers')} of {total.get('n_layers')}, hidden "
         f"{total.get('hidden_size')}, {total.get('dtype')}, {total.get('tokens')} tokens, "
         f"padding {total.get('padding_share')}")
    _say(f"  hidden states: {out / 'hidden_states'}  ({total.get('format')})")
    _say(f"  index:         {out / 'index.parquet'}")
    return 0


def _summary_extract_plan(run: Path, doc: dict[str, Any]) -> int:
    from dflash_etl.stages.extract import PLAN_FILE, size_text

    data, sample, projected = doc["dataset"], doc["measured"], doc["projected"]
    _say(f"extract plan (a dry run: nothing extracted or published) on {doc['device']}:")
    _say(f"  dataset: {data['rows']} rows, {data['tokens']} tokens in {data['batches']} batches "
         f"(padding {doc['padding_share']})")
    _say(f"  layers {doc['stored_layers']} of {doc['n_layers']} stored, hidden "
         f"{doc['hidden_size']}, {doc['dtype']}, {doc['format']}")
    _say(f"  measured: {sample['batches']} batches, {sample['tokens']} tokens in "
         f"{sample['seconds']} s ({sample['tokens_per_s']} tokens/s), "
         f"{size_text(sample['bytes'])} written")
    _say(f"  projected: {size_text(projected['bytes'])} on disk, {projected['hours']} hours "
         f"({projected['seconds']} s) on this device")
    _say(f"  disk: {doc['advice']}")
    _say(f"  plan: {run / PLAN_FILE}")
    return 0


def _summary_train(name: str, run: Path, doc: dict[str, Any]) -> int:
    if not doc:  # a torchrun rank other than 0: rank 0 reports
        return 0
    from dflash_etl.core.rundir import RunDir

    out = run / "train"
    total = doc["total"]
    # timings live in the manifest, not in stats.json (whose bytes do not depend on the machine)
    timing = RunDir(run).manifest().get("stages", {}).get("train", {})
    _say(f"train {_state(doc)}: rows {_counts_line(total)}")
    _say(f"  {total.get('steps')} steps ({total.get('steps_this_run')} this run, "
         f"{timing.get('steps_per_s')} steps/s), final loss {total.get('final_loss')}, "
         f"{total.get('drafter_parameters')} drafter parameters")
    _say(f"  acceptance length tau on {total.get('eval_prompts')} held-out prompts: "
         f"{_fmt(total.get('tau_untrained'))} untrained -> {_fmt(total.get('tau_final'))} "
         f"trained (block {total.get('block_size')})")
    _say(f"  drafter: {out / 'drafter'}")
    _say(f"  eval:    {out / 'eval.json'}")
    return 0


# what each stage's subcommand prints after it ran (a stage without one: its counts)
SUMMARIES: dict[str, Callable[[str, Path, dict[str, Any]], int]] = {
    "ingest": _summary_ingest, "regenerate": _summary_regenerate,
    "tokenize": _summary_tokenize, "extract": _summary_extract, "train": _summary_train,
}


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _configured(config: PipelineConfig, spec: StageSpec) -> bool:
    """Whether the config gives `spec` what `run` needs to run it (its target model or
    tokenizer: [<stage>] <requires>, or a [target] section where that stands for it)."""
    if spec.requires is None:
        return True
    return bool(config.section(spec.section or spec.name).get(spec.requires)
                or (spec.target_fallback and config.section("target")))


PROBE_LIMITS = ("render_timeout_s", "render_size_factor", "render_size_extra")


def cmd_probe(args: argparse.Namespace) -> int:
    from dflash_etl.stages import tokenize

    limits = {name: getattr(args, name) for name in PROBE_LIMITS
              if getattr(args, name) is not None}
    settings = tokenize.TokenizeSettings.from_sources(
        {}, {"model": args.model, "chat_template": args.chat_template, **limits}, None)
    probe = tokenize.probe(settings).to_dict()
    if args.json:
        Path(args.json).write_text(json.dumps(probe, indent=2))
    width = max(len(k) for k in probe)
    for key, value in probe.items():
        if key in ("generation_prompt", "eot_text", "post_eot", "generation_prefill"):
            value = repr(value)
        _say(f"{key:<{width}}  {value}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Every stage that exists, in order, on one config (the embedded default by default)."""
    from dflash_etl.core.lock import run_lock

    args.config = args.config or str(DEFAULT_CONFIG)
    load_config(args.config)  # a bad config is refused before the run directory is touched
    with run_lock(args.run, "run"):  # held across the stages: no other process in between
        return _run_stages(args)


def _run_stages(args: argparse.Namespace) -> int:
    _say(f"config: {args.config}\nrun:    {args.run}")
    config = load_config(args.config)
    ran: set[str] = set()
    for spec in STAGES:
        if not set(spec.after) <= ran:
            continue
        if not _configured(config, spec):
            if any(spec.name in later.after for later in STAGES):  # say why those do not run
                _say(f"{spec.name} skipped: no [{spec.section}] {spec.requires} in the config")
            continue
        code = _run_one(spec, args)
        if code:
            return code
        ran.add(spec.name)
    _say(f"manifest: {Path(args.run) / 'manifest.json'}")
    _say(f"report:   {_docs(args.run)}")
    return 0


def _docs(run: str) -> Path:
    from dflash_etl.report import build_docs

    return build_docs(run) / "index.html"


def cmd_docs(args: argparse.Namespace) -> int:
    """Rebuild runs/<name>/docs/ from the files the run left (no data is re-validated)."""
    if not (Path(args.run) / "manifest.json").exists():
        raise StageError(f"{args.run} is not a run directory (no manifest.json): give the "
                         "--run directory a `dflash-etl run` or stage wrote")
    _say(f"report: {_docs(args.run)}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from dflash_etl.validation.check import check_path

    report = check_path(Path(args.path), suite=args.suite)
    _say(report["summary"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    if args.report:
        from dflash_etl.report import build_check_report

        _say(f"report: {build_check_report(report, args.report)}")
    return 0 if report["passed"] else 1


def _stage_args(p: argparse.ArgumentParser, config_required: bool) -> None:
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


def _stage_parser(p: argparse.ArgumentParser, spec: StageSpec) -> argparse.ArgumentParser:
    """One stage's flags: the common ones and one per field of its settings dataclass."""
    _stage_args(p, config_required=spec.needs_config)
    settings = spec.settings_class
    if settings is not None:
        add_settings_flags(p, settings, spec.section or spec.name)
    p.set_defaults(func=cmd_stage, command=spec.name)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-etl",
        description="Validation-first ETL for speculative-decoding drafter training data.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    for spec in STAGES:
        _stage_parser(sub.add_parser(spec.name, help=spec.help, description=spec.help), spec)

    from dflash_etl.stages.tokenize import TokenizeSettings

    tokenize = {f.name: f for f in dataclasses.fields(TokenizeSettings)}
    p = sub.add_parser("probe-template", help="what a chat template does (nothing written)")
    p.add_argument("--model", required=True, metavar="DIR", help=field_help(tokenize["model"]))
    p.add_argument("--chat-template", metavar="FILE",
                   help=field_help(tokenize["chat_template"]))
    p.add_argument("--json", help="also write the probe as JSON here")
    for name in PROBE_LIMITS:  # the stage's render limits: a hostile template cannot hang it
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None,
                       type=type(tokenize[name].default), metavar="N",
                       help=field_help(tokenize[name]))
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("run", help="every stage on a config (default: the embedded data/)")
    _stage_args(p, config_required=False)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check", help="contracts and suites on a stage output or a whole run "
                                     "(exit 0/1)")
    p.add_argument("path", help="a stage output directory (e.g. runs/x/ingest) or a run directory")
    p.add_argument("--suite", help="only the outputs of this suite: "
                                   + " or ".join(sorted({s.suite for s in STAGES if s.suite})))
    p.add_argument("--json", help="also write the full report as JSON here")
    p.add_argument("--report", help="also write an HTML report: a directory (index.html inside) "
                                    "or a .html file")
    p.set_defaults(func=cmd_check)

    from dflash_etl.handoff import export

    p = sub.add_parser("export", help="a finished run as speculators or SpecForge read it, "
                       "and the command that trains on it")
    export.add_arguments(p).set_defaults(func=export.run_from_args)

    p = sub.add_parser("docs", help="rebuild a run's HTML report (runs/<name>/docs/index.html)")
    p.add_argument("--run", default="runs/default", help="run directory (default: %(default)s)")
    p.set_defaults(func=cmd_docs)
    init.add_parser(sub)
    return parser


def _start_suite_helper(command: str | None, argv: list[str]) -> None:
    """A gated stage (or `run`) is coming: start the suite helper before anything heavy is
    imported (building the parser imports the stage modules)."""
    gated = {s.name for s in STAGES if s.suite} | {"run"}
    if command in gated and not {"-h", "--help"} & set(argv):
        from dflash_etl.validation import suite_helper

        suite_helper.start()


def execute(args: argparse.Namespace) -> int:
    """Run a parsed command: a user error is one line and exit 1, never a traceback."""
    try:
        return int(args.func(args) or 0)
    except (ConfigError, StageError) as exc:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted: completed work is kept; rerun to resume", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug, or an error outside a stage: one paragraph, not a trace
        from dflash_etl.core.runner import describe_error

        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"error: {describe_error(exc, args.command)}", file=sys.stderr, flush=True)
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    _start_suite_helper(command, argv)
    args = build_parser().parse_args(argv)
    if command in {s.name for s in STAGES}:  # its own arguments: what --launcher torchrun reruns
        args.argv = argv[:argv.index(command)] + argv[argv.index(command) + 1:]
    return execute(args)


def stage_main(name: str, argv: list[str] | None = None) -> int:
    """`python -m dflash_etl.stages.<name>`: the stage's subcommand, with only its parser."""
    spec = STAGES[name]
    argv = list(sys.argv[1:] if argv is None else argv)
    _start_suite_helper(name, argv)
    parser = argparse.ArgumentParser(prog=f"python -m {spec.module_path}", description=spec.help)
    args = _stage_parser(parser, spec).parse_args(argv)
    args.argv = argv  # what --launcher torchrun runs again
    return execute(args)


if __name__ == "__main__":
    raise SystemExit(main())
