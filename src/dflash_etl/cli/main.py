"""`dflash-etl`: one subcommand per stage, plus `run` (every stage), `check` (for CI) and `docs`
(the run's HTML report)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import dflash_etl.cli.stage as stage_command
from dflash_etl.cli import init
from dflash_etl.cli.flags import field_help
from dflash_etl.cli.stage import execute, say, stage_args, stage_parser
from dflash_etl.core.config import DEFAULT_CONFIG, PipelineConfig, load_config
from dflash_etl.core.errors import StageError
from dflash_etl.stages import STAGES, StageSpec


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
        say(f"{key:<{width}}  {value}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Every stage that exists, in order, on one config (the embedded default by default)."""
    from dflash_etl.core.lock import run_lock

    args.config = args.config or str(DEFAULT_CONFIG)
    load_config(args.config)  # a bad config is refused before the run directory is touched
    with run_lock(args.run, "run"):  # held across the stages: no other process in between
        return _run_stages(args)


def _run_stages(args: argparse.Namespace) -> int:
    say(f"config: {args.config}\nrun:    {args.run}")
    config = load_config(args.config)
    ran: dict[str, float] = {}  # stage -> its wall seconds in this call
    for spec in STAGES:
        if not set(spec.after) <= set(ran):
            continue
        if not _configured(config, spec):
            if any(spec.name in later.after for later in STAGES):  # say why those do not run
                say(f"{spec.name} skipped: no [{spec.section}] {spec.requires} in the config")
            continue
        start = time.perf_counter()
        code = stage_command.run_one(spec, args)
        if code:
            return code
        ran[spec.name] = time.perf_counter() - start
    say("wall time: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in ran.items())
        + f"; {sum(ran.values()):.1f} s in all")
    say(f"manifest: {Path(args.run) / 'manifest.json'}")
    say(f"report:   {_docs(args.run)}")
    return 0


def _docs(run: str) -> Path:
    from dflash_etl.report import build_docs

    return build_docs(run) / "index.html"


def cmd_docs(args: argparse.Namespace) -> int:
    """Rebuild runs/<name>/docs/ from the files the run left (no data is re-validated)."""
    if not (Path(args.run) / "manifest.json").exists():
        raise StageError(f"{args.run} is not a run directory (no manifest.json): give the "
                         "--run directory a `dflash-etl run` or stage wrote")
    from dflash_etl.core.rundir import RunDir

    RunDir(args.run).manifest()  # a corrupt one is named (the report alone would show nothing)
    say(f"report: {_docs(args.run)}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from dflash_etl.validation.check import check_path

    report = check_path(Path(args.path), suite=args.suite)
    say(report["summary"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    if args.report:
        from dflash_etl.report import build_check_report

        say(f"report: {build_check_report(report, args.report)}")
    return 0 if report["passed"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-etl",
        description="Validation-first ETL for speculative-decoding drafter training data.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    for spec in STAGES:
        stage_parser(sub.add_parser(spec.name, help=spec.help, description=spec.help), spec)

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
    stage_args(p, config_required=False)
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

    from dflash_etl import evaluate

    p = sub.add_parser("eval", help="the drafter's acceptance length (tau) per benchmark "
                       "(MT-Bench, GSM8K, HumanEval, ...)")
    evaluate.add_arguments(p).set_defaults(func=evaluate.run_from_args)

    from dflash_etl import lineage

    p = sub.add_parser("show", help="one conversation through every stage: source line, "
                       "replies, rows with the supervised tokens marked, states, training split")
    lineage.add_arguments(p).set_defaults(func=lineage.run_from_args)

    p = sub.add_parser("docs", help="rebuild a run's HTML report (runs/<name>/docs/index.html)")
    p.add_argument("--run", default="runs/default", help="run directory (default: %(default)s)")
    p.set_defaults(func=cmd_docs)
    init.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser().parse_args(argv)
    if command in {s.name for s in STAGES}:  # its own arguments: what --launcher torchrun reruns
        args.argv = argv[:argv.index(command)] + argv[argv.index(command) + 1:]
    return execute(args)


if __name__ == "__main__":
    raise SystemExit(main())
