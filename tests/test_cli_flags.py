"""The pipeline (the stages in order) and the CLI flags generated from each stage's settings
class (no stage runs: only parsers, settings checks and a `run` whose stages are stubbed)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_etl.cli.main import build_parser, main
from dflash_etl.core.stage import BatchStage
from dflash_etl.stages import PIPELINE as STAGES

cli = importlib.import_module("dflash_etl.cli.main")  # dflash_etl.cli exports main(), not this
stage_cli = importlib.import_module("dflash_etl.cli.stage")

PIPELINE = ("ingest", "regenerate", "tokenize", "extract", "train")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings}


def test_the_pipeline_is_the_stages_in_order_and_imports_no_model_library():
    assert STAGES.names() == PIPELINE
    for stage in STAGES:
        assert stage.__module__ == f"dflash_etl.stages.{stage.name}"
        assert STAGES.sections()[stage.name] is stage.Settings
        assert importlib.import_module(stage.__module__).run.__name__ == "run"  # the Python API
    code = ("import sys, dflash_etl.stages as s; s.PIPELINE['train']; "
            "print([m for m in ('torch', 'transformers', 'great_expectations', 'pandera', "
            "'dflash_etl.cli.main') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_check_and_the_gates_read_the_kinds_of_output():
    """What a stage writes names its contract and suite, and how `check` recognises it."""
    from dflash_etl.core.outputs import HiddenStatesOutput
    from dflash_etl.validation import check, suites

    assert set(check.SUITES) == {s.writes.suite for s in STAGES if s.writes.suite}
    assert suites.OUTPUT_DIRS == {"conversations": "conversations", "tokenized": "dataset"}
    assert {s.name: s.writes.marker for s in STAGES if s.writes.suite is None} == {
        "extract": "index.parquet", "train": "drafter/config.json"}
    assert STAGES["extract"].writes is HiddenStatesOutput


def test_every_settings_field_has_a_flag():
    parsers = _subparsers(build_parser())
    for stage in STAGES:
        parser = parsers[stage.name]
        assert parser.description == stage.help
        dests = {a.dest for a in parser._actions}
        for field in dataclasses.fields(stage.Settings):
            assert field.name in dests, f"{stage.name}: no flag for {field.name}"
            flag = "--" + field.name.replace("_", "-")
            action = _flags(parser)[flag]
            assert action.dest == field.name and action.default is None  # the config decides
            assert action.help, f"{stage.name} {flag}: no help"


def test_flags_of_today_keep_their_names_and_meaning():
    parse = build_parser().parse_args
    args = parse(["tokenize", "--no-eot", "--no-reasoning", "--seq-length", "128"])
    overrides = stage_cli.settings_overrides(args, STAGES["tokenize"].Settings)
    assert overrides["include_eot"] is False and overrides["supervise_reasoning"] is False
    assert overrides["seq_length"] == 128 and overrides["turns"] is None
    args = parse(["regenerate", "--stream", "--keep-truncated", "--endpoints", "http://a/v1,"
                  "http://b/v1", "--cooldown-s", "2.5"])
    assert (args.stream, args.keep_truncated) == (True, True)
    assert args.endpoints == ("http://a/v1", "http://b/v1") and args.cooldown_s == 2.5
    args = parse(["extract", "--backend", "server", "--endpoints", "http://a/v1,http://b/v1",
                  "--cooldown-s", "2.5", "--timeout-s", "9", "--retries", "0"])
    assert args.endpoints == ("http://a/v1", "http://b/v1") and args.cooldown_s == 2.5
    assert (args.timeout_s, args.retries) == (9.0, 0)
    overrides = stage_cli.settings_overrides(args, STAGES["extract"].Settings)
    settings = STAGES["extract"].Settings(model="m", **{
        k: v for k, v in overrides.items() if v is not None})
    assert settings.servers == ("http://a/v1", "http://b/v1")
    args = parse(["train", "--states-endpoints", "http://a/v1,http://b/v1/"])
    assert args.states_endpoints == ("http://a/v1", "http://b/v1/")
    args = parse(["train", "--online", "--target", "DIR", "--lr", "1e-3"])
    assert (args.online, args.target, args.lr) == (True, "DIR", 1e-3)
    args = parse(["extract", "--workers", "2", "--executor", "ray", "--ray-address", "auto",
                  "--force", "--debug", "--config", "p.toml", "--run", "r"])
    assert (args.workers, args.executor, args.ray_address, args.force, args.debug,
            args.config, args.run) == (2, "ray", "auto", True, True, "p.toml", "r")


def test_a_bool_flag_and_its_no_form():
    parse = build_parser().parse_args
    assert parse(["tokenize"]).include_eot is None  # not given: the config decides
    assert parse(["tokenize", "--include-eot"]).include_eot is True
    assert parse(["tokenize", "--no-include-eot"]).include_eot is False
    assert parse(["tokenize", "--eot"]).include_eot is True
    assert parse(["regenerate", "--no-stream"]).stream is False
    assert parse(["train", "--no-online"]).online is False


def test_settings_without_a_flag_before_have_one():
    parse = build_parser().parse_args
    assert parse(["regenerate", "--dummy-min-repeats", "4"]).dummy_min_repeats == 4
    assert parse(["extract", "--shard-rows", "64"]).shard_rows == 64
    args = parse(["train", "--warmup-steps", "5", "--grad-clip", "0.5", "--weight-decay", "0.1",
                  "--keep-checkpoints", "3"])
    assert (args.warmup_steps, args.grad_clip, args.weight_decay, args.keep_checkpoints) == \
        (5, 0.5, 0.1, 3)


def test_choices_are_enforced_with_a_clear_message(capsys):
    parse = build_parser().parse_args
    with pytest.raises(SystemExit) as exit_info:
        parse(["tokenize", "--truncation", "middle"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--truncation: invalid choice: 'middle'" in err and "'right', 'drop'" in err
    assert parse(["extract", "--device", "cuda:1"]).device == "cuda:1"  # a choice "cuda:N"
    assert parse(["train", "--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit):
        parse(["train", "--device", "cuda:x"])
    assert "invalid choice: 'cuda:x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["regenerate", "--endpoints", ","])
    assert "--endpoints: give at least one value" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["tokenize", "--seq-length", "long"])
    assert "--seq-length: invalid int value: 'long'" in capsys.readouterr().err


def test_a_value_out_of_range_exits_1_with_the_key_and_range(tmp_path, capsys):
    assert main(["tokenize", "--run", str(tmp_path / "r"), "--seq-length", "-5"]) == 1
    err = capsys.readouterr().err
    assert "--seq-length -5" in err and "must be an integer >= 1" in err
    assert main(["regenerate", "--run", str(tmp_path / "r"), "--model", "m",
                 "--dummy-min-repeats", "1"]) == 1
    err = capsys.readouterr().err
    assert "--dummy-min-repeats 1" in err and ">= 2" in err and "given once" in err


@pytest.mark.parametrize("name", PIPELINE)
def test_stage_help_works_and_shows_the_defaults(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: dflash-etl {name}" in out and "--config" in out
    stage = STAGES[name]
    assert f"[{name}] settings" in out
    for field in dataclasses.fields(stage.Settings):
        assert "--" + field.name.replace("_", "-") in out
    # how work items run: shown for the batch stages alone
    assert ("--workers" in out) is issubclass(stage, BatchStage)


def test_help_text_lives_with_the_setting(capsys):
    from dflash_etl.stages.tokenize import TokenizeSettings

    meta = {f.name: f.metadata for f in dataclasses.fields(TokenizeSettings)}
    assert meta["seq_length"]["help"] == "maximum tokens per row"
    with pytest.raises(SystemExit):
        main(["tokenize", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "maximum tokens per row (default: 4096)" in out
    assert "--include-eot, --no-include-eot, --eot, --no-eot supervise end-of-turn " \
           "(default: on)" in out


def test_stage_modules_do_not_import_the_cli():
    for stage in STAGES:
        source = Path(importlib.import_module(stage.__module__).__file__).read_text()
        assert "dflash_etl.cli" not in source, stage.name
        assert "def main(" not in source, stage.name  # one entry: dflash-etl / python -m dflash_etl


def test_run_goes_through_the_registry_in_order(tmp_path, monkeypatch, capsys):
    """`dflash-etl run` runs the registry's stages in its order, each one the config gives what
    it needs (the stages' own work is stubbed)."""
    ran = []

    def fake_run_one(stage, args, pipeline):
        ran.append(stage.name)
        return 0

    monkeypatch.setattr(cli, "run_one", fake_run_one)
    monkeypatch.setattr(cli, "_docs", lambda run: Path(run) / "docs" / "index.html")
    config = tmp_path / "pipeline.toml"
    config.write_text('[[sources]]\npath = "rows.jsonl"\n\n[target]\nmodel = "t"\n\n'
                      '[tokenize]\nmodel = "t"\n')
    assert main(["run", "--config", str(config), "--run", str(tmp_path / "r")]) == 0
    assert ran == list(PIPELINE)

    ran.clear()
    config.write_text('[[sources]]\npath = "rows.jsonl"\n\n[target]\nmodel = "t"\n')
    assert main(["run", "--config", str(config), "--run", str(tmp_path / "r")]) == 0
    assert ran == ["ingest", "regenerate"]  # no tokenizer: nothing after tokenize runs
    assert "tokenize skipped: no [tokenize] model in the config" in capsys.readouterr().out

    ran.clear()
    config.write_text('[[sources]]\npath = "rows.jsonl"\n\n[tokenize]\nmodel = "t"\n\n'
                      '[train]\ntarget = "t"\n')
    assert main(["run", "--config", str(config), "--run", str(tmp_path / "r")]) == 0
    assert ran == ["ingest", "tokenize", "train"]


def test_run_passes_workers_to_the_batch_stages_only(tmp_path, monkeypatch):
    calls = {}

    def fake_run(self, name, config, run_dir, **options):
        calls[name] = options
        return {"total": {}, "sources": {}}

    monkeypatch.setattr(type(STAGES), "run", fake_run)
    for stage in STAGES:
        monkeypatch.setattr(stage, "summary", classmethod(lambda cls, doc, record, out: []))
    monkeypatch.setattr(cli, "_docs", lambda run: Path(run) / "docs" / "index.html")
    config = tmp_path / "pipeline.toml"
    config.write_text('[[sources]]\npath = "rows.jsonl"\n\n[target]\nmodel = "t"\n\n'
                      '[tokenize]\nmodel = "t"\n')
    assert main(["run", "--config", str(config), "--run", str(tmp_path / "r"),
                 "--workers", "3"]) == 0
    assert list(calls) == list(PIPELINE)
    assert calls["ingest"] == {"force": False, "workers": 3, "executor": None,
                               "ray_address": None, "max_decompressed_bytes": None,
                               "strict_sources": None, "decontaminate": None,
                               "decontaminate_ngram": None, "near_dedup": None,
                               "near_dedup_threshold": None, "near_dedup_ngram": None,
                               "near_dedup_scope": None, "placeholder_replies": None,
                               "placeholder_min_share": None, "weight_by": None}
    assert calls["tokenize"]["workers"] == 3 and calls["tokenize"]["seq_length"] is None
    # extract is a batch stage too (its shards are work items: one process locally, whatever
    # --workers says, as its declared resources cap it; actors on Ray); train is not
    assert calls["extract"]["workers"] == 3 and calls["extract"]["model"] is None
    assert "workers" not in calls["train"] and "executor" not in calls["train"]


def test_the_mix_and_label_settings_are_flags():
    """[ingest] weight_by and [train] labels, as every stage key, are flags of their stage."""
    parsers = _subparsers(build_parser())
    weight_by = _flags(parsers["ingest"])["--weight-by"]
    labels = _flags(parsers["train"])["--labels"]
    assert tuple(weight_by.choices) == ("rows", "supervised_tokens")
    assert tuple(labels.choices) == ("data", "target")
    assert "--labels" not in _flags(parsers["tokenize"])


def test_a_flag_a_stage_has_no_use_for_is_refused_naming_what_it_is_for(tmp_path, capsys):
    """`train --executor ray` used to run locally without a word: how work items run is
    refused on a stage without any, and a Ray address without the Ray executor."""
    run = str(tmp_path / "r")
    assert main(["train", "--run", run, "--target", "t", "--executor", "ray"]) == 1
    err = capsys.readouterr().err
    assert "train does not take --executor" in err and "(ingest, tokenize, extract)" in err
    assert "--launcher torchrun" in err  # what train's parallel form is
    assert main(["regenerate", "--run", run, "--model", "m", "--workers", "2"]) == 1
    assert "regenerate does not take --workers" in capsys.readouterr().err
    assert main(["tokenize", "--run", run, "--model", "m", "--ray-address", "auto"]) == 1
    assert "--ray-address auto applies to the Ray executor: add --executor ray" in \
        capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # refused before the run directory is touched


def test_a_setting_that_does_nothing_with_the_others_is_refused_as_a_flag(tmp_path, capsys):
    """`--concurrency` does nothing on the transformers backend, `--states-dir` without server
    states, `--nproc-per-node` without the launcher: given as flags they are refused, naming the
    flag that makes them apply (a config may keep them: it may switch backends with a flag)."""
    from dflash_etl.core.config import build_settings
    from dflash_etl.stages.regenerate import RegenerateSettings

    run = str(tmp_path / "r")
    assert main(["regenerate", "--run", run, "--model", "m", "--concurrency", "4"]) == 1
    assert "--concurrency applies only with --backend openai (backend is \"transformers\" " \
           "now): drop it, or add --backend openai" in capsys.readouterr().err
    assert main(["extract", "--run", run, "--model", "m", "--nproc-per-node", "2"]) == 1
    assert "--nproc-per-node applies only with --launcher torchrun" in capsys.readouterr().err
    assert main(["train", "--run", run, "--target", "t", "--states-dir", "s"]) == 1
    assert "--states-dir applies only with --states-from server" in capsys.readouterr().err
    config = str(Path(__file__).resolve().parents[1] / "data" / "pipeline.toml")
    assert main(["ingest", "--config", config, "--run", run, "--near-dedup-ngram", "5"]) == 1
    assert "--near-dedup-ngram applies only with --near-dedup" in capsys.readouterr().err
    # in the config section it is kept, and applies once a flag switches the backend
    settings = build_settings(RegenerateSettings, "regenerate", {"concurrency": 4},
                              {"model": "m", "backend": "openai"})
    assert settings.concurrency == 4
