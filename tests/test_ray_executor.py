"""The Ray executor gives what the local one gives: same rows in the same order, same ids, same
quarantine rows and reasons, same stats.json; an actor killed mid-run is retried and nothing is
lost or duplicated; a two-node cluster gives the same again, with the CLI as a user runs it.

The two nodes are started with Ray's own `cluster_utils.Cluster` on loopback: `ray start
--address` would advertise the machine's network address, which this sandbox refuses to
connect to (and traffic here stays on loopback)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_etl.runner import run_stage
from dflash_etl.stages import PIPELINE, ingest, load_config, parse_config, tokenize

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local Ray: loopback only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray = pytest.importorskip("ray", reason="the ray extra is not installed: pip install "
                                        "'dflash-etl[ray]'")

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "data" / "pipeline.toml"
DEFAULT_TOKENIZER = REPO / "data" / "tokenizer"
TOKENIZE = {"model": str(DEFAULT_TOKENIZER), "seq_length": 512}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray of 2 CPUs for the module (starting one takes seconds)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)  # not a cluster some `ray start` left running here
    yield
    ray.shutdown()


def data_files(run: Path, stage: str) -> dict[str, bytes]:
    """Every data file of a published stage output (the listing and the report excluded)."""
    out = run / stage
    skip = {"files.json", "validation.json"}
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in skip}


def assert_same_output(a: Path, b: Path, stage: str) -> None:
    left, right = data_files(a, stage), data_files(b, stage)
    assert sorted(left) == sorted(right)
    differ = [name for name in left if left[name] != right[name]]
    assert not differ, f"{stage}: files differ between the executors: {differ}"


def generated_rows(tmp_path: Path, n_files: int = 4, rows: int = 900) -> Path:
    """A few thousand rows in several files (several ingest units), with duplicates, broken
    lines and rows of two formats, so quarantine, filters and order all matter."""
    config = tmp_path / "pipeline.toml"
    for f in range(n_files):
        lines = []
        for k in range(rows):
            n = f * rows + k
            if n % 97 == 0:
                lines.append("{not json")
            elif n % 5 == 0:
                lines.append(json.dumps({"instruction": f"Add {n} and {n % 7}.",
                                         "output": f"{n + n % 7}"}))
            else:
                lines.append(json.dumps({"messages": [
                    {"role": "user", "content": f"What is {n % 300} squared?"},
                    {"role": "assistant", "content": f"{(n % 300) ** 2}."}]}))
        (tmp_path / f"part{f}.jsonl").write_text("\n".join(lines) + "\n")
    config.write_text('[run]\nshard_rows = 1000\n[expectations]\nmax_quarantine_rate = 0.05\n'
                      '[[sources]]\nname = "mixed"\npath = "part*.jsonl"\n')
    return config


def test_a_two_node_cluster_gives_the_local_result(tmp_path):
    """Two Ray nodes (one CPU each, their own raylets), and `dflash-etl run --executor ray
    --ray-address` against them from another process, as a user runs it."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        config = generated_rows(tmp_path, n_files=3, rows=500)
        with config.open("a") as fh:  # `dflash-etl run` then runs ingest and tokenize
            fh.write(f'[tokenize]\nmodel = "{DEFAULT_TOKENIZER}"\nseq_length = 512\n')
        done = subprocess.run(
            [sys.executable, "-m", "dflash_etl", "run", "--config", str(config), "--run",
             str(tmp_path / "ray"), "--executor", "ray", "--ray-address", cluster.address],
            capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        nodes = subprocess.run(
            [sys.executable, "-c", "import ray, sys; ray.init(address=sys.argv[1], "
             "log_to_driver=False); print(sum(n['Alive'] for n in ray.nodes()))",
             cluster.address], capture_output=True, text=True, timeout=300)
        assert nodes.stdout.strip().splitlines()[-1] == "2"
    finally:
        cluster.shutdown()
    local = load_config(config)
    ingest.run(local, tmp_path / "local")
    tokenize.run(local, tmp_path / "local")
    for stage in ("ingest", "tokenize"):
        assert_same_output(tmp_path / "local", tmp_path / "ray", stage)


def near_copies(tmp_path: Path) -> Path:
    """Generated rows plus a file of templated near-copies (one number differs) across two
    sources, with [ingest] near_dedup on: which copy is kept must not depend on the executor."""
    tmp_path.mkdir()
    config = generated_rows(tmp_path, n_files=2, rows=400)
    words = " ".join(f"word{k}" for k in range(40))
    (tmp_path / "near.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Summarise this: {words} item {n}."},
        {"role": "assistant", "content": f"A summary {n}."}]}) + "\n" for n in range(300)))
    with config.open("a") as fh:
        fh.write('[[sources]]\nname = "near"\npath = "near.jsonl"\n'
                 '[ingest]\nnear_dedup = true\n')
    return config


