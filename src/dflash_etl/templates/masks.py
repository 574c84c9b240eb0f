"""Tokenize a canonical conversation with the target's chat template and build a verified loss mask.

A mask is either verifiably right or the row is refused with a reason code (DESIGN principle 2).
The supervised span of an assistant turn is what the model would generate after the prompt: the
text of `render(history<=k)` after `render(history<k, add_generation_prompt=True)`, cut at the
template's end-of-turn marker. Everything after that marker (a newline, an assistant header some
templates append) is prompt. Each row is re-checked by `verify_row` before it is returned.

Decisions (documented so reviewers can check them):
- BPE merges across the prompt/reply boundary: a per-turn row is encoded as
  encode(prompt) + encode(reply), exactly as at inference (the prompt is tokenized alone, the
  model generates the reply), so no token can straddle. In a one-row-per-conversation row a token
  is supervised iff its first character lies inside a reply span; a token straddling a span
  boundary sends the conversation to per-turn rows (or refuses it, `token_straddles_boundary`,
  when the policy forces one row).
- An empty think block (`<think>\\n\\n</think>\\n\\n`) is never supervised for a turn without
  reasoning: for such turns the thinking-off generation prompt is tried first (Qwen3.6:
  `enable_thinking=False`), which puts the empty block in the prompt; a variant whose reply would
  start by closing an empty think block is rejected.
- A generation prompt that pre-fills a *closed empty* think block the rendered turn lacks
  (QwQ / DeepSeek-R1 distills with thinking off) is prompt: the row is that prompt + the reply as
  rendered.
- A generation prompt that leaves a reasoning block *open* (`<think>\n`: DeepSeek-R1 distills,
  QwQ and DeepCoder with thinking on) while the template strips reasoning from its turns: the row
  is that prompt, opener included, + what the model writes after it, the rest of the reasoning,
  `\n</think>\n\n` (the layout `inline_reasoning` gives), then the turn as rendered (content,
  end of turn); one row per turn, `TokenizedRow.prefill` names the opener and `verify_row` checks
  the prompt ends with it and the reply closes it once. A turn without reasoning there is refused
  (`prefill_needs_reasoning`); any other pre-fill mismatch is refused
  (`generation_prompt_mismatch`), never guessed.
- Without a template end-of-turn marker the eos token (tokenizer, else generation_config.json) is
  appended and supervised when `include_eot` (probe.json `eos_appended` says which and why); such
  rows are always one row per turn, so no eos is ever inserted into a history the target would
  not see.
- `turns="all"`: one row for the whole conversation when every turn's prompt+reply is a prefix of
  the full render (by default, else with the template's stable kwarg such as
  `preserve_thinking=True`); otherwise one row per assistant turn with its exact history.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import operator
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash_etl.templates.probe_record import (
    STRATEGY_GENERATION,
    STRATEGY_PER_TURN,
    STRATEGY_RENDER_DIFF,
    TemplateProbe,
)
from dflash_etl.templates.render import (
    EMPTY_REASONING_AT_END_RE,
    LEADING_EMPTY_THINK_RE,
    TRAILING_MARKER_RE,
    RenderError,
    RenderLimitExceeded,
    RenderTimeout,
    RenderTooLarge,
    common_prefix_len,
    guarded_call,
    inline_reasoning,
    parse_json_list,
    render,
    render_generation_spans,
)

# --- reason codes -----------------------------------------------------------------------------
# Filters: the row is fine but there is nothing (or too little) to train on; counted as filtered.
R_NEEDS_RESPONSE = "needs_response"
R_NO_ASSISTANT_TURN = "no_assistant_turn"
R_TOO_FEW_SUPERVISED = "too_few_supervised_tokens"
R_EXCEEDS_SEQ_LENGTH = "exceeds_seq_length"
# Quarantine: the row (or the template) cannot be masked correctly; someone must look at it.
R_INVALID_CONVERSATION = "invalid_conversation"
R_EMPTY_ASSISTANT_TURN = "empty_assistant_turn"
R_ROLE_ORDER = "template_rejects_role_order"
R_RENDER_ERROR = "template_render_error"
R_DROPS_SYSTEM = "template_drops_system"
R_DROPS_TOOLS = "template_drops_tools"
R_DROPS_TOOL_CALLS = "template_drops_tool_calls"
R_DROPS_TOOL_MESSAGES = "template_drops_tool_messages"
R_REASONING_NOT_RENDERED = "reasoning_not_rendered"
R_NOT_PREFIX_STABLE = "template_not_prefix_stable"
R_GENERATION_PROMPT_MISMATCH = "generation_prompt_mismatch"
R_EMPTY_THINK_SUPERVISED = "would_supervise_empty_think"
R_REPLY_MISSING_CONTENT = "reply_missing_content"
R_EOT_NOT_FOUND = "eot_not_found"
R_NO_EOS = "no_eos_token"
R_GENERATION_TAGS_UNUSABLE = "generation_tags_unusable"
R_TOKEN_STRADDLES_BOUNDARY = "token_straddles_boundary"
R_MASK_VERIFICATION_FAILED = "mask_verification_failed"
R_RENDER_TIMEOUT = RenderTimeout.code  # "template_render_timeout": over [tokenize] limits
R_OUTPUT_TOO_LARGE = RenderTooLarge.code  # "template_output_too_large"
LIMIT_CODES = frozenset({R_RENDER_TIMEOUT, R_OUTPUT_TOO_LARGE})  # final: never retried otherwise
# a turn that would train two think blocks (an empty prompt block then reasoning, or reasoning
# left in the content by a splitter that missed a generation prompt's `<think>\n` prefill)
R_DUPLICATED_THINK = "duplicated_think_markup"
# the generation prompt opens a reasoning block (R1 distills: "<think>\n") the template's turns
# lack, and the turn has no reasoning: what the model writes before closing the block is unknown
R_PREFILL_NEEDS_REASONING = "prefill_needs_reasoning"
THINK_TAGS = ("<think>", "</think>")

FILTER_CODES = frozenset(
    {R_NEEDS_RESPONSE, R_NO_ASSISTANT_TURN, R_TOO_FEW_SUPERVISED, R_EXCEEDS_SEQ_LENGTH}
)
QUARANTINE_CODES = frozenset(
    {
        R_INVALID_CONVERSATION,
        R_EMPTY_ASSISTANT_TURN,
        R_ROLE_ORDER,
        R_RENDER_ERROR,
        R_DROPS_SYSTEM,
        R_DROPS_TOOLS,
        R_DROPS_TOOL_CALLS,
        R_DROPS_TOOL_MESSAGES,
        R_REASONING_NOT_RENDERED,
        R_NOT_PREFIX_STABLE,
        R_GENERATION_PROMPT_MISMATCH,
        R_EMPTY_THINK_SUPERVISED,
        R_REPLY_MISSING_CONTENT,
        R_EOT_NOT_FOUND,
        R_NO_EOS,
        R_GENERATION_TAGS_UNUSABLE,
        R_TOKEN_STRADDLES_BOUNDARY,
        R_MASK_VERIFICATION_FAILED,
        R_RENDER_TIMEOUT,
        R_OUTPUT_TOO_LARGE,
        R_DUPLICATED_THINK,
        R_PREFILL_NEEDS_REASONING,
    }
)


def duplicated_think(text: str) -> str | None:
    """The think tag `text` holds more than once, or None."""
    return next((t for t in THINK_TAGS if text.count(t) > 1), None)


_PLAIN_VALUE_RE = re.compile(r"^[\w .,:-]{1,60}$")


class MaskRefused(Exception):
    """A row that cannot be tokenized with a verifiably right mask; `code` is a reason code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def is_filter(self) -> bool:
        return self.code in FILTER_CODES


