"""Source adapters on real rows (../shared/fixtures/data) and on small hand-written rows.

Each fixture file is read by the same reader and normalizer that ingest uses; the accepted /
quarantined counts and reasons were computed once, checked by reading the rows, and pinned here.
"""

from __future__ import annotations

import json
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from dflash_etl.core.config import SourceConfig
from dflash_etl.formats import RowError, detect_format, normalize_row
from dflash_etl.formats.roles import letter, role_order_error
from dflash_etl.io import readers
from dflash_etl.stages.ingest import normalize_records

# ------------------------------------------------------------------ helpers


@cache
def _ingest(path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Any]:
    source = SourceConfig(name=Path(path).stem, path=path)
    records = readers.read_unit(readers.Unit(path), 16 * 1024 * 1024)
    return normalize_records(records, source, path)


def ingest(data: Path, name: str):
    return _ingest(str(data / name))


def raw_rows(data: Path, name: str) -> list[dict[str, Any]]:
    with open(data / name, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def by_line(rows: list[dict[str, Any]], line: int) -> dict[str, Any]:
    (row,) = [r for r in rows if r["line"] == line]
    return row


def roles(row: dict[str, Any]) -> list[str]:
    return [m["role"] for m in row["messages"]]


def calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    return json.loads(message["tool_calls"]) if message["tool_calls"] else []


def norm(row: Any, fmt: str = "auto", fields: dict[str, str] | None = None) -> dict[str, Any]:
    return normalize_row(row, fmt, fields)[0]


def error_of(row: Any, fmt: str = "auto", fields: dict[str, str] | None = None) -> RowError:
    with pytest.raises(RowError) as info:
        normalize_row(row, fmt, fields)
    return info.value


def chat(*turns: tuple[str, str], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


# ------------------------------------------------------------------ per fixture file: counts

# file: (rows read, accepted, {quarantine reason: n}, {format: n}, rows needing a response)
EXPECTED: dict[str, tuple[int, int, dict[str, int], dict[str, int], int]] = {
    "sharegpt.jsonl": (500, 500, {}, {"sharegpt": 500}, 0),
    "sharegpt_toolcall_glaive.jsonl": (300, 300, {}, {"sharegpt": 300}, 0),
    "sharegpt_axolotl_fixtures.jsonl": (2, 1, {"empty_content": 1}, {"sharegpt": 1}, 0),
    "sharegpt_torchtune_chat_tiny.jsonl": (1, 1, {}, {"sharegpt": 1}, 0),
    "sharegpt_hermes_fc_examples.jsonl": (3, 3, {}, {"sharegpt": 3}, 0),
    "alpaca.jsonl": (999, 999, {}, {"alpaca": 999}, 0),
    "alpaca_torchtune_tiny.jsonl": (100, 100, {}, {"alpaca": 100}, 0),
    "openai_messages.jsonl": (449, 449, {}, {"openai": 449}, 0),
    "openai_messages_edgecases.jsonl": (5, 4, {"role_order": 1}, {"openai": 4}, 0),
    "tool_calls.jsonl": (86, 86, {}, {"openai": 86}, 0),
    "tool_calls_developer_prompt_only.jsonl": (10, 10, {}, {"openai": 10}, 10),
    "agentic_reasoning_tool_use.jsonl": (50, 50, {}, {"parts": 50}, 0),
    "glaive_v2_style.jsonl": (3, 3, {}, {"glaive": 3}, 0),
}


def test_every_fixture_file_is_pinned(fixture_data):
    assert sorted(p.name for p in fixture_data.glob("*.jsonl")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_counts(fixture_data, name):
    rows_in, accepted, reasons, formats, needs_response = EXPECTED[name]
    rows, quarantine, stats = ingest(fixture_data, name)
    assert stats.rows_in == rows_in
    assert stats.rows_out == len(rows) == accepted
    assert dict(stats.quarantine_reasons) == reasons
    assert Counter(q["reason"] for q in quarantine) == Counter(reasons)
    assert not stats.rows_filtered  # no blank lines in these files
    assert stats.rows_in == stats.rows_out + stats.rows_quarantined
    assert dict(Counter(r["format"] for r in rows)) == formats
    assert sum(r["needs_response"] for r in rows) == needs_response
    for row in rows:  # every accepted row keeps a valid role order and its origin
        letters = "".join(letter(m["role"], bool(m["tool_calls"])) for m in row["messages"])
        assert role_order_error(letters) is None, (name, row["line"], letters)
        assert row["file"].endswith(name) and row["line"] >= 1
    for q in quarantine:  # the quarantined original is kept verbatim
        assert json.loads(q["raw"]) == raw_rows(fixture_data, name)[q["line"] - 1]
        assert q["message"]


@pytest.mark.parametrize(
    "name", ["sharegpt.jsonl", "sharegpt_toolcall_glaive.jsonl", "alpaca.jsonl", "tool_calls.jsonl"]
)
def test_ids_collide_exactly_for_duplicate_source_rows(fixture_data, name):
    """The content hash neither merges distinct rows nor splits identical ones."""
    rows, _, _ = ingest(fixture_data, name)
    distinct_raw = {json.dumps(r, sort_keys=True) for r in raw_rows(fixture_data, name)}
    assert len({r["id"] for r in rows}) == len(distinct_raw)


# ------------------------------------------------------------------ per format: field values


def test_sharegpt_roles_are_mapped_and_counted(fixture_data):
    rows, _, stats = ingest(fixture_data, "sharegpt.jsonl")
    first = by_line(rows, 1)
    assert roles(first) == ["user", "assistant", "user", "assistant"]
    assert first["messages"][0]["content"] == "Who are you?"
    assert first["messages"][3]["content"] == "You too!"
    assert first["tools"] is None and first["tool_arguments"] is None
    assert dict(stats.extra["role_mapping"]) == {"human->user": 1000, "gpt->assistant": 1000}


def test_sharegpt_tools_function_call_and_observation(fixture_data):
    rows, _, stats = ingest(fixture_data, "sharegpt_toolcall_glaive.jsonl")
    first = by_line(rows, 1)
    assert roles(first) == [
        "user", "assistant", "user", "assistant", "tool", "assistant", "user", "assistant"
    ]
    call_turn = first["messages"][3]
    assert call_turn["content"] == ""
    assert calls(call_turn) == [{
        "type": "function",
        "function": {
            "name": "search_recipes",
            "arguments": {"ingredients": ["chicken", "bell peppers", "rice"]},
        },
    }]
    assert first["messages"][4]["content"].startswith('{"recipes": [')
    assert first["tool_arguments"] == "object"
    # tools was a JSON string of bare specs: now OpenAI specs
    tools = json.loads(first["tools"])
    assert [t["type"] for t in tools] == ["function"]
    assert tools[0]["function"]["name"] == "search_recipes"
    assert tools[0]["function"]["parameters"]["required"] == ["ingredients"]
    assert dict(stats.extra["role_mapping"]) == {
        "human->user": 746, "gpt->assistant": 746,
        "function_call->assistant": 211, "observation->tool": 211,
    }
    assert sum(1 for r in rows if r["tools"] is None) == 109  # tools == "[]" in the source
    assert sum(1 for r in rows for m in r["messages"] if m["tool_calls"]) == 211


def test_axolotl_empty_gpt_turn_is_quarantined(fixture_data):
    rows, quarantine, _ = ingest(fixture_data, "sharegpt_axolotl_fixtures.jsonl")
    assert [r["line"] for r in rows] == [1]
    assert len(rows[0]["messages"]) == 12
    (q,) = quarantine
    assert (q["line"], q["reason"]) == (2, "empty_content")
    assert "message 1 (assistant) has empty content" in q["message"]


def test_torchtune_system_turn(fixture_data):
    rows, _, _ = ingest(fixture_data, "sharegpt_torchtune_chat_tiny.jsonl")
    (row,) = rows
    assert roles(row) == ["system", "user", "assistant", "user", "assistant"]
    assert row["messages"][0]["content"] == "You are an AI assistant."
    assert row["messages"][2]["content"] == "The meaning of life is 42."


def test_hermes_tool_call_xml_and_think(fixture_data):
    rows, _, _ = ingest(fixture_data, "sharegpt_hermes_fc_examples.jsonl")
    one, two, three = (by_line(rows, k) for k in (1, 2, 3))
    assert roles(one) == ["system", "user", "assistant", "tool", "assistant"]
    assert one["messages"][2]["content"] == ""
    assert calls(one["messages"][2]) == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Beijing"}}}
    ]
    assert one["messages"][3]["content"] == '{"temp": 25, "desc": "sunny"}'  # <tool_response> off
    assert one["tool_arguments"] == "object"
    # two <tool_call> blocks in one turn, answered by two tool turns
    assert roles(two) == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert [c["function"]["name"] for c in calls(two["messages"][2])] == ["get_weather", "get_time"]
    assert [m["content"] for m in two["messages"][3:5]] == ['{"temp": 18}', '{"time": "14:00"}']
    # <think> before a <tool_call>: reasoning and the call, no text left over
    turn = three["messages"][2]
    assert turn["reasoning"] == (
        "The user wants word frequency. I'll call word_frequency with the given text."
    )
    assert turn["content"] == ""
    assert calls(turn)[0]["function"] == {
        "name": "word_frequency", "arguments": {"text": "the cat sat on the mat"}
    }
    assert json.loads(three["tools"])[0]["function"]["name"] == "word_frequency"
    assert all("<think>" not in m["content"] for r in rows for m in r["messages"][1:])


def test_alpaca_instruction_input_output(fixture_data):
    rows, _, _ = ingest(fixture_data, "alpaca.jsonl")
    source = raw_rows(fixture_data, "alpaca.jsonl")
    first, sixth = by_line(rows, 1), by_line(rows, 6)
    assert roles(first) == ["user", "assistant"]
    assert first["messages"][0]["content"] == "Describe a process of making crepes."
    assert first["messages"][1]["content"] == source[0]["output"]
    assert sixth["messages"][0]["content"] == (
        "Given the parameters of a triangle, find out its perimeter.\n\n"
        "Side 1 = 4\nSide 2 = 6\nSide 3 = 8"
    )


def test_alpaca_with_text_ignores_the_prerendered_text(fixture_data):
    rows, _, _ = ingest(fixture_data, "alpaca_torchtune_tiny.jsonl")
    row = by_line(rows, 6)
    assert [(m["role"], m["content"]) for m in row["messages"]] == [
        ("user", "Identify the odd one out.\n\nTwitter, Instagram, Telegram"),
        ("assistant", "Telegram"),
    ]
    assert not any("### Instruction" in m["content"] for r in rows for m in r["messages"])


def test_openai_messages(fixture_data):
    rows, _, stats = ingest(fixture_data, "openai_messages.jsonl")
    first = by_line(rows, 1)
    assert roles(first) == ["system", "user", "assistant"]
    assert first["messages"][0]["content"] == "Reply user's question as accurately as possible."
    assert first["messages"][2]["content"].startswith(" Natalia sold 48/2")  # kept verbatim
    assert not stats.extra["role_mapping"]


def test_openai_edge_cases(fixture_data):
    rows, quarantine, _ = ingest(fixture_data, "openai_messages_edgecases.jsonl")
    assert [r["line"] for r in rows] == [1, 2, 3, 5]
    (q,) = quarantine  # system + assistant, no user
    assert (q["line"], q["reason"]) == (4, "role_order")
    assert "roles: SA" in q["message"] and "no user query" in q["message"]
    assert roles(by_line(rows, 3)) == ["user", "assistant"]  # no system: fine
    assert len(by_line(rows, 2)["messages"]) == 9
    assert len(by_line(rows, 5)["messages"][2]["content"]) == 26000  # a long reply, kept whole


def test_openai_tool_calls_without_content_key(fixture_data):
    rows, _, _ = ingest(fixture_data, "tool_calls.jsonl")
    first = by_line(rows, 1)
    assert roles(first) == ["system", "user", "assistant"]
    turn = first["messages"][2]
    assert turn["content"] == ""
    assert calls(turn) == [{
        "id": "call_1",
        "type": "function",
        "function": {
            "name": "get_last_nday_stock_price",
            "arguments": {"symbol": "BAC", "period": "1mo"},  # was a JSON string
        },
    }]
    assert first["tool_arguments"] == "json_string"
    assert first["needs_response"] is False  # ends on the call itself: a tool-call target
    assert Counter(r["tool_arguments"] for r in rows) == {"json_string": 36, None: 50}
    assert all(len(json.loads(r["tools"])) == 2 for r in rows)
    every_call = [c for r in rows for m in r["messages"] for c in calls(m)]
    assert len(every_call) == 36
    assert all(isinstance(c["function"]["arguments"], dict) for c in every_call)


def test_developer_prompt_only_rows_are_flagged_never_padded(fixture_data):
    rows, _, stats = ingest(fixture_data, "tool_calls_developer_prompt_only.jsonl")
    assert dict(stats.extra["role_mapping"]) == {"developer->system": 10}
    for row in rows:
        assert roles(row) == ["system", "user"]  # no dummy assistant reply
        assert row["needs_response"] is True
        assert json.loads(row["tools"])[0]["function"]["name"]
    first = by_line(rows, 1)
    assert first["messages"][0]["content"].startswith("# Retail catalog agent policy")
    # the reference answer is a grading key, not a reply
    assert "JKT-URB-009" not in json.dumps(first["messages"])


def test_llamafactory_parts(fixture_data):
    rows, _, _ = ingest(fixture_data, "agentic_reasoning_tool_use.jsonl")
    second = by_line(rows, 2)
    assert roles(second) == [
        "system", "user", "assistant", "tool", "assistant", "user", "assistant", "tool", "assistant"
    ]
    assert second["messages"][1]["content"] == 'Can you tell me about the movie "Inception"?'
    turn = second["messages"][2]
    assert turn["reasoning"].startswith("Alright, the user wants information about the movie")
    assert turn["content"] == ""
    assert calls(turn) == [
        {"type": "function", "function": {"name": "get_movie_details",
                                          "arguments": {"title": "Inception"}}}
    ]
    assert json.loads(second["messages"][3]["content"])[0]["director"] == "Christopher Nolan"
    assert second["messages"][4]["content"].startswith("Here are the key details")
    assert second["messages"][4]["reasoning"].startswith("Okay, the user is asking about a movie")
    third = by_line(rows, 3)
    parallel = next(calls(m) for m in third["messages"] if len(calls(m)) == 3)
    assert [c["function"]["arguments"] for c in parallel] == [
        {"radius": 2.5}, {"radius": 4}, {"radius": 5.5}
    ]
    # every reasoning part and every tool_call part of the source arrived
    assert sum(1 for r in rows for m in r["messages"] if m["reasoning"]) == 112
    assert sum(len(calls(m)) for r in rows for m in r["messages"]) == 68
    assert [r["line"] for r in rows if r["tools"] is None] == [37, 49]  # tools == "[]"


def test_glaive_v2(fixture_data):
    rows, _, stats = ingest(fixture_data, "glaive_v2_style.jsonl")
    first, second, third = (by_line(rows, k) for k in (1, 2, 3))
    assert roles(first) == ["system", "user", "assistant", "tool", "assistant"]
    assert first["messages"][0]["content"].startswith("You are a helpful assistant with access")
    assert first["messages"][1]["content"] == "What's the price of Apple stock?"
    assert first["messages"][2]["content"] == ""
    assert calls(first["messages"][2]) == [
        {"type": "function", "function": {"name": "get_stock_price",
                                          "arguments": {"symbol": "AAPL"}}}
    ]
    assert first["tool_arguments"] == "json_string"  # '{"symbol": "AAPL"}' in single quotes
    assert first["messages"][3]["content"] == '{"price": 150.25, "currency": "USD"}'
    assert first["messages"][4]["content"] == "Apple (AAPL) is currently trading at $150.25 USD."
    assert json.loads(first["tools"])[0]["function"]["name"] == "get_stock_price"
    assert roles(second) == ["system", "user", "assistant"]
    assert second["messages"][2]["content"] == (
        "Sure!\nWaves roll in with whispered grace,\nThe tide returns to its embrace."
    )
    assert second["tool_arguments"] is None
    assert roles(third) == [
        "system", "user", "assistant", "tool", "assistant", "user", "assistant", "tool", "assistant"
    ]
    assert calls(third["messages"][6])[0]["function"]["arguments"] == {"symbol": "MSFT"}
    assert not any("<|endoftext|>" in m["content"] for r in rows for m in r["messages"])
    assert dict(stats.extra["role_mapping"]) == {"FUNCTION RESPONSE->tool": 3}


# ------------------------------------------------------------------ detection and overrides


@pytest.mark.parametrize(
    ("row", "fmt"),
    [
        ({"messages": []}, "openai"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "value": "x"}]}]}, "parts"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, "openai"),
        ({"conversations": []}, "sharegpt"),
        ({"instruction": "x", "output": "y"}, "alpaca"),
        ({"question": "x", "response": "y"}, "orca"),
        ({"system_prompt": "", "question": "x"}, "orca"),
        ({"prompt": "x"}, "prompt"),
        ({"system": "s", "chat": "USER: x"}, "glaive"),
        ({"question": "x"}, None),
        ({"text": "x"}, None),
    ],
)
def test_detect_format(row, fmt):
    assert detect_format(row) == fmt


