"""pipeline.toml: parsed once into frozen dataclasses so every stage sees the same settings.

The whole file is checked against a schema before any stage runs (`parse_config`): every section
and key must be known (a typo gets a "did you mean"), and every value must have its setting's type
and range. The schema of a section is a settings dataclass: [run] is `RunConfig`, each stage's
section its stage's settings class, which the caller passes (`dflash_etl.stages.load_config`
passes the pipeline's); a field's range or choices are in its metadata (`core.settings.setting`).
`build_settings` makes a stage's settings from its section and the command line.
"""

from __future__ import annotations

import hashlib
import json
import math
import shlex
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError
from dflash_etl.core.settings import (
    check_section,
    check_value,
    flag_name,
    inapplicable,
    marked,
    problem_list,
    setting,
    show_value,
    type_hints,
    unknown_name,
    unoptional,
)

FORMATS = ("auto", "openai", "sharegpt", "alpaca", "orca", "prompt", "parts", "glaive")
FIELD_KEYS = ("messages", "response", "system", "tools", "prompt")


class ConfigError(ValueError):
    """The config file is wrong; the message names the key and what to write instead."""


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
    max_capped_reply_share: float = setting(0.05, min=0, max=1)
    # a setting's range applies to a table's values (`setting` would do, but ruff's RUF009)
    max_quarantine_rate_per_source: dict[str, float] = field(default_factory=dict,
                                                             metadata={"min": 0, "max": 1})


@dataclass(frozen=True)
class TargetSettings:
    """The schema of [target] (models/tiny_model.py reads it and checks `tiny`'s keys)."""

    model: str = ""
    tiny: dict[str, Any] = field(default_factory=dict)


# the sections every pipeline.toml may have besides its stages' and [[sources]]
CORE_SECTIONS: dict[str, type] = {
    "run": RunConfig, "expectations": ExpectationsSettings, "target": TargetSettings,
}


def _section_label(name: str, value: Any = None) -> str:
    if name == "sources" or (isinstance(value, list) and value
                             and all(isinstance(v, dict) for v in value)):
        return f"[[{name}]]"
    return f"[{name}]" if value is None or isinstance(value, dict) else name


def check_schema(data: dict[str, Any], sections: Mapping[str, type]) -> list[str]:
    """Every problem of a parsed pipeline.toml: unknown sections and keys, wrong types, values
    out of range ([[sources]] entries: see `_source`). `sections`: the stages' sections (name ->
    settings class)."""
    schemas = {**CORE_SECTIONS, **sections}
    known = ["run", "sources", *sorted(set(schemas) - {"run"})]
    problems = []
    for name, value in data.items():
        if name == "sources":
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                problems.append("sources must be an array of tables: write [[sources]] (two "
                                "brackets) above each source's keys")
        elif name not in schemas:
            what = "section" if isinstance(value, dict | list) else "top-level key"
            problems.append(unknown_name("", what, name, known, show=_section_label,
                                         label=_section_label(name, value)))
        else:
            problems += check_section(schemas[name], f"[{name}]", value)
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
    hints = type_hints(SourceConfig)
    for key in ("name", "path", "fields"):
        if key in entry and check_value(entry[key], hints[key], {}):
            raise ConfigError(f"{where} {key} = {show_value(entry[key])}: "
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


TINY_LIMITS = {"hidden_size": 4096, "layers": 64, "heads": 64, "kv_heads": 64}


def tiny_target_problems(spec: Any) -> list[str]:
    """What is wrong with [target] tiny's sizes (whole, positive, small: the model is built on
    this machine), checked with the config, before any stage runs."""
    if not isinstance(spec, dict):
        return [f"[target] tiny = {show_value(spec)}: give a table of build arguments"]
    problems = []
    for key, most in TINY_LIMITS.items():
        value = spec.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not 1 <= value <= most):
            problems.append(f"[target] tiny: {key} = {value!r}: give a whole number from 1 to "
                            f"{most} (a tiny random target; name a real one with [target] "
                            "model = \"DIR\")")
    if problems:
        return problems
    hidden, heads = spec.get("hidden_size", 64), spec.get("heads", 4)
    kv_heads = spec.get("kv_heads", 2)
    if hidden % heads or heads % kv_heads:
        problems.append(f"[target] tiny: hidden_size {hidden} must be a multiple of heads "
                        f"{heads}, and heads of kv_heads {kv_heads}")
    if "seed" in spec and (not isinstance(spec["seed"], int) or isinstance(spec["seed"], bool)):
        problems.append(f"[target] tiny: seed = {spec['seed']!r}: give a whole number")
    return problems


