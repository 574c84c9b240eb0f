"""regenerate: the target model writes the assistant turns (on-policy data for the drafter).

`--mode missing` answers the conversations ingest flagged as needing a response (they end on a
user turn: never padded with dummy replies); `--mode all` rewrites every assistant turn in order,
each on the regenerated history before it. Replies are checked (empty, truncated, dummy-like,
reasoning leaking into content with thinking off) and counted like every stage's rows.

Each generation is cached under a content hash of (history, tools, sampling settings, model), in
the partial output directory: an interrupted run keeps what finished, a rerun generates only what
is missing, and the output order never depends on which request finished first.

Backends: `transformers` (a local model, batched generate with left padding), `openai` (any
OpenAI-compatible server, async with bounded concurrency, timeouts and retries) and `vllm`
(offline `LLM.generate`, from the optional extra `gpu`, imported only when chosen).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_etl.core import schema as S
from dflash_etl.core.accounting import Stats, stats_document
from dflash_etl.core.config import (
    TARGET_HINT,
    PipelineConfig,
    register_section,
    setting,
    stage_settings,
)
from dflash_etl.core.errors import StageError
from dflash_etl.core.progress import progress_bar
from dflash_etl.core.rundir import RunDir, sha256_file, write_text_atomic
from dflash_etl.core.stage import Stage, StageContext
from dflash_etl.models.identity import model_identity
from dflash_etl.models.loading import placement
from dflash_etl.stages.shell import run_stage
from dflash_etl.templates.render import RenderError

STAGE = "regenerate"
BACKENDS = ("transformers", "openai", "vllm")

# Reason codes
Q_EMPTY_RESPONSE = "empty_response"
Q_DUMMY_REPLY = "dummy_reply"
Q_REASONING_LEAK = "reasoning_in_content"
Q_GENERATION_FAILED = "generation_failed"  # the template refused, or the server failed
Q_DEGENERATE = "degenerate_repetition"  # a reply stuck in a loop (greedy decoding's failure)
F_TRUNCATED = "truncated_response"
F_TOOL_CALLS = "tool_call_turns"  # mode=all cannot re-run tools, so those rows keep nothing

# One row per generated assistant turn of the kept conversations (message index = turn).
GENERATED_TURNS = pa.schema([("id", pa.string()), ("turn", pa.int32()),
                             ("finish_reason", pa.string()), ("new_tokens", pa.int32()),
                             ("key", pa.string())])

# where and how the openai backend reaches its servers: not what it generates, so changing them
# (another fleet, more concurrency) keeps a run's fingerprint, and an interrupted run's cache
TRANSPORT_SETTINGS = ("endpoint", "endpoints", "concurrency", "timeout_s", "retries",
                      "cooldown_s", "request_deadline_s", "retry_failed",
                      "device_map", "max_memory")  # and where the transformers backend runs

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
THINK_RE = re.compile(r"^\s*<think>(.*?)</think>\s*", re.S)
DUMMY_MAX_CHARS = 40
NGRAM_N = 4  # word n-grams of the repetition check
NGRAM_MIN_WORDS = 40  # shorter replies are not judged by their n-grams
# the openai backend reads at most this much of one reply: a server that sends more is broken
REPLY_BYTES_PER_TOKEN = 256  # a JSON body: content and reasoning, escaped, with margin
STREAM_BYTES_PER_CHUNK = 2048  # an SSE chunk carries about one token, plus its JSON envelope
REPLY_BYTES_BASE = 65536
EXCERPT_CHARS = 300  # of a server's text in an error message


@dataclass(frozen=True)
class RegenerateSettings:
    """[regenerate] in pipeline.toml; CLI flags override it."""

    model: str = setting("", metavar="DIR",
                         help="the target model directory (offline; default: [target] model)")
    backend: str = setting("transformers", choices=BACKENDS, help="generation backend")
    mode: str = setting("missing", choices=("missing", "all"),
                        help="answer conversations that need a reply, or rewrite every turn")
    max_new_tokens: int = setting(256, min=1, help="per reply")
    temperature: float = setting(0.0, min=0, help="0 = greedy")
    seed: int = setting(0, min=0, help="sampling seed")
    batch_size: int = setting(8, min=1, help="prompts per generate call")
    thinking: str = setting("keep", choices=("on", "off", "keep"),
                            help="the template's enable_thinking (keep: as the template does)")
    keep_truncated: bool = setting(False, help="keep replies cut at --max-new-tokens "
                                               "(else they are filtered)")
    # thinking-on replies run long: most cut at max_new_tokens is a setting problem, not data
    max_truncated_share: float = setting(0.2, min=0, max=1,
                                         help="warn when more than this share of a thinking "
                                              "mode's replies stop at --max-new-tokens")
    # one short reply for this many different prompts is a dummy
    dummy_min_repeats: int = setting(3, min=2, why="a reply given once is not a dummy",
                                     help="a short reply given to this many different prompts "
                                          "is a dummy (quarantined)")
    # openai backend
    endpoint: str = setting("http://127.0.0.1:8000/v1", metavar="URL",
                            help="openai backend: the server's /v1 URL")
    # several servers of one model (empty: `endpoint` alone); requests go to the least loaded
    # healthy one, a failed server sits out `cooldown_s` and is probed before it comes back
    endpoints: tuple[str, ...] = setting((), metavar="URL,URL",
                                         help="openai backend: several servers of one model, "
                                              "comma-separated; each request goes to the least "
                                              "loaded healthy one (default: --endpoint)")
    served_model: str | None = setting(None, help="openai backend: model name (default: the "
                                                  "first the server lists)")
    concurrency: int = setting(8, min=1, help="openai backend: requests in flight per server")
    timeout_s: float = setting(120.0, above=0, help="openai backend: seconds each read (and "
                                                    "the connect) may wait")
    # bounds a trickling (slow-loris) or endless reply, which per-read timeouts never end
    request_deadline_s: float = setting(600.0, above=0,
                                        help="openai backend: seconds one attempt may take in "
                                             "all (connect, first byte and the whole reply); "
                                             "past it the attempt is cut and retried")
    # with exponential backoff
    retries: int = setting(3, min=0, help="openai backend: retries on timeouts, connection "
                                          "errors, 429, 5xx, replies past request_deadline_s "
                                          "or their size cap, and malformed replies")
    stream: bool = setting(False, help="openai backend: stream the responses")
    device_map: str = setting("none", choices=("none", "auto"),
                              help="transformers backend, 'auto': place the model's layers over "
                                   "the visible GPUs, then the CPU (accelerate)")
    max_memory: str = setting("", metavar="0=70GiB,1=70GiB,cpu=200GiB",
                              help="transformers backend with --device-map auto: the memory "
                                   "each device may hold (default: accelerate's estimate)")
    # several endpoints: a failed server's rest before its probe
    cooldown_s: float = setting(10.0, help="openai backend, several endpoints: how long a "
                                           "failed server sits out before its probe")
    retry_failed: bool = setting(True, help="openai backend: a rerun of a complete stage that "
                                            "has generation_failed rows retries them (the "
                                            "cached replies are reused); off: it is skipped")
    # degenerate repetition: a reply whose tail is one short cycle, or mostly repeated n-grams
    repeat_tail_chars: int = setting(100, min=0,
                                     help="a reply whose last this many characters repeat one "
                                          "cycle of at most --repeat-max-cycle characters is "
                                          "degenerate_repetition (0: off)")
    repeat_max_cycle: int = setting(16, min=1, help="the longest cycle the tail check looks for")
    ngram_repeat_max: float = setting(0.6, min=0, max=1,
                                      help=f"a reply of {NGRAM_MIN_WORDS}+ words whose "
                                           f"{NGRAM_N}-word sequences are repeats at more than "
                                           "this fraction is degenerate_repetition (1: off)")

    def __post_init__(self) -> None:
        endpoints = self.endpoints or ()
        if isinstance(endpoints, str):  # "URL,URL" (a TOML string, or the flag's text)
            endpoints = endpoints.split(",")
        object.__setattr__(self, "endpoints",
                           tuple(u.strip() for u in endpoints if u and u.strip()))

    @property
    def servers(self) -> tuple[str, ...]:
        """The openai backend's server URLs (/v1 bases, no trailing slash)."""
        return tuple(u.rstrip("/") for u in (self.endpoints or (self.endpoint,)))

    @classmethod
    def from_sources(cls, section: dict[str, Any], overrides: dict[str, Any],
                     base_dir: Path | None) -> RegenerateSettings:
        settings = stage_settings(cls, "regenerate", section, overrides, base_dir,
                                  ("model",), "model", "the target model", TARGET_HINT)
        if settings.backend not in BACKENDS:
            raise StageError(f"--backend {settings.backend!r} is not available in this version; "
                             f"available: {list(BACKENDS)}")
        if settings.mode not in ("missing", "all"):
            raise StageError(f"--mode {settings.mode!r}: use 'missing' or 'all'")
        if settings.dummy_min_repeats < 2:
            raise StageError("dummy_min_repeats must be >= 2: a reply given once is not a dummy")
        if settings.thinking not in ("on", "off", "keep"):
            raise StageError(f"--thinking {settings.thinking!r}: use on, off or keep")
        if settings.concurrency < 1:
            raise StageError("--concurrency must be >= 1 (requests in flight per server)")
        if not 0 < settings.cooldown_s <= 600:
            raise StageError("cooldown_s must be in (0, 600] seconds")
        twice = sorted({u for u in settings.servers if settings.servers.count(u) > 1})
        if twice:
            raise StageError(f"--endpoints lists {twice} more than once")
        if settings.backend == "transformers":
            placement(settings.device_map, settings.max_memory)  # fails before any work
        return settings