def test_explicit_format_mismatch_names_the_keys():
    err = error_of(chat(("user", "hi"), ("assistant", "yo")), "sharegpt")
    assert err.code == "format_mismatch"
    assert "'conversations'" in err.message and "['messages']" in err.message
    assert "looks like 'openai'" in err.message
    err = error_of({"conversations": [{"from": "human", "value": "x"}], "id": "a"}, "openai")
    assert err.code == "format_mismatch" and "['conversations', 'id']" in err.message


def test_explicit_format_wins_over_detection():
    row = {"instruction": "Say hi", "output": "hi", "prompt": "ignored"}
    assert norm(row, "alpaca")["format"] == "alpaca"
    assert norm(row, "prompt")["messages"][0]["content"] == "ignored"


def test_unknown_format_and_non_objects():
    err = error_of({"text": "x", "label": 1})
    assert err.code == "unknown_format" and "['label', 'text']" in err.message
    for value in ([1, 2], "text", 3, None, True):
        assert error_of(value).code == "not_an_object"


# ------------------------------------------------------------------ [sources.fields]


def test_fields_dotted_paths_and_appended_response():
    row = {
        "traj": {"steps": [{"role": "user", "content": "Pick one."}]},
        "preferred_output": [{"role": "assistant", "content": "A."}],
        "non_preferred_output": [{"role": "assistant", "content": "B."}],
    }
    out = norm(row, fields={"messages": "traj.steps", "response": "preferred_output"})
    assert [(m["role"], m["content"]) for m in out["messages"]] == [
        ("user", "Pick one."), ("assistant", "A."),
    ]
    assert out["needs_response"] is False
    out = norm({"traj": [{"role": "user", "content": "q"}], "best": "a"},
               fields={"messages": "traj", "response": "best"})
    assert [m["content"] for m in out["messages"]] == ["q", "a"]
    row = {"data": [{"turns": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}]}
    assert len(norm(row, fields={"messages": "data.0.turns"})["messages"]) == 2


