"""Templates whose generation prompt pre-fills a reasoning opener that the rendered turns lack
(DeepSeek-R1 distills, QwQ, MiniMax-M2), on the fixture templates and rows with the real Qwen3.6
tokenizer; and the eos appended when a template has no end-of-turn marker (probe.json, report).

Rows are checked independently of dflash_etl's verification: the template's own render of the
prompt with its generation prompt, tokenized alone, is the row's unsupervised start, and the
supervised rest decodes to what the model writes after the opener (the rest of the reasoning,
the closing tag, the content, the end of turn).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from dflash_etl.templates import (
    MaskPolicy,
    MaskRefused,
    TemplateUnusable,
    probe_template,
    tokenize_conversation,
    verify_row,
)
from templates_helpers import (
    TEMPLATES_DIR,
    independent_problems,
    load_rows,
    prefill_conversations,
    require_fixtures,
)

R1_EOT = "<｜end▁of▁sentence｜>"
# template, the kwargs its reasoning prompt is rendered with, its end of turn
FAMILIES = [
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", {}, R1_EOT),  # always "<think>\n"
    ("llama-cpp-deepseek-r1.jinja", {}, R1_EOT),
    # DeepCoder ships this R1-Distill-Qwen template; the fixture's copy closes the block unless
    # enable_thinking is on
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", {"enable_thinking": True}, R1_EOT),
    ("Qwen-QwQ-32B.jinja", {"enable_thinking": True}, "<|im_end|>"),
    ("MiniMax-M2.jinja", {}, "[e~["),  # renders the final turn's reasoning itself
]
NO_EXTRA = ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "llama-cpp-deepseek-r1.jinja")


@pytest.fixture(scope="module")
def reasoning_rows():
    """Real rows: system, user, an assistant turn with reasoning and an answer (no tool call),
    tool specs dropped (the R1 templates render none); see `prefill_conversations`."""
    require_fixtures()
    rows = [c for c in prefill_conversations() if len(c["messages"]) == 3]
    assert len(rows) == 3
    return rows


@pytest.fixture(scope="module")
def two_rounds():
    require_fixtures()
    convs = [c for c in prefill_conversations() if len(c["messages"]) == 5]
    assert len(convs) == 2
    return convs


def test_a_reply_holding_think_markup_is_refused_not_guessed(tok):
    """A real row whose answer holds "</think>": R1 templates cut the content there, so the
    answer cannot be rendered whole and the row is refused with the reason."""
    (row,) = [r for r in load_rows("agentic_reasoning_tool_use.jsonl")
              if len(r["messages"]) == 3 and "</think>" in r["messages"][2]["content"]]
    row["tools"] = None
    src = _template("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja")
    with pytest.raises(MaskRefused) as e:
        tokenize_conversation(row, tok, probe_template(tok, src), chat_template=src)
    assert e.value.code in ("reply_missing_content", "duplicated_think_markup")


def _template(name: str) -> str:
    return (TEMPLATES_DIR / name).read_text(encoding="utf-8")


def _plain(messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def check_prefill_row(tok, src, probe, conv, row, kwargs, eot, tag="think") -> None:
    """The row is the template's prompt with its generation prompt + what the model writes.
    (`probe.render_kwargs` holds what the probe supplied, e.g. the bos these templates read.)"""
    msgs = conv["messages"]
    idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"][row.turn]
    prompt = tok.apply_chat_template(_plain(msgs[:idx]), chat_template=src, tokenize=False,
                                     add_generation_prompt=True,
                                     **{**probe.render_kwargs, **kwargs})
    assert prompt.endswith(f"<{tag}>\n")
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    n = len(prompt_ids)
    assert row.input_ids[:n] == prompt_ids  # the prompt, as the model sees it at inference
    assert row.loss_mask == [0] * n + [1] * (len(row.input_ids) - n)
    reply = msgs[idx]
    want = f"{reply['reasoning'].strip()}\n</{tag}>\n\n{reply['content']}{eot}"
    got = tok.decode(row.input_ids[n:], skip_special_tokens=False,
                     clean_up_tokenization_spaces=False)
    assert got == want


@pytest.mark.parametrize(("name", "kwargs", "eot"), FAMILIES)
def test_reasoning_turn_is_supervised_after_the_prefilled_opener(
    tok, reasoning_rows, name, kwargs, eot
):
    src = _template(name)
    probe = probe_template(tok, src)
    assert probe.prefill_reasoning == "<think>\n"
    assert probe.prefill_reasoning_kwargs == kwargs
    for conv in reasoning_rows[:3]:
        (row,) = tokenize_conversation(conv, tok, probe, chat_template=src)
        check_prefill_row(tok, src, probe, conv, row, kwargs, eot)
        assert independent_problems(conv, row, tok, probe) == []
        verify_row(row, tok)
        if name not in ("Qwen-QwQ-32B.jinja", "MiniMax-M2.jinja"):  # those render it themselves
            assert row.prefill == "<think>\n"
            assert "reasoning_supervised_after_prefill:'<think>\\n'" in row.normalizations


@pytest.mark.parametrize(("name", "kwargs", "eot"), FAMILIES)
def test_multi_turn_reasoning_one_row_per_turn(tok, two_rounds, name, kwargs, eot):
    src = _template(name)
    probe = probe_template(tok, src)
    for conv in two_rounds:
        rows = tokenize_conversation(conv, tok, probe, chat_template=src)
        assert [r.turn for r in rows] == [0, 1]
        for row in rows:
            check_prefill_row(tok, src, probe, conv, row, kwargs, eot)
            assert independent_problems(conv, row, tok, probe) == []
        # the second row's history holds the first turn as the template renders it: its
        # answer, and (the template strips it) not its reasoning
        history = tok.decode(rows[1].input_ids)
        assert conv["messages"][2]["content"] in history
        if name in NO_EXTRA:
            assert conv["messages"][2]["reasoning"].strip()[:60] not in history


# EXAONE-Deep's shape (its template is not among the fixtures; this one is written here): the
# generation prompt opens "<thought>\n", turns are rendered with the thought cut off.
EXAONE_SHAPED = (
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if '</thought>' in c %}{% set c = c.split('</thought>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '[|' + m['role'] + '|]' + c }}{% if m['role'] != 'user' %}{{ '[|endofturn|]' }}{% endif %}"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n[|assistant|]<thought>\\n' }}{% endif %}"
)


def test_another_opener_tag_is_closed_with_its_own_tag(tok, reasoning_rows, two_rounds):
    probe = probe_template(tok, EXAONE_SHAPED)
    assert probe.prefill_reasoning == "<thought>\n"
    for conv in [*reasoning_rows, *two_rounds]:
        rows = tokenize_conversation(conv, tok, probe, chat_template=EXAONE_SHAPED)
        assert len(rows) == sum(m["role"] == "assistant" for m in conv["messages"])
        for row in rows:
            check_prefill_row(tok, EXAONE_SHAPED, probe, conv, row, {}, "[|endofturn|]",
                              tag="thought")
            assert row.prefill == "<thought>\n"


def test_probe_says_how_prefilled_templates_are_masked(tok):
    r1 = probe_template(tok, _template("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"))
    assert "opens '<think>\\n'" in r1.reason and "prefill_needs_reasoning" in r1.reason
    qwen = probe_template(tok, _template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"))
    assert "{'enable_thinking': True}" in qwen.reason
    assert "without reasoning takes the generation prompt with enable_thinking=False" in qwen.reason
    doc = json.loads(json.dumps(r1.to_dict()))
    assert doc["prefill_reasoning"] == "<think>\n" and doc["prefill_reasoning_kwargs"] == {}
    # templates that render the opener in their turns have none
    q36 = probe_template(tok, _template("qwen36/Qwen3.6-27B.official-reconstructed.jinja"))
    assert q36.prefill_reasoning is None


@pytest.mark.parametrize("name", [*NO_EXTRA, "MiniMax-M2.jinja"])
def test_a_turn_without_reasoning_after_an_open_block_is_refused(tok, name):
    src = _template(name)
    probe = probe_template(tok, src)
    (plain,) = load_rows("openai_messages.jsonl", 1)  # system, user, assistant; no reasoning
    with pytest.raises(MaskRefused) as e:
        tokenize_conversation(plain, tok, probe, chat_template=src)
    assert e.value.code == "prefill_needs_reasoning"
    assert "pre-fills '<think>\\n'" in e.value.message and "no reasoning" in e.value.message


def test_reasoning_not_supervised_by_policy_is_refused_too(tok, reasoning_rows):
    name = "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"
    src = _template(name)
    probe = probe_template(tok, src)
    with pytest.raises(MaskRefused) as e:
        tokenize_conversation(reasoning_rows[0], tok, probe,
                              MaskPolicy(supervise_reasoning=False), chat_template=src)
    assert e.value.code == "prefill_needs_reasoning"
    assert "supervise_reasoning = false drops it" in e.value.message


def test_multi_turn_with_one_turn_lacking_reasoning(tok, two_rounds):
    name = "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"
    src = _template(name)
    probe = probe_template(tok, src)
    conv = copy.deepcopy(two_rounds[0])
    conv["messages"][2]["reasoning"] = None  # the first reply has no reasoning
    with pytest.raises(MaskRefused) as e:
        tokenize_conversation(conv, tok, probe, chat_template=src)
    assert e.value.code == "prefill_needs_reasoning" and "assistant turn 0" in e.value.message
    # the last turn alone still masks exactly
    (row,) = tokenize_conversation(conv, tok, probe, MaskPolicy(turns="last"), chat_template=src)
    assert row.turn == 1
    check_prefill_row(tok, src, probe, conv, row, {}, R1_EOT)


def test_thinking_off_template_without_reasoning_still_masks_as_before(tok):
    """R1-Distill-Qwen's copy here closes the block unless enable_thinking: a turn without
    reasoning takes that prompt, its empty block is prompt, and only the answer is supervised."""
    name = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
    src = _template(name)
    probe = probe_template(tok, src)
    (plain,) = load_rows("openai_messages.jsonl", 1)
    (row,) = tokenize_conversation(plain, tok, probe, chat_template=src)
    text = tok.decode(row.input_ids, skip_special_tokens=False)
    sup = tok.decode([t for t, m in zip(row.input_ids, row.loss_mask, strict=True) if m])
    assert sup == plain["messages"][-1]["content"] + R1_EOT
    assert row.prefill == "" and "<think>\n</think>" + sup in text


def test_a_template_that_still_cannot_be_made_exact_is_refused_with_its_reason(tok):
    """Alpaca's history turns end in blank lines its generation prompt does not give: a turn's
    prompt is not the text the turn renders after, so no exact row exists."""
    src = _template("template_alpaca.jinja")
    probe = probe_template(tok, src)
    (conv,) = load_rows("sharegpt.jsonl", 1, start=2)  # three rounds
    with pytest.raises(MaskRefused) as e:
        tokenize_conversation(conv, tok, probe, chat_template=src)
    assert e.value.code == "generation_prompt_mismatch"
    assert "generation prompt ends" in e.value.message


# Llama Guard's shape (its template is not among the fixtures; this one is written here): the
# conversation is quoted inside one user turn, then the task, then the assistant header always.
GUARD_SHAPED = (
    "<|start_header_id|>user<|end_header_id|>\n\nTask: Check if there is unsafe content in "
    "the conversation.\n\n<BEGIN CONVERSATION>\n\n{% for m in messages %}"
    "{{ ('User' if m['role'] == 'user' else 'Agent') + ': ' + m['content'] + '\\n\\n' }}"
    "{% endfor %}<END CONVERSATION>\n\nProvide your safety assessment: 'safe' or 'unsafe'."
    "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
)


# Llama Guard 3 8B's wording: the task names the last message's role, so the text after an
# assistant turn ("...the LAST Agent message") is not the generation prompt's ("...User...")
GUARD_3_SHAPED = GUARD_SHAPED.replace(
    "{% endfor %}<END CONVERSATION>\n\nProvide your safety assessment:",
    "{% endfor %}<END CONVERSATION>\n\nProvide your safety assessment for ONLY THE LAST "
    "{{ 'User' if messages[-1]['role'] == 'user' else 'Agent' }} message:")


@pytest.mark.parametrize("template", [GUARD_SHAPED, GUARD_3_SHAPED], ids=["guard", "guard-3"])
def test_a_classifier_template_that_quotes_the_turns_is_refused_whole(tok, template):
    """Whatever words the task uses for the roles (Llama Guard 3 names the last one): one clear
    reason, not generation_prompt_mismatch on every row."""
    with pytest.raises(TemplateUnusable) as e:
        probe_template(tok, template)
    assert "quotes the conversation inside its prompt" in e.value.reason
    assert "<END CONVERSATION>" in e.value.reason  # the text that gave it away


def test_verification_checks_the_prefill(tok, reasoning_rows):
    name = "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"
    src = _template(name)
    probe = probe_template(tok, src)
    (row,) = tokenize_conversation(reasoning_rows[0], tok, probe, chat_template=src)
    wrong = copy.deepcopy(row)
    wrong.prefill = "<thought>\n"  # the prompt does not end with it
    with pytest.raises(MaskRefused) as e:
        verify_row(wrong, tok)
    assert e.value.code == "mask_verification_failed" and "pre-fill" in e.value.message


# --- the eos appended when the template has no end-of-turn marker ------------------------------


def test_probe_records_the_appended_eos_and_why(tok):
    probe = probe_template(tok, _template("template_chatml.jinja"))  # no end-of-turn marker
    doc = json.loads(json.dumps(probe.to_dict()))
    eos = doc["eos_appended"]
    assert eos["token"] == tok.eos_token and eos["id"] == tok.eos_token_id
    assert eos["source"] == "tokenizer_eos"
    assert "no end-of-turn marker" in eos["why"] and "supervised" in eos["why"]
    q36 = probe_template(tok, _template("qwen36/Qwen3.6-27B.official-reconstructed.jinja"))
    assert q36.eos_appended is None  # ends its turns with <|im_end|> itself


def test_probe_json_and_the_report_show_the_appended_eos(tmp_path):
    require_fixtures()
    from dflash_etl.report import build_docs
    from dflash_etl.stages import ingest, parse_config, tokenize

    rows = [{"messages": [{"role": "user", "content": "What is 12 + 30?"},
                          {"role": "assistant", "content": "12 + 30 = 42."}]},
            {"messages": [{"role": "user", "content": "Say hi"},
                          {"role": "assistant", "content": "Hello there, friend."}]}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = parse_config({"run": {"workers": 1},
                           "sources": [{"name": "mini", "path": "rows.jsonl"}]}, tmp_path)
    run = tmp_path / "run"
    ingest.run(config, run)
    tokenizer_dir = TEMPLATES_DIR.parent / "qwen36-tokenizer"
    tokenize.run(config, run, workers=1, model=str(tokenizer_dir), seq_length=256,
                 chat_template=str(TEMPLATES_DIR / "template_chatml.jinja"))
    probe = json.loads((run / "tokenize" / "probe.json").read_text())
    eos = probe["eos_appended"]
    assert eos["token"] == "<|im_end|>" and eos["source"] == "tokenizer_eos"
    html = (build_docs(run) / "index.html").read_text(encoding="utf-8")
    assert "eos_appended" in html and "&lt;|im_end|&gt;" in html
    assert "no end-of-turn marker" in html


def test_the_docs_document_the_appended_eos_and_prefill():
    page = (Path(__file__).resolve().parents[1] / "docs" / "stages" / "tokenize.md").read_text(
        encoding="utf-8")
    assert "eos_appended" in page and "prefill_needs_reasoning" in page


def test_report_says_nothing_is_appended_when_include_eot_is_off(tok, tmp_path):
    from dflash_etl.report.collect import StageInfo
    from dflash_etl.report.pages import tokenize_section

    probe = probe_template(tok, _template("template_chatml.jinja")).to_dict()
    stage = StageInfo("tokenize", tmp_path, "complete", False, {}, probe=probe,
                      settings={"include_eot": False})
    html = tokenize_section(stage)
    assert "include_eot = false: nothing is appended" in html
    stage.settings = {"include_eot": True}
    assert "Appended end of turn:</b> <code>&lt;|im_end|&gt;</code>" in tokenize_section(stage)
