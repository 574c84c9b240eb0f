"""Rendering a conversation through a chat template, inside transformers' sandboxed Jinja.

Chat templates are untrusted code (DESIGN principle 6), so every render runs in transformers'
`ImmutableSandboxedEnvironment`. Any exception a template raises is turned into `RenderError`
carrying the template's own text, so callers can report it instead of dying.

The stage renders each conversation several times (render-diff), and `apply_chat_template`
re-normalises and deep-copies the messages and rebuilds the special-token map on every call (a
fifth of the stage's time). So `render` runs transformers' compiled template directly with the
same inputs `apply_chat_template` would give it: messages without None values, reasoning aliased as
transformers aliases it, the special tokens as variables; in an overlay of transformers'
environment whose sandbox memoizes its own verdicts (`_CachingSandbox`), and with one clock per
process for templates that print the time. Where those internals are missing (another
transformers version) it uses `apply_chat_template`; tests/test_template_render.py checks that both
give the same text (and the same refusals of hostile templates) on every fixture template.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
import types
from dataclasses import dataclass
from typing import Any

from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

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


class RenderError(Exception):
    """The template raised (or produced no text) while rendering a conversation."""


@dataclass(frozen=True)
class MessageFormat:
    """How canonical messages are spelled for one template (decided by the probe)."""

    reasoning_key: str | None = "reasoning_content"  # field the template reads, None = never
    reasoning_inline: bool = False  # put reasoning into content as <think>..</think> instead
    tool_args: str = "object"  # "object" | "string": how tool-call arguments are passed
    empty_content: str = "none"  # "none" | "empty": content of a tool-call-only assistant turn
    system_mode: str = "native"  # "native" | "merge_into_user"


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    kwargs: dict[str, Any] | None = None,
) -> str:
    """Render `messages` to text; raise RenderError with the template's message on failure."""
    try:
        direct = _direct_renderer(tokenizer, chat_template, tools is not None) if messages else None
        if direct is not None:
            out = direct(messages, tools, add_generation_prompt, kwargs)
        else:
            out = render_with_transformers(tokenizer, messages, chat_template=chat_template,
                                           tools=tools, add_generation_prompt=add_generation_prompt,
                                           kwargs=kwargs)
    except Exception as exc:  # templates raise anything: TemplateError, TypeError, KeyError...
        raise RenderError(f"{type(exc).__name__}: {exc}") from exc
    if isinstance(out, list):  # batched return shape of some transformers versions
        out = out[0] if out else ""
    if not isinstance(out, str):
        raise RenderError(f"template returned {type(out).__name__}, not text")
    return out


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


@functools.lru_cache(maxsize=16)
def _direct_renderer(tokenizer: Any, chat_template: str | None, has_tools: bool) -> Any:
    """A `_CompiledRenderer` for this tokenizer and template, or None where transformers lacks
    the internals this relies on."""
    try:
        from transformers.utils.chat_template_utils import (
            _alias_reasoning_fields,
            _compile_jinja_template,
        )
    except ImportError:
        return None
    template = tokenizer.get_chat_template(chat_template, [{}] if has_tools else None)
    variables = {k: v for k, v in tokenizer.special_tokens_map.items()
                 if isinstance(v, (str, list))}
    compiled = _fast_sandboxed(_compile_jinja_template(template), template)
    return _CompiledRenderer(compiled, variables, _alias_reasoning_fields)


# Templates that print the current time (Hunyuan: to the second) would render a conversation's
# prompt and its full text a second apart, and the render-diff would find the prompt is no prefix.
# Every render of this process reads this one time instead.
RENDER_CLOCK = datetime.datetime.now()


def _strftime_render_clock(spec: str) -> str:
    return RENDER_CLOCK.strftime(spec)