def test_fields_missing_paths_are_named():
    err = error_of({"other": 1}, fields={"messages": "traj"})
    assert err.code == "missing_field" and "'traj'" in err.message and "other" in err.message
    err = error_of({"traj": [{"role": "user", "content": "q"}]},
                   fields={"messages": "traj", "response": "chosen"})
    assert err.code == "missing_field" and "'chosen'" in err.message


# ------------------------------------------------------------------ single-turn layouts


def test_orca():
    out = norm({"system_prompt": "Be brief.", "question": "2+2?", "response": "4"})
    assert [(m["role"], m["content"]) for m in out["messages"]] == [
        ("system", "Be brief."), ("user", "2+2?"), ("assistant", "4"),
    ]
    out = norm({"system_prompt": "", "question": "2+2?", "response": ""})
    assert [m["role"] for m in out["messages"]] == ["user"]
    assert out["needs_response"] is True
    assert error_of({"question": 5, "response": "x"}).code == "wrong_type"


def test_prompt_only_and_prompt_completion():
    out = norm({"prompt": "Write a haiku."})
    assert [(m["role"], m["content"]) for m in out["messages"]] == [("user", "Write a haiku.")]
    assert out["needs_response"] is True
    out = norm({"prompt": "q", "system": "s"})
    assert [m["role"] for m in out["messages"]] == ["system", "user"]
    out = norm({"prompt": [{"role": "developer", "content": "d"},
                           {"role": "user", "content": "q"}]})
    assert [m["role"] for m in out["messages"]] == ["system", "user"] and out["needs_response"]
    # a completion next to the prompt is the reply, never dropped
    out = norm({"prompt": "q", "completion": "a"})
    assert [(m["role"], m["content"]) for m in out["messages"]] == [
        ("user", "q"), ("assistant", "a"),
    ]
    assert out["needs_response"] is False
    out = norm({"prompt": [{"role": "user", "content": "q"}],
                "completion": [{"role": "assistant", "content": "a"}]})
    assert [m["role"] for m in out["messages"]] == ["user", "assistant"]
    assert error_of({"prompt": {"text": "q"}}).code == "wrong_type"


