"""The gate between a stage's work and its publishing: stats.json, then its output kind's contract
(pandera, or code for hidden states and a drafter) and suite (great-expectations), in this
process. The engines are imported on first use, once per process; `warming_up` lets a batch
stage import them on a thread while its worker processes run."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from dflash_etl.core.rundir import write_json_atomic
from dflash_etl.core.stage import Stage, StageContext
from dflash_etl.validation import suites
from dflash_etl.validation.contracts import validate_output
from dflash_etl.validation.model_outputs import validate_model_output


def gate(stage: Stage, ctx: StageContext, doc: dict[str, Any],
         step: Callable[[str], None] = lambda _: None) -> None:
    """stats.json, then the contract and (where the kind has one) the suite; the suite reads
    only an output that kept its contract. Raises the failing check's error. `step` names
    each check as it starts (the progress a log and `status` show)."""
    write_json_atomic(ctx.partial / "stats.json", doc)
    output = stage.writes
    if output is None:  # a stage outside a pipeline (tests' stand-ins): nothing to check
        return
    params = stage.contract_params(ctx)
    step(f"checking the {output.kind} contract")
    if output.suite is None:
        validate_model_output(output.contract, ctx.partial, params)
        return
    validate_output(output.contract, ctx.partial, params)
    thresholds = (suites.Thresholds.from_config(ctx.config) if ctx.config
                  else suites.Thresholds.from_manifest(ctx.run.root))
    step(f"running the {output.kind} expectation suite")
    suites.gate(stage.name, output.suite, ctx.partial, ctx.run.root, thresholds)


@contextlib.contextmanager
def warming_up(stage: Stage, rank: int = 0) -> Iterator[Callable[[], None]]:
    """What the executor calls once the workers are forked: the gate's imports on a thread (for
    a kind with a suite: pandera and great_expectations), joined on leaving; only on rank 0,
    the one that gates."""
    if stage.writes is None or stage.writes.suite is None or rank != 0:
        yield lambda: None
        return
    with suites.warming_up(("pandera.polars",)) as start:
        yield start
