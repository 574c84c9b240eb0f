"""A settings dataclass is the one declaration of a stage's settings: each field, made with
`setting`, carries its range, its CLI flag and help, and how the runner treats it (taken from
[target] or another section when unset, relative to the config, left out of the fingerprint).
The checks here turn a wrong value, from the config or a flag, into a message naming the key or
flag and what it must be."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import tomllib
import types
import typing
from collections.abc import Iterable
from dataclasses import asdict, field, fields
from functools import cache
from typing import Any

from dflash_etl.core.errors import StageError


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            min: float | None = None, max: float | None = None, above: float | None = None,
            choices: Iterable[str] | None = None, why: str | None = None,
            help: str | None = None, flags: Iterable[str] = (), metavar: str | None = None,
            required: str | None = None, target: bool = False, inherit: str | None = None,
            path: bool = False, fingerprint: bool | str = True,
            applies: tuple[str, tuple[Any, ...]] | None = None, kept: bool = False) -> Any:
    """A settings dataclass field with the range its value must be in: `min` <= value <= `max`,
    value > `above`, value in `choices` (a choice "x:N" also accepts "x:0", "x:1", ...); `why`
    is added to the error message. For a dict field the range applies to its values.

    `help` is what the setting does (the CLI flag's help; the default is added to it), `flags`
    extra names of the flag (`--eot` for include_eot also gives `--no-eot`), `metavar` how its
    help writes the value.

    How the runner treats it: `required` names what it is ("a tokenizer") when the stage cannot
    run without it (`dflash-etl run` runs the stage only when it is configured); `target`: the
    config's [target] model when unset; `inherit`: the named section's value when unset; `path`:
    a config value is relative to the config's folder; `fingerprint`: False leaves it out of the
    stage's fingerprint (where or how the work runs, not what it makes), "unless_default" only
    while it has its default (a setting added later: runs made before it are not redone);
    `applies=("backend", ("openai",))`: it does something only while that setting has one of
    those values, and a flag given otherwise is refused, naming the one that makes it apply;
    `kept`: a choice a rerun keeps — redoing a complete output with another value of it is
    refused unless the value is given (a rerun that names only --model must not re-extract
    other layers than were chosen)."""
    meta = {"min": min, "max": max, "above": above, "why": why,
            "choices": tuple(choices) if choices is not None else None,
            "help": help, "flags": tuple(flags) or None, "metavar": metavar,
            "required": required, "target": target or None, "inherit": inherit,
            "path": path or None, "fingerprint": None if fingerprint is True else fingerprint,
            "applies": applies, "kept": kept or None}
    meta = {k: v for k, v in meta.items() if v is not None}
    if default_factory is not dataclasses.MISSING:  # a dict or list: out of the hash, as
        # a frozen settings object stays hashable (equality still compares it)
        return field(default_factory=default_factory, metadata=meta, hash=False)
    return field(default=default, metadata=meta)


def marked(cls: type, key: str) -> list[dataclasses.Field[Any]]:
    """The fields of the settings dataclass `cls` whose `setting` sets `key` (required, target,
    inherit, path, applies)."""
    return [f for f in fields(cls) if f.metadata.get(key)]


def inapplicable(settings: Any, given: Iterable[str]) -> list[str]:
    """The `given` flags that do nothing with these settings (`setting(applies=...)`), each
    with the flag that would make it apply."""
    problems = []
    for spec in marked(type(settings), "applies"):
        key, allowed = spec.metadata["applies"]
        if spec.name not in given or getattr(settings, key) in allowed:
            continue
        needs = (flag_name(key) if allowed == (True,) else
                 f"{flag_name(key)} {' or '.join(map(str, allowed))}")
        problems.append(f"{flag_name(spec.name)} applies only with {needs} ({key} is "
                        f"{show_value(getattr(settings, key))} now): drop it, or add {needs}")
    return problems


def dropped_choices(settings: Any, given: Iterable[str], before: dict[str, Any]) -> list[str]:
    """The `kept` settings a rerun would change without being given them: `before` is the
    published output's settings; each with the flag that keeps it."""
    now = asdict(settings)
    return [f"{flag_name(spec.name)} {show_value(before[spec.name])} (it would be "
            f"{show_value(now[spec.name])}, the default)"
            for spec in marked(type(settings), "kept")
            if spec.name not in set(given) and spec.name in before
            and before[spec.name] != now[spec.name]]


def fingerprinted(settings: Any) -> dict[str, Any]:
    """The settings that make a stage's output, as its fingerprint covers them."""
    rules = {f.name: (f.metadata.get("fingerprint", True), f) for f in fields(settings)}
    return {key: value for key, value in asdict(settings).items()
            if rules[key][0] is not False
            and not (rules[key][0] == "unless_default" and value == default_of(rules[key][1]))}


def default_of(spec: dataclasses.Field[Any]) -> Any:
    """A settings field's default value."""
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


# ---------------------------------------------------------------- checks
def show_value(value: Any) -> str:
    """A value as it is written in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {show_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(show_value(v) for v in value) + "]"
    return str(value)


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def _close(name: str, known: Iterable[str]) -> str | None:
    match = difflib.get_close_matches(name, list(known), n=1)
    return match[0] if match else None


def unknown_name(where: str, what: str, name: str, known: Iterable[str], show: Any = str,
                 label: str | None = None) -> str:
    """`<where>unknown <what> <name>; did you mean <close>?` (else the known names); `show`
    writes a known name as the message shows it, `label` the unknown one (default: as is)."""
    known = list(known)
    close = _close(name, known)
    hint = f"did you mean {show(close)}?" if close else \
        f"known: {', '.join(show(k) for k in known)}"
    return f"{where}unknown {what} {label or name}; {hint}"


@cache
def type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def unoptional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def _bounds(meta: dict[str, Any]) -> str:
    low, above, high = meta.get("min"), meta.get("above"), meta.get("max")
    if high is not None and (low is not None or above is not None):
        return f" in [{low}, {high}]" if low is not None else f" in ({above}, {high}]"
    if low is not None:
        return f" >= {low}"
    if above is not None:
        return f" > {above}"
    return f" <= {high}" if high is not None else ""


def _expected(tp: Any, meta: dict[str, Any]) -> str:
    """What a value of this setting must be, in words."""
    tp, _ = unoptional(tp)
    if tp is bool:
        return "true or false (a TOML boolean, without quotes)"
    if tp is int:
        return "an integer" + _bounds(meta)
    if tp is float:
        return "a number" + _bounds(meta)
    if tp is str:
        choices = meta.get("choices")
        return f"one of {', '.join(show_value(c) for c in choices)}" if choices else "a string"
    if typing.get_origin(tp) is dict:
        value_tp = typing.get_args(tp)[1]
        return "a table" if value_tp is Any else f"a table of {_plural(value_tp, meta)}"
    return str(tp)


def _plural(tp: Any, meta: dict[str, Any]) -> str:
    words = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
    text = words.get(tp, str(tp))
    return text + _bounds(meta) if tp in (int, float) else text


def _fits(value: Any, tp: Any, meta: dict[str, Any]) -> bool:
    tp, optional = unoptional(tp)
    if value is None:
        return optional
    if tp is Any:
        return True
    if tp is bool:
        return isinstance(value, bool)
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, int if tp is int else int | float):
            return False
        if isinstance(value, float) and math.isnan(value):
            return False
        low, above, high = meta.get("min"), meta.get("above"), meta.get("max")
        return ((low is None or value >= low) and (above is None or value > above)
                and (high is None or value <= high))
    if tp is str:
        if not isinstance(value, str):
            return False
        choices = meta.get("choices")
        return choices is None or in_choices(value, choices)
    if typing.get_origin(tp) is dict:
        value_tp = typing.get_args(tp)[1]
        return isinstance(value, dict) and all(_fits(v, value_tp, meta) for v in value.values())
    return True  # an annotation this check does not know: the dataclass takes it as it is


def in_choices(value: str, choices: Iterable[str]) -> bool:
    """Whether `value` is one of `choices` (a choice "x:N" stands for "x:0", "x:1", ...)."""
    return any(value == c or (c.endswith(":N") and re.fullmatch(re.escape(c[:-1]) + r"\d+", value))
               for c in choices)


def check_value(value: Any, tp: Any, meta: dict[str, Any]) -> str | None:
    """None when `value` fits the setting (type `tp`, range `meta`), else what it must be."""
    if _fits(value, tp, meta):
        return None
    tp, _ = unoptional(tp)
    message = "must be " + _expected(tp, meta)
    choices = meta.get("choices")
    if tp is str and choices and isinstance(value, str):
        close = _close(value, choices)
        if close:
            message += f"; did you mean {show_value(close)}?"
    if tp in (bool, int, float) and isinstance(value, str):
        with_quotes_removed = _unquoted(value)
        if with_quotes_removed is not None and _fits(with_quotes_removed, tp, meta):
            message += f"; write {show_value(with_quotes_removed)} without quotes"
    if meta.get("why"):
        message += f" ({meta['why']})"
    return message


def _unquoted(text: str) -> Any:
    if "\n" in text:
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return None


def check_section(cls: type, where: str, section: Any, skip: Iterable[str] = ()) -> list[str]:
    """The problems of one config table against the dataclass `cls` (unknown keys, wrong types
    or ranges); `where` names it ("[run]"), `skip`: keys checked elsewhere."""
    if not isinstance(section, dict):
        return [f"{where} must be a table (key = value lines under {where}), not "
                f"{show_value(section)}"]
    specs = {f.name: f for f in fields(cls)}
    hints = type_hints(cls)
    problems = []
    for key, value in section.items():
        if key not in specs:
            problems.append(unknown_name(f"{where}: ", "key", key, specs))
        elif key in skip:
            continue
        elif typing.get_origin(hints[key]) is dict and isinstance(value, dict):
            value_tp = typing.get_args(hints[key])[1]  # a sub-table: each of its values
            for sub, item in value.items():
                wrong = check_value(item, value_tp, dict(specs[key].metadata))
                if wrong:
                    problems.append(f"[{where.strip('[]')}.{key}] {sub} = "
                                    f"{show_value(item)}: {wrong}")
        else:
            wrong = check_value(value, hints[key], dict(specs[key].metadata))
            if wrong:
                problems.append(f"{where} {key} = {show_value(value)}: {wrong}")
    return problems


def problem_list(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems)


# The fleet client's settings (models/fleet.py: regenerate's openai backend, extract's and
# train's hidden-states servers): declared once here, each stage's help naming its own `scope`.
FLEET_SETTINGS: dict[str, tuple[Any, dict[str, Any], str]] = {
    "endpoints": ((), {"metavar": "URL,URL", "fingerprint": False},
                  "several servers of one model, comma-separated; each request goes to the "
                  "least loaded healthy one (default: --endpoint)"),
    "served_model": (None, {}, "model name (default: the first the server lists)"),
    "concurrency": (8, {"min": 1, "fingerprint": False}, "requests in flight per server"),
    "timeout_s": (120.0, {"above": 0, "max": 86400, "fingerprint": False},
                  "seconds each read (and the connect) may wait"),
    # bounds a trickling (slow-loris) or endless reply, which per-read timeouts never end
    "request_deadline_s": (600.0, {"above": 0, "max": 86400, "fingerprint": False},
                           "seconds one attempt may take in all (connect, first byte and the "
                           "whole reply); past it the attempt is cut and retried"),
    # with exponential backoff
    "retries": (3, {"min": 0, "fingerprint": False},
                "retries on timeouts, connection errors, 429, 5xx, replies past "
                "request_deadline_s or their size cap, and malformed replies"),
    "cooldown_s": (10.0, {"above": 0, "max": 600, "fingerprint": False},
                   "several endpoints: how long a failed server sits out before its probe"),
}
# (where and how the servers are reached is not what they make: none of it but the served model
# is fingerprinted, so another fleet or more concurrency keeps a run and its cache)


def fleet_setting(name: str, scope: str, **more: Any) -> Any:
    """The `FLEET_SETTINGS` field `name`, its help starting with `scope` (the backend); `more`:
    further `setting` arguments (extract leaves the served model out of its fingerprint)."""
    default, limits, text = FLEET_SETTINGS[name]
    return setting(default, help=f"{scope}: {text}", **{**limits, **more})


def endpoint_list(value: Any) -> tuple[str, ...]:
    """A list setting (`endpoints`, `decontaminate`) as a tuple: from a list, or "A,B" (a TOML
    string, the flag's text); blanks dropped."""
    items = (value or "").split(",") if isinstance(value, str) or not value else value
    return tuple(u.strip() for u in items if u and u.strip())


def fleet_servers(endpoint: str, endpoints: tuple[str, ...]) -> tuple[str, ...]:
    """The fleet's server URLs (/v1 bases, no trailing slash): `endpoints`, else `endpoint`."""
    return tuple(u.rstrip("/") for u in (endpoints or ((endpoint,) if endpoint else ())))


def check_fleet(servers: tuple[str, ...], concurrency: int, cooldown_s: float) -> None:
    """What a settings object's ranges cannot say about a fleet (a flag built one too)."""
    if concurrency < 1:
        raise StageError("--concurrency must be >= 1 (requests in flight per server)")
    if not 0 < cooldown_s <= 600:
        raise StageError("cooldown_s must be in (0, 600] seconds")
    twice = sorted({u for u in servers if servers.count(u) > 1})
    if twice:
        raise StageError(f"--endpoints lists {twice} more than once")


