"""The tokenize shortcuts (one render for {% generation %}-tag templates, N+1 renders for N
replies on prefix-stable ones) give exactly the rows of rendering every turn, and are off or
fall back wherever they could not: the real Qwen3.6 tokenizer, templates written here."""

from __future__ import annotations

import dataclasses
import json

import pytest

import dflash_etl.templates.masks.renders as masks
from dflash_etl.templates import MaskPolicy, MaskRefused, probe_template, tokenize_conversations
from dflash_etl.templates.masks import one_render
from dflash_etl.templates.render import render_message_spans

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TAGGED = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a turn that renders the end-of-turn marker twice: its first marker is not its end
TWICE = CHATML.replace(
    "{{ m.content }}<|im_end|>\n",
    "{{ m.content }}<|im_end|>\n{% if m.role == 'assistant' %}<|im_start|>note\n"
    "done<|im_end|>\n{% endif %}")
# tool calls rendered in the turn, argument values as they are (they may hold any text)
TOOLS = CHATML.replace(
    "{{ m.content }}<|im_end|>",
    "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "{% for k, v in c.function.arguments.items() %} {{ k }}={{ v }}{% endfor %}</tool_call>"
    "{% endfor %}<|im_end|>")


def _conv(*pairs: tuple[str, str], **extra) -> dict:
    return {"id": extra.pop("id", "c"), "messages": [
        {"role": role, "content": text, **extra.get(str(k), {})}
        for k, (role, text) in enumerate(pairs)], "tools": extra.get("tools")}


THREE_REPLIES = _conv(("user", "Hi"), ("assistant", "Hello, how can I help?"),
                      ("user", "Capital of France?"), ("assistant", "Paris."),
                      ("user", "Thanks"), ("assistant", "Any time."))


def _outcome(results):
    """Per conversation: its rows (ids, mask, turn, strategy, normalizations) or its refusal."""
    return [(r.code, r.message) if isinstance(r, MaskRefused) else
            [(x.input_ids, x.loss_mask, x.turn, x.strategy, x.normalizations) for x in r]
            for r in results]


class _Counter:
    """Counts the renders the masks module makes, by kind."""

    def __init__(self, monkeypatch) -> None:
        self.calls = {"render": 0, "generation_spans": 0, "hf_mask": 0}
        for name, kind in (("render", "render"), ("render_generation_spans", "generation_spans"),
                           ("guarded_call", "hf_mask")):
            original = getattr(masks, name)
            monkeypatch.setattr(masks, name, self._wrap(original, kind))

    def _wrap(self, fn, kind):
        def counted(*args, **kwargs):
            self.calls[kind] += 1
            return fn(*args, **kwargs)
        return counted


POLICIES = [MaskPolicy(turns=t, include_eot=e) for t in ("all", "last") for e in (True, False)]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.turns}-eot{p.include_eot}")
def test_tag_template_one_render_same_rows(tok, policy, monkeypatch):
    probe = probe_template(tok, TAGGED)
    assert probe.strategy == "generation" and probe.fast_paths[masks.FAST_GENERATION]
    slow = tokenize_conversations([THREE_REPLIES], tok, probe, policy, chat_template=TAGGED,
                                  fast=False)
    counter = _Counter(monkeypatch)
    fast = tokenize_conversations([THREE_REPLIES], tok, probe, policy, chat_template=TAGGED)
    assert _outcome(fast) == _outcome(slow)
    assert not isinstance(fast[0], MaskRefused), fast[0]
    # one render, no second render + tokenization by transformers for its mask
    assert counter.calls == {"render": 0, "generation_spans": 1, "hf_mask": 0}


def test_tag_template_cross_check_still_uses_hf_mask(tok, monkeypatch):
    probe = probe_template(tok, TAGGED)
    counter = _Counter(monkeypatch)
    out = tokenize_conversations([THREE_REPLIES], tok, probe, chat_template=TAGGED,
                                 cross_check=1.0)
    assert out[0][0].cross_checked
    assert counter.calls["hf_mask"] == 1 and counter.calls["render"] > 0


