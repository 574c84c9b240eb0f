"""The pipeline's stages, one module each, and their order: `PIPELINE`.

Everything about a stage is declared on its class (stages/<name>.py); its place in `PIPELINE` is
the one other line a new stage needs. From this list come the CLI's subcommands and their flags,
`dflash-etl run`, the config's schema (`load_config`), where each stage reads its inputs from,
and each stage module's `run(config, run_dir, **options)`, the Python API:

    from dflash_etl.stages import load_config, tokenize
    tokenize.run(load_config("pipeline.toml"), "runs/x", seq_length=8192)
"""

from __future__ import annotations

import sys

from dflash_etl.runner import Pipeline
from dflash_etl.stages.extract import ExtractStage
from dflash_etl.stages.ingest import IngestStage
from dflash_etl.stages.regenerate import RegenerateStage
from dflash_etl.stages.tokenize import TokenizeStage
from dflash_etl.stages.train import TrainStage

PIPELINE = Pipeline(IngestStage, RegenerateStage, TokenizeStage, ExtractStage, TrainStage)

load_config = PIPELINE.load_config
parse_config = PIPELINE.parse_config

# each stage module's `run`, made here from the one list rather than declared in every module
for _stage in PIPELINE:
    sys.modules[_stage.__module__].run = PIPELINE.runner(_stage.name)  # type: ignore[attr-defined]

__all__ = ["PIPELINE", "load_config", "parse_config"]
