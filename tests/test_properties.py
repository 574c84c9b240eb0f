"""Property tests (hypothesis) of the reader + normalizer that ingest runs on every line.

(a) any line ends up either as an output row or in quarantine with a reason, and the counts
    balance; (b) normalizing a canonical conversation again changes nothing; (c) every accepted
    row has a valid role order.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_etl.core import schema as S
from dflash_etl.core.config import FORMATS, SourceConfig
from dflash_etl.formats import RowError, normalize_row
from dflash_etl.formats.roles import letter, role_order_error
from dflash_etl.io.readers import decode_line
from dflash_etl.stages.ingest import normalize_records

REASONS = {v for k, v in vars(S).items() if k.startswith("Q_")}
# deadline=None: the shared CI machines are noisy; the example counts keep the file at a few
# seconds on an idle machine.
FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def letters_of(row: dict[str, Any]) -> str:
    return "".join(letter(m["role"], bool(m["tool_calls"])) for m in row["messages"])


# ------------------------------------------------------------------ strategies: anything

text = st.text(max_size=16)
leaf = (
    st.none() | st.booleans() | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False) | text
)
json_value = st.recursive(
    leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
        "</tool_response>", '{"name": "f", "arguments": {"a": 1}}', "USER: ", "ASSISTANT: ",
        "FUNCTION RESPONSE: ", "<functioncall> ", '{"name": "f", "arguments": \'{"a": 1}\'}',
        "<|endoftext|>", "\n", " "]
tagged_text = st.lists(text | st.sampled_from(TAGS), max_size=6).map("".join)
role = st.sampled_from([
    "system", "developer", "user", "human", "User", "assistant", "gpt", "model", "tool",
    "function_call", "observation", "function", "narrator", "",
]) | leaf
arguments = (
    st.dictionaries(text, leaf, max_size=3)
    | st.dictionaries(text, leaf, max_size=3).map(json.dumps) | text | json_value
)
call = st.fixed_dictionaries(
    {"type": st.just("function"),
     "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", ""]) | leaf,
                                        "arguments": arguments})},
    optional={"id": leaf},
)
part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "reasoning", "tool_call", "image_url", "thinking"]) | leaf},
    optional={"text": tagged_text | leaf, "value": tagged_text | leaf | call},
)
content = tagged_text | st.none() | st.lists(part, max_size=3) | json_value
message = st.fixed_dictionaries(
    {"role": role, "content": content},
    optional={
        "tool_calls": st.lists(call, max_size=2) | st.lists(call, max_size=2).map(json.dumps)
        | json_value,
        "reasoning_content": tagged_text | json_value,
        "tool_call_id": leaf,
        "name": leaf,
        "function_call": call.map(lambda c: c["function"]) | json_value,
    },
)
sharegpt_turn = st.fixed_dictionaries({"from": role, "value": content})
tools = st.none() | st.lists(st.fixed_dictionaries({"name": text}), max_size=2) | json_value
rows = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(message, max_size=5)},
                          optional={"tools": tools, "system": leaf}),
    st.fixed_dictionaries({"conversations": st.lists(sharegpt_turn, max_size=5)},
                          optional={"tools": tools.map(json.dumps), "system": text}),
    st.fixed_dictionaries({"instruction": tagged_text | leaf},
                          optional={"input": text | leaf, "output": tagged_text | leaf,
                                    "system": leaf,
                                    "history": st.lists(st.lists(text, max_size=3), max_size=2)}),
    st.fixed_dictionaries({"question": text | leaf},
                          optional={"response": tagged_text | leaf, "system_prompt": text | leaf}),
    st.fixed_dictionaries({"prompt": text | st.lists(message, max_size=3) | leaf},
                          optional={"completion": tagged_text | leaf, "system": leaf}),
    st.fixed_dictionaries({"chat": tagged_text | leaf}, optional={"system": tagged_text | leaf}),
    st.dictionaries(text, json_value, max_size=4),
)


@st.composite
def lines(draw) -> bytes:
    kind = draw(st.sampled_from(["bytes", "text", "row", "value"]))
    if kind == "bytes":
        raw = draw(st.binary(max_size=120))
    elif kind == "text":
        raw = draw(tagged_text).encode("utf-8", errors="surrogatepass")
    elif kind == "row":
        raw = json.dumps(draw(rows), ensure_ascii=draw(st.booleans())).encode(
            "utf-8", errors="surrogatepass"
        )
    else:
        raw = json.dumps(draw(json_value)).encode()
    if draw(st.booleans()):  # damage it: cut it, add a BOM, a CR, a stray byte
        how = draw(st.sampled_from(["cut", "bom", "cr", "byte"]))
        if how == "cut":
            raw = raw[: draw(st.integers(0, max(len(raw) - 1, 0)))]
        elif how == "bom":
            raw = b"\xef\xbb\xbf" + raw
        elif how == "cr":
            raw = raw + b"\r"
        else:
            at = draw(st.integers(0, len(raw)))
            raw = raw[:at] + bytes([draw(st.integers(0x80, 0xFF))]) + raw[at:]
    return raw


# ------------------------------------------------------------------ (a) + (c)


@FAST
@given(
    batch=st.lists(lines(), min_size=1, max_size=6),
    fmt=st.sampled_from(FORMATS),
    max_bytes=st.sampled_from([40, 1 << 20]),
)
def test_every_line_is_a_row_or_quarantined_with_a_reason(batch, fmt, max_bytes):
    records = [decode_line(raw, k + 1, max_bytes) for k, raw in enumerate(batch)]
    source = SourceConfig(name="s", path="x", format=fmt)
    out, quarantine, stats = normalize_records(records, source, "f.jsonl")

    assert stats.rows_in == len(batch)
    assert stats.rows_in == stats.rows_out + stats.rows_quarantined + stats.filtered_total
    assert stats.rows_out == len(out) and stats.rows_quarantined == len(quarantine)
    assert set(stats.rows_filtered) <= {S.F_BLANK_LINE}
    seen = sorted([r["line"] for r in out] + [q["line"] for q in quarantine]
                  + [r.line for r in records if r.blank])
    assert seen == list(range(1, len(batch) + 1))  # each line exactly once
    for q in quarantine:
        assert q["reason"] in REASONS and q["message"]
        assert q["source"] == "s" and q["file"] == "f.jsonl"
        if q["raw_bytes"] is not None:  # not UTF-8: the bytes are kept exactly
            assert q["raw_bytes"] in batch[q["line"] - 1]
    for row in out:  # (c) every accepted row has a valid role order
        assert role_order_error(letters_of(row)) is None
        assert all(m["content"].strip() or m["tool_calls"] for m in row["messages"])
    # both land in their Arrow schemas, as ingest writes them
    pa.Table.from_pylist(out, schema=S.CONVERSATIONS)
    pa.Table.from_pylist(quarantine, schema=S.QUARANTINE)


FIELDS = [None, {"messages": "conversations"}, {"messages": "messages", "response": "completion"},
          {"prompt": "instruction"}, {"messages": "messages.0"}]


@FAST
@given(row=rows, fmt=st.sampled_from(FORMATS), fields=st.sampled_from(FIELDS))
def test_normalize_row_raises_only_row_errors(row, fmt, fields):
    try:
        out, mapping = normalize_row(row, fmt, fields)
    except RowError as exc:
        assert exc.code in REASONS and exc.message
        return
    assert role_order_error(letters_of(out)) is None
    assert all(isinstance(n, int) and n > 0 for n in mapping.values())
    for m in out["messages"]:
        assert m["role"] in S.ROLES
        for c in json.loads(m["tool_calls"] or "[]"):
            assert isinstance(c["function"]["arguments"], dict)


@FAST
@given(
    seq=st.lists(st.sampled_from(["system", "user", "assistant", "tool", "call"]), max_size=7)
)
def test_any_role_sequence_is_accepted_only_in_a_valid_order(seq):
    messages: list[dict[str, Any]] = []
    for k, kind in enumerate(seq):
        if kind == "call":
            messages.append({"role": "assistant", "content": None,
                             "tool_calls": [{"function": {"name": "f", "arguments": {}}}]})
        else:
            messages.append({"role": kind, "content": f"turn {k}"})
    try:
        out, _ = normalize_row({"messages": messages})
    except RowError as exc:
        assert exc.code in {S.Q_ROLE_ORDER, S.Q_EMPTY_CONVERSATION}
        return
    letters = letters_of(out)
    assert role_order_error(letters) is None
    assert out["needs_response"] == letters.endswith(("U", "T"))


# ------------------------------------------------------------------ (b) normalizing twice

words = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=24
).filter(lambda s: s.strip())
plain_args = st.dictionaries(
    st.text(min_size=1, max_size=6),
    st.integers(-1000, 1000) | st.text(max_size=8) | st.booleans() | st.none()
    | st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
    max_size=3,
)


@st.composite
def reply(draw) -> dict[str, Any]:
    """An assistant turn: text, with reasoning given as a field, inline, or not at all."""
    body = draw(words)
    how = draw(st.sampled_from(["none", "field", "inline", "inline_twice", "empty_think"]))
    if how == "field":
        return {"content": body, "reasoning_content": draw(words)}
    if how == "inline":
        return {"content": f"<think>{draw(words)}</think>\n\n{body}"}
    if how == "inline_twice":
        return {"content": f"<think>{draw(words)}</think><think>{draw(words)}</think>{body}"}
    if how == "empty_think":
        return {"content": f"<think></think>\n\n{body}"}
    return {"content": body}


@st.composite
def conversations(draw) -> list[tuple[str, Any]]:
    """Abstract turns in a valid order: ("system"|"user"|"assistant", text or reply) and
    ("calls", [(name, args, as_string)]) followed by one ("tool", text) per call."""
    turns: list[tuple[str, Any]] = []
    if draw(st.booleans()):
        turns.append(("system", draw(words)))
    for _ in range(draw(st.integers(1, 3))):
        turns.append(("user", draw(words)))
        for _ in range(draw(st.integers(0, 2))):
            made = draw(st.lists(
                st.tuples(st.sampled_from(["f", "get_x"]), plain_args, st.booleans()),
                min_size=1, max_size=2,
            ))
            turns.append(("calls", made))
            turns.extend(("tool", draw(words)) for _ in made)
        if draw(st.integers(0, 4)):  # mostly answered; sometimes a prompt awaiting a reply
            turns.append(("assistant", draw(reply())))
    return turns


def as_openai(turns, tools) -> dict[str, Any]:
    messages = []
    for kind, value in turns:
        if kind == "calls":
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{k}", "type": "function",
                 "function": {"name": n, "arguments": json.dumps(a) if s else a}}
                for k, (n, a, s) in enumerate(value)
            ]})
        elif kind == "assistant":
            messages.append({"role": "assistant", **value})
        else:
            messages.append({"role": kind, "content": value})
    return {"messages": messages, **({"tools": tools} if tools is not None else {})}


def as_sharegpt(turns, tools) -> dict[str, Any]:
    names = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}
    out = []
    for kind, value in turns:
        if kind == "calls":
            out.extend({"from": "function_call",
                        "value": json.dumps({"name": n, "arguments": json.dumps(a) if s else a})}
                       for n, a, s in value)
        elif kind == "assistant":
            out.append({"from": "gpt", "value": value["content"],
                        **({"reasoning_content": value["reasoning_content"]}
                           if "reasoning_content" in value else {})})
        else:
            out.append({"from": names[kind], "value": value})
    return {"conversations": out, **({"tools": json.dumps(tools)} if tools is not None else {})}


tool_specs = st.none() | st.lists(
    st.fixed_dictionaries({"name": st.sampled_from(["f", "get_x"]),
                           "parameters": st.just({"type": "object"})}),
    min_size=1, max_size=2,
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=conversations(), tools=tool_specs, style=st.sampled_from(["openai", "sharegpt"]))
def test_normalizing_twice_changes_nothing(turns, tools, style):
    row = as_openai(turns, tools) if style == "openai" else as_sharegpt(turns, tools)
    first, _ = normalize_row(row)  # generated conversations are valid: this must not raise
    assert role_order_error(letters_of(first)) is None
    again, _ = normalize_row({"messages": first["messages"], "tools": first["tools"]})
    assert again["messages"] == first["messages"]
    assert again["tools"] == first["tools"]
    assert again["id"] == first["id"]
    assert again["needs_response"] == first["needs_response"]
    # assistant turns hold no inline reasoning (user and tool text is data, kept verbatim), and
    # tool-call arguments are objects
    for m in first["messages"]:
        if m["role"] == "assistant":
            assert not m["content"].lstrip().startswith("<think>")
        for c in json.loads(m["tool_calls"] or "[]"):
            assert isinstance(c["function"]["arguments"], dict)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=conversations(), tools=tool_specs)
def test_openai_and_sharegpt_spellings_agree(turns, tools):
    """The same conversation written in either format gets the same messages (ShareGPT has no
    call ids, so those are dropped before comparing) and the same tools."""
    a, _ = normalize_row(as_openai(turns, tools))
    b, _ = normalize_row(as_sharegpt(turns, tools))

    def strip_ids(row):
        out = []
        for m in row["messages"]:
            calls = json.loads(m["tool_calls"]) if m["tool_calls"] else None
            for c in calls or []:
                c.pop("id", None)
            out.append({**m, "tool_calls": calls})
        return out

    assert strip_ids(a) == strip_ids(b)
    assert a["tools"] == b["tools"]


@given(st.text(alphabet="ab<|>é", max_size=40), st.text(alphabet="ab<|>é", max_size=40),
       st.text(alphabet="ab<|>é", max_size=40))
def test_common_prefix_len_is_the_longest_shared_prefix(shared, a_tail, b_tail):
    from dflash_etl.templates.render import common_prefix_len

    a, b = shared + a_tail, shared + b_tail
    expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert common_prefix_len(a, b) == expected == common_prefix_len(b, a)