register_section("regenerate", RegenerateSettings)


@dataclass
class Reply:
    text: str
    finish_reason: str  # "stop" | "length" (or whatever the server said)
    new_tokens: int
    reasoning: str | None = None  # when the server returns it separately (reasoning parsers)
    error: str | None = None  # the request could not be rendered or served
    # the rendered generation prompt ended with an opening think tag (Qwen3.6 with thinking on:
    # `<think>\n`), so the text starts inside the reasoning; None: unknown (a server rendered it)
    think_open: bool | None = None


Request = tuple[list[dict[str, Any]], list[Any] | None]  # (messages, tools)


class Backend(Protocol):
    model_id: str

    def generate(self, requests: list[Request]) -> list[Reply]: ...


# ---------------------------------------------------------------- pure core
def split_reasoning(text: str, think_open: bool | None = None) -> tuple[str, str | None]:
    """(content, reasoning) of a reply's text. A leading <think>..</think> block is reasoning.
    When the generation prompt opened the block (`think_open`), the text up to the first
    </think> is reasoning (all of it when the block never closes: a reply cut short). When that
    is unknown (a server rendered the prompt), a </think> with no <think> before it can only
    close a block the prompt opened, and splits the same way."""
    close = text.find(THINK_CLOSE)
    opened = text.find(THINK_OPEN)
    if think_open and not text.lstrip().startswith(THINK_OPEN):
        if close < 0:
            return "", text.strip() or None
        return text[close + len(THINK_CLOSE):].strip(), text[:close].strip() or None
    if think_open is None and close >= 0 and not 0 <= opened < close:
        return text[close + len(THINK_CLOSE):].strip(), text[:close].strip() or None
    m = THINK_RE.match(text)
    if not m:
        return text.strip(), None
    return text[m.end():].strip(), m.group(1).strip() or None


def reply_parts(reply: Reply, thinking: str = "keep") -> tuple[str, str | None]:
    """(content, reasoning) of a reply; the server's separate reasoning wins where given (its
    text is then the content, perhaps after a leading think block). With thinking off no prompt
    opened a block: a stray </think> stays in the content, where check_reply finds the leak."""
    if reply.reasoning and reply.reasoning.strip():
        return split_reasoning(reply.text, False)[0], reply.reasoning.strip()
    return split_reasoning(reply.text, False if thinking == "off" else reply.think_open)


