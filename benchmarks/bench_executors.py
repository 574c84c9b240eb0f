"""Executors benchmark: ingest and tokenize on the local executor against Ray (a local cluster).

What it does (see `--help`):

1. Data: N synthetic rows for ingest (default 1,000,000; bench_ingest's generator, 0.1%
   malformed lines, reused from benchmarks/work/ when present) and M synthetic ShareGPT
   conversations for tokenize (default 200,000; bench_tokenize's `make_data`), ingested once
   per executor into its own run directory (not timed).
2. Timed runs, each `python -m dflash_etl <stage> ... --force` as a fresh process, alternating
   local, ray, local, ray, ... (--pairs pairs per stage): ingest of the N rows, then tokenize of
   the M conversations with the project's tokenizer (data/tokenizer, --seq-length 2048). Ray is
   the local cluster `--executor ray` starts itself (no address: one CPU per core).
   Each run is measured from outside and from inside:
   - outside: wall time; the peak RSS of the driver process alone; the peak RSS (and PSS) summed
     over every process of the run. The driver is started in a new session, and every process
     of the run, Ray's included (gcs_server, raylet, the dashboard and monitor scripts, the
     agents, the actors and Ray Data's helper actors), inherits that session id, so the run's
     processes are those of the session, sampled from /proc every 100 ms (bench_ingest's
     /proc readers). While Ray runs they are also all descendants of the driver (ray.init
     starts gcs_server and raylet as its children, the raylet starts the workers); the JSON
     records how many were found outside that tree (reparented) and how many Ray processes
     outside the session (someone else's) the machine ran meanwhile. CPU seconds per process
     (user + system, the last sample of each) are added up by kind.
   - inside: the CLI runs under timers (`--cli-with-timers`: the same `dflash_etl.cli.main`,
     with its stage's prepare, plan, executor map, finish and `init_ray` wrapped), so each run
     splits into start-up, prepare, plan, ray.init, map, finish + gates, and exit (after the
     command returned: Ray's shutdown). The Ray runs also count the object-store traffic: the
     pickled work items sent and the JSON results returned.
   The outputs of the two executors are compared file by file (sha256 of every data file).
3. Probes of Ray's fixed and per-item costs, each in a fresh process: `import ray` and
   `ray.init` alone (and ray.shutdown); a no-op batch stage through both executors' `map` with
   2 and with K items (batch_size=1, as the executor runs them): the cost of starting the
   workers (actors or a forked pool) and the cost per item; and what a Ray actor imports and
   sets up that a forked worker inherits (the stage modules, the tokenizer).
4. Writes benchmarks/results/executors.{json,md} (--quick: executors_quick.*; --out STEM).

Goals: Ray's overhead (ray wall / local wall - 1, median of the per-pair ratios) <= 15%; the
driver's peak RSS <= 1.5 GB at 1M rows (the data streams through the workers, not the driver).

    python benchmarks/bench_executors.py                   # the recorded run
    python benchmarks/bench_executors.py --quick           # a smoke check (a few minutes)
    python benchmarks/bench_executors.py --rows N --conversations M --pairs K
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_ingest as bi  # noqa: E402  (the data generator and the /proc readers)
import bench_tokenize as bt  # noqa: E402  (make_data)

REPO = bi.REPO
WORK = bi.WORK / "executors"
RESULTS = bi.RESULTS
TOKENIZER = REPO / "data" / "tokenizer"
SEQ_LENGTH = 2048
CLK = os.sysconf("SC_CLK_TCK")
GOAL_OVERHEAD, GOAL_DRIVER_RSS = 0.15, 1.5e9
EXECUTORS = ("local", "ray")
STAGE_CLASSES = {"ingest": "IngestStage", "tokenize": "TokenizeStage"}
RAY_SYSTEM = ("gcs_server", "raylet", "dashboard", "monitor.py", "log_monitor.py", "agent")


# ------------------------------------------------------------------ the run's processes
def _stat(pid: int) -> tuple[int, int, float, int] | None:
    """(ppid, session id, CPU seconds, start time) from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
        f = raw[raw.rindex(b")") + 2:].split()
        return int(f[1]), int(f[3]), (int(f[11]) + int(f[12])) / CLK, int(f[19])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def label_of(cmd: str) -> str:
    """A short name: Ray's process title (ray::MapWorker(...)), a binary's or script's name."""
    if not cmd:
        return "?"
    first = cmd.split()[0]
    if first.startswith("ray::"):  # ray::Class(args).method -> ray::Class(args)
        return first[:first.rindex(")") + 1] if ")" in first else first.split(".")[0]
    for word in cmd.split()[:3]:
        if word.endswith(".py"):
            return Path(word).name
    return Path(first).name


def kind_of(pid: int, driver: int, cmd: str, driver_cmd: str) -> str:
    """driver | workers (the items': forked pool or Ray Data map actors) |
    ray system (gcs, raylet, dashboard, monitors, agents, Ray Data's helper actors, idle
    workers) | other."""
    if pid == driver:
        return "driver"
    if cmd == driver_cmd or cmd.startswith("ray::MapWorker"):
        return "workers"
    if cmd.startswith("ray::") or "/ray/" in cmd or any(m in cmd for m in RAY_SYSTEM):
        return "ray system"
    return "other"


