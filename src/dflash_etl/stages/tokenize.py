"""tokenize: canonical conversations -> rows of input_ids + verified assistant loss masks.

The template is probed once (tokenize/probe.json), each conversation is rendered and masked by
`dflash_etl.templates` (every row verified; a row that cannot be verified is quarantined), and the
rows are written as a `datasets` save_to_disk directory, the layout speculators' and SpecForge's
trainers read, plus token frequencies and the draft-vocabulary maps (d2t / t2d).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_etl.core.accounting import Stats, stats_document
from dflash_etl.core.errors import StageError
from dflash_etl.core.outputs import ConversationsOutput, Output, TokenizedOutput
from dflash_etl.core.rundir import StageRecord, sha256_file, write_json_atomic
from dflash_etl.core.schema import TOKENIZED_ROWS, numeric_array, string_array
from dflash_etl.core.settings import fingerprinted, setting
from dflash_etl.core.stage import (
    BatchOutput,
    BatchStage,
    ItemResults,
    StageContext,
    WorkItem,
    counts_line,
    read_item_file,
    state_word,
)
from dflash_etl.io.draft_vocab import save_vocab
from dflash_etl.io.hf_dataset import save_dataset
from dflash_etl.mix.shares import learning_shares, leave_out_by_supervised_tokens
from dflash_etl.models.identity import tokenizer_identity
from dflash_etl.models.tokenizer import load_tokenizer, model_vocab_size, read_template
from dflash_etl.validation.on_policy import on_policy_report

STAGE = "tokenize"
CHUNK = 256  # conversations per work item

QUARANTINE = pa.schema(
    [("id", pa.string()), ("source", pa.string()), ("file", pa.string()), ("line", pa.int64()),
     ("reason", pa.string()), ("message", pa.string())]
)


@dataclass(frozen=True)
class TokenizeSettings:
    """[tokenize] in pipeline.toml; CLI flags override it."""

    # their identities are fingerprinted (the tokenizer's files, the template), not their paths
    model: str = setting("", metavar="DIR", help="local tokenizer or model directory (offline)",
                         required="a tokenizer", path=True, fingerprint=False)
    chat_template: str | None = setting(None, metavar="FILE", path=True, fingerprint=False,
                                        help="a .jinja file that overrides the tokenizer's")
    seq_length: int = setting(4096, min=1, help="maximum tokens per row")
    truncation: str = setting("right", choices=("right", "drop"),
                              help="what happens to rows over --seq-length")
    min_supervised_tokens: int = setting(2, min=1,
                                         help="consecutive supervised tokens a row needs")
    strategy: str = setting("auto", choices=("auto", "generation", "render_diff", "per_turn"),
                            help="how the loss mask is found")
    include_eot: bool = setting(True, flags=("--eot",), help="supervise end-of-turn")
    supervise_reasoning: bool = setting(True, flags=("--reasoning",),
                                        help="supervise reasoning")
    turns: str = setting("all", choices=("all", "last"), help="which assistant turns to train")
    draft_vocab_size: int = setting(32000, min=1, help="size of d2t/t2d")
    max_off_policy_share: float = setting(
        0.01, min=0, max=1, help="rows rendered in another thinking mode than regenerate "
        "generated with, as a share of rows, before the on-policy check fails the stage")
    special_tokens_in_content: str = setting(
        "quarantine", choices=("quarantine", "keep"),
        help="a conversation whose text holds a special token's string (<|im_end|>...): "
             "quarantine it (special_token_in_content), or keep it, the string then becoming "
             "the real token")
    template_kwargs: dict[str, Any] = setting(  # noqa: RUF009 (setting() returns a field)
        default_factory=dict, flags=("--template-kwarg",), metavar="KEY=JSON",
        help="variables every render of the template gets (repeat the flag): those a template "
             "needs to render at all (functions, datetime) or switches (preserve_thinking)")
    stale_regenerate: str = setting(
        "error", choices=("error", "read_ingest"),
        help="regenerate ran but its output is not current (ingest rerun since, or regenerate "
             "failed): stop with the rerun to do, or read ingest's conversations, warned")
    cross_check: float = setting(
        0.01, min=0, max=1, help="share of conversations (chosen by id) also tokenized without "
        "the shortcuts the probe allowed (one render: by {% generation %} tags or the message "
        "loop's marks; N+1 renders for N replies) and quarantined if the rows differ")
    template_clock: str = setting(
        "2025-01-01T00:00:00", metavar="ISO|now",
        help="the date and time a template that prints the current time (strftime_now: Llama "
             "3.x, Granite, Hunyuan) renders: fixed, so a rerun gives the same rows; 'now' for "
             "the wall clock (rows then change from run to run)")
    render_timeout_s: float = setting(10.0, above=0, help="seconds the renders of one "
                                      "conversation may take (template_render_timeout)")
    max_render_timeout_share: float = setting(
        0.05, min=0, max=1, help="share of the conversations the template may time out on "
        "(and 3 or more) before the stage stops: a template that spins on many rows is broken")
    render_size_factor: float = setting(10.0, min=0, help="a render may make render_size_factor "
                                        "x the conversation's characters + render_size_extra "
                                        "(template_output_too_large)")
    render_size_extra: int = setting(1_000_000, min=0, help="characters a render may make "
                                     "beyond render_size_factor x the conversation's")

    def __post_init__(self) -> None:
        if self.template_clock != "now":
            import datetime

            try:
                datetime.datetime.fromisoformat(self.template_clock)
            except ValueError as exc:
                raise StageError(f"template_clock={self.template_clock!r}: give an ISO 8601 "
                                 "date and time (2025-01-01T00:00:00) or 'now'") from exc

    @property
    def render_limits(self) -> Any:
        from dflash_etl.templates.limits import RenderLimits

        return RenderLimits(timeout_s=self.render_timeout_s, size_factor=self.render_size_factor,
                            size_extra=self.render_size_extra, clock=self.template_clock)



# ---------------------------------------------------------------- loading (offline)
def probe(settings: TokenizeSettings, tokenizer: Any = None) -> Any:
    """The template probe (TemplateUnusable becomes a StageError naming the reason, and so does
    a probe render over the render limits: such a template would fail every row)."""
    from dflash_etl.templates import TemplateUnusable, probe_template
    from dflash_etl.templates.limits import RenderLimitExceeded, render_limits

    tokenizer = tokenizer or load_tokenizer(settings.model)
    try:
        with render_limits(settings.render_limits):
            return probe_template(tokenizer, read_template(settings.chat_template),
                                  render_kwargs=dict(settings.template_kwargs),
                                  model_dir=settings.model)
    except TemplateUnusable as exc:
        undefined = re.search(r"'(\w+)' is undefined", str(exc))
        hint = (f"; the template reads a variable {undefined.group(1)!r} no render gives it: pass "
                f"it with [tokenize] template_kwargs = {{ {undefined.group(1)} = ... }} or "
                f"--template-kwarg {undefined.group(1)}=JSON" if undefined else "")
        raise StageError(f"the chat template cannot be used: {exc}{hint}") from exc
    except RenderLimitExceeded as exc:
        name = (settings.chat_template if settings.chat_template
                else f"the chat template of {settings.model}")
        raise StageError(
            f"{name}: probing the template ran over the render limit ({exc.limit}): {exc}. A "
            "real chat template renders the probe's short conversations in milliseconds; if "
            "this one is legitimately slow or large, raise [tokenize] render_timeout_s / "
            "render_size_factor / render_size_extra") from exc


# ---------------------------------------------------------------- pure core
def _mask_policy(settings: TokenizeSettings) -> Any:
    """The masking settings as the templates package takes them."""
    from dflash_etl.templates import MaskPolicy

    return MaskPolicy(
        strategy=settings.strategy, include_eot=settings.include_eot,
        supervise_reasoning=settings.supervise_reasoning, turns=settings.turns,
        seq_length=settings.seq_length, truncation=settings.truncation,
        min_supervised_tokens=settings.min_supervised_tokens,
        special_tokens_in_content=settings.special_tokens_in_content,
        max_render_timeout_share=settings.max_render_timeout_share,
    )


def _source_stats() -> Stats:
    """A source's accounting before its first row: the counters tokenize adds to."""
    return Stats(extra={
        "rows_written": 0, "tokens": 0, "supervised_tokens": 0, "rows_truncated": 0,
        "cross_checked": 0, "renders": 0, "render_paths": Counter(),
        "strategies": Counter(), "normalizations": Counter(),
        "generation_prompt_kwargs": Counter()})


