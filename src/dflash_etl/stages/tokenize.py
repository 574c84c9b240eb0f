"""tokenize: canonical conversations -> rows of input_ids + verified assistant loss masks.

The template is probed once (tokenize/probe.json), each conversation is rendered and masked by
`dflash_etl.templates` (every row verified; a row that cannot be verified is quarantined), and the
rows are written as a `datasets` save_to_disk directory, the layout speculators' and SpecForge's
trainers read, plus token frequencies and the draft-vocabulary maps (d2t / t2d).
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import sys
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_etl.core.accounting import Stats, stats_document
from dflash_etl.core.config import register_section, setting, stage_settings
from dflash_etl.core.errors import StageError
from dflash_etl.core.rundir import RunDir, sha256_file, write_json_atomic
from dflash_etl.core.schema import F_MIX_WEIGHT, flat_values, numeric_array, string_array
from dflash_etl.core.stage import (
    BatchOutput,
    BatchStage,
    StageContext,
    WorkItem,
    item_paths,
    read_item_file,
)
from dflash_etl.io.torch_pickle import save_plain_dict
from dflash_etl.mix.shares import learning_shares, plan_supervised_mix
from dflash_etl.models.identity import tokenizer_identity
from dflash_etl.models.tokenizer import load_tokenizer, model_vocab_size, read_template
from dflash_etl.stages.shell import stage_runner
from dflash_etl.validation import suites
from dflash_etl.validation.on_policy import on_policy_report

STAGE = "tokenize"
CHUNK = 256  # conversations per work item

ROWS = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("seq_len", pa.int32()),
        ("id", pa.string()),
        ("source", pa.string()),
        ("turn", pa.int32()),
    ]
)
QUARANTINE = pa.schema(
    [("id", pa.string()), ("source", pa.string()), ("file", pa.string()), ("line", pa.int64()),
     ("reason", pa.string()), ("message", pa.string())]
)


@dataclass(frozen=True)
class TokenizeSettings:
    """[tokenize] in pipeline.toml; CLI flags override it."""

    model: str = setting("", metavar="DIR", help="local tokenizer or model directory (offline)")
    chat_template: str | None = setting(None, metavar="FILE",
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

    @classmethod
    def from_sources(
        cls, section: dict[str, Any], overrides: dict[str, Any], base_dir: Path | None
    ) -> TokenizeSettings:
        settings = stage_settings(cls, "tokenize", section, overrides, base_dir,
                                  ("model", "chat_template"), "model", "a tokenizer")
        if settings.truncation not in ("right", "drop"):
            raise StageError(f"truncation={settings.truncation!r}: use 'right' or 'drop'")
        if settings.template_clock != "now":
            import datetime

            try:
                datetime.datetime.fromisoformat(settings.template_clock)
            except ValueError as exc:
                raise StageError(f"template_clock={settings.template_clock!r}: give an ISO 8601 "
                                 "date and time (2025-01-01T00:00:00) or 'now'") from exc
        return settings


    @property
    def render_limits(self) -> Any:
        from dflash_etl.templates.limits import RenderLimits

        return RenderLimits(timeout_s=self.render_timeout_s, size_factor=self.render_size_factor,
                            size_extra=self.render_size_extra, clock=self.template_clock)


register_section("tokenize", TokenizeSettings)


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
    ], schema=ROWS)


def draft_vocab(freq: Counter[int], draft_vocab_size: int, tokenizer_size: int,
                model_vocab_size: int):
    """speculators' d2t (offsets) / t2d (bool mask): the most frequent supervised tokens.

    Draft tokens are real tokens (below the tokenizer's size); t2d spans the model's padded
    vocabulary, the length the trainers check it against."""
    size = min(draft_vocab_size, tokenizer_size)
    ranked = sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = [t for t, _ in ranked[:size]]
    if len(chosen) < size:  # pad with the lowest unused ids, as speculators does
        taken = set(chosen)
        chosen += [t for t in range(tokenizer_size) if t not in taken][: size - len(chosen)]
    chosen.sort()
    d2t = np.asarray(chosen, dtype=np.int64) - np.arange(size, dtype=np.int64)
    t2d = np.zeros(model_vocab_size, dtype=bool)
    t2d[chosen] = True
    total = sum(freq.values())
    covered = sum(freq.get(t, 0) for t in chosen)
    return d2t, t2d, (covered / total if total else 0.0)


def vocab_map_names(size: int) -> tuple[str, str]:
    """d2t-<N>.npy / t2d-<N>.npy: the names speculators looks for (N = the draft vocab size)."""
    return f"d2t-{size}.npy", f"t2d-{size}.npy"


# ---------------------------------------------------------------- shell
def _conversations(run: RunDir, stale_regenerate: str = "error") -> list[Path]:
    """The regenerated conversations when regenerate completed on the current ingest output,
    ingest's when regenerate never ran; a regenerate that ran and is not current (ingest rerun
    since, or it failed) is an error, or with `stale_regenerate = "read_ingest"` a warning,
    never a silent fallback to ingest's replies."""
    stages = run.manifest().get("stages", {})
    regen = stages.get("regenerate")
    directory = run.stage_dir("ingest") / "conversations"
    if regen:
        current = (regen.get("status") == "complete"
                   and regen.get("input_fingerprint") == stages.get("ingest", {}).get(
                       "fingerprint")
                   and (run.stage_dir("regenerate") / "conversations").is_dir())
        if current:
            directory = run.stage_dir("regenerate") / "conversations"
        else:
            why = ("was made from an older ingest output (ingest was rerun since)"
                   if regen.get("status") == "complete" else
                   f"is {regen.get('status', 'not complete')}, not complete")
            message = (f"regenerate's output {why}: tokenize would read ingest's conversations "
                       "and their original replies instead of the target's")
            if stale_regenerate == "error":
                raise StageError(f"{message}. Rerun `dflash-etl regenerate --run {run.root}` "
                                 "first, or tokenize ingest's on purpose with "
                                 "--stale-regenerate read_ingest")
            print(f"tokenize: WARNING: {message} (stale_regenerate = read_ingest)",
                  file=sys.stderr, flush=True)
    files = sorted(directory.glob("*.parquet"))
    if not files:
        raise StageError(f"no conversations in {directory}: run `dflash-etl ingest` for this run "
                         "first (tokenize reads the ingest stage's output)")
    return files


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

    name = STAGE
    reads = ("ingest", "regenerate")  # regenerate's conversations where it ran
    settings: TokenizeSettings = field(default_factory=TokenizeSettings)
    template_probe: Any = None
    tokenizer: Any = field(default=None, init=False)
    chat_template: str | None = field(default=None, init=False)

    def prepare(self, ctx: StageContext) -> dict[str, Any]:
        settings: TokenizeSettings = ctx.settings
        files = _conversations(ctx.run, settings.stale_regenerate)
        tokenizer = load_tokenizer(settings.model)
        template_probe = probe(settings, tokenizer)
        probe_doc = template_probe.to_dict()
        ctx.state.update(files=files, tokenizer=tokenizer, probe=template_probe,
                         probe_doc=probe_doc)
        # the tokenizer's and template's identities, not their paths (a moved run is not redone)
        kept = {k: v for k, v in asdict(settings).items() if k not in ("model", "chat_template")}
        payload = {"settings": kept, "inputs": [sha256_file(f) for f in files],
                   "tokenizer": tokenizer_identity(settings.model),
                   "template": probe_doc["template_sha256"]}
        mix = ingest_mix(ctx.run.root)
        if mix.get("weight_by") == "supervised_tokens":  # weights change no ingest output
            payload["mix"] = mix
        return payload

    def begin(self, ctx: StageContext) -> None:
        probe_doc = ctx.state["probe_doc"]
        write_json_atomic(ctx.partial / "probe.json", probe_doc)
        ctx.run.update_stage(STAGE, settings=asdict(ctx.settings), probe={
            "strategy": probe_doc["strategy"], "reason": probe_doc["reason"],
            "template_sha256": probe_doc["template_sha256"]})

    def plan(self, ctx: StageContext) -> list[WorkItem]:
        return plan_chunks(ctx.state["files"])

    def bind(self, ctx: StageContext) -> None:
        self.settings, self.template_probe = ctx.settings, ctx.state["probe"]

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

    def while_working(self) -> AbstractContextManager[Callable[[], None]]:
        # the gate's imports (pandera for the contract), while the workers work
        return suites.warming_up(("pandera.polars",))

    def contract_params(self, ctx: StageContext) -> dict[str, Any]:
        return _contract_params(len(ctx.state["tokenizer"]), ctx.settings)

    def finish(self, ctx: StageContext, results: list[dict[str, Any]], work_dir: Path
               ) -> dict[str, Any]:
        doc = _finish(ctx.settings, results, ctx.partial, work_dir, len(ctx.state["tokenizer"]),
                      ctx.state["probe_doc"], ctx.fingerprint)
        _check_on_policy(ctx.run, ctx.settings, doc, ctx.partial)
        return doc


