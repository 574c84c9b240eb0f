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

import shutil
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_etl.core import schema as S
from dflash_etl.core.accounting import stats_document
from dflash_etl.core.errors import StageError
from dflash_etl.core.outputs import ConversationsOutput, Output
from dflash_etl.core.progress import progress_bar, progress_record
from dflash_etl.core.rundir import StageRecord, sha256_file
from dflash_etl.core.settings import (
    check_fleet,
    endpoint_list,
    fingerprinted,
    fleet_servers,
    fleet_setting,
    setting,
)
from dflash_etl.core.stage import Stage, StageContext, counts_line, state_word
from dflash_etl.models.generation.conversations import (
    ReplyCache,
    regenerate_conversations,
    target_positions,
    think_cut_warning,
    truncation,
)
from dflash_etl.models.generation.fleet import OpenAIBackend
from dflash_etl.models.generation.local import TransformersBackend, VLLMBackend
from dflash_etl.models.generation.replies import (
    F_TRUNCATED,
    NGRAM_MIN_WORDS,
    NGRAM_N,
    Q_DUMMY_REPLY,
    Q_EMPTY_RESPONSE,
    Q_GENERATION_FAILED,
    Q_INSIDE_THINK,
    Backend,
)
from dflash_etl.models.loading import placement

STAGE = "regenerate"
BACKENDS = ("transformers", "openai", "vllm")
OPENAI = ("backend", ("openai",))  # the settings of the openai backend alone

# One row per generated assistant turn of the kept conversations (message index = turn).
GENERATED_TURNS = pa.schema([("id", pa.string()), ("turn", pa.int32()),
                             ("finish_reason", pa.string()), ("new_tokens", pa.int32()),
                             ("key", pa.string())])

# what to do about a reason, said only for the reasons that occurred
REASON_HINTS = {
    F_TRUNCATED: "raise --max-new-tokens or pass --keep-truncated",
    Q_INSIDE_THINK: "raise --max-new-tokens or pass --thinking off",
    Q_DUMMY_REPLY: "the model gives one short reply to everything (check {model})",
    Q_EMPTY_RESPONSE: "the model returned empty replies (check {model} and its chat template)",
    Q_GENERATION_FAILED: "the template or the server failed: the quarantine rows say how",
}