def _tokenized(conversations: list[dict[str, Any]], tokenizer: Any, template_probe: Any,
               settings: TokenizeSettings, chat_template: str | None) -> list[Any]:
    """tokenize_conversations under the settings; a template that times out on too many rows
    stops the stage naming it and the limits."""
    from dflash_etl.templates import TemplateTimingOut, tokenize_conversations

    try:
        return tokenize_conversations(conversations, tokenizer, template_probe,
                                      _mask_policy(settings), chat_template=chat_template,
                                      cross_check=settings.cross_check)
    except TemplateTimingOut as exc:
        name = settings.chat_template or f"the chat template of {settings.model}"
        raise StageError(
            f"{name}: {exc}: the template spins on this data, it is not the rows; fix or replace "
            "it (--chat-template FILE), or if its renders are merely slow raise "
            f"render_timeout_s (now {settings.render_timeout_s:g}) or max_render_timeout_share "
            f"(now {settings.max_render_timeout_share:g})") from exc


def tokenize_rows(
    conversations: list[dict[str, Any]], tokenizer: Any, template_probe: Any,
    settings: TokenizeSettings, chat_template: str | None,
) -> tuple[pa.Table, list[dict[str, Any]], dict[str, Stats]]:
    """Conversations -> training rows (a table with the ROWS schema), quarantine rows and
    accounting per source (the supervised-token counts are taken from the rows as the dataset
    is joined: `_save_dataset`)."""
    from dflash_etl.templates import MaskRefused

    quarantine: list[dict[str, Any]] = []
    per_source: dict[str, Stats] = {}
    ids_lists: list[list[int]] = []
    mask_lists: list[list[int]] = []
    row_stats: list[Stats] = []
    ids_col: list[str] = []
    source_col: list[str] = []
    turn_col: list[int] = []
    results = _tokenized(conversations, tokenizer, template_probe, settings, chat_template)
    for conv, made in zip(conversations, results, strict=True):
        stats = per_source.get(conv["source"])
        if stats is None:
            stats = per_source[conv["source"]] = _source_stats()
        stats.rows_in += 1
        if isinstance(made, MaskRefused):
            _count_refused(made, conv, stats, quarantine)
            continue
        stats.rows_out += 1
        extra = stats.extra
        extra["cross_checked"] += int(made[0].cross_checked)
        extra["renders"] += made[0].renders  # per written conversation: renders / rows_out
        extra["render_paths"][made[0].render_path] += 1
        for row in made:
            ids_lists.append(row.input_ids)
            mask_lists.append(row.loss_mask)
            row_stats.append(stats)
            ids_col.append(conv["id"])
            source_col.append(conv["source"])
            turn_col.append(row.turn)
            extra["rows_written"] += 1
            extra["rows_truncated"] += int(row.truncated)
            extra["strategies"][row.strategy] += 1
            extra["normalizations"].update(n.split(":")[0] for n in row.normalizations)
            extra["generation_prompt_kwargs"].update(
                n.split(":", 1)[1] for n in row.normalizations
                if n.startswith("generation_prompt_kwargs:"))
    rows = _rows_table(ids_lists, mask_lists, row_stats, ids_col, source_col, turn_col)
    return rows, quarantine, per_source


