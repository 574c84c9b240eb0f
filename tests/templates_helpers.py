"""Test helpers for the template/mask tests: fixture paths, a cached tokenizer, a tiny converter
from the fixture row formats to canonical conversations, and an independent row checker.

The checker deliberately does not reuse dflash_etl's verification code, so a bug there cannot
hide itself.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
TOKENIZER_DIR = FIXTURES / "qwen36-tokenizer"
TEMPLATES_DIR = FIXTURES / "templates"
DATA_DIR = FIXTURES / "data"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def require_fixtures() -> None:
    """Skip (with the reason) when ../shared/fixtures is not next to the repository."""
    if not TOKENIZER_DIR.is_dir() or not TEMPLATES_DIR.is_dir() or not DATA_DIR.is_dir():
        pytest.skip(f"fixtures not found at {FIXTURES} (expected ../shared/fixtures)")


@functools.lru_cache(maxsize=1)
def qwen_tokenizer() -> Any:
    require_fixtures()
    pytest.importorskip("transformers")
    from dflash_etl.models.tokenizer import load_tokenizer

    return load_tokenizer(str(TOKENIZER_DIR))  # the stage's loader, and its per-process cache


# --- fixture rows → canonical conversations ------------------------------------------------------

_ROLE = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
    "observation": "tool",
    "tool": "tool",
    "function": "tool",
}
_THINK_RE = re.compile(r"^\s*<think>(.*?)</think>\s*", re.S)


def _split_think(text: str) -> tuple[str, str | None]:
    m = _THINK_RE.match(text)
    if not m:
        return text, None
    return text[m.end() :], m.group(1).strip() or None


def _call(name: str, arguments: Any, k: int) -> dict[str, Any]:
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    return {
        "id": f"call_{k}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _tools(value: Any) -> str | None:
    if value in (None, "", []):
        return None
    tools = json.loads(value) if isinstance(value, str) else value
    out = [t if "function" in t else {"type": "function", "function": t} for t in tools]
    return json.dumps(out)


def _message(role: str, content: str = "", **kw: Any) -> dict[str, Any]:
    m = {
        "role": role,
        "content": content,
        "reasoning": None,
        "tool_calls": None,
        "tool_call_id": None,
        "name": None,
    }
    m.update(kw)
    return m


def to_canonical(row: dict[str, Any], row_id: str) -> dict[str, Any] | None:
    """Convert one fixture row (ShareGPT, OpenAI, LLaMA-Factory parts, Alpaca) or None."""
    msgs: list[dict[str, Any]] = []
    k = 0
    if "conversations" in row:
        for turn in row["conversations"]:
            frm, value = turn["from"], turn.get("value") or ""
            if frm == "function_call":
                spec = json.loads(value)
                msgs.append(
                    _message(
                        "assistant",
                        "",
                        tool_calls=json.dumps([_call(spec["name"], spec.get("arguments", {}), k)]),
                    )
                )
                k += 1
                continue
            role = _ROLE[frm]
            if role == "assistant":
                content, reasoning = _split_think(value)
                msgs.append(_message(role, content, reasoning=reasoning))
            else:
                msgs.append(_message(role, value))
    elif "messages" in row:
        for m in row["messages"]:
            role = _ROLE[m["role"]]
            content = m.get("content")
            reasoning = None
            calls: list[dict[str, Any]] = []
            if isinstance(content, list):  # LLaMA-Factory parts
                texts = []
                for part in content:
                    if part["type"] == "text":
                        texts.append(part["value"])
                    elif part["type"] == "reasoning":
                        reasoning = part["value"]
                    elif part["type"] == "tool_call":
                        spec = json.loads(part["value"])
                        calls.append(_call(spec["name"], spec.get("arguments", {}), k))
                        k += 1
                content = "".join(texts)
            for c in m.get("tool_calls") or []:
                calls.append(_call(c["function"]["name"], c["function"].get("arguments", {}), k))
                k += 1
            msgs.append(
                _message(
                    role,
                    content or "",
                    reasoning=reasoning,
                    tool_calls=json.dumps(calls) if calls else None,
                    tool_call_id=m.get("tool_call_id"),
                    name=m.get("name"),
                )
            )
    elif "instruction" in row:
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        msgs = [_message("user", prompt), _message("assistant", row["output"])]
    else:
        return None
    # link tool results to the preceding call ids, as ingest does
    last_ids: list[str] = []
    for m in msgs:
        if m["tool_calls"]:
            last_ids = [c["id"] for c in json.loads(m["tool_calls"])]
        elif m["role"] == "tool" and last_ids and not m["tool_call_id"]:
            m["tool_call_id"] = last_ids.pop(0)
    return {"id": row_id, "messages": msgs, "tools": _tools(row.get("tools"))}


def load_rows(name: str, limit: int | None = None, start: int = 0) -> list[dict[str, Any]]:
    out = []
    with (DATA_DIR / name).open(encoding="utf-8") as fh:
        for n, line in enumerate(fh):
            if n < start or not line.strip():
                continue
            conv = to_canonical(json.loads(line), f"{name}:{n}")
            if conv is not None:
                out.append(conv)
            if limit is not None and len(out) >= limit:
                break
    return out


def representative_conversations() -> list[dict[str, Any]]:
    """Real fixture rows covering system, multi-turn, tools/tool calls, reasoning, edge cases."""
    rows: list[dict[str, Any]] = []
    rows += load_rows("openai_messages.jsonl", 1)  # system, user, assistant
    rows += load_rows("openai_messages_edgecases.jsonl")  # multi-turn, no user, ends on user
    rows += load_rows("sharegpt.jsonl", 1, start=2)  # three rounds
    rows += load_rows("sharegpt_torchtune_chat_tiny.jsonl")  # system + two rounds
    rows += load_rows("sharegpt_axolotl_fixtures.jsonl")  # long turns; an empty gpt turn
    rows += load_rows("tool_calls.jsonl", 1)  # OpenAI tool call, JSON-string arguments
    rows += load_rows("sharegpt_toolcall_glaive.jsonl", 1)  # function_call / observation
    rows += load_rows("agentic_reasoning_tool_use.jsonl", 2)  # reasoning + tools, multi-turn
    rows += load_rows("sharegpt_hermes_fc_examples.jsonl")[0::2]  # <tool_call> XML; <think>
    return rows


def prefill_conversations() -> list[dict[str, Any]]:
    """Real rows whose assistant turn has reasoning and an answer (no tool call, no think markup
    in the text), their tool specs dropped (templates such as the R1 distills render none): three
    single-turn conversations and two of two rounds (one row's turns, then the next row's user
    and reply). The representative set's reasoning rows all carry tools."""
    rows = []
    for r in load_rows("agentic_reasoning_tool_use.jsonl"):
        a = r["messages"][-1]
        markup = any(t in (a[k] or "") for k in ("content", "reasoning")
                     for t in ("<think>", "</think>"))
        if len(r["messages"]) == 3 and not a["tool_calls"] and a["reasoning"] and not markup:
            rows.append({**r, "tools": None})
    chained = [
        {"id": f"{a['id']}+{b['id']}", "tools": None,
         "messages": [dict(m) for m in a["messages"] + b["messages"][1:]]}
        for a, b in ((rows[0], rows[1]), (rows[2], rows[3]))
    ]
    return rows[:3] + chained


