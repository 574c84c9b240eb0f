"""The shell around core's lifecycle: what `core.runner.run_stage` takes from the layers above
core, resolved here once for every stage from the stage registry's declarations:

- its settings: its config section, the command line, and the [target] model where the
  registry says the stage falls back to it;
- the executor its work items run on (local or Ray: --executor / [run] executor);
- its gate: stats.json, then the contract the registry names and, where it gives one, the
  suite, in this process, before the output is published;
- the run's HTML report after each stage."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_etl.core import runner
from dflash_etl.core.config import PipelineConfig
from dflash_etl.core.rundir import write_json_atomic
from dflash_etl.core.stage import Shell, Stage, StageContext
from dflash_etl.executors import get_executor
from dflash_etl.models.tiny_model import with_target
from dflash_etl.stages import STAGES
from dflash_etl.validation import suites
from dflash_etl.validation.contracts import validate_output
from dflash_etl.validation.model_outputs import validate_model_output


def settings_of(stage: str, config: PipelineConfig | None, run_dir: Path,
                overrides: dict[str, Any]) -> Any:
    """A stage's settings dataclass (None for a stage the registry does not know)."""
    spec = STAGES.get(stage)
    if spec is None or spec.settings_class is None:
        return None
    section = config.section(spec.section or spec.name) if config else {}
    if spec.target_fallback and spec.requires:  # its model, unless given: the [target]'s
        overrides = with_target(config, run_dir, section, overrides, spec.requires)
    for key, other in spec.inherits:
        if config and key not in section and not overrides.get(key) \
                and config.section(other).get(key) is not None:
            section = {**section, key: config.section(other)[key]}
    return spec.settings_class.from_sources(section, overrides,
                                            config.base_dir if config else None)


def _gate(ctx: StageContext, doc: dict[str, Any], contract_params: dict[str, Any]) -> None:
    """stats.json, then the contract and the suite the registry names, before the output is
    published (the suite reads only an output that kept its contract). extract's and train's
    contracts (hidden states, a drafter) are code, not a contract file, and have no suite."""
    spec = STAGES.get(ctx.name)
    if spec is None:
        return
    write_json_atomic(ctx.partial / "stats.json", doc)
    if spec.suite is None:
        validate_model_output(spec.contract, ctx.partial, contract_params)
        return
    validate_output(spec.contract, ctx.partial, contract_params)
    thresholds = (suites.Thresholds.from_config(ctx.config) if ctx.config
                  else suites.Thresholds.from_manifest(ctx.run.root))
    suites.gate(ctx.name, ctx.partial, ctx.run.root, thresholds)


def _publish_docs(run_root: Path) -> None:
    from dflash_etl.report import publish_docs  # the report's pages: loaded when one is due

    publish_docs(run_root)


SHELL = Shell(settings=settings_of, executor=get_executor, gate=_gate,
              publish_docs=_publish_docs)


def run_stage(stage: Stage, config: PipelineConfig | None, run_dir: str | Path,
              **options: Any) -> dict[str, Any]:
    """`core.runner.run_stage` with this package's executors, gate and report."""
    return runner.run_stage(stage, config, run_dir, shell=SHELL, **options)


def stage_runner(stage_class: type[Stage]) -> Callable[..., dict[str, Any]]:
    """A stage module's `run(config, run_dir, **options)` (options: force, progress, workers,
    executor, ray_address and the settings)."""
    def run(config: PipelineConfig | None, run_dir: str | Path, **options: Any
            ) -> dict[str, Any]:
        return run_stage(stage_class(), config, run_dir, **options)

    run.__doc__ = (f"Run {stage_class.name} into `run_dir/{stage_class.name}`; returns its stats "
                   "document (`skipped: True` when it was complete for the same inputs).")
    return run
