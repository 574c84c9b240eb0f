"""A small OpenAI-compatible chat-completions server over a local transformers model.

For trying `regenerate --backend openai` without vLLM, and for that backend's tests and benchmark:

    python -m dflash_etl.models.devserver --model DIR [--port 8000]

It serves `GET /v1/models` and `POST /v1/chat/completions` (streaming on and off) through the
same `TransformersBackend` the regenerate stage uses, one generation at a time. `--instant` answers
every request with a fixed reply (tagged with a digest of the messages, so replies can be told
apart) without touching the model, to measure a client's own overhead. `--latency-ms N` makes each
request hold the server's one generation slot for N ms more (requests queue, as on the model
server): a stand-in for a real server's generation time, for fleet benchmarks. Failures can be
injected (`fail_next`, `delay_next`, `die_after`, `kill()`) to test retries, timeouts and
failover (on either route). `requests` counts the requests it received. Not for production
serving.

`--extract-hidden-states IDS --states-dir DIR` speaks vLLM's hidden-states protocol instead
(`StatesEngine`): what `extract --backend server` and speculators' data generation send; with
`--synthetic-states` it loads no model and answers at its config's width (`SyntheticStates`).

`--drafter DIR` serves the target with a DFlash drafter by speculative decoding (`SpecEngine`:
the eval simulator's decoding) and exports vLLM's spec-decode counters on /metrics under
vLLM's names: what `dflash-etl eval --server` reads. Every mode exports
`vllm:generation_tokens_total` there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

INSTANT_REPLY = "This is the development server's fixed reply."


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default 5 drops connections at concurrency 32 (1 s SYN retry)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that gave up (timed out) closes its end: not worth a traceback."""
        import sys

        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


@dataclass(frozen=True)
class ServedModel:
    """What the transformers backend reads of its settings (models/generation/settings.py),
    set per request from the request's own sampling parameters and template kwargs."""

    model: str
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    thinking: str = "keep"
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    device_map: str = "none"
    max_memory: str = ""