@dataclass(frozen=True)
class MaskPolicy:
    """How to mask: which strategy, which turns, end-of-turn, reasoning and length handling."""

    strategy: Literal["auto", "generation", "render_diff", "per_turn"] = "auto"
    include_eot: bool = True
    supervise_reasoning: bool = True
    turns: Literal["all", "last"] = "all"
    seq_length: int | None = None
    truncation: Literal["right", "drop"] = "right"
    min_supervised_tokens: int = 2


@dataclass
class TokenizedRow:
    """One training row. `turn`: ordinal of the supervised assistant turn, -1 when the row
    supervises several turns (one row per conversation)."""

    input_ids: list[int]
    loss_mask: list[int]
    turn: int
    normalizations: list[str]
    strategy: str = ""
    text: str = ""  # the rendered row text (before an appended eos and truncation)
    char_spans: list[tuple[int, int]] = field(default_factory=list)  # reply spans in `text`
    expected: list[str] = field(default_factory=list)  # decoded text each span must give
    eos_appended: bool = False
    truncated: bool = False
    split_at: int | None = None  # per-turn rows: prompt and reply are encoded separately here
    cross_checked: bool = False  # also made without shortcuts, and equal (`cross_check`)
    prefill: str = ""  # the reasoning opener the prompt ends with; the reply continues after it


@dataclass
class _Turn:
    """One assistant turn rendered as the final turn: prompt + the reply the model generates."""

    ordinal: int
    index: int
    prompt: str
    reply: str
    append_eos: bool
    kwargs: dict[str, Any]
    notes: list[str]
    prefill: str = ""  # the pre-filled reasoning opener the prompt ends with, when supervised after


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


def _render_prefix(
    tokenizer: Any,
    prep: _Prepared,
    n: int,
    generation_prompt: bool,
    kwargs: dict[str, Any],
    template: str | None,
) -> str:
    """The first `n` messages rendered, once per conversation: the last turn's render-diff
    render is the full conversation's render, and each render is the stage's largest cost."""
    key = _render_key(n, generation_prompt, kwargs)
    if key not in prep.renders:
        prep.renders[key] = render(
            tokenizer, prep.messages[:n], chat_template=template, tools=prep.tools,
            add_generation_prompt=generation_prompt, kwargs=kwargs,
        )
    return prep.renders[key]


def _render_key(n: int, generation_prompt: bool, kwargs: dict[str, Any]) -> tuple[Any, ...]:
    return n, generation_prompt, tuple(sorted((k, repr(v)) for k, v in kwargs.items()))


# --- preparation ------------------------------------------------------------------------------


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


# --- per-turn rendering -----------------------------------------------------------------------


def _variants(probe: TemplateProbe, has_reasoning: bool) -> list[dict[str, Any]]:
    """Thinking-mode kwargs to try for one turn, most faithful first."""
    if has_reasoning:
        return [{}] + [{k: True} for k in probe.thinking_kwargs]
    return [{k: False} for k in probe.thinking_kwargs] + [{}]


def _render_turn(
    tokenizer: Any,
    probe: TemplateProbe,
    prep: _Prepared,
    ordinal: int,
    i: int,
    base: dict[str, Any],
    policy: MaskPolicy,
    template: str | None,
    next_prompt_at: int | None = None,
) -> _Turn:
    """Prompt (history<i + generation prompt) and the reply of message i rendered as final turn.

    With `next_prompt_at` (the next target turn's index, whose prompt was rendered first, on a
    template prefix-stable under these kwargs) the history up to this turn is read off that
    prompt instead of rendered: N+1 renders for N replies, not 2N."""
    failures: list[tuple[str, str]] = []

    for variant in _turn_variants(probe, prep, i):
        kw = {**probe.render_kwargs, **base, **variant}
        try:
            prompt = _render_prefix(tokenizer, prep, i, True, kw, template)
            upto = (_upto_from_next_prompt(probe, prep, i, next_prompt_at, prompt, kw)
                    if next_prompt_at is not None else None)
            if upto is None:
                upto = _render_prefix(tokenizer, prep, i + 1, False, kw, template)
        except RenderLimitExceeded:
            raise  # the conversation's verdict: another variant would only spend the limit again
        except RenderError as exc:
            failures.append((R_RENDER_ERROR, f"{variant or 'default'}: {exc}"))
            continue
        ok = _check_turn(probe, prep, i, prompt, upto, policy, failures, variant)
        if ok is not None:
            reply, append_eos, notes, prefill = ok
            if variant:
                notes.append(
                    "generation_prompt_kwargs:" + ",".join(f"{k}={v}" for k, v in variant.items())
                )
            return _Turn(ordinal, i, prompt, reply, append_eos, variant, notes, prefill)
    code, message = failures[0] if failures else (R_RENDER_ERROR, "no variant rendered")
    detail = "; ".join(f"[{c}] {m}" for c, m in failures)
    raise MaskRefused(
        code,
        f"assistant turn {ordinal}: {message}"
        + (f" (all tries: {detail})" if len(failures) > 1 else ""),
    )


def _strings_in(value: Any) -> list[str]:
    """Every string inside a message (its content, reasoning, tool-call names and arguments)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _strings_in(v)]
    if isinstance(value, list):
        return [t for v in value for t in _strings_in(v)]
    return []


def _holds_marker(probe: TemplateProbe, message: dict[str, Any]) -> bool:
    """Whether the message's own text holds the template's end-of-turn marker: then the first
    marker after a reply's start need not be its end, and the shortcuts render instead."""
    eot = probe.eot_text.strip()
    return any(eot in text for text in _strings_in(message))


def _turn_end(text: str, start: int, probe: TemplateProbe) -> int | None:
    """Where the turn that starts at `start` ends in `text` (after its end-of-turn marker and the
    text the template puts after it), if its first marker is its end."""
    eot, post = probe.eot_text.strip(), probe.post_eot
    at = text.find(eot, start) if eot else -1
    if at < 0:
        return None
    end = at + len(eot)
    if post and not text.startswith(post, end):
        return None
    return end + len(post)


def _upto_from_next_prompt(
    probe: TemplateProbe,
    prep: _Prepared,
    i: int,
    next_at: int,
    prompt: str,
    kwargs: dict[str, Any],
) -> str | None:
    """render(history <= i), read off the next target turn's prompt render (made first, with the
    same kwargs): on a prefix-stable template it starts with this turn's prompt, then holds this
    reply up to its end-of-turn marker. None (render it) unless the probe found this shortcut
    exact on its sample, the template ends turns with its own marker and the message's own text
    holds no such marker (the first one after the prompt is then the turn's end)."""
    if not probe.fast_paths.get(FAST_TURN_END) or probe.eot_source != "template":
        return None
    following = prep.renders.get(_render_key(next_at, True, kwargs))
    eot = probe.eot_text.strip()
    if following is None or not eot or not following.startswith(prompt):
        return None
    if _holds_marker(probe, prep.messages[i]):
        return None
    end = _turn_end(following, len(prompt), probe)
    return following[:end] if end is not None else None