def test_alpaca_system_and_history():
    out = norm({"instruction": "i", "input": "", "output": "o", "system": "s",
                "history": [["q1", "a1"], ["q2", "a2"]]})
    assert [(m["role"], m["content"]) for m in out["messages"]] == [
        ("system", "s"), ("user", "q1"), ("assistant", "a1"), ("user", "q2"),
        ("assistant", "a2"), ("user", "i"), ("assistant", "o"),
    ]
    out = norm({"instruction": "i", "input": "", "output": ""})
    assert [m["role"] for m in out["messages"]] == ["user"] and out["needs_response"]
    assert error_of({"instruction": "i", "output": "o", "history": "q"}).code == "wrong_type"
    assert error_of({"instruction": ["i"], "output": "o"}).code == "wrong_type"


def test_glaive_multiple_functions_and_bad_call():
    system = ('SYSTEM: You can use -\n{"name": "a", "parameters": {}}\n\n'
              '{"name": "b", "parameters": {"type": "object"}}')
    out = norm({"system": system, "chat": "USER: hi ASSISTANT: <think>hm</think> hello"})
    assert [t["function"]["name"] for t in json.loads(out["tools"])] == ["a", "b"]
    assert out["messages"][0]["content"].startswith("You can use")  # SYSTEM: prefix off
    assert (out["messages"][2]["reasoning"], out["messages"][2]["content"]) == ("hm", "hello")
    bad = {"system": "", "chat": "USER: x ASSISTANT: <functioncall> {oops} <|endoftext|>"}
    assert error_of(bad).code == "bad_tool_call"
    assert error_of({"system": "", "chat": "hello USER: x"}).code == "unparseable_chat"