class DevServer:
    """The server, started in a background thread; `url` is its /v1 base."""

    def __init__(self, model: str | None, host: str = "127.0.0.1", port: int = 0,
                 instant: bool = False, latency_ms: float = 0.0, name: str | None = None,
                 extract_layers: list[int] | None = None, states_dir: str | None = None,
                 drafter: str | None = None, synthetic: bool = False) -> None:
        self.model_name = name or (Path(model).name if model else "instant")
        self.backend: Any = None
        self.states: StatesEngine | None = None
        self.spec: SpecEngine | None = None
        self.generated = 0  # completion tokens answered: vllm:generation_tokens
        if extract_layers is not None:  # vLLM's extract_hidden_states server, not chat
            engine = SyntheticStates if synthetic else StatesEngine
            self.states = engine(str(model), extract_layers, Path(states_dir or "."))
        elif drafter is not None:
            self.spec = SpecEngine(str(model), drafter)
        elif not instant:
            from dflash_etl.models.generation.local import TransformersBackend

            self.backend = TransformersBackend(ServedModel(model=str(model)))
        self.lock = threading.Lock()
        self.fail_next = 0  # answer this many coming requests with HTTP 500
        self.delay_next = 0  # delay this many coming requests by `delay_s`
        self.delay_s = 0.0
        self.latency_s = latency_ms / 1000  # per request, holding the one generation slot
        self.slot = threading.Lock()
        self.die_after: int | None = None  # kill() itself when more requests than this arrive
        self.dead = False
        self.stopping = threading.Event()  # ends injected delays
        self.requests = 0
        self.httpd = _QuietServer((host, port), _handler(self))
        self.url = f"http://{host}:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def start(self) -> DevServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():  # shutdown() waits for a serve_forever that must be running
            self.httpd.shutdown()
        self.httpd.server_close()

    def kill(self) -> None:
        """Die as a crashed server does: stop listening (new connections are refused) and drop
        every request in flight without an answer."""
        self.dead = True
        threading.Thread(target=self.stop, daemon=True).start()

    def __enter__(self) -> DevServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def admit(self) -> str:
        """Count a request (either route) and apply what is injected: "drop" when the server
        is dead (or dies of it: `die_after`) or stopped during a delay (`delay_next`, cut
        short by the stop), "fail" for an injected HTTP 500, "" to answer it."""
        with self.lock:
            self.requests += 1
            if self.die_after is not None and self.requests > self.die_after and not self.dead:
                self.kill()
            if self.dead:
                return "drop"
        if self.take("fail_next"):
            return "fail"
        if self.take("delay_next"):
            self.stopping.wait(self.delay_s)
        return "drop" if self.stopping.is_set() else ""

    def states_reply(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(HTTP status, answer) of a hidden-states request: one at a time."""
        with self.lock:
            if self.states is None or not isinstance(body.get("prompt"), list):
                return 400, {"error": {"message": "prompt: token ids expected"}}
            return 200, self.states.complete(body["prompt"])

    def metrics_page(self) -> bytes:
        """Prometheus text, vLLM's names: what a metrics scraper (and eval) reads."""
        with self.spec.lock if self.spec else contextlib.nullcontext():
            lines = ["# TYPE vllm:generation_tokens counter",
                     f'vllm:generation_tokens_total{{engine="0",model_name="{self.model_name}"}}'
                     f" {float(self.generated)}"]
            if self.spec is not None:
                lines += self.spec.metrics(self.model_name)
        return ("\n".join(lines) + "\n").encode()

    def take(self, name: str) -> bool:
        """Consume one injected failure or delay."""
        with self.lock:
            if getattr(self, name) > 0:
                setattr(self, name, getattr(self, name) - 1)
                return True
            return False

    def complete(self, body: dict[str, Any]) -> tuple[str, str, int]:
        """(text, finish_reason, completion tokens) for one chat-completions request."""
        if self.latency_s:
            with self.slot:
                time.sleep(self.latency_s)
        if self.spec is not None:
            return self.spec.complete(body)
        if self.backend is None:
            digest = hashlib.sha256(json.dumps(body.get("messages"), sort_keys=True)
                                    .encode()).hexdigest()[:8]
            text = f"{INSTANT_REPLY} [{digest}]"
            return text, "stop", len(text.split())
        kwargs = dict(body.get("chat_template_kwargs") or {})
        thinking = kwargs.pop("enable_thinking", None)
        with self.lock:
            self.backend.settings = dataclasses.replace(
                self.backend.settings, max_new_tokens=int(body.get("max_tokens") or 256),
                temperature=float(body.get("temperature") or 0.0),
                seed=int(body.get("seed") or 0), template_kwargs=kwargs,
                thinking="keep" if thinking is None else ("on" if thinking else "off"))
            reply = self.backend.generate([(body["messages"], body.get("tools"))])[0]
        if reply.error:
            raise ValueError(reply.error)
        return reply.text, reply.finish_reason, reply.new_tokens


class SpecEngine:
    """The target served with a DFlash drafter: each chat completion decoded by the eval
    simulator's speculative decoding (models/acceptance.py: greedy, or at the request's
    temperature and seed), its steps counted as vLLM counts them. A step's accepted tokens are
    what it added to the text less the bonus token, so the served tau (1 + accepted / drafts)
    equals the simulator's tokens per verify step on the same prompts: any difference on a
    real server is the deployment's."""

    def __init__(self, model: str, drafter_dir: str) -> None:
        from dflash_etl.models.acceptance import drafter_proposer, eos_token_ids
        from dflash_etl.models.drafter import DFlashDrafter
        from dflash_etl.models.target import Target, TargetSpec
        from dflash_etl.models.tokenizer import load_tokenizer

        drafter = DFlashDrafter.load(Path(drafter_dir))
        layers = ",".join(map(str, drafter.config.target_layer_ids))
        self.target = Target(TargetSpec(model=model, layers=layers))
        self.drafter = drafter.to(self.target.device).eval()
        self.tokenizer = load_tokenizer(model)
        self.eos = eos_token_ids(self.target.model)
        self.propose = drafter_proposer(self.target, self.drafter)
        self.spec_tokens = drafter.config.block_size - 1
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_position = [0] * self.spec_tokens
        self.lock = threading.Lock()  # one generation at a time; counters read between them

    def complete(self, body: dict[str, Any]) -> tuple[str, str, int]:
        with self.lock:
            return self._complete(body)

    def _complete(self, body: dict[str, Any]) -> tuple[str, str, int]:
        from dflash_etl.models.acceptance import speculative_decode
        from dflash_etl.templates.limits import RenderError
        from dflash_etl.templates.render import render

        try:
            text = render(self.tokenizer, body["messages"], chat_template=None,
                          add_generation_prompt=True,
                          kwargs=dict(body.get("chat_template_kwargs") or {}))
        except RenderError as exc:
            raise ValueError(f"the chat template refused the messages: {exc}") from exc
        import torch

        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        generator = torch.Generator(self.target.device).manual_seed(int(body.get("seed") or 0))
        decoded = speculative_decode(self.target, self.propose, ids,
                                     int(body.get("max_tokens") or 256), self.eos,
                                     temperature=float(body.get("temperature") or 0.0),
                                     generator=generator)
        for added, drafted in zip(decoded.accepted, decoded.drafted, strict=True):
            if drafted:  # a step without a draft is plain decoding, not counted by vLLM
                self.drafts += 1
                self.draft_tokens += drafted
                self.accepted += added - 1
                for k in range(added - 1):
                    self.per_position[k] += 1
        finish = "stop" if decoded.tokens and decoded.tokens[-1] in self.eos else "length"
        return (self.tokenizer.decode(decoded.tokens, skip_special_tokens=True), finish,
                len(decoded.tokens))

    def metrics(self, model: str) -> list[str]:
        labels = f'engine="0",model_name="{model}"'
        lines: list[str] = []
        for name, value in (("drafts", self.drafts), ("draft_tokens", self.draft_tokens),
                            ("accepted_tokens", self.accepted)):
            lines += [f"# TYPE vllm:spec_decode_num_{name} counter",
                      f"vllm:spec_decode_num_{name}_total{{{labels}}} {float(value)}"]
        lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{k}"}}'
                  f" {float(v)}" for k, v in enumerate(self.per_position)]
        return lines