def parse_config(data: dict[str, Any], base_dir: Path, *, sections: Mapping[str, type]
                 ) -> PipelineConfig:
    """The checked config (ConfigError naming every unknown section or key and every value of
    the wrong type or out of range); `sections`: the stages' (name -> settings class)."""
    problems = check_schema(data, sections)
    target = data.get("target")
    if isinstance(target, dict) and "tiny" in target:
        problems += tiny_target_problems(target["tiny"])
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
        raise ConfigError(problem_list(problems))
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


def load_config(path: str | Path, *, sections: Mapping[str, type]) -> PipelineConfig:
    """pipeline.toml at `path`, checked against the core sections and the stages' `sections`."""
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
        return parse_config(data, path.resolve().parent, sections=sections)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None




def build_settings(cls: type, stage: str, section: dict[str, Any], overrides: dict[str, Any],
                   config: PipelineConfig | None = None) -> Any:
    """A stage's settings (the dataclass `cls`) from its config section [stage] (`section`) and
    the command line (`overrides`: flags given win over the section; None is not given). With
    the whole `config`: a field marked `inherit` takes the named section's value when neither
    gives it, and `path` values are relative to the config's folder. A `required` field must
    end up set, else the error says how. Unknown keys, and values of the wrong type or out of
    range, are a StageError naming the key or flag. ([target] fallback needs the models:
    `runner.settings.stage_settings`.)"""
    section = dict(section)
    for spec in marked(cls, "inherit"):
        other = config.section(spec.metadata["inherit"]) if config else {}
        if spec.name not in section and not overrides.get(spec.name) \
                and other.get(spec.name) is not None:
            section[spec.name] = other[spec.name]
    given = {k: v for k, v in overrides.items() if v is not None}
    problems = check_section(cls, f"[{stage}]", section, skip=given)
    specs = {f.name: f for f in fields(cls)}
    for key, value in given.items():
        if key not in specs:
            problems.append(unknown_name(f"{stage}: ", "setting", flag_name(key),
                                         [flag_name(k) for k in specs]))
            continue
        wrong = check_value(value, type_hints(cls)[key], dict(specs[key].metadata))
        if wrong:
            as_text = isinstance(value, str) and unoptional(type_hints(cls)[key])[0] is str
            shown = shlex.quote(value) if as_text else show_value(value)
            problems.append(f"{flag_name(key)} {shown}: {wrong}")
    if problems:
        raise StageError(problem_list(problems))
    values = {**section, **given}
    for spec in marked(cls, "path"):
        key = spec.name
        if section.get(key) and config is not None and overrides.get(key) is None:
            values[key] = str((config.base_dir / section[key]).resolve())
    settings = cls(**values)
    if problems := inapplicable(settings, given):
        raise StageError(problem_list(problems))
    for spec in marked(cls, "required"):
        if not getattr(settings, spec.name):
            hint = TARGET_HINT if spec.metadata.get("target") else ""
            raise StageError(f"{stage} needs {spec.metadata['required']}: pass "
                             f"{flag_name(spec.name)} DIR or set [{stage}] {spec.name} = 'DIR' "
                             f"in the config{hint}")
    return settings


TARGET_HINT = " (or [target] model = 'DIR' for regenerate, extract and train at once)"
