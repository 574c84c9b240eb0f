"""The kinds of stage output, and what a published one tells the stages and the export after it,
read from the files the stage already writes: one typed description per kind, so no reader keeps
its own default for an upstream setting or guesses a path. A stage declares the kind it writes and
the kinds it reads (core/stage.py); the kind names its contract, its suite and the file that marks
it. A missing field is an error that names the file and the stage to rerun: a default here would
train or export with a value the data was not made with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from dflash_etl.core.errors import StageError


def _rerun(path: Path, stage: str) -> str:
    return f"rerun `dflash-etl {stage} --run {path.parent.parent} --force`"


def _stats(stage_dir: Path) -> dict[str, Any]:
    """A stage directory's stats.json, {} when unreadable."""
    try:
        doc = json.loads((stage_dir / "stats.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _load(path: Path, stage: str) -> dict[str, Any]:
    """The JSON object in `path`; raises a StageError naming it and the stage to rerun."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StageError(f"{path} is missing or unreadable ({exc}): {_rerun(path, stage)}"
                         ) from exc


def _fields(doc: Any, keys: tuple[str, ...], path: Path, stage: str) -> dict[str, Any]:
    """`keys` of `doc` (read from `path`); raises a StageError naming the missing ones."""
    missing = [k for k in keys if not isinstance(doc, dict) or k not in doc]
    if missing:
        raise StageError(f"{path} has no {', '.join(missing)} (written by an older or failed "
                         f"{stage}): {_rerun(path, stage)}")
    return {k: doc[k] for k in keys}


def rendered_template_kwargs(stats: dict[str, Any]) -> dict[str, Any]:
    """The chat-template kwargs most of tokenize's rows were rendered with: regenerate's
    thinking mode where the on-policy check recorded one, else each variant the template needed
    for most rows (Qwen3's `enable_thinking=False`, counted per row as "name=value")."""
    served = ((stats.get("on_policy") or {}).get("serve_with") or {}).get(
        "chat_template_kwargs")
    if served:
        return dict(served)
    total = stats.get("total") or {}
    rows = int(total.get("rows_written") or 0)
    kwargs: dict[str, Any] = {}
    for variant, n in (total.get("generation_prompt_kwargs") or {}).items():
        if 2 * int(n) > rows:
            for pair in variant.split(","):
                name, _, value = pair.partition("=")
                kwargs[name] = {"True": True, "False": False, "None": None}.get(value, value)
    return kwargs


class Output:
    """A kind of stage output. `contract`: what its gate validates it with (a file in contracts/,
    or validation/model_outputs.py for hidden states and a drafter); `suite`: its
    great-expectations suite in expectations/ (None: none); `marker`: the path below a stage's
    directory that holds it (a folder of shards, or a file), by which `check` recognises it."""

    kind: ClassVar[str]
    contract: ClassVar[str]
    suite: ClassVar[str | None] = None
    marker: ClassVar[str]
    stage_dir: Path

    @classmethod
    def found_in(cls, stage_dir: Path) -> bool:
        return (Path(stage_dir) / cls.marker).exists()


@dataclass(frozen=True)
class ConversationsOutput(Output):
    """ingest/, regenerate/ (any stage that writes conversations): the canonical conversations
    as Parquet shards in conversations/, and its stats.json."""

    kind: ClassVar[str] = "conversations"
    contract: ClassVar[str] = "conversations"
    suite: ClassVar[str | None] = "conversations"
    marker: ClassVar[str] = "conversations"
    stage_dir: Path

    @property
    def stage(self) -> str:
        return self.stage_dir.name

    def files(self) -> list[Path]:
        """The shards, in order; none is an error naming the stage to run."""
        files = sorted((self.stage_dir / self.marker).glob("*.parquet"))
        if not files:
            raise StageError(f"no conversations in {self.stage_dir / self.marker}: run "
                             f"`dflash-etl {self.stage}` for this run first")
        return files

    def stats(self) -> dict[str, Any]:
        """Its stats.json ({} when unreadable: an output published before it was written)."""
        return _stats(self.stage_dir)

    @classmethod
    def read(cls, stage_dir: Path) -> ConversationsOutput:
        return cls(stage_dir=Path(stage_dir))


@dataclass(frozen=True)
class TokenizedOutput(Output):
    """tokenize/: the limits its rows were made with (settings.json) and its draft vocabulary
    (draft_vocab.json), which extract, train, the suite and the export read."""

    kind: ClassVar[str] = "tokenized"
    contract: ClassVar[str] = "tokenized"
    suite: ClassVar[str | None] = "tokenized"
    marker: ClassVar[str] = "dataset"
    stage_dir: Path
    seq_length: int
    min_supervised_tokens: int
    vocab_size: int
    draft_vocab_size: int
    d2t_file: Path
    t2d_file: Path
    t2d_length: int
    # the mask's markers (stages/tokenize.mask_markers); empty in an output made before them
    end_of_turn_ids: tuple[int, ...] = ()
    turn_start_ids: tuple[int, ...] = ()

    @property
    def dataset_dir(self) -> Path:
        """The rows, a `datasets` save_to_disk directory."""
        return self.stage_dir / "dataset"

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """The chat-template kwargs the rows' generation prompts were rendered with (its
        stats.json): what a server must be started with to serve what the drafter learned."""
        return rendered_template_kwargs(_load(self.stage_dir / "stats.json", "tokenize"))

    def stats(self) -> dict[str, Any]:
        """Its stats.json ({} when unreadable); the on-policy report is in it."""
        return _stats(self.stage_dir)

    def dataset_files(self) -> list[Path]:
        """The rows' Arrow files, in order (what extract and train read)."""
        return TokenizedOutput.files_in(self.stage_dir)

    @staticmethod
    def files_in(stage_dir: Path) -> list[Path]:
        """The Arrow files of the tokenized rows in the stage directory `stage_dir`; none is an
        error naming the stage to rerun."""
        dataset = Path(stage_dir) / TokenizedOutput.marker
        files = sorted(dataset.glob("*.arrow"))
        if not files:
            raise StageError(f"no tokenized dataset in {dataset}: {_rerun(dataset, 'tokenize')}")
        return files

    def contract_params(self) -> dict[str, int]:
        """The limits the tokenized contract and suite check the rows against."""
        return {"vocab_size": self.vocab_size, "seq_length": self.seq_length,
                "min_supervised_tokens": self.min_supervised_tokens}

    @classmethod
    def read(cls, stage_dir: Path) -> TokenizedOutput:
        stage_dir = Path(stage_dir)
        settings, vocab = stage_dir / "settings.json", stage_dir / "draft_vocab.json"
        recorded = _load(settings, "tokenize")
        limits = _fields(recorded, ("seq_length", "min_supervised_tokens", "vocab_size"),
                         settings, "tokenize")
        draft = _fields(_load(vocab, "tokenize"), ("size", "d2t", "t2d", "t2d_length"), vocab,
                        "tokenize")
        return cls(stage_dir=stage_dir, seq_length=int(limits["seq_length"]),
                   min_supervised_tokens=int(limits["min_supervised_tokens"]),
                   vocab_size=int(limits["vocab_size"]), draft_vocab_size=int(draft["size"]),
                   d2t_file=stage_dir / draft["d2t"], t2d_file=stage_dir / draft["t2d"],
                   t2d_length=int(draft["t2d_length"]),
                   end_of_turn_ids=tuple(recorded.get("end_of_turn_ids") or ()),
                   turn_start_ids=tuple(recorded.get("turn_start_ids") or ()))


@dataclass(frozen=True)
class HiddenStatesOutput(Output):
    """extract/: which target layers its states hold and how they are stored (stats.json)."""

    kind: ClassVar[str] = "hidden_states"
    contract: ClassVar[str] = "hidden_states"
    marker: ClassVar[str] = "index.parquet"
    stage_dir: Path
    layers: list[int]
    stored_layers: list[int]
    n_layers: int
    hidden_size: int
    format: str
    dtype: str
    quarantine_reasons: dict[str, int]

    @property
    def index_file(self) -> Path:
        """row -> shard, offset, length (the native format)."""
        return self.stage_dir / "index.parquet"

    @classmethod
    def read(cls, stage_dir: Path) -> HiddenStatesOutput:
        stage_dir = Path(stage_dir)
        stats = stage_dir / "stats.json"
        total = _fields(_load(stats, "extract").get("total"),
                        ("layers", "stored_layers", "n_layers", "hidden_size", "format", "dtype",
                         "quarantine_reasons"), stats, "extract")
        return cls(stage_dir=stage_dir, layers=list(total["layers"]),
                   stored_layers=list(total["stored_layers"]), n_layers=int(total["n_layers"]),
                   hidden_size=int(total["hidden_size"]), format=str(total["format"]),
                   dtype=str(total["dtype"]),
                   quarantine_reasons=dict(total["quarantine_reasons"]))


@dataclass(frozen=True)
class DrafterOutput(Output):
    """train/: the drafter it trained (drafter/config.json), as the export and vLLM take it."""

    kind: ClassVar[str] = "drafter"
    contract: ClassVar[str] = "drafter"
    marker: ClassVar[str] = "drafter/config.json"
    stage_dir: Path
    config: dict[str, Any]
    block_size: int
    draft_layers: int
    mask_token_id: int
    target_layer_ids: list[int]
    loss_decay_gamma: float

    @property
    def drafter_dir(self) -> Path:
        return self.stage_dir / "drafter"

    @classmethod
    def read(cls, stage_dir: Path) -> DrafterOutput:
        stage_dir = Path(stage_dir)
        path = stage_dir / "drafter" / "config.json"
        config = _load(path, "train")
        dflash = _fields(config.get("dflash_config"),
                         ("block_size", "mask_token_id", "target_layer_ids"), path, "train")
        shape = _fields(config, ("num_hidden_layers", "loss_decay_gamma"), path, "train")
        return cls(stage_dir=stage_dir, config=config,
                   block_size=int(dflash["block_size"]),
                   draft_layers=int(shape["num_hidden_layers"]),
                   mask_token_id=int(dflash["mask_token_id"]),
                   target_layer_ids=list(dflash["target_layer_ids"]),
                   loss_decay_gamma=float(shape["loss_decay_gamma"]))


# every kind of output, in the order `check` looks for them in a directory
OUTPUTS: tuple[type[Output], ...] = (DrafterOutput, HiddenStatesOutput, TokenizedOutput,
                                     ConversationsOutput)
