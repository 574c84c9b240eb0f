"""Ingest benchmark: `dflash-etl ingest` against bare polars `scan_ndjson(...).sink_parquet(...)`.

What it does (see `--help`):

1. Generates N synthetic conversations (default 1,000,000) as JSONL, one file per format
   (OpenAI messages, OpenAI with tool calls, ShareGPT, Alpaca, prompt-only), a few hundred bytes to
   a few KB per row, deterministically from a seed, into benchmarks/work/ (reused when present with
   the same parameters). Two copies: `dirty/` has 0.1% malformed lines mixed in (bad JSON,
   invalid UTF-8, JSON that isn't an object); `clean/` has the same rows without them.
2. Times, each as a fresh process and in the same run:
   (a) the baseline: `pl.scan_ndjson(file).sink_parquet(out)` for each clean file;
   (b) `python -m dflash_etl ingest --force` (default workers) on the dirty files;
   (c) the same ingest on a 100k-row dataset, for the RSS-at-1M / RSS-at-100k ratio.
   Wall time, and peak RSS of the whole process tree (the process and its descendants, RSS summed,
   sampled from /proc every 50 ms; PSS too, which does not double-count pages shared by forked
   workers), plus /usr/bin/time -v's maximum RSS of any single process.
3. Profiles the ingest with `--workers 1` on the 100k-row dataset under cProfile and lists the
   hotspots.
4. Writes benchmarks/results/ingest.json and ingest.md (for other --rows: ingest_<rows>.*) and
   prints the markdown.

Goals (issue 2, "Performance"): ingest throughput >= 0.7x the baseline's; peak RSS <= 2 GB;
peak RSS at 1M rows <= 1.2x the peak RSS at 100k rows.

    python benchmarks/bench_ingest.py                 # the recorded run (1M rows)
    python benchmarks/bench_ingest.py --rows 100000   # a quick check
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import pstats
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work"
RESULTS = HERE / "results"
GENERATOR_VERSION = 1  # bump when the generator changes, so cached datasets are regenerated
GOAL_RATIO, GOAL_RSS, GOAL_SCALING = 0.7, 2 * 1024**3, 1.2
PAGE = os.sysconf("SC_PAGE_SIZE")

# Share of rows per format.
FORMAT_MIX = {
    "openai": 0.35,
    "sharegpt": 0.25,
    "alpaca": 0.15,
    "openai_tools": 0.15,
    "prompt": 0.10,
}


# ------------------------------------------------------------------ synthetic data
class TextMaker:
    """Deterministic pseudo-English: a vocabulary of made-up words, a pool of sentences."""

    SYLLABLES = (  # noqa: SIM905
        "ka to ri an el mo su de ne ra li ve po sa ti ur om be ca fi gu ho ja le mi nu or pe "
        "qua re si ta un vi wa xe yo ze str th ing ion er al ly ment ous"
    ).split()
    COMMON = (  # noqa: SIM905
        "the of and to in is that for it as with was on be by this are or an from at which "
        "can we you if not all but one has more use each how they will about other what"
    ).split()

    def __init__(self, rng: random.Random, n_words: int = 6000, n_sentences: int = 40000) -> None:
        words = list(self.COMMON)
        while len(words) < n_words:
            words.append("".join(rng.choices(self.SYLLABLES, k=rng.randint(1, 4))))
        self.words = words
        self.sentences = []
        for _ in range(n_sentences):
            k = rng.randint(5, 22)
            ws = [
                rng.choice(words) if rng.random() < 0.7 else rng.choice(self.COMMON)
                for _ in range(k)
            ]
            if rng.random() < 0.15:
                ws.insert(rng.randint(0, k), str(rng.randint(0, 100000)))
            s = " ".join(ws)
            self.sentences.append(s[0].upper() + s[1:] + rng.choice(".....?!:"))
        self.rng = rng

    def text(self, lo: int, hi: int) -> str:
        """lo..hi sentences (skewed towards lo), now and then in paragraphs or a code block."""
        rng = self.rng
        n = lo + int((hi - lo) * rng.random() ** 2)
        parts = rng.choices(self.sentences, k=max(1, n))
        if len(parts) > 6 and rng.random() < 0.5:
            cut = rng.randint(2, len(parts) - 2)
            parts[cut] = "\n\n" + parts[cut]
        if rng.random() < 0.05:
            parts.append(f"\n```python\ndef f(x):\n    return x * {rng.randint(2, 99)}\n```")
        return " ".join(parts)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "description": "Search the web and return the top results.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to search for"},
                    "max_results": {"type": "integer", "description": "How many results"},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Run a Python snippet in a sandbox.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "Source code"}},
                "required": ["code"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Look up an order by its id.",
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string", "description": "Order id"},
                    "include_items": {"type": "boolean", "description": "Also list the items"},
                },
                "required": ["order_id"],
            },
        },
    },
]


def _tool_args(name: str, tm: TextMaker) -> dict[str, Any]:
    rng = tm.rng
    if name == "get_weather":
        return {"city": rng.choice(tm.words).title(), "unit": rng.choice(["celsius", "fahrenheit"])}
    if name == "search_web":
        return {
            "query": " ".join(rng.choices(tm.words, k=rng.randint(2, 6))),
            "max_results": rng.randint(1, 10),
        }
    if name == "run_python":
        return {"code": f"print(sum(range({rng.randint(1, 10**6)})))"}
    return {"order_id": f"A{rng.randint(10**5, 10**6)}", "include_items": rng.random() < 0.5}


def make_row(fmt: str, i: int, tm: TextMaker) -> dict[str, Any]:
    """One synthetic conversation of the given format (i makes ids unique)."""
    rng = tm.rng
    if fmt == "openai":
        msgs: list[dict[str, Any]] = []
        if rng.random() < 0.4:
            msgs.append({"role": "system", "content": tm.text(1, 3)})
        for _ in range(1 + int(2 * rng.random() ** 2)):
            msgs.append({"role": "user", "content": tm.text(1, 5)})
            answer = tm.text(2, 24)
            if rng.random() < 0.2:
                answer = f"<think>\n{tm.text(1, 6)}\n</think>\n\n{answer}"
            msgs.append({"role": "assistant", "content": answer})
        return {"messages": msgs}
    if fmt == "openai_tools":
        tools = rng.sample(TOOLS, rng.randint(1, len(TOOLS)))
        msgs = [
            {"role": "system", "content": "You can call tools. " + tm.text(0, 2)},
            {"role": "user", "content": tm.text(1, 4)},
        ]
        for turn in range(1 + int(rng.random() < 0.3)):
            calls = []
            for k in range(1 + int(rng.random() < 0.25)):
                name = rng.choice(tools)["function"]["name"]
                calls.append(
                    {
                        "id": f"call_{i}_{turn}_{k}",
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(_tool_args(name, tm))},
                    }
                )
            msgs.append({"role": "assistant", "content": None, "tool_calls": calls})
            for call in calls:
                msgs.append(
                    {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "name": call["function"]["name"],
                        "content": json.dumps({"result": tm.text(1, 3)}),
                    }
                )
        msgs.append({"role": "assistant", "content": tm.text(1, 8)})
        return {"messages": msgs, "tools": tools}
    if fmt == "sharegpt":
        conv = []
        row: dict[str, Any] = {"id": f"sg-{i}"}
        if rng.random() < 0.3:
            row["system"] = tm.text(1, 2)
        for _ in range(1 + int(3 * rng.random() ** 2)):
            conv.append({"from": "human", "value": tm.text(1, 5)})
            conv.append({"from": "gpt", "value": tm.text(2, 20)})
        row["conversations"] = conv
        return row
    if fmt == "alpaca":
        return {
            "instruction": tm.text(1, 3),
            "input": tm.text(1, 4) if rng.random() < 0.4 else "",
            "output": tm.text(2, 18),
        }
    if fmt == "prompt":
        return {"prompt": tm.text(1, 8), "category": rng.choice(["math", "code", "chat", "qa"])}
    raise ValueError(fmt)


def malformed_line(kind: int, good: bytes, rng: random.Random) -> bytes:
    """A line that must be quarantined: bad JSON, invalid UTF-8 or a JSON non-object."""
    if kind == 0:  # truncated JSON
        return good[: rng.randint(1, len(good) - 2)]
    if kind == 1:  # invalid UTF-8 inside a string value
        at = good.find(b'": "')
        at = at + 4 if at >= 0 else len(good) // 2
        return good[:at] + b"caf\xe9 \xff\xfe" + good[at:]
    return rng.choice([b"[1, 2, 3]", b'"just a string"', b"42", b"null", b'[{"role": "user"}]'])


def dataset_dir(rows: int, seed: int, malformed_rate: float) -> Path:
    return WORK / f"data-v{GENERATOR_VERSION}-r{rows}-s{seed}-m{malformed_rate:g}"


def generate(rows: int, seed: int, malformed_rate: float) -> dict[str, Any]:
    """Write (or reuse) the dataset; returns its meta (files, rows, bytes, malformed count)."""
    import orjson

    out = dataset_dir(rows, seed, malformed_rate)
    meta_path = out / "meta.json"
    params = {
        "rows": rows,
        "seed": seed,
        "malformed_rate": malformed_rate,
        "generator_version": GENERATOR_VERSION,
        "format_mix": FORMAT_MIX,
    }
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("params") == params and all(
            (out / f).exists() for f in meta["files"]["clean"] + meta["files"]["dirty"]
        ):
            print(f"dataset: reusing {out.relative_to(REPO)}", flush=True)
            return meta
    shutil.rmtree(out, ignore_errors=True)
    (out / "clean").mkdir(parents=True)
    (out / "dirty").mkdir()
    t0 = time.perf_counter()
    rng = random.Random(seed)
    tm = TextMaker(rng)
    formats = list(FORMAT_MIX)
    weights = [FORMAT_MIX[f] for f in formats]
    n_bad = round(rows * malformed_rate)
    bad_before = set(random.Random(seed + 1).sample(range(rows), n_bad))
    bad_rng = random.Random(seed + 2)
    per_format = {f: {"rows": 0, "malformed": 0} for f in formats}
    bad_kinds = [0, 0, 0]
    with contextlib.ExitStack() as stack:
        clean = {f: stack.enter_context(open(out / "clean" / f"{f}.jsonl", "wb")) for f in formats}
        dirty = {f: stack.enter_context(open(out / "dirty" / f"{f}.jsonl", "wb")) for f in formats}
        for i in range(rows):
            fmt = rng.choices(formats, weights)[0]
            line = orjson.dumps(make_row(fmt, i, tm))
            if i in bad_before:
                kind = bad_rng.randrange(3)
                bad_kinds[kind] += 1
                dirty[fmt].write(malformed_line(kind, line, bad_rng) + b"\n")
                per_format[fmt]["malformed"] += 1
            clean[fmt].write(line + b"\n")
            dirty[fmt].write(line + b"\n")
            per_format[fmt]["rows"] += 1
            if (i + 1) % 200_000 == 0:
                print(f"  generated {i + 1:,} rows ({time.perf_counter() - t0:.0f} s)", flush=True)
    files = {kind: [f"{kind}/{f}.jsonl" for f in formats] for kind in ("clean", "dirty")}
    meta = {
        "params": params,
        "rows": rows,
        "malformed": n_bad,
        "malformed_kinds": dict(
            zip(("bad_json", "invalid_utf8", "not_an_object"), bad_kinds, strict=True)
        ),
        "per_format": per_format,
        "files": files,
        "bytes": {k: sum((out / f).stat().st_size for f in v) for k, v in files.items()},
        "generate_s": round(time.perf_counter() - t0, 1),
    }
    meta_path.write_text(json.dumps(meta, indent=2))
    mb = meta["bytes"]["clean"] / 1e6
    print(
        f"dataset: wrote {out.relative_to(REPO)} ({rows:,} rows, {mb:.0f} MB, "
        f"{n_bad} malformed lines) in {meta['generate_s']} s",
        flush=True,
    )
    return meta


def write_config(data: Path, name: str) -> Path:
    config = data / f"{name}.toml"
    config.write_text(
        "# written by benchmarks/bench_ingest.py\n"
        "[run]\nseed = 0\ndedup = true\nshard_rows = 100000\n\n"
        '[[sources]]\nname = "bench"\npath = "dirty/*.jsonl"\nformat = "auto"\n'
    )
    return config


# ------------------------------------------------------------------ measurement
def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split(None, 2)[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def _task_children(pid: int) -> list[int] | None:
    """Children of all of pid's threads via /proc/PID/task/TID/children; None if unsupported."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                out.extend(int(c) for c in fh.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended
            return None  # the kernel has no CONFIG_PROC_CHILDREN
        except OSError:
            continue
    return out