class _CompiledRenderer:
    """Renders with the inputs transformers gives a template: messages without None values,
    reasoning aliased as transformers aliases it, the special tokens as variables.

    What `Template.render` does, less rebuilding the template's globals (a ChainMap flattened on
    every call: a third of a short template's render) each time.
    """

    def __init__(self, compiled: Any, variables: dict[str, Any], alias: Any) -> None:
        self.template = compiled
        self.variables = variables
        self.alias = alias
        self.globals = dict(compiled.globals)
        if "strftime_now" in self.globals:  # one clock for every render: see RENDER_CLOCK
            self.globals["strftime_now"] = _strftime_render_clock

    def __call__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 add_generation_prompt: bool, kwargs: dict[str, Any] | None) -> str:
        chat = self.alias([m if None not in m.values() else
                           {k: v for k, v in m.items() if v is not None} for m in messages])
        template = self.template
        environment = template.environment
        parent = {**self.globals, "messages": chat, "tools": tools, "documents": None,
                  "add_generation_prompt": add_generation_prompt, **self.variables,
                  **(kwargs or {})}
        context = environment.context_class(environment, parent, template.name, template.blocks,
                                            globals=self.globals)
        return environment.concat(template.root_render_func(context))


class _CachingSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox with its attribute verdicts memoized per (type, attribute name).

    The sandbox judges every `message.content`, `content.startswith`, `loop.last` afresh through
    a dozen isinstance checks against abstract classes: most of a render's time on a template
    like Qwen3.6's. For the objects a chat template reads (the plain types of JSON messages, Jinja's
    loop and namespace objects) that verdict depends on the type and the name alone, so it is the
    sandbox's own verdict, computed once; `str.format` is still wrapped, and every other object
    takes the sandbox's own path.
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            try:  # no such attribute on a dict: the sandbox would look the key up
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        if not _memoizable(kind):
            return super().getattr(obj, attribute)
        try:
            value = getattr(obj, attribute)
        except AttributeError:
            return super().getattr(obj, attribute)
        wrapped = self.wrap_str_format(value)
        if wrapped is not None:
            return wrapped
        key = (kind, attribute)
        safe = _VERDICTS.get(key)
        if safe is None:
            safe = _VERDICTS[key] = self.is_safe_attribute(obj, attribute, value)
        return value if safe else self.unsafe_undefined(obj, attribute)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        """A builtin method (`content.split`, `message.get`), a template macro or `namespace()`
        (transformers' checked Namespace class): always safe (none can carry the sandbox's
        `unsafe_callable` mark) and never given the context, so the sandbox's and the context's
        per-call inspection is skipped; the rest as Jinja does."""
        if type(obj) not in _PLAIN_CALLABLES and not _is_namespace_class(obj):
            return super().call(context, obj, *args, **kwargs)
        kwargs.pop("_block_vars", None)
        kwargs.pop("_loop_vars", None)
        try:
            return obj(*args, **kwargs)
        except StopIteration:
            return context.environment.undefined(
                "value was undefined because a callable raised a StopIteration exception"
            )


_PLAIN_CALLABLES = frozenset({types.BuiltinMethodType, Macro})
_DICT_ATTRIBUTES = frozenset(dir(dict))
_VERDICTS: dict[tuple[type, str], bool] = {}
_PLAIN_TYPES = frozenset({str, int, float, bool, type(None), list, dict, tuple})


def _is_namespace_class(obj: Any) -> bool:
    return type(obj) is type and issubclass(obj, Namespace)


@functools.lru_cache(maxsize=64)
def _memoizable(kind: type) -> bool:
    from jinja2.runtime import LoopContext

    return kind in _PLAIN_TYPES or issubclass(kind, (LoopContext, Namespace))


def _fast_sandboxed(compiled: Any, source: str) -> Any:
    """The template compiled again in an overlay of transformers' environment (same extensions,
    filters and globals) whose class is the caching sandbox; transformers' own when its
    environment is not the plain immutable sandbox this was written against."""
    environment = compiled.environment
    if type(environment) is not ImmutableSandboxedEnvironment:
        return compiled
    overlay = environment.overlay()
    overlay.__class__ = _CachingSandbox
    return overlay.from_string(source)


def try_render(
    tokenizer: Any, messages: list[dict[str, Any]], **kw: Any
) -> tuple[str | None, str | None]:
    """(text, None) on success, (None, error text) on failure."""
    try:
        return render(tokenizer, messages, **kw), None
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
