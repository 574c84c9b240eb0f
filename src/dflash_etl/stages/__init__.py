"""One module per stage; each exposes `run(config, run_dir, ...)` and a `python -m` entry.

`STAGES` is the one list of the pipeline's stages, in pipeline order: the CLI (its subcommands
and their flags, `run`), the report and `check` read it. A record names its module and classes
as strings and imports them on first use, so importing this package stays cheap (no pyarrow,
torch or transformers).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from dflash_etl.core.config import SECTION_SCHEMAS, register_section_loader


@dataclass(frozen=True)
class StageSpec:
    """One stage of the pipeline, as the CLI, `run`, the report and `check` see it."""

    name: str  # the subcommand, the run directory's subdirectory and the manifest's key
    module_path: str  # its module: `python -m <module_path>` runs the stage
    stage_class_name: str  # its `core.stage.Stage` subclass in that module
    settings_class_name: str | None  # its settings dataclass (one CLI flag per field)
    section: str | None  # the pipeline.toml section the settings dataclass is the schema of
    help: str  # the subcommand's help line
    contract: str  # the contract its output is checked against (validation/contracts.py)
    output: str  # what its output directory holds: the shard directory, or a marker file
    suite: str | None = None  # the great-expectations suite that gates it (None: no suite)
    batch: bool = False  # a BatchStage: --workers / --executor / --ray-address apply
    needs_config: bool = False  # refuses to run without --config (nothing else says what to read)
    # `dflash-etl run` runs it when this setting is configured ([<section>] <requires>, or a
    # [target] section when target_fallback), and when the stages in `after` ran
    requires: str | None = None
    target_fallback: bool = False
    after: tuple[str, ...] = ()
    # (setting, section): a setting taken from another stage's section when neither the stage's
    # own section nor its flag gives it (one value for the run, set where users look for it)
    inherits: tuple[tuple[str, str], ...] = ()

    def module(self) -> ModuleType:
        return importlib.import_module(self.module_path)

    @property
    def stage_class(self) -> type:
        return getattr(self.module(), self.stage_class_name)

    @property
    def settings_class(self) -> type | None:
        if self.settings_class_name is None:
            return None
        return getattr(self.module(), self.settings_class_name)


class StageRegistry:
    """The stages in pipeline order; iterate it, or look one up by name."""

    def __init__(self, *specs: StageSpec) -> None:
        self._specs = {s.name: s for s in specs}

    def __iter__(self) -> Iterator[StageSpec]:
        return iter(self._specs.values())

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __getitem__(self, name: str) -> StageSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise KeyError(f"unknown stage {name!r}; known: {', '.join(self._specs)}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def get(self, name: str, default: Any = None) -> Any:
        return self._specs.get(name, default)


STAGES = StageRegistry(
    StageSpec(
        name="ingest", module_path="dflash_etl.stages.ingest", stage_class_name="IngestStage",
        settings_class_name="IngestSettings", section="ingest",
        help="sources -> canonical conversations + quarantine",
        contract="conversations", output="conversations", suite="conversations", batch=True,
        needs_config=True,
    ),
    StageSpec(
        name="regenerate", module_path="dflash_etl.stages.regenerate",
        stage_class_name="RegenerateStage", settings_class_name="RegenerateSettings",
        section="regenerate", help="the target model writes the assistant turns",
        contract="conversations", output="conversations", suite="conversations",
        requires="model", target_fallback=True,
        # replies generated behind the prompt the rows are rendered with
        inherits=(("template_kwargs", "tokenize"),),
    ),
    StageSpec(
        name="tokenize", module_path="dflash_etl.stages.tokenize",
        stage_class_name="TokenizeStage", settings_class_name="TokenizeSettings",
        section="tokenize", help="conversations -> input_ids + verified loss masks",
        contract="tokenized", output="dataset", suite="tokenized", batch=True,
        requires="model",
    ),
    StageSpec(
        name="extract", module_path="dflash_etl.stages.extract",
        stage_class_name="ExtractStage", settings_class_name="ExtractSettings",
        section="extract", help="tokenized rows -> the target's hidden states",
        contract="hidden_states", output="index.parquet", batch=True,
        requires="model", target_fallback=True, after=("tokenize",),
    ),
    StageSpec(
        name="train", module_path="dflash_etl.stages.train", stage_class_name="TrainStage",
        settings_class_name="TrainSettings", section="train",
        help="hidden states -> a DFlash drafter, with its tau",
        contract="drafter", output="drafter/config.json",
        requires="target", target_fallback=True, after=("tokenize",),
    ),
)


def _register_settings() -> None:
    """Import the stage modules whose settings dataclasses are the schemas of their config
    sections (each registers its own), once a config is first checked."""
    for spec in STAGES:
        if spec.section and spec.section not in SECTION_SCHEMAS:
            spec.module()


register_section_loader(_register_settings)
