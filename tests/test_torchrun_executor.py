"""The torchrun executor: any batch stage's work items over the ranks of a launch. Each rank
takes its cost-balanced share (the same on every rank, computed without talking), skips what
was done before, and rank 0 finishes from every item's result in item order: so ingest and
tokenize run under a real `python -m torch.distributed.run` (gloo on CPU) publish what one
process publishes, byte for byte (extract's own launch: test_extract_ddp.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from dflash_etl.core.accounting import Stats
from dflash_etl.core.distributed import assign_by_cost
from dflash_etl.core.rundir import RunDir
from dflash_etl.core.stage import BatchOutput, BatchStage, StageContext, WorkItem, done_result
from dflash_etl.executors import get_executor
from dflash_etl.executors.local import LocalExecutor
from dflash_etl.executors.torchrun import TorchrunExecutor

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "data" / "pipeline.toml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}


class Squares(BatchStage):
    """Item k's rows are k's squares; `setups` counts the workers set up in this process."""

    name = "squares"
    setups = 0

    def setup(self) -> None:
        type(self).setups += 1

    def load(self, item: WorkItem) -> list[int]:
        return list(range(item.payload))

    def process_batch(self, batch: list[int], item: WorkItem) -> BatchOutput:
        rows = pa.table({"x": [v * v for v in batch]}, schema=pa.schema([("x", pa.int64())]))
        empty = pa.table({"x": pa.array([], pa.int64())})
        return BatchOutput(rows, empty, {"s": Stats(rows_in=len(batch), rows_out=len(batch))},
                           {"n": len(batch)})


def _ctx(tmp_path: Path, rank: int = 0, world: int = 1) -> StageContext:
    return StageContext(name="squares", run=RunDir(tmp_path / "run"), config=None,
                        progress=False, rank=rank, world=world)


def test_each_rank_gets_a_balanced_share_and_every_item_once():
    costs = [50, 10, 40, 30, 30, 20, 5]
    shares = assign_by_cost(costs, 3)
    assert sorted(n for share in shares for n in share) == list(range(len(costs)))
    loads = [sum(costs[n] for n in share) for share in shares]
    assert max(loads) - min(loads) <= max(costs)
    assert shares == assign_by_cost(costs, 3)  # every rank computes the same


def test_one_rank_runs_every_item_and_resumes_without_setting_up(tmp_path):
    """world 1: the executor is one process that does everything; a second map finds every
    item done and neither sets the stage up (a model load) nor runs an item again, and its
    results are the local executor's."""
    work = tmp_path / "units"
    work.mkdir()
    items = [WorkItem(k, k + 1, cost=k + 1) for k in range(5)]
    Squares.setups = 0
    first = TorchrunExecutor().map(Squares(), _ctx(tmp_path), items, work)
    assert [r["index"] for r in first] == list(range(5))
    assert [r["n"] for r in first] == [1, 2, 3, 4, 5]
    assert Squares.setups == 1
    stamps = {p.name: p.stat().st_mtime_ns for p in work.iterdir()}
    again = TorchrunExecutor().map(Squares(), _ctx(tmp_path), items, work)
    assert again == first and Squares.setups == 1
    assert {p.name: p.stat().st_mtime_ns for p in work.iterdir()} == stamps
    other = tmp_path / "local-units"
    other.mkdir()
    assert LocalExecutor().map(Squares(), _ctx(tmp_path), items, other) == first


def test_a_rank_runs_only_its_share(tmp_path, monkeypatch):
    """Rank 1 of 2 (the agreement stubbed: no process group here) writes exactly the items the
    assignment gives it, and returns nothing: rank 0 alone finishes."""
    from dflash_etl.executors import torchrun

    monkeypatch.setattr(torchrun, "agree", lambda error, world, stage: None)
    work = tmp_path / "units"
    work.mkdir()
    items = [WorkItem(k, 3, cost=c) for k, c in enumerate([9, 1, 8, 2, 7])]
    assert TorchrunExecutor().map(Squares(), _ctx(tmp_path, 1, 2), items, work) == []
    mine = assign_by_cost([i.cost for i in items], 2)[1]
    written = [k for k in range(5) if done_result(work, k) is not None]
    assert written == mine and 0 < len(mine) < 5


def test_rank_zero_names_an_item_no_rank_left(tmp_path, monkeypatch):
    from dflash_etl.core.errors import StageError
    from dflash_etl.executors import torchrun

    monkeypatch.setattr(torchrun, "agree", lambda error, world, stage: None)
    work = tmp_path / "units"
    work.mkdir()
    items = [WorkItem(k, 2, cost=1) for k in range(4)]
    with pytest.raises(StageError, match=r"work item [13]'s files .* rerun to redo it"):
        TorchrunExecutor().map(Squares(), _ctx(tmp_path, 0, 2), items, work)


