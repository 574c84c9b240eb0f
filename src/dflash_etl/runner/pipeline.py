"""A pipeline: its stages in order, and everything derived from that list. A stage is declared
once, on its class (core/stage.py); its place here says where its inputs come from (the stages
before it that write the kinds it reads). The CLI, `dflash-etl run`, the config's schema and the
readers of a finished run take it from here."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dflash_etl.core.config import PipelineConfig, load_config, parse_config
from dflash_etl.core.outputs import Output
from dflash_etl.core.rundir import RunDir
from dflash_etl.core.settings import marked
from dflash_etl.core.stage import Stage, StageContext
from dflash_etl.runner.lifecycle import run_stage

RUN_OPTIONS = ("force", "progress", "workers", "executor", "ray_address")


class Pipeline:
    """The stages in order; iterate it, or look one up by name."""

    def __init__(self, *stages: type[Stage]) -> None:
        names = [s.name for s in stages]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"a pipeline names each stage once; twice: {twice}")
        unchecked = [s.__name__ for s in stages if s.writes is None or s.Settings is None]
        if unchecked:  # what a pipeline's stage publishes passes its kind's contract
            raise ValueError(f"{unchecked}: a pipeline's stage declares `writes` (its kind of "
                             "output) and `Settings` (its config section)")
        self.stages = stages

    def __iter__(self) -> Iterator[type[Stage]]:
        return iter(self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    def __contains__(self, name: object) -> bool:
        return any(s.name == name for s in self.stages)

    def __getitem__(self, name: str) -> type[Stage]:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"unknown stage {name!r}; known: {', '.join(self.names())}")

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    # ------------------------------------------------------------ the config
    def sections(self) -> dict[str, type]:
        """Each stage's config section and its schema, the stage's settings class."""
        return {s.name: s.Settings for s in self.stages if s.Settings is not None}

    def load_config(self, path: str | Path) -> PipelineConfig:
        """pipeline.toml, every section checked (the stages' against their settings)."""
        return load_config(path, sections=self.sections())

    def parse_config(self, data: dict[str, Any], base_dir: Path) -> PipelineConfig:
        return parse_config(data, base_dir, sections=self.sections())

    def configured(self, config: PipelineConfig, stage: type[Stage]) -> bool:
        """Whether the config gives `stage` what it cannot run without (its `required`
        settings: a model, a tokenizer), in its section or by [target] where that stands for
        it: `dflash-etl run` runs only the stages it configures."""
        required = marked(stage.Settings, "required") if stage.Settings else []
        return all(config.section(stage.name).get(spec.name)
                   or (spec.metadata.get("target") and config.section("target"))
                   for spec in required)

    # ------------------------------------------------------------ running a stage
    def upstream(self, name: str) -> tuple[tuple[str, str], ...]:
        """(stage, kind of output it writes) of the stages before `name`, in order."""
        before = self.names().index(self[name].name)
        return tuple((s.name, s.writes.kind) for s in self.stages[:before] if s.writes)

    def run(self, name: str, config: PipelineConfig | None, run_dir: str | Path,
            **options: Any) -> dict[str, Any]:
        """Run stage `name` into `run_dir/<name>`; returns its stats document (`skipped: True`
        when it was complete for the same inputs). `options`: force, progress, workers,
        executor, ray_address, the stage's settings (None: not given), and the keywords its
        class takes (regenerate's `generator`: a backend instance)."""
        stage = self[name]
        settings = {f.name for f in dataclasses.fields(stage.Settings)} if stage.Settings else ()
        run_options = {k: options.pop(k) for k in list(options) if k in RUN_OPTIONS}
        takes = inspect.signature(stage).parameters  # what its class is built with (generator)
        built = {k: options.pop(k) for k in list(options) if k in takes and k not in settings}
        planned = stage.dry_run(StageContext(
            name=name, run=RunDir(run_dir), config=config, progress=run_options.get("progress"),
            upstream=self.upstream(name)), options)
        if planned is not None:
            return planned
        return run_stage(stage(**built), config, run_dir, upstream=self.upstream(name),
                         **run_options, **options)

    def runner(self, name: str) -> Callable[..., dict[str, Any]]:
        """`run` for one stage: the `run(config, run_dir, **options)` of its module."""
        def run(config: PipelineConfig | None, run_dir: str | Path, **options: Any
                ) -> dict[str, Any]:
            return self.run(name, config, run_dir, **options)

        run.__doc__ = (f"Run {name} into `run_dir/{name}`; returns its stats document "
                       "(`skipped: True` when it was complete for the same inputs). Options: "
                       "force, progress, workers, executor, ray_address and its settings.")
        return run

    def writer(self, kind: type[Output]) -> str:
        """The last stage that writes `kind`: the one to run for a reader that lacks it."""
        return next(s.name for s in reversed(self.stages) if s.writes is kind)
