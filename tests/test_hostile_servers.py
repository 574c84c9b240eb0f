"""regenerate's openai backend against a misbehaving OpenAI-compatible server: a real threaded
HTTP server on 127.0.0.1 whose behaviour per request is chosen by the prompt (`mode=NAME`), so
one stage run meets every failure at once. Each mode is a failure seen from real servers and
proxies: slow-loris trickles, endless streams and bodies, invalid JSON, HTML error pages, replies
without choices, broken SSE chunks, 503s, and replies stuck in a repetition loop."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.models.generation.fleet import OpenAIBackend
from dflash_etl.stages import ingest, load_config, regenerate
from dflash_etl.stages.regenerate import RegenerateSettings

TICK_S = 0.2  # a slow-loris byte (or an endless stream's chunk) this often
HTML_PAGE = ("<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1>"
             + "<p>upstream timed out</p>" * 400 + "</body></html>")
LOOP_REPLY = "Sure, here is the list you asked for: lin" + "lin" * 150
NGRAM_REPLY = "The cat sat on the mat and looked at the door. " * 12


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default 5 drops connections (a 1 s SYN retry) at concurrency 8


class Hostile:
    """An OpenAI-compatible server whose chat completions misbehave as the last user message's
    `mode=NAME` says; `once-NAME` misbehaves only on a prompt's first request, `broken = True`
    answers every request with 503, a mode in `fixed` answers well. `seen` counts requests per
    prompt."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()
        self.broken = False
        self.fixed: set[str] = set()
        self.models_mode = "ok"  # GET /v1/models: ok, or slow_loris
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.httpd = _Server(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,),
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()  # ends the endless replies
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(server: Hostile) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if server.models_mode == "slow_loris":
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.mode_slow_loris("", False)
                return
            self._send(200, json.dumps({"data": [{"id": "hostile"}]}).encode())

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["messages"][-1]["content"]
            with server.lock:
                server.seen[prompt] += 1
                first = server.seen[prompt] == 1
            found = re.search(r"mode=([\w-]+)", prompt)
            mode = found.group(1) if found else "ok"
            if mode.startswith("once-"):
                mode = mode[5:] if first else "ok"
            if mode in server.fixed:
                mode = "ok"
            if server.broken:
                mode = "status_503"
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # client gave up
                getattr(self, f"mode_{mode}")(prompt, bool(body.get("stream")))

        # ---------------------------------------------------------- replies
        def _reply(self, text: str, stream: bool, finish: str = "stop") -> None:
            if not stream:
                self._send(200, json.dumps({"choices": [{"index": 0, "message": {
                    "role": "assistant", "content": text}, "finish_reason": finish}],
                    "usage": {"completion_tokens": len(text.split())}}).encode())
                return
            self._stream_head()
            for k in range(0, len(text), 8):
                self._chunk({"choices": [{"delta": {"content": text[k:k + 8]}}]})
            self._chunk({"choices": [{"delta": {}, "finish_reason": finish}]})
            self.wfile.write(b"data: [DONE]\n\n")

        def _stream_head(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True

        def _chunk(self, data: dict[str, Any]) -> None:
            self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()

        def mode_ok(self, prompt: str, stream: bool) -> None:
            self._reply(f"A fine answer to: {prompt}", stream)

        def mode_loop(self, prompt: str, stream: bool) -> None:
            self._reply(LOOP_REPLY, stream)

        def mode_ngram(self, prompt: str, stream: bool) -> None:
            self._reply(NGRAM_REPLY, stream)

        def mode_surrogate(self, prompt: str, stream: bool) -> None:
            self._reply("An answer with a lone surrogate \ud800 in it.", stream)  # JSON: \\ud800

        def mode_status_503(self, prompt: str, stream: bool) -> None:
            self._send(503, b'{"error": {"message": "overloaded"}}')

        def mode_slow_loris(self, prompt: str, stream: bool) -> None:
            """Headers at once, then one byte per tick: every read succeeds, the body never
            ends (or, streaming, one chunk per tick)."""
            if stream:
                self._stream_head()
                while not server.stop_event.wait(TICK_S):
                    self._chunk({"choices": [{"delta": {"content": "x"}}]})
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100000")
            self.end_headers()
            while not server.stop_event.wait(TICK_S):
                self.wfile.write(b" ")
                self.wfile.flush()

        def mode_endless(self, prompt: str, stream: bool) -> None:
            """As fast as it can, forever: SSE chunks, or a chunked body."""
            if stream:
                self._stream_head()
                while not server.stop_event.is_set():
                    self._chunk({"choices": [{"delta": {"content": "more "}}]})
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.close_connection = True
            piece = b" " * 4096
            while not server.stop_event.is_set():
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))

        def mode_invalid_json(self, prompt: str, stream: bool) -> None:
            self._send(200, b'{"choices": [{"message": {"content": "cut')

        def mode_html(self, prompt: str, stream: bool) -> None:
            self._send(200, HTML_PAGE.encode(), "text/html")

        def mode_no_choices(self, prompt: str, stream: bool) -> None:
            self._send(200, b'{"object": "chat.completion", "model": "hostile"}')

        def mode_empty_choices(self, prompt: str, stream: bool) -> None:
            self._send(200, b'{"object": "chat.completion", "choices": []}')

        def mode_broken_sse(self, prompt: str, stream: bool) -> None:
            if not stream:
                self.mode_invalid_json(prompt, stream)
                return
            self._stream_head()
            self._chunk({"choices": [{"delta": {"content": "Hello"}}]})
            self.wfile.write(b'data: {"choices": [{"delta": {"content": \n\n')
            self.wfile.write(b"data: [DONE]\n\n")

        def mode_bad_choice(self, prompt: str, stream: bool) -> None:
            if not stream:
                self._send(200, b'{"choices": ["not an object"]}')
                return
            self._stream_head()
            self.wfile.write(b'data: {"choices": ["not an object"]}\n\n')

        def mode_open_after_finish(self, prompt: str, stream: bool) -> None:
            """The reply, then neither [DONE] nor a close (a proxy that keeps it open)."""
            if not stream:
                self.mode_ok(prompt, stream)
                return
            self._stream_head()
            self._chunk({"choices": [{"delta": {"content": "Done it."}}]})
            self._chunk({"choices": [{"delta": {}, "finish_reason": "stop"}]})
            server.stop_event.wait(30)

        def mode_cut_stream(self, prompt: str, stream: bool) -> None:
            """A stream that stops (connection closed) before [DONE] or a finish_reason."""
            if not stream:
                self.mode_invalid_json(prompt, stream)
                return
            self._stream_head()
            self._chunk({"choices": [{"delta": {"content": "Half a rep"}}]})

    return Handler


