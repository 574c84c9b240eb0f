"""One render per conversation on a prefix-stable template (or for a conversation's last turn
alone, on any template): each target turn's prompt and reply read off the full render, where
the template's loop over the messages marks each message's output
(`render.render_message_spans`).

What the render diff renders per turn, and what stands in for it here:
- the prompt, render(history < i, generation prompt): the full render up to message i's
  iteration, then the generation prompt (`_generation_headers`: learnt once per process and
  conversation shape, from a sample conversation of that shape where rendering the prefix
  showed exactly that), which must open message i's own output here too;
- the turn's render, render(history <= i): up to the turn's first end-of-turn marker after the
  prompt (as the N+1 shortcut reads it off the next prompt), a marker message i's own iteration
  made; the last turn's is the full render itself, made with that turn's kwargs.
Each turn is then checked exactly as a rendered one (`per_turn._TurnAttempt`). Anything else (no
single loop over the messages, a header not where it belongs, a turn that needs an appended eos
or a pre-fill, a variant other than the first on the last turn, a render error) returns None
and the caller renders every turn: never a guessed row. A shape's sample proves what the
template does with that structure and other texts; a template that branches on the texts
themselves is what the rest is for: the probe turns this path on only where it gives the full
render diff's rows on its sample conversations (`shortcuts.fast_paths_for`), `cross_check`
re-does a share of the conversations the full way, and every row is verified.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from dflash_etl.templates.limits import RenderError
from dflash_etl.templates.masks.per_turn import _Turn, _turn_variants, _TurnAttempt
from dflash_etl.templates.masks.policy import MaskPolicy, MaskRefused
from dflash_etl.templates.masks.prepare import _Masking, _prepare, _Prepared
from dflash_etl.templates.masks.renders import (
    RENDER_PATH_ONE,
    _holds_marker,
    _render_key,
    _turn_end,
)
from dflash_etl.templates.probe_record import TemplateProbe
from dflash_etl.templates.render import render, render_message_spans

# per (tokenizer (held: an id could be reused), template, the conversation's shape, kwargs): per
# message, the generation prompt after its history where a conversation of that shape proved it
# (None elsewhere)
_HEADERS: dict[tuple[Any, ...], list[str | None]] = {}
_MAX_HEADERS = 4096
_SAMPLE_TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]
_SAMPLE_CALL = json.dumps([{"type": "function", "id": "call_1",
                            "function": {"name": "lookup", "arguments": {"word": "cat"}}}])


def _shape(prep: _Prepared) -> tuple[Any, ...]:
    """What a template may branch on besides the texts: the roles in order, which assistant
    turns carry content, tool calls and passed reasoning, and the tools' kind."""
    tools = "none" if prep.tools is None else "some" if prep.tools else "empty"
    return (tools, *(
        (m["role"], bool(m.get("content")), bool(m.get("tool_calls")),
         bool(prep.reasoning_passed.get(k))) for k, m in enumerate(prep.messages)))


def _sample_of(shape: tuple[Any, ...]) -> dict[str, Any]:
    """A canonical conversation of `shape` with short texts of its own."""
    messages = []
    for k, (role, content, calls, reasoning) in enumerate(shape[1:]):
        m: dict[str, Any] = {"role": role, "content": f"Text {k}." if content else ""}
        if role == "system":
            m["content"] = "Be brief."
        elif role == "tool":
            m.update(tool_call_id="call_1", name="lookup")
        elif role == "assistant":
            m.update(tool_calls=_SAMPLE_CALL if calls else None,
                     reasoning=f"Thought {k}." if reasoning else None)
        messages.append(m)
    return {"id": "shape", "messages": messages, "tools": None}


def _generation_headers(
    tokenizer: Any, probe: TemplateProbe, template: str | None, full_kw: dict[str, Any],
    prompt_kw: dict[str, Any], prep: _Prepared, shape: tuple[Any, ...] | None = None,
) -> list[str | None]:
    """Per message of a conversation shaped as `prep` is (`_shape`): the text the generation
    prompt adds after the messages before it under `prompt_kw`, where a sample conversation
    of that shape proved that those messages rendered with it are its full render under
    `full_kw` up to that message's iteration, then that text (None where not; and nowhere
    when the two kwargs render the sample otherwise). Made once per process and shape
    (`shape`: prep's, when the caller has it)."""
    shape = shape or _shape(prep)
    key = (tokenizer, template, shape, _render_key(0, False, full_kw),
           _render_key(0, True, prompt_kw))
    if key not in _HEADERS:
        if len(_HEADERS) >= _MAX_HEADERS:
            _HEADERS.clear()
        given = None if shape[0] == "none" else _SAMPLE_TOOLS if shape[0] == "some" else []
        headers: list[str | None] = [None] * len(prep.messages)
        try:
            sample = _prepare(_sample_of(shape), probe, MaskPolicy())
            made = _sample_render(tokenizer, template, sample, shape, given, full_kw, prompt_kw)
        except (MaskRefused, RenderError):
            made = None  # no proof from a conversation the template does not take
        if made is not None:
            for p in sample.assistant_idx:
                headers[p] = _header_at(tokenizer, template, sample.messages[:p], given,
                                        prompt_kw, made, p)
        _HEADERS[key] = headers
    return _HEADERS[key]