def _check_turn(
    probe: TemplateProbe,
    prep: _Prepared,
    i: int,
    prompt: str,
    upto: str,
    policy: MaskPolicy,
    failures: list[tuple[str, str]],
    variant: dict[str, Any],
) -> tuple[str, bool, list[str], str] | None:
    """(reply, append_eos, notes, prefill) for one variant, or None after recording why it failed.
    `prefill` is the reasoning opener the prompt ends with when the reply is supervised after it."""
    tag = str(variant or "default")
    notes: list[str] = []
    prefill = ""
    h = common_prefix_len(prompt, upto)
    if _thinking_on_drops_reasoning(prep, i, prompt, variant):
        return None  # a try made only for an opener that is not there: not the turn's verdict
    if h == len(prompt):  # the prompt is a prefix of the history-with-this-turn render
        body = upto[h:]
    else:
        m = EMPTY_REASONING_AT_END_RE.search(prompt)
        reasoning = _reasoning_text(prep, i)
        at = upto.rfind(reasoning[:40]) if reasoning else -1
        gp = probe.generation_prompt
        if m and m.start() <= h and not prep.reasoning_passed.get(i):
            # thinking off: the closed empty block the generation prompt ends with is prompt; a
            # (partial) empty block the turn renders in its place is that same block (DeepSeek-V3.2
            # renders "</think>" where the prompt has "<think></think>")
            body = upto[m.start() :]
            lead = LEADING_EMPTY_THINK_RE.match(body)
            if lead:
                body = body[lead.end() :]
                if prompt[-1:].isspace():
                    body = body.lstrip()
            notes.append("generation_prompt_empty_think_is_prompt")
        elif (
            len(gp.strip()) >= 3
            and prompt.endswith(gp)
            and 0 <= (hs := upto.find(gp, max(0, h - len(gp)))) <= h
        ):
            # the template renders text after the last message (Command-R tool use: a trailing
            # instruction) and then the generation prompt; the turn starts with that header
            body = upto[hs + len(gp) :]
            notes.append("generation_prompt_after_trailing_text")
        elif reasoning and 0 <= at <= h:
            # the generation prompt pre-fills the start of the reasoning (Apriel: "Here are my
            # reasoning steps:"); the model continues with the reasoning as the template renders it
            body = upto[at:]
            notes.append("generation_prompt_prefill_is_prompt")
        elif (opened := _open_reasoning_prefill(prompt, upto)) is not None:
            after = _reply_after_prefill(prep, i, prompt, upto, opened, tag, failures)
            if after is None:
                return None
            body, prefill = after
            notes.append(f"reasoning_supervised_after_prefill:{prefill!r}")
        else:
            failures.append(
                (
                    R_GENERATION_PROMPT_MISMATCH,
                    f"{tag}: generation prompt ends {prompt[h:][-60:]!r} but the turn renders as "
                    f"{upto[h:][:60]!r}",
                )
            )
            return None
    eot = probe.eot_text.strip()
    head = prompt[prompt.rfind(eot) + len(eot):] if eot and eot in prompt else ""
    if tag_twice := duplicated_think(head + body):
        failures.append((R_DUPLICATED_THINK, f"{tag}: the turn holds {tag_twice!r} twice: "
                         f"{(head + body)[:80]!r}"))
        return None
    if not prep.reasoning_passed.get(i) and LEADING_EMPTY_THINK_RE.match(body):
        failures.append(
            (
                R_EMPTY_THINK_SUPERVISED,
                f"{tag}: reply would start with an empty think block the model did not generate",
            )
        )
        return None
    post = probe.post_eot
    if post:
        if not body.endswith(post):
            failures.append((R_EOT_NOT_FOUND, f"{tag}: turn does not end with {post!r}"))
            return None
        body = body[: -len(post)]
    append_eos = False
    if probe.eot_source == "template":
        m2 = TRAILING_MARKER_RE.search(body)
        eot = probe.eot_text.strip()
        if eot and body.endswith(eot):
            cut = len(body) - len(eot)
        elif m2:  # another marker ends this turn (gpt-oss: <|call|> after a tool call)
            cut = m2.start()
        else:
            failures.append((R_EOT_NOT_FOUND, f"{tag}: no end-of-turn marker at {body[-40:]!r}"))
            return None
        content_part = body[:cut]
        reply = body if policy.include_eot else body[:cut]
    else:
        content_part = reply = body
        if policy.include_eot:
            if probe.eos_fallback_id is None:
                failures.append((R_NO_EOS, "no end-of-turn marker and no eos token to supervise"))
                return None
            append_eos = True
            notes.append(f"eot_appended:{probe.eos_fallback_token}({probe.eot_source})")
    missing = [p for p in prep.pieces.get(i, []) if p not in content_part]
    if missing:
        code = R_REPLY_MISSING_CONTENT
        if prep.reasoning_passed.get(i) and missing[0] in _reasoning_of(prep, i):
            code = R_REASONING_NOT_RENDERED
        failures.append((code, f"{tag}: rendered reply lacks {missing[0][:60]!r}"))
        return None
    if not reply:
        failures.append((R_REPLY_MISSING_CONTENT, f"{tag}: empty reply"))
        return None
    return reply, append_eos, notes, prefill


# A reasoning block the generation prompt opens and leaves open (R1 distills, QwQ: "<think>\n").
_OPEN_REASONING_AT_END_RE = re.compile(r"<(?P<tag>think|thinking|thought|reasoning)>\n?\Z")
_OPENER_MAX = 16  # characters: the longest opener it matches, "<reasoning>\n", fits


def _turn_variants(probe: TemplateProbe, prep: _Prepared, i: int) -> list[dict[str, Any]]:
    """`_variants`, thinking-on first for a turn whose reasoning the template never renders: a
    generation prompt that opens a reasoning block lets the row supervise it after that opener."""
    if prep.raw_reasoning.get(i) and not prep.reasoning_passed.get(i, False):
        on = [{k: True} for k in probe.thinking_kwargs]
        return on + [v for v in _variants(probe, False) if v not in on]
    return _variants(probe, prep.reasoning_passed.get(i, False))


def _thinking_on_drops_reasoning(
    prep: _Prepared, i: int, prompt: str, variant: dict[str, Any]
) -> bool:
    """A thinking-on variant tried for unrendered reasoning whose prompt opens no reasoning
    block: the row would pair a thinking-on prompt with a reply lacking the reasoning."""
    return (
        any(v is True for v in variant.values())
        and bool(prep.raw_reasoning.get(i))
        and not prep.reasoning_passed.get(i, False)
        and _OPEN_REASONING_AT_END_RE.search(prompt[-_OPENER_MAX:]) is None
    )