@pytest.fixture()
def hostile():
    srv = Hostile()
    yield srv
    srv.stop()


FAST = {"timeout_s": 1.0, "request_deadline_s": 1.0, "retries": 1, "concurrency": 8}


def _settings(server: Hostile, **extra: Any) -> RegenerateSettings:
    """The served model named (no /models lookup at start: on a loaded CI machine that lookup
    alone can pass FAST's 1 s deadline), unless a test asks for the lookup (served_model=None)."""
    return RegenerateSettings(**{"model": "hostile", "backend": "openai", "endpoint": server.url,
                                 "max_new_tokens": 32, "dummy_min_repeats": 99,
                                 "served_model": "hostile", **FAST, **extra})


def _within(budget_s: float, fn: Any) -> Any:
    """fn() in a thread, within `budget_s`: a hang fails the test instead of hanging it."""
    done: dict[str, Any] = {}

    def call() -> None:
        try:
            done["r"] = fn()
        except BaseException as exc:
            done["e"] = exc

    worker = threading.Thread(target=call, daemon=True)
    start = time.monotonic()
    worker.start()
    worker.join(budget_s + 10)
    assert done, f"hung (> {budget_s + 10:.0f} s)"
    assert time.monotonic() - start < budget_s
    if "e" in done:
        raise done["e"]
    return done["r"]


def _generate(backend: OpenAIBackend, prompts: list[str], budget_s: float) -> list:
    return _within(budget_s, lambda: backend.generate(
        [([{"role": "user", "content": p}], None) for p in prompts]))


