"""regenerate's openai backend over 4 local dev servers vs 1: requests/s of the stage's client.

Four `python -m dflash_etl.models.devserver --instant` processes (each its own process, all
started once and used by every row of the same run). For each server setting N chat-completion
requests go through `OpenAIBackend.generate` (the stage's own client), once with `endpoint` = the
first server, once with `endpoints` = all four, at the same `concurrency` (in flight per server).

Two server settings:
  --latency-ms 0 (plain `--instant`): a fixed reply at once, so the client and the HTTP stack on
      this machine's cores are the bottleneck, not the servers: more servers cannot help much;
  --latency-ms 50: each request holds its server's one generation slot for 50 ms (requests
      queue, as on the model dev server), a stand-in for a real server's generation time, so the
      servers are the bottleneck and 4 of them should give close to 4x the requests/s of 1.

    python benchmarks/bench_regenerate_fleet.py [--requests 200] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_regenerate import start_server  # noqa: E402  (the same dev-server launcher)

COMMAND = "python benchmarks/bench_regenerate_fleet.py"


def measure(urls: list[str], concurrency: int, n: int, latency_ms: float) -> dict:
    from dflash_etl.stages.regenerate import OpenAIBackend, RegenerateSettings

    where = {"endpoints": tuple(urls)} if len(urls) > 1 else {"endpoint": urls[0]}
    backend = OpenAIBackend(RegenerateSettings(
        model="instant", backend="openai", concurrency=concurrency, max_new_tokens=16,
        timeout_s=600, **where))
    requests = [([{"role": "user", "content": f"Question number {k}: what is {k} plus {k}?"}],
                 None) for k in range(n)]
    backend.generate(requests[:2 * len(urls)])  # warm-up: connections, first-call costs
    before = [s.served for s in backend.servers]
    cpu, start = time.process_time(), time.perf_counter()
    replies = backend.generate(requests)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    errors = [r.error for r in replies if r.error]
    if errors:
        raise SystemExit(f"requests failed: {errors[:3]}")
    return {"servers": len(urls), "latency_ms": latency_ms, "concurrency_per_server": concurrency,
            "requests": n, "seconds": round(wall, 3), "requests_per_s": round(n / wall, 1),
            "client_cpu_ms_per_request": round(1000 * cpu / n, 2),
            "per_server": [s.served - b for s, b in zip(backend.servers, before, strict=True)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4, help="in flight per server")
    parser.add_argument("--latencies", default="0,50", help="server latencies (ms) to run")
    parser.add_argument("--date", default=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"))
    args = parser.parse_args()
    latencies = [float(x) for x in args.latencies.split(",")]
    results = {"date": args.date,
               "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                           "cpu": platform.processor() or platform.machine()},
               "command": COMMAND, "runs": []}
    for latency in latencies:
        procs = [start_server(["--instant", "--latency-ms", str(latency)]) for _ in range(4)]
        try:
            urls = [url for _, url in procs]
            n = args.requests if latency else 5 * args.requests  # 0 ms: too quick otherwise
            for fleet in (urls[:1], urls):
                row = measure(fleet, args.concurrency, n, latency)
                results["runs"].append(row)
                print(json.dumps(row), flush=True)
        finally:
            for proc, _ in procs:
                proc.terminate()
                proc.wait()
    out = HERE / "results"
    (out / "regenerate_fleet.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# regenerate (openai backend) over 4 servers vs 1 — {args.date}", "",
             f"Machine: {os.cpu_count()} cores (shared with other work), Python "
             f"{platform.python_version()}. {args.requests} chat-completion requests per row "
             f"({5 * args.requests} at 0 ms) through `OpenAIBackend.generate` (the stage's "
             f"client), concurrency {args.concurrency} in flight per server."
             " Each server is its own `python -m dflash_etl.models.devserver --instant "
             "--latency-ms N` process on the same machine as the client.", "",
             f"Command: `{COMMAND}`", "",
             "| server latency | servers | requests | requests/s | speed-up | seconds | "
             "client CPU ms / request | requests per server |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    speedups = {}
    for row in results["runs"]:
        base = next(r for r in results["runs"]
                    if r["latency_ms"] == row["latency_ms"] and r["servers"] == 1)
        speedup = row["requests_per_s"] / base["requests_per_s"]
        if row["servers"] > 1:
            speedups[row["latency_ms"]] = speedup
        lines.append(f"| {row['latency_ms']:g} ms | {row['servers']} | {row['requests']} | "
                     f"{row['requests_per_s']} | "
                     f"{speedup:.2f}x | {row['seconds']} | {row['client_cpu_ms_per_request']} | "
                     f"{row['per_server']} |")
    lines += ["", "*0 ms*: plain `--instant` (a fixed reply at once). Nothing waits on a "
              "generation: one server process (Python, one GIL) and the client compete for the "
              "same cores, and more server processes help only until those cores are full. "
              "This row is the ceiling of the client plus the HTTP stack on this machine, not "
              "a measure of the fleet: the instant server is too fast for the scaling to show.",
              "", "*50 ms* (and any latency > 0): each request holds its server's one "
              "generation slot that long (`--latency-ms`, added to the dev server for this "
              "benchmark as a stand-in for a real server's generation time; requests queue as "
              "on the model dev server), so one server can do at most 1000/latency requests/s "
              "and the servers, not the client, are the bottleneck."]
    for latency, speedup in speedups.items():
        if latency > 0:
            lines += ["", f"With {latency:g} ms per request, 4 servers give {speedup:.2f}x the "
                      f"requests/s of 1 (goal: >= 3x): "
                      f"{'met' if speedup >= 3 else 'NOT met'}."]
    (out / "regenerate_fleet.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
