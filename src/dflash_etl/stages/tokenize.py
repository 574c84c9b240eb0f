"""tokenize: canonical conversations -> rows of input_ids + verified assistant loss masks.

The template is probed once (tokenize/probe.json), each conversation is rendered and masked by
`dflash_etl.templates` (every row verified; a row that cannot be verified is quarantined), and the
rows are written as a `datasets` save_to_disk directory, the layout speculators' and SpecForge's
trainers read, plus token frequencies and the draft-vocabulary maps (d2t / t2d).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import shutil
import sys
from collections import Counter, deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_etl.core.accounting import Stats, stats_document
from dflash_etl.core.config import PipelineConfig, stage_settings
from dflash_etl.core.errors import ContractError, StageError
from dflash_etl.core.progress import progress_bar
from dflash_etl.core.rundir import RunDir, Timer, sha256_file, write_json_atomic
from dflash_etl.io.torch_pickle import save_plain_dict
from dflash_etl.report import publish_docs
from dflash_etl.validation import suite_helper, suites

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

    model: str = ""
    chat_template: str | None = None
    seq_length: int = 4096
    truncation: str = "right"  # or "drop"
    min_supervised_tokens: int = 2
    strategy: str = "auto"  # or generation | render_diff | per_turn
    include_eot: bool = True
    supervise_reasoning: bool = True
    turns: str = "all"  # or "last"
    draft_vocab_size: int = 32000

    @classmethod
    def from_sources(
        cls, section: dict[str, Any], overrides: dict[str, Any], base_dir: Path | None
    ) -> TokenizeSettings:
        settings = stage_settings(cls, "tokenize", section, overrides, base_dir,
                                  ("model", "chat_template"), "model", "a tokenizer")
        if settings.truncation not in ("right", "drop"):
            raise StageError(f"truncation={settings.truncation!r}: use 'right' or 'drop'")
        return settings


# ---------------------------------------------------------------- loading (offline)
def load_tokenizer(model: str) -> Any:
    """A local tokenizer or model directory; never the hub, never remote code.

    Loaded once per process and directory (a 12 MB tokenizer.json takes seconds to parse); the
    cache key includes the files' sizes and times, so an edited tokenizer is reloaded.
    """
    path = Path(model)
    if not path.is_dir():
        raise StageError(f"--model {model!r} is not a directory: give a local tokenizer or model "
                         "directory (the hub is never used)")
    signature = tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                             for f in path.iterdir() if f.is_file()))
    return _load_tokenizer(str(path.resolve()), signature)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(model: str, signature: tuple[Any, ...]) -> Any:
    """A directory with tokenizer.json loads as a plain fast tokenizer: AutoTokenizer would import
    torch (through the model configs), which costs seconds in every process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        if (Path(model) / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(model, local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, local_files_only=True,
                                             trust_remote_code=False)
    except Exception as exc:  # transformers raises many types for a bad directory
        raise StageError(f"cannot load a tokenizer from {model}: {exc}") from exc


def read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise StageError(f"--chat-template {path}: cannot read it ({exc})") from exc


def probe(settings: TokenizeSettings, tokenizer: Any = None) -> Any:
    """The template probe (TemplateUnusable becomes a StageError naming the reason)."""
    from dflash_etl.templates import TemplateUnusable, probe_template

    tokenizer = tokenizer or load_tokenizer(settings.model)
    try:
        return probe_template(tokenizer, read_template(settings.chat_template),
                              model_dir=settings.model)
    except TemplateUnusable as exc:
        raise StageError(f"the chat template cannot be used: {exc}") from exc


# ---------------------------------------------------------------- pure core
def tokenize_rows(
    conversations: list[dict[str, Any]], tokenizer: Any, template_probe: Any,
    settings: TokenizeSettings, chat_template: str | None,
) -> tuple[pa.Table, list[dict[str, Any]], dict[str, Stats], Counter[int]]:
    """Conversations -> training rows (a table with the ROWS schema), quarantine rows,
    accounting per source and the supervised-token counts."""
    from dflash_etl.templates import MaskPolicy, MaskRefused, tokenize_conversations

    policy = MaskPolicy(
        strategy=settings.strategy, include_eot=settings.include_eot,
        supervise_reasoning=settings.supervise_reasoning, turns=settings.turns,
        seq_length=settings.seq_length, truncation=settings.truncation,
        min_supervised_tokens=settings.min_supervised_tokens,
    )
    quarantine: list[dict[str, Any]] = []
    per_source: dict[str, Stats] = {}
    ids_lists: list[list[int]] = []
    mask_lists: list[list[int]] = []
    row_stats: list[Stats] = []
    ids_col: list[str] = []
    source_col: list[str] = []
    turn_col: list[int] = []
    results = tokenize_conversations(conversations, tokenizer, template_probe, policy,
                                     chat_template=chat_template)
    for conv, made in zip(conversations, results, strict=True):
        stats = per_source.get(conv["source"])
        if stats is None:
            stats = per_source[conv["source"]] = Stats(extra={
                "rows_written": 0, "tokens": 0, "supervised_tokens": 0, "rows_truncated": 0,
                "strategies": Counter(), "normalizations": Counter()})
        stats.rows_in += 1
        if isinstance(made, MaskRefused):
            if made.is_filter:
                stats.filter(made.code)
            else:
                stats.quarantine(made.code)
                quarantine.append({"id": conv["id"], "source": conv["source"],
                                   "file": conv.get("file"), "line": conv.get("line"),
                                   "reason": made.code, "message": made.message[:2000]})
            continue
        stats.rows_out += 1
        extra = stats.extra
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
    rows = pa.Table.from_arrays([
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_ids)),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_mask)),
        pa.array(lengths.astype(np.int32)), pa.array(ids_col, pa.string()),
        pa.array(source_col, pa.string()), pa.array(turn_col, pa.int32()),
    ], schema=ROWS)
    counts = np.bincount(flat_ids[flat_mask == 1])
    tokens = np.flatnonzero(counts)
    freq: Counter[int] = Counter(dict(zip(tokens.tolist(), counts[tokens].tolist(),
                                          strict=True)))
    return rows, quarantine, per_source, freq