def repetition(text: str, settings: RegenerateSettings) -> str | None:
    """Why `text` is stuck in a loop, or None: its tail repeats one short cycle
    (`linlinlin`), or most of its word n-grams are repeats (a sentence said over and over)."""
    text = text.rstrip()
    size = settings.repeat_tail_chars
    if size and len(text) >= size:
        tail = text[-size:]
        for p in range(1, min(settings.repeat_max_cycle, size // 2) + 1):
            if tail[p:] == tail[:-p]:  # periodic with period p
                return (f"degenerate repetition: its last {size} characters repeat the "
                        f"{p}-character cycle {tail[-p:]!r}: ...{tail[-60:]!r}")
    words = text.split()
    if settings.ngram_repeat_max < 1 and len(words) >= NGRAM_MIN_WORDS:
        grams = Counter(tuple(words[k:k + NGRAM_N]) for k in range(len(words) - NGRAM_N + 1))
        total = sum(grams.values())
        repeated = 1 - len(grams) / total
        if repeated > settings.ngram_repeat_max:
            top = " ".join(grams.most_common(1)[0][0])
            return (f"degenerate repetition: {repeated:.0%} of its {total} {NGRAM_N}-word "
                    f"sequences are repeats (ngram_repeat_max={settings.ngram_repeat_max:g}); "
                    f"most common {top!r}: {text[:80]!r}...")
    return None


def check_reply(reply: Reply, settings: RegenerateSettings) -> tuple[str, str, str] | None:
    """(kind, code, message) when a reply must not be kept; kind is quarantine or filter. A loop
    is told before truncation: a looping reply usually runs to max_new_tokens, and the loop is
    the news."""
    if reply.error:
        return ("quarantine", Q_GENERATION_FAILED, reply.error)
    content, reasoning = reply_parts(reply, settings.thinking)
    for part in (content, reasoning or ""):
        if loop := repetition(part, settings):
            return ("quarantine", Q_DEGENERATE, loop)
    if reply.finish_reason == "length" and not settings.keep_truncated:
        return ("filter", F_TRUNCATED,
                f"stopped at max_new_tokens={settings.max_new_tokens} before the end of turn")
    if not content and not reasoning:
        return ("quarantine", Q_EMPTY_RESPONSE, "the model returned an empty reply")
    if not content and reply.think_open and not reply.reasoning and THINK_CLOSE not in reply.text:
        return ("quarantine", Q_EMPTY_RESPONSE, "the reply ended inside the think block the "
                "generation prompt opened: reasoning, no answer")
    if settings.thinking == "off" and ("<think>" in content or "</think>" in content):
        return ("quarantine", Q_REASONING_LEAK,
                "thinking is off but the reply contains think markup")
    return None


def dummy_replies(replies: dict[str, str], min_repeats: int) -> set[str]:
    """Keys whose reply is a short text the model gave to at least `min_repeats` different
    prompts ("OK.", "Sure!"): the signature of padded or collapsed data."""
    norm = {k: " ".join(v.split()).lower() for k, v in replies.items()}
    counts = Counter(v for v in norm.values() if len(v) <= DUMMY_MAX_CHARS)
    repeated = {v for v, n in counts.items() if n >= min_repeats}
    return {k for k, v in norm.items() if v in repeated}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Canonical messages as chat templates read them (tool-call arguments as objects)."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("reasoning"):
            msg["reasoning_content"] = m["reasoning"]
        if m.get("tool_calls"):
            msg["tool_calls"] = json.loads(m["tool_calls"])
        for key in ("tool_call_id", "name"):
            if m.get(key):
                msg[key] = m[key]
        out.append(msg)
    return out


def cache_key(messages: list[dict[str, Any]], tools: str | None, settings: RegenerateSettings,
              model_id: str) -> str:
    sampling = {k: getattr(settings, k) for k in ("max_new_tokens", "temperature", "seed",
                                                   "thinking")}
    blob = json.dumps([messages, tools, sampling, model_id], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


# ---------------------------------------------------------------- transformers backend
class _LocalTemplate:
    """Backends that render the chat template themselves (in the sandbox) and generate text."""

    settings: RegenerateSettings
    tokenizer: Any

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
        from dflash_etl.templates.render import render

        kwargs = {} if self.settings.thinking == "keep" else {
            "enable_thinking": self.settings.thinking == "on"}
        return render(self.tokenizer, messages, chat_template=None, tools=tools,
                      add_generation_prompt=True, kwargs=kwargs)

    def generate(self, requests: list[Request]) -> list[Reply]:
        """Render each request with the model's template and generate in one batch; a request
        the template refuses gets an error reply with the template's message."""
        prompts, where, replies = [], [], [Reply("", "", 0)] * len(requests)
        for k, (messages, tools) in enumerate(requests):
            try:
                prompts.append(self.render(messages, tools))
                where.append(k)
            except RenderError as exc:
                replies[k] = Reply("", "", 0, error=f"the chat template refused: {exc}")
        for k, prompt, reply in zip(where, prompts, self.generate_text(prompts) if prompts else [],
                                    strict=True):
            replies[k] = dataclasses.replace(reply, think_open=prompt.rstrip().endswith(
                THINK_OPEN))
        return replies

    def generate_text(self, prompts: list[str]) -> list[Reply]:
        raise NotImplementedError


class TransformersBackend(_LocalTemplate):
    """A local causal LM; batched generate with left padding, on GPU when there is one."""

    def __init__(self, settings: RegenerateSettings) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch

        from dflash_etl.models.loading import input_device, load_causal_lm, refuse_remote_code
        from dflash_etl.models.tokenizer import load_tokenizer

        self.settings = settings
        self.torch = torch
        self.tokenizer = load_tokenizer(settings.model)
        refuse_remote_code(settings.model)
        placed = placement(settings.device_map, settings.max_memory)
        try:
            self.model = load_causal_lm(settings.model, **placed)
        except Exception as exc:  # transformers raises many types for a bad directory
            raise StageError(f"cannot load a causal LM from {settings.model}: {exc}") from exc
        if placed:  # layers on several devices: ids go in where the embedding is
            self.device = input_device(self.model)
            self.model.eval()
        else:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
            self.model.to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        if not self.eos_ids:
            raise StageError(f"{settings.model}: neither the generation config nor the tokenizer "
                             "names an end-of-turn (eos) token, so no reply could ever finish")
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = min(self.eos_ids)
        self.model_id = model_identity(settings.model)

    def generate_text(self, prompts: list[str]) -> list[Reply]:
        torch = self.torch
        encoded = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        width = max(len(e) for e in encoded)
        ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, e in enumerate(encoded):  # left padding: every prompt ends at the same column
            ids[row, width - len(e):] = torch.tensor(e)
            mask[row, width - len(e):] = 1
        sample = self.settings.temperature > 0
        # seeded by the batch's own prompts: a resumed run samples what an uninterrupted one did
        digest = hashlib.sha256("\x00".join(prompts).encode()).digest()
        torch.manual_seed(self.settings.seed + int.from_bytes(digest[:6], "little"))
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                max_new_tokens=self.settings.max_new_tokens, do_sample=sample,
                temperature=self.settings.temperature if sample else None, top_p=None, top_k=None,
                pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids))
        replies = []
        for row in out[:, width:].tolist():
            end = next((k for k, t in enumerate(row) if t in self.eos_ids), None)
            new = row if end is None else row[:end]
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            replies.append(Reply(text, "length" if end is None else "stop", len(new)))
        return replies


# ---------------------------------------------------------------- vllm backend
class VLLMBackend(_LocalTemplate):
    """Offline vLLM (`LLM.generate`) from the optional extra `gpu`, imported only when chosen.
    Prompts are rendered here and passed as token ids, exactly as the transformers backend
    tokenizes them (vLLM would otherwise add the tokenizer's BOS to text prompts)."""

    def __init__(self, settings: RegenerateSettings) -> None:
        try:
            from vllm import LLM, SamplingParams
        except ImportError as exc:
            raise StageError("--backend vllm needs vLLM, which is not installed: pip install "
                             "'dflash-etl[gpu]' on a CUDA machine, or use --backend transformers "
                             "or --backend openai (e.g. against `vllm serve`)") from exc
        from dflash_etl.models.tokenizer import load_tokenizer

        self.settings = settings
        self.tokenizer = load_tokenizer(settings.model)
        from dflash_etl.models.loading import refuse_remote_code

        refuse_remote_code(settings.model)
        self.llm = LLM(model=settings.model, seed=settings.seed, trust_remote_code=False)
        self.params = SamplingParams(max_tokens=settings.max_new_tokens,
                                     temperature=settings.temperature, seed=settings.seed)
        self.model_id = model_identity(settings.model)
        self.batch_hint = max(settings.batch_size, 256)  # vLLM schedules a large batch itself

    def generate_text(self, prompts: list[str]) -> list[Reply]:
        inputs = [{"prompt_token_ids": self.tokenizer(p, add_special_tokens=False)["input_ids"]}
                  for p in prompts]
        outputs = self.llm.generate(inputs, self.params, use_tqdm=False)
        replies = []
        for out in outputs:
            choice = out.outputs[0]
            replies.append(Reply(choice.text, choice.finish_reason or "stop",
                                 len(choice.token_ids)))
        return replies


# ---------------------------------------------------------------- openai backend
class _Server:
    """One server of the openai backend's fleet, and what the dispatcher knows of it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.in_flight = 0
        self.served = 0  # replies it gave (of this backend's requests)
        self.healthy = True
        self.probing = False
        self.probes_failed = 0  # failed probes since it was taken out
        self.retry_at = 0.0  # time.monotonic() of its next probe, while it is out
        self.problem = ""  # why it was taken out
        self.probe_problem = ""  # why its last probe failed

    def why(self) -> str:
        return f"{self.url}: {self.problem}" + (
            f"; then {self.probe_problem}" if self.probe_problem else "")


class OpenAIBackend:
    """Any OpenAI-compatible chat-completions server (vLLM serve, SGLang), or several serving
    one model: the server applies the chat template. Async requests with bounded concurrency
    (per server), per-request timeouts and retries with exponential backoff; replies come back
    in request order whatever order, and whatever server, they finish on.

    With several servers each request goes to the healthy server with the fewest requests in
    flight (ties in turn). A server that fails a request (refused connection; reset, timeout,
    429 or 5xx after `retries`) is taken out and the request goes to another; an out server is
    probed (GET /models) after `cooldown_s` and comes back when it answers with the fleet's
    models. When no server is left a request waits at most one probe round for one to come
    back, then fails as a row (generation_failed): no wait is without a deadline. With one
    server, failures stay per request (retried, then the row fails), as they always were."""

    def __init__(self, settings: RegenerateSettings) -> None:
        import httpx

        self.settings = settings
        self.httpx = httpx
        self.servers = [_Server(url) for url in settings.servers]
        self.base = self.servers[0].url
        self.fleet = len(self.servers) > 1  # health tracking and failover
        self.probe_timeout_s = min(settings.timeout_s, 5.0)
        self.retried = 0
        self.failovers = 0  # requests moved to another server after theirs failed
        self._turn = 0  # round-robin position among equally loaded servers
        self.listed: list[str] = []
        name = settings.served_model
        if self.fleet:
            name = self._check_fleet(name)
        elif name is None:
            try:
                name = _list_models(httpx, self.base, settings.timeout_s,
                                    settings.request_deadline_s)[0]
            except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
                raise StageError(f"cannot list the models of {self.base}/models ({exc}): is the "
                                 "server running? Pass --served-model to skip the lookup") from exc
        self.served_model = name
        self.batch_hint = settings.concurrency * 4 * len(self.servers)  # requests per flush
        # the model's identity, never which or how many servers answer: the cache keys (and a
        # rerun's reuse of them) are the same with one server or a fleet
        files = sorted(p for p in Path(settings.model).iterdir() if p.is_file()) \
            if Path(settings.model).is_dir() else []
        identity = [name, *(sha256_file(p) for p in files if p.suffix in (".json", ".jinja"))]
        self.model_id = hashlib.sha256("\x00".join(identity).encode()).hexdigest()

    # ------------------------------------------------------------ the fleet's models
    def _models(self, url: str) -> list[str]:
        return _list_models(self.httpx, url, self.probe_timeout_s,
                            min(self.settings.request_deadline_s, self.probe_timeout_s + 1.0))

    def _check_fleet(self, name: str | None) -> str:
        """Every server that answers must list the same models; those that do not answer yet
        start out of the fleet (probed later). Returns the served model name."""
        listed: dict[str, list[str]] = {}
        for server in self.servers:
            try:
                listed[server.url] = self._models(server.url)
            except (self.httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
                self._take_out(server, f"did not list its models at the start: "
                                       f"{type(exc).__name__}: {exc}")
        if not listed:
            raise StageError("cannot list the models of any of --endpoints "
                             f"{[s.url for s in self.servers]}: "
                             + " | ".join(s.why() for s in self.servers))
        kinds = {tuple(sorted(ids)) for ids in listed.values()}
        if len(kinds) > 1:
            raise StageError("the --endpoints do not serve the same models: " + "; ".join(
                f"{url} lists {ids}" for url, ids in listed.items())
                + ". A fleet must serve one model (the replies would depend on the server)")
        self.listed = sorted(next(iter(kinds)))
        first = next(iter(listed.values()))
        if name is None:
            if not first:
                raise StageError(f"{next(iter(listed))}/models lists no model")
            return first[0]
        if name not in self.listed:
            raise StageError(f"--served-model {name!r} is not served by the --endpoints "
                             f"{list(listed)} (they list {self.listed})")
        return name

    # ------------------------------------------------------------ requests
    def payload(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.served_model, "messages": messages,
            "max_tokens": self.settings.max_new_tokens,
            "temperature": self.settings.temperature, "seed": self.settings.seed,
            "stream": self.settings.stream}
        if tools:
            body["tools"] = tools
        if self.settings.thinking != "keep":  # vLLM / SGLang pass these to the template
            body["chat_template_kwargs"] = {"enable_thinking": self.settings.thinking == "on"}
        return body

    def generate(self, requests: list[Request]) -> list[Reply]:
        import asyncio

        return asyncio.run(self._generate_all(requests))

    async def _generate_all(self, requests: list[Request]) -> list[Reply]:
        import asyncio

        changed = asyncio.Condition()  # in-flight counts and health: the dispatcher's state
        for server in self.servers:  # an interrupted batch may have left counts behind
            server.in_flight, server.probing = 0, False
        limits = self.httpx.Limits(max_connections=self.settings.concurrency * len(self.servers))
        async with self.httpx.AsyncClient(timeout=self.settings.timeout_s, limits=limits) as client:
            probes: set[asyncio.Task] = set()
            self._probe_due(client, changed, probes)  # before any request picks a server
            prober = asyncio.create_task(self._prober(client, changed, probes))
            # the fleet's slots: few requests wait on `changed` (only while servers are out)
            gate = asyncio.Semaphore(self.settings.concurrency * len(self.servers))

            async def one(request: Request) -> Reply:
                async with gate:
                    try:
                        return await self._dispatch(client, changed, self.payload(*request))
                    except Exception as exc:  # one request never takes its batch down
                        return Reply("", "", 0, error=f"the openai client failed on this "
                                     f"request: {type(exc).__name__}: {exc}")

            try:
                return list(await asyncio.gather(*(one(r) for r in requests)))
            finally:
                prober.cancel()
                for task in (prober, *probes):
                    task.cancel()
                await asyncio.gather(prober, *probes, return_exceptions=True)

    async def _dispatch(self, client: Any, changed: Any, body: dict[str, Any]) -> Reply:
        """One request: a server, then another while servers fail, until a reply or none is
        left."""
        tried: dict[int, str] = {}  # server -> how it failed this request
        while True:
            picked = await self._acquire(changed, tried)
            if picked is None:
                return Reply("", "", 0, error=self._no_server(tried))
            k, server = picked
            try:
                reply, problem = await self._request(client, server.url, body)
            finally:
                async with changed:
                    server.in_flight -= 1
                    changed.notify_all()
            if reply is not None:
                server.served += 1
                return reply
            if not self.fleet:
                return Reply("", "", 0, error=problem)
            tried[k] = problem
            async with changed:
                self._take_out(server, problem)
                changed.notify_all()
            self.failovers += 1

    def _no_server(self, tried: dict[int, str]) -> str:
        n = len(self.servers)
        if len(tried) == n:
            return f"failed on every one of the {n} --endpoints: " + " | ".join(tried.values())
        down = " | ".join(s.why() for k, s in enumerate(self.servers) if k not in tried)
        failed = "".join(f" | this request: {p}" for p in tried.values())
        return (f"no server of the {n} --endpoints is up (waited one probe round, cooldown_s="
                f"{self.settings.cooldown_s:g}): {down}{failed}")

    async def _acquire(self, changed: Any, tried: dict[int, str]) -> tuple[int, _Server] | None:
        """The least-loaded healthy server this request has not failed on (ties in turn), its
        in-flight count taken; None when there is none to wait for. Waits for a free slot (freed
        by requests that have their own timeouts) or, when every server is out, at most one probe
        round for one to come back."""
        import asyncio

        n, cap, deadline = len(self.servers), self.settings.concurrency, None
        async with changed:
            while True:
                left = [k for k in range(n) if k not in tried]
                if not left:
                    return None
                free = [k for k in left
                        if self.servers[k].healthy and self.servers[k].in_flight < cap]
                if free:
                    low = min(self.servers[k].in_flight for k in free)
                    k = min((k for k in free if self.servers[k].in_flight == low),
                            key=lambda k: (k - self._turn) % n)
                    self._turn = (k + 1) % n
                    self.servers[k].in_flight += 1
                    return k, self.servers[k]
                wait = 1.0  # re-checked at least this often
                if not any(self.servers[k].healthy for k in left):
                    # out servers worth waiting for: probed now, or not probed yet since they
                    # were taken out (a server whose probe failed is not waited for again)
                    coming = [k for k in left if self.servers[k].probing
                              or self.servers[k].probes_failed == 0]
                    if not coming:
                        return None
                    if deadline is None:
                        deadline = (time.monotonic() + self.settings.cooldown_s
                                    + self.probe_timeout_s + 1.0)
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        return None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), wait)

    def _take_out(self, server: _Server, problem: str) -> None:
        if server.healthy:
            server.healthy = False
            server.probes_failed = 0
            server.retry_at = time.monotonic() + self.settings.cooldown_s
            server.problem, server.probe_problem = problem, ""

    # ------------------------------------------------------------ probes
    def _probe_due(self, client: Any, changed: Any, probes: set[Any]) -> None:
        import asyncio

        now = time.monotonic()
        for server in self.servers:
            if not server.healthy and not server.probing and server.retry_at <= now:
                server.probing = True
                task = asyncio.create_task(self._probe(client, changed, server))
                probes.add(task)
                task.add_done_callback(probes.discard)

    async def _prober(self, client: Any, changed: Any, probes: set[Any]) -> None:
        import asyncio

        if not self.fleet:
            return
        while True:
            await asyncio.sleep(min(0.2, self.settings.cooldown_s / 2))
            self._probe_due(client, changed, probes)

    async def _probe(self, client: Any, changed: Any, server: _Server) -> None:
        """GET /models: the server comes back when it answers with the fleet's models."""
        import asyncio

        problem = ""
        try:
            async with asyncio.timeout(self.probe_timeout_s + 1.0):  # a trickle ends too
                response = await client.get(f"{server.url}/models",
                                            timeout=self.probe_timeout_s)
            response.raise_for_status()
            ids = sorted(m["id"] for m in response.json()["data"])
            if ids != self.listed:
                problem = f"now lists {ids}, not the fleet's {self.listed}"
        except (self.httpx.HTTPError, KeyError, TypeError, ValueError, TimeoutError) as exc:
            problem = f"probe failed: {type(exc).__name__}: {exc}"
        finally:
            server.probing = False  # also when cancelled: the next batch probes it again
        async with changed:
            if problem:
                server.probes_failed += 1
                server.retry_at = time.monotonic() + self.settings.cooldown_s
                server.probe_problem = problem
            else:
                server.healthy, server.probes_failed = True, 0
                server.problem = server.probe_problem = ""
            changed.notify_all()

    async def _request(self, client: Any, base: str,
                       body: dict[str, Any]) -> tuple[Reply | None, str]:
        """(reply, "") — a reply, or the request's own error (HTTP 4xx: no other server would
        take it) — or (None, problem) when the server failed it after its retries: timeouts,
        connection errors, 429 and 5xx, a reply past `request_deadline_s` or past the size
        derived from max_new_tokens, and malformed replies (not JSON, no choices, a broken
        stream). In a fleet a refused connection fails over at once: nothing listens there."""
        import asyncio

        url = f"{base}/chat/completions"
        deadline = self.settings.request_deadline_s
        problem = ""
        for attempt in range(self.settings.retries + 1):
            if attempt:
                self.retried += 1
                await asyncio.sleep(min(0.25 * 2 ** (attempt - 1), 8.0))
            try:
                async with asyncio.timeout(deadline):
                    return await self._attempt(client, url, body), ""
            except _Retry as exc:
                problem = str(exc)
            except TimeoutError:
                problem = (f"no complete reply within request_deadline_s={deadline:g} s "
                           "(connect, first byte and the whole reply)")
            except (self.httpx.TimeoutException, self.httpx.TransportError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
                if self.fleet and isinstance(exc, self.httpx.ConnectError):
                    return None, f"{url}: {problem}"
            except self.httpx.HTTPError as exc:  # decoding, protocol: the reply is unusable
                problem = f"{type(exc).__name__}: {exc}"
        return None, (f"{url} failed after {self.settings.retries + 1} attempts; "
                      f"last: {problem}")

    async def _attempt(self, client: Any, url: str, body: dict[str, Any]) -> Reply:
        """One request; raises _Retry for a failure worth retrying."""
        async with client.stream("POST", url, json=body) as response:
            status = response.status_code
            if status == 200 and body["stream"]:
                return await self._streamed(response)
            text = (await _read_capped(response, self._byte_cap(False), self.settings)
                    ).decode("utf-8", "replace")
        if status == 429 or status >= 500:
            raise _Retry(f"HTTP {status}: {_excerpt(text)}")
        if status >= 400:  # the request itself is wrong: no retry
            return Reply("", "", 0, error=f"{url} refused the request: HTTP {status}: "
                         f"{_excerpt(text, 500)}")
        if status != 200:
            raise _Retry(f"HTTP {status} is not a reply: {_excerpt(text)}")
        return _reply_from_completion(text)

    def _byte_cap(self, stream: bool) -> int:
        per = STREAM_BYTES_PER_CHUNK if stream else REPLY_BYTES_PER_TOKEN
        return REPLY_BYTES_BASE + per * self._chunk_cap()

    def _chunk_cap(self) -> int:
        return 2 * self.settings.max_new_tokens + 16

    async def _streamed(self, response: Any) -> Reply:
        """An SSE stream read to its [DONE] (or finish_reason), within caps on its chunks and
        bytes; anything else (a chunk that is not JSON, an error event, a stream that stops
        early or never) raises _Retry with what the server sent."""
        content, reasoning, finish, chunks, done = [], [], "", 0, False
        other: list[str] = []  # lines that are not events (an HTML page), for the message
        cap, chunk_cap, size, buffer = self._byte_cap(True), self._chunk_cap(), 0, b""
        async for piece in response.aiter_bytes():
            size += len(piece)
            if size > cap:
                raise _Retry(f"the stream passed {cap} bytes without ending (the cap from "
                             f"max_new_tokens={self.settings.max_new_tokens}, with margin)")
            *lines, buffer = (buffer + piece).split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    if line and sum(map(len, other)) < EXCERPT_CHARS:
                        other.append(line)
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                choice = _stream_choice(data)
                if choice is None:  # a chunk without choices (usage): nothing to add
                    continue
                delta = choice.get("delta") or {}
                if not isinstance(delta, dict):
                    raise _Retry(f"a broken stream chunk (delta is not an object): "
                                 f"{_excerpt(data)}")
                content.append(_text(delta.get("content"), data))
                reasoning.append(_text(delta.get("reasoning_content")
                                       or delta.get("reasoning"), data))
                finish = _text(choice.get("finish_reason"), data) or finish
                chunks += 1
                if finish:  # choice 0's last chunk: what may follow (usage, [DONE]) adds nothing
                    done = True
                    break
                if chunks > chunk_cap:
                    raise _Retry(f"the stream passed {chunk_cap} chunks without ending (the cap "
                                 f"from max_new_tokens={self.settings.max_new_tokens}, with "
                                 "margin)")
            if done:
                break
        if not done:
            sent = " ".join([*other, buffer.decode("utf-8", "replace")]).strip()
            raise _Retry("the stream ended before [DONE] or a finish_reason after "
                         f"{chunks} chunks" + (f"; the server sent: {_excerpt(sent)}"
                                              if sent else ""))
        return Reply("".join(content), finish or "stop", chunks, "".join(reasoning) or None)


def _list_models(httpx: Any, url: str, timeout: float, deadline: float) -> list[str]:
    """The model ids `url`/models lists, within `deadline` s in all (a server that trickles its
    answer cannot hang the start); raises httpx's errors, KeyError, TypeError, ValueError."""
    import asyncio

    async def get() -> Any:
        async with asyncio.timeout(deadline), httpx.AsyncClient(timeout=timeout) as client:
            return await client.get(f"{url}/models")

    try:
        response = asyncio.run(get())
    except TimeoutError:
        raise httpx.TimeoutException(f"no complete answer within {deadline:g} s") from None
    response.raise_for_status()
    return [m["id"] for m in response.json()["data"]]


class _Retry(Exception):
    """A reply that failed in a way worth retrying (the message says how)."""


async def _read_capped(response: Any, cap: int, settings: RegenerateSettings) -> bytes:
    """A response body, or _Retry when it runs past `cap` bytes (an endless body)."""
    parts, size = [], 0
    async for piece in response.aiter_bytes():
        size += len(piece)
        if size > cap:
            raise _Retry(f"the reply passed {cap} bytes without ending (the cap from "
                         f"max_new_tokens={settings.max_new_tokens}, with margin)")
        parts.append(piece)
    return b"".join(parts)


def _excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """A server's text for a message: whitespace collapsed, cut at `limit`."""
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[:limit] + f"... ({len(text)} chars)")


def _text(value: Any, data: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _Retry(f"a malformed reply (text that is not a string): {_excerpt(data)}")
    return value


def _stream_choice(data: str) -> dict[str, Any] | None:
    """The first choice of one SSE chunk; None for a chunk without choices (a usage chunk)."""
    try:
        chunk = json.loads(data)
    except ValueError:
        raise _Retry(f"a broken stream chunk (not JSON): {_excerpt(data)}") from None
    if not isinstance(chunk, dict):
        raise _Retry(f"a broken stream chunk (not an object): {_excerpt(data)}")
    if "error" in chunk:
        raise _Retry(f"the server reported an error mid-stream: {_excerpt(data)}")
    choices = chunk.get("choices")
    if not choices:
        return None
    if not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise _Retry(f"a broken stream chunk (choices): {_excerpt(data)}")
    return choices[0]


def _reply_from_completion(text: str) -> Reply:
    """A chat-completion body; anything malformed raises _Retry with the body's excerpt."""
    try:
        data = json.loads(text)
    except ValueError:
        raise _Retry(f"a malformed reply (HTTP 200, not JSON): {_excerpt(text)}") from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices:
        raise _Retry(f"a malformed reply (HTTP 200, no choices): {_excerpt(text)}")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or not isinstance(message, dict | None):
        raise _Retry(f"a malformed reply (HTTP 200, choices[0].message): {_excerpt(text)}")
    message = message or {}
    usage = data.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return Reply(_text(message.get("content"), text), _text(choice.get("finish_reason"), text)
                 or "stop", tokens if isinstance(tokens, int) else 0,
                 _text(message.get("reasoning_content") or message.get("reasoning"), text)
                 or None)


# ---------------------------------------------------------------- shell
def _input_files(run: RunDir) -> list[Path]:
    directory = run.stage_dir("ingest") / "conversations"
    files = sorted(directory.glob("*.parquet"))
    if not files:
        raise StageError(f"no conversations in {directory}: run `dflash-etl ingest` for this run "
                         "first (regenerate reads the ingest stage's output)")
    return files


def _targets(conv: dict[str, Any], mode: str) -> list[int]:
    """Message positions to (re)generate: each assistant turn (mode all) plus the missing reply."""
    positions = [k for k, m in enumerate(conv["messages"]) if m["role"] == "assistant"] \
        if mode == "all" else []
    if conv.get("needs_response"):
        positions.append(len(conv["messages"]))
    return positions


class _Cache:
    """Finished generations, appended as JSON lines and flushed per batch. A failed one (the
    template refused, the servers failed) is kept for this run only: a rerun tries it again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        if not path.exists():
            return
        text = path.read_bytes()
        whole = text[:text.rfind(b"\n") + 1]  # a line cut by a kill has no newline yet
        good = []
        lines = whole.split(b"\n")[:-1]
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:  # garbled (or not UTF-8): generated again
                continue
            if isinstance(entry, dict) and "key" in entry:
                self.entries[entry["key"]] = entry
                good.append(line.decode("utf-8") + "\n")
        if len(whole) != len(text) or len(good) != len(lines):
            # without the cut or garbled lines: appending after a cut line would glue the next
            # entry to it (lost on the next read), and the published cache would keep the bytes
            write_text_atomic(path, "".join(good))

    def add(self, entries: list[dict[str, Any]]) -> None:
        with self.path.open("a", encoding="utf-8") as fh:
            for entry in entries:
                if not entry.get("error"):
                    fh.write(json.dumps(entry) + "\n")
                self.entries[entry["key"]] = entry
            fh.flush()
            os.fsync(fh.fileno())


def _generate_round(pending: list[tuple[str, list[dict[str, Any]], Any]], backend: Backend,
                    cache: _Cache, settings: RegenerateSettings, bar: Any) -> None:
    """Generate every (key, messages, tools) not in the cache, in batches; a key pending twice
    (two conversations with the same history so far) is generated once, so the cache holds one
    line per key however the run was interrupted and resumed."""
    todo: dict[str, tuple[str, list[dict[str, Any]], Any]] = {}
    for p in pending:
        if p[0] not in cache.entries:
            todo.setdefault(p[0], p)  # the first of each key, in pending order
    bar.advance(len(pending) - len(todo))
    size = getattr(backend, "batch_hint", settings.batch_size)
    work = list(todo.values())
    for start in range(0, len(work), size):
        batch = work[start:start + size]
        replies = backend.generate([(messages, tools) for _, messages, tools in batch])
        cache.add([{"key": key, **asdict(reply)}
                   for (key, _, _), reply in zip(batch, replies, strict=True)])
        bar.advance(len(batch))


def thinking_mode(reply: Reply, thinking: str) -> str:
    """on | off: whether the reply was written with thinking on (the setting, or with `keep`
    what the prompt or the reply shows: a think block opened by the prompt, a leading
    `<think>`, reasoning returned apart)."""
    if thinking in ("on", "off"):
        return thinking
    started = reply.think_open or reply.reasoning or reply.text.lstrip().startswith(THINK_OPEN)
    return "on" if started else "off"


def _reply_counts() -> dict[str, Any]:
    """Per source: replies generated (kept or not), those dropped with their conversation by
    reason, and per thinking mode the replies and those cut at max_new_tokens."""
    return {"generated_turns": 0, "generated_replies": 0, "dropped_replies": Counter(),
            "replies_by_mode": Counter(), "truncated_by_mode": Counter()}


def truncation(total: dict[str, Any], max_share: float) -> tuple[dict[str, Any], list[str]]:
    """Per thinking mode the share of replies cut at max_new_tokens (finish_reason "length"),
    and a warning for each mode above `max_share`: most thinking-on replies cut short is
    silently lost (or, kept, truncated) data."""
    shares, warnings = {}, []
    for mode, n in sorted(total.get("replies_by_mode", {}).items()):
        cut = total.get("truncated_by_mode", {}).get(mode, 0)
        shares[mode] = {"replies": n, "truncated": cut, "share": round(cut / n, 4) if n else 0.0}
        if n and cut / n > max_share:
            warnings.append(
                f"{cut} of {n} replies with thinking {mode} ({100 * cut / n:.0f}%) stopped at "
                f"max_new_tokens before their end of turn (over max_truncated_share="
                f"{max_share:g}): raise --max-new-tokens"
                + (" (reasoning needs thousands of tokens)" if mode == "on" else ""))
    return shares, warnings


def regenerate_conversations(conversations: list[dict[str, Any]], backend: Backend,
                             cache: _Cache, settings: RegenerateSettings, bar: Any):
    """Conversations -> (kept, quarantine rows, per-source stats, finish reasons, generated
    turns). Round r generates the r-th target of every conversation on its history so far."""
    state = []
    for conv in conversations:
        tools = json.loads(conv["tools"]) if conv.get("tools") else None
        has_calls = settings.mode == "all" and any(
            m["role"] == "assistant" and m.get("tool_calls") for m in conv["messages"])
        state.append({"conv": conv, "tools": tools, "targets": _targets(conv, settings.mode),
                      "messages": list(conv["messages"]), "done": 0, "failure": None,
                      "skip": F_TOOL_CALLS if has_calls else None})
    while True:
        pending, slots = [], []
        for s in state:
            if s["skip"] or s["failure"] or s["done"] >= len(s["targets"]):
                continue
            pos = s["targets"][s["done"]]
            history = template_messages(s["messages"][:pos])
            key = cache_key(history, s["conv"].get("tools"), settings, backend.model_id)
            pending.append((key, history, s["tools"]))
            slots.append((s, pos, key))
        if not pending:
            break
        _generate_round(pending, backend, cache, settings, bar)
        for s, pos, key in slots:
            entry = cache.entries[key]
            reply = Reply(**{k: v for k, v in entry.items() if k != "key"})
            if not reply.error:  # a reply the target wrote, whatever becomes of it below
                s.setdefault("replies", []).append((thinking_mode(reply, settings.thinking),
                                                    reply.finish_reason))
            bad = check_reply(reply, settings)
            if bad:
                s["failure"] = bad
                continue
            content, reasoning = reply_parts(reply, settings.thinking)
            message = {"role": "assistant", "content": content, "reasoning": reasoning,
                       "tool_calls": None, "tool_call_id": None, "name": None}
            s["messages"] = [*s["messages"][:pos], message, *s["messages"][pos + 1:]]
            s.setdefault("finish", []).append(reply.finish_reason)
            s.setdefault("turns", []).append({"turn": pos, "finish_reason": reply.finish_reason,
                                              "new_tokens": reply.new_tokens, "key": key})
            s["last_reply"] = content
            s["done"] += 1
    answered = {s["conv"]["id"]: s["last_reply"] for s in state
                if s["targets"] and not s["failure"] and not s["skip"]}
    dummies = dummy_replies(answered, settings.dummy_min_repeats)
    kept, quarantine, per_source, turns = [], [], {}, []
    finish: Counter[str] = Counter()
    for s in state:
        conv = s["conv"]
        stats = per_source.setdefault(conv["source"], Stats(extra=_reply_counts()))
        stats.rows_in += 1
        replies = s.get("replies", [])
        stats.extra["generated_replies"] += len(replies)
        for mode, reason in replies:
            stats.extra["replies_by_mode"][mode] += 1
            if reason == "length":
                stats.extra["truncated_by_mode"][mode] += 1
        failure = s["failure"]
        if conv["id"] in dummies:
            failure = ("quarantine", Q_DUMMY_REPLY,
                       f"reply {answered[conv['id']]!r} was given to at least "
                       f"{settings.dummy_min_repeats} different prompts")
        if s["skip"]:
            stats.filter(s["skip"])
            continue
        if failure:
            kind, code, message = failure
            if replies:  # every reply of the conversation goes with it
                stats.extra["dropped_replies"][code] += len(replies)
            if kind == "filter":
                stats.filter(code)
            else:
                stats.quarantine(code)
                quarantine.append({"source": conv["source"], "file": conv.get("file"),
                                   "line": conv.get("line"), "reason": code,
                                   "message": f"conversation {conv['id']}: {message}",
                                   "raw": None, "raw_bytes": None})
            continue
        stats.rows_out += 1
        stats.extra["generated_turns"] += s["done"]
        finish.update(s.get("finish", []))
        turns.extend({"id": conv["id"], **t} for t in s.get("turns", []))
        kept.append({**conv, "messages": s["messages"],
                     "needs_response": False if s["targets"] else conv.get("needs_response")})
    return kept, quarantine, per_source, finish, turns


class RegenerateStage(Stage):
    """Conversations -> the same conversations with the target's replies."""

    name = STAGE

    def __init__(self, generator: Backend | None = None) -> None:
        self.generator = generator

    def prepare(self, ctx: StageContext) -> dict[str, Any]:
        settings: RegenerateSettings = ctx.settings
        files = _input_files(ctx.run)
        backend = self.generator or {"openai": OpenAIBackend, "vllm": VLLMBackend}.get(
            settings.backend, TransformersBackend)(settings)
        ctx.state.update(files=files, backend=backend)
        return {"settings": {k: v for k, v in asdict(settings).items()
                             if k not in TRANSPORT_SETTINGS},
                "model": backend.model_id,
                "inputs": [sha256_file(f) for f in files]}

    def redo_complete(self, ctx: StageContext, done: dict[str, Any]) -> str | None:
        """A complete stage with rows the servers failed runs again (retry_failed): the replies
        it cached are reused, so only the failed rows are requested."""
        settings: RegenerateSettings = ctx.settings
        failed = done["total"].get("quarantine_reasons", {}).get(Q_GENERATION_FAILED, 0)
        if not (settings.retry_failed and settings.backend == "openai" and failed):
            return None
        ctx.state["reuse"] = ctx.run.stage_dir(STAGE) / "generations.jsonl"
        return (f"{failed} rows failed to generate last time: retrying them (the cached "
                "replies are reused; retry_failed = false skips a complete stage)")

    def begin(self, ctx: StageContext) -> None:
        cache, reuse = ctx.partial / "generations.jsonl", ctx.state.get("reuse")
        if reuse and reuse.exists() and not cache.exists():
            shutil.copyfile(reuse, cache)
        ingest_fingerprint = ctx.run.manifest().get("stages", {}).get("ingest", {}).get(
            "fingerprint")
        ctx.run.update_stage(STAGE, settings=asdict(ctx.settings),
                             input_fingerprint=ingest_fingerprint)

    def execute(self, ctx: StageContext) -> dict[str, Any]:
        settings: RegenerateSettings = ctx.settings
        partial = ctx.partial
        cache = _Cache(partial / "generations.jsonl")
        conversations = pl.read_parquet(ctx.state["files"]).to_dicts()
        total = sum(len(_targets(c, settings.mode)) for c in conversations)
        with progress_bar("regenerate", total=total, enabled=ctx.progress) as bar:
            kept, quarantine, per_source, finish, turns = regenerate_conversations(
                conversations, ctx.state["backend"], cache, settings, bar)
        doc = stats_document(per_source, STAGE)
        doc["total"]["finish_reasons"] = dict(finish)
        doc["total"]["truncation"], warnings = truncation(doc["total"],
                                                          settings.max_truncated_share)
        doc["warnings"] = warnings
        for warning in warnings:
            print(f"regenerate: WARNING: {warning}", file=sys.stderr, flush=True)
        # what tokenize's on-policy check compares its rendering with
        doc["generation"] = {
            "backend": settings.backend, "thinking": settings.thinking,
            "temperature": settings.temperature, "max_new_tokens": settings.max_new_tokens,
            "mode": settings.mode,
            # the server's name for it (openai), and the weights' identity: never a path, so
            # two runs of the same inputs in other directories write the same stats
            "served_model": getattr(ctx.state["backend"], "served_model", None),
            "model_identity": getattr(ctx.state["backend"], "model_id", None)}
        out = partial / "conversations"
        out.mkdir(exist_ok=True)
        pq.write_table(pa.Table.from_pylist(kept, schema=S.CONVERSATIONS),
                       out / "part-00000.parquet", row_group_size=S.ROW_GROUP_ROWS)
        pq.write_table(pa.Table.from_pylist(turns, schema=GENERATED_TURNS),
                       partial / "generated_turns.parquet")
        pq.write_table(pa.Table.from_pylist(quarantine, schema=S.QUARANTINE),
                       partial / "quarantine.parquet")
        if not kept:
            reasons = Counter(doc["total"]["quarantine_reasons"]) + Counter(
                doc["total"]["rows_filtered"])
            raise StageError(
                f"regenerate kept no conversations of {doc['total']['rows_in']}; most common "
                f"reasons: {dict(reasons.most_common(4))}. 'truncated_response': raise "
                "--max-new-tokens or pass --keep-truncated; 'dummy_reply': the model gives one "
                f"short reply to everything (check {settings.model}). See "
                f"{partial / 'quarantine.parquet'}.")
        needed = {c["id"] for c in conversations if c.get("needs_response")}
        unanswered = [c["id"] for c in kept
                      if c["id"] in needed and c["messages"][-1]["role"] != "assistant"]
        if unanswered:  # an invariant of the code above, checked on the data it wrote
            raise StageError(f"{len(unanswered)} conversations still end without a reply, "
                             f"e.g. {unanswered[:3]}")
        return doc


def run(config: PipelineConfig | None, run_dir: str | Path, force: bool = False,
        progress: bool | None = None, generator: Backend | None = None,
        **overrides: Any) -> dict[str, Any]:
    """Regenerate into `run_dir/regenerate`; returns the stats document. Skips when complete.
    `generator` replaces the backend the settings name (an instance, e.g. shared between runs)."""
    return run_stage(RegenerateStage(generator), config, run_dir, force=force,
                     progress=progress, **overrides)


def main(argv: list[str] | None = None) -> int:
    from dflash_etl.cli.stage import stage_main

    return stage_main("regenerate", argv)


if __name__ == "__main__":
    raise SystemExit(main())
