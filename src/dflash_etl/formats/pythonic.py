"""Tool calls written as a Python-style list in the reply text, as ToolACE (and the BFCL
prompt it follows) spells them: `[get_weather(city="Paris", days=3), other(x=[1, 2])]`.

Parsed, never evaluated: the argument list goes through `ast.parse` and each value through
`ast.literal_eval`, with bounds on size and count. Function names may hold spaces and
parentheses (`User Feed (Video Posts) V2(user_id="1")`): the argument list is the first `(`
after which the text parses as keyword arguments up to a `)` that ends the call.
"""

from __future__ import annotations

import ast
import re
from typing import Any

MAX_TEXT = 64 * 1024  # a longer reply is not a call list we parse
MAX_CALLS = 64
MAX_ATTEMPTS = 256  # candidate (name, argument list) splits tried per reply

_LOOKS_LIKE = re.compile(r"^\[\s*[^\[\]\s(][^(]*\(.*\)\s*\]$", re.DOTALL)
_ARGS_START = re.compile(r"\(\s*(?:\)|[A-Za-z_][A-Za-z0-9_]*\s*=)")
_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicError(ValueError):
    """The text looks like a call list but is not one; the message says where it breaks."""


def looks_like_calls(text: str) -> bool:
    """`[name(...), ...]` as the whole reply (cheap test before parsing)."""
    stripped = text.strip()
    return len(stripped) <= MAX_TEXT and bool(_LOOKS_LIKE.match(stripped))


class _JsonNames(ast.NodeTransformer):
    """`true`, `false`, `null` (JSON spellings, which occur in such data) as constants."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _JSON_NAMES:
            return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)
        return node


def _value(node: ast.expr, name: str, key: str) -> Any:
    node = _JsonNames().visit(node)
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError) as exc:
        raise PythonicError(f"argument {key!r} of {name!r} is not a literal ({exc})") from None
    return _plain(value, name, key)


def _plain(value: Any, name: str, key: str) -> Any:
    """A literal as JSON data: tuples become lists; sets, bytes, complex are refused."""
    if isinstance(value, tuple | list):
        return [_plain(v, name, key) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise PythonicError(f"argument {key!r} of {name!r} has a non-string dict key")
        return {k: _plain(v, name, key) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise PythonicError(f"argument {key!r} of {name!r} is a {type(value).__name__}, not JSON")


def _arguments(text: str, name: str) -> dict[str, Any] | None:
    """`(k=v, ...)` as a dict, or None when `text` is not one keyword argument list."""
    try:
        tree = ast.parse("f" + text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    call = tree.body
    if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
        return None
    return {k.arg: _value(k.value, name, k.arg) for k in call.keywords if k.arg is not None}


def parse_calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    """`[name(k=v, ...), ...]` -> [(name, arguments)]; PythonicError when it is not one."""
    body = text.strip()
    if len(body) > MAX_TEXT:
        raise PythonicError(f"the call list is {len(body)} characters (limit {MAX_TEXT})")
    if not (body.startswith("[") and body.endswith("]")):
        raise PythonicError("a call list starts with '[' and ends with ']'")
    calls: list[tuple[str, dict[str, Any]]] = []
    pos, end, attempts = 1, len(body) - 1, 0
    while pos < end:
        found = None
        for opening in _ARGS_START.finditer(body, pos, end):
            name = body[pos:opening.start()].strip()
            if not name or any(ch in name for ch in "=\"'"):
                continue
            close = opening.start()
            while found is None and (close := body.find(")", close + 1, end)) != -1:
                after = body[close + 1:end + 1].lstrip()
                if not after.startswith((",", "]")):
                    continue
                attempts += 1
                if attempts > MAX_ATTEMPTS:
                    raise PythonicError(f"no parse after {MAX_ATTEMPTS} tries")
                args = _arguments(body[opening.start():close + 1], name)
                if args is not None:
                    found = (name, args, close + 1)
            if found is not None:
                break
        if found is None:
            raise PythonicError(f"cannot parse a call at {body[pos:pos + 60].strip()!r}")
        name, args, pos = found
        calls.append((name, args))
        if len(calls) > MAX_CALLS:
            raise PythonicError(f"more than {MAX_CALLS} calls")
        rest = body[pos:end + 1].lstrip()
        if rest.startswith(","):
            pos = end + 1 - len(rest) + 1
        elif rest == "]":
            break
        else:
            raise PythonicError(f"unexpected text after a call: {rest[:60]!r}")
    if not calls:
        raise PythonicError("the call list is empty")
    return calls
