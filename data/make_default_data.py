"""Writes the embedded default sources in data/sources/ (run it to regenerate them).

The rows are written for this project: small, varied conversations in every supported format,
plus a handful of deliberately broken lines, so a default run exercises parsing, quarantine,
dedup and the contracts. Deterministic: the same script writes the same bytes.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUT = Path(__file__).resolve().parent / "sources"
rng = random.Random(20261129)

CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Quebec", "Perth", "Tbilisi", "Accra"]
COLORS = ["red", "green", "blue", "yellow", "purple", "orange"]
ANIMALS = ["otter", "heron", "lynx", "gecko", "walrus", "ibis", "marmot"]
SYSTEMS = [
    "You are a concise assistant.",
    "You are a helpful tutor who explains each step.",
    "Answer briefly and accurately.",
]


def arithmetic() -> tuple[str, str, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    word = {"+": "sum", "-": "difference", "*": "product"}[op]
    question = f"What is {a} {op} {b}?"
    reasoning = f"The {word} of {a} and {b}: {a} {op} {b} = {value}."
    return question, f"{a} {op} {b} = {value}.", reasoning


def fact() -> tuple[str, str]:
    animal, color = rng.choice(ANIMALS), rng.choice(COLORS)
    n = rng.randint(2, 9)
    return (
        f"Write a short sentence about a {color} {animal}.",
        f"The {color} {animal} counted {n} pebbles by the river and kept the brightest one.",
    )


def conversion() -> tuple[str, str]:
    km = rng.randint(1, 500)
    return f"How many meters are in {km} kilometers?", f"{km} kilometers is {km * 1000} meters."


def qa() -> tuple[str, str]:
    return rng.choice([arithmetic()[:2], fact(), conversion()])


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}


def weather_turns(city: str) -> tuple[dict, str, str]:
    temp = rng.randint(-5, 35)
    args = {"city": city}
    result = json.dumps({"city": city, "temp_c": temp, "sky": rng.choice(["clear", "cloudy"])})
    return args, result, f"It is {temp} degrees Celsius in {city} right now."


def dump_jsonl(path: Path, rows: list, extra_lines: list[bytes] = (), bom: bool = False) -> None:
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in rows]
    for k, raw in enumerate(extra_lines):
        lines.insert(min(len(lines), 3 + 7 * k), raw)
    data = b"\n".join(lines) + b"\n"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + data)


def openai_chat() -> None:
    rows = []
    for k in range(70):
        msgs = [{"role": "system", "content": rng.choice(SYSTEMS)}] if k % 3 == 0 else []
        for _ in range(rng.randint(1, 3)):
            q, a = qa()
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        rows.append({"messages": msgs})
    for _ in range(10):  # reasoning in a separate field and inline
        q, a, r = arithmetic()
        rows.append({"messages": [{"role": "user", "content": q},
                                  {"role": "assistant", "content": a, "reasoning_content": r}]})
        q, a, r = arithmetic()
        rows.append({"messages": [{"role": "user", "content": q},
                                  {"role": "assistant", "content": f"<think>{r}</think>\n\n{a}"}]})
    rows.append(rows[5])  # an exact duplicate: counted as filtered (duplicate)
    rows.append({"messages": [{"role": "system", "content": "Be nice."},
                              {"role": "assistant", "content": "Hello there!"}]})  # no user turn
    rows.append({"messages": [{"role": "user", "content": 42},
                              {"role": "assistant", "content": "Forty-two."}]})  # wrong type
    rows.append({"messages": [{"role": "user", "content": "Ping?"},
                              {"role": "assistant", "content": "   "}]})  # empty reply
    broken = [
        b'{"messages": [{"role": "user", "content": "unterminated',  # malformed JSON
        b'["a", "list", "not", "an", "object"]',
        b"",  # blank line
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',  # invalid UTF-8 (latin-1)
        json.dumps({"messages": [{"role": "user", "content": "Hi with CRLF"},
                                 {"role": "assistant", "content": "Hello!"}]}).encode() + b"\r",
    ]
    dump_jsonl(OUT / "openai_chat.jsonl", rows, broken, bom=True)


def openai_tools() -> None:
    rows = []
    for k in range(30):
        city = rng.choice(CITIES)
        args, result, answer = weather_turns(city)
        first = {"role": "developer" if k % 4 == 0 else "system",
                 "content": "Use the tools when the user asks about weather."}
        call = {"id": f"call_{k}", "type": "function",
                "function": {"name": "get_weather",
                             "arguments": json.dumps(args) if k % 2 else args}}
        rows.append({"messages": [
            first,
            {"role": "user", "content": f"What's the weather in {city}?"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": result},
            {"role": "assistant", "content": answer},
        ], "tools": [WEATHER_TOOL]})
    rows.append({"messages": [{"role": "user", "content": "Weather in Oslo?"},
                              {"role": "assistant", "tool_calls": [
                                  {"type": "function", "function": {
                                      "name": "get_weather", "arguments": "{city: Oslo"}}]}],
                 "tools": [WEATHER_TOOL]})  # arguments are not JSON
    dump_jsonl(OUT / "openai_tools.jsonl", rows)


def sharegpt() -> None:
    rows = []
    for k in range(60):
        conv = [{"from": "system", "value": rng.choice(SYSTEMS)}] if k % 10 == 0 else []
        for _ in range(rng.randint(1, 3)):
            q, a = qa()
            conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        rows.append({"id": f"sg-{k}", "conversations": conv})
    rows.append({"id": "sg-bad-role", "conversations": [
        {"from": "narrator", "value": "Once upon a time."},
        {"from": "gpt", "value": "Indeed."}]})  # unknown role
    rows.append({"id": "sg-as-openai", "messages": [{"role": "user", "content": "hi"}]})
    dump_jsonl(OUT / "sharegpt.jsonl", rows)


def sharegpt_tools_json() -> None:
    """A .json array, LLaMA-Factory style: function_call/observation and tools as a string."""
    rows = []
    for _ in range(25):
        city = rng.choice(CITIES)
        args, result, answer = weather_turns(city)
        rows.append({
            "conversations": [
                {"from": "human", "value": f"Is it warm in {city} today?"},
                {"from": "function_call",
                 "value": json.dumps({"name": "get_weather", "arguments": args})},
                {"from": "observation", "value": result},
                {"from": "gpt", "value": answer},
            ],
            "system": "You can call get_weather.",
            "tools": json.dumps([WEATHER_TOOL["function"]]),
        })
    (OUT / "sharegpt_tools.json").write_text(json.dumps(rows, indent=1, ensure_ascii=False))


def alpaca_gz() -> None:
    rows = []
    for k in range(60):
        if k % 4 == 0:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            rows.append({"instruction": "Add the two numbers.", "input": f"{a} and {b}",
                         "output": f"{a} + {b} = {a + b}."})
        else:
            q, a = qa()
            rows.append({"instruction": q, "input": "", "output": a})
    rows.append({"instruction": "Summarize the text.", "input": "", "output": ""})  # prompt-only
    with gzip.GzipFile(OUT / "alpaca.jsonl.gz", "wb", mtime=0) as fh:
        fh.write(b"".join(json.dumps(r).encode() + b"\n" for r in rows))


def orca_parquet() -> None:
    rows = []
    for k in range(40):
        q, a, r = arithmetic()
        rows.append({"system_prompt": SYSTEMS[k % 3], "question": q,
                     "response": f"{r} So the answer is {a}"})
    pq.write_table(pa.Table.from_pylist(rows), OUT / "orca.parquet")


def prompts() -> None:
    rows = [{"prompt": qa()[0]} for _ in range(25)]
    rows += [{"messages": [{"role": "system", "content": "Answer in one line."},
                           {"role": "user", "content": qa()[0]}]} for _ in range(10)]
    dump_jsonl(OUT / "prompts.jsonl", rows)


def parts() -> None:
    rows = []
    for _ in range(25):
        city = rng.choice(CITIES)
        args, result, answer = weather_turns(city)
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "text", "value": f"Weather for {city}?"}]},
            {"role": "assistant", "content": [
                {"type": "reasoning", "value": f"I should call get_weather for {city}."},
                {"type": "tool_call",
                 "value": json.dumps({"name": "get_weather", "arguments": args})}]},
            {"role": "tool", "content": [{"type": "text", "value": result}]},
            {"role": "assistant", "content": [
                {"type": "reasoning", "value": "The tool answered."},
                {"type": "text", "value": answer}]},
        ], "tools": json.dumps([WEATHER_TOOL])})
    dump_jsonl(OUT / "parts.jsonl", rows)


def glaive() -> None:
    spec = json.dumps(WEATHER_TOOL["function"], indent=2)
    rows = []
    for _ in range(20):
        city = rng.choice(CITIES)
        args, result, answer = weather_turns(city)
        call = '{"name": "get_weather", "arguments": \'' + json.dumps(args) + "'}"
        rows.append({
            "system": "SYSTEM: You are a helpful assistant with access to the following "
                      f"functions. Use them if required -\n{spec}",
            "chat": f"USER: How is the weather in {city}?\n\n\nASSISTANT: <functioncall> {call} "
                    f"<|endoftext|>\n\n\nFUNCTION RESPONSE: {result}\n\n\nASSISTANT: {answer} "
                    "<|endoftext|>\n\n\n",
        })
    rows.append({"system": "SYSTEM: none", "chat": "no markers in this chat at all"})
    dump_jsonl(OUT / "glaive.jsonl", rows)


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for write in (openai_chat, openai_tools, sharegpt, sharegpt_tools_json, alpaca_gz,
                  orca_parquet, prompts, parts, glaive):
        write()
    print(f"wrote {len(list(OUT.iterdir()))} files to {OUT}")