KINDS = ("driver", "workers", "ray system", "other")


class RunSampler(threading.Thread):
    """Peak RSS of the driver, of every process of its session (summed) and per kind; CPU
    seconds per process; the load average. Reuses bench_ingest's /proc readers."""

    def __init__(self, driver: int, interval: float = 0.1, pss_every: int = 10) -> None:
        super().__init__(daemon=True)
        self.driver, self.interval, self.pss_every = driver, interval, pss_every
        self.stop = threading.Event()
        self.peak = {"driver_rss": 0, "tree_rss": 0, "tree_pss": 0, "driver_pss": 0}
        self.peak_kind = dict.fromkeys(KINDS, 0)
        self.procs: dict[tuple[int, int], dict[str, Any]] = {}
        self.max_procs = self.max_outside_tree = self.samples = 0
        self.foreign_ray: set[tuple[int, int]] = set()
        self.seen_other: set[tuple[int, int]] = set()
        self.loads: list[float] = []
        self.series: list[tuple[float, int, int]] = []  # (time, driver RSS, tree RSS)
        self.driver_cmd = ""

    def run(self) -> None:
        next_load = 0.0
        while not self.stop.is_set():
            self.sample()
            if time.monotonic() >= next_load:
                self.loads.append(bi._loadavg())
                next_load = time.monotonic() + 1.0
            self.stop.wait(self.interval)

    def sample(self) -> None:
        with_pss = self.samples % self.pss_every == 0
        self.samples += 1
        members = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            st = _stat(pid)
            if st is None:
                continue
            key = (pid, st[3])
            if st[1] == self.driver:
                members.append((pid, key, st[2]))
            elif key not in self.seen_other:  # look once at each process outside the run
                self.seen_other.add(key)
                cmd = _cmdline(pid)
                if cmd.startswith("ray::") or any(m in cmd for m in ("raylet", "gcs_server")):
                    self.foreign_ray.add(key)
        if not members:
            return
        if not self.driver_cmd:
            self.driver_cmd = _cmdline(self.driver)
        tree = set(bi._tree(self.driver))
        rss_sum = pss_sum = driver_rss = 0
        by_kind = dict.fromkeys(KINDS, 0)
        for pid, key, cpu in members:
            proc = self.procs.setdefault(key, {"label": "", "seen": 0})
            proc["seen"] += 1
            # A process is looked at again while young (a fork runs the parent's command line
            # until it execs) and while a Ray worker without an actor (it takes the actor's
            # title when it becomes one).
            if proc["seen"] <= 20 or proc["label"].startswith(("ray::IDLE", "default_worker")):
                cmd = _cmdline(pid)
                proc.update(label=label_of(cmd),
                            kind=kind_of(pid, self.driver, cmd, self.driver_cmd))
            proc["cpu_s"] = cpu
            rss, pss = bi._rss_pss(pid, with_pss)
            proc["peak_rss"] = max(proc.get("peak_rss", 0), rss)
            rss_sum += rss
            pss_sum += pss
            by_kind[proc["kind"]] += rss
            if pid == self.driver:
                driver_rss = rss
                self.peak["driver_rss"] = max(self.peak["driver_rss"], rss)
                self.peak["driver_pss"] = max(self.peak["driver_pss"], pss)
        self.peak["tree_rss"] = max(self.peak["tree_rss"], rss_sum)
        self.series.append((time.time(), driver_rss, rss_sum))
        self.peak["tree_pss"] = max(self.peak["tree_pss"], pss_sum)
        for kind, value in by_kind.items():
            self.peak_kind[kind] = max(self.peak_kind[kind], value)
        self.max_procs = max(self.max_procs, len(members))
        self.max_outside_tree = max(self.max_outside_tree,
                                    sum(1 for pid, _, _ in members if pid not in tree))

    def summary(self) -> dict[str, Any]:
        cpu_kind = dict.fromkeys(KINDS, 0.0)
        cpu_label: dict[str, float] = {}
        count_label: dict[str, int] = {}
        for proc in self.procs.values():
            cpu_kind[proc["kind"]] += proc.get("cpu_s", 0.0)
            cpu_label[proc["label"]] = cpu_label.get(proc["label"], 0.0) + proc.get("cpu_s", 0)
            count_label[proc["label"]] = count_label.get(proc["label"], 0) + 1
        return {
            "peak_driver_rss_bytes": self.peak["driver_rss"],
            "peak_driver_pss_bytes": self.peak["driver_pss"],
            "peak_tree_rss_bytes": self.peak["tree_rss"],
            "peak_tree_pss_bytes": self.peak["tree_pss"],
            "peak_rss_bytes_by_kind": self.peak_kind,
            "cpu_s_by_kind": {k: round(v, 2) for k, v in cpu_kind.items()},
            "cpu_s": round(sum(cpu_kind.values()), 2),
            "processes_by_label": {k: {"count": count_label[k], "cpu_s": round(v, 2)}
                                   for k, v in sorted(cpu_label.items(), key=lambda kv: -kv[1])},
            "processes": len(self.procs),
            "max_processes_at_once": self.max_procs,
            "max_outside_driver_tree": self.max_outside_tree,
            "foreign_ray_processes_seen": len(self.foreign_ray),
            "samples": self.samples,
            "loadavg_mean": round(statistics.fmean(self.loads), 2) if self.loads else None,
            "loadavg_max": max(self.loads) if self.loads else None,
        }


