"""extract: the target model's hidden states at chosen decoder layers, for every tokenized row.

The target runs under transformers with forward hooks on its decoder layers, so any architecture
whose layers sit in one ModuleList works (dense, MoE, hybrid linear attention): nothing depends on
a serving engine's KV cache. Rows are sorted by length and cut into batches of at most
`batch_tokens` padded tokens, which keeps padding small; shards are written atomically and a
rerun skips the finished ones.

Output (runs/<name>/extract/):
  native:      hidden_states/shard-NNNNN.safetensors with `hidden_states` [tokens, layers + 1,
               hidden] and `token_ids` [tokens] (rows concatenated), plus index.parquet: id,
               turn, shard, offset, length;
  speculators: hidden_states/hs_{i}.safetensors per row with `hidden_states` [seq, layers + 1,
               hidden] and `token_ids` [seq], i the row's position in the tokenized dataset
               (the index says which file holds which row).
Both hold the chosen layers, then the last decoder layer (speculators' loader splits it off as
the verifier's final state), so either format exports to every consumer without a re-extract.
"""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_etl.core.accounting import Stats, stats_document
from dflash_etl.core.config import PipelineConfig
from dflash_etl.core.distributed import device_for_rank, rank_world
from dflash_etl.core.errors import StageError
from dflash_etl.core.outputs import HiddenStatesOutput, Output, TokenizedOutput
from dflash_etl.core.progress import progress_bar, size_text
from dflash_etl.core.rundir import PLAN_FILE, StageRecord, sha256_file, write_json_atomic
from dflash_etl.core.settings import (
    check_fleet,
    endpoint_list,
    fingerprinted,
    fleet_servers,
    fleet_setting,
    setting,
)
from dflash_etl.core.stage import (
    BatchOutput,
    BatchStage,
    ItemResults,
    Resources,
    StageContext,
    WorkItem,
    counts_line,
    state_word,
)
from dflash_etl.io.hidden_states import content_digest, drop_server_files, save_states
from dflash_etl.models.batching import (
    length_batches,
    plan_advice,
    plan_sample,
    plan_summary,
    project,
    run_batches,
    shard_cost,
    shard_plan,
    shard_tokens,
    state_bytes,
)
from dflash_etl.models.fleet import add_use, use_figures
from dflash_etl.models.identity import model_identity
from dflash_etl.models.layers import layer_state_identity, resolve_layers, target_shape
from dflash_etl.models.loading import placement
from dflash_etl.models.reply_check import check_replies, replies_origin
from dflash_etl.models.reply_check import sample as reply_sample
from dflash_etl.models.serving import aux_hidden_state_layer_ids
from dflash_etl.models.states_server import (
    SERVER_FAULTS,
    ServerTarget,
    begin_server_stage,
    reference_norms,
    take_spot_check,
)
from dflash_etl.models.target import Target
from dflash_etl.runner.settings import stage_settings
from dflash_etl.validation.contracts import read_arrow
from dflash_etl.validation.health import (
    HealthLimits,
    all_finite,
    layer_health,
    reference_diff,
    scale_problems,
    shard_problems,
    summarize,
)
from dflash_etl.validation.model_outputs import Q_NON_FINITE, Q_UNHEALTHY

STAGE = "extract"
INDEX = pa.schema([("id", pa.string()), ("turn", pa.int32()), ("row", pa.int64()),
                   ("shard", pa.string()), ("offset", pa.int64()), ("length", pa.int32()),
                   ("sha256", pa.string())])  # the row's states (io/hidden_states.py)
QUARANTINE = pa.schema([("id", pa.string()), ("turn", pa.int32()), ("reason", pa.string())])
SERVER = ("backend", ("server",))  # the settings of the server backend alone