def _open_reasoning_prefill(prompt: str, upto: str) -> tuple[int, str] | None:
    """(where the opener starts in `prompt`, its tag) when the prompt ends by opening a reasoning
    block and the turn, rendered as the final one, matches the prompt up to that opener but
    lacks it (the template strips or never renders reasoning)."""
    offset = max(0, len(prompt) - _OPENER_MAX)  # the opener is at the end: search only there
    m = _OPEN_REASONING_AT_END_RE.search(prompt, offset)
    if m is None or not upto.startswith(prompt[: m.start()]):
        return None
    if upto.startswith(f"<{m.group('tag')}>", m.start()):
        return None
    return m.start(), m.group("tag")


def _reply_after_prefill(
    prep: _Prepared,
    i: int,
    prompt: str,
    upto: str,
    opened: tuple[int, str],
    tag: str,
    failures: list[tuple[str, str]],
) -> tuple[str, str] | None:
    """(body, prefill): what the model writes after the pre-filled opener, in the layout
    `inline_reasoning` gives (the rest of the reasoning, the closing tag, a blank line) and then
    the turn as the template renders it (content, end of turn). None after recording why not."""
    start, think = opened
    prefill = prompt[start:]
    rendered = upto[start:]
    reasoning = prep.raw_reasoning.get(i, "")
    if not reasoning:
        dropped = "reasoning_dropped:policy" in prep.normalizations
        failures.append((R_PREFILL_NEEDS_REASONING, (
            f"{tag}: the generation prompt pre-fills {prefill!r}, which the template's turns "
            "lack, and this turn has no reasoning"
            + (" (supervise_reasoning = false drops it)" if dropped else "")
            + ": what the model writes before closing the block is unknown (give the turn its "
            "reasoning, e.g. regenerate it with the target, or use a template or kwarg that "
            "does not open the block)")))
        return None
    if reasoning[:40] in rendered:  # rendered in some other form: joining it again would guess
        failures.append((R_GENERATION_PROMPT_MISMATCH, (
            f"{tag}: the generation prompt pre-fills {prefill!r} but the turn renders its "
            f"reasoning without it: {rendered[:60]!r}")))
        return None
    lead = "" if prefill.endswith("\n") else "\n"
    return f"{lead}{reasoning}\n</{think}>\n\n{rendered}", prefill


def _reasoning_text(prep: _Prepared, i: int) -> str:
    """The reasoning passed to the template for message i ("" if none)."""
    if not prep.reasoning_passed.get(i):
        return ""
    pieces = prep.pieces.get(i, [])
    m = prep.messages[i]
    for key in ("reasoning_content", "reasoning", "thinking"):
        if isinstance(m.get(key), str) and m[key]:
            return m[key].strip()
    return next((p for p in pieces if p and p in str(m.get("content"))), "")


def _reasoning_of(prep: _Prepared, i: int) -> str:
    m = prep.messages[i]
    return " ".join(
        str(v)
        for k, v in m.items()
        if k in ("reasoning_content", "reasoning", "thinking", "content") and v
    )


# --- tokenization and verification ------------------------------------------------------------


class _Encoded:
    """A row's token ids, and its tokens' character offsets looked up where they are needed:
    a mask needs the offsets at the reply spans' edges only, and the full offsets list costs
    more to build (a tuple per token) than the rest of a row's mask.

    A row is one encoded piece, or two (a per-turn row: prompt and reply); each piece is a
    tokenizers `Encoding` or a list of (start, end) offsets, with its first token and first
    character in the row.
    """

    __slots__ = ("_pieces", "ids")

    def __init__(self, ids: list[int], pieces: list[tuple[Any, int, int, int]]) -> None:
        self.ids = ids
        self._pieces = pieces  # (encoding or offsets list, first token, first char, chars)

    @classmethod
    def join(cls, texts: tuple[str, ...], encodings: list[Any]) -> _Encoded:
        ids: list[int] = []
        pieces = []
        char = 0
        for text, enc in zip(texts, encodings, strict=True):
            if isinstance(enc, tuple):  # (ids, offsets) from a slow tokenizer
                piece_ids, enc = enc
            else:
                piece_ids = enc.ids
            pieces.append((enc, len(ids), char, len(text)))
            ids = ids + piece_ids if ids else piece_ids
            char += len(text)
        return cls(ids, pieces)

    def __len__(self) -> int:
        return len(self.ids)

    def _piece_of_token(self, t: int) -> tuple[Any, int, int, int]:
        pieces = self._pieces
        return pieces[-1] if len(pieces) > 1 and t >= pieces[-1][1] else pieces[0]

    def span(self, t: int) -> tuple[int, int]:
        """Character (start, end) of token t in the row text."""
        enc, first_token, first_char, _ = self._piece_of_token(t)
        a, b = enc[t - first_token] if isinstance(enc, list) else enc.token_to_chars(
            t - first_token)
        return a + first_char, b + first_char

    def first_at_or_after(self, c: int) -> int:
        """Index of the first token starting at character c or later (len when none): what a
        bisection over every token's start gives (starts never decrease)."""
        pieces = self._pieces
        k = len(pieces) - 1 if len(pieces) > 1 and c >= pieces[-1][2] else 0
        enc, first_token, first_char, chars = pieces[k]
        local = c - first_char
        if isinstance(enc, list):
            return first_token + bisect.bisect_left(enc, local, key=_START)
        n = (pieces[k + 1][1] if k + 1 < len(pieces) else len(self.ids)) - first_token
        t = enc.char_to_token(local) if local < chars else n  # a guess, made exact below
        if t is None:  # a character no token covers
            return first_token + bisect.bisect_left(enc.offsets, local, key=_START)
        while t < n and enc.token_to_chars(t)[0] < local:
            t += 1
        while t > 0 and enc.token_to_chars(t - 1)[0] >= local:
            t -= 1
        return first_token + t


