"""A stage's CLI flags, generated from its settings dataclass: one flag per field.

`--field-name` (plus the field's `flags` aliases), its type from the annotation (int, float, str;
a bool is `--flag/--no-flag`; a tuple takes a comma-separated list; a dict `KEY=JSON`, repeated),
`choices` and the help text
from the field's metadata (`core.config.setting`), the dataclass default shown in the help. Every
flag defaults to None: a flag that is not given leaves the setting to the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable
from typing import Any

from dflash_etl.core.settings import default_of, flag_name, in_choices, type_hints, unoptional


class Choices(tuple):
    """argparse choices where a choice "x:N" also accepts "x:0", "x:1", ... (cuda:N)."""

    def __contains__(self, value: object) -> bool:
        return isinstance(value, str) and in_choices(value, self)


def _comma_list(metavar: str) -> Callable[[str], tuple[str, ...]]:
    def comma_list(text: str) -> tuple[str, ...]:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        if not items:
            raise argparse.ArgumentTypeError(f"give at least one value, comma-separated: "
                                             f"{metavar}")
        return items

    return comma_list


class KeyJson(argparse.Action):
    """`--flag KEY=JSON`, repeatable, into one dict (a dict setting: template kwargs); a value
    that is not JSON is taken as the string it is (`--template-kwarg tone=brief`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        import json

        key, sep, text = str(values).partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentError(self, f"{values!r}: give KEY=VALUE (VALUE as JSON: "
                                         "true, 3, \"text\", [1, 2], {\"a\": 1})")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        merged = dict(getattr(namespace, self.dest) or {})
        merged[key.strip()] = value
        setattr(namespace, self.dest, merged)


def _shown(value: Any) -> str | None:
    """A default as the help shows it; None for an empty one (the help text says what unset
    means)."""
    if value is None or value in ("", ()):
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def field_help(spec: dataclasses.Field[Any]) -> str:
    """The field's help text with its default, escaped for argparse."""
    text = spec.metadata.get("help", "")
    shown = _shown(default_of(spec))
    if shown is not None:
        text = f"{text} (default: {shown})" if text else f"default: {shown}"
    return text.replace("%", "%%")


def flag_names(spec: dataclasses.Field[Any]) -> list[str]:
    return [flag_name(spec.name), *spec.metadata.get("flags", ())]


def add_settings_flags(parser: argparse.ArgumentParser, settings: type, section: str) -> None:
    """One flag per field of the settings dataclass `settings` (the schema of [section])."""
    group = parser.add_argument_group(
        f"[{section}] settings",
        f"each flag overrides [{section}] in the config; a setting neither sets takes the "
        "default shown")
    hints = type_hints(settings)
    for spec in dataclasses.fields(settings):
        tp, _ = unoptional(hints[spec.name])
        meta = spec.metadata
        kwargs: dict[str, Any] = {"dest": spec.name, "default": None, "help": field_help(spec)}
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif tp in (int, float):
            kwargs["type"] = tp
            kwargs.setdefault("metavar", "N" if tp is int else "NUM")
        elif tp is str:
            if meta.get("choices"):
                kwargs["choices"] = Choices(meta["choices"])
        elif typing.get_origin(tp) is tuple:
            kwargs["type"] = _comma_list(meta.get("metavar", "A,B"))
            kwargs.setdefault("metavar", "A,B")
        elif typing.get_origin(tp) is dict:
            kwargs["action"] = KeyJson
            kwargs.setdefault("metavar", "KEY=JSON")
        else:
            raise TypeError(f"{settings.__name__}.{spec.name}: no CLI flag for a {tp} setting; "
                            "give it a type the CLI knows (int, float, str, bool, tuple[str], "
                            "dict)")
        group.add_argument(*flag_names(spec), **kwargs)