@dataclass(frozen=True)
class RegenerateSettings:
    """[regenerate] in pipeline.toml; CLI flags override it."""

    # its identity is fingerprinted, not its path (a moved run is not redone)
    model: str = setting("", metavar="DIR", required="the target model", target=True,
                         path=True, fingerprint=False,
                         help="the target model directory (offline; default: [target] model)")
    backend: str = setting("transformers", choices=BACKENDS, help="generation backend")
    mode: str = setting("missing", choices=("missing", "all"),
                        help="answer conversations that need a reply, or rewrite every turn")
    max_new_tokens: int = setting(256, min=1, help="per reply")
    temperature: float = setting(0.0, min=0, help="0 = greedy")
    seed: int = setting(0, min=0, help="sampling seed")
    batch_size: int = setting(8, min=1, applies=("backend", ("transformers", "vllm")),
                              help="prompts per generate call")
    thinking: str = setting("keep", choices=("on", "off", "keep"),
                            help="the template's enable_thinking (keep: as the template does)")
    template_kwargs: dict[str, Any] = setting(  # noqa: RUF009 (setting() returns a field)
        default_factory=dict, flags=("--template-kwarg",), metavar="KEY=JSON", inherit="tokenize",
        help="variables every render of the target's template gets (the local backends render "
             "with them, the openai backend sends them as chat_template_kwargs); default: "
             "[tokenize] template_kwargs, so replies follow the prompt the rows are rendered "
             "with. An enable_thinking here is --thinking")
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
    endpoint: str = setting("http://127.0.0.1:8000/v1", metavar="URL", fingerprint=False,
                            applies=OPENAI,
                            help="openai backend: the server's /v1 URL")
    # several servers of one model (empty: `endpoint` alone); requests go to the least loaded
    # healthy one, a failed server sits out `cooldown_s` and is probed before it comes back;
    # these limits are the fleet client's, declared once (core/settings.py FLEET_SETTINGS)
    endpoints: tuple[str, ...] = fleet_setting("endpoints", "openai backend", applies=OPENAI)
    served_model: str | None = fleet_setting("served_model", "openai backend", applies=OPENAI)
    concurrency: int = fleet_setting("concurrency", "openai backend", applies=OPENAI)
    timeout_s: float = fleet_setting("timeout_s", "openai backend", applies=OPENAI)
    request_deadline_s: float = fleet_setting("request_deadline_s", "openai backend",
                                              applies=OPENAI)
    retries: int = fleet_setting("retries", "openai backend", applies=OPENAI)
    stream: bool = setting(False, applies=OPENAI, help="openai backend: stream the responses")
    device_map: str = setting("none", choices=("none", "auto"), fingerprint=False,
                              applies=("backend", ("transformers",)),
                              help="transformers backend, 'auto': place the model's layers over "
                                   "the visible GPUs, then the CPU (accelerate)")
    max_memory: str = setting("", metavar="0=70GiB,1=70GiB,cpu=200GiB", fingerprint=False,
                              applies=("backend", ("transformers",)),
                              help="transformers backend with --device-map auto: the memory "
                                   "each device may hold (default: accelerate's estimate)")
    cooldown_s: float = fleet_setting("cooldown_s", "openai backend", applies=OPENAI)
    retry_failed: bool = setting(True, fingerprint=False, applies=OPENAI,
                                 help="openai backend: a rerun of a complete stage that has "
                                      "generation_failed rows retries them (the cached replies "
                                      "are reused); off: it is skipped")
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
        """What the fields' ranges cannot say: an enable_thinking among the template kwargs is
        the thinking setting; the fleet; the placement (all before any work)."""
        object.__setattr__(self, "endpoints", endpoint_list(self.endpoints))
        thinking, kwargs = _thinking_from_kwargs(self.thinking, self.template_kwargs)
        object.__setattr__(self, "thinking", thinking)
        object.__setattr__(self, "template_kwargs", kwargs)
        check_fleet(self.servers, self.concurrency, self.cooldown_s)
        if self.backend == "transformers":
            placement(self.device_map, self.max_memory)

    @property
    def servers(self) -> tuple[str, ...]:
        """The openai backend's server URLs (/v1 bases, no trailing slash)."""
        return fleet_servers(self.endpoint, self.endpoints)


def _thinking_from_kwargs(thinking: str, template_kwargs: dict[str, Any]
                          ) -> tuple[str, dict[str, Any]]:
    """An enable_thinking among the template kwargs is the thinking setting (so the reply
    checks, the cache keys and the on-policy check all see it); one that contradicts
    --thinking is an error, not a silent choice."""
    switch = template_kwargs.get("enable_thinking")
    if switch is None:
        return thinking, template_kwargs
    if not isinstance(switch, bool):
        raise StageError(f"template_kwargs enable_thinking = {switch!r}: give true or false")
    wanted = "on" if switch else "off"
    if thinking not in ("keep", wanted):
        raise StageError(f"template_kwargs enable_thinking = {str(switch).lower()} contradicts "
                         f"--thinking {thinking}: give one of them")
    return wanted, {k: v for k, v in template_kwargs.items() if k != "enable_thinking"}


