"""A canonical conversation made template-ready: normalized as the probe found the template
needs, each normalization recorded, and what each reply must contain."""

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


def _prepare(conv: dict[str, Any], probe: TemplateProbe, policy: MaskPolicy) -> _Prepared:
    """Canonical conversation → template-ready messages, normalized per probe (and recorded)."""
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
    fmt = probe.message_format
    norms: list[str] = []
    try:
        tools = parse_json_list(conv.get("tools"))
    except ValueError as exc:
        raise MaskRefused(R_INVALID_CONVERSATION, f"tools is not a JSON list: {exc}") from exc
    if not tools and probe.tools_required:
        tools = []
        norms.append("empty_tools_list_supplied")
    if tools:
        wrapped = []
        for t in tools:
            if isinstance(t, dict) and "function" not in t and "name" in t:
                wrapped.append({"type": "function", "function": t})
            else:
                wrapped.append(t)
        if wrapped != tools:
            norms.append("tools_wrapped_as_openai_functions")
        tools = wrapped
        if not probe.renders_tools:
            raise MaskRefused(R_DROPS_TOOLS, "the template does not render the tool specs")

    msgs: list[dict[str, Any]] = []
    pieces: dict[int, list[str]] = {}
    reasoning_passed: dict[int, bool] = {}
    raw_reasoning: dict[int, str] = {}
    pending_system: str | None = None
    for pos, m in enumerate(raw):
        role = m["role"]
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise MaskRefused(R_INVALID_CONVERSATION, f"message {pos} content is not text")
        if role == "system":
            if fmt.system_mode == "native":
                msgs.append({"role": "system", "content": content})
            elif fmt.system_mode == "merge_into_user" and pos == 0:
                pending_system = content
            else:
                raise MaskRefused(R_DROPS_SYSTEM, "the template rejects or drops system turns")
            continue
        if role == "user":
            if pending_system is not None:
                content = f"{pending_system}\n\n{content}"
                pending_system = None
                norms.append("system_merged_into_first_user")
            msgs.append({"role": "user", "content": content})
            continue
        if role == "tool":
            if probe.tool_role != "native":
                raise MaskRefused(
                    R_DROPS_TOOL_MESSAGES, f"the template's tool role is {probe.tool_role}"
                )
            tm: dict[str, Any] = {"role": "tool", "content": content}
            for key in ("tool_call_id", "name"):
                if m.get(key):
                    tm[key] = m[key]
            msgs.append(tm)
            continue
        # assistant
        idx = len(msgs)
        am: dict[str, Any] = {"role": "assistant"}
        must: list[str] = []
        try:
            calls = parse_json_list(m.get("tool_calls"))
        except ValueError as exc:
            raise MaskRefused(
                R_INVALID_CONVERSATION, f"tool_calls is not a JSON list: {exc}"
            ) from exc
        if calls:
            if probe.tool_call_args is None:
                raise MaskRefused(
                    R_DROPS_TOOL_CALLS,
                    "the template does not render tool calls"
                    + (f" ({probe.tool_call_error})" if probe.tool_call_error else ""),
                )
            am["tool_calls"], call_norms, names = _normalize_calls(calls, fmt.tool_args)
            norms.extend(n for n in call_norms if n not in norms)
            must.extend(names)
        orig_content = content
        reasoning = (m.get("reasoning") or "").strip()
        passed = False
        if reasoning and policy.supervise_reasoning:
            raw_reasoning[idx] = reasoning
        if reasoning:
            if not policy.supervise_reasoning:
                norms.append("reasoning_dropped:policy")
            elif probe.reasoning_placement == "never":
                norms.append("reasoning_dropped:template_never_renders_reasoning")
            elif fmt.reasoning_inline:
                content = inline_reasoning(reasoning, content)
                norms.append("reasoning_inlined_as_think_tags")
                passed = True
            else:
                am[fmt.reasoning_key or "reasoning_content"] = reasoning
                passed = True
            if passed:
                must.append(reasoning)
        if content.strip():
            am["content"] = content
            must.append(orig_content.strip())
        else:
            if not calls:
                if passed:
                    am["content"] = ""
                else:
                    raise MaskRefused(R_EMPTY_ASSISTANT_TURN, f"assistant message {pos} is empty")
            else:
                am["content"] = None if fmt.empty_content == "none" else ""
        must = [p for p in must if p]
        msgs.append(am)
        pieces[idx] = must
        reasoning_passed[idx] = passed
    if pending_system is not None:
        raise MaskRefused(R_DROPS_SYSTEM, "system turn could not be merged: no user turn follows")
    assistant_idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    return _Prepared(msgs, tools, norms, assistant_idx, pieces, reasoning_passed,
                     raw_reasoning=raw_reasoning)


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
