"""The runner: the lifecycle every stage goes through (lifecycle.py), its gate (gate.py), a
stage's settings for a run (settings.py) and a pipeline, the stages in order (pipeline.py)."""

from dflash_etl.runner.lifecycle import run_stage
from dflash_etl.runner.pipeline import Pipeline

__all__ = ["Pipeline", "run_stage"]