class RegenerateStage(Stage):
    """Conversations -> the same conversations with the target's replies."""

    name: ClassVar[str] = STAGE
    help: ClassVar[str] = "the target model writes the assistant turns"
    Settings: ClassVar[type] = RegenerateSettings
    reads: ClassVar[tuple[type[Output], ...]] = (ConversationsOutput,)
    writes: ClassVar[type[ConversationsOutput]] = ConversationsOutput
    settings: RegenerateSettings

    def __init__(self, generator: Backend | None = None) -> None:
        """`generator`: a backend instance to use instead of the one the settings name (tests
        and benchmarks share one between runs)."""
        self.generator = generator
        self.files: list[Path] = []
        self.backend: Backend | None = None
        self.reuse: Path | None = None  # a complete output's cached replies (retry_failed)

    def prepare(self, ctx: StageContext) -> dict[str, Any]:
        settings = self.settings
        self.files = ctx.read(ConversationsOutput).files()
        self.backend = self.generator or {"openai": OpenAIBackend, "vllm": VLLMBackend}.get(
            settings.backend, TransformersBackend)(settings)
        return {"settings": fingerprinted(settings), "model": self.backend.model_id,
                "inputs": [sha256_file(f) for f in self.files]}

    def redo_complete(self, ctx: StageContext, done: dict[str, Any]) -> str | None:
        """A complete stage with rows the servers failed runs again (retry_failed): the replies
        it cached are reused, so only the failed rows are requested."""
        settings = self.settings
        failed = done["total"].get("quarantine_reasons", {}).get(Q_GENERATION_FAILED, 0)
        if not (settings.retry_failed and settings.backend == "openai" and failed):
            return None
        self.reuse = ctx.run.stage_dir(STAGE) / "generations.jsonl"
        return (f"{failed} rows failed to generate last time: retrying them (the cached "
                "replies are reused; retry_failed = false skips a complete stage)")

    def begin(self, ctx: StageContext) -> None:
        cache = ctx.partial / "generations.jsonl"
        if self.reuse and self.reuse.exists() and not cache.exists():
            shutil.copyfile(self.reuse, cache)
        ctx.run.update_stage(STAGE, settings=asdict(self.settings))

    def execute(self, ctx: StageContext) -> dict[str, Any]:
        settings, backend = self.settings, self.backend
        assert backend is not None
        partial = ctx.partial
        cache = ReplyCache(partial / "generations.jsonl")
        conversations = pl.read_parquet(self.files).to_dicts()
        total = sum(len(target_positions(c, settings.mode)) for c in conversations)
        with progress_bar("regenerate", total=total, enabled=ctx.progress,
                          record=progress_record(ctx.run.root, STAGE), unit="replies") as bar:
            kept, quarantine, per_source, finish, turns = regenerate_conversations(
                conversations, backend, cache, settings, bar)
        if figures := getattr(backend, "server_figures", None):  # the fleet's load
            ctx.call_totals["servers"] = figures()  # a run's record (timing), not data
        doc = stats_document(per_source, STAGE)
        doc["total"]["finish_reasons"] = dict(finish)
        doc["total"]["truncation"], warnings = truncation(doc["total"],
                                                          settings.max_truncated_share)
        warnings += think_cut_warning(doc["total"], settings)
        # why the rows a server failed failed: what the quarantine-rate gate's message repeats
        warnings += getattr(backend, "broken_servers", list)()
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
            "served_model": getattr(backend, "served_model", None),
            "model_identity": getattr(backend, "model_id", None)}
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
                f"reasons: {dict(reasons.most_common(4))}. "
                + "".join(f"'{r}': {REASON_HINTS[r].format(model=settings.model)}; "
                          for r, _ in reasons.most_common() if r in REASON_HINTS)
                + f"See {partial / 'quarantine.parquet'}."
                + "".join(f"\n  - {w}" for w in warnings[:4]))
        needed = {c["id"] for c in conversations if c.get("needs_response")}
        unanswered = [c["id"] for c in kept
                      if c["id"] in needed and c["messages"][-1]["role"] != "assistant"]
        if unanswered:  # an invariant of the code above, checked on the data it wrote
            raise StageError(f"{len(unanswered)} conversations still end without a reply, "
                             f"e.g. {unanswered[:3]}")
        return doc

    @classmethod
    def summary(cls, doc: dict[str, Any], record: StageRecord, out: Path) -> list[str]:
        total = doc["total"]
        dropped = total.get("dropped_replies") or {}
        if "generated_replies" not in total:  # a stage completed by an older version: its counts
            total = {**total, "generated_replies": total.get("generated_turns")}
        lines = [f"regenerate {state_word(doc)}: conversations {counts_line(total)}",
                 f"  replies: {total.get('generated_replies')} generated, "
                 f"{total.get('generated_turns')} kept, {sum(dropped.values())} filtered or "
                 f"quarantined with their conversations {dropped or ''}".rstrip(),
                 f"  finish reasons of the kept: {total.get('finish_reasons')}"]
        lines += [f"  thinking {mode}: {cut['truncated']} of {cut['replies']} replies cut at "
                  f"max_new_tokens ({100 * cut['share']:.0f}%)"
                  for mode, cut in (total.get("truncation") or {}).items()]
        return [*lines, f"  conversations: {out / 'conversations'}  (tokenize reads these now)",
                *(f"  WARNING: {warning}" for warning in doc.get("warnings", [])),
                f"  quarantine:    {out / 'quarantine.parquet'}",
                f"  stats:         {out / 'stats.json'}"]
