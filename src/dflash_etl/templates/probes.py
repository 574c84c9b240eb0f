"""The nine probes: each renders valid sentinel conversations through the template and records
one thing it does (role orders, the system turn, the end of turn, the generation prompt,
reasoning, prefix stability, tools, {% generation %} tags, BOS). They sit apart from
`probe.probe_template`, which runs them and decides the mask strategy from what they found.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from dflash_etl.templates.limits import RenderLimitExceeded
from dflash_etl.templates.render import (
    LEADING_MARKER_RE,
    THINK_CLOSE,
    common_prefix_len,
    guarded_call,
    inline_reasoning,
)

# Kwargs some templates read to keep earlier turns' reasoning, making a prefix render stable.
STABLE_KWARG_CANDIDATES: tuple[tuple[str, Any], ...] = (
    ("preserve_thinking", True),
    ("clear_thinking", False),
    ("keep_thinking", True),
    ("preserve_reasoning", True),
)
# Kwargs that switch a template's thinking mode (only passed when the template mentions them).
THINKING_KWARGS = ("enable_thinking", "thinking", "reasoning")

_S = "You are the probe system prompt."
_U1, _U2 = "First probe question about apples?", "Second probe question about pears?"
_A1, _A2 = "First probe answer about apples.", "Second probe answer about pears."
_R1, _R2 = "First probe reasoning about apples.", "Second probe reasoning about pears."
_TOOL_NAME, _TOOL_ARG = "probe_lookup_fn", "probe-argument-value"
_TOOL_RESULT = "probe tool result 4217"
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": _TOOL_NAME,
            "description": "Look a probe value up.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to look up"}},
                "required": ["query"],
            },
        },
    }
]
_GEN_TAG_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateUnusable(Exception):
    """The template cannot render any valid conversation; `reason` says why."""

    def __init__(self, reason: str, details: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.details = details or {}


def _msg(role: str, content: str | None, **extra: Any) -> dict[str, Any]:
    m: dict[str, Any] = {"role": role, "content": content}
    m.update({k: v for k, v in extra.items() if v is not None})
    return m


def _tool_call(args: Any) -> dict[str, Any]:
    return {
        "id": "call_probe_1",
        "type": "function",
        "function": {"name": _TOOL_NAME, "arguments": args},
    }


# A probe render: messages, add_generation_prompt, tools, extra kwargs -> (text, error).
_Render = Callable[..., tuple[str | None, str | None]]


class _RoleOrders(NamedTuple):
    accepted: list[str]
    rejected: dict[str, str]
    renders: dict[str, str]  # accepted order -> its render


def _probe_role_orders(r: _Render) -> _RoleOrders:
    """1. Role orders: the valid ones first; the invalid ones only to report what the template
    rejects. TemplateUnusable unless [user, assistant] renders with both contents."""
    u1, u2, s = _msg("user", _U1), _msg("user", _U2), _msg("system", _S)
    a1, a2 = _msg("assistant", _A1), _msg("assistant", _A2)
    orders: dict[str, tuple[list[dict[str, Any]], bool]] = {
        "user,assistant": ([u1, a1], False),
        "system,user,assistant": ([s, u1, a1], False),
        "user,assistant,user,assistant": ([u1, a1, u2, a2], False),
        "user+generation_prompt": ([u1], True),
        "assistant_only": ([a1], False),
        "system,assistant": ([s, a1], False),
        "user,user,assistant": ([u1, u2, a1], False),
        "developer,user,assistant": ([_msg("developer", _S), u1, a1], False),
    }
    found = _RoleOrders([], {}, {})
    for name, (msgs, gen) in orders.items():
        text, err = r(msgs, gen)
        if err is None and text:
            found.accepted.append(name)
            found.renders[name] = text
        else:
            found.rejected[name] = err or "rendered empty text"
    if "user,assistant" not in found.renders:
        raise TemplateUnusable(
            "template renders no valid conversation (user,assistant): "
            + found.rejected.get("user,assistant", "?"),
            found.rejected,
        )
    ua = found.renders["user,assistant"]
    if _U1 not in ua or _A1 not in ua:
        raise TemplateUnusable("template drops the user or assistant content of [user, assistant]")
    return found


def _probe_system(r: _Render, roles: _RoleOrders, notes: list[str]) -> str:
    """2. The system turn: native, or merged into the first user turn when rejected/dropped."""
    sua = roles.renders.get("system,user,assistant")
    if sua is not None and _S in sua:
        return "native"
    merged, _ = r([_msg("user", f"{_S}\n\n{_U1}"), _msg("assistant", _A1)])
    notes.append(
        "system turn "
        + ("rejected: " + roles.rejected["system,user,assistant"] if sua is None else "dropped")
    )
    return "merge_into_user" if merged and _S in merged else "unsupported"


class _EndOfTurn(NamedTuple):
    eot_text: str
    post_eot: str
    eot_source: str


def _probe_end_of_turn(
    tail: str, renders: dict[str, str], eos_tok: str | None, eos_src: str, notes: list[str]
) -> _EndOfTurn:
    """3. End of turn: what follows the final assistant content (`tail`)."""
    m = LEADING_MARKER_RE.match(tail)
    if m:
        return _EndOfTurn(tail[: m.end()], tail[m.end() :], "template")
    if eos_tok and tail.lstrip().startswith(eos_tok):
        end = len(tail) - len(tail.lstrip()) + len(eos_tok)
        return _EndOfTurn(tail[:end], tail[end:], "template")
    if (mid := _mid_tail(renders.get("user,assistant,user,assistant"))) and (
        shared := tail[: common_prefix_len(tail, mid)].rstrip()
    ).strip():
        # no marker-shaped text, but the final and a middle assistant turn end the same way
        notes.append(f"end-of-turn {shared!r} taken from the text shared by final and middle turns")
        return _EndOfTurn(shared, tail[len(shared) :], "template")
    notes.append(
        f"no end-of-turn marker after the assistant content (tail {tail!r}); "
        f"falls back to {eos_src} {eos_tok!r}"
    )
    return _EndOfTurn("", tail, eos_src)


class _GenerationPrompt(NamedTuple):
    generation_prompt: str
    generation_prefill: str
    appends_assistant_header: bool


def _probe_generation_prompt(
    ua: str,
    renders: dict[str, str],
    base_u: str | None,
    tail: str,
    post_eot: str,
    eot_source: str,
) -> _GenerationPrompt:
    """4. The generation prompt, and what it pre-fills compared with a rendered assistant turn."""
    gen_text = renders.get("user+generation_prompt")
    if eot_source != "template" and _quotes_turns(ua, gen_text):
        raise TemplateUnusable(
            "the template quotes the conversation inside its prompt, as a classifier such as "
            "Llama Guard or Granite Guardian does: the text after an assistant turn "
            f"({tail[:80]!r}) is the text after the user turn of a generation prompt, so the "
            "model's reply is a verdict about the conversation, not its assistant turn, and "
            "there is no turn to supervise (use the chat model's own template)"
        )
    generation_prompt = prefill = ""
    if gen_text is not None and base_u is not None and gen_text.startswith(base_u):
        generation_prompt = gen_text[len(base_u) :]
        turn = ua[len(base_u) :] if ua.startswith(base_u) else ""
        prefill = generation_prompt[common_prefix_len(generation_prompt, turn) :]
    header = generation_prompt[: len(generation_prompt) - len(prefill)]
    if header.strip():
        appends_header = header.strip() in post_eot
    else:  # no separate generation prompt: the header is always appended after the last turn
        appends_header = bool(post_eot.strip()) and (base_u or "").rstrip().endswith(
            post_eot.strip()
        )
    return _GenerationPrompt(generation_prompt, prefill, appends_header)


class _Reasoning(NamedTuple):
    reasoning_key: str | None
    reasoning_inline: bool
    reasoning_placement: str
    injects_empty_think: bool
    thinking_kwargs: list[str]


def _probe_reasoning(r: _Render, source: str, ua: str, base_u: str | None) -> _Reasoning:
    """5. Reasoning: which field the template reads, and for which turns."""
    thinking_kwargs = [k for k in THINKING_KWARGS if _reads_variable(source, k)]
    reasoning_key, reasoning_inline, placement = None, False, "never"
    candidates: list[tuple[str | None, bool]] = [
        ("reasoning_content", False),
        ("reasoning", False),
        ("thinking", False),
    ]
    if THINK_CLOSE in source:
        candidates.append((None, True))
    for key, inline in candidates:
        ra1 = _reason_msg(key, inline, _R1, _A1)
        ra2 = _reason_msg(key, inline, _R2, _A2)
        text, _ = r([_msg("user", _U1), ra1, _msg("user", _U2), ra2])
        if not text:
            continue
        if _R2 in text:
            reasoning_key, reasoning_inline = key, inline
            placement = "all" if _R1 in text else "after_last_user"
            break
    single = ua[len(base_u) :] if base_u and ua.startswith(base_u) else ua
    injects_empty_think = bool(re.search(r"<think>\s*</think>", single))
    return _Reasoning(reasoning_key, reasoning_inline, placement, injects_empty_think,
                      thinking_kwargs)


class _PrefixStability(NamedTuple):
    prefix_stable: bool
    stable_kwargs: dict[str, Any] | None
    prefix_detail: str


def _probe_prefix_stability(
    r: _Render, source: str, reasoning: _Reasoning, system_mode: str
) -> _PrefixStability:
    """6. Prefix stability: render(history<=k) is a prefix of render(all), with the generation
    prompt too; by default, else under a stable kwarg the template reads."""
    key, inline = reasoning.reasoning_key, reasoning.reasoning_inline
    if key or inline:
        a1, a2 = _reason_msg(key, inline, _R1, _A1), _reason_msg(key, inline, _R2, _A2)
    else:
        a1, a2 = _msg("assistant", _A1), _msg("assistant", _A2)
    system = [_msg("system", _S)] if system_mode == "native" else []
    conv = [*system, _msg("user", _U1), a1, _msg("user", _U2), a2]
    prefix_stable, prefix_detail = _stable_under(r, conv, {})
    stable_kwargs: dict[str, Any] | None = None
    if not prefix_stable:
        for name, value in STABLE_KWARG_CANDIDATES:
            if _reads_variable(source, name) and _stable_under(r, conv, {name: value})[0]:
                stable_kwargs = {name: value}
                break
    return _PrefixStability(prefix_stable, stable_kwargs, prefix_detail)


def _stable_under(
    r: _Render, conv: list[dict[str, Any]], extra: dict[str, Any]
) -> tuple[bool, str]:
    """Whether every history render and generation prompt of `conv` is a prefix of its full
    render under the kwargs `extra`, and in words why not."""
    full, err = r(conv, **extra)
    if full is None:
        return False, f"full render failed: {err}"
    for i, msg in enumerate(conv):
        if msg["role"] != "assistant":
            continue
        upto, _ = r(conv[: i + 1], **extra)
        if upto is None or not full.startswith(upto.rstrip()):
            return False, f"render of messages[:{i + 1}] is not a prefix of the full render"
        prompt, _ = r(conv[:i], gen=True, **extra)
        if prompt is None or not full.startswith(prompt):
            return False, f"generation prompt before message {i} is not a prefix of the render"
    return True, "every history render and generation prompt is a prefix of the full render"


class _Tools(NamedTuple):
    renders_tools: bool
    tool_call_args: str | None
    tool_call_error: str | None
    empty_content: str
    tool_role: str


def _probe_tools(r: _Render) -> _Tools:
    """7. Tools, tool calls (arguments as an object or a JSON string, empty content as None or
    ""), the tool role."""
    with_tools, _ = r([_msg("user", _U1), _msg("assistant", _A1)], tools=_TOOLS)
    renders_tools = bool(with_tools and _TOOL_NAME in with_tools)
    tool_call_error: str | None = None
    for args_kind, args in (
        ("object", {"query": _TOOL_ARG}),
        ("string", json.dumps({"query": _TOOL_ARG})),
    ):
        for ec, content in (("none", None), ("empty", "")):
            call = _msg("assistant", content, tool_calls=[_tool_call(args)])
            tmsg = _msg("tool", _TOOL_RESULT, tool_call_id="call_probe_1", name=_TOOL_NAME)
            conv = [_msg("user", _U1), call, tmsg, _msg("assistant", _A2)]
            text, err = r(conv, tools=_TOOLS if renders_tools else None)
            if text is None:
                tool_call_error = tool_call_error or err
                continue
            if _TOOL_NAME in text and _TOOL_ARG in text and "None" not in text.replace(_S, ""):
                tool_role = "native" if _TOOL_RESULT in text else "dropped"
                return _Tools(renders_tools, args_kind, None, ec, tool_role)
    rejected = bool(tool_call_error and "tool" in tool_call_error.lower())
    return _Tools(renders_tools, None, tool_call_error, "none",
                  "rejected" if rejected else "untested")


class _GenerationTags(NamedTuple):
    has_generation_tags: bool
    generation_mask_usable: bool


def _probe_generation_tags(
    tokenizer: Any, source: str, kwargs: dict[str, Any]
) -> _GenerationTags:
    """8. {% generation %} tags, and whether HF's assistant mask from them is usable."""
    if not _GEN_TAG_RE.search(source):
        return _GenerationTags(False, False)
    conv = [_msg("user", _U1), _msg("assistant", _A1)]
    return _GenerationTags(True, _generation_mask_ok(tokenizer, source, kwargs, conv, _A1))


