"""The regenerate stage with the transformers backend on a tiny random-weight model (built from a
config, with the project's own tokenizer in data/tokenizer): real generate, real files, the stage's
accounting, and the checks that keep dummy, empty and truncated replies out of the data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.models.generation.conversations import template_messages
from dflash_etl.models.generation.replies import Reply, check_reply, dummy_replies, split_reasoning
from dflash_etl.stages import load_config, regenerate
from dflash_etl.stages.regenerate import RegenerateSettings

ROWS = [
    {"id": "p1", "prompt": "Name three colours of the rainbow."},
    {"id": "p2", "prompt": "What is the capital of France?"},
    {"id": "p3", "messages": [{"role": "user", "content": "Say something about rivers."}]},
    {"id": "c1", "messages": [{"role": "user", "content": "Hi there"},
                              {"role": "assistant", "content": "Hello! How can I help?"},
                              {"role": "user", "content": "Tell me about trees."},
                              {"role": "assistant", "content": "Trees are tall plants."}]},
]


@pytest.fixture()
def ingested(ingest_rows) -> Path:
    return ingest_rows(ROWS, "mixed")


def _conversations(run_dir: Path) -> dict[str, dict]:
    frame = pl.read_parquet(run_dir / "regenerate" / "conversations" / "*.parquet")
    return {r["id"]: r for r in frame.to_dicts()}


def _ids(run_dir: Path, stage: str) -> dict[str, str]:
    """source row id (the `line` of the source file) -> conversation id"""
    frame = pl.read_parquet(run_dir / stage / "conversations" / "*.parquet")
    return {ROWS[r["line"] - 1]["id"]: r["id"] for r in frame.to_dicts()}


def test_missing_mode_answers_prompts_with_real_generations(tiny_model, ingested):
    doc = regenerate.run(None, ingested, progress=False, model=str(tiny_model),
                         max_new_tokens=12, temperature=1.0, keep_truncated=True,
                         dummy_min_repeats=99)
    total = doc["total"]
    assert total["rows_in"] == 4
    assert total["rows_in"] == (total["rows_out"] + total["rows_quarantined"]
                                + sum(total["rows_filtered"].values()))
    ids = _ids(ingested, "ingest")
    out = _conversations(ingested)
    before = {r["id"]: r for r in pl.read_parquet(
        ingested / "ingest" / "conversations" / "*.parquet").to_dicts()}
    answered = [out[ids[k]] for k in ("p1", "p2", "p3") if ids[k] in out]
    assert answered, f"no prompt kept: {total}"
    for conv in answered:
        assert conv["messages"][-1]["role"] == "assistant"
        assert conv["needs_response"] is False
        assert len(conv["messages"]) == len(before[conv["id"]]["messages"]) + 1
    assert out[ids["c1"]]["messages"] == before[ids["c1"]]["messages"]  # complete: untouched
    assert total["generated_turns"] == len(answered)
    turns = pl.read_parquet(ingested / "regenerate" / "generated_turns.parquet")
    assert sorted(turns["id"]) == sorted(c["id"] for c in answered)
    for row in turns.to_dicts():  # the generated turn is the conversation's last message
        assert row["turn"] == len(out[row["id"]]["messages"]) - 1
        assert row["finish_reason"] in ("stop", "length") and 0 < row["new_tokens"] <= 12
    gate = json.loads((ingested / "regenerate" / "validation.json").read_text())
    assert gate["suite"] == "conversations" and gate["passed"]
    assert gate["rows"] == total["rows_out"]
    assert sum(total["finish_reasons"].values()) == len(answered)
    # tokenize now reads the regenerated conversations
    from dflash_etl.core.outputs import ConversationsOutput
    from dflash_etl.core.rundir import RunDir

    read = RunDir(ingested).output(ConversationsOutput, ["ingest", "regenerate"], "tokenize")
    assert read.files()[0].parent == ingested / "regenerate" / "conversations"


def test_truncated_replies_are_filtered_and_counted(tiny_model, ingested):
    # greedy decoding of random weights repeats one token and never reaches the end of turn:
    # with mode=all every turn is cut at max_new_tokens, so every conversation is filtered
    with pytest.raises(StageError, match=r"kept no conversations of 4.*truncated_response"
                       ) as failed:
        regenerate.run(None, ingested, progress=False, model=str(tiny_model), mode="all",
                       max_new_tokens=3)
    # advice for the reason that occurred, none for those that did not
    assert "'truncated_response': raise --max-new-tokens" in str(failed.value)
    assert "'dummy_reply':" not in str(failed.value)
    assert "'reply_inside_think_block':" not in str(failed.value)
    # the stage's warnings follow the reasons: here the truncation share, with its advice
    assert "4 of 4 replies with thinking off (100%) stopped at max_new_tokens" in str(failed.value)
    assert not (ingested / "regenerate").exists()  # a failed stage publishes nothing
    manifest = json.loads((ingested / "manifest.json").read_text())
    assert manifest["stages"]["regenerate"]["status"] == "failed"


def test_an_interrupted_run_resumes_to_the_same_result(tiny_model, ingested, tmp_path):
    kw = {"progress": False, "model": str(tiny_model), "max_new_tokens": 8, "temperature": 1.0,
          "keep_truncated": True, "dummy_min_repeats": 99, "batch_size": 1, "mode": "all"}
    backend = regenerate.TransformersBackend(RegenerateSettings(
        **{k: v for k, v in kw.items() if k != "progress"}))
    calls = {"n": 0}
    real = backend.generate

    def crash_after_two(prompts):
        calls["n"] += 1
        if calls["n"] > 2:
            raise KeyboardInterrupt
        return real(prompts)

    backend.generate = crash_after_two
    with pytest.raises(KeyboardInterrupt):
        regenerate.run(None, ingested, generator=backend, **kw)
    cached = (ingested / ".regenerate.partial" / "generations.jsonl").read_text().splitlines()
    assert len(cached) == 2  # what finished is kept

    backend.generate = real
    calls_after = {"n": 0}

    def counting(prompts):
        calls_after["n"] += 1
        return real(prompts)

    backend.generate = counting
    resumed_doc = regenerate.run(None, ingested, generator=backend, **kw)
    resumed = _conversations(ingested)
    targets = resumed_doc["total"]["generated_turns"]
    assert calls_after["n"] == targets - 2  # only what was missing

    fresh_run = tmp_path / "fresh"
    shutil.copytree(ingested, fresh_run, ignore=shutil.ignore_patterns("*regenerate*"))
    regenerate.run(None, fresh_run, generator=backend, **kw)
    assert _conversations(fresh_run) == resumed


def test_reply_checks():
    s = RegenerateSettings(model="m", max_new_tokens=5)
    assert check_reply(Reply("   ", "stop", 1), s)[1] == "empty_response"
    assert check_reply(Reply("cut off mid", "length", 5), s)[1] == "truncated_response"
    assert check_reply(Reply("cut off mid", "length", 5),
                       RegenerateSettings(model="m", keep_truncated=True)) is None
    off = RegenerateSettings(model="m", thinking="off")
    assert check_reply(Reply("sure </think> answer", "stop", 3), off)[1] == "reasoning_in_content"
    assert check_reply(Reply("A fine answer.", "stop", 3), s) is None
    assert split_reasoning("<think>\nstep 1\n</think>\n\nThe answer") == ("The answer", "step 1")
    assert split_reasoning("plain") == ("plain", None)


def test_replies_stuck_in_a_loop_are_degenerate():
    s = RegenerateSettings(model="m", max_new_tokens=64)
    loop = Reply("The word is lin" + "lin" * 60, "length", 64)
    kind, code, message = check_reply(loop, s)  # told before the truncation
    assert (kind, code) == ("quarantine", "degenerate_repetition") and "'lin'" in message
    said_again = Reply("We went to the market and bought some bread. " * 10, "stop", 90)
    assert check_reply(said_again, s)[1] == "degenerate_repetition"
    thinking_loop = Reply("<think>" + "hmm, wait. " * 30 + "</think>Fine.", "stop", 64)
    assert check_reply(thinking_loop, s)[1] == "degenerate_repetition"
    prose = Reply(" ".join(f"Point {k}: the {w} differs from the others in its own way."
                           for k, w in enumerate(["river", "tree", "stone", "cloud", "road",
                                                  "bridge", "field", "house"])), "stop", 90)
    assert check_reply(prose, s) is None
    code_reply = Reply("def f(x):\n    return x * 2\n\n" + "-" * 20 + "\nDone.", "stop", 20)
    assert check_reply(code_reply, s) is None
    off = RegenerateSettings(model="m", repeat_tail_chars=0, ngram_repeat_max=1.0,
                             keep_truncated=True)
    assert check_reply(loop, off) is None and check_reply(said_again, off) is None


def test_dummy_replies_are_found_across_prompts():
    replies = {"a": "OK.", "b": " ok. ", "c": "OK.", "d": "A long and specific answer about x.",
               "e": "Sure!", "f": "Sure!"}
    assert dummy_replies(replies, 3) == {"a", "b", "c"}
    assert dummy_replies(replies, 2) == {"a", "b", "c", "e", "f"}
    long = {str(k): "the same long answer repeated for every single prompt here" for k in range(5)}
    assert dummy_replies(long, 3) == set()  # only short replies are dummy-like


def test_cli_subcommand_and_module_entry(tiny_model, ingested, capsys):
    from dflash_etl.cli.main import main

    args = ["--run", str(ingested), "--model", str(tiny_model), "--max-new-tokens", "6",
            "--temperature", "1.0", "--keep-truncated"]
    assert main(["regenerate", *args]) == 0
    out = capsys.readouterr().out
    assert "regenerate done: conversations 4 in" in out
    assert main(["regenerate", *args]) == 0  # same inputs: skipped
    assert "already complete, skipped" in capsys.readouterr().out
    assert main(["check", str(ingested / "regenerate")]) == 0
    assert "PASS regenerate" in capsys.readouterr().out
    report = (ingested / "docs" / "index.html").read_text()
    assert "regenerate" in report
    assert main(["regenerate", "--run", str(ingested), "--model",
                 str(ingested / "no-such-model")]) == 1
    assert "is not a directory" in capsys.readouterr().err


# ---------------------------------------------------------------- openai backend
def _openai_kw(server, **extra):
    return {"progress": False, "model": str(server.model_dir), "backend": "openai",
            "endpoint": server.url, "max_new_tokens": 8, "temperature": 1.0,
            "keep_truncated": True, "dummy_min_repeats": 99, "mode": "all", **extra}


@pytest.fixture(scope="module")
def server(tiny_model):
    from dflash_etl.models.devserver import DevServer

    with DevServer(str(tiny_model)) as srv:
        srv.model_dir = tiny_model
        yield srv


def test_openai_backend_over_real_http_matches_the_local_model(tiny_model, server, ingested,
                                                               tmp_path):
    regenerate.run(None, ingested, **_openai_kw(server, concurrency=4))
    over_http = _conversations(ingested)
    streamed_run = tmp_path / "streamed"
    shutil.copytree(ingested, streamed_run, ignore=shutil.ignore_patterns("*regenerate*"))
    regenerate.run(None, streamed_run, **_openai_kw(server, stream=True))
    local_run = tmp_path / "local"
    shutil.copytree(ingested, local_run, ignore=shutil.ignore_patterns("*regenerate*"))
    regenerate.run(None, local_run, progress=False, model=str(tiny_model), max_new_tokens=8,
                   temperature=1.0, keep_truncated=True, dummy_min_repeats=99, mode="all",
                   batch_size=1)
    assert over_http == _conversations(streamed_run) == _conversations(local_run)
    assert any(m["content"] for c in over_http.values() for m in c["messages"]
               if m["role"] == "assistant")


def test_openai_backend_retries_failures_and_timeouts(server, ingested):
    from dflash_etl.models.generation.fleet import OpenAIBackend

    kw = _openai_kw(server, timeout_s=5.0, retries=2)  # generous: CI machines can be slow
    backend = OpenAIBackend(RegenerateSettings(**{k: v for k, v in kw.items()
                                                  if k != "progress"}))
    server.fail_next, server.delay_next, server.delay_s = 1, 1, 8.0  # a 500, then a timeout
    doc = regenerate.run(None, ingested, generator=backend, **kw)
    assert backend.retried == 2
    assert doc["total"]["rows_quarantined"] == 0

    server.fail_next = 10  # more failures than attempts: the conversation is quarantined
    kw = {**kw, "retries": 1, "concurrency": 1, "seed": 7}
    stubborn = OpenAIBackend(RegenerateSettings(**{k: v for k, v in kw.items()
                                                   if k != "progress"}))
    with pytest.raises(StageError) as err:
        regenerate.run(None, ingested, generator=stubborn, **kw)
    server.fail_next = 0
    assert "generation_failed" in str(err.value)
    quarantine = pl.read_parquet(ingested / ".regenerate.partial" / "quarantine.parquet")
    assert quarantine.height >= 1
    assert "failed after 2 attempts; last: HTTP 500" in quarantine["message"][0]


# ---------------------------------------------------------------- vllm backend
def test_vllm_backend_without_vllm_says_how_to_get_it(tiny_model, ingested, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # as on a machine without the gpu extra
    with pytest.raises(StageError, match=r"pip install 'dflash-etl\[gpu\]'"):
        regenerate.run(None, ingested, progress=False, model=str(tiny_model), backend="vllm")


def test_vllm_adapter_passes_rendered_token_ids_and_reads_outputs(tiny_model, ingested,
                                                                   monkeypatch):
    """vLLM needs a GPU, so here a stand-in `vllm` module records what the adapter sends and
    answers like vLLM's RequestOutput; it checks this adapter, not vLLM (the issue asks for a real
    vLLM run where a GPU is lent)."""
    import sys
    import types

    calls = []

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class LLM:
        def __init__(self, **kw):
            calls.append(("init", kw))

        def generate(self, inputs, params, use_tqdm=True):
            calls.append(("generate", inputs, params.kw))
            done = types.SimpleNamespace(text="<think>plan</think>A real answer.",
                                         finish_reason="stop", token_ids=[5, 6, 7])
            return [types.SimpleNamespace(outputs=[done]) for _ in inputs]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM,
                                                                   SamplingParams=SamplingParams))
    doc = regenerate.run(None, ingested, progress=False, model=str(tiny_model), backend="vllm",
                         max_new_tokens=9, seed=3, dummy_min_repeats=99)
    assert calls[0] == ("init", {"model": str(tiny_model), "seed": 3, "trust_remote_code": False})
    _, inputs, params = calls[1]
    assert params == {"max_tokens": 9, "temperature": 0.0, "seed": 3}
    local = regenerate.TransformersBackend(RegenerateSettings(model=str(tiny_model)))
    ids = _ids(ingested, "ingest")
    before = {r["id"]: r for r in pl.read_parquet(
        ingested / "ingest" / "conversations" / "*.parquet").to_dicts()}
    prompts = [local.render(template_messages(before[ids[k]]["messages"]), None)
               for k in ("p1", "p2", "p3")]
    want = sorted(local.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts)
    assert sorted(i["prompt_token_ids"] for i in inputs) == want
    out = _conversations(ingested)
    reply = out[ids["p1"]]["messages"][-1]
    assert (reply["content"], reply["reasoning"]) == ("A real answer.", "plan")
    assert doc["total"]["finish_reasons"] == {"stop": 3}


# ---------------------------------------------------------------- [target] tiny
def test_a_target_directory_the_project_did_not_make_is_never_replaced(tmp_path):
    """[target] tiny builds `<run>/target/`; a directory there without the project's marker
    (someone's own model, say) is refused with a clear error and left as it was."""
    pytest.importorskip("torch")
    (tmp_path / "rows.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (tmp_path / "pipeline.toml").write_text(
        '[[sources]]\npath = "rows.jsonl"\n\n[target]\ntiny = { hidden_size = 16, layers = 1, '
        "heads = 2, kv_heads = 1 }\n")
    config = load_config(tmp_path / "pipeline.toml")
    run_dir = tmp_path / "run"
    mine = run_dir / "target"
    mine.mkdir(parents=True)
    (mine / "model.safetensors").write_bytes(b"my own weights")
    with pytest.raises(StageError, match=r"was not made by dflash-etl.*\[target\] model"):
        regenerate.run(config, run_dir, progress=False)
    assert sorted(p.name for p in mine.iterdir()) == ["model.safetensors"]
    assert (mine / "model.safetensors").read_bytes() == b"my own weights"

    mine.rename(tmp_path / "moved")  # moved away: the project builds its own, marked as its own
    from dflash_etl.models.tiny_model import CREATED_MARKER, configured_target

    built = Path(configured_target(config, run_dir))
    assert built == mine and (built / CREATED_MARKER).is_file()
    assert (built / "config.json").is_file()
    # its own directory it may replace (a changed spec rebuilds it)
    (tmp_path / "pipeline.toml").write_text(
        (tmp_path / "pipeline.toml").read_text().replace("hidden_size = 16", "hidden_size = 8"))
    rebuilt = Path(configured_target(load_config(tmp_path / "pipeline.toml"), run_dir))
    assert json.loads((rebuilt / "config.json").read_text())["hidden_size"] == 8


def test_the_summary_counts_replies_that_were_generated_then_filtered(tiny_model, ingested,
                                                                      capsys):
    """Every prompt's reply is cut at max_new_tokens (greedy random weights never end a turn)
    and filtered with its conversation; the complete conversation is kept. The summary and
    stats.json say 3 replies were generated and why none was kept (it said `generated turns:
    0`), and the share cut at max_new_tokens per thinking mode, with a warning above the
    threshold that says what to do."""
    from dflash_etl.cli.main import main

    args = ["regenerate", "--run", str(ingested), "--model", str(tiny_model),
            "--max-new-tokens", "3", "--thinking", "on"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "replies: 3 generated, 0 kept, 3 filtered or quarantined with their conversations " \
           "{'truncated_response': 3}" in out.out
    assert "thinking on: 3 of 3 replies cut at max_new_tokens (100%)" in out.out
    assert "WARNING: 3 of 3 replies with thinking on (100%) stopped at max_new_tokens" in out.out
    assert "raise --max-new-tokens" in out.out and "WARNING" in out.err
    total = json.loads((ingested / "regenerate" / "stats.json").read_text())
    assert total["total"]["generated_replies"] == 3 and total["total"]["generated_turns"] == 0
    assert total["total"]["dropped_replies"] == {"truncated_response": 3}
    assert total["total"]["truncation"] == {"on": {"replies": 3, "truncated": 3, "share": 1.0}}
    assert len(total["warnings"]) == 1

    # thinking off, under a threshold it does not pass: counted per mode, no warning
    assert main([*args[:-1], "off", "--max-truncated-share", "1", "--force"]) == 0
    out = capsys.readouterr()
    assert "thinking off: 3 of 3 replies" in out.out and "WARNING" not in out.out + out.err
    doc = json.loads((ingested / "regenerate" / "stats.json").read_text())
    assert doc["total"]["truncation"] == {"off": {"replies": 3, "truncated": 3, "share": 1.0}}
    assert doc["warnings"] == []


def test_thinking_mode_of_a_reply_with_the_templates_default():
    from dflash_etl.models.generation.replies import thinking_mode

    assert thinking_mode(Reply("x", "stop", 1), "on") == "on"
    assert thinking_mode(Reply("<think>x", "length", 1), "off") == "off"
    assert thinking_mode(Reply("reasoning", "length", 1, think_open=True), "keep") == "on"
    assert thinking_mode(Reply(" <think>a</think>b", "stop", 1), "keep") == "on"
    assert thinking_mode(Reply("b", "stop", 1, reasoning="a"), "keep") == "on"
    assert thinking_mode(Reply("b", "stop", 1, think_open=False), "keep") == "off"


def test_tokenize_refuses_a_regenerate_made_from_an_older_ingest(tiny_model, ingested, tmp_path,
                                                                 capsys):
    """ingest rerun on changed sources after regenerate (mode all): tokenize used to read
    ingest's original replies in silence, and check passed. Now it stops naming both stages and
    the rerun, check fails regenerate as stale, and `--stale-regenerate read_ingest` reads
    ingest's conversations on purpose, warned."""
    from dflash_etl.stages import ingest, tokenize
    from dflash_etl.validation.check import check_path

    kw = {"progress": False, "model": str(tiny_model), "max_new_tokens": 12,
          "temperature": 1.0, "keep_truncated": True, "dummy_min_repeats": 99, "mode": "all"}
    regenerate.run(None, ingested, **kw)
    source = tmp_path / "rows.jsonl"
    source.write_text(source.read_text() + json.dumps(
        {"id": "p4", "prompt": "One more question?"}) + "\n")
    ingest.run(load_config(tmp_path / "pipeline.toml"), ingested, progress=False, workers=1)
    with pytest.raises(StageError) as refused:
        tokenize.run(None, ingested, progress=False, model=str(tiny_model))
    message = str(refused.value)
    assert "regenerate's output was made from an older ingest output" in message
    assert f"dflash-etl regenerate --run {ingested}" in message
    assert "--stale-regenerate read_ingest" in message
    summary = check_path(ingested, suites=False)["summary"]
    assert "FAIL regenerate (manifest.json): the stage is stale: built on the ingest output" \
        in summary

    capsys.readouterr()
    doc = tokenize.run(None, ingested, progress=False, model=str(tiny_model),
                       stale_regenerate="read_ingest")
    assert "WARNING: regenerate's output was made from an older ingest output" in \
        capsys.readouterr().err
    assert doc["total"]["rows_in"] == 5  # ingest's five conversations, not regenerate's four


def test_tokenize_template_kwargs_reach_regenerates_renders(tiny_model, ingested, tmp_path):
    """[tokenize] template_kwargs are regenerate's too (replies follow the prompt the rows are
    rendered with): a template that needs `functions` renders in the local backend and through
    the openai backend's chat_template_kwargs; an enable_thinking there is the thinking
    setting, and one that contradicts --thinking is an error."""
    from dflash_etl.models.devserver import DevServer
    from dflash_etl.runner.settings import stage_settings
    from dflash_etl.stages import parse_config

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    template = model / "chat_template.jinja"
    template.write_text("{{- '<|im_start|>system\\nFunctions: ' + functions[0].name + "
                        "'<|im_end|>\\n' -}}" + template.read_text())
    kwargs = {"functions": [{"name": "get_time"}], "enable_thinking": False}
    config = parse_config({"sources": [{"path": "unread.jsonl"}],  # ingest ran already
                           "regenerate": {"model": str(model), "max_new_tokens": 6,
                                          "temperature": 1.0,
                                          "keep_truncated": True, "dummy_min_repeats": 99},
                           "tokenize": {"model": str(model), "template_kwargs": kwargs}},
                          tmp_path)
    settings = stage_settings(regenerate.RegenerateStage, config, ingested, {})
    assert settings.template_kwargs == {"functions": [{"name": "get_time"}]}
    assert settings.thinking == "off"
    with pytest.raises(StageError, match="enable_thinking = false contradicts --thinking on"):
        stage_settings(regenerate.RegenerateStage, config, ingested, {"thinking": "on"})
    local = regenerate.run(config, ingested, progress=False)["total"]
    assert local["rows_quarantined"] == 0 and local["generated_turns"] == 3, local
    with DevServer(str(model)) as server:
        served = regenerate.run(config, ingested, progress=False, force=True, backend="openai",
                                endpoint=server.url)["total"]
    assert served["rows_quarantined"] == 0 and served["generated_turns"] == 3, served
