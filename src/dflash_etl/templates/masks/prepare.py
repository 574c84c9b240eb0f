"""A canonical conversation made template-ready: normalized as the probe found the template
needs, each normalization recorded, and what each reply must contain; and the prepared
conversation with what masking it reads (`_Masking`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from dflash_etl.templates.masks.policy import (
    R_DROPS_SYSTEM,
    R_DROPS_TOOL_CALLS,
    R_DROPS_TOOL_MESSAGES,
    R_DROPS_TOOLS,
    R_EMPTY_ASSISTANT_TURN,
    R_INVALID_CONVERSATION,
    R_NEEDS_RESPONSE,
    R_NO_ASSISTANT_TURN,
    MaskPolicy,
    MaskRefused,
)
from dflash_etl.templates.probe_record import TemplateProbe
from dflash_etl.templates.render import inline_reasoning, parse_json_list

_PLAIN_VALUE_RE = re.compile(r"^[\w .,:-]{1,60}$")


@dataclass
class _Prepared:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    normalizations: list[str]
    assistant_idx: list[int]
    pieces: dict[int, list[str]]  # per message index: texts that must appear in its reply
    reasoning_passed: dict[int, bool]
    renders: dict[tuple[Any, ...], str] = field(default_factory=dict)
    # per message index: the reasoning the policy supervises, rendered by the template or not
    raw_reasoning: dict[int, str] = field(default_factory=dict)
    # what rendering it took (stats.json `render_paths`, `renders`): the renders made, and
    # the path its rows came from (masks.plan's RENDER_PATH_* names)
    renders_made: int = 0
    render_path: str = "render_every_turn"


@dataclass
class _Masking:
    """A prepared conversation with what masking it reads throughout: the tokenizer, the probe,
    the policy and the template. Passed whole to the strategies and to each turn's attempt
    (`per_turn._TurnAttempt`) instead of as five parameters each."""

    prep: _Prepared
    tokenizer: Any
    probe: TemplateProbe
    policy: MaskPolicy
    template: str | None


def _prepare(conv: dict[str, Any], probe: TemplateProbe, policy: MaskPolicy) -> _Prepared:
    """Canonical conversation → template-ready messages, normalized per probe (and recorded)."""
    raw = _checked_messages(conv)
    norms: list[str] = []
    prep = _Prepared([], _prepared_tools(conv, probe, norms), norms, [], {}, {})
    system_mode = probe.message_format.system_mode
    pending_system: str | None = None
    for pos, m in enumerate(raw):
        role = m["role"]
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise MaskRefused(R_INVALID_CONVERSATION, f"message {pos} content is not text")
        if role == "system" and system_mode == "merge_into_user" and pos == 0:
            pending_system = content
        elif role == "system":
            if system_mode != "native":
                raise MaskRefused(R_DROPS_SYSTEM, "the template rejects or drops system turns")
            prep.messages.append({"role": "system", "content": content})
        elif role == "user":
            if pending_system is not None:
                content = f"{pending_system}\n\n{content}"
                pending_system = None
                norms.append("system_merged_into_first_user")
            prep.messages.append({"role": "user", "content": content})
        elif role == "tool":
            prep.messages.append(_tool_message(probe, m, content))
        else:
            _add_assistant(prep, probe, policy, m, pos, content)
    if pending_system is not None:
        raise MaskRefused(R_DROPS_SYSTEM, "system turn could not be merged: no user turn follows")
    prep.assistant_idx = [i for i, m in enumerate(prep.messages) if m["role"] == "assistant"]
    return prep


def _checked_messages(conv: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation's messages, if it has known roles and ends on an assistant turn."""
    raw = conv.get("messages")
    if not isinstance(raw, list) or not raw:
        raise MaskRefused(R_INVALID_CONVERSATION, "no messages")
    roles = [m.get("role") if isinstance(m, dict) else None for m in raw]
    bad = [r for r in roles if r not in ("system", "user", "assistant", "tool")]
    if bad:
        raise MaskRefused(R_INVALID_CONVERSATION, f"unknown roles {bad!r}")
    if "assistant" not in roles:
        raise MaskRefused(R_NO_ASSISTANT_TURN, "the conversation has no assistant turn")
    if roles[-1] != "assistant":
        raise MaskRefused(
            R_NEEDS_RESPONSE, f"the conversation ends on a {roles[-1]} turn that awaits a reply"
        )
    return raw


def _prepared_tools(
    conv: dict[str, Any], probe: TemplateProbe, norms: list[str]
) -> list[dict[str, Any]] | None:
    """The tool specs in OpenAI shape, an empty list for a template that needs one, or None."""
    try:
        tools = parse_json_list(conv.get("tools"))
    except ValueError as exc:
        raise MaskRefused(R_INVALID_CONVERSATION, f"tools is not a JSON list: {exc}") from exc
    if not tools and probe.tools_required:
        norms.append("empty_tools_list_supplied")
        return []
    if not tools:
        return tools
    wrapped = [
        {"type": "function", "function": t}
        if isinstance(t, dict) and "function" not in t and "name" in t
        else t
        for t in tools
    ]
    if wrapped != tools:
        norms.append("tools_wrapped_as_openai_functions")
    if not probe.renders_tools:
        raise MaskRefused(R_DROPS_TOOLS, "the template does not render the tool specs")
    return wrapped