class StatesEngine:
    """vLLM's `extract_hidden_states` method with ExampleHiddenStatesConnector, on a hooked
    transformers forward: /v1/completions of token ids writes <states_dir>/<request>.safetensors
    (`hidden_states` [seq, layers, hidden] at vLLM's layer ids, the embedding output being 0,
    and `token_ids`) and answers with its path in `kv_transfer_params.hidden_states_path`.
    `fault` makes the next replies wrong as servers have been: "zeros", "nan", "other" (the
    previous request's file), "short" (a layer missing), "scaled" (x1000), "integer" (cast)."""

    def __init__(self, model: str, layer_ids: list[int], states_dir: Path) -> None:
        from dflash_etl.models.target import Target, TargetSpec

        # vLLM's capture is every layer's own output (the last one's before the final norm):
        # `every_layer`'s, in vLLM's numbering; the chosen layers of `Target` play no part
        self.target = Target(TargetSpec(model=model, layers="0"))
        self._files(layer_ids, states_dir)

    def _files(self, layer_ids: list[int], states_dir: Path) -> None:
        self.layer_ids = list(layer_ids)
        self.dir = states_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.count = 0
        self.tag = uuid.uuid4().hex[:8]  # unique names: servers of a fleet share states_dir
        self.last_path: str | None = None
        self.fault = ""

    def complete(self, ids: list[int]) -> dict[str, Any]:
        import torch
        from safetensors.torch import save_file

        hidden = self.capture(ids)
        if self.fault == "zeros":
            hidden = torch.zeros_like(hidden)
        elif self.fault == "nan":
            hidden = hidden.clone()
            hidden[0, 0, 0] = float("nan")
        elif self.fault == "short":
            hidden = hidden[:, :-1].contiguous()
        elif self.fault == "scaled":
            hidden = hidden * 1000
        elif self.fault == "integer":
            hidden = hidden.round().to(torch.int32)
        self.count += 1
        path = str(self.dir / f"req-{self.tag}-{self.count}.safetensors")
        save_file({"hidden_states": hidden, "token_ids": torch.tensor(ids, dtype=torch.long)},
                  path)
        if self.fault == "other" and self.last_path is not None:
            path, self.last_path = self.last_path, path
        else:
            self.last_path = path
        return {"id": f"cmpl-{self.count}", "object": "text_completion",
                "choices": [{"index": 0, "text": "", "finish_reason": "length",
                             "prompt_token_ids": list(ids)}],
                "kv_transfer_params": {"hidden_states_path": path}}


    def capture(self, ids: list[int]) -> Any:
        """[seq, layers, hidden]: the states at the served layer ids."""
        return self.target.every_layer(ids)[:, self.layer_ids].contiguous()