@dataclass(frozen=True)
class ExtractSettings:
    """[extract] in pipeline.toml; CLI flags override it."""

    # its identity is fingerprinted, not its path (a moved run is not redone)
    model: str = setting("", metavar="DIR", required="the target model", target=True,
                         path=True, fingerprint=False,
                         help="the target model directory (offline; default: [target] model)")
    layers: str = setting("auto", metavar="auto|1,16,31", kept=True,
                          help="'auto' (the DFlash rule) or decoder layer indices (0-based)")
    draft_layers: int = setting(5, min=1, kept=True,
                                help="K for --layers auto (K layers from 1 to L-3)")
    dtype: str = setting("fp32", choices=("fp32", "bf16"),
                         help="the target's dtype, and the stored hidden states'")
    batch_tokens: int = setting(8192, min=1, help="padded tokens per forward pass")
    shard_rows: int = setting(256, min=1, help="rows per hidden-states shard")
    # shards are built in memory: at a 27B target's width (~60 KB a token) 256 rows of 2k
    # tokens are 31 GB; runs whose shards stay under the default keep their fingerprints
    shard_mb: int = setting(1024, min=1, fingerprint="unless_default",
                            help="the most MB of states a shard holds (tokens x stored layers "
                                 "x hidden x dtype bytes; a longer row alone): it is built in "
                                 "memory, about 2-3x this at its peak")
    device: str = setting("auto", choices=("auto", "cpu", "cuda", "cuda:N"),
                          help="where the target runs")
    # where the layers are placed does not change the states (tested): not fingerprinted
    device_map: str = setting("none", choices=("none", "auto"), fingerprint=False,
                              help="'auto': place the target's layers over the visible GPUs, "
                                   "then the CPU (accelerate; a target larger than one GPU)")
    max_memory: str = setting("", metavar="0=70GiB,1=70GiB,cpu=200GiB", fingerprint=False,
                              help="with --device-map auto: the memory each device may hold "
                                   "(default: accelerate's estimate of what is free)")
    format: str = setting("native", choices=("native", "speculators"),
                          help="the hidden states' file layout")
    # how the work is launched, not what it makes: a rerun on another number of ranks resumes
    launcher: str = setting("none", choices=("none", "torchrun"), fingerprint=False,
                            help="torchrun: re-run this command under `python -m "
                                 "torch.distributed.run --standalone` (data parallel, one node)")
    nproc_per_node: int = setting(0, min=0, fingerprint=False,
                                  applies=("launcher", ("torchrun",)),
                                  help="--launcher torchrun: processes (0: one per visible GPU, "
                                       "at least one)")
    dist_timeout_s: int = setting(1800, min=1, fingerprint=False,
                                  help="under torchrun: seconds a rank waits for the others "
                                       "before the run fails")
    # the dry run's settings, not the output's
    plan: bool = setting(False, fingerprint=False,
                         help="a dry run: measure a few batches, project the whole dataset's "
                              "bytes and hours against free disk, write "
                              "<run>/extract.plan.json; nothing is published")
    plan_batches: int = setting(4, min=1, fingerprint=False, applies=("plan", (True,)),
                                help="--plan: length-bucketed batches to measure (spread over "
                                     "the length range)")
    backend: str = setting("hooks", choices=("hooks", "server"),
                           help="hooks: the target under transformers here; server: a vLLM "
                                "server with the extract_hidden_states method (--endpoint)")
    endpoint: str = setting("", metavar="URL", fingerprint=False, applies=SERVER,
                            help="--backend server: the server's /v1 base")
    # a fleet of servers and its limits: regenerate's fleet client and declarations
    # (core/settings.py FLEET_SETTINGS); the served model defaults to the first the server lists
    endpoints: tuple[str, ...] = fleet_setting("endpoints", "--backend server", applies=SERVER)
    served_model: str | None = fleet_setting("served_model", "--backend server",
                                             fingerprint=False, applies=SERVER)
    states_dir: str = setting("", metavar="DIR", fingerprint=False, applies=SERVER,
                              help="--backend server: the connector's shared_storage_path; a "
                                   "file named elsewhere is refused")
    keep_server_files: bool = setting(False, fingerprint=False, applies=SERVER,
                                      help="--backend server: keep the server's files after "
                                           "they are copied")
    reply_check: str = setting("auto", choices=("auto", "off"), fingerprint=False,
                               help="before the work: are the replies the target's? auto: when "
                               "regenerate did not write them with this target, the target's "
                               "own greedy agreement on a sample (hooks backend), warned below "
                               "50%%")
    spot_check: str = setting("auto", choices=("auto", "on", "off"), fingerprint=False,
                              applies=SERVER, help="--backend server: one short row through the "
                              "target here against each server's states (layer ids, scale); "
                              "auto: where the target loads, else warned")
    concurrency: int = fleet_setting("concurrency", "--backend server", applies=SERVER)
    timeout_s: float = fleet_setting("timeout_s", "--backend server", applies=SERVER)
    request_deadline_s: float = fleet_setting("request_deadline_s", "--backend server",
                                              applies=SERVER)
    retries: int = fleet_setting("retries", "--backend server", applies=SERVER)
    cooldown_s: float = fleet_setting("cooldown_s", "--backend server", applies=SERVER)

    def __post_init__(self) -> None:
        """The placement and the fleet, checked before any work."""
        object.__setattr__(self, "endpoints", endpoint_list(self.endpoints))
        placement(self.device_map, self.max_memory)
        check_fleet(self.servers, self.concurrency, self.cooldown_s)

    @property
    def servers(self) -> tuple[str, ...]:
        """The hidden-states servers' URLs (/v1 bases, no trailing slash)."""
        return fleet_servers(self.endpoint, self.endpoints)