# ------------------------------------------------------------------ reasoning


@pytest.mark.parametrize(
    ("content", "reasoning", "rest"),
    [
        ("<think>plan</think>\n\nanswer", "plan", "answer"),
        ("  <think>\n plan \n</think>answer", "plan", "answer"),
        ("<think></think>\n\nanswer", None, "answer"),  # an empty think is not reasoning
        ("<think>a</think><think>b</think>c", "a\n\nb", "c"),
        ("answer <think>later</think>", None, "answer <think>later</think>"),  # not leading
        ("<think>unclosed answer", None, "<think>unclosed answer"),
    ],
)
def test_inline_think(content, reasoning, rest):
    out = norm(chat(("user", "q"), ("assistant", content)))
    assert (out["messages"][1]["reasoning"], out["messages"][1]["content"]) == (reasoning, rest)


def test_inline_think_is_only_split_on_assistant_turns():
    out = norm(chat(("user", "<think>x</think>y"), ("assistant", "a")))
    assert out["messages"][0]["content"] == "<think>x</think>y"


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning", "thinking"])
def test_reasoning_fields(key):
    row = {"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a", key: "because"}]}
    assert norm(row)["messages"][1]["reasoning"] == "because"


def test_reasoning_field_wins_over_inline_think_and_must_be_text():
    row = {"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": "<think>x</think>a",
                         "reasoning_content": "r"}]}
    assert norm(row)["messages"][1]["reasoning"] == "r"
    row["messages"][1]["reasoning_content"] = {"text": "r"}
    assert error_of(row).code == "wrong_type"


def test_empty_reply_with_only_reasoning_is_quarantined():
    err = error_of(chat(("user", "q"), ("assistant", "<think>only thoughts</think>")))
    assert err.code == "empty_content"


