"""Role-order rules, shared by ingest (per row) and the contract (per column).

Each conversation is spelled as one letter per message: S system, U user, A assistant reply,
C assistant turn with tool calls, T tool result. The rules are then forbidden patterns, which both
Python's `re` and polars' Rust regex can run, so ingest and `check` judge a row identically.
"""

from __future__ import annotations

import re

# (pattern, why) — a conversation is valid when none of these match its letter string.
FORBIDDEN: tuple[tuple[str, str], ...] = (
    (r"^$", "the conversation has no messages"),
    (r"^[ACT]", "it must start with a system or user turn"),
    (r"^S$", "it has a system turn and nothing else"),
    (r".S", "a system turn may only come first"),
    (r"[SAC][AC]", "an assistant turn must follow a user or tool turn (no user query before it?)"),
    (r"[SUA]T", "a tool turn must follow an assistant turn with tool calls"),
    (r"CU", "a user turn follows a tool call that has no tool result"),
)

ROLE_ORDER_PATTERN = "|".join(f"(?:{p})" for p, _ in FORBIDDEN)
_COMPILED = [(re.compile(p), why) for p, why in FORBIDDEN]


def letter(role: str, has_tool_calls: bool) -> str:
    if role == "assistant":
        return "C" if has_tool_calls else "A"
    return {"system": "S", "user": "U", "tool": "T"}.get(role, "?")


def role_order_error(letters: str) -> str | None:
    """Why the role order is invalid, or None when it is valid."""
    if "?" in letters:
        return "it has a role outside system/user/assistant/tool"
    for pattern, why in _COMPILED:
        match = pattern.search(letters)
        if match:
            return f"{why} (roles: {letters}, at message {max(match.end() - 1, 0)})"
    return None


def needs_response(letters: str) -> bool:
    """A conversation ending on a user or tool turn waits for an assistant reply."""
    return letters.endswith(("U", "T"))