class _Bos(NamedTuple):
    template_uses_bos: bool
    template_emits_bos: bool
    tokenizer_adds_bos: bool


def _probe_bos(
    tokenizer: Any, source: str, kwargs: dict[str, Any], ua: str, notes: list[str]
) -> _Bos:
    """9. BOS handling: the template's, and whether the tokenizer adds special tokens."""
    bos = kwargs.get("bos_token") or getattr(tokenizer, "bos_token", None)
    emits_bos = bool(bos) and ua.startswith(bos)
    try:
        adds_bos = len(tokenizer("a")["input_ids"]) > len(
            tokenizer("a", add_special_tokens=False)["input_ids"]
        )
    except Exception:
        adds_bos = False
    if adds_bos:
        notes.append(
            "tokenizer adds special tokens when asked; rows are encoded without them "
            "(the rendered template is authoritative)"
        )
    return _Bos("bos_token" in source, emits_bos, adds_bos)


_OPEN_REASONING_END_RE = re.compile(r"<(think|thinking|thought|reasoning)>\n?\Z")


def _open_reasoning_prefill(
    r: _Render, base_u: str | None, ua: str, thinking_kwargs: list[str]
) -> tuple[str | None, dict[str, Any] | None]:
    """The reasoning opener a generation prompt ends with (by default, else with a thinking
    kwarg on) that the template's rendered assistant turn lacks, and those kwargs."""
    if base_u is None or not ua.startswith(base_u):
        return None, None
    turn = ua[len(base_u):]
    for extra in [{}] + [{k: True} for k in thinking_kwargs]:
        text, _ = r([_msg("user", _U1)], gen=True, **extra)
        if not text or not text.startswith(base_u):
            continue
        m = _OPEN_REASONING_END_RE.search(text)
        if m is None:
            continue
        at = m.start() - len(base_u)
        if at >= 0 and turn.startswith(text[len(base_u) : m.start()]) and not turn.startswith(
            m.group(0).strip(), at
        ):
            return m.group(0), extra
    return None, None