@pytest.mark.parametrize("stream", [False, True])
def test_slow_loris_and_endless_replies_are_cut_and_retried(hostile, stream):
    prompts = ["mode=slow_loris", "mode=endless", "mode=once-slow_loris", "mode=once-endless",
               "mode=ok"]
    backend = OpenAIBackend(_settings(hostile, stream=stream))
    # each failing attempt ends at its deadline (1 s); two attempts plus a 0.25 s backoff
    replies = _generate(backend, prompts, budget_s=8.0)
    loris, endless, loris_once, endless_once, ok = replies
    assert "request_deadline_s=1" in loris.error and "after 2 attempts" in loris.error
    assert ("request_deadline_s=1" in endless.error  # whichever comes first: deadline or cap
            or "without ending" in endless.error), endless.error
    assert not loris_once.error and loris_once.text == "A fine answer to: mode=once-slow_loris"
    assert not endless_once.error and endless_once.text.startswith("A fine answer")
    assert not ok.error
    assert hostile.seen["mode=slow_loris"] == hostile.seen["mode=endless"] == 2  # retried once


@pytest.mark.parametrize("mode", ["slow_loris", "status_503", "endless"])
def test_a_server_that_fails_every_request_is_out_after_a_few(hostile, mode):
    """One server that trickles (or 503s, or streams without end) every reply: each of 33 rows
    waited out its retries x request_deadline_s, concurrency at a time (100 min at the
    defaults); counted per request after all its attempts, still (retries + 1) x the deadline,
    and an endless reply never counted (reliability issue, item 9). The breaker counts failed
    attempts, every kind: after BREAK_AFTER of one kind with none answered the server is out
    for the rest of the stage, the rows left fail at once, each saying why, in about one
    request_deadline_s, and the server sees about one wave of attempts."""
    from dflash_etl.models.generation.fleet import BREAK_AFTER

    backend = OpenAIBackend(_settings(hostile, concurrency=4))
    prompts = [f"Question {k}. mode={mode}" for k in range(33)]
    start = time.monotonic()
    replies = _generate(backend, prompts, budget_s=20)
    elapsed = time.monotonic() - start
    assert all(r.error for r in replies)
    sent = sum(hostile.seen.values())  # attempts
    assert BREAK_AFTER <= sent <= 4 + BREAK_AFTER  # about one wave, not 33 rows x attempts
    assert elapsed < FAST["request_deadline_s"] * 2 + 2  # not (retries + 1) x the deadline
    broken = [r for r in replies if "out for the rest of the stage" in r.error]
    assert len(broken) >= 33 - sent
    assert "failed its first 3 attempts" in broken[-1].error


def test_an_endless_stream_is_capped_from_max_new_tokens(hostile):
    """Without a deadline in reach, the cap on streamed chunks and bytes ends it."""
    backend = OpenAIBackend(_settings(hostile, stream=True, request_deadline_s=60.0,
                                      retries=0, max_new_tokens=16))
    reply, = _generate(backend, ["mode=endless"], budget_s=5.0)
    assert "without ending" in reply.error and "max_new_tokens=16" in reply.error
    backend = OpenAIBackend(_settings(hostile, request_deadline_s=60.0, retries=0,
                                      max_new_tokens=16))
    reply, = _generate(backend, ["mode=endless"], budget_s=5.0)
    assert "without ending" in reply.error and "bytes" in reply.error


def test_a_stream_left_open_after_its_finish_reason_is_a_reply(hostile):
    backend = OpenAIBackend(_settings(hostile, stream=True, request_deadline_s=5.0))
    reply, = _generate(backend, ["mode=open_after_finish"], budget_s=2.0)
    assert (reply.error, reply.text, reply.finish_reason) == (None, "Done it.", "stop")


