"""Render limits: a chat template can loop for hours or build gigabytes inside the sandbox (it
stops escapes, not exhaustion), so every render runs against a deadline and a size limit.

The limits (`RenderLimits`) are set per process with `render_limits`. Every loop iteration and
macro call checks the deadline (in any thread; what transformers renders itself gets SIGALRM
instead, on a process's main thread), the operators and methods that multiply sizes (`*`, `**`,
`+`, `%`, `~`, padding, replace, join, format) refuse a result over the size limit before making
it (sandbox.py), and the output is counted as it is produced (compiled.py). A render over a limit
raises `RenderLimitExceeded`.

This module holds what those checks share, below the sandbox and the renderers that read it: the
render errors, the limits, one render's budget (`_Budget`, in force within `_guarded`), the alarm,
and the clock a template that prints the time reads (a `RenderLimits` setting too).
"""

from __future__ import annotations

import _signal
import contextlib
import datetime
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


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


# .budget: the render in progress in this thread, if any; .conversation_deadline: the deadline
# its conversation's renders share; .marks: where its loops are marked (compiled._LoopMarks)
_STATE = threading.local()


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

