"""The direct renderer: a chat template compiled once into the caching sandbox (sandbox.py) and
rendered with the inputs transformers' `apply_chat_template` would give it, without what that
call redoes on every render (a fifth of the tokenize stage's time); and the loop marks that let
one render say where each message's output lies.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

from dflash_etl.templates.limits import _STATE, _budget, _strftime_render_clock
from dflash_etl.templates.sandbox import _fast_sandboxed


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