# ------------------------------------------------------------------ the CLI under timers
def cli_with_timers(out: str, argv: list[str]) -> int:
    """`python -m dflash_etl ARGV` in this process, its phases timed into `out` (JSON)."""
    events: dict[str, Any] = {"launcher_start": time.time()}
    spans: dict[str, list[float]] = {}
    extra: dict[str, Any] = {}

    import importlib
    import pickle

    from dflash_etl.executors import local as local_ex
    from dflash_etl.executors import ray as ray_ex

    cli = importlib.import_module("dflash_etl.cli.main")
    pipeline = importlib.import_module("dflash_etl.runner.pipeline")
    stage_mod = importlib.import_module(f"dflash_etl.stages.{argv[0]}")
    stage_cls = getattr(stage_mod, STAGE_CLASSES[argv[0]])

    def timed(owner: Any, name: str, label: str) -> None:
        orig = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            try:
                return orig(*args, **kwargs)
            finally:
                spans.setdefault(label, []).append([start, time.time()])

        setattr(owner, name, wrapper)

    timed(pipeline, "run_stage", "stage")
    timed(stage_cls, "prepare", "prepare")
    timed(stage_cls, "plan", "plan")
    timed(stage_cls, "finish", "finish")
    timed(ray_ex, "init_ray", "ray_init")
    for executor in (local_ex.LocalExecutor, ray_ex.RayExecutor):
        orig_map = executor.map

        def counting_map(self: Any, stage: Any, ctx: Any, items: list, work_dir: Path,
                         *args: Any, _orig: Any = orig_map, **kwargs: Any) -> list:
            start = time.time()
            results = _orig(self, stage, ctx, items, work_dir, *args, **kwargs)
            spans.setdefault("map", []).append([start, time.time()])
            extra.update(items=len(items), item_bytes=sum(len(pickle.dumps(i)) for i in items),
                         result_bytes=sum(len(json.dumps(r)) for r in results))
            return results

        executor.map = counting_map
    orig_run = ray_ex.RayExecutor._run

    def first_result(self: Any, *args: Any) -> Any:
        for k, result in enumerate(orig_run(self, *args)):
            if k == 0:
                events["first_result"] = time.time()
            yield result

    ray_ex.RayExecutor._run = first_result
    rc = 1
    try:
        rc = cli.main(argv)
    finally:
        events["main_end"] = time.time()
        Path(out).write_text(json.dumps({"events": events, "spans": spans, **extra}))
    return rc


def phases(timers: dict[str, Any], t0: float, t_end: float) -> dict[str, float]:
    """Seconds per phase of one run, from its timers (t0: Popen, t_end: the process ended)."""
    ev, sp = timers["events"], timers["spans"]

    def first(label: str) -> list[float] | None:
        return sp[label][0] if sp.get(label) else None

    stage, prep, plan, mapped, fin = (first(k) for k in ("stage", "prepare", "plan", "map",
                                                          "finish"))
    out: dict[str, float] = {}
    if not (stage and mapped):
        return out
    out["start_up"] = stage[0] - t0  # interpreter, imports, config
    out["prepare"] = prep[1] - prep[0] if prep else 0.0
    out["plan"] = plan[1] - plan[0] if plan else 0.0
    init = first("ray_init")
    out["ray_init"] = init[1] - init[0] if init else 0.0
    out["map"] = mapped[1] - mapped[0] - out["ray_init"]
    if init and "first_result" in ev:
        out["ray_first_result"] = ev["first_result"] - init[1]  # dataset + actors + 1 item
    out["finish"] = fin[1] - fin[0] if fin else 0.0
    out["after_map"] = stage[1] - mapped[1]  # finish, contract, gates, publishing
    accounted = sum(out[k] for k in ("prepare", "plan", "ray_init", "map", "after_map"))
    out["stage_other"] = (stage[1] - stage[0]) - accounted  # begin, fingerprint, listing
    out["exit"] = t_end - ev["main_end"]  # atexit: Ray's shutdown
    out["after_stage"] = ev["main_end"] - stage[1]  # the CLI's summary lines
    return {k: round(v, 3) for k, v in out.items()}


# ------------------------------------------------------------------ runs
def env_for(src: Path = REPO / "src") -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(HERE)])}


