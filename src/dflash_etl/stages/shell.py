"""The shell around core's lifecycle: what `core.runner.run_stage` takes from the layers above
core, resolved here once for every stage: the executor a batch stage's items run on (local or
Ray, from --executor / [run] executor), the suite helper's early start for a stage the registry
gives a suite, and the run's HTML report after each stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_etl.core import runner
from dflash_etl.core.config import PipelineConfig
from dflash_etl.core.stage import Shell, Stage
from dflash_etl.executors import get_executor
from dflash_etl.stages import STAGES
from dflash_etl.validation import suite_helper


def _start_gate(stage: str) -> None:
    """A stage with a great-expectations suite: its helper imports GE on an idle core while
    the stage does its first, single-core work."""
    spec = STAGES.get(stage)
    if spec is not None and spec.suite:
        suite_helper.start()


def _publish_docs(run_root: Path) -> None:
    from dflash_etl.report import publish_docs  # the report's pages: loaded when one is due

    publish_docs(run_root)


SHELL = Shell(executor=get_executor, start_gate=_start_gate, publish_docs=_publish_docs)


def run_stage(stage: Stage, config: PipelineConfig | None, run_dir: str | Path,
              **options: Any) -> dict[str, Any]:
    """`core.runner.run_stage` with this package's executors, gate and report."""
    return runner.run_stage(stage, config, run_dir, shell=SHELL, **options)
