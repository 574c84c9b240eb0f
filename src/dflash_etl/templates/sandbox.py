"""The sandbox renders run in, and its guards: transformers' immutable Jinja sandbox, made fast
(its attribute verdicts memoized) and made to keep the render limits (limits.py) while the
template runs, since a sandbox alone stops escapes but not a template that spins or multiplies
text. `refuse_folded_constants` guards what Jinja would compute before any render starts.
"""

from __future__ import annotations

import functools
import re
import types
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from dflash_etl.templates.limits import (
    _MAX_INT_BITS,
    _STATE,
    RenderLimits,
    _Budget,
    _budget,
    _tick,
)


class _CachingSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox with its attribute verdicts memoized per (type, attribute name).

    The sandbox judges every `message.content`, `content.startswith`, `loop.last` afresh through
    a dozen isinstance checks against abstract classes: most of a render's time on a template
    like Qwen3.6's. For the objects a chat template reads (the plain types of JSON messages, Jinja's
    loop and namespace objects) that verdict depends on the type and the name alone, so it is the
    sandbox's own verdict, computed once; `str.format` is still wrapped, and every other object
    takes the sandbox's own path.

    It also holds the render's limits (limits.py): its code generator ticks the deadline in every
    loop, and the size checks run on the operators, methods and filters that multiply sizes.
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