# ---------------------------------------------------------------- pure core
def stored_layers(layers: list[int], n_layers: int) -> list[int]:
    """The layers a shard holds, in order: the chosen ones, then the last decoder layer, which
    speculators' loader reads as the verifier's final hidden state (ours and SpecForge's read
    only the chosen ones): one extract, in either format, serves every trainer."""
    return [*layers, n_layers - 1]


# ---------------------------------------------------------------- shell
def _check_disk(out: Path, tokens: int, layers: int, hidden: int, dtype: str) -> int:
    """The bytes the whole output takes; fails when what is still to write (the shards an
    interrupted run wrote into `out` already count) exceeds the free space."""
    need = tokens * (state_bytes(layers, hidden, dtype) + 8)  # and the token ids
    written = sum(f.stat().st_size for f in (out / "hidden_states").glob("*.safetensors")) \
        if (out / "hidden_states").is_dir() else 0
    free = shutil.disk_usage(out).free
    if need - written > free:
        raise StageError(f"the hidden states need ~{size_text(need)} ({tokens} tokens x "
                         f"{layers} layers x {hidden} x {dtype}; {size_text(written)} of it "
                         f"written before) but {out} has {size_text(free)} free: free space, "
                         "choose fewer --layers, or use --dtype bf16")
    return need


def _write_shard(target: Target, settings: ExtractSettings, rows: list[dict[str, Any]],
                 name: str, out: Path
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int, dict[str, Any]]:
    """Extract one shard's rows; returns (index rows, quarantined rows, padded tokens run, the
    shard's health)."""
    lengths = [len(r["input_ids"]) for r in rows]
    states: list[Any] = [None] * len(rows)
    batches = length_batches(lengths, settings.batch_tokens)
    extra = (target.last_layer,)
    # the server's files already in speculators' layout are moved into the output, not copied
    move = {"movable": True} if settings.backend == "server" and settings.format == \
        "speculators" and not settings.keep_server_files else {}
    try:
        for batch in batches:
            _, got = target.forward([rows[k]["input_ids"] for k in batch], extra_layers=extra,
                                    **move)
            for k, s in zip(batch, got, strict=True):
                states[k] = s
        _stop_on_server_faults(target, states, name)
        quarantine, keep = [], []
        for k, row in enumerate(rows):
            if isinstance(states[k], str):  # the server backend: failed, or another row's
                quarantine.append({"id": row["id"], "turn": row["turn"], "reason": states[k]})
            elif not all_finite(states[k]):
                quarantine.append({"id": row["id"], "turn": row["turn"], "reason": Q_NON_FINITE})
            else:
                keep.append(k)
        health = _shard_health(target, settings, rows, batches, states, keep, extra)
        if health["problems"]:  # the whole shard: its numbers are in the marker and the error
            quarantine += [{"id": rows[k]["id"], "turn": rows[k]["turn"], "reason": Q_UNHEALTHY}
                           for k in keep]
            keep = []
        index = save_states(target.torch, settings.format, [(rows[k], states[k]) for k in keep],
                            name, out / "hidden_states")
    finally:
        drop_server_files(states)  # those not moved into the output
    return (index, quarantine, sum(max(lengths[i] for i in b) * len(b) for b in batches),
            health)