def draft_vocab(freq: Counter[int], draft_vocab_size: int, vocab_size: int):
    """speculators' d2t (offsets) / t2d (bool mask): the most frequent supervised tokens."""
    size = min(draft_vocab_size, vocab_size)
    ranked = sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = [t for t, _ in ranked[:size]]
    if len(chosen) < size:  # pad with the lowest unused ids, as speculators does
        taken = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in taken][: size - len(chosen)]
    chosen.sort()
    d2t = np.asarray(chosen, dtype=np.int64) - np.arange(size, dtype=np.int64)
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[chosen] = True
    total = sum(freq.values())
    covered = sum(freq.get(t, 0) for t in chosen)
    return d2t, t2d, (covered / total if total else 0.0)


# ---------------------------------------------------------------- workers
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Any, settings: TokenizeSettings, probe_state: Any) -> None:
    _WORKER["tokenizer"] = tokenizer
    _WORKER["probe"] = probe_state
    _WORKER["settings"] = settings
    _WORKER["template"] = read_template(settings.chat_template)


def _one_thread_per_worker() -> None:
    """The workers already use every core: the tokenizer's batch encode runs serially in each
    (its thread pool would only compete with the other workers)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _work(args: tuple[int, bytes, str]) -> dict[str, Any]:
    index, chunk, out_dir = args
    rows, quarantine, per_source, freq = tokenize_rows(
        _chunk_conversations(chunk), _WORKER["tokenizer"], _WORKER["probe"],
        _WORKER["settings"], _WORKER["template"],
    )
    base = Path(out_dir) / f"c{index:06d}"
    pq.write_table(rows, f"{base}.rows.parquet")
    pq.write_table(pa.Table.from_pylist(quarantine, schema=QUARANTINE), f"{base}.q.parquet")
    result = {"index": index, "sources": {n: s.to_dict() for n, s in per_source.items()},
              "freq": {str(k): v for k, v in freq.items()}}
    write_json_atomic(Path(f"{base}.done.json"), result)
    return result


def _chunk_bytes(table: pa.Table) -> bytes:
    """A chunk of conversations as Arrow IPC: the parent slices and sends columns, each worker
    makes its own Python dicts (in parallel, instead of the parent making and pickling all)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _chunk_conversations(chunk: bytes) -> list[dict[str, Any]]:
    """pyarrow, not polars: polars' thread pool does not survive the fork (a worker using it
    hangs)."""
    return pa.ipc.open_stream(chunk).read_all().to_pylist()