def measure_run(name: str, argv: list[str], log: Path) -> dict[str, Any]:
    """One fresh driver process (a new session): wall time, RSS, CPU, phases."""
    timers_path = log.with_suffix(".timers.json")
    timers_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cli-with-timers",
           str(timers_path), "--", *argv]
    print(f"[{name}] $ python -m dflash_etl {' '.join(argv)}", flush=True)
    load_before = bi._loadavg()
    self_cpu = bi._self_cpu()
    with open(log, "wb") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=env_for(), start_new_session=True)
        sampler = RunSampler(proc.pid)
        sampler.start()
        rc = proc.wait()
        t_end = time.time()
        sampler.stop.set()
        sampler.join()
    if rc != 0:
        raise SystemExit(f"[{name}] failed ({rc}); log {log}:\n"
                         f"{log.read_text(errors='replace')[-3000:]}")
    timers = json.loads(timers_path.read_text())
    in_map = {"driver": 0, "tree": 0}
    for start, end in timers["spans"].get("map", []):
        for t, driver_rss, tree_rss in sampler.series:
            if start <= t <= end:
                in_map["driver"] = max(in_map["driver"], driver_rss)
                in_map["tree"] = max(in_map["tree"], tree_rss)
    result = {"name": name, "argv": argv, "wall_s": round(t_end - t0, 3),
              "loadavg_before": load_before, "loadavg_after": bi._loadavg(),
              "sampler_cpu_s": round(bi._self_cpu() - self_cpu, 2), **sampler.summary(),
              "phases": phases(timers, t0, t_end),
              "peak_driver_rss_in_map_bytes": in_map["driver"],
              "peak_tree_rss_in_map_bytes": in_map["tree"],
              **{k: v for k, v in timers.items() if k not in ("events", "spans")}}
    print(f"[{name}] {result['wall_s']:.1f} s, driver {_mib(result['peak_driver_rss_bytes'])}, "
          f"tree {_mib(result['peak_tree_rss_bytes'])}, {result['processes']} processes, "
          f"load {result['loadavg_mean']}; phases {result['phases']}", flush=True)
    return result


def output_digest(stage_dir: Path) -> str:
    """sha256 over every data file of a published stage output (names and bytes; the file
    listing and the validation report, which hold timings, excluded), as the tests compare."""
    digest = hashlib.sha256()
    for path in sorted(p for p in stage_dir.rglob("*") if p.is_file()):
        if path.name in ("files.json", "validation.json"):
            continue
        digest.update(path.relative_to(stage_dir).as_posix().encode() + b"\0")
        with open(path, "rb") as fh:
            while block := fh.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def alternate(stage: str, pairs: int, argv_for: Any) -> dict[str, Any]:
    """local, ray, local, ray, ...: each a fresh process; per-pair ratios ray / local."""
    runs: list[dict[str, Any]] = []
    digests: dict[str, set[str]] = {e: set() for e in EXECUTORS}
    for pair in range(pairs):
        for executor in EXECUTORS:
            argv, run_dir = argv_for(executor)
            r = measure_run(f"{stage} {executor} #{pair + 1}", argv,
                            WORK / "logs" / f"{stage}-{executor}-{pair + 1}.log")
            r.update(executor=executor, pair=pair + 1)
            manifest = json.loads((run_dir / "manifest.json").read_text())
            r["in_stage_s"] = manifest["stages"][stage]["seconds"]
            r["counts"] = {k: v for k, v in manifest["stages"][stage]["counts"].items()
                           if isinstance(v, int)}
            r["output_sha256"] = output_digest(run_dir / stage)
            digests[executor].add(r["output_sha256"])
            runs.append(r)
    ratios = [runs[2 * k + 1]["wall_s"] / runs[2 * k]["wall_s"] for k in range(pairs)]
    median = statistics.median(ratios)
    res = {"runs": runs, "pair_ratios": [round(x, 3) for x in ratios],
           "ratio_median": round(median, 3), "overhead": round(median - 1, 3)}
    cpu = cpu_ratios(res)
    return {**res, "cpu_pair_ratios": [round(x, 3) for x in cpu],
            "cpu_ratio_median": round(statistics.median(cpu), 3),
            "outputs_identical": len(digests["local"] | digests["ray"]) == 1}


def ingest_data(rows: int) -> tuple[Path, dict[str, Any]]:
    meta = bi.generate(rows, 0, 0.001)
    data = bi.dataset_dir(rows, 0, 0.001)
    return bi.write_config(data, "bench"), meta


def tokenize_data(conversations: int) -> dict[str, Path]:
    """The conversations, ingested once per executor's run directory (local executor)."""
    base = WORK / f"tokenize-{conversations}"
    base.mkdir(parents=True, exist_ok=True)
    source = base / f"sharegpt_{conversations}.jsonl"
    if not source.exists():
        tmp = source.with_suffix(".tmp")
        bt.make_data(conversations, tmp)
        tmp.rename(source)
    config = base / "bench.toml"
    config.write_text(f'[[sources]]\nname = "sharegpt"\npath = "{source.name}"\n')
    runs = {}
    for executor in EXECUTORS:
        run_dir = base / f"run-{executor}"
        stats = run_dir / "ingest" / "stats.json"
        if not (stats.exists() and json.loads(stats.read_text())["total"]["rows_in"]
                == conversations):
            subprocess.run([sys.executable, "-m", "dflash_etl", "ingest", "--config", str(config),
                            "--run", str(run_dir), "--force"], check=True, env=env_for(),
                           stdout=subprocess.DEVNULL)
        runs[executor] = run_dir
    return runs


