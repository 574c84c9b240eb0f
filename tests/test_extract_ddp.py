"""Data-parallel extract under torchrun (gloo on CPU, real `python -m torch.distributed.run`
subprocesses) on a tiny random-weight target and the embedded default's tokenized rows: every
rank extracts its token-balanced share of the shards, rank 0 merges and publishes, and the output
is byte-identical to one process's; a rank killed or failing fails the run loudly and leaves it
resumable, by any number of ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dflash_etl.core.distributed import assign_by_cost as assign_shards
from dflash_etl.models.batching import shard_cost, shard_plan
from dflash_etl.stages import extract, load_config

REPO = Path(__file__).resolve().parents[1]
SHARD_ROWS = 16  # several shards per rank on the default data
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo on Linux")


@pytest.fixture(scope="module")
def one_process(tiny_target, default_tokenized, tmp_path_factory, copy_run) -> Path:
    """The reference: extract in this one process (one thread, as each torchrun rank runs)."""
    import torch

    run_dir = copy_run(default_tokenized, tmp_path_factory.mktemp("one-process"), "*extract*",
                       "docs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        extract.run(None, run_dir, progress=False, model=str(tiny_target), shard_rows=SHARD_ROWS)
    finally:
        torch.set_num_threads(threads)
    return run_dir


def _torchrun(nproc: int, run_dir: Path, target: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), "-m", "--", "dflash_etl", "extract", "--run", str(run_dir), "--model",
            str(target), "--shard-rows", str(SHARD_ROWS), "--dist-timeout-s", "60"]


ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}


def assert_same_output(run_dir: Path, reference: Path) -> None:
    """The same index (rows, order, shards, offsets), stats and shard files, byte for byte."""
    a, b = run_dir / "extract", reference / "extract"
    assert pq.read_table(a / "index.parquet").equals(pq.read_table(b / "index.parquet"))
    assert (a / "stats.json").read_bytes() == (b / "stats.json").read_bytes()
    names = sorted(p.name for p in (b / "hidden_states").iterdir())
    assert sorted(p.name for p in (a / "hidden_states").iterdir()) == names
    for name in names:
        assert (a / "hidden_states" / name).read_bytes() == \
            (b / "hidden_states" / name).read_bytes(), name


def test_balanced_deterministic_shard_assignment():
    costs = [50, 10, 40, 30, 30, 20]
    plan = assign_shards(costs, 2)
    assert plan == assign_shards(costs, 2)
    assert sorted(n for m in plan for n in m) == list(range(6))
    loads = [sum(costs[n] for n in m) for m in plan]
    assert max(loads) - min(loads) <= min(costs)
    assert assign_shards(costs, 1) == [list(range(6))]
    assert assign_shards([5], 3) == [[0], [], []]  # a rank without a shard still joins


def test_run_does_not_launch_torchrun(tmp_path):
    """`dflash-etl run` holds the run's lock across its stages: it cannot re-run itself under
    torchrun, and says what to do instead; without a launcher extract runs in this process."""
    from dflash_etl.core.errors import StageError
    from dflash_etl.executors.torchrun import relaunch

    (tmp_path / "pipeline.toml").write_text('[[sources]]\nname = "a"\npath = "a.jsonl"\n\n'
                                            '[extract]\nlauncher = "torchrun"\n')
    config = load_config(tmp_path / "pipeline.toml")
    with pytest.raises(StageError, match="run `dflash-etl extract --launcher torchrun`"):
        relaunch(config, {}, None)
    assert relaunch(None, {"launcher": "none"}, ["--run", "x"]) is None


@pytest.mark.slow
def test_torchrun_extract_equals_one_process(tiny_target, default_tokenized, one_process, tmp_path,
                                             copy_run):
    """`dflash-etl extract --launcher torchrun --nproc-per-node 2` runs itself again under
    torchrun; rank 0 alone reports and writes the manifest, and the output is one process's."""
    run_dir = copy_run(default_tokenized, tmp_path, "*extract*", "docs")
    result = subprocess.run(
        [sys.executable, "-m", "dflash_etl.cli.main", "extract", "--run", str(run_dir),
         "--model", str(tiny_target), "--shard-rows", str(SHARD_ROWS), "--launcher", "torchrun",
         "--nproc-per-node", "2"],
        capture_output=True, text=True, env=ENV, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch.distributed.run --standalone --nproc-per-node 2 -m --" in result.stderr
    assert result.stdout.count("extract done") == 1
    assert "ranks:         2 (torchrun" in result.stdout
    manifest = json.loads((run_dir / "manifest.json").read_text())["stages"]["extract"]
    assert (manifest["status"], manifest["ranks"]) == ("complete", 2)
    reference = json.loads((one_process / "manifest.json").read_text())["stages"]["extract"]
    assert manifest["fingerprint"] == reference["fingerprint"]  # the launch is not the content
    assert_same_output(run_dir, one_process)


def _rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the torchrun worker of `rank` working on `run_dir`."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if str(run_dir).encode() in cmdline and f"RANK={rank}".encode() in environ \
                and b"dflash_etl" in cmdline and b"extract" in cmdline \
                and b"torch.distributed.run" \
                not in cmdline:
            return int(proc.name)
    return None


def _marker(partial: Path, shard: int) -> Path:
    """The done marker of a shard (a work item of the extract batch stage)."""
    return partial / "units" / f"u{shard:06d}.done.json"


def _plan(run_dir: Path, world: int) -> list[list[int]]:
    import pyarrow as pa

    from dflash_etl.validation.contracts import read_arrow

    files = sorted((run_dir / "tokenize" / "dataset").glob("*.arrow"))
    lengths = [len(x) for x in pa.concat_tables([read_arrow(f).select(["input_ids"])
                                                  for f in files]).column(0).to_pylist()]
    shards = shard_plan(lengths, SHARD_ROWS)
    costs = [shard_cost([lengths[i] for i in m], 8192) for m in shards]
    return assign_shards(costs, world)


@pytest.mark.slow
def test_a_lost_or_failing_rank_fails_the_run_which_then_resumes(tiny_target, default_tokenized,
                                                                 one_process, tmp_path, copy_run):
    """Rank 1 SIGKILLed mid-run: torchrun fails, nothing is published, the finished shards stay.
    Then rank 1 fails on a shard it cannot write: rank 0 fails too, with rank 1's message in the
    manifest, after finishing its own shards. Fixed and rerun on 3 ranks: the output is one
    process's, and the shards written before were not redone."""
    run_dir = copy_run(default_tokenized, tmp_path, "*extract*", "docs")
    partial = run_dir / ".extract.partial"
    mine = _plan(run_dir, 2)
    launch = subprocess.Popen(_torchrun(2, run_dir, tiny_target), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 300
    killed = False
    while launch.poll() is None and time.monotonic() < deadline:
        if _marker(partial, mine[1][0]).exists():
            pid = _rank_pid(run_dir, 1)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
        time.sleep(0.02)
    _, err = launch.communicate(timeout=300)
    assert killed and launch.returncode != 0, err[-3000:]
    assert "Signal 9 (SIGKILL)" in err or "SIGKILL" in err
    assert not (run_dir / "extract").exists()
    assert json.loads((run_dir / "manifest.json").read_text())["stages"]["extract"][
        "status"] != "complete"
    finished = [n for n in range(sum(map(len, mine)))
                if _marker(partial, n).exists()]
    assert mine[1][0] in finished
    kept = {f"shard-{n:05d}.safetensors": (partial / "hidden_states" / f"shard-{n:05d}"
                                            ".safetensors").stat().st_mtime_ns for n in finished}

    # rank 1 cannot write one of its unfinished shards (a directory is in the way)
    todo = [n for n in mine[1] if not _marker(partial, n).exists()]
    assert todo, "rank 1 finished before it was killed: use smaller shards"
    blocker = partial / "hidden_states" / f"shard-{todo[-1]:05d}.safetensors"
    blocker.mkdir()
    result = subprocess.run(_torchrun(2, run_dir, tiny_target), capture_output=True, text=True,
                            env=ENV, timeout=600)
    assert result.returncode != 0
    assert "rank 1 failed: extract: Is a directory" in result.stderr, result.stderr[-3000:]
    info = json.loads((run_dir / "manifest.json").read_text())["stages"]["extract"]
    assert info["status"] == "failed" and "rank 1 failed" in info["error"]
    assert all(_marker(partial, n).exists() for n in mine[0])

    blocker.rmdir()
    result = subprocess.run(_torchrun(3, run_dir, tiny_target), capture_output=True, text=True,
                            env=ENV, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_output(run_dir, one_process)
    published = run_dir / "extract" / "hidden_states"
    assert all((published / name).stat().st_mtime_ns == when for name, when in kept.items())


@pytest.mark.parametrize(("local", "visible", "gpu"), [(1, 8, 1), (3, 8, 3), (3, 2, 0), (0, 1, 0)])
def test_a_ranks_gpu_is_its_local_rank_unless_it_sees_only_its_own(monkeypatch, local, visible,
                                                                     gpu):
    """One GPU per rank where every GPU is visible; a rank given only its own GPUs
    (CUDA_VISIBLE_DEVICES per rank, G per replica for --device-map auto) takes its first one
    (cuda:LOCAL_RANK did not exist there)."""
    torch = pytest.importorskip("torch")
    from dflash_etl.core import distributed

    monkeypatch.setenv("LOCAL_RANK", str(local))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert distributed.rank_gpu() == gpu
    assert distributed.device_for_rank("auto") == f"cuda:{gpu}"
    assert distributed.device_for_rank("cpu") == "cpu"


@pytest.mark.parametrize("outcome", ["done", "user error"])
def test_a_command_leaves_the_process_group_it_joined(tmp_path, outcome):
    """A rank ends its command with its process group destroyed, on success and on an error:
    gloo's threads left running at exit can abort the process after its work succeeded
    (SIGABRT, "terminate called without an active exception"), a rank torchrun reports failed."""
    import argparse

    import torch.distributed as dist

    from dflash_etl.cli.stage import execute
    from dflash_etl.core.errors import StageError

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)

    def command(args: argparse.Namespace) -> int:
        assert dist.is_initialized()
        if outcome == "user error":
            raise StageError("bad input")
        return 0

    code = execute(argparse.Namespace(func=command, command="extract"))
    assert code == (0 if outcome == "done" else 1)
    assert not dist.is_initialized()