def _stop_on_server_faults(target: Any, states: list[Any], name: str) -> None:
    """Rows a server failed (none answered, another row's states, a states file missing or
    cut) are the servers' failure, not the data's: the stage stops at this shard naming the
    reasons (as train stops, and regenerate fails its stage on such rows), before it is
    written, so a rerun resumes here and asks again; quarantined, they would be lost to every
    rerun of a complete stage."""
    faults = Counter(s for s in states if isinstance(s, str) and s in SERVER_FAULTS)
    if faults:
        last = f": {target.last_problem}" if getattr(target, "last_problem", "") else ""
        raise StageError(
            f"extract: {sum(faults.values())} of {name}'s {len(states)} rows got no "
            f"states from the servers ({dict(faults)}{last}): the stage stops here, the shards "
            "done are kept; check the servers (--endpoint / --endpoints, --states-dir) and "
            "rerun to resume")


def _shard_health(target: Target, settings: ExtractSettings, rows: list[dict[str, Any]],
                  batches: list[list[int]], states: list[Any], keep: list[int],
                  extra: tuple[int, ...]) -> dict[str, Any]:
    """Per-layer health of the shard's kept states, and one batched row re-run alone (the
    shortest row of the most padded batch: where padding would leak)."""
    layers = [*target.layers, *extra]
    if not keep:
        return {"layers": [], "reference": None, "problems": []}
    layer_stats = layer_health([states[k] for k in keep], layers)
    kept = set(keep)
    padded = [b for b in batches if len(b) > 1 and all(k in kept for k in b)]
    reference = None
    if padded:
        lengths = [len(r["input_ids"]) for r in rows]
        batch = max(padded, key=lambda b: max(lengths[k] for k in b) - min(lengths[k] for k in b))
        k = min(batch, key=lambda i: (lengths[i], i))
        _, alone = target.forward([rows[k]["input_ids"]], extra_layers=extra)
        if not isinstance(alone[0], str):  # a server that failed the re-run: no reference
            reference = {"row": rows[k]["row"], **reference_diff(states[k], alone[0])}
    problems = shard_problems(layer_stats, reference, HealthLimits.for_dtype(settings.dtype))
    problems += scale_problems(layer_stats, getattr(target, "reference_norms", {}))
    return {"layers": layer_stats, "reference": reference, "problems": problems}


