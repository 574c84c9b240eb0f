"""pipeline.toml: parsed once into frozen dataclasses so every stage sees the same settings."""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError

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
    seed: int = 0
    dedup: bool = True
    shard_rows: int = 100_000
    max_line_bytes: int = 16 * 1024 * 1024
    workers: int = 0  # 0: one per core
    max_quarantine_rate: float = 0.05
    executor: str = "local"  # or "ray": the CPU stages' work items on a Ray cluster (Ray Data)
    ray_address: str | None = None  # "auto", "HOST:PORT"; default: start a local Ray


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


def _source(entry: dict[str, Any], index: int) -> SourceConfig:
    where = f"[[sources]] #{index + 1}"
    unknown = set(entry) - {"name", "path", "format", "max_rows", "weight", "fields"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    if "path" not in entry:
        raise ConfigError(f"{where}: 'path' is required (a file, a directory or a glob)")
    name = str(entry.get("name") or Path(str(entry["path"])).stem)
    fmt = entry.get("format", "auto")
    if fmt not in FORMATS:
        raise ConfigError(f"{where} ({name!r}): format={fmt!r}; use one of {list(FORMATS)}")
    max_rows = entry.get("max_rows")
    weight = entry.get("weight")
    if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 0):
        raise ConfigError(f"{where} ({name!r}): max_rows must be a non-negative integer")
    if weight is not None and (not isinstance(weight, int | float) or weight <= 0):
        raise ConfigError(f"{where} ({name!r}): weight must be a positive number")
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


def parse_config(data: dict[str, Any], base_dir: Path) -> PipelineConfig:
    run_section = data.get("run", {})
    known_run = set(RunConfig.__dataclass_fields__)
    unknown = set(run_section) - known_run
    if unknown:
        raise ConfigError(f"[run]: unknown keys {sorted(unknown)}; known: {sorted(known_run)}")
    sources = tuple(_source(e, i) for i, e in enumerate(data.get("sources", [])))
    if not sources:
        raise ConfigError("no [[sources]] in the config: add at least one source with a path")
    names = [s.name for s in sources]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ConfigError(f"source names must be unique; repeated: {sorted(dupes)}")
    return PipelineConfig(
        run=RunConfig(**run_section), sources=sources, base_dir=base_dir, raw=dict(data)
    )


def load_config(path: str | Path) -> PipelineConfig:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return parse_config(data, path.resolve().parent)


TARGET_HINT = " (or [target] model = 'DIR' for regenerate, extract and train at once)"


def stage_settings(cls: type, stage: str, section: dict[str, Any], overrides: dict[str, Any],
                   base_dir: Path | None, paths: tuple[str, ...], required: str, need: str,
                   hint: str = "") -> Any:
    """A stage's settings dataclass from its config section and the command line (flags that
    were given win); `paths` in the config are relative to it; `required` must end up set, else
    the error says how (`need`: what it is)."""
    known = {f.name for f in fields(cls)}
    unknown = set(section) - known
    if unknown:
        raise StageError(f"[{stage}]: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    values = {**section, **{k: v for k, v in overrides.items() if v is not None}}
    for key in paths:
        if section.get(key) and base_dir is not None and overrides.get(key) is None:
            values[key] = str((base_dir / section[key]).resolve())
    settings = cls(**values)
    if not getattr(settings, required):
        flag = "--" + required.replace("_", "-")
        raise StageError(f"{stage} needs {need}: pass {flag} DIR or set [{stage}] {required} = "
                         f"'DIR' in the config{hint}")
    return settings