def test_ray_equals_local_on_the_default_and_on_generated_rows(tmp_path, local_ray):
    for config_path in (DEFAULT_CONFIG, generated_rows(tmp_path), near_copies(tmp_path / "nd")):
        config = load_config(config_path)
        name = config_path.parent.name
        runs = {e: tmp_path / f"{name}-{e}" for e in ("local", "ray")}
        docs = {}
        for executor, run in runs.items():
            docs[executor] = (ingest.run(config, run, executor=executor),
                              tokenize.run(config, run, executor=executor, **TOKENIZE))
        assert docs["ray"] == docs["local"]
        assert docs["ray"][1]["total"]["rows_written"] > 300
        if config.section("ingest").get("near_dedup"):
            filtered = docs["ray"][0]["total"]["rows_filtered"]
            assert filtered.get("near_duplicate", 0) >= 290, filtered
        for stage in ("ingest", "tokenize"):
            assert_same_output(runs["local"], runs["ray"], stage)
        manifest = json.loads((runs["ray"] / "manifest.json").read_text())
        assert manifest["stages"]["tokenize"]["status"] == "complete"


class KillOnce(tokenize.TokenizeStage):
    """Tokenize, but the actor that takes chunk 2 kills its own process the first time."""

    marker: str = ""

    def process_batch(self, batch, item):
        if item.index == 2 and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().process_batch(batch, item)


def test_a_killed_actor_is_retried_and_nothing_is_lost_or_duplicated(tmp_path, local_ray):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import it
    config = load_config(generated_rows(tmp_path, n_files=2, rows=700))
    for run in ("local", "ray"):
        ingest.run(config, tmp_path / run)
    tokenize.run(config, tmp_path / "local", **TOKENIZE)
    KillOnce.marker = str(tmp_path / "killed")
    doc = run_stage(KillOnce(), config, tmp_path / "ray", executor="ray",
                    upstream=PIPELINE.upstream("tokenize"), **TOKENIZE)
    killed = int(Path(KillOnce.marker).read_text())
    assert killed != os.getpid()  # an actor's process died, not this one
    local = json.loads((tmp_path / "local" / "tokenize" / "stats.json").read_text())
    assert doc == local
    assert_same_output(tmp_path / "local", tmp_path / "ray", "tokenize")


def test_choosing_ray_without_it_names_the_install(tmp_path, monkeypatch):
    from dflash_etl.core.errors import StageError

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    config = parse_config({"run": {"workers": 1, "executor": "ray"},
                           "sources": [{"name": "d", "path": str(DEFAULT_CONFIG.parent /
                                                                 "sources")}]}, tmp_path)
    with pytest.raises(StageError, match=r"pip install 'dflash-etl\[ray\]'"):
        ingest.run(config, tmp_path / "run")


def test_extract_on_ray_equals_local(tmp_path, local_ray, tiny_target, default_tokenized,
                                     copy_run):
    """extract's shards as work items on Ray actors, one target replica per actor (sized by
    the stage's declared resources: 1 CPU, no GPU here): the same states, index and stats as
    the local executor's one process, byte for byte."""
    import torch

    from dflash_etl.stages import extract

    runs = {e: copy_run(default_tokenized, tmp_path / e, "*extract*", "docs")
            for e in ("local", "ray")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each 1-CPU actor runs (Ray sets OMP_NUM_THREADS=1)
    try:
        docs = {e: extract.run(None, runs[e], progress=False, model=str(tiny_target),
                               shard_rows=32, executor=e) for e in runs}
    finally:
        torch.set_num_threads(threads)
    assert docs["ray"] == docs["local"]
    assert docs["ray"]["total"]["rows_out"] > 300
    assert_same_output(runs["local"], runs["ray"], "extract")
