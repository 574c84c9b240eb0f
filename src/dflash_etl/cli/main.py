"""`dflash-etl`: one subcommand per stage, plus `run` (every stage), `check` (for CI) and `docs`
(the run's HTML report)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from pathlib import Path
from typing import Any

from dflash_etl.core.config import ConfigError, load_config
from dflash_etl.core.errors import StageError

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CONFIG = REPO_ROOT / "data" / "pipeline.toml"


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


def _url_list(text: str) -> tuple[str, ...]:
    """`--endpoints URL,URL` -> a tuple of URLs (the frozen settings keep tuples)."""
    urls = tuple(u.strip() for u in text.split(",") if u.strip())
    if not urls:
        raise argparse.ArgumentTypeError("give at least one URL, e.g. "
                                         "http://127.0.0.1:8001/v1,http://127.0.0.1:8002/v1")
    return urls


def cmd_ingest(args: argparse.Namespace) -> int:
    from dflash_etl.stages import ingest

    config = load_config(args.config)
    doc = ingest.run(config, args.run, force=args.force, workers=args.workers,
                     **_executor(args))
    out = Path(args.run) / "ingest"
    state = _state(doc)
    _say(f"ingest {state}: {_counts_line(doc['total'])}")
    for name, stats in doc["sources"].items():
        _say(f"  {name}: {_counts_line(stats)}")
    _say(f"  conversations: {out / 'conversations'}")
    _say(f"  quarantine:    {out / 'quarantine.parquet'}")
    _say(f"  stats:         {out / 'stats.json'}")
    return 0


def _tokenize_overrides(args: argparse.Namespace) -> dict[str, Any]:
    names = ("model", "chat_template", "seq_length", "truncation", "min_supervised_tokens",
             "strategy", "turns", "draft_vocab_size")
    out = {n: getattr(args, n, None) for n in names}
    if getattr(args, "no_eot", False):
        out["include_eot"] = False
    if getattr(args, "no_reasoning", False):
        out["supervise_reasoning"] = False
    return out


def cmd_tokenize(args: argparse.Namespace) -> int:
    from dflash_etl.stages import tokenize

    config = load_config(args.config) if args.config else None
    doc = tokenize.run(config, args.run, force=args.force, workers=args.workers,
                       **_executor(args), **_tokenize_overrides(args))
    out = Path(args.run) / "tokenize"
    total = doc["total"]
    state = _state(doc)
    _say(f"tokenize {state}: conversations {_counts_line(total)}")
    _say(f"  rows written: {total.get('rows_written')}, tokens: {total.get('tokens')}, "
         f"supervised: {total.get('supervised_tokens')}, strategies: {total.get('strategies')}")
    _say(f"  draft vocab: {total.get('draft_vocab')}")
    _say(f"  dataset:  {out / 'dataset'}  (datasets.load_from_disk)")
    _say(f"  probe:    {out / 'probe.json'}")
    _say(f"  stats:    {out / 'stats.json'}")
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    from dflash_etl.stages import regenerate

    config = load_config(args.config) if args.config else None
    doc = regenerate.run(config, args.run, force=args.force,
                         **_overrides(args, regenerate.RegenerateSettings))
    out = Path(args.run) / "regenerate"
    total = doc["total"]
    state = _state(doc)
    _say(f"regenerate {state}: conversations {_counts_line(total)}")
    _say(f"  generated turns: {total.get('generated_turns')}, finish reasons: "
         f"{total.get('finish_reasons')}")
    _say(f"  conversations: {out / 'conversations'}  (tokenize reads these now)")
    _say(f"  quarantine:    {out / 'quarantine.parquet'}")
    _say(f"  stats:         {out / 'stats.json'}")
    return 0


def cmd_extract(args: argparse.Namespace) -> int:
    from dflash_etl.stages import extract

    config = load_config(args.config) if args.config else None
    doc = extract.run(config, args.run, force=args.force,
                      **_overrides(args, extract.ExtractSettings))
    out = Path(args.run) / "extract"
    total = doc["total"]
    state = _state(doc)
    _say(f"extract {state}: rows {_counts_line(total)}")
    _say(f"  layers {total.get('layers')} of {total.get('n_layers')}, hidden "
         f"{total.get('hidden_size')}, {total.get('dtype')}, {total.get('tokens')} tokens, "
         f"padding {total.get('padding_share')}")
    _say(f"  hidden states: {out / 'hidden_states'}  ({total.get('format')})")
    _say(f"  index:         {out / 'index.parquet'}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from dflash_etl.stages import train

    config = load_config(args.config) if args.config else None
    doc = train.run(config, args.run, force=args.force, **_overrides(args, train.TrainSettings))
    if not doc:  # a torchrun rank other than 0: rank 0 reports
        return 0
    from dflash_etl.core.rundir import RunDir

    out = Path(args.run) / "train"
    total = doc["total"]
    # timings live in the manifest, not in stats.json (whose bytes do not depend on the machine)
    timing = RunDir(args.run).manifest().get("stages", {}).get("train", {})
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


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _has_target(config_path: str, stage: str, key: str = "model") -> bool:
    """Whether the config gives `stage` a target model (its own section or [target])."""
    config = load_config(config_path)
    return bool(config.section(stage).get(key) or config.section("target"))


def cmd_probe(args: argparse.Namespace) -> int:
    from dflash_etl.stages import tokenize

    settings = tokenize.TokenizeSettings(model=args.model, chat_template=args.chat_template)
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
    code = cmd_ingest(args)
    if code:
        return code
    if _has_target(args.config, "regenerate"):
        code = cmd_regenerate(args)
        if code:
            return code
    if load_config(args.config).section("tokenize").get("model"):
        code = cmd_tokenize(args)
        if code:
            return code
        if _has_target(args.config, "extract"):
            code = cmd_extract(args)
            if code:
                return code
        if _has_target(args.config, "train", "target"):
            code = cmd_train(args)
            if code:
                return code
    else:
        _say("tokenize skipped: no [tokenize] model in the config")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-etl",
        description="Validation-first ETL for speculative-decoding drafter training data.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def stage_args(p: argparse.ArgumentParser, config_required: bool) -> None:
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

    def tokenize_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", help="local tokenizer or model directory (offline)")
        p.add_argument("--chat-template", help="a .jinja file that overrides the tokenizer's")
        p.add_argument("--seq-length", type=int, help="maximum tokens per row (default 4096)")
        p.add_argument("--truncation", choices=["right", "drop"], help="over seq-length rows")
        p.add_argument("--min-supervised-tokens", type=int,
                       help="consecutive supervised tokens a row needs (default 2)")
        p.add_argument("--strategy", choices=["auto", "generation", "render_diff", "per_turn"])
        p.add_argument("--turns", choices=["all", "last"], help="which assistant turns to train")
        p.add_argument("--draft-vocab-size", type=int, help="size of d2t/t2d (default 32000)")
        p.add_argument("--no-eot", action="store_true", help="do not supervise end-of-turn")
        p.add_argument("--no-reasoning", action="store_true", help="do not supervise reasoning")

    p = sub.add_parser("ingest", help="sources -> canonical conversations + quarantine")
    stage_args(p, config_required=True)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("tokenize", help="conversations -> input_ids + verified loss masks")
    stage_args(p, config_required=False)
    tokenize_args(p)
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("regenerate", help="the target model writes the assistant turns")
    stage_args(p, config_required=False)
    p.add_argument("--model", help="the target model directory (offline)")
    p.add_argument("--backend", choices=["transformers", "openai", "vllm"],
                   help="generation backend (default transformers)")
    p.add_argument("--endpoint", help="openai backend: the server's /v1 URL "
                                      "(default http://127.0.0.1:8000/v1)")
    p.add_argument("--endpoints", type=_url_list, metavar="URL,URL",
                   help="openai backend: several servers of one model, comma-separated; each "
                        "request goes to the least loaded healthy one (default: --endpoint)")
    p.add_argument("--served-model", help="openai backend: model name (default: the first the "
                                          "server lists)")
    p.add_argument("--concurrency", type=int,
                   help="openai backend: requests in flight per server (8)")
    p.add_argument("--cooldown-s", type=float,
                   help="openai backend, several endpoints: how long a failed server sits out "
                        "before its probe (10)")
    p.add_argument("--timeout-s", type=float, help="openai backend: per request (120)")
    p.add_argument("--retries", type=int, help="openai backend: on timeouts/429/5xx (3)")
    p.add_argument("--stream", action="store_true", default=None,
                   help="openai backend: stream the responses")
    p.add_argument("--mode", choices=["missing", "all"],
                   help="answer conversations that need a reply (default) or rewrite every turn")
    p.add_argument("--max-new-tokens", type=int, help="per reply (default 256)")
    p.add_argument("--temperature", type=float, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, help="sampling seed (default 0)")
    p.add_argument("--batch-size", type=int, help="prompts per generate call (default 8)")
    p.add_argument("--thinking", choices=["on", "off", "keep"],
                   help="the template's enable_thinking (default keep)")
    p.add_argument("--keep-truncated", action="store_true", default=None,
                   help="keep replies cut at --max-new-tokens (default: filter them)")
    p.set_defaults(func=cmd_regenerate)

    p = sub.add_parser("extract", help="tokenized rows -> the target's hidden states")
    stage_args(p, config_required=False)
    p.add_argument("--model", help="the target model directory (offline)")
    p.add_argument("--layers", help="'auto' (DFlash rule) or decoder layer indices, e.g. 1,16,31")
    p.add_argument("--draft-layers", type=int, help="K for --layers auto (default 5)")
    p.add_argument("--dtype", choices=["fp32", "bf16"])
    p.add_argument("--batch-tokens", type=int, help="padded tokens per forward pass (8192)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--format", choices=["native", "speculators"])
    p.set_defaults(func=cmd_extract)

    p = sub.add_parser("train", help="hidden states -> a DFlash drafter, with its tau")
    stage_args(p, config_required=False)
    p.add_argument("--target", help="the target model directory (offline)")
    p.add_argument("--draft-layers", type=int, help="decoder layers of the drafter (5)")
    p.add_argument("--block-size", type=int, help="anchor + tokens predicted per block (16)")
    p.add_argument("--steps", type=int, help="optimizer steps (1000)")
    p.add_argument("--lr", type=float, help="peak learning rate (6e-4)")
    p.add_argument("--batch-rows", type=int, help="rows per step, over all ranks (8)")
    p.add_argument("--anchors-per-row", type=int, help="blocks sampled per row (64)")
    p.add_argument("--gamma", type=float, help="loss decay over block offsets (7)")
    p.add_argument("--online", action="store_true", default=None,
                   help="compute the hidden states from the target (no extract output needed)")
    p.add_argument("--layers", help="--online: 'auto' or target layer indices")
    p.add_argument("--mask-token-id", type=int, help="the blocks' mask token (default: found)")
    p.add_argument("--eval-prompts", type=int, help="held-out prompts for tau (16)")
    p.add_argument("--eval-new-tokens", type=int, help="tokens decoded per prompt (48)")
    p.add_argument("--eval-every", type=int, help="steps between evaluations (0: end only)")
    p.add_argument("--save-every", type=int, help="steps between checkpoints (200)")
    p.add_argument("--seed", type=int, help="(0)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="the target's dtype")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("probe-template", help="what a chat template does (nothing written)")
    p.add_argument("--model", required=True, help="local tokenizer or model directory")
    p.add_argument("--chat-template", help="a .jinja file that overrides the tokenizer's")
    p.add_argument("--json", help="also write the probe as JSON here")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("run", help="every stage on a config (default: the embedded data/)")
    stage_args(p, config_required=False)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check", help="contracts and suites on a stage output or a whole run "
                                     "(exit 0/1)")
    p.add_argument("path", help="a stage output directory (e.g. runs/x/ingest) or a run directory")
    p.add_argument("--suite", help="only the outputs of this suite: conversations or tokenized")
    p.add_argument("--json", help="also write the full report as JSON here")
    p.add_argument("--report", help="also write an HTML report: a directory (index.html inside) "
                                    "or a .html file")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("docs", help="rebuild a run's HTML report (runs/<name>/docs/index.html)")
    p.add_argument("--run", default="runs/default", help="run directory (default: %(default)s)")
    p.set_defaults(func=cmd_docs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("ingest", "regenerate", "tokenize", "run"):
        from dflash_etl.validation import suite_helper

        suite_helper.start()  # before the stage's own imports: see suite_helper
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


if __name__ == "__main__":
    raise SystemExit(main())