def test_generation_mask_with_last_turn_or_no_eot_is_not_refused(tok):
    """Before: the HF tag mask (every turn, with the marker) was compared with the supervised
    spans as they were, so turns="last" and include_eot=false refused every conversation."""
    probe = probe_template(tok, TAGGED)
    for policy in (MaskPolicy(turns="last"), MaskPolicy(include_eot=False)):
        (rows,) = tokenize_conversations([THREE_REPLIES], tok, probe, policy,
                                         chat_template=TAGGED, fast=False)
        assert not isinstance(rows, MaskRefused), rows
        supervised = [tok.decode([t for t, m in zip(r.input_ids, r.loss_mask, strict=True) if m])
                      for r in rows]
        want = "Any time." if policy.turns == "last" else "Hello, how can I help?Paris.Any time."
        assert supervised[-1] == want + ("<|im_end|>" if policy.include_eot else "")


def test_turn_end_from_next_prompt_n_plus_one_renders(tok, monkeypatch):
    probe = _without_one_render(probe_template(tok, CHATML))
    assert probe.strategy == "render_diff" and probe.fast_paths[masks.FAST_TURN_END]
    slow = tokenize_conversations([THREE_REPLIES], tok, probe, chat_template=CHATML, fast=False)
    counter = _Counter(monkeypatch)
    fast = tokenize_conversations([THREE_REPLIES], tok, probe, chat_template=CHATML)
    assert _outcome(fast) == _outcome(slow) and not isinstance(fast[0], MaskRefused)
    assert counter.calls["render"] == 4  # 3 prompts + the full conversation (was 6)


def test_text_after_the_marker_is_part_of_the_turn_end(tok):
    """A template that renders more after each turn's marker (a note with its own marker): the
    shortcut's end is the marker plus exactly that text, as the full render diff has it."""
    probe = probe_template(tok, TWICE)
    assert probe.post_eot.startswith("\n<|im_start|>note") and probe.fast_paths[masks.FAST_TURN_END]
    slow = tokenize_conversations([THREE_REPLIES], tok, probe, chat_template=TWICE, fast=False)
    for shortcuts in (probe, _without_one_render(probe)):  # one render, N+1 renders
        fast = tokenize_conversations([THREE_REPLIES], tok, shortcuts, chat_template=TWICE)
        assert _outcome(fast) == _outcome(slow) and not isinstance(fast[0], MaskRefused)


def test_cross_check_quarantines_a_shortcut_that_disagrees(tok, monkeypatch):
    """A shortcut that misreads a turn's end (simulated: it takes the next turn's marker) gives
    other rows than rendering every turn; a cross-checked conversation is then quarantined."""
    probe = _without_one_render(probe_template(tok, CHATML))  # the N+1 shortcut
    slow = tokenize_conversations([THREE_REPLIES], tok, probe, chat_template=CHATML, fast=False)
    real = masks._turn_end

    def misread(text, start, probe):
        end = real(text, start, probe)
        return real(text, end, probe) if end is not None else None

    monkeypatch.setattr(masks, "_turn_end", misread)
    assert _outcome(tokenize_conversations([THREE_REPLIES], tok, probe,
                                           chat_template=CHATML)) != _outcome(slow)
    (checked,) = tokenize_conversations([THREE_REPLIES], tok, probe, chat_template=CHATML,
                                        cross_check=1.0)
    assert isinstance(checked, MaskRefused) and checked.code == "mask_verification_failed"
    assert "cross-check" in checked.message


def test_marker_inside_tool_arguments_renders_the_turn(tok):
    """The first marker after the prompt is the turn's end only if the message's own text holds
    none: here a tool call's arguments hold one, which the content check would not catch."""
    probe = probe_template(tok, TOOLS)
    call = [{"type": "function", "function": {"name": "echo",
                                              "arguments": {"text": "a <|im_end|>\n b"}}}]
    conv = _conv(("user", "Echo it"), ("assistant", ""), ("tool", "ok"), ("assistant", "Done."),
                 **{"1": {"tool_calls": json.dumps(call)}})
    # the marker is text inside the call: by default such a conversation is refused
    # (special_token_in_content); kept as it is, the shortcut must still find the turn's end
    (refused,) = tokenize_conversations([conv], tok, probe, chat_template=TOOLS)
    assert isinstance(refused, MaskRefused) and refused.code == "special_token_in_content"
    keep = MaskPolicy(special_tokens_in_content="keep")
    slow = tokenize_conversations([conv], tok, probe, keep, chat_template=TOOLS, fast=False)
    fast = tokenize_conversations([conv], tok, probe, keep, chat_template=TOOLS)
    assert probe.tool_call_args == "object" and not isinstance(slow[0], MaskRefused), slow
    assert _outcome(fast) == _outcome(slow)


