"""regenerate's openai backend against a local OpenAI-compatible server, at concurrency 1, 8, 32.

Two servers, each its own process (so the client measured here shares no interpreter with them):
  model:   `python -m dflash_etl.models.devserver --model <tiny random Qwen2>`: real
           generation, one at a time (the dev server serialises the model);
  instant: `python -m dflash_etl.models.devserver --instant`: a fixed reply with no model, i.e.
           the most requests/s this client and the HTTP stack can do.
For each, N chat-completion requests go through `OpenAIBackend.generate` (the stage's own client);
reported: requests/s, completion tokens/s, and the client's CPU seconds per request. The client is
not the bottleneck when the instant server's requests/s is far above the model server's and the
client's CPU per request is a small part of a request's wall time.

    python benchmarks/bench_regenerate.py [--requests 64] [--max-new-tokens 16]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = HERE / "work" / "regenerate"


def tiny_model(out: Path) -> Path:
    """A 2-layer random Qwen2 with the project's tokenizer (as in tests/test_regenerate_stage)."""
    from dflash_etl.models.tiny_model import build_tiny_qwen2

    return build_tiny_qwen2(out, hidden_size=32, layers=2, heads=2, kv_heads=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_etl.models.devserver",
                             "--port", str(port),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = []
    for line in proc.stdout:  # "serving NAME at URL" once it listens (after loading the model)
        seen.append(line)
        if line.startswith("serving"):
            return proc, f"http://127.0.0.1:{port}/v1"
    proc.kill()
    raise SystemExit("the dev server did not start:\n" + "".join(seen[-20:]))


def measure(url: str, model_dir: Path, concurrency: int, n: int, max_new_tokens: int) -> dict:
    from dflash_etl.stages.regenerate import OpenAIBackend, RegenerateSettings

    backend = OpenAIBackend(RegenerateSettings(
        model=str(model_dir), backend="openai", endpoint=url, concurrency=concurrency,
        max_new_tokens=max_new_tokens, temperature=1.0, timeout_s=600))
    requests = [([{"role": "user", "content": f"Question number {k}: what is {k} plus {k}?"}],
                 None) for k in range(n)]
    backend.generate(requests[:2])  # warm-up: connection set-up, first-call costs
    cpu, start = time.process_time(), time.perf_counter()
    replies = backend.generate(requests)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    errors = [r.error for r in replies if r.error]
    if errors:
        raise SystemExit(f"requests failed: {errors[:3]}")
    tokens = sum(r.new_tokens for r in replies)
    return {"concurrency": concurrency, "requests": n, "seconds": round(wall, 3),
            "requests_per_s": round(n / wall, 1), "tokens_per_s": round(tokens / wall, 1),
            "client_cpu_ms_per_request": round(1000 * cpu / n, 2),
            "wall_ms_per_request": round(1000 * wall / n, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    model_dir = tiny_model(WORK / "tiny-model")
    results = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
               "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                           "cpu": platform.processor() or platform.machine()},
               "requests": args.requests, "max_new_tokens": args.max_new_tokens, "runs": {}}
    for name, server_args in (("model", ["--model", str(model_dir)]),
                              ("instant", ["--instant"])):
        proc, url = start_server(server_args)
        try:
            results["runs"][name] = [measure(url, model_dir, c, args.requests,
                                             args.max_new_tokens) for c in (1, 8, 32)]
        finally:
            proc.terminate()
            proc.wait()
        for row in results["runs"][name]:
            print(name, json.dumps(row), flush=True)
    out = HERE / "results"
    (out / "regenerate.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# regenerate (openai backend) benchmark — {results['date']}", "",
             f"{os.cpu_count()} cores, Python {platform.python_version()}; "
             f"{args.requests} chat-completion requests per row, max_new_tokens "
             f"{args.max_new_tokens}, through `OpenAIBackend.generate` (the stage's client). "
             "Command: `python benchmarks/bench_regenerate.py`.", "",
             "| server | concurrency | requests/s | completion tokens/s | wall ms / request | "
             "client CPU ms / request |", "|---|---:|---:|---:|---:|---:|"]
    for name, rows in results["runs"].items():
        for r in rows:
            lines.append(f"| {name} | {r['concurrency']} | {r['requests_per_s']} | "
                         f"{r['tokens_per_s']} | {r['wall_ms_per_request']} | "
                         f"{r['client_cpu_ms_per_request']} |")
    lines += ["", "*model*: `python -m dflash_etl.models.devserver` over a tiny random-weight "
              "Qwen2 "
              "(real generate, one request at a time: more concurrency cannot make it faster); "
              "*instant*: the same server with `--instant` (a fixed reply, no model), the "
              "ceiling of this client plus the HTTP stack on this machine. Both servers run in "
              "their own process, on the same 2 cores as the client."]
    model_best = max(r["requests_per_s"] for r in results["runs"]["model"])
    instant_worst = min(r["requests_per_s"] for r in results["runs"]["instant"])
    cpu_share = max(r["client_cpu_ms_per_request"] / r["wall_ms_per_request"]
                    for r in results["runs"]["model"])
    lines += ["", f"The client's ceiling (instant server, worst concurrency: {instant_worst} "
              f"requests/s) is {instant_worst / model_best:.0f}x the model server's best "
              f"({model_best} requests/s), and against the model server the client's own CPU is "
              f"at most {100 * cpu_share:.0f}% of a request's wall time: the client is not the "
              "bottleneck."]
    (out / "regenerate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
