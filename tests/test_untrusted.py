"""Untrusted inputs: chat templates that exhaust time or memory, model directories that ask for
their own code, and checkpoints that do not match their files (issue 16, sections 2 and 3)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.stages import ingest, parse_config, tokenize
from dflash_etl.templates.limits import (
    RenderError,
    RenderLimits,
    RenderTimeout,
    RenderTooLarge,
    render_limits,
)
from dflash_etl.templates.render import render

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "tokenizer"
CHATML = (TOKENIZER / "chat_template.jinja").read_text()
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
SMALL = RenderLimits(timeout_s=0.5, size_factor=10, size_extra=100_000)

# ---------------------------------------------------------------- templates: time and size
SPINS = {
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}"
                          "{% endfor %}{% endfor %}",
    "nested loops over a list": "{% set r = range(100000) | list %}{% for i in r %}"
                                "{% for j in r %}{% endfor %}{% endfor %}",
    "exponential macro recursion": "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}"
                                   "{% endif %}{% endmacro %}{{ f(60) }}",
}
BLOWS_UP = {
    "a huge power": "{{ 11 ** (10 ** 8) }}",
    "a huge repeat": "{{ 'x' * 4000000000 }}",
    "a huge list": "{{ ([1] * 4000000000) | length }}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                       "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "squaring an integer": "{% set ns = namespace(x=3) %}{% for i in range(64) %}"
                           "{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "str.center": "{{ 'x'.center(4000000000) }}",
    "the center filter": "{{ 'x' | center(4000000000) }}",
    "str.format width": "{{ '{:>4000000000}'.format(1) }}",
    "a nested format width": "{{ '{:>{}}'.format(1, 4000000000) }}",
    "printf width": "{{ '%4000000000d' % 1 }}",
    "the format filter": "{{ '%4000000000d' | format(1) }}",
    "a tojson indent": "{{ messages | tojson(indent=4000000000) }}",
    "replace doubling": "{% set ns = namespace(s='xxxx') %}{% for i in range(64) %}"
                        "{% set ns.s = ns.s.replace('x', 'xx') %}{% endfor %}",
    "join of copies": "{% set s = 'x' * 90000 %}{{ [s, s, s, s, s, s, s, s, s, s, s, s] | join }}",
    "output in a loop": "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx"
                        "{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("name", list(SPINS))
def test_a_template_that_spins_is_stopped_at_the_time_limit(project_tok, name):
    start = time.monotonic()
    with render_limits(SMALL), pytest.raises(RenderTimeout, match=r"within 0\.5 s"):
        render(project_tok, MESSAGES, chat_template=SPINS[name])
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("name", list(BLOWS_UP))
def test_a_template_that_blows_up_is_refused_before_it_allocates(project_tok, name):
    start = time.monotonic()
    with render_limits(SMALL), pytest.raises(RenderTooLarge, match="over the render size limit"):
        render(project_tok, MESSAGES, chat_template=BLOWS_UP[name])
    assert time.monotonic() - start < 3


def test_the_time_limit_holds_off_the_main_thread(project_tok):
    """No SIGALRM there: the loops' own deadline checks stop the render."""
    caught: list[BaseException] = []

    def spin() -> None:
        try:
            with render_limits(SMALL):
                render(project_tok, MESSAGES, chat_template=SPINS["nested loops over a list"])
        except BaseException as exc:  # the test reports what it was
            caught.append(exc)

    worker = threading.Thread(target=spin)
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and len(caught) == 1 and isinstance(caught[0], RenderTimeout)


def test_what_transformers_renders_itself_is_stopped_by_sigalrm(project_tok):
    """The fallback render and the {% generation %} mask run transformers' own compiled template
    (no loop checks): SIGALRM ends them, and an alarm outside a render still reaches the
    handler that was there before."""
    import signal

    from dflash_etl.templates.render import guarded_call, render_with_transformers

    seen: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: seen.append(signum))
    try:
        start = time.monotonic()
        with render_limits(SMALL), pytest.raises(RenderTimeout):
            guarded_call(MESSAGES, None, render_with_transformers, project_tok, MESSAGES,
                         chat_template=SPINS["nested loops over a list"])
        assert time.monotonic() - start < 3
        signal.raise_signal(signal.SIGALRM)
        assert seen == [signal.SIGALRM]
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_a_guarded_transformers_render_takes_every_keyword(project_tok):
    """The {% generation %} mask call passes tools= (and the rest) through the guard."""
    from dflash_etl.templates.render import guarded_call

    with render_limits(SMALL):
        text = guarded_call(MESSAGES, [], project_tok.apply_chat_template, MESSAGES, tools=[],
                            chat_template=CHATML, tokenize=False)
    # the reference render (its first compiles the template) outside the 0.5 s limit: on a
    # loaded machine the compile alone passed it
    assert text == render(project_tok, MESSAGES, chat_template=CHATML, tools=[])