class ExtractStage(BatchStage):
    """Tokenized rows -> the target's hidden states at the chosen layers. A batch stage whose
    work items are the shards: in this process on the local executor (one model replica),
    one replica per actor on Ray, the ranks' token-balanced shares under torchrun; each shard's
    states file is the same whoever writes it, so every executor publishes the same output."""

    name: ClassVar[str] = STAGE
    help: ClassVar[str] = "tokenized rows -> the target's hidden states"
    Settings: ClassVar[type] = ExtractSettings
    reads: ClassVar[tuple[type[Output], ...]] = (TokenizedOutput,)
    writes: ClassVar[type[HiddenStatesOutput]] = HiddenStatesOutput
    item_unit: ClassVar[str] = "shards"
    settings: ExtractSettings

    def __init__(self) -> None:
        self.files: list[Path] = []  # the tokenized rows' Arrow files
        self.lengths: list[int] = []  # tokens per row
        self.layers: list[int] = []  # the chosen target layers
        self.n_layers = self.hidden = 0  # the target's decoder layers and hidden size
        self.partial = Path()  # where the workers write the shards
        self.generated_with: dict[str, Any] | None = None  # how regenerate made the replies
        self.identity = ""  # the target's model_identity
        self.replies: dict[str, Any] | None = None  # the reply check's record

    def prepare(self, ctx: StageContext) -> dict[str, Any]:
        settings = self.settings
        tokenized = ctx.read(TokenizedOutput)
        self.files = tokenized.dataset_files()
        self.generated_with = (tokenized.stats().get("on_policy") or {}).get("generated_with")
        self.lengths = pa.concat_tables([read_arrow(f).select(["input_ids"]) for f in self.files]
                                        ).column("input_ids").combine_chunks().value_lengths(
                                        ).to_pylist()
        self.layers = resolve_layers(settings.layers, settings.model, settings.draft_layers)
        self.n_layers, self.hidden = target_shape(settings.model)
        self.identity = model_identity(settings.model)
        return {"settings": fingerprinted(settings), "layers": self.layers,
                "inputs": [sha256_file(f) for f in self.files], "model": self.identity,
                **layer_state_identity(self.layers, self.n_layers)}

    def begin(self, ctx: StageContext) -> None:
        settings = self.settings
        stored = stored_layers(self.layers, self.n_layers)
        need = _check_disk(ctx.partial, sum(self.lengths), len(stored), self.hidden,
                           settings.dtype)
        ctx.run.update_stage(STAGE, settings=asdict(settings), layers=self.layers,
                             stored_layers=stored, n_layers=self.n_layers, estimated_bytes=need,
                             ranks=ctx.world)
        if settings.reply_check != "off":
            origin = replies_origin(self.generated_with, self.identity)
            measure = origin != "target" and settings.backend != "server"  # loads the target
            rows = pa.concat_tables([read_arrow(f).select(["input_ids", "loss_mask"])
                                     for f in self.files]).take(pa.array(
                reply_sample(self.lengths), pa.int64())).to_pylist() if measure else []
            self.replies = check_replies(
                rows, origin, spec=replace(settings, device=device_for_rank(settings.device)))
        if settings.backend == "server":
            first = next(c for f in self.files if len(c := read_arrow(f).column("input_ids")))
            begin_server_stage(settings, self.layers, self.n_layers, self.hidden,
                               first[0].as_py(), ctx.partial)

    def plan(self, ctx: StageContext) -> list[WorkItem]:
        """One item per shard, its cost the padded tokens of its forward passes."""
        self.partial = ctx.partial
        lengths, s = self.lengths, self.settings
        most = shard_tokens(s.shard_mb, len(stored_layers(self.layers, self.n_layers)),
                            self.hidden, s.dtype)
        return [WorkItem(n, members, cost=shard_cost([lengths[i] for i in members],
                                                     s.batch_tokens))
                for n, members in enumerate(shard_plan(lengths, s.shard_rows, most))]

    def resources(self) -> Resources:
        """A worker holds one replica of the target: a GPU where it runs on one (with
        --device-map auto, the GPUs its worker sees), and one worker process per machine."""
        device = self.settings.device
        on_gpu = device.startswith("cuda") or (device == "auto" and _cuda_available())
        return Resources(cpus=1, gpus=1 if on_gpu else 0, local_workers=1)

    def setup(self) -> None:
        # loaded only where there is work: a big target takes minutes
        if self.settings.backend == "server":
            self.target: Any = ServerTarget(self.settings, self.layers, self.n_layers,
                                            self.hidden)
            self.target.reference_norms = reference_norms(self.partial)
        else:
            self.target = Target(replace(self.settings,
                                         device=device_for_rank(self.settings.device)))
        self.dataset = pa.concat_tables([read_arrow(f).select(["input_ids", "id", "source",
                                                               "turn"]) for f in self.files])

    def load(self, item: WorkItem) -> list[dict[str, Any]]:
        rows = self.dataset.take(pa.array(item.payload, pa.int64())).to_pylist()
        for position, row in zip(item.payload, rows, strict=True):
            row["row"] = position
        return rows

    def process_batch(self, batch: list[dict[str, Any]], item: WorkItem) -> BatchOutput:
        """One shard: its states file (written here, renamed into place whole), and its index
        rows, quarantined rows, accounting, padded tokens and health for `finish`."""
        index, quarantined, padded, health = _write_shard(
            self.target, self.settings, batch, f"shard-{item.index:05d}", self.partial)
        bad = {(q["id"], q["turn"]): q["reason"] for q in quarantined}
        per_source: dict[str, Stats] = {}
        for row in batch:
            stats = per_source.setdefault(row["source"], Stats(extra={"tokens": 0}))
            stats.rows_in += 1
            if (row["id"], row["turn"]) in bad:
                stats.quarantine(bad[row["id"], row["turn"]])
            else:
                stats.rows_out += 1
                stats.extra["tokens"] += len(row["input_ids"])
        fleet = getattr(self.target, "fleet", None)  # the server backend's: its load, per shard
        return BatchOutput(rows=pa.Table.from_pylist(index, schema=INDEX),
                           quarantine=pa.Table.from_pylist(quarantined, schema=QUARANTINE),
                           stats=per_source, extra={"padded": padded, "health": health,
                                                    "servers": fleet.take_use() if fleet else {}})

    def finish(self, ctx: StageContext, results: ItemResults) -> dict[str, Any]:
        """Every shard's result, in shard order whichever worker wrote it: one index (by row,
        as one process writes it), the accounting and the health figures."""
        settings = self.settings
        index = [e for path in results.row_files() for e in pq.read_table(path).to_pylist()]
        pq.write_table(pa.Table.from_pylist(sorted(index, key=lambda e: e["row"]), schema=INDEX),
                       ctx.partial / "index.parquet")
        layers, n_layers = self.layers, self.n_layers
        stored = stored_layers(layers, n_layers)
        doc = stats_document(results.per_source(), STAGE)
        padded = sum(r["padded"] for r in results)
        tokens = sum(self.lengths)
        doc["total"].update({"layers": layers, "stored_layers": stored,
                             # the same layers in both conventions (README: which ids go where)
                             "target_layer_ids": layers,
                             "aux_hidden_state_layer_ids": aux_hidden_state_layer_ids(layers),
                             "n_layers": n_layers, "hidden_size": self.hidden,
                             "dtype": settings.dtype, "format": settings.format,
                             "padding_share": round(1 - tokens / padded, 4) if padded else 0.0})
        if all(e.get("sha256") for e in index):  # not when resumed over an older version's
            shape = {k: doc["total"][k] for k in ("stored_layers", "hidden_size", "dtype")}
            doc["total"]["content_sha256"] = content_digest(
                index, {**shape, **layer_state_identity(layers, n_layers)})
        doc["health"] = _health_document(results, settings.dtype)
        if self.replies:
            doc["replies"] = self.replies
            doc["warnings"] = [w for w in [self.replies.get("warning")] if w]
        if settings.backend == "server":  # the fleet's load and check: a run's record, not data
            ctx.call_totals["servers"] = _server_load(results)
            ctx.call_totals["server_check"] = take_spot_check(ctx.partial)
        return doc

    def contract_params(self, ctx: StageContext) -> dict[str, Any]:
        """The tokenized rows the stored token ids must equal."""
        return {"dataset": self.files}

    def cleanup(self, ctx: StageContext) -> None:
        super().cleanup(ctx)
        shutil.rmtree(ctx.partial / "shards", ignore_errors=True)  # an older version's markers

    @classmethod
    def dry_run(cls, ctx: StageContext, overrides: dict[str, Any]) -> dict[str, Any] | None:
        """`plan` set: the dry run's plan (see `plan`) instead of the stage."""
        if not _wants_plan(ctx.config, overrides):
            return None
        if rank_world()[0] != 0:  # started under torchrun anyway: rank 0 plans, for one replica
            return {}
        return plan(ctx, overrides)

    @classmethod
    def summary(cls, doc: dict[str, Any], record: StageRecord, out: Path) -> list[str]:
        if doc.get("plan"):
            return plan_summary(doc, out.parent)
        total = doc["total"]
        lines = [f"extract {state_word(doc)}: rows {counts_line(total)}",
                 f"  layers {total.get('layers')} of {total.get('n_layers')}, hidden "
                 f"{total.get('hidden_size')}, {total.get('dtype')}, {total.get('tokens')} "
                 f"tokens, padding {total.get('padding_share')}",
                 f"  hidden states: {out / 'hidden_states'}  ({total.get('format')})",
                 f"  index:         {out / 'index.parquet'}"]
        ranks = record.get("ranks") or 1  # the manifest's record: stats.json is the data's
        if ranks > 1 and not doc.get("skipped"):
            lines.append(f"  ranks:         {ranks} (torchrun; the output is one process's, "
                         "byte for byte)")
        return [*lines, *(f"  WARNING: {warning}" for warning in doc.get("warnings", []))]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _server_load(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per server URL over the shards (this call's and those it resumed from): requests, served,
    failed, mean requests in flight while the client had any outstanding, busy share."""
    totals: dict[str, dict[str, Any]] = {}
    for result in results:
        add_use(totals, result.get("servers") or {})
    return use_figures(totals)


def _health_document(results: list[dict[str, Any]], dtype: str) -> dict[str, Any]:
    """The shards' health, summed up: per-layer figures, the reference re-runs, the problems."""
    references = [r["health"]["reference"] for r in results if r["health"]["reference"]]
    return {"layers": summarize([r["health"]["layers"] for r in results]),
            "limits": asdict(HealthLimits.for_dtype(dtype)), "reference_rows": len(references),
            "reference_max_rel": max((r["max_rel"] for r in references), default=None),
            "problems": [f"shard-{r['index']:05d}: {p}" for r in results
                         for p in r["health"]["problems"]]}


# ---------------------------------------------------------------- the dry run (--plan)
def plan(ctx: StageContext, overrides: dict[str, Any]) -> dict[str, Any]:
    """`extract --plan`: measure `plan_batches` batches of the real run (same target, layers,
    dtype, format, writer and health check) in a scratch directory, project the whole dataset,
    write <run>/extract.plan.json. The extract stage is neither run, published nor recorded."""
    import time

    from dflash_etl.core.lock import run_lock

    run, progress = ctx.run, ctx.progress
    with run_lock(run.root, "extract --plan"):
        settings = stage_settings(ExtractStage, ctx.config, run.root, overrides)
        files = ctx.read(TokenizedOutput).dataset_files()
        rows = pa.concat_tables([read_arrow(f).select(["input_ids", "id", "source", "turn"])
                                 for f in files]).to_pylist()
        for position, row in enumerate(rows):
            row["row"] = position
        if not rows:
            raise StageError(f"the tokenized dataset of {run.root} has no rows: nothing to plan")
        lengths = [len(r["input_ids"]) for r in rows]
        layers = resolve_layers(settings.layers, settings.model, settings.draft_layers)
        n_layers, hidden = target_shape(settings.model)
        batches = run_batches(lengths, settings.shard_rows, settings.batch_tokens,
                              shard_tokens(settings.shard_mb, len(stored_layers(layers, n_layers)),
                                           hidden, settings.dtype))
        padded = [max(lengths[i] for i in b) * len(b) for b in batches]
        free = shutil.disk_usage(run.root).free  # before the sample takes any of it
        loading = time.perf_counter()
        target = _plan_target(settings, layers, n_layers, hidden)
        load_seconds = time.perf_counter() - loading
        stored = stored_layers(target.layers, target.n_layers)
        picks = plan_sample(batches, settings.plan_batches)
        scratch = run.root / ".extract-plan.tmp"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        try:
            first = min(batches[picks[0]], key=lambda i: lengths[i])
            target.forward([rows[first]["input_ids"]])  # warm-up, not timed
            seconds = 0.0
            with progress_bar("extract --plan", total=len(picks), enabled=progress) as bar:
                for n, b in enumerate(picks):
                    start = time.perf_counter()
                    _write_shard(target, settings, [rows[i] for i in batches[b]],
                                 f"plan-{n:05d}", scratch)
                    seconds += time.perf_counter() - start
                    bar.advance(1)
            written = sum(f.stat().st_size for f in (scratch / "hidden_states").iterdir())
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        sample = {"batches": len(picks), "rows": sum(len(batches[b]) for b in picks),
                  "tokens": sum(lengths[i] for b in picks for i in batches[b]),
                  "padded_tokens": sum(padded[b] for b in picks), "seconds": round(seconds, 3),
                  "bytes": written, "load_seconds": round(load_seconds, 3)}
        sample["tokens_per_s"] = round(sample["tokens"] / seconds, 1) if seconds else None
        total = {"rows": len(rows), "tokens": sum(lengths), "batches": len(batches),
                 "padded_tokens": sum(padded)}
        doc = {"plan": True, "run": str(run.root), "model": settings.model,
               "device": str(target.device), "layers": target.layers, "stored_layers": stored,
               "n_layers": target.n_layers, "hidden_size": target.hidden,
               "dtype": settings.dtype, "format": settings.format, "dataset": total,
               "padding_share": round(1 - total["tokens"] / total["padded_tokens"], 4)
               if total["padded_tokens"] else 0.0,
               "measured": sample, "projected": project(total, sample, free),
               "disk_path": str(run.root.resolve())}
        doc["advice"] = plan_advice(doc)
        write_json_atomic(run.root / PLAN_FILE, doc)
        return doc


def _plan_target(settings: ExtractSettings, layers: list[int], n_layers: int,
                 hidden: int) -> Any:
    """What `--plan` measures with: the target here, or (--backend server) the servers through
    the client the stage uses, with the target's layers and shape from its config."""
    if settings.backend != "server":
        return Target(settings)
    return ServerTarget(settings, layers, n_layers, hidden)


def _wants_plan(config: PipelineConfig | None, overrides: dict[str, Any]) -> bool:
    if overrides.get("plan") is not None:
        return bool(overrides["plan"])
    return bool(config and config.section("extract").get("plan"))
