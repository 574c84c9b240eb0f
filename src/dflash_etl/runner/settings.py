"""A stage's settings for one run: its config section and the command line (core's
`build_settings`), with the [target] model where a setting falls back to it (building the
embedded default's tiny target on first use, which is why this is not core's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_etl.core.config import PipelineConfig, build_settings
from dflash_etl.core.settings import marked
from dflash_etl.core.stage import Stage
from dflash_etl.models.tiny_model import with_target


def stage_settings(stage: type[Stage], config: PipelineConfig | None, run_dir: str | Path,
                   overrides: dict[str, Any]) -> Any:
    """`stage`'s Settings instance (None for a stage without settings)."""
    if stage.Settings is None:
        return None
    section = config.section(stage.name) if config else {}
    for spec in marked(stage.Settings, "target"):
        overrides = with_target(config, run_dir, section, overrides, spec.name)
    return build_settings(stage.Settings, stage.name, section, overrides, config)
