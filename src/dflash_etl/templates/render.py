"""Rendering a conversation through a chat template, inside transformers' sandboxed Jinja.

Chat templates are untrusted code (DESIGN principle 6), so every render runs in transformers'
`ImmutableSandboxedEnvironment`. Any exception a template raises is turned into `RenderError`
carrying the template's own text, so callers can report it instead of dying.

The stage renders each conversation several times (render-diff), and `apply_chat_template`
re-normalises and deep-copies the messages and rebuilds the special-token map on every call (a
fifth of the stage's time). So `render` runs transformers' compiled template directly with the
same inputs `apply_chat_template` would give it (compiled.py), in an overlay of transformers'
environment whose sandbox memoizes its own verdicts (sandbox.py), and with one clock per process
for templates that print the time. Where those internals are missing (another transformers
version) it uses `apply_chat_template`; tests/test_template_render.py checks that both give the
same text (and the same refusals of hostile templates) on every fixture template. Every render
runs under the render limits (limits.py).

This module is what callers use: the render functions and the text helpers that read renders.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

from dflash_etl.templates.compiled import _direct_renderer, _LoopMarks
from dflash_etl.templates.limits import (
    RenderError,
    RenderLimitExceeded,
    RenderTooLarge,
    _guarded,
)
from dflash_etl.templates.sandbox import refuse_folded_constants

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# A prompt-side think block the model did not write: "<think>\n\n</think>\n\n" and variants.
EMPTY_THINK_RE = re.compile(r"^\s*<(think|thinking|reasoning)>\s*</\1>\s*$")
# An empty reasoning block at the end of a generation prompt (thinking switched off): prompt.
EMPTY_REASONING_AT_END_RE = re.compile(
    r"(?:<(?P<tag>[\w:]*(?:think|thought|reason)\w*)>\s*</(?P=tag)>"
    r"|<\|START_THINKING\|>\s*<\|END_THINKING\|>"
    r"|<\|channel>thought\s*<channel\|>"
    r"|<\|channel\|>analysis<\|message\|>\s*<\|end\|>"
    r"|</think>)\s*$",  # DeepSeek-V3.1 thinking off: the prompt ends by closing the block
    re.IGNORECASE,
)
# A reply that starts by closing an empty think block (the model would not have generated it
# when the turn has no reasoning).
LEADING_EMPTY_THINK_RE = re.compile(
    r"^\s*(<(think|thinking|reasoning)>)?\s*</(think|thinking|reasoning)>"
)

# Marker-shaped text that ends an assistant turn: <|im_end|>, <|eot_id|>, </s>, <end_of_turn>,
# <｜end▁of▁sentence｜>, [/TOOL_CALLS]-like brackets.
_MARKER = (
    r"<\|[^|<>\s]{1,48}\|>"
    r"|<｜[^｜<>]{1,48}｜>"
    r"|</?[A-Za-z_][\w\-▁.:]{0,48}>"
    r"|<\|?[A-Za-z_][\w\-▁.:]{0,48}\|?>"  # gemma-4 style <turn|>, <|turn>
    r"|\[/?[A-Z_]{2,24}\]"
)
LEADING_MARKER_RE = re.compile(rf"^(\s*)({_MARKER})")
TRAILING_MARKER_RE = re.compile(rf"({_MARKER})$")


@contextlib.contextmanager
def _as_render_errors() -> Iterator[None]:
    """A template's own exception as a RenderError with its message (the limits' pass as they
    are): templates raise anything, TemplateError, TypeError, KeyError..."""
    try:
        yield
    except RenderLimitExceeded:
        raise
    except RecursionError as exc:
        raise RenderError(f"RecursionError: {exc}") from exc
    except MemoryError as exc:
        raise RenderTooLarge("the template ran out of memory", "memory") from exc
    except Exception as exc:
        raise RenderError(f"{type(exc).__name__}: {exc}") from exc


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    kwargs: dict[str, Any] | None = None,
) -> str:
    """Render `messages` to text; raise RenderError with the template's message on failure
    (RenderLimitExceeded past the time or size limit)."""
    with _as_render_errors():
        with _guarded(messages, tools):
            direct = (_direct_renderer(tokenizer, chat_template, tools is not None)
                      if messages else None)
            if direct is not None:
                out = direct(messages, tools, add_generation_prompt, kwargs)
        if direct is None:
            out = guarded_call(messages, tools, render_with_transformers, tokenizer, messages,
                               chat_template=chat_template, tools=tools,
                               add_generation_prompt=add_generation_prompt, kwargs=kwargs)
    if isinstance(out, list):  # batched return shape of some transformers versions
        out = out[0] if out else ""
    if not isinstance(out, str):
        raise RenderError(f"template returned {type(out).__name__}, not text")
    return out


def render_generation_spans(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None,
    tools: list[dict[str, Any]] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[tuple[int, int]]] | None:
    """The conversation rendered once, with the character span of each `{% generation %}` block
    in it (transformers' own tag, recorded as the text is made): what `return_assistant_tokens_mask`
    computes, without its second render and tokenization. None where the direct renderer is not
    available (the caller then renders as before). Errors as `render`."""
    spans: list[tuple[int, int]] = []
    with _as_render_errors(), _guarded(messages, tools):
        direct = (_direct_renderer(tokenizer, chat_template, tools is not None)
                  if messages else None)
        if direct is None or not hasattr(direct.template.environment, "activate_tracker"):
            return None
        out = direct(messages, tools, False, kwargs, spans)
    if not isinstance(out, str):
        raise RenderError(f"template returned {type(out).__name__}, not text")
    return out, spans


def render_message_spans(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None,
    tools: list[dict[str, Any]] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[tuple[int, int] | None] | None] | None:
    """The conversation rendered once (no generation prompt), with the character span of each
    message's iteration of the template's loop over the messages (`_LoopMarks`): where its
    output starts and where the next message's (or the loop's end) starts. The text is the
    plain render's. The spans are None where no single loop makes each message's output in
    order (the caller renders every turn instead); the whole answer is None where the direct
    renderer is not available. Errors as `render`."""
    marks = _LoopMarks()
    with _as_render_errors(), _guarded(messages, tools):
        direct = (_direct_renderer(tokenizer, chat_template, tools is not None)
                  if messages else None)
        if direct is None:
            return None
        out = direct(messages, tools, False, kwargs, marks=marks)
    if not isinstance(out, str):
        raise RenderError(f"template returned {type(out).__name__}, not text")
    return out, marks.message_spans()


def render_with_transformers(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    kwargs: dict[str, Any] | None = None,
) -> Any:
    """`apply_chat_template` to text: the reference `render` must agree with."""
    return tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=chat_template, tokenize=False,
        add_generation_prompt=add_generation_prompt, **(kwargs or {}),
    )


def guarded_call(messages: Any, tools: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` (a transformers render: apply_chat_template) under the render limits;
    its text output, if any, is checked against the size limit. A template with constants that
    would fold to a huge value (`chat_template=`, else the tokenizer's) is refused first."""
    source = kwargs.get("chat_template")
    if source is None and getattr(fn, "__self__", None) is not None:
        source = getattr(fn.__self__, "chat_template", None)
    if isinstance(source, str):
        refuse_folded_constants(source)
    with _guarded(messages, tools, alarm=True) as budget:
        out = fn(*args, **kwargs)
        text = out[0] if isinstance(out, list) and out and isinstance(out[0], str) else out
        if isinstance(text, str) and budget.over(len(text)):
            raise budget.too_large("a rendered text", len(text))
        return out


def try_render(
    tokenizer: Any, messages: list[dict[str, Any]], **kw: Any
) -> tuple[str | None, str | None]:
    """(text, None) on success, (None, error text) on failure; RenderLimitExceeded is raised (a
    template over the limits is not one that merely rejects a conversation)."""
    try:
        return render(tokenizer, messages, **kw), None
    except RenderLimitExceeded:
        raise
    except RenderError as exc:
        return None, str(exc)


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix, by bisecting on C-level slice compares (a loop over
    characters costs more than the render on long conversations)."""
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo] holds; a[:hi+1] != b[:hi+1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def parse_json_list(text: str | None) -> list[Any] | None:
    """Decode a JSON-text list field (tools, tool_calls); None/empty stays None."""
    if text is None or text == "":
        return None
    value = json.loads(text) if isinstance(text, str) else text
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"expected a JSON list, got {type(value).__name__}")
    return value or None


def inline_reasoning(reasoning: str, content: str) -> str:
    """Reasoning written into content the way think-aware templates split it back out."""
    return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{content}"