# --- independent checks ------------------------------------------------------------------------

_MARKER_END = re.compile(
    r"(<\|[^|<>\s]{1,48}\|>|<｜[^｜<>]{1,48}｜>|</?[A-Za-z_][\w\-▁.:]{0,48}>|"
    r"\[/?[A-Z_]{2,24}\])$"
)
_EMPTY_THINK_START = re.compile(r"^\s*(<think>)?\s*</think>")


def runs(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, v in enumerate([*mask, 0]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i))
            start = None
    return out


def independent_problems(
    conv: dict[str, Any], row: Any, tokenizer: Any, probe: Any, include_eot: bool = True
) -> list[str]:
    """Why a returned row is wrong (empty list: it is right), judged from ids and the input."""
    problems: list[str] = []
    ids, mask = row.input_ids, row.loss_mask

    def dec(x: list[int]) -> str:
        return tokenizer.decode(x, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    spans = runs(mask)
    assistants = [m for m in conv["messages"] if m["role"] == "assistant"]
    users = [m["content"].strip() for m in conv["messages"] if m["role"] in ("user", "tool")]
    sys_texts = [m["content"].strip() for m in conv["messages"] if m["role"] == "system"]
    supervised_turns = [assistants[row.turn]] if row.turn >= 0 else assistants
    if len(spans) != len(supervised_turns):
        problems.append(f"{len(spans)} supervised spans for {len(supervised_turns)} turns")
        return problems
    for (a, b), msg in zip(spans, supervised_turns, strict=True):
        text = dec(ids[a:b])
        if a == 0:
            problems.append("reply starts at token 0")
            continue
        if dec(ids[:a]) + text + dec(ids[b:]) != dec(ids):
            problems.append(f"a token straddles the span boundary of {text[:40]!r}")
        content = (msg["content"] or "").strip()
        if content and content not in text:
            problems.append(f"supervised {text[:60]!r} lacks the content {content[:40]!r}")
        for call in json.loads(msg["tool_calls"] or "[]"):
            if call["function"]["name"] not in text:
                problems.append(f"supervised text lacks tool call {call['function']['name']}")
        for other in users + sys_texts:
            parsed = json.loads(msg["tool_calls"] or "[]")
            arg_values = []
            for c in parsed:
                args = c["function"].get("arguments") or {}
                args = json.loads(args) if isinstance(args, str) else args
                arg_values += [str(v) for v in args.values()]
            calls = json.dumps(parsed, ensure_ascii=False) + " ".join(arg_values)
            own = f"{content} {msg.get('reasoning') or ''} {calls}"
            if len(other) > 12 and other in text and other not in own:
                problems.append(f"supervised text contains a prompt message {other[:40]!r}")
        if not msg.get("reasoning") and _EMPTY_THINK_START.match(text):
            problems.append(f"supervises an empty think block: {text[:40]!r}")
        if (
            msg.get("reasoning")
            and probe.reasoning_placement != "never"
            and msg["reasoning"].strip() not in text
        ):
            problems.append("reasoning rendered by the template but not supervised")
        if include_eot:
            eot = probe.eot_text.strip()
            eot_ok = (
                bool(_MARKER_END.search(text))
                or bool(eot and text.endswith(eot))
                or (row.eos_appended and b == len(ids) and ids[-1] == probe.eos_fallback_id)
            )
            if not eot_ok:
                problems.append(f"supervised text does not end with an end-of-turn: {text[-30:]!r}")
        header = probe.generation_prompt.strip()
        if header and len(header) > 3 and text.rstrip().endswith(header):
            problems.append("supervised text ends with an assistant header")
    return problems