# ------------------------------------------------------------------ tool calls


def _call(name: str, arguments: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}, **extra}


def test_tool_call_arguments_become_objects_and_the_kind_is_recorded():
    def row(*arguments: Any) -> dict[str, Any]:
        return {"messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None,
             "tool_calls": [_call("f", a, id=f"c{k}") for k, a in enumerate(arguments)]},
            *({"role": "tool", "tool_call_id": f"c{k}", "content": "r"}
              for k in range(len(arguments))),
        ]}

    out = norm(row('{"x": 1}'))
    assert calls(out["messages"][1]) == [_call("f", {"x": 1}, id="c0")]
    assert out["tool_arguments"] == "json_string"
    assert out["messages"][2]["tool_call_id"] == "c0"
    assert norm(row({"x": 1}))["tool_arguments"] == "object"
    assert norm(row({"x": 1}, '{"y": 2}'))["tool_arguments"] == "mixed"
    assert calls(norm(row(""))["messages"][1])[0]["function"]["arguments"] == {}
    # both spellings of the same call are one conversation
    assert norm(row('{"x": 1}'))["id"] == norm(row({"x": 1}))["id"]
    assert error_of(row("{not json")).code == "bad_tool_call"
    assert error_of(row("[1, 2]")).code == "bad_tool_call"
    assert error_of(row([1, 2])).code == "bad_tool_call"


def test_tool_calls_as_json_text_and_bad_shapes():
    base = [{"role": "user", "content": "q"}]
    text = json.dumps([_call("f", {"a": 1})])
    out = norm({"messages": [*base, {"role": "assistant", "content": "", "tool_calls": text}]})
    assert calls(out["messages"][1]) == [_call("f", {"a": 1})]
    for bad in ("{oops", [{"function": {"arguments": "{}"}}], [5]):
        row = {"messages": [*base, {"role": "assistant", "content": "", "tool_calls": bad}]}
        assert error_of(row).code == "bad_tool_call", bad


def test_legacy_function_call_and_function_role():
    row = {"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None,
         "function_call": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
        {"role": "function", "name": "weather", "content": "rain"},
        {"role": "assistant", "content": "It rains."},
    ]}
    out, mapping = normalize_row(row)
    assert calls(out["messages"][1]) == [_call("weather", {"city": "Oslo"})]
    assert (out["messages"][2]["role"], out["messages"][2]["name"]) == ("tool", "weather")
    assert mapping == {"function->tool": 1}
    assert out["tool_arguments"] == "json_string"


def test_a_text_turn_then_a_bare_call_turn_are_merged():
    row = {"conversations": [
        {"from": "human", "value": "q"},
        {"from": "gpt", "value": "Let me look."},
        {"from": "function_call", "value": '{"name": "f", "arguments": {"a": 1}}'},
        {"from": "observation", "value": "r"},
        {"from": "gpt", "value": "done"},
    ]}
    out, mapping = normalize_row(row)
    assert roles(out) == ["user", "assistant", "tool", "assistant"]
    assert out["messages"][1]["content"] == "Let me look."
    assert calls(out["messages"][1]) == [_call("f", {"a": 1})]
    assert mapping["merged_tool_call_turn"] == 1


def test_tools_specs():
    spec = {"name": "f", "parameters": {"type": "object"}}
    row = chat(("user", "q"), ("assistant", "a"))
    assert json.loads(norm({**row, "tools": [spec]})["tools"]) == [
        {"type": "function", "function": spec}
    ]
    assert norm({**row, "tools": json.dumps([spec])})["tools"] == norm({**row, "tools": [spec]})[
        "tools"
    ]
    assert norm({**row, "tools": "[]"})["tools"] is None
    assert norm({**row, "tools": [spec]})["id"] != norm(row)["id"]
    for bad in ("{nope", 5, [5], [{"description": "no name"}], [{"function": 5}],
                [{"type": "function", "function": {"description": "no name"}}]):
        assert error_of({**row, "tools": bad}).code == "bad_tools", bad


def test_tool_turn_without_a_call_is_a_role_order_error():
    err = error_of(chat(("user", "q"), ("assistant", "a"), ("tool", "r")))
    assert err.code == "role_order" and "tool turn" in err.message


# ------------------------------------------------------------------ content shapes and roles


def test_content_as_openai_text_parts():
    row = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello, "},
                                     {"type": "text", "text": "world"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]},
    ]}
    out = norm(row)
    assert out["format"] == "openai"
    assert [m["content"] for m in out["messages"]] == ["Hello, world", "Hi"]


def test_unsupported_content_parts_are_wrong_type():
    row = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    ]}]}
    err = error_of(row)
    assert err.code == "wrong_type"
    assert "'image_url'" in err.message and "messages[0].content[1]" in err.message
    bad_part = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    assert error_of(bad_part).code == "wrong_type"
    assert error_of({"messages": [{"role": "user", "content": [7]}]}).code == "wrong_type"


