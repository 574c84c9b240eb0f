"""tokenize's rows as a `datasets` save_to_disk directory (Arrow stream shards,
dataset_info.json, state.json), the layout speculators' and SpecForge's trainers load, written
with pyarrow alone: one copy of the rows and no `datasets` import in the stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash_etl.core.rundir import write_json_atomic
from dflash_etl.core.schema import TOKENIZED_ROWS, flat_values
from dflash_etl.core.stage import read_item_file

# datasets' Features of TOKENIZED_ROWS, as save_to_disk records them (dataset_info.json and the
# Arrow schema's "huggingface" metadata)
FEATURES = {
    "input_ids": {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "List"},
    "loss_mask": {"feature": {"dtype": "int8", "_type": "Value"}, "_type": "List"},
    "seq_len": {"dtype": "int32", "_type": "Value"},
    "id": {"dtype": "string", "_type": "Value"},
    "source": {"dtype": "string", "_type": "Value"},
    "turn": {"dtype": "int32", "_type": "Value"},
}
SHARD_BYTES = 500 * 2**20  # datasets' own default max_shard_size for save_to_disk


def save_dataset(row_files: list[Path], out: Path, fingerprint: str,
                 shard_bytes: int = SHARD_BYTES, drop: pa.Array | None = None) -> np.ndarray:
    """A `datasets` save_to_disk directory (Arrow stream shards, dataset_info.json, state.json),
    written with pyarrow from the chunk files as they are read: one copy of the rows, and no
    `datasets` import (Dataset.from_parquet + save_to_disk wrote them twice, ~1 s of the stage's
    serial end on 20k rows). Returns how often each token id is supervised, counted on the way."""
    shutil.rmtree(out, ignore_errors=True)  # a failed attempt's shards
    out.mkdir(parents=True)
    schema = TOKENIZED_ROWS.with_metadata(
        {"huggingface": json.dumps({"info": {"features": FEATURES}})})
    shards: list[Path] = []
    writer: pa.RecordBatchStreamWriter | None = None
    rows = size = in_shard = 0
    counts = np.zeros(0, np.int64)
    for path in row_files:
        table = read_item_file(path, TOKENIZED_ROWS).replace_schema_metadata(schema.metadata)
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
        counts = add_counts(counts, np.bincount(ids[supervised]))
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


def add_counts(total: np.ndarray, more: np.ndarray) -> np.ndarray:
    if len(more) > len(total):
        total, more = more.astype(np.int64), total
    total[: len(more)] += more
    return total
