"""regenerate's openai backend over several servers (`endpoints`): real HTTP dev servers on
127.0.0.1, started in-process (`--instant`: a deterministic reply per request, no model), killed
mid-run, all down, or serving different models."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import polars as pl
import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.models.devserver import DevServer
from dflash_etl.models.generation.fleet import OpenAIBackend
from dflash_etl.stages import regenerate
from dflash_etl.stages.regenerate import RegenerateSettings

N_PROMPTS = 24
ROWS = [{"id": f"p{k}", "prompt": f"Question {k}: what is {k} plus {k}?"}
        for k in range(N_PROMPTS)] + [
    {"id": "c1", "messages": [{"role": "user", "content": "Hi there"},
                              {"role": "assistant", "content": "Hello! How can I help?"}]}]


@pytest.fixture()
def ingested(ingest_rows) -> Path:
    return ingest_rows(ROWS, "q")


@pytest.fixture()
def servers(dev_servers):
    """Instant dev servers, started on demand and all stopped at the end (conftest's)."""
    return dev_servers


def _kw(urls: list[str], **extra) -> dict:
    """Stage keywords; `endpoints` only for a fleet (one server: `endpoint`, as before)."""
    where = {"endpoints": urls} if len(urls) > 1 else {"endpoint": urls[0]}
    return {"model": "instant", "backend": "openai", "max_new_tokens": 16, "mode": "missing",
            "dummy_min_repeats": 99, "concurrency": 2, "timeout_s": 5.0, **where, **extra}


def _backend(urls: list[str], **extra) -> OpenAIBackend:
    return OpenAIBackend(RegenerateSettings(**_kw(urls, **extra)))


def _outputs(run_dir: Path) -> tuple[list[dict], list[dict]]:
    convs = pl.read_parquet(run_dir / "regenerate" / "conversations" / "*.parquet")
    turns = pl.read_parquet(run_dir / "regenerate" / "generated_turns.parquet")
    return convs.sort("id").to_dicts(), turns.sort("id").to_dicts()


def _requests(n: int) -> list:
    return [([{"role": "user", "content": f"request {k}"}], None) for k in range(n)]


def _accounted(total: dict) -> bool:
    return total["rows_in"] == (total["rows_out"] + total["rows_quarantined"]
                                + sum(total["rows_filtered"].values()))


def test_two_servers_give_the_same_rows_as_one(servers, ingested, tmp_path, copy_run):
    one, = servers(1)
    regenerate.run(None, ingested, progress=False, **_kw([one.url]))
    a, b = servers(2)
    fleet_run = copy_run(ingested, tmp_path / "fleet", "*regenerate*")
    doc = regenerate.run(None, fleet_run, progress=False, **_kw([a.url, b.url]))
    assert _outputs(fleet_run) == _outputs(ingested)  # rows, turns and cache keys alike
    assert doc["total"]["rows_out"] == N_PROMPTS + 1 and _accounted(doc["total"])
    assert a.requests > 0 and b.requests > 0
    assert a.requests + b.requests == one.requests == N_PROMPTS
    load = doc["total"]["servers"]  # the fleet client's own count, per server
    assert [load[s.url]["served"] for s in (a, b)] == [a.requests, b.requests]
    convs, _ = _outputs(fleet_run)  # each reply is the one for its own prompt (request order)
    replies = {c["messages"][0]["content"]: c["messages"][-1]["content"] for c in convs}
    probe = DevServer(None, instant=True)
    for prompt, reply in replies.items():
        if prompt.startswith("Question"):
            assert reply == probe.complete({"messages": [{"role": "user",
                                                          "content": prompt}]})[0]
    probe.stop()


def test_requests_go_to_the_least_loaded_server(servers):
    fast, slow = servers(1, latency_ms=2)[0], servers(1, latency_ms=40)[0]
    backend = _backend([fast.url, slow.url], concurrency=2)
    replies = backend.generate(_requests(40))
    assert not [r.error for r in replies if r.error]
    ref, = servers(1)
    assert [r.text for r in replies] == [r.text for r in _backend([ref.url]).generate(
        _requests(40))]  # in request order
    assert fast.requests + slow.requests == 40
    assert [s.served for s in backend.servers] == [fast.requests, slow.requests]
    # the fast server frees its slots sooner, so it takes most of the work (round-robin: 20/20)
    assert fast.requests > 3 * slow.requests > 0

    even = servers(3, latency_ms=10)
    backend = _backend([s.url for s in even], concurrency=2)
    backend.generate(_requests(30))
    assert all(7 <= s.requests <= 13 for s in even), [s.requests for s in even]  # ~ a third each


def test_a_server_killed_mid_run_loses_no_row(servers, ingested, tmp_path, copy_run):
    a, b = servers(2, latency_ms=10)
    a.die_after = 5  # the 6th request it receives kills it, in-flight ones are dropped
    backend = _backend([a.url, b.url], cooldown_s=30.0)
    doc = regenerate.run(None, ingested, progress=False, generator=backend,
                         **_kw([a.url, b.url]))
    total = doc["total"]
    assert total["rows_out"] == N_PROMPTS + 1 and total["rows_quarantined"] == 0
    assert _accounted(total) and total["generated_turns"] == N_PROMPTS
    assert a.dead and backend.failovers >= 1 and not backend.servers[0].healthy
    served = [s.served for s in backend.servers]
    assert served[0] < 6 and sum(served) == N_PROMPTS  # every reply once; b wrote the rest
    assert b.requests == served[1]
    lines = (ingested / "regenerate" / "generations.jsonl").read_text().splitlines()
    keys = [json.loads(line)["key"] for line in lines]
    assert len(keys) == len(set(keys)) == N_PROMPTS  # none lost, none twice
    one, = servers(1)
    alone = copy_run(ingested, tmp_path / "alone", "*regenerate*")
    regenerate.run(None, alone, progress=False, **_kw([one.url]))
    assert _outputs(ingested) == _outputs(alone)


def test_a_server_that_comes_back_is_probed_and_used_again(servers):
    a, b = servers(2)
    backend = _backend([a.url, b.url], cooldown_s=0.3)
    port = int(a.url.rsplit(":", 1)[1].split("/")[0])
    a.stop()
    assert not [r for r in backend.generate(_requests(8)) if r.error]
    assert not backend.servers[0].healthy and backend.servers[1].served == 8
    again, = servers(1, port=port)  # the same address, answering again
    time.sleep(0.4)
    assert not [r for r in backend.generate(_requests(16)) if r.error]
    assert backend.servers[0].healthy and again.requests > 0


def test_all_servers_down_quarantines_rows_within_a_deadline(servers, ingested):
    a, b = servers(2)
    backend = _backend([a.url, b.url], cooldown_s=1.0)
    a.stop()
    b.stop()
    start = time.monotonic()
    with pytest.raises(StageError, match="quarantine"):  # the gate: 24 of 25 rows quarantined
        regenerate.run(None, ingested, progress=False, generator=backend,
                       **_kw([a.url, b.url], cooldown_s=1.0))
    assert time.monotonic() - start < 8.0  # one probe round (1 s), never a hang
    partial = ingested / ".regenerate.partial"
    quarantine = pl.read_parquet(partial / "quarantine.parquet")
    assert quarantine.height == N_PROMPTS and set(quarantine["reason"]) == {"generation_failed"}
    for message in quarantine["message"]:
        assert "--endpoints" in message and a.url in message and b.url in message
    total = json.loads((partial / "stats.json").read_text())["total"]
    assert _accounted(total) and total["rows_out"] == 1  # c1 needed no reply
    manifest = json.loads((ingested / "manifest.json").read_text())
    assert manifest["stages"]["regenerate"]["status"] == "failed"
    # failed generations are not cached: servers back, the rerun generates them all
    assert not (ingested / ".regenerate.partial" / "generations.jsonl").read_text().strip()


def test_servers_dying_mid_run_fail_the_rest_as_rows(servers, ingested):
    a, b = servers(2, latency_ms=5)
    a.die_after, b.die_after = 4, 4
    backend = _backend([a.url, b.url], cooldown_s=0.5)
    start = time.monotonic()
    try:
        doc = regenerate.run(None, ingested, progress=False, generator=backend,
                             **_kw([a.url, b.url]))
        total = doc["total"]
    except StageError as exc:  # the quarantine-rate gate fails the stage: counts in the partial
        assert "quarantine" in str(exc)
        total = json.loads((ingested / ".regenerate.partial" / "stats.json").read_text())["total"]
    assert time.monotonic() - start < 8.0
    assert _accounted(total) and total["rows_in"] == N_PROMPTS + 1
    assert total["rows_out"] == 1 + sum(s.served for s in backend.servers)
    assert total["quarantine_reasons"] == {"generation_failed": N_PROMPTS
                                           - sum(s.served for s in backend.servers)}


def test_a_rerun_against_another_fleet_reuses_the_cache(servers, ingested):
    one, = servers(1)
    first = _backend([one.url])
    real, calls = first.generate, {"n": 0}

    def crash_after_one(requests):
        calls["n"] += 1
        if calls["n"] > 1:
            raise KeyboardInterrupt
        return real(requests)

    first.generate = crash_after_one  # batch_hint 8: one batch of 8 cached, then interrupted
    with pytest.raises(KeyboardInterrupt):
        regenerate.run(None, ingested, progress=False, generator=first, **_kw([one.url]))
    a, b = servers(2)
    fleet = _backend([a.url, b.url])
    assert fleet.model_id == first.model_id  # the cache keys do not depend on the servers
    regenerate.run(None, ingested, progress=False, generator=fleet, **_kw([a.url, b.url]))
    assert a.requests + b.requests == N_PROMPTS - 8  # only what was missing


def test_servers_listing_different_models_are_refused(servers):
    a, = servers(1)
    b, = servers(1, name="another-model")
    with pytest.raises(StageError, match="do not serve the same models") as err:
        _backend([a.url, b.url])
    assert a.url in str(err.value) and b.url in str(err.value)
    assert "another-model" in str(err.value)


def test_endpoints_from_the_cli_and_the_config(tmp_path):
    from dflash_etl.cli.main import build_parser
    from dflash_etl.cli.stage import settings_overrides
    from dflash_etl.core.config import build_settings

    args = build_parser().parse_args(["regenerate", "--endpoints",
                                      "http://h1:8001/v1, http://h2:8002/v1/"])
    overrides = settings_overrides(args, RegenerateSettings)
    assert overrides["endpoints"] == ("http://h1:8001/v1", "http://h2:8002/v1/")
    settings = build_settings(RegenerateSettings, "regenerate",
                              {"endpoints": ["http://h1:8001/v1", "http://h2:8002/v1"]},
                              {"model": "m"})
    assert settings.endpoints == ("http://h1:8001/v1", "http://h2:8002/v1")
    assert hash(settings) == hash(RegenerateSettings(model="m", endpoints=settings.endpoints))
    assert settings.servers == ("http://h1:8001/v1", "http://h2:8002/v1")
    assert RegenerateSettings(model="m").servers == ("http://127.0.0.1:8000/v1",)
    with pytest.raises(StageError, match="more than once"):
        build_settings(RegenerateSettings, "regenerate",
                       {"endpoints": ["http://h/v1", "http://h/v1/"]}, {"model": "m"})


def test_a_waiting_request_never_outlives_its_deadline(servers):
    """A fleet whose servers accept connections but never answer: every request times out,
    and generate returns row errors in bounded time."""
    import socket

    silent = []
    for _ in range(2):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        silent.append(sock)
    a, b = servers(2)
    backend = _backend([a.url, b.url], timeout_s=0.5, retries=0, cooldown_s=0.5)
    for srv, sock in zip((a, b), silent, strict=True):  # swap in the silent listeners
        srv.stop()
        backend.servers[[a, b].index(srv)].url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    start = time.monotonic()
    done = {}
    worker = threading.Thread(target=lambda: done.setdefault("r", backend.generate(
        _requests(6))), daemon=True)
    worker.start()
    worker.join(15.0)
    for sock in silent:
        sock.close()
    assert "r" in done, "generate hung"
    assert time.monotonic() - start < 10.0
    assert all(r.error for r in done["r"])