def _check_on_policy(run: RunDir, settings: TokenizeSettings, doc: dict[str, Any],
                     partial: Path) -> None:
    """Rows rendered in another thinking mode than the replies were generated in fail the stage,
    naming both (see validation/on_policy.py); the report goes into the stats either way (on a
    failure into the partial directory's stats.json, for the user to read)."""
    generated = None
    stats = run.stage_dir("regenerate") / "stats.json"
    if run.manifest().get("stages", {}).get("regenerate", {}).get("status") == "complete" \
            and stats.is_file():
        generated = json.loads(stats.read_text()).get("generation")
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


run = stage_runner(TokenizeStage)


def _finish(settings: TokenizeSettings, results: list[dict[str, Any]], partial: Path,
            units_dir: Path, vocab_size: int, probe_doc: dict[str, Any], fingerprint: str
            ) -> dict[str, Any]:
    per_source: dict[str, Stats] = {}
    for result in results:
        for name, data in result["sources"].items():
            per_source.setdefault(name, Stats()).merge(Stats.from_dict(data))
    total = Stats()
    for stats in per_source.values():
        total.merge(stats)
    paths = [item_paths(units_dir, r["index"]) for r in results]
    row_files = [rows for rows, _, _ in paths]
    q_files = [q for _, q, _ in paths]
    quarantine = pa.concat_tables([read_item_file(f, QUARANTINE) for f in q_files])
    pq.write_table(quarantine, partial / "quarantine.parquet")
    if not total.extra.get("rows_written", 0):
        reasons = (total.quarantine_reasons + total.rows_filtered).most_common(4)
        raise StageError(
            f"tokenize wrote no rows from {total.rows_in} conversations; most common "
            f"reasons: {dict(reasons)}. Template strategy: {probe_doc['strategy']} "
            f"({probe_doc['reason']}). See {partial / 'quarantine.parquet'}; "
            "'needs_response' means the conversations have no reply yet (run regenerate)."
        )
    mix = ingest_mix(partial.parent)
    supervised_mix, dropped = None, None
    if mix.get("weight_by") == "supervised_tokens" and mix.get("weights"):
        dropped, supervised_mix = _mix_by_supervised_tokens(row_files, mix, per_source)
    counts = _save_dataset(row_files, partial / "dataset", fingerprint, drop=dropped)
    tokens = np.flatnonzero(counts)
    freq: Counter[int] = Counter(dict(zip(tokens.tolist(), counts[tokens].tolist(),
                                          strict=True)))
    model_vocab, model_vocab_from = model_vocab_size(settings.model, vocab_size)
    draft = _save_vocab(freq, settings.draft_vocab_size, vocab_size, model_vocab,
                        model_vocab_from, partial)
    # the limits the contract and the suite check against (the suite reads this file)
    write_json_atomic(partial / "settings.json",
                      {**asdict(settings), **_contract_params(vocab_size, settings)})
    doc = stats_document(per_source, "tokenize")
    doc["learning_mix"] = learning_shares(doc["sources"], _asked_shares(partial.parent),
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


def ingest_mix(run_root: Path) -> dict[str, Any]:
    """ingest's mix (stats.json `mix`: weight_by, seed, weights; {} for a run made before
    ingest recorded it, whose weights were shares of rows)."""
    try:
        return dict(json.loads((run_root / "ingest" / "stats.json").read_text()).get("mix") or {})
    except (OSError, ValueError):
        return {}


def _conversation_counts(row_files: list[Path]) -> Any:
    """Per conversation (id): its source, rows, tokens and supervised tokens, over its rows (a
    polars frame; polars is imported here, in the parent after the workers, never before a
    fork: its thread pool does not survive one)."""
    import polars as pl

    frames = [pl.read_parquet(f, columns=["id", "source", "seq_len", "loss_mask"])
              for f in row_files]
    return pl.concat(frames).group_by("id", maintain_order=True).agg(
        pl.col("source").first(), pl.len().alias("rows"),
        pl.col("seq_len").cast(pl.Int64).sum().alias("tokens"),
        pl.col("loss_mask").list.eval(pl.element().cast(pl.Int64)).list.sum().sum()
        .alias("supervised"))


def _mix_by_supervised_tokens(row_files: list[Path], mix: dict[str, Any],
                              per_source: dict[str, Stats]
                              ) -> tuple[pa.Array, dict[str, dict[str, Any]]]:
    """[ingest] weight_by = "supervised_tokens": the conversations the mix leaves out (their
    ids), each filtered mix_weight in its source's accounting (its rows, tokens and supervised
    tokens taken off what the source wrote), and the mix per weighted source."""
    import polars as pl

    conversations = _conversation_counts(row_files)
    weights = {k: float(v) for k, v in mix["weights"].items()}
    empty = [name for name in sorted(weights)
             if not conversations.filter(pl.col("source") == name)["supervised"].sum()]
    if empty:
        raise StageError(
            f"[ingest] weight_by = \"supervised_tokens\": the weighted source(s) {empty} have no "
            "supervised tokens after tokenize, so their weights leave the other weighted "
            "sources none: remove their weights, or see quarantine.parquet for why their rows "
            "were refused")
    ids, plan = plan_supervised_mix(conversations, weights, int(mix.get("seed", 0)))
    left_out = conversations.join(pl.DataFrame({"id": ids.tolist()}, schema={"id": pl.String}),
                                  on="id", how="semi")
    for name, n, rows, tokens, supervised in left_out.group_by("source").agg(
            pl.len(), pl.col("rows").sum(), pl.col("tokens").sum(),
            pl.col("supervised").sum()).iter_rows():
        stats = per_source[name]
        stats.filter(F_MIX_WEIGHT, n)
        stats.rows_out -= n
        stats.extra["rows_written"] -= rows
        stats.extra["tokens"] -= tokens
        stats.extra["supervised_tokens"] -= supervised
        plan[name].update(conversations_left_out=n, rows_left_out=rows,
                          supervised_left_out=supervised)
    return pa.array(ids.tolist(), pa.string()), plan


def _asked_shares(run_root: Path) -> dict[str, float | None]:
    """The share of rows each weighted source asked for (ingest's mix), by source."""
    try:
        sources = json.loads((run_root / "ingest" / "stats.json").read_text())["sources"]
    except (OSError, ValueError, KeyError):
        return {}
    return {name: (s.get("mix") or {}).get("target_share") for name, s in sources.items()}


# datasets' Features of ROWS, as save_to_disk records them (dataset_info.json and the Arrow
# schema's "huggingface" metadata)
FEATURES = {
    "input_ids": {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "List"},
    "loss_mask": {"feature": {"dtype": "int8", "_type": "Value"}, "_type": "List"},
    "seq_len": {"dtype": "int32", "_type": "Value"},
    "id": {"dtype": "string", "_type": "Value"},
    "source": {"dtype": "string", "_type": "Value"},
    "turn": {"dtype": "int32", "_type": "Value"},
}
SHARD_BYTES = 500 * 2**20  # datasets' own default max_shard_size for save_to_disk


def _save_dataset(row_files: list[Path], out: Path, fingerprint: str,
                  shard_bytes: int = SHARD_BYTES, drop: pa.Array | None = None) -> np.ndarray:
    """A `datasets` save_to_disk directory (Arrow stream shards, dataset_info.json, state.json),
    written with pyarrow from the chunk files as they are read: one copy of the rows, and no
    `datasets` import (Dataset.from_parquet + save_to_disk wrote them twice, ~1 s of the stage's
    serial end on 20k rows). Returns how often each token id is supervised, counted on the way."""
    shutil.rmtree(out, ignore_errors=True)  # a failed attempt's shards
    out.mkdir(parents=True)
    schema = ROWS.with_metadata({"huggingface": json.dumps({"info": {"features": FEATURES}})})
    shards: list[Path] = []
    writer: pa.RecordBatchStreamWriter | None = None
    rows = size = in_shard = 0
    counts = np.zeros(0, np.int64)
    for path in row_files:
        table = read_item_file(path, ROWS).replace_schema_metadata(schema.metadata)
        if drop is not None and len(drop):  # the conversations the mix left out
            table = table.filter(pc.invert(pc.is_in(table.column("id"), value_set=drop)))
        if writer is None or (in_shard and in_shard + table.nbytes > shard_bytes):
            if writer is not None:
                writer.close()
            shards.append(out / f".shard-{len(shards)}.arrow")
            writer = pa.ipc.new_stream(str(shards[-1]), schema)
            in_shard = 0
        writer.write_table(table, max_chunksize=1000)  # datasets' writer batch size
        ids = flat_values(table.column("input_ids"))
        supervised = flat_values(table.column("loss_mask")).astype(bool)
        counts = _add_counts(counts, np.bincount(ids[supervised]))
        rows += table.num_rows
        size += table.nbytes
        in_shard += table.nbytes
    if writer is not None:
        writer.close()
    names = [f"data-{k:05d}-of-{len(shards):05d}.arrow" for k in range(len(shards))]
    for shard, name in zip(shards, names, strict=True):
        shard.rename(out / name)
    write_json_atomic(out / "dataset_info.json", {
        "builder_name": "dflash_etl", "citation": "", "config_name": "default",
        "dataset_name": "tokenize", "dataset_size": size, "description": "",
        "features": FEATURES, "homepage": "", "license": "", "size_in_bytes": size,
        "splits": {"train": {"name": "train", "num_bytes": size, "num_examples": rows,
                             "dataset_name": "tokenize"}},
        "version": {"version_str": "0.0.0", "major": 0, "minor": 0, "patch": 0},
    })
    # speculators' preprocessing saves its datasets in torch format and its loader relies on it
    write_json_atomic(out / "state.json", {
        "_data_files": [{"filename": name} for name in names], "_fingerprint": fingerprint[:16],
        "_format_columns": ["input_ids", "loss_mask", "seq_len"], "_format_kwargs": {},
        "_format_type": "torch", "_output_all_columns": True, "_split": "train",
    })
    return counts


def _add_counts(total: np.ndarray, more: np.ndarray) -> np.ndarray:
    if len(more) > len(total):
        total, more = more.astype(np.int64), total
    total[: len(more)] += more
    return total


def _save_vocab(freq: Counter[int], draft_vocab_size: int, tokenizer_size: int,
                model_vocab: int, model_vocab_from: str, out: Path) -> dict[str, Any]:
    ranked = sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))
    write_json_atomic(out / "token_freq.json", {
        "vocab_size": tokenizer_size, "supervised_tokens": sum(freq.values()),
        "distinct_tokens": len(freq), "frequencies": {str(t): n for t, n in ranked},
    })
    # what torch.load gives the trainers; in token order, whatever order the chunks were counted in
    save_plain_dict(dict(sorted(freq.items())), out / "token_freq.pt")
    d2t, t2d, coverage = draft_vocab(freq, draft_vocab_size, tokenizer_size, model_vocab)
    d2t_name, t2d_name = vocab_map_names(int(d2t.shape[0]))
    np.save(out / d2t_name, d2t)
    np.save(out / t2d_name, t2d)
    draft = {"size": int(d2t.shape[0]), "coverage": round(coverage, 6), "d2t": d2t_name,
             "t2d": t2d_name, "t2d_length": int(t2d.shape[0]),
             "t2d_length_from": model_vocab_from}
    write_json_atomic(out / "draft_vocab.json", draft)
    return draft


def _contract_params(vocab_size: int, settings: TokenizeSettings) -> dict[str, Any]:
    return {"vocab_size": vocab_size, "seq_length": settings.seq_length,
            "min_supervised_tokens": settings.min_supervised_tokens}


def main(argv: list[str] | None = None) -> int:
    from dflash_etl.cli.stage import stage_main

    return stage_main("tokenize", argv)


if __name__ == "__main__":
    raise SystemExit(main())
