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

The sandbox stops escapes, not exhaustion: a template can loop for hours or build gigabytes. Each
render therefore has a time limit and a size limit (`RenderLimits`, set per process with
`render_limits`): every loop iteration and macro call checks the deadline (in any thread; what
transformers renders itself gets SIGALRM instead, on a process's main thread), the operators and
methods that multiply sizes (`*`, `**`, `+`, `%`, `~`, padding, replace, join, format) refuse a
result over the size limit before making it, and the output is counted as it is produced. A
render over a limit raises `RenderLimitExceeded`.
"""

from __future__ import annotations

import _signal
import contextlib
import datetime
import functools
import itertools
import json
import re
import signal
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
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


class RenderLimitExceeded(RenderError):
    """A render ran past its time limit or would produce more than its size limit; `code` is
    the quarantine reason, `limit` says which limit in words."""

    code = "template_render_limit"

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class RenderTimeout(RenderLimitExceeded):
    code = "template_render_timeout"


class RenderTooLarge(RenderLimitExceeded):
    code = "template_output_too_large"


@dataclass(frozen=True)
class RenderLimits:
    """Per-render limits: seconds, and characters = size_factor x the conversation's characters
    (messages and tools) + size_extra. Generous for real templates (milliseconds, about 2x)."""

    timeout_s: float = 10.0
    size_factor: float = 10.0
    size_extra: int = 1_000_000
    # the time a template that prints the current time (strftime_now) reads: fixed, so a rerun
    # renders the same text; "now" is this process's start (reruns then differ)
    clock: str = "2025-01-01T00:00:00"

    def max_chars(self, conversation_chars: int) -> int:
        return int(self.size_factor * conversation_chars) + self.size_extra


_LIMITS = [RenderLimits()]  # this process's limits (a list: set by render_limits)
_MAX_INT_BITS = 1 << 16  # no chat template computes with larger integers (11**(10**8) has 3.5e8)


@contextlib.contextmanager
def render_limits(limits: RenderLimits) -> Iterator[None]:
    """Renders in this block (in this process) use `limits`."""
    saved = _LIMITS[0]
    _LIMITS[0] = limits
    try:
        yield
    finally:
        _LIMITS[0] = saved


class _Budget:
    """One render's deadline and size limit, read by the sandbox's checks in this thread."""

    __slots__ = ("_inputs", "_max_chars", "deadline", "floor", "limits", "timeout_s")

    def __init__(self, limits: RenderLimits, inputs: tuple[Any, ...]) -> None:
        self.limits = limits
        self.timeout_s = limits.timeout_s
        self.deadline = time.monotonic() + limits.timeout_s
        shared = getattr(_STATE, "conversation_deadline", None)
        if shared is not None:  # the renders of one conversation share one budget
            self.deadline = min(self.deadline, shared)
        self.floor = limits.size_extra  # below it no size is over: the conversation is not sized
        self._inputs = inputs
        self._max_chars: int | None = None

    @property
    def max_chars(self) -> int:
        if self._max_chars is None:
            self._max_chars = self.limits.max_chars(_conversation_chars(self._inputs))
        return self._max_chars

    def over(self, size: int) -> bool:
        return size > self.floor and size > self.max_chars

    def timeout(self) -> RenderTimeout:
        return RenderTimeout(f"the template did not finish rendering within {self.timeout_s:g} s "
                             "(render_timeout_s)", f"render_timeout_s = {self.timeout_s:g}")

    def too_large(self, what: str, size: int, unit: str = "characters") -> RenderTooLarge:
        """`what` of `size` `unit` is over the limit (integers: _MAX_INT_BITS bits)."""
        if unit == "bits":
            limit = f"{_MAX_INT_BITS:,} bits"
        else:
            limit = (f"{self.max_chars:,} characters (render_size_factor x the conversation's "
                     "characters + render_size_extra)")
        return RenderTooLarge(f"the template would make {what} of {size:,} {unit}, over the "
                              f"render size limit of {limit}", limit)


_STATE = threading.local()  # .budget: the render in progress in this thread, if any


@contextlib.contextmanager
def conversation_budget() -> Iterator[None]:
    """Every render in the block (one conversation's: the render-diff renders it several times)
    shares one render_timeout_s, so a template that spins costs a conversation the limit once,
    not once per render."""
    outer = getattr(_STATE, "conversation_deadline", None)
    _STATE.conversation_deadline = time.monotonic() + _LIMITS[0].timeout_s
    try:
        yield
    finally:
        _STATE.conversation_deadline = outer


def _budget() -> _Budget | None:
    return getattr(_STATE, "budget", None)


def _tick() -> None:
    """The deadline check every loop iteration and macro call of a guarded template makes."""
    budget = getattr(_STATE, "budget", None)
    if budget is not None and time.monotonic() > budget.deadline:
        raise budget.timeout()


def _conversation_chars(value: Any, depth: int = 0) -> int:
    """Characters of the text in messages / tools (what a template can legitimately print)."""
    if isinstance(value, str):
        return len(value)
    if depth > 8:
        return 0
    if isinstance(value, dict):
        return sum(len(v) if type(v) is str else len(str(k)) + _conversation_chars(v, depth + 1)
                   for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_conversation_chars(v, depth + 1) for v in value)
    return 8 if value is not None else 0


_DISPLACED: list[Any] = [signal.SIG_DFL]  # the SIGALRM handler _on_alarm replaced


def _on_alarm(signum: int, frame: Any) -> None:
    """Installed once per process (installing per render costs a fifth of a render); an alarm
    outside a render goes where it went before."""
    budget = _budget()
    if budget is not None:
        raise budget.timeout()
    displaced = _DISPLACED[0]
    if callable(displaced):
        displaced(signum, frame)
    elif displaced == signal.SIG_DFL:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGALRM)


class _guarded:  # lower case: used as a function, `with _guarded(messages, tools) as budget`
    """One render under this process's limits: the budget the sandbox checks; with `alarm`, on
    the main thread (where no other timer runs), SIGALRM at the deadline too, for a template
    transformers compiled itself (it has none of the checks). A class, not a generator: it runs
    around every render (the direct renders need no alarm: two syscalls each)."""

    __slots__ = ("alarm", "budget", "outer")

    def __init__(self, messages: Any, tools: Any, alarm: bool = False) -> None:
        self.budget = _Budget(_LIMITS[0], (messages, tools))
        self.alarm = alarm

    def __enter__(self) -> _Budget:
        budget = self.budget
        self.outer = getattr(_STATE, "budget", None)
        _STATE.budget = budget
        if self.alarm and threading.current_thread() is threading.main_thread():
            if _signal.getsignal(signal.SIGALRM) is not _on_alarm:
                _DISPLACED[0] = signal.signal(signal.SIGALRM, _on_alarm)
            left = budget.deadline - time.monotonic()
            previous = signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))
            if previous[0]:  # someone else's timer: theirs stands, the loops' checks are ours
                signal.setitimer(signal.ITIMER_REAL, *previous)
                self.alarm = False
        else:
            self.alarm = False
        return budget

    def __exit__(self, *exc: Any) -> None:
        if self.alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
        _STATE.budget = self.outer


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


@dataclass(frozen=True)
class MessageFormat:
    """How canonical messages are spelled for one template (decided by the probe)."""

    reasoning_key: str | None = "reasoning_content"  # field the template reads, None = never
    reasoning_inline: bool = False  # put reasoning into content as <think>..</think> instead
    tool_args: str = "object"  # "object" | "string": how tool-call arguments are passed
    empty_content: str = "none"  # "none" | "empty": content of a tool-call-only assistant turn
    system_mode: str = "native"  # "native" | "merge_into_user"


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
    # transformers' environment, from an empty template: compiling the template itself there
    # would fold its constants (`{{ 11 ** (10 ** 8) }}`, `'x' * 4000000000`) unguarded
    compiled = _fast_sandboxed(_compile_jinja_template(""), template)
    if compiled is None:
        return None
    return _CompiledRenderer(compiled, variables, _alias_reasoning_fields)


# Templates that print the current time (Llama 3.x the date, Hunyuan to the second) would give
# other rows on every rerun, and render a conversation's prompt and its full text a second apart
# (the render-diff would find the prompt is no prefix). Every render reads the limits' clock.
PROCESS_START = datetime.datetime.now()


def render_time(clock: str) -> datetime.datetime:
    """The time a render reads: `clock` (ISO 8601), or the process's start for "now"."""
    return PROCESS_START if clock == "now" else datetime.datetime.fromisoformat(clock)


def render_clock() -> str:
    """The clock setting renders in this process read (see RenderLimits.clock)."""
    return _LIMITS[0].clock


def _strftime_render_clock(spec: str) -> str:
    return render_time(_LIMITS[0].clock).strftime(spec)


class _LoopMarks:
    """What a render's loops marked (`loop_mark`): (loop, kind, item, parts made so far) per
    mark, the parts made and the messages as the template got them (the items are those very
    objects, so an item is a message by identity, whatever list the loop ran over)."""

    __slots__ = ("chat", "events", "most", "overflow", "parts")

    def __init__(self) -> None:
        self.events: list[tuple[int, int, Any, int]] = []
        self.parts: list[str] = []
        self.chat: list[Any] = []
        self.most = 10_000  # marks kept; more (a loop over characters, a spin) gives no spans
        self.overflow = False

    def message_spans(self) -> list[tuple[int, int] | None] | None:
        """Per message, the span of its iteration in the text: from its iteration's start to the
        next one's (or the loop's end). Only from the one loop run whose items are all messages,
        in order, and that made text; None when there is not exactly one such run (a loop not
        over the messages, two that print them, one that reorders them)."""
        runs = None if self.overflow else self._runs()
        if runs is None:
            return None
        index = {id(m): k for k, m in enumerate(self.chat)}
        offsets = [0]
        for part in self.parts:
            offsets.append(offsets[-1] + len(part))
        found = []
        for items, end in runs:
            ks = [index.get(id(item)) for item, _ in items]
            if items and None not in ks and offsets[end] > offsets[items[0][1]]:
                found.append((ks, [at for _, at in items] + [end]))
        if len(found) != 1:
            return None
        ks, bounds = found[0]
        if any(b <= a for a, b in itertools.pairwise(ks)):
            return None
        spans: list[tuple[int, int] | None] = [None] * len(self.chat)
        for n, k in enumerate(ks):
            spans[k] = (offsets[bounds[n]], offsets[bounds[n + 1]])
        return spans

    def _runs(self) -> list[tuple[list[tuple[Any, int]], int]] | None:
        """Each loop run: its items with the parts made before each, and the parts made at its
        end; None when the marks do not nest (never from the generated code)."""
        stack: list[tuple[int, list[tuple[Any, int]]]] = []
        runs = []
        for loop, kind, item, at in self.events:
            if kind == 0:
                stack.append((loop, []))
            elif not stack or stack[-1][0] != loop:
                return None
            elif kind == 1:
                stack[-1][1].append((item, at))
            else:
                runs.append((stack.pop()[1], at))
        return None if stack else runs


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
        if "strftime_now" in self.globals:  # one clock for every render: PROCESS_START
            self.globals["strftime_now"] = _strftime_render_clock

    def __call__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 add_generation_prompt: bool, kwargs: dict[str, Any] | None,
                 generation_spans: list[tuple[int, int]] | None = None,
                 marks: _LoopMarks | None = None) -> str:
        """The text; with `generation_spans`, each {% generation %} block's span is appended
        to it (transformers' tracker reads the parts made so far); with `marks`, the loops'
        iterations are recorded in it (`_LoopMarks`)."""
        chat = self.alias([m if None not in m.values() else
                           {k: v for k, v in m.items() if v is not None} for m in messages])
        template = self.template
        environment = template.environment
        parent = {**self.globals, "messages": chat, "tools": tools, "documents": None,
                  "add_generation_prompt": add_generation_prompt, **self.variables,
                  **(kwargs or {})}
        context = environment.context_class(environment, parent, template.name, template.blocks,
                                            globals=self.globals)
        budget = _budget()
        if generation_spans is not None:
            parts: list[str] = []
            with environment.activate_tracker(parts, generation_spans):
                return self._collect(template.root_render_func(context), parts, budget)
        if marks is not None:
            marks.chat = chat
            marks.most += 16 * len(chat)
            outer = getattr(_STATE, "marks", None)
            _STATE.marks = marks
            try:
                return self._collect(template.root_render_func(context), marks.parts, budget)
            finally:
                _STATE.marks = outer
        if budget is None:
            return environment.concat(template.root_render_func(context))
        return self._collect(template.root_render_func(context), [], budget)

    @staticmethod
    def _collect(made: Any, parts: list[str], budget: Any) -> str:
        """The parts as made, joined; counted as made to stop at the size limit."""
        size, most = 0, budget.floor if budget is not None else 0
        for part in made:
            if budget is not None:
                size += len(part)
                if size > most:
                    most = budget.max_chars
                    if size > most:
                        raise budget.too_large("a rendered text", size)
            parts.append(part)
        return "".join(parts)


class _CachingSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox with its attribute verdicts memoized per (type, attribute name).

    The sandbox judges every `message.content`, `content.startswith`, `loop.last` afresh through
    a dozen isinstance checks against abstract classes: most of a render's time on a template
    like Qwen3.6's. For the objects a chat template reads (the plain types of JSON messages, Jinja's
    loop and namespace objects) that verdict depends on the type and the name alone, so it is the
    sandbox's own verdict, computed once; `str.format` is still wrapped, and every other object
    takes the sandbox's own path.

    It also holds the render's limits (see the module's docstring): its code generator ticks the
    deadline in every loop, and the size checks run on the operators, methods and filters that
    multiply sizes.
    """

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        if budget is not None:
            if operator == "+" and type(left) is str and type(right) is str:  # most binops
                if budget.over(size := len(left) + len(right)):
                    raise budget.too_large("a sequence (+)", size)
            else:
                _check_binop(budget, operator, left, right)
        return self.binop_table[operator](left, right)

    def checked_concat(self, parts: tuple[Any, ...]) -> str:
        """`a ~ b`: the joined text, refused over the size limit before it is made."""
        texts = [p if isinstance(p, str) else str(p) for p in parts]
        budget = _budget()
        if budget is not None:
            size = sum(map(len, texts))
            if budget.over(size):
                raise budget.too_large("a string (~)", size)
        return "".join(texts)

    def render_tick(self) -> None:
        _tick()

    def loop_mark(self, loop: int, kind: int, item: Any = None) -> None:
        """A loop of the template starts (`kind` 0), starts an iteration over `item` (1) or
        ends (2): recorded where a render asked for its loops' marks (`render_message_spans`),
        nothing otherwise. The text is not touched: the mark is the number of parts made."""
        marks = getattr(_STATE, "marks", None)
        if marks is not None:
            if len(marks.events) >= marks.most:  # a loop that spins: no marks, and no memory
                marks.overflow = True
                return
            marks.events.append((loop, kind, item, len(marks.parts)))

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            budget = _budget()
            if budget is not None:  # a nested width ({:{w}}) may be any of the arguments
                nested = ["*"] if _NESTED_SPEC_RE.search(fmt) else []
                specs = [*_FORMAT_SPEC_RE.findall(fmt), *nested]
                _check_widths(budget, specs, args, kwargs)
            return wrapped(*args, **kwargs)

        return checked

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
        kind = type(obj)
        if kind is Macro:
            _tick()  # a recursive macro is the other unbounded loop
        elif kind is types.BuiltinMethodType and type(obj.__self__) is str:
            budget = _budget()
            if budget is not None:
                _check_str_method(budget, obj.__self__, obj.__name__, args)
        if kind not in _PLAIN_CALLABLES and not _is_namespace_class(obj):
            _tick()
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


class _GuardedCodeGenerator(CodeGenerator):
    """Jinja's code generator, plus a deadline check at the top of every loop body and `~`
    through the sandbox's size check; and marks (`loop_mark`) where a loop whose output goes
    straight to the rendered text (not into a macro's, a `set` block's or a filter's buffer)
    starts, starts each iteration (with the item) and ends, for `render_message_spans`."""

    def visit_For(self, node: nodes.For, frame: Any) -> None:
        self._loop_bodies = getattr(self, "_loop_bodies", set())
        self._loop_bodies.add(id(node.body))  # jinja allows no custom node: marked by identity
        self._marked_loops: dict[int, tuple[int, str]] = getattr(self, "_marked_loops", {})
        if (frame.buffer is not None or node.recursive
                or not isinstance(node.target, nodes.Name)):
            super().visit_For(node, frame)
            return
        loop = len(self._marked_loops)
        self._marked_loops[id(node.body)] = (loop, node.target.name)
        self.writeline(f"environment.loop_mark({loop}, 0)")
        super().visit_For(node, frame)
        self.writeline(f"environment.loop_mark({loop}, 2)")

    def blockvisit(self, body: list[nodes.Node], frame: Any) -> None:
        if id(body) in getattr(self, "_loop_bodies", ()):
            self.writeline("environment.render_tick()")
            marked = getattr(self, "_marked_loops", {}).get(id(body))
            if marked is not None:
                self.writeline(f"environment.loop_mark({marked[0]}, 1, "
                               f"{frame.symbols.ref(marked[1])})")
        super().blockvisit(body, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super().visit_Concat(node, frame)
            return
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


_CachingSandbox.code_generator_class = _GuardedCodeGenerator

# printf / str.format conversions whose width or precision makes text of that size
_PRINTF_SPEC_RE = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")
_FORMAT_SPEC_RE = re.compile(r"\{[^{}:]*:[^{}\d]*(\d+)?(?:[,_]?\.(\d+))?[^{}]*\}")
_NESTED_SPEC_RE = re.compile(r":[^{}]*\{")
_SIZED = (str, list, tuple)


def _length(value: Any) -> int:
    return len(value) if isinstance(value, _SIZED) else 0


def _int_bits(value: Any) -> int:
    return value.bit_length() if isinstance(value, int) else 0


def _check_binop(budget: _Budget, operator: str, left: Any, right: Any) -> None:
    """Refuse `*`, `**`, `+`, `%` whose result would be over the limits, before it is made."""
    if operator == "*":
        if isinstance(left, _SIZED) and isinstance(right, int):
            size = len(left) * right
        elif isinstance(right, _SIZED) and isinstance(left, int):
            size = len(right) * left
        elif isinstance(left, int) and isinstance(right, int):
            bits = _int_bits(abs(left)) + _int_bits(abs(right))
            if bits > _MAX_INT_BITS:
                raise budget.too_large("an integer (*)", bits, "bits")
            return
        else:
            return
        if budget.over(size):
            raise budget.too_large("a sequence (*)", size)
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 \
                and abs(left) > 1:
            bits = _int_bits(abs(left)) * right
            if bits > _MAX_INT_BITS:
                raise budget.too_large("an integer (**)", bits, "bits")
    elif operator == "+":
        size = _length(left) + _length(right)
        if budget.over(size):
            raise budget.too_large("a sequence (+)", size)
    elif operator == "%" and isinstance(left, str):
        args = right if isinstance(right, tuple) else (right,)
        _check_widths(budget, _PRINTF_SPEC_RE.findall(left), args, {})


def _check_widths(budget: _Budget, specs: list[Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> None:
    """A format's widths and precisions (and `*` ones taken from the arguments) within the
    limit: each makes text at least that long."""
    numbers = [v for v in (*args, *kwargs.values()) if isinstance(v, int)]
    for spec in specs:
        for part in spec if isinstance(spec, tuple) else (spec,):
            size = max(numbers, default=0) if part == "*" else int(part) if part else 0
            if budget.over(size):
                raise budget.too_large("formatted text (a width)", size)


def _check_str_method(budget: _Budget, text: str, name: str, args: tuple[Any, ...]) -> None:
    """The str methods that can make a much longer string than their inputs."""
    size = 0
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        size = args[0]
    elif name == "expandtabs":
        tab = args[0] if args and isinstance(args[0], int) else 8
        size = len(text) + text.count("\t") * max(tab, 0)
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) \
            and isinstance(args[1], str):
        size = len(text) + (text.count(args[0]) if args[0] else len(text) + 1) * len(args[1])
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        size = sum(_length(v) for v in args[0]) + len(text) * len(args[0])
    if budget.over(size):
        raise budget.too_large(f"a string (str.{name})", size)


def _guard_filters(environment: Any) -> None:
    """The overlay's own filters dict, with the size-multiplying filters checked first."""
    filters = dict(environment.filters)
    for name, check in _FILTER_CHECKS.items():
        if name in filters:
            filters[name] = _checked_filter(filters[name], check)
    environment.filters = filters


def _checked_filter(fn: Any, check: Any) -> Any:
    @functools.wraps(fn)  # keeps jinja_pass_arg (the filter's context/eval-context argument)
    def checked(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is not None:
            values = [a for a in args if not _is_jinja_context(a)]
            check(budget, values, kwargs)
        return fn(*args, **kwargs)

    return checked


def _is_jinja_context(value: Any) -> bool:
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return isinstance(value, (EvalContext, Context)) or hasattr(value, "sandboxed")


def _filter_width(budget: _Budget, values: list[Any], kwargs: dict[str, Any]) -> None:
    text = values[0] if values else ""
    width = kwargs.get("width", values[1] if len(values) > 1 else 0)
    if isinstance(width, int) and isinstance(text, str):
        lines = text.count("\n") + 1
        size = len(text) + width * lines
        if budget.over(size):
            raise budget.too_large("an indented or centred string", size)


def _filter_replace(budget: _Budget, values: list[Any], kwargs: dict[str, Any]) -> None:
    if len(values) >= 3 and all(isinstance(v, str) for v in values[:3]):
        _check_str_method(budget, values[0], "replace", (values[1], values[2]))


def _filter_join(budget: _Budget, values: list[Any], kwargs: dict[str, Any]) -> None:
    if values and isinstance(values[0], (list, tuple)):
        sep = values[1] if len(values) > 1 and isinstance(values[1], str) else ""
        _check_str_method(budget, sep, "join", (values[0],))


def _filter_format(budget: _Budget, values: list[Any], kwargs: dict[str, Any]) -> None:
    if values and isinstance(values[0], str):
        _check_widths(budget, _PRINTF_SPEC_RE.findall(values[0]), tuple(values[1:]), kwargs)


def _filter_tojson(budget: _Budget, values: list[Any], kwargs: dict[str, Any]) -> None:
    """transformers' tojson(x, ensure_ascii, indent, ...): an indent repeats per nesting level."""
    indent = kwargs.get("indent", values[2] if len(values) > 2 else None)
    if isinstance(indent, int) and budget.over(indent):
        raise budget.too_large("JSON (an indent)", indent)


_FILTER_CHECKS = {"center": _filter_width, "indent": _filter_width, "replace": _filter_replace,
                  "join": _filter_join, "format": _filter_format, "tojson": _filter_tojson}


class _NotConstant(Exception):
    pass


def _constant(node: Any, budget: _Budget) -> Any:
    """The value jinja's optimizer would fold `node` to at compile time, computed with the size
    checks; _NotConstant where it would not fold."""
    if isinstance(node, nodes.Const):
        return node.value
    if isinstance(node, nodes.BinExpr) and node.operator in _BINOPS:
        left, right = _constant(node.left, budget), _constant(node.right, budget)
        _check_binop(budget, node.operator, left, right)
        try:
            return _BINOPS[node.operator](left, right)
        except Exception as exc:
            raise _NotConstant from exc
    raise _NotConstant


_BINOPS = {"*": lambda a, b: a * b, "**": lambda a, b: a ** b, "+": lambda a, b: a + b,
           "-": lambda a, b: a - b, "%": lambda a, b: a % b, "//": lambda a, b: a // b,
           "/": lambda a, b: a / b}


@functools.lru_cache(maxsize=16)
def refuse_folded_constants(source: str) -> None:
    """RenderTooLarge for a template whose constants would fold to a huge value: transformers
    compiles a template in its own environment, whose optimizer computes `{{ 11 ** (10 ** 8) }}`
    or `{{ 'x' | center(4000000000) }}` at compile time, even in a branch never taken, where no
    limit can stop it. Called before transformers compiles a template (its own renders)."""
    try:  # transformers' own environment (its {% generation %} tag), parsed, not compiled
        from transformers.utils.chat_template_utils import _compile_jinja_template

        ast = _compile_jinja_template("").environment.parse(source)
    except Exception:  # transformers reports what does not parse
        return
    budget = _Budget(RenderLimits(), ((), None))
    for node in ast.find_all((nodes.BinExpr, nodes.Filter)):
        if isinstance(node, nodes.Filter):
            check = _FILTER_CHECKS.get(node.name)
            if check is None or node.node is None:
                continue
            try:
                values = [_constant(n, budget) for n in (node.node, *node.args)]
                named = {k.key: _constant(k.value, budget) for k in node.kwargs}
            except _NotConstant:
                continue
            check(budget, values, named)
            continue
        try:
            _constant(node, budget)
        except _NotConstant:
            continue


def _fast_sandboxed(compiled: Any, source: str) -> Any:
    """The template compiled again in an overlay of transformers' environment (same extensions,
    filters and globals) whose class is the caching sandbox; None when its environment is not
    the plain immutable sandbox this was written against (the caller falls back to
    transformers' own rendering)."""
    environment = compiled.environment
    if type(environment) is not ImmutableSandboxedEnvironment:
        return None
    overlay = environment.overlay()
    overlay.__class__ = _CachingSandbox
    _guard_filters(overlay)
    return overlay.from_string(source)


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