@pytest.mark.parametrize(
    ("row", "code"),
    [
        ({"messages": "hi"}, "wrong_type"),
        ({"messages": ["hi"]}, "wrong_type"),
        ({"messages": [{"content": "hi"}]}, "missing_field"),
        ({"messages": [{"role": 1, "content": "hi"}]}, "wrong_type"),
        ({"messages": [{"role": "narrator", "content": "hi"}]}, "unknown_role"),
        ({"messages": [{"role": "user", "content": 5}]}, "wrong_type"),
        ({"messages": [{"role": "user", "content": {"text": "hi"}}]}, "wrong_type"),
        ({"messages": []}, "empty_conversation"),
        ({"messages": [{"role": "user", "content": "  "}]}, "empty_content"),
        ({"messages": [{"role": "user", "content": None}]}, "empty_content"),
        ({"messages": [{"role": "system", "content": "s"}]}, "role_order"),
        ({"messages": [{"role": "assistant", "content": "a"}]}, "role_order"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]},
         "role_order"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                            {"from": "gpt", "value": "b"}]}, "role_order"),
        ({"instruction": None, "output": "o"}, "wrong_type"),
        ({"system": 5, "chat": "USER: q"}, "wrong_type"),
    ],
)
def test_bad_rows_get_a_reason(row, code):
    err = error_of(row)
    assert err.code == code
    assert err.message


def test_role_spellings_are_mapped_and_recorded():
    row = {"messages": [
        {"role": "developer", "content": "d"},
        {"role": "Human", "content": "q"},
        {"role": "model", "content": "a"},
    ]}
    out, mapping = normalize_row(row)
    assert roles(out) == ["system", "user", "assistant"]
    assert mapping == {"developer->system": 1, "Human->user": 1, "model->assistant": 1}


