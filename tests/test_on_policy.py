"""The on-policy check between regenerate (how the replies were made) and tokenize (how the rows
were rendered): the rule on its own, then a real regenerate -> tokenize run with the Qwen3.6
template, whose thinking-off generation prompt holds an empty think block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.stages import parse_config
from dflash_etl.validation.on_policy import on_policy_report

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO.parent / "shared" / "fixtures" / "qwen36-tokenizer"
ON = {"thinking": "on", "temperature": 0.0, "max_new_tokens": 64}


def test_thinking_on_replies_behind_a_thinking_off_prompt_are_off_policy():
    report = on_policy_report(ON, True, 100, {"enable_thinking=False": 30}, 0.01)
    assert len(report["problems"]) == 1
    assert "thinking on" in report["problems"][0] and "30 of 100" in report["problems"][0]
    assert "enable_thinking=False" in report["problems"][0]
    assert report["serve_with"]["chat_template_kwargs"] == {"enable_thinking": True}


def test_a_share_within_the_limit_passes_and_the_limit_is_the_users():
    assert not on_policy_report(ON, True, 100, {"enable_thinking=False": 1}, 0.01)["problems"]
    assert on_policy_report(ON, True, 100, {"enable_thinking=False": 1}, 0.0)["problems"]


def test_reasoning_generated_but_not_supervised_is_off_policy():
    problems = on_policy_report(ON, False, 10, {}, 0.01)["problems"]
    assert problems and "supervise_reasoning = false" in problems[0]


def test_thinking_off_replies_behind_a_thinking_on_prompt_are_off_policy():
    off = {**ON, "thinking": "off"}
    problems = on_policy_report(off, True, 10, {"enable_thinking=True": 5}, 0.01)["problems"]
    assert problems and "thinking off" in problems[0]
    assert not on_policy_report(off, True, 10, {"enable_thinking=False": 10}, 0.01)["problems"]


def test_without_regenerate_or_with_the_templates_default_nothing_is_claimed():
    none = on_policy_report(None, True, 10, {"enable_thinking=False": 10}, 0.01)
    assert none["serve_with"] is None and not none["problems"]
    keep = on_policy_report({**ON, "thinking": "keep"}, True, 10,
                            {"enable_thinking=False": 10}, 0.01)
    assert not keep["problems"] and "chat_template_kwargs" not in keep["serve_with"]


@pytest.fixture(scope="module")
def prompts_run(tmp_path_factory, tiny_qwen2) -> tuple[Path, Path]:
    """Prompt-only rows ingested, and a tiny random target with the Qwen3.6 tokenizer."""
    if not QWEN.is_dir():
        pytest.skip("../shared/fixtures/qwen36-tokenizer is absent")
    from dflash_etl.stages import ingest

    base = tmp_path_factory.mktemp("policy")
    target = tiny_qwen2(hidden_size=32, layers=2, heads=2, kv_heads=1, tokenizer_dir=QWEN,
                        tie_word_embeddings=False)
    (base / "rows.jsonl").write_text("".join(
        json.dumps({"prompt": f"Question number {i}: what is {i} + {i}?"}) + "\n"
        for i in range(4)))
    config = parse_config({"run": {"workers": 1},
                           "sources": [{"name": "q", "path": "rows.jsonl"}]}, base)
    ingest.run(config, base / "run", progress=False)
    return base / "run", target


@pytest.mark.slow  # prompts_run builds a target with the 248k Qwen3.6 vocabulary
@pytest.mark.parametrize("thinking", ["on", "off"])
def test_regenerated_with_thinking_on_then_tokenized_off_policy_fails_naming_both(
        prompts_run, tmp_path, monkeypatch, thinking):
    """With thinking on, Qwen3.6's generation prompt ends in `<think>\n`; a target that skips
    its reasoning closes the block at once (`\n</think>\n\nanswer`). Such a reply has no
    reasoning, so tokenize renders it behind the thinking-off prompt (an empty think block in the
    prompt), which serving with thinking on never shows: off-policy. With thinking off the same
    answers are on-policy, and the report says how to serve. The replies are scripted (a random
    model writes no think markup); template, prompts, splitter and tokenize are real."""
    import shutil

    from dflash_etl.models.generation.local import TransformersBackend
    from dflash_etl.models.generation.replies import Reply
    from dflash_etl.stages import regenerate, tokenize

    def scripted(self, prompts):
        opened = "\n</think>\n\n" if thinking == "on" else ""
        return [Reply(f"{opened}The answer is number {k}.", "stop", 9)
                for k, _ in enumerate(prompts)]

    monkeypatch.setattr(TransformersBackend, "generate_text", scripted)
    source, target = prompts_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    regenerate.run(None, run, progress=False, model=str(target), max_new_tokens=16,
                   thinking=thinking, dummy_min_repeats=99)
    if thinking == "on":
        with pytest.raises(StageError) as caught:
            tokenize.run(None, run, workers=1, progress=False, model=str(QWEN), seq_length=512)
        message = str(caught.value)
        assert "on-policy check" in message and "thinking on" in message
        assert "enable_thinking=False" in message and "of 4 rows" in message
        partial = json.loads((run / ".tokenize.partial" / "stats.json").read_text())
        assert partial["on_policy"]["problems"]  # kept for the user to read
        return
    doc = tokenize.run(None, run, workers=1, progress=False, model=str(QWEN), seq_length=512)
    policy = doc["on_policy"]
    assert not policy["problems"]
    assert policy["generated_with"]["thinking"] == "off"
    from dflash_etl.models.identity import model_identity

    # what made the replies: its weights' identity (a local backend has no served name)
    assert policy["generated_with"]["model_identity"] == model_identity(str(target))
    assert policy["generated_with"]["served_model"] is None
    assert policy["serve_with"]["chat_template_kwargs"] == {"enable_thinking": False}
    stored = json.loads((run / "tokenize" / "stats.json").read_text())
    assert stored["on_policy"] == policy
    from dflash_etl.report import build_docs

    page = (build_docs(run) / "index.html").read_text()
    assert "On-policy check" in page and "enable_thinking" in page