def _tree(root: int) -> list[int]:
    """root and all its descendants (cheap: reads only the tree's own /proc entries)."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        kids = _task_children(pid)
        if kids is None:  # fall back to a scan of all of /proc
            children = _children_map()
            out, todo = [], [root]
            while todo:
                pid = todo.pop()
                out.append(pid)
                todo.extend(children.get(pid, ()))
            return out
        out.append(pid)
        todo.extend(kids)
    return out


def _rss_pss(pid: int, with_pss: bool) -> tuple[int, int]:
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            rss = int(fh.read().split()[1]) * PAGE
        pss = 0
        if not with_pss:
            return rss, pss
        with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
            for line in fh:
                if line.startswith(b"Pss:"):
                    pss = int(line.split()[1]) * 1024
                    break
        return rss, pss
    except (OSError, ValueError, IndexError):
        return 0, 0


class TreeSampler(threading.Thread):
    """Peak summed RSS of a process and all its descendants, sampled every `interval` s.

    PSS (smaps_rollup walks the page tables: dearer) is sampled every `pss_every`-th time.
    """

    def __init__(self, root: int, interval: float = 0.05, pss_every: int = 10) -> None:
        super().__init__(daemon=True)
        self.root, self.interval, self.pss_every = root, interval, pss_every
        self.peak_rss = self.peak_pss = self.max_procs = self.samples = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            pids = _tree(self.root)
            rss = pss = 0
            with_pss = self.samples % self.pss_every == 0
            for pid in pids:
                r, p = _rss_pss(pid, with_pss)
                rss += r
                pss += p
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, pss)
            self.max_procs = max(self.max_procs, len(pids))
            self.samples += 1
            self.stop.wait(self.interval)


def _self_cpu() -> float:
    """CPU seconds of this process (the /proc sampler's cost, competing with the measured run)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError):
        return -1.0


def _parse_time_v(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for line in text.splitlines():
        key, _, value = line.strip().rpartition(": ")
        if key == "Maximum resident set size (kbytes)":
            out["max_single_rss_bytes"] = int(value) * 1024
        elif key == "User time (seconds)":
            out["user_s"] = float(value)
        elif key == "System time (seconds)":
            out["sys_s"] = float(value)
        elif key == "Percent of CPU this job got":
            out["cpu_percent"] = value
    return out


def measure(name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> dict:
    """Run `cmd` as a fresh process tree; wall time, peak tree RSS/PSS, /usr/bin/time figures."""
    use_time = os.path.exists("/usr/bin/time")
    time_file = log.with_suffix(".time")
    full = ["/usr/bin/time", "-v", "-o", str(time_file), *cmd] if use_time else cmd
    print(f"[{name}] $ {' '.join(cmd)}", flush=True)
    load_before = _loadavg()
    self_cpu = _self_cpu()
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        rc = proc.wait()
        wall = time.perf_counter() - t0
        sampler.stop.set()
        sampler.join()
    result: dict[str, Any] = {
        "name": name,
        "cmd": cmd,
        "rc": rc,
        "wall_s": round(wall, 3),
        "peak_tree_rss_bytes": sampler.peak_rss,
        "peak_tree_pss_bytes": sampler.peak_pss,
        "max_processes": sampler.max_procs,
        "samples": sampler.samples,
        "log": str(log),
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "sampler_cpu_s": round(_self_cpu() - self_cpu, 2),
    }
    if use_time and time_file.exists():
        result.update(_parse_time_v(time_file.read_text()))
    else:  # no /usr/bin/time: the largest reaped child of this process so far
        import resource

        result["max_single_rss_bytes"] = (
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        )
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"[{name}] failed with exit code {rc}; log {log}:\n{tail}")
    print(
        f"[{name}] {wall:.1f} s, peak tree RSS {sampler.peak_rss / 2**20:.0f} MiB "
        f"(PSS {sampler.peak_pss / 2**20:.0f} MiB), {sampler.max_procs} processes",
        flush=True,
    )
    return result


BASELINE_CODE = """
import sys
from pathlib import Path
import polars as pl
src, out = Path(sys.argv[1]), Path(sys.argv[2])
for f in sorted(src.glob("*.jsonl")):
    pl.scan_ndjson(f).sink_parquet(out / (f.stem + ".parquet"))
"""


def run_baseline(data: Path, tag: str) -> dict[str, Any]:
    out = WORK / "out" / f"baseline-{tag}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-c", BASELINE_CODE, str(data / "clean"), str(out)]
    result = measure(f"baseline {tag}", cmd, WORK / "out" / f"baseline-{tag}.log")
    import pyarrow.parquet as pq

    result["rows_out"] = sum(pq.ParquetFile(p).metadata.num_rows for p in out.glob("*.parquet"))
    result["output_bytes"] = sum(p.stat().st_size for p in out.glob("*.parquet"))
    shutil.rmtree(out)
    return result


def run_ingest(data: Path, tag: str, workers: int | None) -> dict[str, Any]:
    config = write_config(data, "bench")
    run_dir = WORK / "out" / f"ingest-{tag}"
    cmd = [
        sys.executable,
        "-m",
        "dflash_etl",
        "ingest",
        "--config",
        str(config),
        "--run",
        str(run_dir),
        "--force",
    ]
    if workers:
        cmd += ["--workers", str(workers)]
    result = measure(f"ingest {tag}", cmd, WORK / "out" / f"ingest-{tag}.log")
    stats = json.loads((run_dir / "ingest" / "stats.json").read_text())["total"]
    result["stats"] = {
        k: stats[k]
        for k in ("rows_in", "rows_out", "rows_quarantined", "quarantine_reasons", "rows_filtered")
    }
    conv = run_dir / "ingest" / "conversations"
    result["output_bytes"] = sum(p.stat().st_size for p in conv.glob("*.parquet"))
    return result


def profile_ingest(data: Path, top: int) -> dict[str, Any]:
    """cProfile of a workers=1 ingest (all work in one process); hotspots by cumulative time."""
    config = write_config(data, "bench")
    run_dir = WORK / "out" / "ingest-profile"
    prof = WORK / "out" / "ingest-profile.prof"
    cmd = [
        sys.executable,
        "-m",
        "cProfile",
        "-o",
        str(prof),
        "-m",
        "dflash_etl",
        "ingest",
        "--config",
        str(config),
        "--run",
        str(run_dir),
        "--force",
        "--workers",
        "1",
    ]
    result = measure("profile (cProfile, workers=1)", cmd, WORK / "out" / "ingest-profile.log")
    st = pstats.Stats(str(prof))
    total = st.total_tt  # type: ignore[attr-defined]
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        short = file
        for marker in ("/src/", "/site-packages/", "/lib/python3"):
            if marker in file:
                short = file.split(marker, 1)[1]
                break
        rows.append(
            {
                "function": f"{short}:{line}({func})",
                "calls": nc,
                "tottime_s": round(tt, 3),
                "cumtime_s": round(ct, 3),
                "tot_pct": round(100 * tt / total, 1),
                "cum_pct": round(100 * ct / total, 1),
            }
        )
    wrappers = (
        "<frozen ",
        "<string>",
        "(<module>)",
        "builtins.exec>",
        "cli.py:",
        "__main__.py",
        "cProfile",
    )
    imports = max((r["cumtime_s"] for r in rows if "_find_and_load)" in r["function"]), default=0.0)
    by_cum = sorted(
        (r for r in rows if not any(w in r["function"] for w in wrappers)),
        key=lambda r: -r["cumtime_s"],
    )[:top]
    by_tot = sorted(rows, key=lambda r: -r["tottime_s"])[:top]
    return {
        "run": result,
        "total_s": round(total, 2),
        "import_s": round(imports, 2),
        "import_pct": round(100 * imports / total, 1),
        "prof_file": str(prof),
        "top_cumulative": by_cum,
        "top_tottime": by_tot,
    }


# ------------------------------------------------------------------ report
def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "-"


def machine_info() -> dict[str, Any]:
    def sh(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO).stdout.strip()
        except OSError:
            return ""

    mem = ""
    cpu = platform.processor()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = sh("git", "rev-parse", "--short", "HEAD")
    if sh("git", "status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": sh("nproc") or str(os.cpu_count()),
        "memory": mem,
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "polars": _version("polars"),
        "pyarrow": _version("pyarrow"),
        "orjson": _version("orjson"),
        "dflash_etl": _version("dflash_etl") + f" @ {commit}",
    }


def _mib(n: int | None) -> str:
    return "-" if not n else f"{n / 2**20:,.0f} MiB"


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    meta = res["dataset"]
    base, ing = res["baseline"], res["ingest"]
    b_rows, i_rows = meta["rows"], meta["rows"] + meta["malformed"]
    for r, rows, nbytes in (
        (base, b_rows, meta["bytes"]["clean"]),
        (ing, i_rows, meta["bytes"]["dirty"]),
    ):
        r["input_rows"], r["input_bytes"] = rows, nbytes
        r["rows_per_s"] = round(rows / r["wall_s"])
        r["mb_per_s"] = round(nbytes / 1e6 / r["wall_s"], 1)
        cpu = r.get("user_s", 0) + r.get("sys_s", 0)
        r["rows_per_cpu_s"] = round(rows / cpu) if cpu else None
    ratio = ing["rows_per_s"] / base["rows_per_s"]
    goals = {
        "throughput_ratio": {
            "value": round(ratio, 3),
            "goal": f">= {GOAL_RATIO}",
            "met": ratio >= GOAL_RATIO,
        },
        "throughput_ratio_per_cpu_s (info)": {
            "value": round(ing["rows_per_cpu_s"] / base["rows_per_cpu_s"], 3)
            if ing.get("rows_per_cpu_s") and base.get("rows_per_cpu_s")
            else 0.0,
            "goal": "(not a goal: rows per CPU-second, less sensitive to a busy machine)",
            "met": True,
        },
        "peak_rss_bytes": {
            "value": ing["peak_tree_rss_bytes"],
            "goal": "<= 2 GiB",
            "met": ing["peak_tree_rss_bytes"] <= GOAL_RSS,
        },
    }
    small = res.get("ingest_small")
    if small:
        scaling = ing["peak_tree_rss_bytes"] / small["peak_tree_rss_bytes"]
        goals["rss_scaling"] = {
            "value": round(scaling, 3),
            "goal": f"<= {GOAL_SCALING} (RSS at {meta['rows']:,} / at {res['small_rows']:,} rows)",
            "met": scaling <= GOAL_SCALING,
        }
    return goals


def markdown(res: dict[str, Any]) -> str:
    meta, m, goals = res["dataset"], res["machine"], res["goals"]
    lines = [
        f"# Ingest benchmark — {meta['rows']:,} rows",
        "",
        f"Command: `{res['command']}`  ",
        f"Date: {m['date']}; {m['nproc']} CPUs ({m['cpu']}), {m['memory']} RAM, "
        f"Linux {m['kernel']}; Python {m['python']}, polars {m['polars']}, pyarrow "
        f"{m['pyarrow']}, orjson {m['orjson']}; dflash_etl {m['dflash_etl']}.",
        "",
        f"Input: {meta['rows']:,} synthetic conversations in one JSONL file per format "
        f"({', '.join(f'{k} {v:.0%}' for k, v in FORMAT_MIX.items())}); "
        f"{meta['bytes']['clean'] / 1e6:,.0f} MB clean (mean "
        f"{meta['bytes']['clean'] / meta['rows']:,.0f} B/row). The ingest input has "
        f"{meta['malformed']:,} malformed lines mixed in "
        f"({', '.join(f'{k} {v}' for k, v in meta['malformed_kinds'].items())}); the baseline "
        "reads the same rows without them. Both run as fresh processes, inputs in the page cache.",
        "",
        "| run | input rows | input MB | wall s | rows/s | MB/s | peak RSS (tree) | "
        "peak PSS (tree) | max RSS (1 process) | CPU user+sys s | rows/CPU-s | processes | "
        "load avg before→after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    runs = [
        ("baseline: `pl.scan_ndjson(f).sink_parquet(out)`", res["baseline"]),
        ("`dflash-etl ingest` (default workers)", res["ingest"]),
    ]
    if res.get("ingest_small"):
        runs.append((f"`dflash-etl ingest`, {res['small_rows']:,} rows", res["ingest_small"]))
    if res.get("ingest_w1"):
        runs.append(
            (f"`dflash-etl ingest --workers 1`, {res['small_rows']:,} rows", res["ingest_w1"])
        )
    for label, r in runs:
        rows = r.get("input_rows", "")
        mb = r.get("input_bytes", 0) / 1e6
        lines.append(
            f"| {label} | {rows:,} | {mb:,.0f} | {r['wall_s']:.1f} | "
            f"{r.get('rows_per_s', 0):,} | {r.get('mb_per_s', 0):,.1f} | "
            f"{_mib(r['peak_tree_rss_bytes'])} | {_mib(r['peak_tree_pss_bytes'])} | "
            f"{_mib(r.get('max_single_rss_bytes'))} | "
            f"{r.get('user_s', 0) + r.get('sys_s', 0):.1f} | {r.get('rows_per_cpu_s') or 0:,} | "
            f"{r['max_processes']} | {r['loadavg_before']:.1f}→{r['loadavg_after']:.1f} |"
        )
    lines += ["", "| goal | value | target | met |", "|---|---:|---|---|"]
    for key, g in goals.items():
        value = _mib(g["value"]) if key == "peak_rss_bytes" else f"{g['value']:.2f}×"
        met = "" if "(info)" in key else ("yes" if g["met"] else "**no**")
        lines.append(f"| {key} | {value} | {g['goal']} | {met} |")
    s = res["ingest"]["stats"]
    lines += [
        "",
        f"Ingest accounting ({meta['rows']:,} rows): {s['rows_in']:,} in → {s['rows_out']:,} out, "
        f"{s['rows_quarantined']:,} quarantined {s['quarantine_reasons']}, filtered "
        f"{s['rows_filtered']}. Baseline wrote {res['baseline']['rows_out']:,} rows. The RSS "
        f"sampler itself used {res['baseline'].get('sampler_cpu_s', '?')} / "
        f"{res['ingest'].get('sampler_cpu_s', '?')} CPU-s during the baseline / ingest run.",
        "",
        "Notes: *peak RSS (tree)* sums the RSS of the process and all its descendants (sampled "
        "every 50 ms from /proc; PSS every 500 ms) and so counts pages shared by forked workers "
        "more than once; "
        "*PSS* divides shared pages among their processes; *max RSS (1 process)* is "
        "`/usr/bin/time -v`'s figure for the largest single process. Throughput counts input "
        "lines (the ingest's include the malformed ones) over the whole process's wall time, "
        "start-up included. The ratio is ingest rows/s over baseline rows/s. The load average "
        f"is the machine's ({m['nproc']} CPUs): above {m['nproc']} other work competed for them.",
    ]
    prof = res.get("profile")
    if prof:
        lines += [
            "",
            f"## Profile: `--workers 1`, {res['small_rows']:,} rows, cProfile "
            f"({prof['total_s']} s profiled; the profiler inflates Python-call-heavy code)",
            "",
            f"Imports (all modules, including those `run()` imports lazily): {prof['import_s']} s "
            f"= {prof['import_pct']}% of the profiled time. Cumulative list without the "
            "start-up wrappers (runpy, cli, `<module>`, importlib frames); `~:0(...)` are "
            "built-ins. Load the stats with `python -m pstats "
            f"{Path(prof['prof_file']).relative_to(REPO)}`.",
            "",
            "| function | calls | cumulative s | cumulative % | own s | own % |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in prof["top_cumulative"]:
            lines.append(
                f"| `{r['function']}` | {r['calls']:,} | {r['cumtime_s']} | "
                f"{r['cum_pct']} | {r['tottime_s']} | {r['tot_pct']} |"
            )
        lines += [
            "",
            "By own time:",
            "",
            "| function | calls | own s | own % |",
            "|---|---:|---:|---:|",
        ]
        for r in prof["top_tottime"]:
            lines.append(
                f"| `{r['function']}` | {r['calls']:,} | {r['tottime_s']} | {r['tot_pct']} |"
            )
    return "\n".join(lines) + "\n"


def warm_cache(data: Path) -> None:
    """Read the inputs once so both runs find them in the page cache."""
    for p in sorted(data.glob("*/*.jsonl")):
        with open(p, "rb") as fh:
            while fh.read(16 * 2**20):
                pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="conversations (default 1M)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--malformed-rate", type=float, default=0.001)
    ap.add_argument("--workers", type=int, default=None, help="ingest workers (default: its own)")
    ap.add_argument(
        "--small-rows",
        type=int,
        default=100_000,
        help="rows of the RSS-scaling and profile runs (default 100k)",
    )
    ap.add_argument("--no-scaling", action="store_true", help="skip the small-input ingest run")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile run")
    ap.add_argument("--generate-only", action="store_true", help="only write the dataset(s)")
    ap.add_argument("--top", type=int, default=25, help="hotspots to list")
    ap.add_argument(
        "--out",
        help="results path without suffix (default: results/ingest, or "
        "results/ingest_<rows> for other --rows)",
    )
    args = ap.parse_args(argv)

    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "out").mkdir(exist_ok=True)
    RESULTS.mkdir(exist_ok=True)
    res: dict[str, Any] = {
        "command": "python benchmarks/bench_ingest.py"
        + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "machine": machine_info(),
        "small_rows": args.small_rows,
    }
    meta = generate(args.rows, args.seed, args.malformed_rate)
    data = dataset_dir(args.rows, args.seed, args.malformed_rate)
    if args.generate_only:
        if not (args.no_scaling and args.no_profile):
            generate(args.small_rows, args.seed, args.malformed_rate)
        return 0
    res["dataset"] = meta
    tag = f"{args.rows}"
    warm_cache(data)
    res["baseline"] = run_baseline(data, tag)
    res["ingest"] = run_ingest(data, tag, args.workers)

    small_data = data
    if args.small_rows != args.rows and not (args.no_scaling and args.no_profile):
        small_meta = generate(args.small_rows, args.seed, args.malformed_rate)
        small_data = dataset_dir(args.small_rows, args.seed, args.malformed_rate)
        warm_cache(small_data)
    else:
        small_meta = meta
    if not args.no_scaling and args.small_rows != args.rows:
        res["ingest_small"] = run_ingest(small_data, f"{args.small_rows}", args.workers)
        res["ingest_small"]["input_rows"] = small_meta["rows"] + small_meta["malformed"]
        res["ingest_small"]["input_bytes"] = small_meta["bytes"]["dirty"]
    if not args.no_profile:
        res["ingest_w1"] = run_ingest(small_data, f"{args.small_rows}-w1", 1)
        res["profile"] = profile_ingest(small_data, args.top)
    for key in ("ingest_small", "ingest_w1"):
        r = res.get(key)
        if r:
            r["input_rows"] = small_meta["rows"] + small_meta["malformed"]
            r["input_bytes"] = small_meta["bytes"]["dirty"]
            r["rows_per_s"] = round(r["input_rows"] / r["wall_s"])
            r["mb_per_s"] = round(r["input_bytes"] / 1e6 / r["wall_s"], 1)
            cpu = r.get("user_s", 0) + r.get("sys_s", 0)
            r["rows_per_cpu_s"] = round(r["input_rows"] / cpu) if cpu else None
    res["goals"] = summarize(res)

    stem = args.out or str(
        RESULTS / ("ingest" if args.rows == 1_000_000 else f"ingest_{args.rows}")
    )
    Path(stem + ".json").write_text(json.dumps(res, indent=2, default=str))
    md = markdown(res)
    Path(stem + ".md").write_text(md)
    print()
    print(md)
    print(f"results: {stem}.md, {stem}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