def test_sharegpt_top_level_system_and_tools_string():
    row = {"system": "Be kind.", "tools": json.dumps([{"name": "f"}]),
           "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    out = norm(row)
    assert (out["messages"][0]["role"], out["messages"][0]["content"]) == ("system", "Be kind.")
    assert json.loads(out["tools"]) == [{"type": "function", "function": {"name": "f"}}]
    # a system turn already in the conversation is not doubled
    row["conversations"].insert(0, {"from": "system", "value": "Own system."})
    assert [m["content"] for m in norm(row)["messages"]][:2] == ["Own system.", "q"]


def test_parquet_style_structs_with_null_fields():
    """Parquet gives every struct field of the file's schema; a null must not hide the other."""
    row = {"messages": [
        {"role": None, "from": "human", "content": None, "value": "q"},
        {"role": "assistant", "from": None, "content": "a", "value": None},
    ]}
    assert [(m["role"], m["content"]) for m in norm(row)["messages"]] == [
        ("user", "q"), ("assistant", "a"),
    ]


def test_ids_are_stable_and_format_independent():
    openai = chat(("user", "q"), ("assistant", "a"))
    sharegpt = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    alpaca = {"instruction": "q", "input": "", "output": "a"}
    ids = {norm(openai)["id"], norm(sharegpt)["id"], norm(alpaca)["id"]}
    assert len(ids) == 1
    assert norm(chat(("user", "q"), ("assistant", "b")))["id"] not in ids


# ------------------------------------------------------------------ agentic data (issue 16 §5)
AIRLINE = {
    "messages": [
        {"role": "system", "content": "You are an airline agent."},
        {"role": "user", "content": "Cancel reservation ABC123."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "cancel_reservation",
                          "arguments": '{"reservation_id": "ABC123"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": ""},  # the tool returned nothing
        {"role": "assistant", "content": "Your reservation ABC123 is cancelled."},
    ]
}


def test_an_empty_tool_result_is_kept():
    row = norm(AIRLINE)
    assert roles(row) == ["system", "user", "assistant", "tool", "assistant"]
    assert row["messages"][3]["content"] == "" and row["messages"][3]["tool_call_id"] == "c1"
    # only tool turns may be empty: an empty user or assistant turn is still quarantined
    for k in (1, 4):
        bad = json.loads(json.dumps(AIRLINE))
        bad["messages"][k]["content"] = ""
        assert error_of(bad).code == "empty_content"


def test_the_contract_accepts_empty_tool_results_only(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_etl.core.schema import CONVERSATIONS
    from dflash_etl.validation.contracts import load_contract, validate_files

    good = norm(AIRLINE)
    bad = json.loads(json.dumps(good))
    bad["messages"][1]["content"] = ""
    bad["id"] = "0" * 32
    for row in (good, bad):
        row.update(source="s", file="f.jsonl", line=1)
    pq.write_table(pa.Table.from_pylist([good], schema=CONVERSATIONS), tmp_path / "good.parquet")
    pq.write_table(pa.Table.from_pylist([bad], schema=CONVERSATIONS), tmp_path / "bad.parquet")
    contract = load_contract("conversations")
    assert validate_files(contract, [tmp_path / "good.parquet"])["passed"]
    report = validate_files(contract, [tmp_path / "bad.parquet"])
    assert [f["check"] for f in report["failures"]] == ["content_non_empty"]


TOOLACE_SYSTEM = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, you will need to make one or more function/tool calls "
    "to achieve the purpose.\nHere is a list of functions in JSON format that you can invoke:\n"
    + json.dumps([
        {"name": "User Feed (Video Posts) V2",
         "description": "Get a user's video feed.",
         "parameters": {"type": "dict", "properties": {"user_id": {"type": "string"},
                                                        "limit": {"type": "integer"}},
                        "required": ["user_id"]}},
        {"name": "get_weather", "description": "Weather of a city.",
         "parameters": {"type": "dict", "properties": {"city": {"type": "string"}}}},
    ])
    + "\nShould you decide to return the function call(s), NO other text MUST be included."
)


def toolace(call: str, *after: tuple[str, str]) -> dict[str, Any]:
    return {"system": TOOLACE_SYSTEM, "conversations": [
        {"from": "user", "value": "Show me the latest videos of user 12345 and Paris weather."},
        {"from": "assistant", "value": call},
        *({"from": f, "value": v} for f, v in after)]}


def test_toolace_pythonic_calls_become_tool_calls():
    row = norm(toolace(
        '[User Feed (Video Posts) V2(user_id="12345", limit=3), get_weather(city=\'Paris\')]',
        ("tool", '[{"name": "User Feed (Video Posts) V2", "results": {"videos": []}}]'),
        ("assistant", "User 12345 has no videos; Paris is sunny.")))
    assert row["format"] == "sharegpt" and roles(row) == [
        "system", "user", "assistant", "tool", "assistant"]
    call_turn = row["messages"][2]
    assert call_turn["content"] == ""
    assert [c["function"] for c in calls(call_turn)] == [
        {"name": "User Feed (Video Posts) V2", "arguments": {"user_id": "12345", "limit": 3}},
        {"name": "get_weather", "arguments": {"city": "Paris"}},
    ]
    assert row["tool_arguments"] == "pythonic"
    tools = json.loads(row["tools"])
    assert [t["function"]["name"] for t in tools] == ["User Feed (Video Posts) V2", "get_weather"]
    assert row["messages"][0]["content"] == TOOLACE_SYSTEM  # the prompt itself is unchanged


def test_toolace_final_call_turn_with_known_names_and_plain_brackets():
    # the conversation ends on the call: converted because every name is a listed tool
    row = norm(toolace('[get_weather(city="Paris")]'))
    assert calls(row["messages"][2])[0]["function"]["name"] == "get_weather"
    # a reply that merely looks like a call list, with no tool turn after it, stays text
    for text in ("[see_above(x=1)]", "[1] (citation)", "[Note: (a) and (b)]"):
        row = norm(toolace(text))
        assert row["messages"][2]["content"] == text and row["messages"][2]["tool_calls"] is None


@pytest.mark.parametrize("call", [
    "[get_weather(city=__import__('os').system('touch /tmp/pwned'))]",  # never evaluated
    "[get_weather('Paris')]",  # positional arguments
    "[get_weather(city={1, 2})]",  # a set: not JSON
    "[get_weather(city=\"Paris\") get_weather(city=\"Rome\")]",  # no comma
    "[get_weather(city=\"Par)]",  # cut short
    "[" + "f(x=[" * 300 + "]" * 300 + ")]",  # nested past the parser
])
def test_toolace_unparseable_call_before_a_tool_turn_is_quarantined(call):
    err = error_of(toolace(call, ("tool", "{}")))
    assert err.code == "bad_tool_call" and "pythonic tool-call list" in err.message
    assert not Path("/tmp/pwned").exists()


def test_toolace_unknown_role_stays_quarantined():
    err = error_of(toolace('[get_weather(city="Paris")]', ("observer", "sunny")))
    assert err.code == "unknown_role" and "'observer'" in err.message


def test_tools_in_a_system_prompt_need_a_json_list_of_named_objects():
    from dflash_etl.formats.common import tools_from_text

    assert tools_from_text("Use [brackets] and [1, 2] freely.") is None
    assert tools_from_text('Tools: [{"description": "no name"}]') is None
    assert tools_from_text("Broken: [{") is None
    (spec,) = tools_from_text('x [1] then [{"name": "f", "parameters": {}}] y')
    assert spec == {"type": "function", "function": {"name": "f", "parameters": {}}}


def test_the_unique_check_finds_duplicates_across_shards_by_value(tmp_path):
    """Keys are compared by hash first (bounded memory) and then by value: a key repeated in
    another shard is reported with its values; distinct keys pass."""
    import polars as pl

    from dflash_etl.validation.contracts import _duplicates

    pl.DataFrame({"id": ["a", "b", "c"], "turn": [0, 0, 1]}).write_parquet(tmp_path / "1.parquet")
    pl.DataFrame({"id": ["c", "d", "b"], "turn": [0, 0, 0]}).write_parquet(tmp_path / "2.parquet")
    files = [tmp_path / "1.parquet", tmp_path / "2.parquet"]
    dupes = _duplicates(files, ["id", "turn"])
    assert dupes.rows() == [("b", 0)]
    assert _duplicates(files[:1], ["id", "turn"]).is_empty()