MALFORMED = ["invalid_json", "html", "no_choices", "empty_choices", "broken_sse", "cut_stream",
             "bad_choice"]


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_replies_are_row_errors_with_the_servers_text(hostile, stream):
    backend = OpenAIBackend(_settings(hostile, stream=stream, retries=1))
    prompts = [f"mode={m}" for m in MALFORMED] + [f"mode=once-{m}" for m in MALFORMED]
    replies = _generate(backend, prompts, budget_s=5.0)
    errors = dict(zip(MALFORMED, (r.error for r in replies), strict=False))
    assert all(errors.values()), errors
    for mode, error in errors.items():
        assert "after 2 attempts" in error and len(error) < 1200, (mode, error)
        assert hostile.seen[f"mode={mode}"] == 2
    assert "502 Bad Gateway" in errors["html"]  # the server's own text, truncated
    assert "not an object" in errors["bad_choice"]
    if not stream:
        assert '"content": "cut' in errors["invalid_json"]
        assert "no choices" in errors["no_choices"] and "no choices" in errors["empty_choices"]
    else:
        assert "broken stream chunk" in errors["broken_sse"]
        assert "before [DONE]" in errors["cut_stream"]
    for reply in replies[len(MALFORMED):]:  # the same failure once: the retry answers
        assert not reply.error and reply.text.startswith("A fine answer"), reply


def test_a_model_listing_that_trickles_cannot_hang_the_start(hostile):
    from dflash_etl.models.devserver import DevServer

    hostile.models_mode = "slow_loris"
    with pytest.raises(StageError, match="cannot list the models"):  # one server: it names
        _within(4.0, lambda: OpenAIBackend(_settings(hostile, served_model=None)))  # the model
    with DevServer(None, instant=True, name="hostile") as good:  # a fleet: it starts out
        backend = _within(4.0, lambda: OpenAIBackend(_settings(
            hostile, endpoints=(hostile.url, good.url), served_model=None)))
        assert not backend.servers[0].healthy and backend.servers[1].healthy


def test_a_fleet_server_that_answers_garbage_is_taken_out(hostile):
    """In a fleet, a server whose replies are malformed after its retries is taken out and
    its requests go to the others: no row is lost to it."""
    from dflash_etl.models.devserver import DevServer

    with DevServer(None, instant=True, name="hostile") as good:
        backend = OpenAIBackend(_settings(hostile, endpoints=(hostile.url, good.url),
                                          retries=0, cooldown_s=30.0))
        replies = _generate(backend, [f"mode=html {k}" for k in range(12)], budget_s=5.0)
        assert not [r.error for r in replies if r.error]
        assert not backend.servers[0].healthy and "502 Bad Gateway" in backend.servers[0].problem
        assert backend.failovers >= 1 and good.requests == 12


# ---------------------------------------------------------------- the stage
N_OK = 40
HOSTILE_MODES = ["slow_loris", "endless", "invalid_json", "html", "no_choices",
                 "empty_choices", "broken_sse", "loop", "ngram", "once-html", "once-slow_loris",
                 "surrogate"]


@pytest.fixture()
def hostile_run(tmp_path) -> tuple[Path, Any]:
    rows = [{"id": f"ok{k}", "prompt": f"Question {k}: what is {k} times two?"}
            for k in range(N_OK)]
    rows += [{"id": m, "prompt": f"Please answer. mode={m}"} for m in HOSTILE_MODES]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "pipeline.toml").write_text(
        '[[sources]]\nname = "q"\npath = "rows.jsonl"\n\n'
        "[expectations]\nmax_quarantine_rate = 0.5\n")
    config = load_config(tmp_path / "pipeline.toml")
    run_dir = tmp_path / "run"
    ingest.run(config, run_dir, progress=False, workers=1)
    return run_dir, config


def _stage_kw(server: Hostile, **extra: Any) -> dict[str, Any]:
    """A stage run: deadlines short enough for a fast test, long enough that a loaded machine
    answers every well-behaved request in time."""
    return {"model": "hostile", "backend": "openai", "endpoint": server.url,
            "max_new_tokens": 32, "dummy_min_repeats": 99, "progress": False,
            **FAST, "timeout_s": 3.0, "request_deadline_s": 2.0, **extra}