def _quotes_turns(ua: str, gen_text: str | None) -> bool:
    """[user, assistant] renders the same text after the assistant's content as [user] with a
    generation prompt does after the user's, and that is more than an end-of-turn marker: the
    assistant content sits where a prompt's does (Llama Guard: "Agent: ...", then the task)."""
    if not gen_text or _A1 not in ua or _U1 not in gen_text:
        return False
    after_answer = ua[ua.rfind(_A1) + len(_A1) :]
    after_question = gen_text[gen_text.rfind(_U1) + len(_U1) :]
    # the task text may name the last message's role ("...the LAST Agent message" after an
    # assistant turn, "...the LAST User message" in the generation prompt: Llama Guard 3)
    same = _ROLE_WORDS.sub("<role>", after_answer) == _ROLE_WORDS.sub("<role>", after_question)
    return same and LEADING_MARKER_RE.match(after_answer) is None and (
        len(after_answer.strip()) > 0
    )


_ROLE_WORDS = re.compile(r"\b(?:user|assistant|agent|human|ai|model|bot|gpt)\b", re.IGNORECASE)


def _mid_tail(text: str | None) -> str:
    """What follows the first assistant answer in a two-round render, up to the next user text."""
    if not text or _A1 not in text or _U2 not in text:
        return ""
    return text[text.find(_A1) + len(_A1) : text.find(_U2)]