# ------------------------------------------------------------------ probes
PROBE_STARTUP = """
import json, sys, time
t0 = time.perf_counter()
import ray, ray.data
t1 = time.perf_counter()
from dflash_etl.executors.ray import init_ray
init_ray(None, int(sys.argv[1]))
t2 = time.perf_counter()
@ray.remote(num_cpus=0)
def one():
    return 1
ray.get(one.remote())
t3 = time.perf_counter()
ray.shutdown()
t4 = time.perf_counter()
print(json.dumps({"import_ray_s": t1 - t0, "ray_init_s": t2 - t1, "first_task_s": t3 - t2,
                  "shutdown_s": t4 - t3}))
"""

PROBE_IMPORTS = """
import json, sys, time
t0 = time.perf_counter()
import dflash_etl.stages.ingest
t1 = time.perf_counter()
import dflash_etl.stages.tokenize
t2 = time.perf_counter()
from dflash_etl.models.tokenizer import load_tokenizer
load_tokenizer(sys.argv[1])
t3 = time.perf_counter()
print(json.dumps({"import_ingest_stage_s": t1 - t0, "import_tokenize_stage_s": t2 - t1,
                  "load_tokenizer_s": t3 - t2}))
"""


def noop_probe(executor: str, items: int, workers: int, per_task: int = 0) -> dict[str, Any]:
    """A no-op batch stage through the executor's `map`: how long until the first item is
    done (the workers' start), the time per item in the steady state (completion times, both
    workers busy), the driver's CPU per item, and the tail. Ray: `per_task` items per Ray task
    (0: as the executor chooses)."""
    import resource
    import tempfile

    import pyarrow as pa

    from dflash_etl.core.stage import BatchOutput, BatchStage, StageContext, WorkItem

    class Noop(BatchStage):  # defined here: Ray pickles it by value for the actors
        name = "noop"

        @classmethod
        def load(cls, worker: Any, item: WorkItem) -> Any:
            return None

        @classmethod
        def process_batch(cls, worker: Any, batch: Any, item: WorkItem) -> BatchOutput:
            empty = pa.table({"x": pa.array([], pa.int64())})
            return BatchOutput(empty, empty, {}, {"done_at": time.time()})

    out: dict[str, Any] = {"executor": executor, "items": items}
    ctx = StageContext(name="noop", run=None, config=None, workers=workers,  # type: ignore
                       executor=executor, progress=False)
    if executor == "ray":
        from dflash_etl.executors import ray as ray_ex
        from dflash_etl.executors.ray import RayExecutor, init_ray

        if per_task:
            ray_ex.MAX_ITEMS_PER_TASK, ray_ex.TASKS_PER_ACTOR = per_task, 1
        out["items_per_task"] = ray_ex.items_per_task(items, workers)
        start = time.time()
        init_ray(None, workers)
        out["ray_init_s"] = round(time.time() - start, 3)
        runner: Any = RayExecutor(None)
    else:
        from dflash_etl.executors.local import LocalExecutor

        runner = LocalExecutor()
    work = Path(tempfile.mkdtemp(prefix="bench-noop-"))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    start = time.time()
    results = runner.map(Noop(), ctx, [WorkItem(k, None) for k in range(items)], work)
    end = time.time()
    after = resource.getrusage(resource.RUSAGE_SELF)
    out["driver_cpu_ms_per_item"] = round(1000 * (after.ru_utime + after.ru_stime
                                                  - usage.ru_utime - usage.ru_stime) / items, 2)
    done = sorted(r["done_at"] for r in results)
    out["first_item_s"] = round(done[0] - start, 3)
    # the middle 80% of completions: both workers started, none finished
    lo, hi = done[len(done) // 10], done[len(done) * 9 // 10]
    out["per_item_ms"] = round(1000 * (hi - lo) / max(1, len(done) * 9 // 10 - len(done) // 10),
                               2)
    out["map_s"] = round(end - start, 3)
    out["tail_s"] = round(end - done[-1], 3)
    return out


def run_probe(code: list[str], label: str) -> dict[str, Any]:
    print(f"[probe] {label}", flush=True)
    proc = subprocess.run([sys.executable, *code], capture_output=True, text=True, cwd=REPO,
                          env=env_for())
    if proc.returncode:
        raise SystemExit(f"probe {label} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    print(f"[probe] {label}: {result}", flush=True)
    return result


def probes(repeats: int, noop_items: int, workers: int) -> dict[str, Any]:
    me = str(Path(__file__).resolve())
    out: dict[str, Any] = {"startup": [], "noop": [], "imports": []}
    for _ in range(repeats):
        out["startup"].append(run_probe(["-c", PROBE_STARTUP, str(workers)], "ray start-up"))
        out["imports"].append(run_probe(["-c", PROBE_IMPORTS, str(TOKENIZER)],
                                        "a fresh worker's imports and setup"))
        for executor, per_task in (("local", 0), ("ray", 1), ("ray", 0)):
            out["noop"].append(run_probe(
                [me, "--noop-probe", executor, str(noop_items), str(workers), str(per_task)],
                f"no-op items, {executor}" + (" (1 item per Ray task)" if per_task else "")))
    return out


# ------------------------------------------------------------------ report
def _mib(n: float | None) -> str:
    return "-" if not n else f"{n / 2**20:,.0f} MiB"


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


PHASES = [("start_up", "start-up (interpreter, imports, config)"), ("prepare", "prepare"),
          ("plan", "plan"), ("ray_init", "ray.init"), ("map", "map (the items)"),
          ("after_map", "after the map (finish, contract, gates)"),
          ("stage_other", "rest of the stage (fingerprint, begin, listing)"),
          ("after_stage", "CLI summary"), ("exit", "exit (atexit: Ray's shutdown)")]


def cpu_ratios(res: dict[str, Any]) -> list[float]:
    """Per pair, ray / local CPU seconds (all processes of the run)."""
    runs = res["runs"]
    return [runs[k + 1]["cpu_s"] / runs[k]["cpu_s"] for k in range(0, len(runs) - 1, 2)]


def stage_section(title: str, res: dict[str, Any]) -> list[str]:
    runs = res["runs"]
    cpu = cpu_ratios(res)
    lines = [f"## {title}", "",
             "| run | wall s | in-stage s | driver peak RSS (during the map) | tree peak RSS | "
             "tree peak PSS | RSS peak: workers / Ray's own | CPU s: all (driver / workers / "
             "Ray's own) | processes | load avg (mean, max) |",
             "|---|---:|---:|---:|---:|---:|---|---|---:|---|"]
    for r in runs:
        k, c = r["peak_rss_bytes_by_kind"], r["cpu_s_by_kind"]
        lines.append(
            f"| {r['executor']} #{r['pair']} | {r['wall_s']:.1f} | {r['in_stage_s']:.1f} | "
            f"{_mib(r['peak_driver_rss_bytes'])} ({_mib(r.get('peak_driver_rss_in_map_bytes'))})"
            f" | {_mib(r['peak_tree_rss_bytes'])} | "
            f"{_mib(r['peak_tree_pss_bytes'])} | {_mib(k['workers'])} / "
            f"{_mib(k['ray system'])} | {r['cpu_s']:.0f} ({c['driver']:.1f} / {c['workers']:.1f} / "
            f"{c['ray system']:.1f}) | {r['processes']} | "
            f"{r['loadavg_mean']}, {r['loadavg_max']} |")
    worst_driver = max(r["peak_driver_rss_bytes"] for r in runs if r["executor"] == "ray")
    worst_in_map = max(r.get("peak_driver_rss_in_map_bytes", 0) for r in runs
                       if r["executor"] == "ray")
    ratios = ", ".join(f"{x:.3f}" for x in res["pair_ratios"])
    lines += ["", f"Per-pair ratios ray / local: {ratios}; median {res['ratio_median']:.3f}: "
              "**Ray's overhead "
              f"{res['overhead']:+.1%}** (goal <= {GOAL_OVERHEAD:.0%}: "
              f"{'met' if res['overhead'] <= GOAL_OVERHEAD else 'not met'}). CPU seconds (all "
              f"processes of the run), per pair ray / local: "
              f"{', '.join(f'{x:.3f}' for x in cpu)}; median "
              f"{statistics.median(cpu):.3f}. Driver peak RSS with Ray: "
              f"{_mib(worst_driver)} at most, {_mib(worst_in_map)} during the map (goal <= "
              f"{GOAL_DRIVER_RSS / 1e9:.1f} GB: "
              f"{'met' if worst_driver <= GOAL_DRIVER_RSS else 'not met'}). Outputs of the two "
              f"executors identical (sha256 of every data file): "
              f"{'yes' if res['outputs_identical'] else '**no**'}.", ""]
    by = {e: [r for r in runs if r["executor"] == e] for e in EXECUTORS}
    lines += ["Where the time goes (mean seconds per run; from the timers inside the CLI):", "",
              "| phase | local | ray | ray - local |", "|---|---:|---:|---:|"]
    for key, label in PHASES:
        a = _mean([r["phases"].get(key, 0.0) for r in by["local"]])
        b = _mean([r["phases"].get(key, 0.0) for r in by["ray"]])
        lines.append(f"| {label} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
    a, b = _mean([r["wall_s"] for r in by["local"]]), _mean([r["wall_s"] for r in by["ray"]])
    lines.append(f"| **wall** | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
    first = [r["phases"]["ray_first_result"] for r in by["ray"] if "ray_first_result" in
             r["phases"]]
    ray_run = by["ray"][-1]
    lines += ["", f"Ray: first result {_mean(first):.1f} s after ray.init returned (the "
              "dataset, the actors' start and setup, one item). "
              f"{ray_run.get('items', '?')} work items; object-store traffic: "
              f"{ray_run.get('item_bytes', 0) / 1e3:,.1f} kB of pickled items out, "
              f"{ray_run.get('result_bytes', 0) / 1e3:,.1f} kB of JSON results back. "
              "Ray's processes in the last Ray run (CPU s):", ""]
    procs = ray_run["processes_by_label"]
    lines.append(", ".join(f"{name} x{p['count']} {p['cpu_s']:.1f}" for name, p in procs.items()
                           if p["cpu_s"] >= 0.05) + ".")
    return [*lines, ""]


def baseline_section(res: dict[str, Any]) -> list[str]:
    """This run against an earlier one (--baseline JSON: the executor before a change)."""
    base = res["baseline"]
    lines = [f"## Against the baseline ({base['label']})", "",
             "| stage | wall ray/local (median of pairs): baseline -> now | CPU s ray/local: "
             "baseline -> now | Ray runs' map s (mean) | Ray runs' driver CPU s (mean) | "
             "Ray runs' map actors' CPU s (mean) |", "|---|---|---|---|---|---|"]

    def ray_mean(doc: dict[str, Any], get: Any) -> float:
        return _mean([get(r) for r in doc["runs"] if r["executor"] == "ray"])

    for stage in ("ingest", "tokenize"):
        if stage not in res or stage not in base:
            continue
        a, b = base[stage], res[stage]
        cells = [f"{a['ratio_median']:.3f} -> {b['ratio_median']:.3f}",
                 f"{statistics.median(cpu_ratios(a)):.3f} -> "
                 f"{statistics.median(cpu_ratios(b)):.3f}"]
        for get in (lambda r: r["phases"].get("map", 0.0),
                    lambda r: r["cpu_s_by_kind"]["driver"],
                    lambda r: r["cpu_s_by_kind"]["workers"]):
            cells.append(f"{ray_mean(a, get):.1f} -> {ray_mean(b, get):.1f}")
        lines.append(f"| {stage} | {' | '.join(cells)} |")
    return [*lines, ""]


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [f"# Executors benchmark: local vs Ray ({res['date']})", "",
             f"Command: `{res['command']}`  ",
             f"Machine: {m['nproc']} CPUs (`nproc`; {m['cpu']}), {m['memory']} RAM, Linux "
             f"{m['kernel']}; Python {m['python']}, Ray {res['ray_version']}; dflash_etl "
             f"{m['dflash_etl']}. Shared with other work: the 1-minute load average was "
             f"{res['loadavg_start']} at the start and {res['loadavg_end']} at the end "
             "(per run below; above 2, other processes competed for the 2 cores).", "",
             f"Each run is `python -m dflash_etl <stage> ... --force` as a fresh process, "
             f"executors alternating (local, ray, local, ray, ...), {res['pairs']} pair(s) per "
             "stage; Ray is the local cluster the run starts itself (`--executor ray`, no "
             "address: one CPU per core, loopback only); default workers (one per core).", ""]
    if "ingest" in res:
        lines += stage_section(f"Ingest, {res['rows']:,} rows (+0.1% malformed lines)",
                               res["ingest"])
    if "tokenize" in res:
        lines += stage_section(
            f"Tokenize, {res['conversations']:,} synthetic ShareGPT conversations (data/"
            f"tokenizer, --seq-length {SEQ_LENGTH})", res["tokenize"])
    if res.get("probes"):
        p = res["probes"]
        lines += ["## Ray's fixed and per-item costs (probes, each a fresh process)", "",
                  "| probe | runs (s) |", "|---|---|"]

        def row(label: str, rows: list[dict[str, Any]], key: str, unit: str = "s") -> None:
            values = " / ".join(f"{r[key]:.2f}" for r in rows if key in r) or "-"
            lines.append(f"| {label} | {values} {unit} |")

        row("`import ray, ray.data`", p["startup"], "import_ray_s")
        row("`ray.init` (local, 2 CPUs) alone", p["startup"], "ray_init_s")
        row("first trivial task after init (a worker lease)", p["startup"], "first_task_s")
        row("`ray.shutdown()`", p["startup"], "shutdown_s")
        row("fresh worker: import the ingest stage", p["imports"], "import_ingest_stage_s")
        row("fresh worker: import the tokenize stage", p["imports"], "import_tokenize_stage_s")
        row("fresh worker: load the tokenizer", p["imports"], "load_tokenizer_s")
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in p["noop"]:
            name = r["executor"] + (f", {r['items_per_task']} item(s) per Ray task"
                                    if "items_per_task" in r else "")
            groups.setdefault(name, []).append(r)
        for name, rows in groups.items():
            n = rows[0]["items"]
            row(f"{name}: {n} no-op items, map called -> first item done (workers' start)",
                rows, "first_item_s")
            row(f"{name}: per no-op item, steady state (2 workers)", rows, "per_item_ms", "ms")
            row(f"{name}: the driver's CPU per item", rows, "driver_cpu_ms_per_item", "ms")
            row(f"{name}: last item done -> map returned", rows, "tail_s")
            row(f"{name}: the whole map of {n} items", rows, "map_s")
        lines.append("")
    lines += ["Notes: *driver peak RSS* is the `python -m dflash_etl` process alone. *tree* sums "
              "every process of the run: the driver's session, which Ray's processes inherit "
              "(gcs_server, raylet, dashboard, monitor, log_monitor, the agents, the actors, "
              "Ray Data's helper actors; with ray.init they are also the driver's "
              "descendants), the forked workers. RSS counts shared pages "
              "(fork, Ray's shared-memory object store) once per process; PSS divides them. "
              "*Ray's own*: every Ray process but the map actors. CPU seconds are each "
              "process's user + system time at its last 100 ms sample.", ""]
    if res.get("baseline"):
        lines += baseline_section(res)
    if res.get("notes"):
        lines += ["## Interpretation", "", *res["notes"], ""]
    return "\n".join(lines)


# ------------------------------------------------------------------ main
def add_extras(res: dict[str, Any], args: argparse.Namespace) -> None:
    if args.notes:
        res["notes"] = Path(args.notes).read_text().strip().splitlines()
    if args.baseline:
        label, _, path = args.baseline.rpartition("=")
        base = json.loads(Path(path).read_text())
        res["baseline"] = {"label": label or path, "path": path,
                           **{k: base[k] for k in ("ingest", "tokenize", "probes") if k in base}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=None, help="ingest rows (default 1,000,000)")
    ap.add_argument("--conversations", type=int, default=None,
                    help="tokenize conversations (default 200,000)")
    ap.add_argument("--pairs", type=int, default=None, help="local+ray pairs per stage (2)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke check: 20,000 rows, 2,000 conversations, 1 pair")
    ap.add_argument("--stages", default="ingest,tokenize", help="which stages (comma list)")
    ap.add_argument("--no-probes", action="store_true", help="skip the Ray cost probes")
    ap.add_argument("--noop-items", type=int, default=None, help="no-op probe items (1000)")
    ap.add_argument("--notes", help="a markdown file appended as the interpretation")
    ap.add_argument("--baseline", help="an earlier run's JSON to compare with (LABEL=PATH)")
    ap.add_argument("--render", help="only write the markdown of this results JSON again "
                    "(with --notes / --baseline)")
    ap.add_argument("--out", help="results path without suffix")
    args = ap.parse_args(argv)
    if args.render:
        res = json.loads(Path(args.render).read_text())
        add_extras(res, args)
        Path(args.render).write_text(json.dumps(res, indent=2, default=str) + "\n")
        Path(args.render).with_suffix(".md").write_text(markdown(res))
        print(markdown(res))
        return 0
    rows = args.rows or (20_000 if args.quick else 1_000_000)
    conversations = args.conversations or (2_000 if args.quick else 200_000)
    pairs = args.pairs or (1 if args.quick else 2)
    noop_items = args.noop_items or (100 if args.quick else 1000)
    stages = [s for s in args.stages.split(",") if s]
    stem = args.out or str(RESULTS / ("executors_quick" if args.quick else "executors"))
    workers = os.cpu_count() or 1
    (WORK / "logs").mkdir(parents=True, exist_ok=True)
    from importlib.metadata import version

    res: dict[str, Any] = {
        "command": "python benchmarks/bench_executors.py"
        + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d"), "machine": bi.machine_info(),
        "ray_version": version("ray"), "rows": rows, "conversations": conversations,
        "pairs": pairs, "loadavg_start": bi._loadavg()}
    if "ingest" in stages:
        config, meta = ingest_data(rows)
        bi.warm_cache(config.parent)
        res["ingest_dataset"] = {k: meta[k] for k in ("rows", "malformed", "bytes")}

        def ingest_argv(executor: str) -> tuple[list[str], Path]:
            run_dir = WORK / f"ingest-{rows}-{executor}"
            return (["ingest", "--config", str(config), "--run", str(run_dir), "--force",
                     "--executor", executor], run_dir)

        res["ingest"] = alternate("ingest", pairs, ingest_argv)
    if "tokenize" in stages:
        run_dirs = tokenize_data(conversations)

        def tokenize_argv(executor: str) -> tuple[list[str], Path]:
            run_dir = run_dirs[executor]
            return (["tokenize", "--run", str(run_dir), "--model", str(TOKENIZER),
                     "--seq-length", str(SEQ_LENGTH), "--force", "--executor", executor],
                    run_dir)

        res["tokenize"] = alternate("tokenize", pairs, tokenize_argv)
    if not args.no_probes:
        res["probes"] = probes(1 if args.quick else 2, noop_items, workers)
    res["loadavg_end"] = bi._loadavg()
    add_extras(res, args)
    Path(stem + ".json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    md = markdown(res)
    Path(stem + ".md").write_text(md)
    print("\n" + md)
    print(f"results: {stem}.md, {stem}.json")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--cli-with-timers":
        raise SystemExit(cli_with_timers(sys.argv[2], sys.argv[4:]))
    if len(sys.argv) in (5, 6) and sys.argv[1] == "--noop-probe":
        print(json.dumps(noop_probe(sys.argv[2], *map(int, sys.argv[3:]))))
        raise SystemExit(0)
    raise SystemExit(main())
