"""`dflash-etl` (and `python -m dflash_etl`): one subcommand per stage of the pipeline, plus `run`
(every stage), `check` (for CI), `docs` (the run's HTML report), `probe-template`, `export`,
`eval`, `show` and `init`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from dflash_etl.cli import init, status
from dflash_etl.cli.flags import field_help
from dflash_etl.cli.stage import execute, run_one, say, stage_args, stage_parser
from dflash_etl.core.config import DEFAULT_CONFIG, build_settings
from dflash_etl.core.errors import StageError
from dflash_etl.core.outputs import OUTPUTS
from dflash_etl.core.rundir import RunDir
from dflash_etl.core.settings import marked
from dflash_etl.core.stage import Stage
from dflash_etl.runner import Pipeline
from dflash_etl.stages import PIPELINE

PROBE_LIMITS = ("render_timeout_s", "render_size_factor", "render_size_extra")


def cmd_probe(args: argparse.Namespace) -> int:
    from dflash_etl.stages import tokenize

    limits = {name: getattr(args, name) for name in PROBE_LIMITS
              if getattr(args, name) is not None}
    settings = build_settings(tokenize.TokenizeSettings, "tokenize", {}, {
        "model": args.model, "chat_template": args.chat_template, **limits})
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
    args.pipeline.load_config(args.config)  # a bad config is refused before the run is touched
    with run_lock(args.run, "run"):  # held across the stages: no other process in between
        return _run_stages(args)


def _run_stages(args: argparse.Namespace) -> int:
    say(f"config: {args.config}\nrun:    {args.run}")
    pipeline: Pipeline = args.pipeline
    config = pipeline.load_config(args.config)
    ran: dict[str, float] = {}  # stage -> its wall seconds in this call
    for stage in pipeline:
        if not all(_written(pipeline, kind, ran) for kind in stage.reads):
            continue  # what it reads was not made in this call
        if not pipeline.configured(config, stage):
            if _only_writer(pipeline, stage):  # say why the stages after it do not run
                missing = marked(stage.Settings, "required")[0].name if stage.Settings else ""
                say(f"{stage.name} skipped: no [{stage.name}] {missing} in the config")
            continue
        start = time.perf_counter()
        code = run_one(stage, args, pipeline)
        if code:
            return code
        ran[stage.name] = time.perf_counter() - start
    say("wall time: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in ran.items())
        + f"; {sum(ran.values()):.1f} s in all")
    say(f"manifest: {Path(args.run) / 'manifest.json'}")
    say(f"report:   {_docs(args.run)}")
    return 0


def _written(pipeline: Pipeline, kind: type, ran: dict[str, float]) -> bool:
    return any(s.writes is kind and s.name in ran for s in pipeline)


def _only_writer(pipeline: Pipeline, stage: type[Stage]) -> bool:
    """Whether a later stage reads what `stage` alone writes."""
    others = [s for s in pipeline if s.writes is stage.writes and s is not stage]
    return not others and any(stage.writes in s.reads for s in pipeline)


def _docs(run: str) -> Path:
    from dflash_etl.report import build_docs

    return build_docs(run) / "index.html"


def cmd_docs(args: argparse.Namespace) -> int:
    """Rebuild runs/<name>/docs/ from the files the run left (no data is re-validated)."""
    if not (Path(args.run) / "manifest.json").exists():
        raise StageError(f"{args.run} is not a run directory (no manifest.json): give the "
                         "--run directory a `dflash-etl run` or stage wrote")
    RunDir(args.run).manifest()  # a corrupt one is named (the report alone would show nothing)
    from dflash_etl.runner.lifecycle import settle_interrupted

    settle_interrupted(args.run, "docs")
    say(f"report: {_docs(args.run)}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from dflash_etl.runner.lifecycle import settle_interrupted
    from dflash_etl.validation.check import check_path

    settle_interrupted(args.path, "check")  # a stage whose process died is not `running`
    report = check_path(Path(args.path), suite=args.suite)
    say(report["summary"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    if args.report:
        from dflash_etl.report import build_check_report

        say(f"report: {build_check_report(report, args.report)}")
    return 0 if report["passed"] else 1


def build_parser(pipeline: Pipeline = PIPELINE) -> argparse.ArgumentParser:
    """The command line of `pipeline`: a subcommand per stage, and the commands over a run."""
    parser = argparse.ArgumentParser(
        prog="dflash-etl",
        description="Validation-first ETL for speculative-decoding drafter training data.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    for stage in pipeline:
        stage_parser(sub.add_parser(stage.name, help=stage.help, description=stage.help), stage,
                     pipeline)

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
    stage_args(p, config_required=False, work_items=True)
    p.set_defaults(func=cmd_run, pipeline=pipeline)

    p = sub.add_parser("check", help="contracts and suites on a stage output or a whole run "
                                     "(exit 0/1)")
    p.add_argument("path", help="a stage output directory (e.g. runs/x/ingest) or a run directory")
    p.add_argument("--suite", help="only the outputs of this suite: "
                                   + " or ".join(sorted({o.suite for o in OUTPUTS if o.suite})))
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
    status.add_parser(sub)
    return parser


def main(argv: list[str] | None = None, pipeline: Pipeline = PIPELINE) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(pipeline).parse_args(argv)
    if command in pipeline:  # its own arguments: what --launcher torchrun reruns
        args.argv = argv[:argv.index(command)] + argv[argv.index(command) + 1:]
    return execute(args)


if __name__ == "__main__":
    raise SystemExit(main())