def _sample_render(
    tokenizer: Any, template: str | None, sample: _Prepared, shape: tuple[Any, ...],
    tools: Any, full_kw: dict[str, Any], prompt_kw: dict[str, Any],
) -> tuple[str, list[tuple[int, int] | None] | None] | None:
    """The sample's marked full render under `full_kw`, if the sample has the shape and renders
    the same under `prompt_kw` (a turn's kwargs change its generation prompt alone)."""
    if _shape(sample)[1:] != shape[1:]:
        return None
    made = render_message_spans(tokenizer, sample.messages, chat_template=template, tools=tools,
                                kwargs=full_kw)
    if made is not None and prompt_kw != full_kw and made[0] != render(
            tokenizer, sample.messages, chat_template=template, tools=tools, kwargs=prompt_kw):
        return None
    return made


def _header_at(
    tokenizer: Any, template: str | None, history: list[dict[str, Any]], tools: Any,
    kwargs: dict[str, Any], made: tuple[str, list[tuple[int, int] | None] | None] | None,
    p: int,
) -> str | None:
    """The generation prompt after `history` (message p's prefix) if render(history, with the
    prompt) is the full render up to message p's iteration, then that prompt, which also
    opens message p's own output; else None."""
    if made is None or made[1] is None or made[1][p] is None or not history:
        return None
    full, spans = made
    start = spans[p][0]  # type: ignore[index]
    try:
        truth = render(tokenizer, history, chat_template=template, tools=tools,
                       add_generation_prompt=True, kwargs=kwargs)
    except RenderError:
        return None
    header = truth[start:]
    return header if truth.startswith(full[:start]) and full.startswith(header, start) else None


class _FullRender(NamedTuple):
    """The conversation's one marked render: its text, the kwargs it was made with (`base` and
    the last turn's first variant's), `base`, and the conversation's shape (`_shape`)."""

    text: str
    kwargs: dict[str, Any]
    base: dict[str, Any]
    shape: tuple[Any, ...]


def _turns_from_one_render(
    masking: _Masking, base: dict[str, Any], targets: list[int], ordinals: dict[int, int]
) -> list[_Turn] | None:
    """The target turns (as `per_turn._TurnAttempt.render` makes them) from one marked render of
    the conversation under `base` kwargs and the last turn's first variant; None where any turn
    cannot be read off it exactly (the caller renders every turn)."""
    tokenizer, template = masking.tokenizer, masking.template
    probe, prep = masking.probe, masking.prep
    last = targets[-1]
    if last != len(prep.messages) - 1:
        return None
    last_variant = _turn_variants(probe, prep, last)[0]
    full_kw = {**probe.render_kwargs, **base, **last_variant}
    try:
        made = render_message_spans(tokenizer, prep.messages, chat_template=template,
                                    tools=prep.tools, kwargs=full_kw)
    except RenderError:
        return None  # the full path renders again and gives the refusal it gives
    if made is None:
        return None
    prep.renders_made += 1
    full, spans = made
    prep.renders.setdefault(_render_key(len(prep.messages), False, full_kw), full)
    if spans is None:
        return None
    turns, rendered = [], _FullRender(full, full_kw, base, _shape(prep))
    for i in targets:
        turn = _turn_in(_TurnAttempt(masking, i, ordinals[i]), rendered, spans[i], i == last)
        if turn is None:
            return None
        turns.append(turn)
    prep.render_path = RENDER_PATH_ONE
    return turns


def _turn_in(
    attempt: _TurnAttempt, rendered: _FullRender, span: tuple[int, int] | None, last: bool
) -> _Turn | None:
    """The attempt's turn read off the full render, its variants tried in the order rendering
    tries them; `last`: the full render is this turn's own. None where the turn cannot be read
    off exactly."""
    if span is None:
        return None
    masking, i = attempt.masking, attempt.i
    full, full_kw = rendered.text, rendered.kwargs
    start, stop = span
    for variant in attempt.variants():
        kw = attempt.kwargs(rendered.base, variant)
        header = _generation_headers(masking.tokenizer, masking.probe, masking.template, full_kw,
                                     kw, masking.prep, rendered.shape)[i]
        if header is None or not full.startswith(header, start):
            return None
        prompt = full[: start + len(header)]
        if last:
            if kw != full_kw:
                return None
            upto: str | None = full
        else:
            upto = _upto_in(masking.probe, masking.prep, i, full, len(prompt), stop)
        if upto is None:
            return None
        turn = attempt.turn(prompt, upto, variant)
        if turn is None:
            continue
        if turn.append_eos or turn.prefill:
            return None
        return turn
    return None


def _upto_in(
    probe: TemplateProbe, prep: _Prepared, i: int, full: str, prompt_len: int, stop: int
) -> str | None:
    """render(history <= i) read off the full render: up to turn i's first end-of-turn marker
    after its prompt (and what the template puts after it), if the template ends turns with its
    own marker, the message's text holds none, and message i's own iteration made it."""
    if probe.eot_source != "template" or _holds_marker(probe, prep.messages[i]):
        return None
    eot = probe.eot_text.strip()
    end = _turn_end(full, prompt_len, probe)
    if end is None or full.find(eot, prompt_len) + len(eot) > stop:
        return None
    return full[:end]