class SyntheticStates(StatesEngine):
    """The hidden-states protocol with no model, at the width of `model`'s config.json (a
    directory holding the config alone is enough): each token's states are the row of a seeded
    pseudo-random table its token id picks, in the config's dtype, written as the connector
    writes them. For measuring the client and the disk path at a 27B target's width (5 layers x
    5120, bf16: ~51 KB a token) on a machine that cannot hold the target."""

    TABLE_ROWS = 1024  # distinct states per layer: token id modulo this

    def __init__(self, model: str, layer_ids: list[int], states_dir: Path) -> None:
        import torch

        config = json.loads((Path(model) / "config.json").read_text())
        text = config.get("text_config") or config
        layers, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
        if not layer_ids or max(layer_ids) > layers or min(layer_ids) < 0:
            raise ValueError(f"layer ids {layer_ids}: vLLM's ids of a {layers}-layer model run "
                             f"from 0 (the embedding output) to {layers}")
        dtype = getattr(torch, str(text.get("torch_dtype") or text.get("dtype")
                                   or config.get("torch_dtype") or "bfloat16"))
        generator = torch.Generator().manual_seed(0)
        self.table = torch.randn(self.TABLE_ROWS, len(layer_ids), hidden,
                                 generator=generator).to(dtype)
        self._files(layer_ids, states_dir)

    def capture(self, ids: list[int]) -> Any:
        import torch

        return self.table[torch.tensor(ids, dtype=torch.long) % self.TABLE_ROWS]


def _handler(server: DevServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        disable_nagle_algorithm = True  # small writes answered at once (no 40 ms ACK wait)
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _json(self, status: int, data: dict[str, Any]) -> None:
            self._send(status, json.dumps(data).encode(), "application/json")

        def _send(self, status: int, blob: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(blob)))
            self.end_headers()
            self.wfile.write(blob)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/metrics":
                self._send(200, server.metrics_page(), "text/plain; version=0.0.4")
            elif self.path.rstrip("/") == "/v1/models":
                self._json(200, {"object": "list", "data": [
                    {"id": server.model_name, "object": "model"}]})
            else:
                self._json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            route = self.path.rstrip("/")
            states = route == "/v1/completions" and server.states is not None
            if not states and route != "/v1/chat/completions":
                self._json(404, {"error": {"message": f"no route {self.path}"}})
                return
            verdict = server.admit()
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if verdict:  # dropped (dead, or stopped while delayed), or an injected failure
                if verdict == "fail":
                    self._json(500, {"error": {"message": "injected failure"}})
                self.close_connection = verdict == "drop"
                return
            if states:
                answer = server.states_reply(body)
                if server.dead:  # died while computing
                    self.close_connection = True
                    return
                self._json(*answer)
                return
            try:
                text, finish, tokens = server.complete(body)
            except (KeyError, ValueError) as exc:
                self._json(400, {"error": {"message": str(exc)}})
                return
            if server.dead:  # died while generating
                self.close_connection = True
                return
            with server.lock:
                server.generated += tokens
            if body.get("stream"):
                self._stream(text, finish)
                return
            self._json(200, {
                "id": f"dev-{server.requests}", "object": "chat.completion",
                "model": server.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": finish}],
                "usage": {"completion_tokens": tokens}})

        def _stream(self, text: str, finish: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            step = max(1, len(text) // 4)
            pieces = [text[k:k + step] for k in range(0, len(text), step)] or [""]
            for k, piece in enumerate(pieces):
                chunk = {"object": "chat.completion.chunk", "choices": [{
                    "index": 0, "delta": {"content": piece},
                    "finish_reason": finish if k == len(pieces) - 1 else None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local causal LM directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--instant", action="store_true", help="fixed replies, no model")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="each request holds the server's one generation slot this long")
    parser.add_argument("--name", help="the model name it lists (default: the model directory's "
                                       "name, or 'instant')")
    parser.add_argument("--extract-hidden-states", metavar="IDS", default=None,
                        help="serve vLLM's extract_hidden_states protocol instead of chat, "
                             "capturing these layer ids (vLLM's: embedding = 0), comma-separated")
    parser.add_argument("--drafter", default=None,
                        help="serve the target with this DFlash drafter (speculative decoding) "
                             "and export vLLM's spec-decode counters on /metrics")
    parser.add_argument("--states-dir", default="hidden_states",
                        help="with --extract-hidden-states: where the files go")
    parser.add_argument("--synthetic-states", action="store_true",
                        help="with --extract-hidden-states: no model; pseudo-random states "
                             "keyed by the token ids at --model's config width (its config.json "
                             "alone is enough), for measuring the client at a real width")
    args = parser.parse_args(argv)
    if not args.instant and not args.model:
        parser.error("--model DIR is required (or --instant)")
    layer_ids = ([int(x) for x in args.extract_hidden_states.split(",") if x.strip()]
                 if args.extract_hidden_states else None)
    server = DevServer(args.model, args.host, args.port, instant=args.instant,
                       latency_ms=args.latency_ms, name=args.name, extract_layers=layer_ids,
                       states_dir=args.states_dir, drafter=args.drafter,
                       synthetic=args.synthetic_states)
    print(f"serving {server.model_name} at {server.url}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.start().thread.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