# ---------------------------------------------------------------- shell
def _conversations(run: RunDir) -> list[Path]:
    """The regenerated conversations when regenerate completed on the current ingest output,
    else ingest's."""
    stages = run.manifest().get("stages", {})
    regen = stages.get("regenerate", {})
    directory = run.stage_dir("ingest") / "conversations"
    if (regen.get("status") == "complete"
            and regen.get("input_fingerprint") == stages.get("ingest", {}).get("fingerprint")
            and (run.stage_dir("regenerate") / "conversations").is_dir()):
        directory = run.stage_dir("regenerate") / "conversations"
    files = sorted(directory.glob("*.parquet"))
    if not files:
        raise StageError(f"no conversations in {directory}: run `dflash-etl ingest` for this run "
                         "first (tokenize reads the ingest stage's output)")
    return files


def _chunks(files: list[Path]):
    """(index, conversations as an Arrow table) per chunk, in order."""
    columns = ["id", "source", "messages", "tools", "file", "line"]
    index = 0
    for path in files:
        table = pl.read_parquet(path, columns=columns).to_arrow()
        for start in range(0, table.num_rows, CHUNK):
            yield index, table.slice(start, CHUNK)
            index += 1


def run(
    config: PipelineConfig | None,
    run_dir: str | Path,
    force: bool = False,
    progress: bool | None = None,
    workers: int | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Tokenize the run's conversations into `run_dir/tokenize`; returns the stats document."""
    suite_helper.start()  # the gate's great_expectations loads meanwhile
    section = config.section("tokenize") if config else {}
    settings = TokenizeSettings.from_sources(section, overrides,
                                             config.base_dir if config else None)
    run = RunDir(run_dir)
    timer = Timer()
    thresholds = (suites.Thresholds.from_config(config) if config
                  else suites.Thresholds.from_manifest(run.root))
    files = _conversations(run)
    tokenizer = load_tokenizer(settings.model)
    template_probe = probe(settings, tokenizer)
    probe_doc = template_probe.to_dict()
    tok_files = sorted(p for p in Path(settings.model).iterdir()
                       if p.is_file() and p.suffix in (".json", ".jinja", ".txt", ".model"))
    fingerprint = hashlib.sha256(json.dumps({
        "settings": asdict(settings), "inputs": [sha256_file(f) for f in files],
        "tokenizer": [sha256_file(f) for f in tok_files],
        "template": probe_doc["template_sha256"],
    }, sort_keys=True).encode()).hexdigest()
    if not force and (done := run.completed_stats(STAGE, fingerprint)):
        return done
    partial = run.begin(STAGE, fingerprint)
    write_json_atomic(partial / "probe.json", probe_doc)
    run.update_stage(STAGE, settings=asdict(settings), probe={
        "strategy": probe_doc["strategy"], "reason": probe_doc["reason"],
        "template_sha256": probe_doc["template_sha256"]})
    chunks_dir = partial / "chunks"
    chunks_dir.mkdir(exist_ok=True)
    try:
        with suites.warming_up(("pandera.polars",)) as warm_up:  # for the contract
            results = _run_chunks(settings, tokenizer, template_probe, files, chunks_dir,
                                  progress, workers, on_forked=warm_up)
            doc = _finish(settings, results, partial, chunks_dir, len(tokenizer), probe_doc,
                          fingerprint)
            write_json_atomic(partial / "stats.json", doc)
            # the suite runs in the helper process while the contract runs here; both must pass
            finish_gate = suites.start_gate(STAGE, partial, run.root, thresholds)
            try:
                _validate(partial, len(tokenizer), settings)
            except BaseException:
                with contextlib.suppress(Exception):  # the contract's failure is the one raised
                    finish_gate(in_process=False)  # the helper's answer, if it is computing one
                raise
            finish_gate()
    except StageError as exc:
        run.fail(STAGE, str(exc))
        publish_docs(run.root)
        raise
    shutil.rmtree(chunks_dir)
    run.commit(STAGE, doc["total"], timer.seconds)
    publish_docs(run.root)
    return doc


def _run_chunks(settings, tokenizer, template_probe, files, chunks_dir: Path, progress,
                workers, on_forked=lambda: None):
    """Tokenize every chunk not done yet (resume), in forked workers when there are several;
    `on_forked` runs once they all exist. Chunks are read and sent as the workers take them (a
    few per worker ahead), so the parent holds one input shard, not the dataset."""
    results: dict[int, dict[str, Any]] = {}
    total = sum(-(-pq.ParquetFile(path).metadata.num_rows // CHUNK) for path in files)
    done = {int(p.name[1:7]) for p in chunks_dir.glob("c*.done.json")}

    def todo():
        for index, conversations in _chunks(files):
            if index in done:  # resume
                results[index] = json.loads((chunks_dir / f"c{index:06d}.done.json").read_text())
            else:
                yield index, _chunk_bytes(conversations), str(chunks_dir)

    n_workers = max(1, min(workers or os.cpu_count() or 1, total - len(done)))
    with progress_bar("tokenize", total=total, enabled=progress) as bar:
        bar.advance(len(done))
        # Forked workers inherit the loaded tokenizer instead of parsing it again.
        _init_worker(tokenizer, settings, template_probe)
        if n_workers == 1:
            for item in todo():
                result = _work(item)
                results[result["index"]] = result
                bar.advance(1)
        else:
            # Frozen objects are never traversed by the collector: the workers' collections
            # skip (and do not copy-on-write) the whole inherited heap, tokenizer and all.
            gc.freeze()
            try:
                with ProcessPoolExecutor(n_workers, mp_context=mp.get_context("fork"),
                                         initializer=_one_thread_per_worker) as pool:
                    in_flight: deque[Future[dict[str, Any]]] = deque()
                    for k, item in enumerate(todo()):
                        in_flight.append(pool.submit(_work, item))
                        if k == 0:
                            on_forked()  # the first submit forked every worker
                        if len(in_flight) >= 4 * n_workers:
                            result = in_flight.popleft().result()
                            results[result["index"]] = result
                            bar.advance(1)
                    while in_flight:
                        result = in_flight.popleft().result()
                        results[result["index"]] = result
                        bar.advance(1)
            finally:
                gc.unfreeze()
    return [results[k] for k in sorted(results)]


def _finish(settings, results, partial: Path, chunks_dir: Path, vocab_size: int,
            probe_doc: dict[str, Any], fingerprint: str) -> dict[str, Any]:
    per_source: dict[str, Stats] = {}
    freq: Counter[int] = Counter()
    for result in results:
        for name, data in result["sources"].items():
            per_source.setdefault(name, Stats()).merge(Stats.from_dict(data))
        freq.update({int(k): v for k, v in result["freq"].items()})
    total = Stats()
    for stats in per_source.values():
        total.merge(stats)
    row_files = [chunks_dir / f"c{r['index']:06d}.rows.parquet" for r in results]
    q_files = [chunks_dir / f"c{r['index']:06d}.q.parquet" for r in results]
    quarantine = pa.concat_tables([pq.read_table(f, schema=QUARANTINE) for f in q_files])
    pq.write_table(quarantine, partial / "quarantine.parquet")
    if not total.extra.get("rows_written", 0):
        reasons = (total.quarantine_reasons + total.rows_filtered).most_common(4)
        raise StageError(
            f"tokenize wrote no rows from {total.rows_in} conversations; most common "
            f"reasons: {dict(reasons)}. Template strategy: {probe_doc['strategy']} "
            f"({probe_doc['reason']}). See {partial / 'quarantine.parquet'}; "
            "'needs_response' means the conversations have no reply yet (run regenerate)."
        )
    _save_dataset(row_files, partial / "dataset", fingerprint)
    draft = _save_vocab(freq, settings.draft_vocab_size, vocab_size, partial)
    # the limits the contract and the suite check against (the suite reads this file)
    write_json_atomic(partial / "settings.json",
                      {**asdict(settings), **_contract_params(vocab_size, settings)})
    doc = stats_document(per_source, "tokenize")
    doc["total"]["vocab_size"] = vocab_size
    doc["total"]["draft_vocab"] = draft
    return doc


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
                  shard_bytes: int = SHARD_BYTES) -> None:
    """A `datasets` save_to_disk directory (Arrow stream shards, dataset_info.json, state.json),
    written with pyarrow from the chunk files as they are read: one copy of the rows, and no
    `datasets` import (Dataset.from_parquet + save_to_disk wrote them twice, ~1 s of the stage's
    serial end on 20k rows)."""
    shutil.rmtree(out, ignore_errors=True)  # a failed attempt's shards
    out.mkdir(parents=True)
    schema = ROWS.with_metadata({"huggingface": json.dumps({"info": {"features": FEATURES}})})
    shards: list[Path] = []
    writer: pa.RecordBatchStreamWriter | None = None
    rows = size = in_shard = 0
    for path in row_files:
        table = pq.read_table(path, schema=ROWS).replace_schema_metadata(schema.metadata)
        if writer is None or (in_shard and in_shard + table.nbytes > shard_bytes):
            if writer is not None:
                writer.close()
            shards.append(out / f".shard-{len(shards)}.arrow")
            writer = pa.ipc.new_stream(str(shards[-1]), schema)
            in_shard = 0
        writer.write_table(table, max_chunksize=1000)  # datasets' writer batch size
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


def _save_vocab(freq: Counter[int], draft_vocab_size: int, vocab_size: int,
                out: Path) -> dict[str, Any]:
    ranked = sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))
    write_json_atomic(out / "token_freq.json", {
        "vocab_size": vocab_size, "supervised_tokens": sum(freq.values()),
        "distinct_tokens": len(freq), "frequencies": {str(t): n for t, n in ranked},
    })
    # what torch.load gives the trainers; in token order, whatever order the chunks were counted in
    save_plain_dict(dict(sorted(freq.items())), out / "token_freq.pt")
    d2t, t2d, coverage = draft_vocab(freq, draft_vocab_size, vocab_size)
    np.save(out / "d2t.npy", d2t)
    np.save(out / "t2d.npy", t2d)
    draft = {"size": int(d2t.shape[0]), "coverage": round(coverage, 6)}
    write_json_atomic(out / "draft_vocab.json", draft)
    return draft


def _contract_params(vocab_size: int, settings: TokenizeSettings) -> dict[str, Any]:
    return {"vocab_size": vocab_size, "seq_length": settings.seq_length,
            "min_supervised_tokens": settings.min_supervised_tokens}


def _validate(partial: Path, vocab_size: int, settings: TokenizeSettings) -> None:
    from dflash_etl.validation.contracts import format_failures, load_contract, validate_files

    params = _contract_params(vocab_size, settings)
    files = sorted((partial / "dataset").glob("*.arrow"))
    report = validate_files(load_contract("tokenized", params), files)
    write_json_atomic(partial / "contract.json", report)
    if not report["passed"]:
        raise ContractError("the tokenized contract failed:\n" + format_failures(report), report)


def main(argv: list[str] | None = None) -> int:
    from dflash_etl.cli.main import main as cli_main

    return cli_main(["tokenize", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    raise SystemExit(main())