def test_limits_leave_real_templates_and_big_ranges_alone(project_tok):
    long = [{"role": "user", "content": "word " * 50_000}, {"role": "assistant", "content": "ok"}]
    with render_limits(SMALL):  # the size limit grows with the conversation
        assert render(project_tok, long, chat_template=CHATML).count("word") == 50_000
        with pytest.raises(RenderError, match="MAX_RANGE"):  # jinja's own bound on range()
            render(project_tok, MESSAGES, chat_template="{{ range(10 ** 9) | length }}")
        assert render(project_tok, MESSAGES, chat_template="{{ 2 ** 64 }}{{ 'ab' * 3 }}") \
            == "18446744073709551616ababab"


# ---------------------------------------------------------------- the tokenize stage
# passes the probe (short conversations), then spins on a row with a long first turn, and
# builds gigabytes on a row that asks for it
TRAP = ("{%- if messages[0].content is string and messages[0].content | length > 300 -%}"
        "{%- for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor -%}"
        "{%- endif -%}{%- if messages[0].content is string and 'BLOWUP' in messages[0].content "
        "-%}{{ 'x' * 4000000000 }}{%- endif -%}") + CHATML


def _conversation(question: str) -> dict:
    import zlib

    # a reply of its own: one text for every prompt is a placeholder ingest filters
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant",
                          "content": f"A fine answer to that ({zlib.crc32(question.encode())})."}]}


