"""pipeline.toml is checked against its schema before any stage runs: unknown sections and keys
(with a "did you mean"), values of the wrong type or out of range, in the file and on the command
line; a file that is not UTF-8 is named with the byte."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dflash_etl.core.config import ConfigError, ExpectationsSettings, build_settings
from dflash_etl.core.errors import StageError
from dflash_etl.stages import PIPELINE, load_config, parse_config

REPO = Path(__file__).resolve().parents[1]
SOURCE = '[[sources]]\nname = "a"\npath = "a.jsonl"\n'


def _load(tmp_path: Path, text: str):
    path = tmp_path / "pipeline.toml"
    path.write_text(text)
    return load_config(path)


def _refused(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, text)
    message = str(info.value)
    assert message.startswith(str(tmp_path / "pipeline.toml") + ": "), message
    return message


# ---------------------------------------------------------------- unknown names
@pytest.mark.parametrize(("text", "expected"), [
    ('[[source]]\nname = "a"\npath = "a.jsonl"\n',
     "unknown section [[source]]; did you mean [[sources]]?"),
    (SOURCE + "[tokenise]\nseq_length = 8\n",
     "unknown section [tokenise]; did you mean [tokenize]?"),
    (SOURCE + "[expectation]\nshare_tolerance = 0.1\n",
     "unknown section [expectation]; did you mean [expectations]?"),
    ("[run]\nshard_row = 10\n" + SOURCE, "[run]: unknown key shard_row; did you mean shard_rows?"),
    (SOURCE + "[train]\nsave_evry = 10\n",
     "[train]: unknown key save_evry; did you mean save_every?"),
    (SOURCE + "[regenerate]\nmax_new_token = 8\n",
     "[regenerate]: unknown key max_new_token; did you mean max_new_tokens?"),
    (SOURCE + "[expectations]\nmax_quarantine = 0.1\n",
     "[expectations]: unknown key max_quarantine; did you mean max_quarantine_rate?"),
    (SOURCE + "[target]\nmodle = 'm'\n", "[target]: unknown key modle; did you mean model?"),
    ('[[sources]]\npath = "a.jsonl"\nfromat = "openai"\n',
     "[[sources]] #1: unknown key fromat; did you mean format?"),
    (SOURCE + "[expectations.max_quarantine_rate_per_source]\nb = 0.5\n",
     "[expectations.max_quarantine_rate_per_source]: unknown source b; known: a"),
])
def test_a_typo_gets_a_suggestion(tmp_path, text, expected):
    assert expected in _refused(tmp_path, text)


def test_with_no_close_name_the_known_ones_are_listed(tmp_path):
    message = _refused(tmp_path, SOURCE + "[zzz]\nx = 1\n")
    assert "unknown section [zzz]; known: [run], [[sources]], [expectations]" in message
    assert all(f"[{s}]" in message for s in ("regenerate", "tokenize", "extract", "train"))
    message = _refused(tmp_path, "[run]\nqqq = 1\n" + SOURCE)
    assert "[run]: unknown key qqq; known: seed, dedup, shard_rows" in message


def test_a_missing_s_is_one_problem_not_two(tmp_path):
    message = _refused(tmp_path, '[[source]]\npath = "a.jsonl"\n')
    assert "problems" not in message and "no [[sources]]" not in message


def test_a_section_of_the_wrong_kind(tmp_path):
    assert "write [[sources]] (two brackets)" in _refused(tmp_path, '[sources]\npath = "a"\n')
    assert "[run] must be a table" in _refused(tmp_path, "run = 3\n" + SOURCE)


# ---------------------------------------------------------------- types and ranges
@pytest.mark.parametrize(("text", "expected"), [
    ('[run]\ndedup = "no"\n', '[run] dedup = "no": must be true or false'),
    ('[run]\nseed = "x"\n', '[run] seed = "x": must be an integer >= 0'),
    ("[run]\nshard_rows = 0\n", "[run] shard_rows = 0: must be an integer >= 1"),
    ("[run]\nmax_line_bytes = 0\n", "[run] max_line_bytes = 0: must be an integer >= 1"),
    ("[run]\nworkers = -1\n", "[run] workers = -1: must be an integer >= 0"),
    ("[run]\nworkers = true\n", "[run] workers = true: must be an integer >= 0"),
    ("[run]\nmax_quarantine_rate = 1.5\n",
     "[run] max_quarantine_rate = 1.5: must be a number in [0, 1]"),
    (SOURCE + "[tokenize]\nseq_length = -5\n",
     "[tokenize] seq_length = -5: must be an integer >= 1"),
    (SOURCE + "[tokenize]\ndraft_vocab_size = 0\n",
     "[tokenize] draft_vocab_size = 0: must be an integer >= 1"),
    (SOURCE + "[tokenize]\ntruncation = 'rigth'\n",
     '[tokenize] truncation = "rigth": must be one of "right", "drop"; did you mean "right"?'),
    (SOURCE + "[tokenize]\nseq_length = 4.5\n",
     "[tokenize] seq_length = 4.5: must be an integer >= 1"),
    (SOURCE + "[train]\nsave_every = 0\n", "[train] save_every = 0: must be an integer >= 1"),
    (SOURCE + "[train]\nlr = 0\n", "[train] lr = 0: must be a number > 0"),
    (SOURCE + "[train]\nlr = nan\n", "[train] lr = nan: must be a number > 0"),
    (SOURCE + "[train]\nblock_size = 1\n",
     "[train] block_size = 1: must be an integer in [2, 256] (a block needs the anchor"),
    (SOURCE + "[train]\ndevice = 'gpu'\n", '[train] device = "gpu": must be one of "auto"'),
    (SOURCE + "[train]\nlabels = 'argmax'\n",
     '[train] labels = "argmax": must be one of "data", "target"'),
    (SOURCE + "[ingest]\nweight_by = 'tokens'\n",
     '[ingest] weight_by = "tokens": must be one of "rows", "supervised_tokens"'),
    (SOURCE + "[regenerate]\ntimeout_s = 0\n",
     "[regenerate] timeout_s = 0: must be a number in (0, 86400]"),
    (SOURCE + "[regenerate]\nrequest_deadline_s = inf\n",
     "[regenerate] request_deadline_s = inf: must be a number in (0, 86400]"),
    (SOURCE + "[regenerate]\nbackend = 'tgi'\n",
     '[regenerate] backend = "tgi": must be one of "transformers", "openai", "vllm"'),
    (SOURCE + "[regenerate]\nkeep_truncated = 1\n",
     "[regenerate] keep_truncated = 1: must be true or false"),
    # the fleet settings, declared once (core/config.py FLEET_SETTINGS), checked alike
    (SOURCE + "[extract]\ncooldown_s = 0\n",
     "[extract] cooldown_s = 0: must be a number in (0, 600]"),
    (SOURCE + "[regenerate]\ncooldown_s = 700\n",
     "[regenerate] cooldown_s = 700: must be a number in (0, 600]"),
    (SOURCE + "[extract]\nconcurrency = 0\n",
     "[extract] concurrency = 0: must be an integer >= 1"),
    (SOURCE + "[extract]\ndtype = 'fp16'\n",
     '[extract] dtype = "fp16": must be one of "fp32", "bf16"; did you mean "bf16"?'),
    (SOURCE + "[expectations]\nshare_tolerance = -0.1\n",
     "[expectations] share_tolerance = -0.1: must be a number in [0, 1]"),
    (SOURCE + "[expectations.max_quarantine_rate_per_source]\na = 'high'\n",
     '[expectations.max_quarantine_rate_per_source] a = "high": must be a number in [0, 1]'),
    (SOURCE + "[target]\ntiny = 3\n", "[target] tiny = 3: must be a table"),
    # values the schema let through, that failed hours later (or allocated 25 GB)
    (SOURCE + "[train]\nblock_size = 100000000\n",
     "[train] block_size = 100000000: must be an integer in [2, 256]"),
    ('[[sources]]\npath = "a"\nweight = inf\n', "weight must be a positive number, and finite"),
    ('[[sources]]\npath = "a"\nmax_rows = 0\n',  # was read, then "set format=" when empty
     "max_rows = 0: give a whole number of rows, 1 or more"),
    ('[[sources]]\npath = 5\n', "[[sources]] #1 path = 5: must be a string"),
    ('[[sources]]\npath = "a"\nfields = { messages = 1 }\n',
     "[[sources]] #1 fields = { messages = 1 }: must be a table of strings"),
])
def test_a_bad_value_is_refused_with_key_value_and_range(tmp_path, text, expected):
    if "[[sources]]" not in text:
        text += SOURCE
    assert expected in _refused(tmp_path, text)


def test_a_quoted_value_says_to_drop_the_quotes(tmp_path):
    assert 'dedup = "false": must be true or false (a TOML boolean, without quotes); write ' \
        "false without quotes" in _refused(tmp_path, '[run]\ndedup = "false"\n' + SOURCE)
    assert "write 10 without quotes" in _refused(tmp_path, '[run]\nshard_rows = "10"\n' + SOURCE)


def test_every_problem_is_reported_at_once(tmp_path):
    message = _refused(tmp_path, '[run]\nshard_rows = 0\ndedup = "no"\n' + SOURCE
                       + "[tokenise]\n[train]\nsave_every = 0\n")
    assert message.count("\n  - ") == 4 and "4 problems" in message


def test_what_is_allowed_is_accepted(tmp_path):
    config = _load(tmp_path, "[run]\nmax_quarantine_rate = 0\nworkers = 0\n" + SOURCE
                   + "[train]\nlr = 1\ndevice = 'cuda:1'\nlabels = 'target'\n"
                   "[ingest]\nweight_by = 'supervised_tokens'\n"
                   "[tokenize]\nchat_template = 't.jinja'\n"
                   "[target]\ntiny = { hidden_size = 8 }\n"
                   "[expectations.max_quarantine_rate_per_source]\na = 1\n")
    assert config.run.max_quarantine_rate == 0 and config.section("train")["lr"] == 1
    assert config.section("train")["labels"] == "target"
    assert config.section("ingest")["weight_by"] == "supervised_tokens"


def test_the_existing_messages_still_hold(tmp_path):
    assert "format='csv'" in _refused(tmp_path, SOURCE + 'format = "csv"\n')
    assert "max_rows = -1: give a whole number of rows, 1 or more" in _refused(
        tmp_path, SOURCE + "max_rows = -1\n")
    assert "weight must be a positive number" in _refused(tmp_path, SOURCE + "weight = 0\n")
    assert "'path' is required" in _refused(tmp_path, '[[sources]]\nname = "a"\n')
    assert "repeated: ['a']" in _refused(tmp_path, SOURCE + SOURCE)
    with pytest.raises(ConfigError, match=r"\[run\]: unknown key shard_row"):
        parse_config({"run": {"shard_row": 1}, "sources": [{"path": "a"}]}, tmp_path)


# ---------------------------------------------------------------- the command line
def test_a_flag_gets_the_same_checks():
    from dflash_etl.stages.extract import ExtractSettings
    from dflash_etl.stages.regenerate import RegenerateSettings
    from dflash_etl.stages.tokenize import TokenizeSettings
    from dflash_etl.stages.train import TrainSettings

    tokenize, train = TokenizeSettings, TrainSettings
    with pytest.raises(StageError, match=r"--seq-length -5: must be an integer >= 1"):
        build_settings(tokenize, "tokenize", {}, {"model": "m", "seq_length": -5})
    with pytest.raises(StageError, match=r"--save-every 0: must be an integer >= 1"):
        build_settings(train, "train", {}, {"target": "t", "save_every": 0})
    with pytest.raises(StageError, match=r"--timeout-s 0: must be a number in \(0, 86400\]"):
        build_settings(RegenerateSettings, "regenerate", {}, {"model": "m", "timeout_s": 0})
    with pytest.raises(StageError, match=r"--request-deadline-s 0: must be a number in \(0, 86400"):
        build_settings(ExtractSettings, "extract", {}, {"model": "m", "request_deadline_s": 0})
    with pytest.raises(StageError, match=r"--endpoints lists .* more than once"):
        build_settings(ExtractSettings, "extract", {"endpoints": ["http://h/v1", "http://h/v1/"]},
                       {"model": "m"})
    with pytest.raises(StageError, match=r"\[tokenize\]: unknown key seq_lenght; did you mean"):
        build_settings(tokenize, "tokenize", {"seq_lenght": 8}, {"model": "m"})
    # the flag wins over the config, and is the one checked
    settings = build_settings(tokenize, "tokenize", {"seq_length": 8},
                              {"model": "m", "seq_length": 16})
    assert settings.seq_length == 16


def test_the_cli_exits_1_with_the_error_and_no_traceback(tmp_path, monkeypatch, capsys):
    from dflash_etl.cli.main import main

    (tmp_path / "bad.toml").write_text("[run]\nshard_rows = 0\n" + SOURCE + "[tokenise]\n")
    run_dir = tmp_path / "run"
    assert main(["ingest", "--config", str(tmp_path / "bad.toml"), "--run", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'bad.toml'}: 2 problems") and "Traceback" not in err
    assert "shard_rows = 0: must be an integer >= 1" in err and "did you mean [tokenize]?" in err
    assert not run_dir.exists()  # refused before anything ran

    (tmp_path / "latin1.toml").write_bytes("[run]\nseed = 1  # café\n".encode("latin-1"))
    assert main(["ingest", "--config", str(tmp_path / "latin1.toml"), "--run", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not UTF-8" in err and "Traceback" not in err

    assert main(["tokenize", "--seq-length", "-5", "--run", str(run_dir)]) == 1
    assert "error: --seq-length -5: must be an integer >= 1" in capsys.readouterr().err


# ---------------------------------------------------------------- files
def test_a_file_that_is_not_utf8_names_the_byte(tmp_path):
    path = tmp_path / "pipeline.toml"
    raw = b'[run]\nseed = 0\n[[sources]]\npath = "caf\xe9.jsonl"\n'
    path.write_bytes(raw)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert raw.index(b"\xe9") == 38
    assert str(info.value).startswith(f"{path}: not UTF-8: byte 38 (line 4) is b'\\xe9'")
    assert "save the file as UTF-8" in str(info.value)
    path.write_bytes(b"\xef\xbb\xbf" + SOURCE.encode())  # a UTF-8 byte order mark is fine
    assert load_config(path).sources[0].name == "a"


def _pipeline_configs() -> list[Path]:
    found = []
    for folder in ("data", "benchmarks", "tests"):
        for path in sorted((REPO / folder).rglob("*.toml")):
            if "sources" in tomllib.loads(path.read_text(encoding="utf-8")):
                found.append(path)
    return found


@pytest.mark.parametrize("path", _pipeline_configs(), ids=lambda p: str(p.relative_to(REPO)))
def test_the_shipped_configs_load(path):
    assert load_config(path).sources


def test_the_embedded_default_loads_and_is_among_them():
    assert REPO / "data" / "pipeline.toml" in _pipeline_configs()
    config = load_config(REPO / "data" / "pipeline.toml")
    assert config.section("tokenize")["seq_length"] == 1024


# ---------------------------------------------------------------- the pipeline
def test_each_stage_section_is_its_settings_class():
    from dflash_etl.stages import extract, regenerate, tokenize, train
    from dflash_etl.validation import suites

    sections = PIPELINE.sections()
    assert sections["regenerate"] is regenerate.RegenerateSettings
    assert sections["tokenize"] is tokenize.TokenizeSettings
    assert sections["extract"] is extract.ExtractSettings
    assert sections["train"] is train.TrainSettings
    keys = {f for f in ExpectationsSettings.__dataclass_fields__}
    assert keys == {*suites.DEFAULTS, suites.PER_SOURCE_KEY}


def test_core_config_imports_no_stage():
    code = ("import sys, dflash_etl.core.config; "
            "print(sorted(m for m in sys.modules if m.startswith('dflash_etl.stages')))")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env).stdout
    assert out.strip() == "[]"


def test_values_that_failed_later_are_refused_with_the_config(tmp_path):
    """Reliability issue, item 15: `near_dedup_ngram = 100000` passed the schema and failed as
    an internal error; `[target] tiny` with a negative size was refused only after ingest had
    run (hours at scale); `decontaminate = "file.jsonl"` (a string) was read character by
    character."""
    from dflash_etl.stages.ingest import IngestSettings

    with pytest.raises(ConfigError, match=r"near_dedup_ngram = 100000: must be an integer in "
                                          r"\[1, 32\]"):
        parse_config({"sources": [{"path": "a"}], "ingest": {"near_dedup_ngram": 100000}},
                     tmp_path)
    with pytest.raises(ConfigError, match=r"\[target\] tiny: layers = -2: give a whole number"):
        parse_config({"sources": [{"path": "a"}], "target": {"tiny": {"layers": -2}}}, tmp_path)
    settings = build_settings(IngestSettings, "ingest", {"decontaminate": "gsm8k.jsonl"}, {})
    assert settings.decontaminate == ("gsm8k.jsonl",)