@pytest.mark.parametrize("stream", [False, True])
def test_the_stage_finishes_and_accounts_for_every_row(hostile, hostile_run, stream):
    run_dir, config = hostile_run
    start = time.monotonic()
    doc = regenerate.run(config, run_dir, **_stage_kw(hostile, stream=stream))
    assert time.monotonic() - start < 30.0  # the slow ones end at their deadlines, in parallel
    total = doc["total"]
    n_in = N_OK + len(HOSTILE_MODES)
    assert total["rows_in"] == n_in == total["rows_out"] + total["rows_quarantined"] + sum(
        total["rows_filtered"].values())
    failed = {"slow_loris", "endless", "invalid_json", "html", "no_choices", "empty_choices",
              "broken_sse"}
    # a reply with a lone surrogate failed the whole stage (UnicodeEncodeError, "a bug"), and
    # every rerun replayed it from the cache: now it is one counted row
    assert total["quarantine_reasons"] == {"generation_failed": len(failed),
                                           "degenerate_repetition": 2,
                                           "invalid_unicode_reply": 1}
    assert total["rows_out"] == N_OK + 2  # the two that failed once were answered on retry
    frame = pl.read_parquet(run_dir / "regenerate" / "quarantine.parquet")
    reasons = dict(zip(frame["reason"], frame["message"], strict=True))
    assert "repeat" in reasons["degenerate_repetition"]
    by_reason = Counter(frame["reason"])
    assert by_reason["degenerate_repetition"] == 2
    report = (run_dir / "docs" / "index.html").read_text()
    pages = "".join(p.read_text() for p in (run_dir / "docs").rglob("*.html"))
    assert "regenerate" in report and "degenerate_repetition" in pages
    assert "3-character cycle" in pages and "linlinlin" in pages  # the example shows the loop


def test_a_rerun_retries_only_the_rows_that_failed(hostile, hostile_run):
    run_dir, config = hostile_run
    n_in = N_OK + len(HOSTILE_MODES)
    hostile.broken = True  # every request 503: the gate fails the stage
    with pytest.raises(StageError, match="generation_failed") as failed:
        regenerate.run(config, run_dir, **_stage_kw(hostile, retries=0))
    # the breaker's reason is in the stage's error, not only in the quarantine file
    assert "out for the rest of the stage" in str(failed.value)
    assert not (run_dir / ".regenerate.partial" / "generations.jsonl").read_text().strip()
    sent_broken = sum(hostile.seen.values())
    assert sent_broken < n_in  # a server answering nothing is out after a few (the breaker)
    # a once- mode misbehaves on its first request: those the broken run never sent fail now
    unsent_once = sum(1 for m in HOSTILE_MODES
                      if m.startswith("once-") and not hostile.seen[f"Please answer. mode={m}"])
    hostile.broken = False
    doc = regenerate.run(config, run_dir, **_stage_kw(hostile, retries=0))
    assert sum(hostile.seen.values()) - sent_broken == n_in  # every row sent again
    always = 7  # slow_loris endless invalid_json html no_choices empty_choices broken_sse
    failing = always + unsent_once
    assert doc["total"]["quarantine_reasons"] == {"generation_failed": failing,
                                                  "degenerate_repetition": 2,
                                                  "invalid_unicode_reply": 1}
    cached = (run_dir / "regenerate" / "generations.jsonl").read_text().splitlines()
    assert len(cached) == n_in - failing  # the successes only (a degenerate reply is one)

    # complete, with failed rows: a plain rerun retries them, and only them
    hostile.fixed = {"html"}
    before = sum(hostile.seen.values())
    doc = regenerate.run(config, run_dir, **_stage_kw(hostile, retries=0))
    assert not doc.get("skipped")
    assert sum(hostile.seen.values()) - before == failing
    assert doc["total"]["quarantine_reasons"]["generation_failed"] == always - 1
    assert doc["total"]["rows_out"] == N_OK + 3

    # --force regenerates every row
    before = sum(hostile.seen.values())
    regenerate.run(config, run_dir, force=True, **_stage_kw(hostile, retries=0))
    assert sum(hostile.seen.values()) - before == n_in

    # retry_failed = false: a complete stage is skipped, as before
    before = sum(hostile.seen.values())
    doc = regenerate.run(config, run_dir, **_stage_kw(hostile, retries=0, retry_failed=False))
    assert doc.get("skipped") and sum(hostile.seen.values()) == before