def _tokenize(base: Path, template: str, workers: int) -> dict:
    rows = [_conversation(f"Question number {k}?") for k in range(40)]
    rows += [_conversation("long " * 80), _conversation("please BLOWUP now")]
    (base / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (base / "trap.jinja").write_text(template)
    config = parse_config({"run": {"workers": 1},
                           "sources": [{"name": "mini", "path": "rows.jsonl"}]}, base)
    ingest.run(config, base / "run")
    return tokenize.run(config, base / "run", workers=workers, model=str(TOKENIZER),
                        chat_template=str(base / "trap.jinja"), render_timeout_s=0.5,
                        draft_vocab_size=64)


@pytest.mark.slow
def test_tokenize_quarantines_the_rows_a_template_hangs_or_blows_up_on(tmp_path):
    """In forked workers (where SIGALRM and the loops' checks both run): the pool goes on."""
    import pyarrow.parquet as pq

    start = time.monotonic()
    total = _tokenize(tmp_path, TRAP, workers=2)["total"]
    assert time.monotonic() - start < 120  # a hung render would never end (a loaded machine: ~40 s)
    assert total["rows_in"] == 42 and total["rows_out"] == 40
    assert total["quarantine_reasons"] == {"template_render_timeout": 1,
                                           "template_output_too_large": 1}
    quarantine = pq.read_table(tmp_path / "run" / "tokenize" / "quarantine.parquet").to_pylist()
    assert {q["line"]: q["reason"] for q in quarantine} == {
        41: "template_render_timeout", 42: "template_output_too_large"}
    assert all("render" in q["message"] for q in quarantine)


def test_a_template_that_trips_the_limits_in_the_probe_fails_the_stage(tmp_path):
    with pytest.raises(StageError, match=r"trap.jinja: probing the template ran over the render "
                                         r"limit \(render_timeout_s = 0.5\)"):
        _tokenize(tmp_path, SPINS["nested range loops"] + CHATML, workers=1)


@pytest.mark.parametrize("constant", ["{{ 11 ** (10 ** 8) }}", "{{ 'x' | center(4000000000) }}"])
def test_a_constant_transformers_would_fold_is_refused_before_it_compiles(tmp_path, constant):
    """A {% generation %} template goes through transformers' own compile (the HF assistant
    mask), which folds constants at compile time even in a branch never taken."""
    tagged = CHATML.replace("{{- message.content }}", "{% generation %}{{- message.content }}"
                            "{% endgeneration %}") if "{{- message.content }}" in CHATML else (
        CHATML + "{% generation %}{% endgeneration %}")
    (tmp_path / "tagged.jinja").write_text("{% if false %}" + constant + "{% endif %}" + tagged)
    settings = tokenize.TokenizeSettings(model=str(TOKENIZER),
                                         chat_template=str(tmp_path / "tagged.jinja"))
    start = time.monotonic()
    with pytest.raises(StageError, match=r"tagged\.jinja: probing the template ran over"):
        tokenize.probe(settings)
    assert time.monotonic() - start < 10


def test_probe_template_has_the_same_limits(tmp_path):
    (tmp_path / "big.jinja").write_text(BLOWS_UP["a huge power"] + CHATML)
    settings = tokenize.TokenizeSettings(model=str(TOKENIZER),
                                         chat_template=str(tmp_path / "big.jinja"))
    with pytest.raises(StageError, match=r"big\.jinja: probing the template ran over the "
                                         r"render limit .*65,536 bits"):
        tokenize.probe(settings)
    (tmp_path / "slow.jinja").write_text(SPINS["nested range loops"] + CHATML)
    done = subprocess.run(
        [sys.executable, "-m", "dflash_etl.cli.main", "probe-template", "--model",
         str(TOKENIZER), "--chat-template", str(tmp_path / "slow.jinja"),
         "--render-timeout-s", "0.3"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "slow.jinja" in done.stderr
    assert "render_timeout_s = 0.3" in done.stderr and "Traceback" not in done.stderr


# ---------------------------------------------------------------- model directories: no own code
EVIL = """import pathlib
pathlib.Path({marker!r}).write_text("the directory's code ran")
"""
LOADERS = """
import json, sys
from dflash_etl.core.errors import StageError
model = sys.argv[1]
results = {}
def attempt(name, fn):
    try:
        fn()
        results[name] = "loaded"
    except StageError as exc:
        results[name] = "refused: " + str(exc)
from dflash_etl.models.target import Target, TargetSpec
from dflash_etl.models.layers import target_layer_count
from dflash_etl.models.generation.local import TransformersBackend
from dflash_etl.stages.regenerate import RegenerateSettings
from dflash_etl.models.mask_token import resolve_mask_token
attempt("extract", lambda: target_layer_count(model))
attempt("target", lambda: Target(TargetSpec(model=model, device="cpu")))
attempt("regenerate", lambda: TransformersBackend(RegenerateSettings(model=model)))
attempt("train", lambda: resolve_mask_token(model, 10**6, -1))
print(json.dumps(results))
"""


def _with_own_code(tiny_model: Path, out: Path, model_type: str) -> Path:
    import shutil

    shutil.copytree(tiny_model, out)
    config = json.loads((out / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (out / "config.json").write_text(json.dumps(config))
    for name in ("configuration_evil.py", "modeling_evil.py"):  # transformers imports a copy
        (out / name).write_text(EVIL.format(marker=str(out / "CODE_RAN")))
    return out


def _load_everywhere(model: Path) -> dict:
    """Every loader in a fresh process whose stdin says "y" to transformers' [y/N] question."""
    done = subprocess.run([sys.executable, "-c", LOADERS, str(model)], input="y\n" * 8,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_model_that_needs_its_own_code_is_refused_everywhere(tiny_model, tmp_path):
    model = _with_own_code(tiny_model, tmp_path / "evil", "evil_arch")
    results = _load_everywhere(model)
    assert not (model / "CODE_RAN").exists()
    for stage in ("extract", "target", "regenerate", "train"):
        assert results[stage].startswith("refused: "), (stage, results[stage])
        assert "`auto_map`" in results[stage] and "'evil_arch'" in results[stage]
        assert "trust_remote_code=False" in results[stage]


@pytest.mark.slow
def test_an_auto_map_beside_a_built_in_architecture_loads_without_its_code(tiny_model, tmp_path):
    model = _with_own_code(tiny_model, tmp_path / "native", "qwen2")
    results = _load_everywhere(model)
    assert results == {"extract": "loaded", "target": "loaded", "regenerate": "loaded",
                       "train": "loaded"}
    assert not (model / "CODE_RAN").exists()


# ---------------------------------------------------------------- model identity
IDENTIFYING = ("config.json", "generation_config.json", "model.safetensors",
               "model-00001-of-00002.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin", "consolidated.00.pth", "tf_model.h5", "flax_model.msgpack",
               "model.gguf", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
               "qwen.tiktoken", "vocab.json", "merges.txt", "spiece.model", "vocab",
               "chat_template.jinja", "special_tokens_map.json")
NOT_IDENTIFYING = ("README.md", "LICENSE", ".gitattributes", ".cache-marker")


def test_model_identity_covers_every_weight_config_and_tokenizer_file(tmp_path):
    from dflash_etl.models.identity import model_identity, tokenizer_identity

    for name in (*IDENTIFYING, *NOT_IDENTIFYING):
        (tmp_path / name).write_bytes(b"original " + name.encode())
    before, tok_before = model_identity(tmp_path), tokenizer_identity(tmp_path)
    weights = {"model.safetensors", "model-00001-of-00002.safetensors", "pytorch_model.bin",
               "consolidated.00.pth", "tf_model.h5", "flax_model.msgpack", "model.gguf"}
    for name in IDENTIFYING:
        original = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(b"replaced")
        assert model_identity(tmp_path) != before, name
        assert (tokenizer_identity(tmp_path) == tok_before) == (name in weights), name
        (tmp_path / name).write_bytes(original)
    for name in NOT_IDENTIFYING:
        (tmp_path / name).write_bytes(b"edited")
    assert model_identity(tmp_path) == before and tokenizer_identity(tmp_path) == tok_before


def test_a_conversation_spends_the_render_limit_once_not_per_render(project_tok):
    """The render-diff renders a conversation several times; each render had the whole limit,
    so one spinning row cost 3-4 x render_timeout_s (18 rows: 389 s). Now they share it."""
    from dflash_etl.templates import MaskRefused, probe_template, tokenize_conversations

    template = TRAP
    probe = probe_template(project_tok, template)
    conv = {"id": "x", "source": "s", "tools": None, "messages": [
        {"role": "user", "content": "long " * 80},
        {"role": "assistant", "content": "A fine answer."},
        {"role": "user", "content": "And again?"},
        {"role": "assistant", "content": "Again."},
        {"role": "user", "content": "Once more?"},
        {"role": "assistant", "content": "Once more."}]}
    with render_limits(RenderLimits(timeout_s=1.0)):
        start = time.monotonic()
        (result,) = tokenize_conversations([conv], project_tok, probe, chat_template=template)
        elapsed = time.monotonic() - start
    assert isinstance(result, MaskRefused) and result.code == "template_render_timeout"
    assert elapsed < 2.0, elapsed  # one limit (1 s) and some overhead, not one per render


def test_a_template_that_spins_on_many_rows_stops_the_stage_naming_it(tmp_path):
    """A template that times out on many rows is broken as a whole: the stage stops after a
    few timeouts (max_render_timeout_share), naming the template and the limit, instead of
    spending render_timeout_s on every row (10k such rows: hours)."""
    rows = [_conversation(("long " * 80 + str(k)) if k % 2 else f"Question {k}?")
            for k in range(40)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "trap.jinja").write_text(TRAP)
    config = parse_config({"run": {"workers": 1},
                           "sources": [{"name": "mini", "path": "rows.jsonl"}]}, tmp_path)
    ingest.run(config, tmp_path / "run")
    start = time.monotonic()
    with pytest.raises(StageError, match=r"trap.jinja: the template ran over the render time "
                       r"limit on 3 of the 6 conversations seen .*render_timeout_s \(now 0.5\)"):
        tokenize.run(config, tmp_path / "run", workers=1, model=str(TOKENIZER),
                     chat_template=str(tmp_path / "trap.jinja"), render_timeout_s=0.5,
                     draft_vocab_size=64)
    assert time.monotonic() - start < 60  # 3 timeouts, not 20


def test_a_model_path_that_is_not_a_directory_is_named_not_taken_for_a_hub_id(
        default_tokenized, copy_run, tmp_path, capsys):
    """extract --model /missing answered with transformers' "Repo id must be in the form ..."
    (a relative one: "couldn't connect to huggingface.co"); every loader now says what the
    path is."""
    from dflash_etl.cli.main import main
    from dflash_etl.models.loading import load_causal_lm, load_config

    (tmp_path / "a-file").write_text("x")
    for path, why in ((tmp_path / "missing", "(nothing is there)"), (tmp_path / "a-file", ""),
                      (Path("relative-missing"), "(nothing is there)")):
        for load in (load_config, load_causal_lm):
            with pytest.raises(StageError, match=rf"is not a directory {re.escape(why)}"
                               if why else r"is not a directory: a model is read from a local"):
                load(path)
    run = copy_run(default_tokenized, tmp_path / "run")
    assert main(["extract", "--run", str(run), "--model", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert f"'{tmp_path / 'missing'}' is not a directory (nothing is there)" in err
    assert "Repo id" not in err and "huggingface.co" not in err