def test_under_a_launch_the_ranks_are_the_executor(tmp_path):
    ctx = _ctx(tmp_path, 1, 4)
    ctx.executor = "ray"  # a launch's ranks are the workers, whatever the setting
    assert isinstance(get_executor(ctx), TorchrunExecutor)
    assert isinstance(get_executor(_ctx(tmp_path)), LocalExecutor)


def _data_files(run: Path, stage: str) -> dict[str, bytes]:
    out = run / stage
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in {"files.json", "validation.json"}}


def _torchrun(stage: str, run_dir: Path) -> subprocess.CompletedProcess[Any]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "--", "dflash_etl", stage, "--config", str(CONFIG), "--run",
         str(run_dir)],
        capture_output=True, text=True, env=ENV, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo on Linux")
def test_ingest_and_tokenize_on_two_ranks_equal_one_process(default_tokenized, tmp_path):
    """The embedded default, ingested and tokenized by 2 torchrun ranks (each its share of
    ingest's units and tokenize's chunks): the same files as one process's."""
    pytest.importorskip("torch")
    run_dir = tmp_path / "run"
    for stage in ("ingest", "tokenize"):
        done = _torchrun(stage, run_dir)
        assert done.returncode == 0, done.stderr[-3000:]
    reference = default_tokenized  # the same config, in one process
    for stage in ("ingest", "tokenize"):
        ours, theirs = _data_files(run_dir, stage), _data_files(reference, stage)
        assert sorted(ours) == sorted(theirs)
        assert [n for n in ours if ours[n] != theirs[n]] == [], stage
    manifest = RunDir(run_dir).manifest()["stages"]
    assert manifest["ingest"]["status"] == manifest["tokenize"]["status"] == "complete"


def test_ray_actors_are_sized_from_the_stages_resources():
    from dflash_etl.executors.ray import actors_fitting

    assert actors_fitting({"CPU": 8.0}, 1, 0) == 8  # a CPU stage: one actor per CPU
    assert actors_fitting({"CPU": 8.0, "GPU": 2.0}, 1, 1) == 2  # a replica per GPU
    assert actors_fitting({"CPU": 8.0, "GPU": 4.0}, 4, 1) == 2  # the CPUs run out first
    assert actors_fitting({"CPU": 8.0}, 1, 1) == 1  # no GPU yet: one, which Ray waits for


class Pids(Squares):
    """Squares that say which process ran each item."""

    def process_batch(self, batch, item):
        out = super().process_batch(batch, item)
        out.extra["pid"] = os.getpid()
        return out


class OneReplica(Pids):
    """Pids whose worker holds a model replica (extract's declaration)."""

    def resources(self):
        from dflash_etl.core.stage import Resources

        return Resources(cpus=1, gpus=1, local_workers=1)


def test_a_stage_holding_a_replica_runs_in_this_process_whatever_workers_says(tmp_path):
    ctx = _ctx(tmp_path)
    ctx.workers = 3
    items = [WorkItem(k, 2) for k in range(6)]
    runs = {}
    for stage in (OneReplica(), Pids()):
        work = tmp_path / type(stage).__name__
        work.mkdir()
        runs[type(stage).__name__] = {r["pid"] for r in
                                      LocalExecutor().map(stage, ctx, items, work)}
    assert runs["OneReplica"] == {os.getpid()}
    assert os.getpid() not in runs["Pids"]  # uncapped: the forked pool's workers


def test_run_options_are_resolved_in_one_place(tmp_path):
    """The command line over the stage's section over [run]; unset: the defaults."""
    from dflash_etl.core.stage import RunOptions
    from dflash_etl.stages import load_config

    (tmp_path / "pipeline.toml").write_text(
        '[run]\nworkers = 3\nexecutor = "ray"\nray_address = "auto"\n\n'
        '[[sources]]\nname = "a"\npath = "a.jsonl"\n\n'
        '[extract]\nlauncher = "torchrun"\nnproc_per_node = 2\n')
    config = load_config(tmp_path / "pipeline.toml")
    assert RunOptions.resolve(config, "extract", {}) == RunOptions(3, "ray", "auto", "torchrun", 2)
    given = {"workers": 1, "executor": "local", "launcher": "none", "nproc_per_node": None}
    assert RunOptions.resolve(config, "extract", given) == RunOptions(1, "local", "auto", "none",
                                                                      2)
    assert RunOptions.resolve(config, "train", {}).launcher == "none"  # [extract]'s only
    assert RunOptions.resolve(None, "extract", {}) == RunOptions()