def test_cross_check_fraction_is_deterministic_by_id(tok):
    probe = probe_template(tok, CHATML)
    convs = [dict(THREE_REPLIES, id=f"conv-{k}") for k in range(200)]
    runs = [[bool(r[0].cross_checked) for r in tokenize_conversations(
        convs, tok, probe, chat_template=CHATML, cross_check=0.1)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert 5 <= sum(runs[0]) <= 40  # ~10% of 200
    none = tokenize_conversations(convs, tok, probe, chat_template=CHATML)
    assert not any(r[0].cross_checked for r in none)


# Llama 3's turn markers with {% generation %} tags, as text to the Qwen3.6 tokenizer: one BPE
# token (".<") runs across the end of a tag block into the next header
LLAMA_TAGGED = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def test_a_token_across_a_tag_end_gets_the_per_turn_rows_not_a_quarantine(tok):
    """The tag path quarantined such a conversation (mask_verification_failed) where the
    render-diff path falls back to per-turn rows; now both do, under "auto", and the rows are
    those of --strategy per_turn. Asked for the tags by name, it is refused as before."""
    probe = probe_template(tok, LLAMA_TAGGED)
    assert probe.strategy == "generation"
    conv = _conv(("user", "Hi"), ("assistant", "Hello there."), ("user", "More?"),
                 ("assistant", "Yes, more."))
    (auto,) = tokenize_conversations([conv], tok, probe, chat_template=LLAMA_TAGGED)
    (per_turn,) = tokenize_conversations([conv], tok, probe, MaskPolicy(strategy="per_turn"),
                                         chat_template=LLAMA_TAGGED)
    assert not isinstance(auto, MaskRefused), auto
    assert [(r.input_ids, r.loss_mask, r.turn) for r in auto] == \
        [(r.input_ids, r.loss_mask, r.turn) for r in per_turn]
    assert {r.strategy for r in auto} == {"per_turn"}
    assert "mask_verification_failed" in auto[0].normalizations[-1]
    (named,) = tokenize_conversations([conv], tok, probe, MaskPolicy(strategy="generation"),
                                      chat_template=LLAMA_TAGGED)
    assert isinstance(named, MaskRefused) and named.code == "mask_verification_failed"


# ------------------------------------------------- one render: turns read off the message marks
REASONING_MIXED = _conv(("user", "Hi"), ("assistant", "Hello!"), ("user", "Think: 3 + 4?"),
                        ("assistant", "7."), ("user", "Good."), ("assistant", "Glad to help."),
                        id="mixed", **{"3": {"reasoning": "3 + 4 = 7."}})
WITH_SYSTEM = _conv(("system", "Be terse."), ("user", "Two plus two?"), ("assistant", "Four."),
                    id="system")
ONE_TURN = _conv(("user", "Capital of Italy?"), ("assistant", "Rome."), id="one")
WEATHER = [{"type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
TOOL_ROUND = _conv(("user", "Weather in Paris?"), ("assistant", ""), ("tool", "18 C"),
                   ("assistant", "It is 18 C."), id="tool",
                   **{"1": {"tool_calls": json.dumps(WEATHER)}})
ONE_RENDER_CONVS = [THREE_REPLIES, REASONING_MIXED, WITH_SYSTEM, ONE_TURN, TOOL_ROUND]


def _without_one_render(probe):
    """The probe as before this shortcut: N+1 renders for N replies."""
    return dataclasses.replace(probe, fast_paths={
        k: v for k, v in probe.fast_paths.items() if k != masks.FAST_ONE_RENDER})


@pytest.mark.parametrize("template", [None, CHATML, TOOLS], ids=["qwen3.6", "chatml", "tools"])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.turns}-eot{p.include_eot}")
def test_one_render_gives_the_rows_of_rendering_every_turn(tok, template, policy, monkeypatch):
    """ChatML and Qwen3.6 (one row under preserve_thinking, reasoning on some turns only, a
    system turn, a tool round trip): one render per conversation, the rows of the N+1 path and
    of rendering every turn, byte for byte."""
    probe = probe_template(tok, template)
    assert probe.fast_paths[masks.FAST_ONE_RENDER]
    convs = ONE_RENDER_CONVS if probe.tool_call_args else ONE_RENDER_CONVS[:-1]  # ChatML: none
    slow = tokenize_conversations(convs, tok, probe, policy, chat_template=template, fast=False)
    before = tokenize_conversations(convs, tok, _without_one_render(probe), policy,
                                    chat_template=template)
    counter = _Counter(monkeypatch)
    fast = tokenize_conversations(convs, tok, probe, policy, chat_template=template)
    assert _outcome(fast) == _outcome(slow) == _outcome(before)
    assert not any(isinstance(r, MaskRefused) for r in fast), fast
    assert [(r[0].render_path, r[0].renders) for r in fast] == [("one_render", 1)] * len(convs)
    assert counter.calls == {"render": 0, "generation_spans": 0, "hf_mask": 0}
    assert sum(r[0].renders for r in before) >= 2 * len(convs)


def test_message_marks_leave_the_text_and_find_each_message(tok):
    messages = THREE_REPLIES["messages"]
    text, spans = render_message_spans(tok, messages, chat_template=CHATML)
    assert text == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert [text[a:b] for a, b in spans] == [
        f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]


@pytest.mark.parametrize("template", [
    # not a loop over the messages: the items are numbers
    "{% for i in range(messages|length) %}<|im_start|>{{ messages[i].role }}\n"
    "{{ messages[i].content }}<|im_end|>\n{% endfor %}",
    # the messages in another order
    "{% for m in messages|reverse %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}",
    # two loops print the messages
    "{% for m in messages %}{{ m.role }} {% endfor %}\n{% for m in messages %}<|im_start|>"
    "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
    # the loop's output goes into a buffer first (a set block), not straight into the text
    "{% set body %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>"
    "\n{% endfor %}{% endset %}{{ body }}",
    # more marks than a render keeps (a loop that spins before the messages' one)
    "{% for i in range(30000) %}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}",
], ids=["range", "reversed", "two-loops", "set-block", "too-many-marks"])
def test_no_marks_where_no_single_loop_prints_the_messages(tok, template):
    """Where no one loop makes each message's output in order, there are no spans (the caller
    renders every turn); the text is the plain render's either way."""
    from dflash_etl.templates.render import render

    messages = THREE_REPLIES["messages"]
    text, spans = render_message_spans(tok, messages, chat_template=template)
    assert spans is None and text == render(tok, messages, chat_template=template)


@pytest.mark.parametrize("shift", ["start+1", "start-1", "start-token", "previous-message",
                                   "end-2"])
def test_a_misread_mark_falls_back_to_rendering_every_turn(tok, monkeypatch, shift):
    """Marks off by a character, a token or a message: the generation prompt is not where the
    mark says the turn starts (or the end-of-turn marker lies past its iteration), so the
    conversation is rendered turn by turn and its rows are exact, never read off wrong marks."""
    probe = probe_template(tok, CHATML)
    slow = tokenize_conversations([THREE_REPLIES], tok, probe, chat_template=CHATML, fast=False)
    tokenize_conversations([THREE_REPLIES], tok, probe, chat_template=CHATML)  # headers learnt
    real = one_render.render_message_spans

    def misread(*args, **kwargs):
        text, spans = real(*args, **kwargs)
        moved = []
        for k, (a, b) in enumerate(spans):
            if shift == "start+1":
                a += 1
            elif shift == "start-1":
                a = max(a - 1, 0)
            elif shift == "start-token":
                a += len("<|im_start|>")
            elif shift == "previous-message":
                a = spans[k - 1][0] if k else a
            else:
                b -= 2  # into the marker (one char early still holds it: read right)
            moved.append((a, b))
        return text, moved

    monkeypatch.setattr(one_render, "render_message_spans", misread)
    (fast,) = tokenize_conversations([THREE_REPLIES], tok, probe, chat_template=CHATML)
    assert _outcome([fast]) == _outcome(slow) and not isinstance(fast, MaskRefused)
    assert fast[0].render_path == "render_every_turn" and fast[0].renders > 1


def test_a_misread_generation_prompt_is_caught_by_the_probe_and_the_cross_check(tok, monkeypatch):
    """A generation prompt misread one character short (what the marks cannot catch: the reply
    would then supervise the header's newline): the probe's check turns the path off for the
    template, and a cross-checked conversation is quarantined, never written."""
    from dflash_etl.templates.masks.shortcuts import fast_paths_for

    probe = probe_template(tok, CHATML)
    slow = tokenize_conversations([THREE_REPLIES], tok, probe, chat_template=CHATML, fast=False)
    real = one_render._generation_headers

    def short(*args, **kwargs):
        return [h[:-1] if h else h for h in real(*args, **kwargs)]

    monkeypatch.setattr(one_render, "_generation_headers", short)
    assert _outcome(tokenize_conversations([THREE_REPLIES], tok, probe,
                                           chat_template=CHATML)) != _outcome(slow)
    assert fast_paths_for(tok, probe, CHATML)[masks.FAST_ONE_RENDER] is False
    (checked,) = tokenize_conversations([THREE_REPLIES], tok, probe, chat_template=CHATML,
                                        cross_check=1.0)
    assert isinstance(checked, MaskRefused) and checked.code == "mask_verification_failed"
    assert "cross-check" in checked.message


def test_a_prompt_that_depends_on_what_follows_is_not_read_off_the_full_render(tok):
    """A template that closes a tool result only when it is the last message (what the
    generation prompt then follows): the full render is no prefix-plus-prompt there, which the
    shape's sample shows, so such a conversation is rendered turn by turn (per-turn rows, as
    rendering every turn gives); a conversation without a tool turn still takes one render."""
    template = TOOLS.replace(
        "{% for m in messages %}",
        "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}"
        "{% if loop.last %}<|im_end|>\n{% endif %}{% else %}").replace(
        "<|im_end|>\n{% endfor %}", "<|im_end|>\n{% endif %}{% endfor %}")
    probe = probe_template(tok, template)
    assert probe.tool_role == "native" and probe.fast_paths[masks.FAST_ONE_RENDER]
    convs = [TOOL_ROUND, THREE_REPLIES]
    fast = tokenize_conversations(convs, tok, probe, chat_template=template)
    slow = tokenize_conversations(convs, tok, probe, chat_template=template, fast=False)
    assert _outcome(fast) == _outcome(slow)
    assert [r.strategy for r in fast[0]] == ["per_turn", "per_turn"]
    assert fast[0][0].render_path == "render_every_turn"
    assert fast[1][0].render_path == "one_render"


_PIECES = ["Hello", " world", "\n", "\n\n", "<think>", "</think>", "assistant", "user:",
           "<tool_call>", "{\"a\": 1}", "  ", "ünïcode", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def probes(tok):
    return {name: probe_template(tok, t) for name, t in (("qwen3.6", None), ("chatml", CHATML))}


def _texts():
    from hypothesis import strategies as st

    return st.lists(st.sampled_from(_PIECES), min_size=0, max_size=6).map("".join)


def test_one_render_equals_rendering_every_turn_on_random_conversations(tok, probes):
    """Random conversations (a system turn or not, 1-3 rounds, reasoning on some replies, text
    with markup in it): the one-render path gives the rows and refusals of rendering every
    turn, on ChatML and Qwen3.6, under both turn policies."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    paths: list[str] = []

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(system=st.one_of(st.none(), _texts()), rounds=st.lists(
        st.tuples(_texts(), _texts(), st.one_of(st.none(), _texts())), min_size=1, max_size=3),
        turns=st.sampled_from(["all", "last"]))
    def check(system, rounds, turns):
        messages = [{"role": "system", "content": system}] if system is not None else []
        for user, reply, reasoning in rounds:
            messages += [{"role": "user", "content": user},
                         {"role": "assistant", "content": reply, "reasoning": reasoning}]
        conv = {"id": "random", "messages": messages, "tools": None}
        keep = MaskPolicy(turns=turns, special_tokens_in_content="keep")
        for name, template in (("qwen3.6", None), ("chatml", CHATML)):
            probe = probes[name]
            fast = tokenize_conversations([conv], tok, probe, keep, chat_template=template)
            slow = tokenize_conversations([conv], tok, probe, keep, chat_template=template,
                                          fast=False)
            assert _outcome(fast) == _outcome(slow), (name, messages)
            paths.extend(r[0].render_path for r in fast if not isinstance(r, MaskRefused))

    check()
    assert paths.count("one_render") >= len(paths) / 2, paths  # the path was taken, mostly