def _encode(tokenizer: Any, text: str) -> Any:
    """A tokenizers Encoding (or ids and char offsets from a slow tokenizer) without special
    tokens (the rendered template is authoritative).

    Uses the fast tokenizer's backend directly (same ids, far less per-call overhead).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False)
    out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(out["input_ids"]), [tuple(o) for o in out["offset_mapping"]]


def _decode(tokenizer: Any, ids: list[int]) -> str:
    """Token ids to text with special tokens kept and no clean-up (the backend directly: the
    wrapper's argument conversion costs more than the decode)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _encode_many(tokenizer: Any, texts: list[str]) -> list[Any]:
    """`_encode` of each text, in one batch (less per-call overhead than one call per text)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return [_encode(tokenizer, text) for text in texts]
    return backend.encode_batch(texts, add_special_tokens=False)


def _encode_row(tokenizer: Any, text: str, split_at: int | None) -> _Encoded:
    """Encode a row; a per-turn row encodes prompt and reply separately (see module doc)."""
    pieces = _pieces(text, split_at)
    return _Encoded.join(pieces, [_encode(tokenizer, piece) for piece in pieces])


def _pieces(text: str, split_at: int | None) -> tuple[str, ...]:
    """The texts the tokenizer encodes for a row, in order."""
    return (text,) if split_at is None else (text[:split_at], text[split_at:])


@dataclass
class _RowPlan:
    """A row before tokenization: its text, the reply spans in it and what each must decode to."""

    text: str
    spans: list[tuple[int, int]]
    expected: list[str]
    append_eos: bool
    turn: int
    norms: list[str]
    strategy: str
    split_at: int | None = None  # per-turn rows: prompt and reply are encoded apart here
    prefill: str = ""  # see TokenizedRow.prefill

    def pieces(self) -> tuple[str, ...]:
        return _pieces(self.text, self.split_at)


def _build_row(
    tokenizer: Any,
    plan: _RowPlan,
    probe: TemplateProbe,
    policy: MaskPolicy,
    encoded: _Encoded | None = None,
) -> TokenizedRow:
    """Encode the row text (unless `encoded` is given), mark tokens starting inside spans,
    truncate, verify."""
    text, spans, append_eos = plan.text, plan.spans, plan.append_eos
    if encoded is None:
        encoded = _encode_row(tokenizer, text, plan.split_at)
    ids = encoded.ids
    mask = [0] * len(ids)
    for s, e in spans:
        first = encoded.first_at_or_after(s)
        end = encoded.first_at_or_after(e)
        for boundary, t in ((s, first - 1), (e, end - 1)):
            # the only token that can straddle a boundary is the last one starting before it
            if t >= 0 and (a_b := encoded.span(t))[0] < boundary < a_b[1]:
                a, b = a_b
                raise MaskRefused(
                    R_TOKEN_STRADDLES_BOUNDARY,
                    f"token {t} {text[a:b]!r} straddles the reply boundary at char {boundary}",
                )
        mask[first:end] = [1] * (end - first)
    exp = list(plan.expected)
    if append_eos:
        ids = [*ids, int(probe.eos_fallback_id)]  # type: ignore[arg-type]
        mask.append(1)
        exp[-1] = exp[-1] + str(probe.eos_fallback_token)
    row = TokenizedRow(
        ids, mask, plan.turn, list(plan.norms), plan.strategy, text, list(spans), exp, append_eos,
        False, plan.split_at, prefill=plan.prefill,
    )
    if policy.seq_length is not None and len(ids) > policy.seq_length:
        if policy.truncation == "drop":
            raise MaskRefused(
                R_EXCEEDS_SEQ_LENGTH, f"{len(ids)} tokens > seq_length {policy.seq_length}"
            )
        row.normalizations.append(f"truncated_right:{len(ids)}->{policy.seq_length}")
        row.input_ids = ids[: policy.seq_length]
        row.loss_mask = mask[: policy.seq_length]
        row.truncated = True
    longest = _longest_run(row.loss_mask)
    if longest < policy.min_supervised_tokens:
        raise MaskRefused(
            R_TOO_FEW_SUPERVISED,
            f"longest supervised run is {longest} tokens < {policy.min_supervised_tokens}",
        )
    verify_row(row, tokenizer, encoded)
    return row


_START = operator.itemgetter(0)
_SUPERVISED_RUN = re.compile(rb"\x01+")


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in a 0/1 mask (found in C: the mask as bytes)."""
    return [m.span() for m in _SUPERVISED_RUN.finditer(bytes(mask))]


def _longest_run(mask: list[int]) -> int:
    return max((e - s for s, e in _runs(mask)), default=0)


def verify_row(
    row: TokenizedRow,
    tokenizer: Any,
    encoded: _Encoded | None = None,
) -> None:
    """Re-check a row from its ids: spans decode to the replies, boundaries sit where they should.

    `encoded` is the text's encoding when the caller has just computed it; otherwise the text is
    encoded again. Raises MaskRefused(mask_verification_failed) on any mismatch.
    """

    def fail(msg: str) -> None:
        raise MaskRefused(R_MASK_VERIFICATION_FAILED, msg)

    n = len(row.input_ids)
    try:
        mask_bytes = bytes(row.loss_mask)
    except (TypeError, ValueError):
        mask_bytes = b"\x02"
    if len(row.loss_mask) != n or mask_bytes.translate(None, b"\x00\x01"):
        fail("loss_mask is not a 0/1 list as long as input_ids")
    runs = _runs(row.loss_mask)
    if not runs:
        fail("no supervised tokens")
    if len(row.char_spans) != len(row.expected):
        fail("row metadata is inconsistent")
    if len(runs) != len(row.expected) and not (row.truncated and len(runs) < len(row.expected)):
        fail(f"{len(runs)} supervised spans, expected {len(row.expected)}")
    if encoded is None:
        encoded = _encode_row(tokenizer, row.text, row.split_at)
    ids = encoded.ids
    ref = ids + ([row.input_ids[-1]] if row.eos_appended and len(ids) < n else [])
    if row.eos_appended and not row.truncated and len(ids) + 1 != n:
        fail("row has an appended eos but is not text + eos")
    if ref[:n] != row.input_ids or (not row.truncated and len(ref) != n):
        fail("input_ids are not the tokenization of the rendered text")
    for j, (a, b) in enumerate(runs):
        got = _decode(tokenizer, row.input_ids[a:b])
        want = row.expected[j]
        last_cut = row.truncated and j == len(runs) - 1 and b == n
        if last_cut:
            if not want.startswith(got.rstrip("\ufffd")):
                fail(f"truncated span {j} decodes to {got[:60]!r}, not a prefix of the reply")
        elif got != want:
            fail(f"span {j} decodes to {got[:80]!r} but the reply is {want[:80]!r}")
        if tag_twice := duplicated_think(got):
            raise MaskRefused(R_DUPLICATED_THINK, f"span {j} holds {tag_twice!r} twice: "
                              f"{got[:80]!r}")
        s, e = row.char_spans[j]
        if a == 0:
            fail(f"span {j} starts at the first token: no prompt before the reply")
        if (start := encoded.span(a)[0]) != s:
            fail(f"span {j}: first supervised token starts at char {start}, reply at {s}")
        if encoded.span(a - 1)[1] > s:
            fail(f"span {j}: the last prompt token runs into the reply")
        if b < len(encoded) and not last_cut and encoded.span(b)[0] < e:
            fail(f"span {j}: the first token after the turn starts inside the reply")
        if row.loss_mask[a - 1] != 0 or (b < n and row.loss_mask[b] != 0):
            fail(f"span {j}: boundary tokens are supervised")
    if row.prefill:
        _verify_prefill(row, tokenizer, runs, fail)


def _verify_prefill(
    row: TokenizedRow, tokenizer: Any, runs: list[tuple[int, int]], fail: Callable[[str], None]
) -> None:
    """A reply supervised after a pre-filled reasoning opener: the prompt tokens end with the
    opener (the model saw it), the reply does not open the block again, and it closes it."""
    m = _OPEN_REASONING_AT_END_RE.search(row.prefill)
    if m is None or m.start() != 0:
        fail(f"pre-fill {row.prefill!r} is not a reasoning opener")
        return
    close = f"</{m.group('tag')}>"
    window = len(row.prefill) + 4  # tokens enough to hold the opener's characters
    for j, (a, b) in enumerate(runs):
        if not _decode(tokenizer, row.input_ids[max(0, a - window):a]).endswith(row.prefill):
            fail(f"span {j}: the prompt does not end with the pre-fill {row.prefill!r}")
        got = _decode(tokenizer, row.input_ids[a:b])
        if got.lstrip().startswith(row.prefill.strip()):
            fail(f"span {j} opens the pre-filled block again: {got[:60]!r}")
        cut = row.truncated and j == len(runs) - 1 and b == len(row.input_ids)
        if not cut and got.count(close) != 1:
            fail(f"span {j} does not close the pre-filled block exactly once with {close!r}")


# --- public entry -----------------------------------------------------------------------------


def _classify_render_error(
    tokenizer: Any, prep: _Prepared, kw: dict[str, Any], template: str | None, err: RenderError
) -> MaskRefused:
    """A render error is a role-order rejection if the bare role skeleton fails too."""
    skeleton = [
        {"role": m["role"], "content": f"skeleton text {k}"} for k, m in enumerate(prep.messages)
    ]
    try:
        render(tokenizer, skeleton, chat_template=template, kwargs=kw)
    except RenderLimitExceeded as exc2:
        return MaskRefused(exc2.code, str(exc2))
    except RenderError as exc2:
        return MaskRefused(R_ROLE_ORDER, str(exc2))
    return MaskRefused(R_RENDER_ERROR, str(err))


def tokenize_conversation(
    conv: dict[str, Any],
    tokenizer: Any,
    probe: TemplateProbe,
    policy: MaskPolicy | None = None,
    *,
    chat_template: str | None = None,
) -> list[TokenizedRow]:
    """Rows with verified loss masks for one canonical conversation, or MaskRefused.

    `chat_template` must be the template the probe was made with when it was not the tokenizer's.
    """
    (result,) = tokenize_conversations([conv], tokenizer, probe, policy,
                                       chat_template=chat_template)
    if isinstance(result, MaskRefused):
        raise result
    return result


def tokenize_conversations(
    convs: list[dict[str, Any]],
    tokenizer: Any,
    probe: TemplateProbe,
    policy: MaskPolicy | None = None,
    *,
    chat_template: str | None = None,
    fast: bool = True,
    cross_check: float = 0.0,
) -> list[list[TokenizedRow] | MaskRefused]:
    """`tokenize_conversation` for many conversations: for each, its rows or why it is refused.

    Every conversation is rendered and planned first, then all row texts are encoded in one pass,
    then masked and verified. The same rows as one at a time; the encoding pass is ~a third
    cheaper when it is not interleaved with rendering (a large tokenizer's tables stay in cache).
    """
    policy = policy or MaskPolicy()
    planned: list[_Planned | MaskRefused] = []
    for conv in convs:
        prep = None
        try:
            prep = _prepare(conv, probe, policy)
            planned.append(_plan(prep, tokenizer, probe, policy, chat_template, fast))
        except (MaskRefused, RenderError) as exc:
            planned.append(_refusal(exc, prep, tokenizer, probe, chat_template))
    pieces = [piece for item in planned if isinstance(item, _Planned)
              for plan in item.rows for piece in plan.pieces()]
    encodings = iter(_encode_many(tokenizer, pieces))
    results: list[list[TokenizedRow] | MaskRefused] = []
    for item in planned:
        if isinstance(item, MaskRefused):
            results.append(item)
            continue
        encoded = [_Encoded.join(texts, [next(encodings) for _ in texts])
                   for texts in (plan.pieces() for plan in item.rows)]
        try:
            results.append(_build_planned(item, tokenizer, probe, policy, encoded))
        except (MaskRefused, RenderError) as exc:
            results.append(_refusal(exc, item.prep, tokenizer, probe, chat_template))
    if fast and cross_check > 0 and probe.fast_paths:
        for k, conv in enumerate(convs):
            if zlib.crc32(str(conv.get("id")).encode()) < cross_check * 2**32:
                results[k] = _cross_checked(results[k], conv, tokenizer, probe, policy,
                                            chat_template)
    return results


def _cross_checked(
    result: list[TokenizedRow] | MaskRefused,
    conv: dict[str, Any],
    tokenizer: Any,
    probe: TemplateProbe,
    policy: MaskPolicy,
    template: str | None,
) -> list[TokenizedRow] | MaskRefused:
    """The conversation tokenized again without shortcuts (every turn rendered, HF's tag mask
    compared): rows that differ are quarantined, since one of the two is wrong."""
    (slow,) = tokenize_conversations([conv], tokenizer, probe, policy, chat_template=template,
                                     fast=False)
    if _outcome(slow) != _outcome(result):
        return MaskRefused(R_MASK_VERIFICATION_FAILED, (
            f"cross-check: the shortcut gives {_describe(result)} but rendering every turn "
            f"gives {_describe(slow)}; set [tokenize] strategy = \"render_diff\" for this "
            "template and report it"))
    for row in () if isinstance(result, MaskRefused) else result:
        row.cross_checked = True
    return result


def _describe(result: list[TokenizedRow] | MaskRefused) -> str:
    if isinstance(result, MaskRefused):
        return f"a refusal ({result.code})"
    return f"{len(result)} row(s) of {[len(r.input_ids) for r in result]} tokens, " \
        f"{[sum(r.loss_mask) for r in result]} supervised"


def _refusal(
    exc: MaskRefused | RenderError,
    prep: _Prepared | None,
    tokenizer: Any,
    probe: TemplateProbe,
    template: str | None,
) -> MaskRefused:
    """The refusal to report. A template that rejects the conversation as such (its role order,
    with its own error text) is the reason, whatever step failed first: the full default render
    is the test, made only for refused conversations."""
    if isinstance(exc, RenderLimitExceeded):  # rendering it again would spend the limit again
        return MaskRefused(exc.code, str(exc))
    if isinstance(exc, MaskRefused) and (exc.is_filter or prep is None or exc.code in LIMIT_CODES):
        return exc
    assert prep is not None
    kw = dict(probe.render_kwargs)
    try:
        _render_prefix(tokenizer, prep, len(prep.messages), False, kw, template)
    except RenderLimitExceeded as err:
        return MaskRefused(err.code, str(err))
    except RenderError as err:
        return _classify_render_error(tokenizer, prep, kw, template, err)
    if isinstance(exc, RenderError):
        return MaskRefused(R_RENDER_ERROR, str(exc))
    return exc


@dataclass
class _Planned:
    """A conversation's first-choice rows, and the per-turn rows to fall back on (made only when
    needed: they may need renders of their own) if a single row fails to tokenize exactly."""

    prep: _Prepared
    rows: list[_RowPlan]
    fallback: Callable[[str], list[_RowPlan]] | None = None


def _build_planned(
    item: _Planned,
    tokenizer: Any,
    probe: TemplateProbe,
    policy: MaskPolicy,
    encoded: list[_Encoded],
) -> list[TokenizedRow]:
    try:
        return [_build_row(tokenizer, plan, probe, policy, enc)
                for plan, enc in zip(item.rows, encoded, strict=True)]
    except MaskRefused as exc:
        if item.fallback is None or exc.is_filter or exc.code in LIMIT_CODES:
            raise
        # e.g. a BPE merge across the end-of-turn and the next header: rows that end at the
        # reply have no such boundary, so per-turn rows can still be exact
        return [_build_row(tokenizer, plan, probe, policy)
                for plan in item.fallback(f"{exc.code}: {exc.message}")]


def _plan(
    prep: _Prepared,
    tokenizer: Any,
    probe: TemplateProbe,
    policy: MaskPolicy,
    template: str | None,
    fast: bool = True,
) -> _Planned:
    """Render what the strategy needs and plan the conversation's rows (see module doc).
    `fast`: take the shortcuts the probe found exact (`fast_paths_for`); off, every turn is
    rendered as in the render diff's definition (what the cross-check compares with)."""
    targets = prep.assistant_idx if policy.turns == "all" else prep.assistant_idx[-1:]
    ordinals = {i: k for k, i in enumerate(prep.assistant_idx)}

    strategy = policy.strategy
    if strategy == "auto":
        strategy = STRATEGY_GENERATION if probe.strategy == STRATEGY_GENERATION else "auto"
    if strategy == STRATEGY_GENERATION and not (
        probe.has_generation_tags and probe.generation_mask_usable
    ):
        raise MaskRefused(
            R_GENERATION_TAGS_UNUSABLE, "template has no usable {% generation %} tags"
        )

    if strategy == STRATEGY_GENERATION and fast and probe.fast_paths.get(FAST_GENERATION):
        row = _generation_row(tokenizer, probe, prep, policy, template, targets, ordinals)
        if row is not None:
            return _Planned(prep, [row], lambda _why: _plan(
                prep, tokenizer, probe, policy, template, fast=False).rows)

    cache: dict[str, list[_Turn]] = {}

    def turns_for(base: dict[str, Any]) -> list[_Turn]:
        key = json.dumps(base, sort_keys=True)
        if key not in cache:
            stable = probe.prefix_stable if not base else base == probe.stable_kwargs
            made: list[_Turn | Exception] = []
            following: int | None = None
            for i in reversed(targets):  # the last first: its prompt gives the one before's end
                try:
                    made.append(_render_turn(tokenizer, probe, prep, ordinals[i], i, base, policy,
                                             template, following if fast and stable else None))
                except (MaskRefused, RenderError) as exc:
                    made.append(exc)
                following = i
            made.reverse()
            for turn in made:  # the first turn's refusal, as when rendered in order
                if isinstance(turn, Exception):
                    raise turn
            cache[key] = made  # type: ignore[assignment]
        return cache[key]

    label = (
        STRATEGY_PER_TURN
        if len(targets) > 1 or probe.strategy == STRATEGY_PER_TURN
        else probe.strategy
    )

    def per_turn(why: str) -> list[_RowPlan]:
        plans = []
        for t in turns_for({}):
            text = t.prompt + t.reply
            norms = prep.normalizations + t.notes
            if len(targets) > 1:
                norms = [*norms, "per_turn_rows:" + why[:120]]
            plans.append(_RowPlan(text, [(len(t.prompt), len(text))], [t.reply], t.append_eos,
                                  t.ordinal, norms, label, split_at=len(t.prompt),
                                  prefill=t.prefill))
        return plans

    # Bases worth a single-row attempt: the default when the probe found the template
    # prefix-stable, else its stable kwarg; one-turn rows need no attempt (same row either way)
    if probe.prefix_stable:
        bases: list[dict[str, Any]] = [{}]
    elif probe.stable_kwargs:
        bases = [dict(probe.stable_kwargs)]
    else:
        bases = []
    if strategy == STRATEGY_PER_TURN or (strategy == "auto" and len(targets) == 1):
        bases = []
    single_failure = "" if bases else "the template is not prefix-stable (probe)"
    for base in bases:
        try:
            row_or_why = _single_row(
                tokenizer, probe, prep, turns_for(base), base, policy, template, strategy
            )
        except MaskRefused as exc:
            if exc.code in FILTER_CODES or exc.code in LIMIT_CODES or strategy != "auto":
                raise
            row_or_why = f"{exc.code}: {exc.message}"
        if isinstance(row_or_why, _RowPlan):
            return _Planned(prep, [row_or_why], per_turn if strategy == "auto" else None)
        single_failure = row_or_why
    if strategy in (STRATEGY_RENDER_DIFF, STRATEGY_GENERATION) and len(targets) > 1:
        raise MaskRefused(R_NOT_PREFIX_STABLE, single_failure)
    if strategy == STRATEGY_GENERATION:  # one turn: still cross-check HF's mask
        row_or_why = _single_row(
            tokenizer, probe, prep, turns_for({}), {}, policy, template, strategy
        )
        if isinstance(row_or_why, str):
            raise MaskRefused(R_GENERATION_PROMPT_MISMATCH, row_or_why)
        return _Planned(prep, [row_or_why])
    return _Planned(prep, per_turn(single_failure))


def _generation_row(
    tokenizer: Any,
    probe: TemplateProbe,
    prep: _Prepared,
    policy: MaskPolicy,
    template: str | None,
    targets: list[int],
    ordinals: dict[int, int],
) -> _RowPlan | None:
    """The one-row plan of a {% generation %}-tag template from one render of the conversation.

    Each tag block marks a reply; the text before it must end with the generation prompt (what
    the model sees before it generates), and the reply is checked as every render-diff reply is
    (its end-of-turn marker, the message's content in it, no duplicated think markup). None when
    any of that does not hold: the caller then plans as before (render diff + HF's mask)."""
    if probe.thinking_kwargs or not probe.prefix_stable or not probe.generation_prompt:
        return None
    made = render_generation_spans(tokenizer, prep.messages, chat_template=template,
                                   tools=prep.tools, kwargs=dict(probe.render_kwargs))
    if made is None:
        return None
    full, blocks = made
    if len(blocks) != len(prep.assistant_idx):
        return None
    block_of = dict(zip(prep.assistant_idx, blocks, strict=True))
    turns: list[_Turn] = []
    for i in targets:
        start, _ = block_of[i]
        prompt = full[:start]
        end = _turn_end(full, start, probe)
        if end is None or not prompt.endswith(probe.generation_prompt):
            return None
        if _holds_marker(probe, prep.messages[i]):
            return None
        ok = _check_turn(probe, prep, i, prompt, full[:end], policy, [], {})
        if ok is None or ok[1] or ok[3]:  # an appended eos or a pre-fill: the full path
            return None
        turns.append(_Turn(ordinals[i], i, prompt, ok[0], False, {}, ok[2]))
    spans = _spans_in(full, turns)
    if isinstance(spans, str):
        return None
    norms = list(prep.normalizations)
    for t in turns:
        norms.extend(n for n in t.notes if n not in norms)
    turn_id = -1 if len(turns) > 1 else turns[0].ordinal
    return _RowPlan(full[: spans[-1][1]], spans, [t.reply for t in turns], False, turn_id, norms,
                    STRATEGY_GENERATION)


def _single_row(
    tokenizer: Any,
    probe: TemplateProbe,
    prep: _Prepared,
    turns: list[_Turn],
    base: dict[str, Any],
    policy: MaskPolicy,
    template: str | None,
    strategy: str,
) -> _RowPlan | str:
    """One row holding every target turn, if each prompt+reply is a prefix of the full render.

    The full render is first made with the last turn's generation-prompt kwargs (it is then the
    render that turn's reply came from, already made), else with the base kwargs alone: any text
    that holds every turn's prompt and reply in place is an exact row.
    """
    if any(t.append_eos for t in turns):
        return "turns need an appended eos (no end-of-turn marker): one row per turn instead"
    if any(t.prefill for t in turns):
        return "replies continue a pre-filled reasoning opener the full render lacks: per turn"
    kw = {**probe.render_kwargs, **base}
    tries = [kw]
    if turns[-1].index == len(prep.messages) - 1 and turns[-1].kwargs:
        tries.insert(0, {**kw, **turns[-1].kwargs})
    why = ""
    for full_kw in tries:
        full = _render_prefix(tokenizer, prep, len(prep.messages), False, full_kw, template)
        spans = _spans_in(full, turns)
        if isinstance(spans, str):
            why = spans
            continue
        text = full[: spans[-1][1]]
        norms = list(prep.normalizations)
        if base:
            norms.append("render_kwargs:" + ",".join(f"{k}={v}" for k, v in base.items()))
        for t in turns:
            norms.extend(n for n in t.notes if n not in norms)
        turn_id = -1 if len(turns) > 1 else turns[0].ordinal
        if strategy == STRATEGY_GENERATION:
            _check_generation_mask(tokenizer, probe, prep, full_kw, template, spans, text,
                                   [t.index for t in turns])
        name = STRATEGY_GENERATION if strategy == STRATEGY_GENERATION else STRATEGY_RENDER_DIFF
        return _RowPlan(text, spans, [t.reply for t in turns], False, turn_id, norms, name)
    return why


def _spans_in(full: str, turns: list[_Turn]) -> list[tuple[int, int]] | str:
    """Each turn's reply span in `full`, or why the turns do not sit in it as rendered alone."""
    spans: list[tuple[int, int]] = []
    for t in turns:
        if not full.startswith(t.prompt):
            return f"generation prompt before turn {t.ordinal} is not a prefix of the full render"
        s = len(t.prompt)
        if not full.startswith(t.reply, s):
            return f"reply of turn {t.ordinal} is rendered differently inside the conversation"
        spans.append((s, s + len(t.reply)))
    return spans


def _check_generation_mask(
    tokenizer: Any,
    probe: TemplateProbe,
    prep: _Prepared,
    kw: dict[str, Any],
    template: str | None,
    spans: list[tuple[int, int]],
    text: str,
    indices: list[int],
) -> None:
    """HF's {% generation %} mask must cover the render-diff replies of the supervised turns
    (`indices`: with turns = "last" HF still marks every turn), with or without the end-of-turn
    marker (the policy's `include_eot` decides that, not the tags)."""
    try:
        out = guarded_call(
            prep.messages, prep.tools, tokenizer.apply_chat_template,
            prep.messages,
            tools=prep.tools,
            chat_template=template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **kw,
        )
    except RenderLimitExceeded as exc:
        raise MaskRefused(exc.code, str(exc)) from exc
    except Exception as exc:
        raise MaskRefused(R_GENERATION_TAGS_UNUSABLE, f"HF assistant mask failed: {exc}") from exc
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    got = [tokenizer.decode(ids[a:b], skip_special_tokens=False) for a, b in _runs(mask)]
    if len(got) == len(prep.assistant_idx):
        got = [g for g, i in zip(got, prep.assistant_idx, strict=True) if i in indices]
    want = [text[s:e] for s, e in spans]
    eot = probe.eot_text.strip()

    def bare(reply: str) -> str:
        reply = reply.strip()
        return reply.removesuffix(eot).rstrip() if eot else reply

    if len(got) != len(want) or any(
        w.strip() and g.strip() and g.strip() not in w and bare(g) != bare(w)
        for g, w in zip(got, want, strict=False)
    ):
        raise MaskRefused(
            R_MASK_VERIFICATION_FAILED,
            f"{{% generation %}} mask spans {got!r} disagree with the render diff {want!r}",
        )


# --- the shortcuts, checked ------------------------------------------------------------------

FAST_GENERATION = "generation_one_render"  # a tag template's mask from one render
FAST_TURN_END = "turn_end_from_next_prompt"  # render diff: N+1 renders for N replies


def _sample_conversations(probe: TemplateProbe) -> list[dict[str, Any]]:
    """Canonical conversations the shortcuts must agree on: several turns, a system turn, a
    tool round trip and reasoning where the template renders them."""
    def turn(role: str, text: str, **extra: Any) -> dict[str, Any]:
        return {"role": role, "content": text, **extra}

    convs = [
        [turn("user", "What is the capital of France?"), turn("assistant", "Paris."),
         turn("user", "And of Italy?"), turn("assistant", "Rome, since 1871."),
         turn("user", "Thanks!"), turn("assistant", "You are welcome.")],
        [turn("system", "You are terse."), turn("user", "Two plus two?"),
         turn("assistant", "Four."), turn("user", "Times three?"), turn("assistant", "Twelve.")],
        [turn("user", "Think first: 7 * 6?"), turn("assistant", "42.", reasoning="7 * 6 = 42."),
         turn("user", "And 6 * 9?"), turn("assistant", "54.", reasoning="6 * 9 = 54.")],
    ]
    if probe.tool_call_args is not None and probe.tool_role == "native":
        call = [{"type": "function", "id": "call_1",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
        convs.append([turn("user", "Weather in Paris?"),
                      turn("assistant", "", tool_calls=json.dumps(call)),
                      turn("tool", "18 C, sunny", tool_call_id="call_1", name="get_weather"),
                      turn("assistant", "It is 18 C and sunny in Paris.")])
    return [{"id": f"probe-{k}", "source": "probe", "messages": m,
             "tools": json.dumps([{"type": "function", "function": {
                 "name": "get_weather", "description": "Weather for a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
             if k == 3 else None} for k, m in enumerate(convs)]


def _outcome(result: list[TokenizedRow] | MaskRefused) -> Any:
    if isinstance(result, MaskRefused):
        return result.code
    return [(r.input_ids, r.loss_mask, r.turn, r.normalizations, r.strategy) for r in result]


def fast_paths_for(tokenizer: Any, probe: TemplateProbe, template: str | None
                   ) -> dict[str, Any]:
    """Which shortcuts give exactly the rows of the full render diff on this template, tried on
    the sample conversations with both turn policies and both end-of-turn policies. A shortcut
    that changes any row (or any refusal) there is off for the run."""
    convs = _sample_conversations(probe)
    policies = [MaskPolicy(turns=t, include_eot=e) for t in ("all", "last") for e in (True, False)]
    out: dict[str, Any] = {}
    names = [FAST_TURN_END] + ([FAST_GENERATION] if probe.strategy == STRATEGY_GENERATION
                               else [])
    for name in names:
        trial = dataclasses.replace(probe, fast_paths={name: True})
        try:
            same = all(
                [_outcome(r) for r in tokenize_conversations(convs, tokenizer, trial, policy,
                                                              chat_template=template)]
                == [_outcome(r) for r in tokenize_conversations(
                    convs, tokenizer, probe, policy, chat_template=template, fast=False)]
                for policy in policies)
        except RenderLimitExceeded:
            same = False
        out[name] = same
    return out


__all__ = [
    "FILTER_CODES",
    "QUARANTINE_CODES",
    "MaskPolicy",
    "MaskRefused",
    "TokenizedRow",
    "tokenize_conversation",
    "tokenize_conversations",
    "verify_row",
]