def _tool_message(probe: TemplateProbe, m: dict[str, Any], content: str) -> dict[str, Any]:
    if probe.tool_role != "native":
        raise MaskRefused(R_DROPS_TOOL_MESSAGES, f"the template's tool role is {probe.tool_role}")
    tm: dict[str, Any] = {"role": "tool", "content": content}
    for key in ("tool_call_id", "name"):
        if m.get(key):
            tm[key] = m[key]
    return tm


def _add_assistant(
    prep: _Prepared,
    probe: TemplateProbe,
    policy: MaskPolicy,
    m: dict[str, Any],
    pos: int,
    content: str,
) -> None:
    """Message `pos`, an assistant turn, as the template reads it, and the texts its reply must
    hold (its tool calls, the reasoning passed, its content)."""
    idx = len(prep.messages)
    am: dict[str, Any] = {"role": "assistant"}
    must: list[str] = []
    calls = _tool_calls(probe, m, prep.normalizations)
    if calls:
        am["tool_calls"], names = calls
        must.extend(names)
    passed_content, passed = _pass_reasoning(prep, probe, policy, m, idx, am, content)
    if passed:
        must.append(prep.raw_reasoning[idx])
    if passed_content.strip():
        am["content"] = passed_content
        must.append(content.strip())
    elif calls:
        am["content"] = None if probe.message_format.empty_content == "none" else ""
    elif passed:
        am["content"] = ""
    else:
        raise MaskRefused(R_EMPTY_ASSISTANT_TURN, f"assistant message {pos} is empty")
    prep.messages.append(am)
    prep.pieces[idx] = [p for p in must if p]
    prep.reasoning_passed[idx] = passed


def _tool_calls(
    probe: TemplateProbe, m: dict[str, Any], norms: list[str]
) -> tuple[list[dict[str, Any]], list[str]] | None:
    """The message's tool calls as the template wants them and the names and plain argument
    values the reply must show; None when it has none."""
    try:
        calls = parse_json_list(m.get("tool_calls"))
    except ValueError as exc:
        raise MaskRefused(R_INVALID_CONVERSATION, f"tool_calls is not a JSON list: {exc}") from exc
    if not calls:
        return None
    if probe.tool_call_args is None:
        raise MaskRefused(
            R_DROPS_TOOL_CALLS,
            "the template does not render tool calls"
            + (f" ({probe.tool_call_error})" if probe.tool_call_error else ""),
        )
    normalized, call_norms, names = _normalize_calls(calls, probe.message_format.tool_args)
    norms.extend(n for n in call_norms if n not in norms)
    return normalized, names


def _pass_reasoning(
    prep: _Prepared,
    probe: TemplateProbe,
    policy: MaskPolicy,
    m: dict[str, Any],
    idx: int,
    am: dict[str, Any],
    content: str,
) -> tuple[str, bool]:
    """Give the template the message's reasoning where it reads it (its reasoning field in `am`,
    or think tags inlined in the content) when the policy supervises it and the template renders
    it: (the content to pass, whether the reasoning was passed)."""
    reasoning = (m.get("reasoning") or "").strip()
    if not reasoning:
        return content, False
    if not policy.supervise_reasoning:
        prep.normalizations.append("reasoning_dropped:policy")
        return content, False
    prep.raw_reasoning[idx] = reasoning
    fmt = probe.message_format
    if probe.reasoning_placement == "never":
        prep.normalizations.append("reasoning_dropped:template_never_renders_reasoning")
        return content, False
    if fmt.reasoning_inline:
        prep.normalizations.append("reasoning_inlined_as_think_tags")
        return inline_reasoning(reasoning, content), True
    am[fmt.reasoning_key or "reasoning_content"] = reasoning
    return content, True


def _normalize_calls(
    calls: list[Any], want: str
) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Tool calls in OpenAI shape with arguments as the template wants them (object or JSON)."""
    out: list[dict[str, Any]] = []
    norms: list[str] = []
    names: list[str] = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MaskRefused(R_INVALID_CONVERSATION, f"tool call without a function name: {c!r}")
        args = fn.get("arguments", {})
        if want == "object" and isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise MaskRefused(
                    R_INVALID_CONVERSATION, f"tool-call arguments are not JSON: {args[:80]!r}"
                ) from exc
            norms.append("tool_arguments_json_to_object")
        elif want == "string" and not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
            norms.append("tool_arguments_object_to_json")
        call: dict[str, Any] = {
            "type": c.get("type") or "function",
            "function": {"name": fn["name"], "arguments": args},
        }
        if c.get("id"):
            call["id"] = c["id"]
        out.append(call)
        names.append(fn["name"])
        # plain-text argument values must show up in the reply too (a template that drops the
        # arguments would otherwise pass); values needing JSON escaping are not checked
        values = args.values() if isinstance(args, dict) else []
        names.extend(v for v in values if isinstance(v, str) and _PLAIN_VALUE_RE.match(v))
    return out, norms, names