def _count_refused(refused: Any, conv: dict[str, Any], stats: Stats,
                   quarantine: list[dict[str, Any]]) -> None:
    """A conversation the masking refused: a filter only counts it, any other refusal is
    also a quarantine row."""
    if refused.is_filter:
        stats.filter(refused.code)
    else:
        stats.quarantine(refused.code)
        quarantine.append({"id": conv["id"], "source": conv["source"],
                           "file": conv.get("file"), "line": conv.get("line"),
                           "reason": refused.code, "message": refused.message[:2000]})


def _rows_table(ids_lists: list[list[int]], mask_lists: list[list[int]], row_stats: list[Stats],
                ids_col: list[str], source_col: list[str], turn_col: list[int]) -> pa.Table:
    """The rows as one ROWS table, built from flat arrays in one pass (no per-row Arrow
    objects); each row's token and supervised-token counts go to its source's stats."""
    lengths = np.fromiter(map(len, ids_lists), np.int64, len(ids_lists))
    offsets = np.zeros(len(ids_lists) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    flat_ids = np.fromiter(itertools.chain.from_iterable(ids_lists), np.int32, total)
    flat_mask = np.fromiter(itertools.chain.from_iterable(mask_lists), np.int8, total)
    supervised = np.add.reduceat(flat_mask, offsets[:-1], dtype=np.int64) if total else lengths
    for stats, n_tokens, n_supervised in zip(row_stats, lengths.tolist(), supervised.tolist(),
                                             strict=True):
        stats.extra["tokens"] += n_tokens
        stats.extra["supervised_tokens"] += n_supervised
    # not pa.array: its first call imports pandas, a second of CPU in every worker
    list_offsets = numeric_array(offsets)
    return pa.Table.from_arrays([
        pa.ListArray.from_arrays(list_offsets, numeric_array(flat_ids)),
        pa.ListArray.from_arrays(list_offsets, numeric_array(flat_mask)),
        numeric_array(lengths.astype(np.int32)), string_array(ids_col),
        string_array(source_col), numeric_array(np.array(turn_col, np.int32)),
    ], schema=TOKENIZED_ROWS)


# ---------------------------------------------------------------- shell
COLUMNS = ["id", "source", "messages", "tools", "file", "line"]


def plan_chunks(files: list[Path]) -> list[WorkItem]:
    """Work items of at most CHUNK conversations, each within one Parquet row group (a worker
    reads just its row group), in file order."""
    items: list[WorkItem] = []
    for path in files:
        metadata = pq.ParquetFile(path).metadata
        for group in range(metadata.num_row_groups):
            rows = metadata.row_group(group).num_rows
            for start in range(0, rows, CHUNK):
                items.append(WorkItem(len(items), (str(path), group, start,
                                                   min(CHUNK, rows - start))))
    return items


@dataclass(eq=False)
class TokenizeStage(BatchStage):
    """Conversations -> verified training rows; a work item is a chunk of conversations.
    Its fields are what every worker tokenizes with: the settings and the parent's template
    probe, then (`setup`, per worker) the tokenizer and the chat template override."""

    name: ClassVar[str] = STAGE
    help: ClassVar[str] = "conversations -> input_ids + verified loss masks"
    Settings: ClassVar[type] = TokenizeSettings
    reads: ClassVar[tuple[type[Output], ...]] = (ConversationsOutput,)
    writes: ClassVar[type[TokenizedOutput]] = TokenizedOutput
    item_unit: ClassVar[str] = "chunks"
    settings: TokenizeSettings = field(default_factory=TokenizeSettings)
    template_probe: Any = None
    tokenizer: Any = field(default=None, init=False)
    chat_template: str | None = field(default=None, init=False)
    # found in `prepare`, in the parent
    conversations: ConversationsOutput | None = field(default=None, init=False)
    files: list[Path] = field(default_factory=list, init=False)
    vocab_size: int = field(default=0, init=False)
    probe_doc: dict[str, Any] = field(default_factory=dict, init=False)
    markers: dict[str, list[int]] = field(default_factory=dict, init=False)  # mask_markers
    # ingest's mix (weight_by, seed, weights) and the share of rows each weighted source
    # asked for: what the supervised-token mix and the learning shares work from
    mix: dict[str, Any] = field(default_factory=dict, init=False)
    asked_shares: dict[str, float | None] = field(default_factory=dict, init=False)

    def prepare(self, ctx: StageContext) -> dict[str, Any]:
        settings = self.settings
        self.conversations = ctx.read(
            ConversationsOutput, stale=STALE_POLICY[settings.stale_regenerate],
            stale_hint=", or read the earlier conversations on purpose with "
                       "--stale-regenerate read_ingest")
        self.files = self.conversations.files()
        tokenizer = load_tokenizer(settings.model)
        self.vocab_size = len(tokenizer)
        self.template_probe = probe(settings, tokenizer)
        self.probe_doc = self.template_probe.to_dict()
        self.markers = mask_markers(tokenizer, self.probe_doc, settings.include_eot)
        origin = ctx.origin(ConversationsOutput)
        ingested = origin.stats() if origin else {}
        self.mix = dict(ingested.get("mix") or {})  # {}: made before ingest recorded it
        self.asked_shares = {name: (s.get("mix") or {}).get("target_share")
                             for name, s in (ingested.get("sources") or {}).items()}
        payload = {"settings": fingerprinted(settings),
                   "inputs": [sha256_file(f) for f in self.files],
                   "tokenizer": tokenizer_identity(settings.model),
                   "template": self.probe_doc["template_sha256"]}
        if self.mix.get("weight_by") == "supervised_tokens":  # weights change no ingest output
            payload["mix"] = self.mix
        return payload

    def begin(self, ctx: StageContext) -> None:
        write_json_atomic(ctx.partial / "probe.json", self.probe_doc)
        ctx.run.update_stage(STAGE, settings=asdict(self.settings), probe={
            key: self.probe_doc[key] for key in ("strategy", "reason", "template_sha256")})

    def plan(self, ctx: StageContext) -> list[WorkItem]:
        return plan_chunks(self.files)

    def setup(self) -> None:
        self.tokenizer = load_tokenizer(self.settings.model)
        self.chat_template = read_template(self.settings.chat_template)

    def load(self, item: WorkItem) -> pa.Table:
        path, group, start, length = item.payload
        # pyarrow, not polars: polars' thread pool does not survive a fork (a worker hangs)
        table = pq.ParquetFile(path).read_row_group(group, columns=COLUMNS)
        return table.slice(start, length)

    def process_batch(self, batch: pa.Table, item: WorkItem) -> BatchOutput:
        from dflash_etl.templates.limits import render_limits

        with render_limits(self.settings.render_limits):  # in the worker: a hung render ends
            rows, quarantine, per_source = tokenize_rows(
                batch.to_pylist(), self.tokenizer, self.template_probe, self.settings,
                self.chat_template)
        # the token frequencies are counted from the row files when they are joined (a
        # chunk's counts, kept per result, grew the parent by ~1.5 kB per conversation)
        return BatchOutput(rows, pa.Table.from_pylist(quarantine, schema=QUARANTINE)
                           if quarantine else pa.Table.from_batches([], QUARANTINE), per_source)

    def contract_params(self, ctx: StageContext) -> dict[str, Any]:
        return _contract_params(self.vocab_size, self.settings)

    def finish(self, ctx: StageContext, results: ItemResults) -> dict[str, Any]:
        doc = _finish(self.settings, results, ctx.partial, self.vocab_size, self.probe_doc,
                      ctx.fingerprint, self.mix, self.asked_shares, self.markers)
        assert self.conversations is not None
        _check_on_policy(self.conversations, self.settings, doc, ctx.partial)
        return doc

    @classmethod
    def summary(cls, doc: dict[str, Any], record: StageRecord, out: Path) -> list[str]:
        total = doc["total"]
        return [f"tokenize {state_word(doc)}: conversations {counts_line(total)}",
                f"  rows written: {total.get('rows_written')}, tokens: {total.get('tokens')}, "
                f"supervised: {total.get('supervised_tokens')}, strategies: "
                f"{total.get('strategies')}",
                f"  draft vocab: {total.get('draft_vocab')}",
                f"  dataset:  {out / 'dataset'}  (datasets.load_from_disk)",
                f"  probe:    {out / 'probe.json'}",
                f"  stats:    {out / 'stats.json'}"]


# [tokenize] stale_regenerate -> what reading the conversations does with a stale writer
STALE_POLICY = {"error": "error", "read_ingest": "previous"}


def _check_on_policy(conversations: ConversationsOutput, settings: TokenizeSettings,
                     doc: dict[str, Any], partial: Path) -> None:
    """Rows rendered in another thinking mode than the replies were generated in fail the stage,
    naming both (see validation/on_policy.py); the report goes into the stats either way (on a
    failure into the partial directory's stats.json, for the user to read). How the replies were
    generated is in the stats of the stage that wrote the conversations (regenerate's)."""
    generated = conversations.stats().get("generation")
    total = doc["total"]
    # the prompt kwargs count every row tokenized, those the mix then left out included
    rows = total["rows_written"] + (doc.get("mix") or {}).get("rows_left_out", 0)
    report = on_policy_report(generated, settings.supervise_reasoning, rows,
                              total.get("generation_prompt_kwargs") or {},
                              settings.max_off_policy_share)
    doc["on_policy"] = report
    if report["problems"]:
        write_json_atomic(partial / "stats.json", doc)
        raise StageError("on-policy check: " + "; ".join(report["problems"]) + ". Tokenize with "
                         "the thinking mode the replies were generated in (or regenerate in the "
                         "mode you will serve), or raise [tokenize] max_off_policy_share")


def _finish(settings: TokenizeSettings, results: ItemResults, partial: Path, vocab_size: int,
            probe_doc: dict[str, Any], fingerprint: str, mix: dict[str, Any],
            asked_shares: dict[str, float | None], markers: dict[str, list[int]]
            ) -> dict[str, Any]:
    """The items' rows joined into the dataset (the supervised-token mix applied), the draft
    vocabulary, the limits file and the stats document."""
    per_source = results.per_source()
    total = Stats()
    for stats in per_source.values():
        total.merge(stats)
    row_files = results.row_files()
    quarantine = pa.concat_tables([read_item_file(f, QUARANTINE)
                                   for f in results.quarantine_files()])
    pq.write_table(quarantine, partial / "quarantine.parquet")
    if not total.extra.get("rows_written", 0):
        reasons = (total.quarantine_reasons + total.rows_filtered).most_common(4)
        raise StageError(
            f"tokenize wrote no rows from {total.rows_in} conversations; most common "
            f"reasons: {dict(reasons)}. Template strategy: {probe_doc['strategy']} "
            f"({probe_doc['reason']}). See {partial / 'quarantine.parquet'}; "
            "'needs_response' means the conversations have no reply yet (run regenerate)."
        )
    supervised_mix, dropped = None, None
    if mix.get("weight_by") == "supervised_tokens" and mix.get("weights"):
        dropped, supervised_mix = leave_out_by_supervised_tokens(row_files, mix, per_source)
    counts = save_dataset(row_files, partial / "dataset", fingerprint, drop=dropped)
    tokens = np.flatnonzero(counts)
    freq: Counter[int] = Counter(dict(zip(tokens.tolist(), counts[tokens].tolist(),
                                          strict=True)))
    model_vocab, model_vocab_from = model_vocab_size(settings.model, vocab_size)
    draft = save_vocab(freq, settings.draft_vocab_size, vocab_size, model_vocab,
                        model_vocab_from, partial)
    # the limits the contract and the suite check against (the suite reads this file)
    write_json_atomic(partial / "settings.json",
                      {**asdict(settings), **_contract_params(vocab_size, settings), **markers})
    doc = stats_document(per_source, "tokenize")
    doc["learning_mix"] = learning_shares(doc["sources"], asked_shares,
                                          supervised_mix)
    if supervised_mix is not None:
        doc["mix"] = {"weight_by": "supervised_tokens", "sources": supervised_mix,
                      "rows_left_out": sum(m.get("rows_left_out", 0)
                                           for m in supervised_mix.values()),
                      "max_share_error": max(abs(m["achieved_share"] - m["asked_share"])
                                             for m in supervised_mix.values())}
    doc["total"]["vocab_size"] = vocab_size
    doc["total"]["model_vocab_size"] = model_vocab
    doc["total"]["draft_vocab"] = draft
    return doc


def mask_markers(tokenizer: Any, probe_doc: dict[str, Any], include_eot: bool
                 ) -> dict[str, list[int]]:
    """The tokens the suite checks every mask by, whoever made it: each reply's last supervised
    token is the end of turn (with include_eot), and the turn-start marker that opens every
    header (`<|im_start|>`, `<|start_header_id|>`, ...) is never supervised. A mask over the
    whole sequence, shifted by a token, or without the end of turn fails one of them."""
    eot: list[int] = []
    if include_eot:
        text = probe_doc.get("eot_text") or ""
        ids = tokenizer.encode(text, add_special_tokens=False) if text else []
        fallback = probe_doc.get("eos_fallback_id")
        eot = [int(ids[-1])] if ids else [int(fallback)] if fallback is not None else []
    prompt = tokenizer.encode(probe_doc.get("generation_prompt") or "", add_special_tokens=False)
    added = {*tokenizer.get_added_vocab().values(), *tokenizer.all_special_ids}
    header = [int(prompt[0])] if prompt and prompt[0] in added and prompt[0] not in eot else []
    return {"end_of_turn_ids": eot, "turn_start_ids": header}


def _contract_params(vocab_size: int, settings: TokenizeSettings) -> dict[str, Any]:
    return {"vocab_size": vocab_size, "seq_length": settings.seq_length,
            "min_supervised_tokens": settings.min_supervised_tokens}
