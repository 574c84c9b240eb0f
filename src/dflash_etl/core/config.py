"""pipeline.toml: parsed once into frozen dataclasses so every stage sees the same settings.

The whole file is checked against a schema before any stage runs (`parse_config`): every section
and key must be known (a typo gets a "did you mean"), and every value must have its setting's type
and range. The schema of a section is a settings dataclass: [run] is `RunConfig`, each stage's
section the dataclass its module registers with `register_section`; a field's range or choices
are in its metadata (`setting`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
import shlex
import tomllib
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError

FORMATS = ("auto", "openai", "sharegpt", "alpaca", "orca", "prompt", "parts", "glaive")
FIELD_KEYS = ("messages", "response", "system", "tools", "prompt")


class ConfigError(ValueError):
    """The config file is wrong; the message names the key and what to write instead."""


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
            min: float | None = None, max: float | None = None, above: float | None = None,
            choices: Iterable[str] | None = None, why: str | None = None,
            help: str | None = None, flags: Iterable[str] = (), metavar: str | None = None
            ) -> Any:
    """A settings dataclass field with the range its value must be in: `min` <= value <= `max`,
    value > `above`, value in `choices` (a choice "x:N" also accepts "x:0", "x:1", ...); `why`
    is added to the error message. For a dict field the range applies to its values.

    `help` is what the setting does (the CLI flag's help; the default is added to it), `flags`
    extra names of the flag (`--eot` for include_eot also gives `--no-eot`), `metavar` how its
    help writes the value."""
    meta = {"min": min, "max": max, "above": above, "why": why,
            "choices": tuple(choices) if choices is not None else None,
            "help": help, "flags": tuple(flags) or None, "metavar": metavar}
    meta = {k: v for k, v in meta.items() if v is not None}
    if default_factory is not dataclasses.MISSING:  # a dict or list: out of the hash, as
        # a frozen settings object stays hashable (equality still compares it)
        return field(default_factory=default_factory, metadata=meta, hash=False)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class SourceConfig:
    name: str
    path: str
    format: str = "auto"
    max_rows: int | None = None
    weight: float | None = None
    fields: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunConfig:
    seed: int = setting(0, min=0)
    dedup: bool = True
    shard_rows: int = setting(100_000, min=1)
    max_line_bytes: int = setting(16 * 1024 * 1024, min=1)
    workers: int = setting(0, min=0)  # 0: one per core
    max_quarantine_rate: float = setting(0.05, min=0, max=1)
    # "ray": the CPU stages' work items on a Ray cluster (Ray Data)
    executor: str = setting("local", choices=("local", "ray"))
    ray_address: str | None = None  # "auto", "HOST:PORT"; default: start a local Ray


@dataclass(frozen=True)
class ExpectationsSettings:
    """The schema of [expectations] (validation/suites.py `Thresholds` parses it; its DEFAULTS
    are the defaults)."""

    max_quarantine_rate: float = setting(0.05, min=0, max=1)
    share_tolerance: float = setting(0.05, min=0, max=1)
    min_mean_supervised_fraction: float = setting(0.05, min=0, max=1)
    max_mean_supervised_fraction: float = setting(0.95, min=0, max=1)
    # a setting's range applies to a table's values (`setting` would do, but ruff's RUF009)
    max_quarantine_rate_per_source: dict[str, float] = field(default_factory=dict,
                                                             metadata={"min": 0, "max": 1})


@dataclass(frozen=True)
class TargetSettings:
    """The schema of [target] (models/tiny_model.py reads it and checks `tiny`'s keys)."""

    model: str = ""
    tiny: dict[str, Any] = field(default_factory=dict)


# section name -> its settings dataclass; the stage modules add theirs (register_section).
SECTION_SCHEMAS: dict[str, type] = {
    "run": RunConfig, "expectations": ExpectationsSettings, "target": TargetSettings,
}


def register_section(name: str, settings_cls: type) -> type:
    """Make `settings_cls` the schema of the config section [name]."""
    SECTION_SCHEMAS[name] = settings_cls
    return settings_cls


# what registers the rest on first use: the stage registry (dflash_etl.stages) adds the import
# of the stage modules here, so core knows their sections without importing a stage
_SECTION_LOADERS: list[Callable[[], None]] = []


def register_section_loader(load: Callable[[], None]) -> None:
    """`load()` registers more sections (`register_section`); it runs before a config's sections
    are checked."""
    _SECTION_LOADERS.append(load)


def _ensure_registered() -> None:
    for load in _SECTION_LOADERS:
        load()


# ---------------------------------------------------------------- schema checks
def _show(value: Any) -> str:
    """A value as it is written in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_show(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


def _flag(key: str) -> str:
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
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unoptional(tp: Any) -> tuple[Any, bool]:
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
    tp, _ = _unoptional(tp)
    if tp is bool:
        return "true or false (a TOML boolean, without quotes)"
    if tp is int:
        return "an integer" + _bounds(meta)
    if tp is float:
        return "a number" + _bounds(meta)
    if tp is str:
        choices = meta.get("choices")
        return f"one of {', '.join(_show(c) for c in choices)}" if choices else "a string"
    if typing.get_origin(tp) is dict:
        value_tp = typing.get_args(tp)[1]
        return "a table" if value_tp is Any else f"a table of {_plural(value_tp, meta)}"
    return str(tp)


def _plural(tp: Any, meta: dict[str, Any]) -> str:
    words = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
    text = words.get(tp, str(tp))
    return text + _bounds(meta) if tp in (int, float) else text


def _fits(value: Any, tp: Any, meta: dict[str, Any]) -> bool:
    tp, optional = _unoptional(tp)
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
    tp, _ = _unoptional(tp)
    message = "must be " + _expected(tp, meta)
    choices = meta.get("choices")
    if tp is str and choices and isinstance(value, str):
        close = _close(value, choices)
        if close:
            message += f"; did you mean {_show(close)}?"
    if tp in (bool, int, float) and isinstance(value, str):
        with_quotes_removed = _unquoted(value)
        if with_quotes_removed is not None and _fits(with_quotes_removed, tp, meta):
            message += f"; write {_show(with_quotes_removed)} without quotes"
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
                f"{_show(section)}"]
    specs = {f.name: f for f in fields(cls)}
    hints = _hints(cls)
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
                    problems.append(f"[{where.strip('[]')}.{key}] {sub} = {_show(item)}: {wrong}")
        else:
            wrong = check_value(value, hints[key], dict(specs[key].metadata))
            if wrong:
                problems.append(f"{where} {key} = {_show(value)}: {wrong}")
    return problems


def _section_label(name: str, value: Any = None) -> str:
    if name == "sources" or (isinstance(value, list) and value
                             and all(isinstance(v, dict) for v in value)):
        return f"[[{name}]]"
    return f"[{name}]" if value is None or isinstance(value, dict) else name


def check_schema(data: dict[str, Any]) -> list[str]:
    """Every problem of a parsed pipeline.toml: unknown sections and keys, wrong types, values
    out of range ([[sources]] entries: see `_source`)."""
    _ensure_registered()
    known = ["run", "sources", *sorted(set(SECTION_SCHEMAS) - {"run"})]
    problems = []
    for name, value in data.items():
        if name == "sources":
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                problems.append("sources must be an array of tables: write [[sources]] (two "
                                "brackets) above each source's keys")
        elif name not in SECTION_SCHEMAS:
            what = "section" if isinstance(value, dict | list) else "top-level key"
            problems.append(unknown_name("", what, name, known, show=_section_label,
                                         label=_section_label(name, value)))
        else:
            problems += check_section(SECTION_SCHEMAS[name], f"[{name}]", value)
    return problems


@dataclass(frozen=True)
class PipelineConfig:
    run: RunConfig
    sources: tuple[SourceConfig, ...]
    base_dir: Path
    raw: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": asdict(self.run),
            "sources": [asdict(s) for s in self.sources],
            "base_dir": str(self.base_dir),
            "sections": {k: v for k, v in self.raw.items() if k not in ("run", "sources")},
        }

    def digest(self) -> str:
        """Hash of the effective settings (not of the file's formatting or comments)."""
        payload = self.to_dict()
        payload.pop("base_dir")
        text = json.dumps(payload, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.raw.get(name, {}))


SOURCE_KEYS = tuple(f.name for f in fields(SourceConfig))


def _source(entry: dict[str, Any], index: int) -> SourceConfig:
    where = f"[[sources]] #{index + 1}"
    unknown = [k for k in entry if k not in SOURCE_KEYS]
    if unknown:
        raise ConfigError("; ".join(unknown_name(f"{where}: ", "key", k, SOURCE_KEYS)
                                    for k in unknown))
    if "path" not in entry:
        raise ConfigError(f"{where}: 'path' is required (a file, a directory or a glob)")
    hints = _hints(SourceConfig)
    for key in ("name", "path", "fields"):
        if key in entry and check_value(entry[key], hints[key], {}):
            raise ConfigError(f"{where} {key} = {_show(entry[key])}: "
                              f"{check_value(entry[key], hints[key], {})}")
    name = str(entry.get("name") or Path(str(entry["path"])).stem)
    fmt = entry.get("format", "auto")
    if fmt not in FORMATS:
        raise ConfigError(f"{where} ({name!r}): format={fmt!r}; use one of {list(FORMATS)}")
    max_rows = entry.get("max_rows")
    weight = entry.get("weight")
    if max_rows is not None and (not isinstance(max_rows, int) or isinstance(max_rows, bool)
                                 or max_rows < 1):
        raise ConfigError(f"{where} ({name!r}): max_rows = {max_rows!r}: give a whole number of "
                          "rows, 1 or more (max_rows = 0 would keep none of the source: remove "
                          "the source instead)")
    if weight is not None and (not isinstance(weight, int | float) or isinstance(weight, bool)
                               or not math.isfinite(weight) or weight <= 0):
        raise ConfigError(f"{where} ({name!r}): weight must be a positive number, and finite")
    fields = entry.get("fields", {})
    bad = set(fields) - set(FIELD_KEYS)
    if bad:
        raise ConfigError(
            f"{where} ({name!r}): unknown [sources.fields] keys {sorted(bad)}; known: {FIELD_KEYS}"
        )
    return SourceConfig(
        name=name,
        path=str(entry["path"]),
        format=fmt,
        max_rows=max_rows,
        weight=float(weight) if weight is not None else None,
        fields={k: str(v) for k, v in fields.items()},
    )


def _problems(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems)


def parse_config(data: dict[str, Any], base_dir: Path) -> PipelineConfig:
    """The checked config (ConfigError naming every unknown section or key and every value of
    the wrong type or out of range)."""
    problems = check_schema(data)
    sources = []
    entries = data.get("sources", [])
    for index, entry in enumerate(entries if isinstance(entries, list) else []):
        if not isinstance(entry, dict):
            continue  # check_schema said so
        try:
            sources.append(_source(entry, index))
        except ConfigError as exc:
            problems.append(str(exc))
    if not entries and not any("did you mean [[sources]]" in p for p in problems):
        problems.append("no [[sources]] in the config: add at least one source with a path")
    names = [s.name for s in sources]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        problems.append(f"source names must be unique; repeated: {sorted(dupes)}")
    per_source = data.get("expectations", {})
    per_source = per_source.get("max_quarantine_rate_per_source") \
        if isinstance(per_source, dict) else None
    if isinstance(per_source, dict) and sources and len(sources) == len(entries):
        problems += [unknown_name("[expectations.max_quarantine_rate_per_source]: ", "source",
                                  k, names) for k in per_source if k not in names]
    if problems:
        raise ConfigError(_problems(problems))
    return PipelineConfig(
        run=RunConfig(**data.get("run", {})), sources=tuple(sources), base_dir=base_dir,
        raw=dict(data),
    )


PACKAGE_DIR = Path(__file__).resolve().parents[1]
CHECKOUT = PACKAGE_DIR.parents[1]  # the repository, when the package runs from its src/


def project_path(name: str) -> Path:
    """contracts/, expectations/ or data/ (or a file in them): the checkout's own, their one
    source, or once installed from a wheel the copy its build hook bundled (setup.py)."""
    if (CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / name).exists():
        return CHECKOUT / name
    return PACKAGE_DIR / "_bundled" / name


DEFAULT_CONFIG = project_path("data/pipeline.toml")  # the embedded default


def load_config(path: str | Path) -> PipelineConfig:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8: byte {exc.start} (line {line}) is "
                          f"{raw[exc.start:exc.end]!r} ({exc.reason}); save the file as "
                          "UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        return parse_config(data, path.resolve().parent)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


# The fleet client's settings (models/fleet.py: regenerate's openai backend, extract's and
# train's hidden-states servers): declared once here, each stage's help naming its own `scope`.
FLEET_SETTINGS: dict[str, tuple[Any, dict[str, Any], str]] = {
    "endpoints": ((), {"metavar": "URL,URL"},
                  "several servers of one model, comma-separated; each request goes to the "
                  "least loaded healthy one (default: --endpoint)"),
    "served_model": (None, {}, "model name (default: the first the server lists)"),
    "concurrency": (8, {"min": 1}, "requests in flight per server"),
    "timeout_s": (120.0, {"above": 0}, "seconds each read (and the connect) may wait"),
    # bounds a trickling (slow-loris) or endless reply, which per-read timeouts never end
    "request_deadline_s": (600.0, {"above": 0},
                           "seconds one attempt may take in all (connect, first byte and the "
                           "whole reply); past it the attempt is cut and retried"),
    # with exponential backoff
    "retries": (3, {"min": 0}, "retries on timeouts, connection errors, 429, 5xx, replies past "
                               "request_deadline_s or their size cap, and malformed replies"),
    "cooldown_s": (10.0, {"above": 0, "max": 600},
                   "several endpoints: how long a failed server sits out before its probe"),
}


def fleet_setting(name: str, scope: str) -> Any:
    """The `FLEET_SETTINGS` field `name`, its help starting with `scope` (the backend)."""
    default, limits, text = FLEET_SETTINGS[name]
    return setting(default, help=f"{scope}: {text}", **limits)


def endpoint_list(value: Any) -> tuple[str, ...]:
    """`endpoints` as a tuple of URLs: from a list, or "URL,URL" (a TOML string, the flag's
    text); blanks dropped."""
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


TARGET_HINT = " (or [target] model = 'DIR' for regenerate, extract and train at once)"


def stage_settings(cls: type, stage: str, section: dict[str, Any], overrides: dict[str, Any],
                   base_dir: Path | None, paths: tuple[str, ...], required: str, need: str,
                   hint: str = "") -> Any:
    """A stage's settings dataclass from its config section and the command line (flags that
    were given win); `paths` in the config are relative to it; `required` must end up set, else
    the error says how (`need`: what it is). Unknown keys, and values (the config's or the
    flags') of the wrong type or out of range, are a StageError naming the key or flag."""
    given = {k: v for k, v in overrides.items() if v is not None}
    problems = check_section(cls, f"[{stage}]", section, skip=given)
    specs = {f.name: f for f in fields(cls)}
    for key, value in given.items():
        if key not in specs:
            problems.append(unknown_name(f"{stage}: ", "setting", _flag(key),
                                         [_flag(k) for k in specs]))
            continue
        wrong = check_value(value, _hints(cls)[key], dict(specs[key].metadata))
        if wrong:
            as_text = isinstance(value, str) and _unoptional(_hints(cls)[key])[0] is str
            shown = shlex.quote(value) if as_text else _show(value)
            problems.append(f"{_flag(key)} {shown}: {wrong}")
    if problems:
        raise StageError(_problems(problems))
    values = {**section, **given}
    for key in paths:
        if section.get(key) and base_dir is not None and overrides.get(key) is None:
            values[key] = str((base_dir / section[key]).resolve())
    settings = cls(**values)
    if not getattr(settings, required):
        flag = _flag(required)
        raise StageError(f"{stage} needs {need}: pass {flag} DIR or set [{stage}] {required} = "
                         f"'DIR' in the config{hint}")
    return settings