def _reads_variable(source: str, name: str) -> bool:
    """The template tests `name` as a variable (not merely mentions the word in its text)."""
    pattern = (
        rf"(?:\bif\s+(?:not\s+)?|\band\s+(?:not\s+)?|\bor\s+(?:not\s+)?|\(\s*)"
        rf"{name}\b(?!\s*=[^=])|\b{name}\s+is\b|\b{name}\s*(?:==|!=)"
    )
    return re.search(pattern, source) is not None


def _reason_msg(key: str | None, inline: bool, reasoning: str, content: str) -> dict[str, Any]:
    if inline:
        return _msg("assistant", inline_reasoning(reasoning, content))
    return _msg("assistant", content, **{key or "reasoning_content": reasoning})


def _generation_mask_ok(
    tokenizer: Any, source: str, kwargs: dict[str, Any], conv: list[dict[str, Any]], answer: str
) -> bool:
    """HF's return_assistant_tokens_mask covers the assistant answer (and is not all zeros)."""
    try:
        out = guarded_call(
            conv, None, tokenizer.apply_chat_template,
            conv,
            chat_template=source,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **kwargs,
        )
    except RenderLimitExceeded:
        raise
    except Exception:
        return False
    mask = out.get("assistant_masks") or []
    ids = out.get("input_ids") or []
    if not any(mask):
        return False
    picked = [t for t, k in zip(ids, mask, strict=False) if k]
    # usable only if the mask starts at the answer: tags that also wrap the assistant header
    # (Laguna: "<assistant>" inside {% generation %}) would supervise prompt tokens
    return tokenizer.decode(picked).lstrip().startswith(answer)
