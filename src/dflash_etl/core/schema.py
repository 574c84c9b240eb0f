"""Arrow schemas of the stage outputs and the reason codes rows are counted under.

The canonical conversation is the contract between ingest and every later stage, so it lives in
one place and is kept stable.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

ROLES = ("system", "user", "assistant", "tool")

MESSAGE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("reasoning", pa.string()),
        # JSON text: [{"id"?, "type": "function", "function": {"name", "arguments": {...}}}]
        ("tool_calls", pa.string()),
        ("tool_call_id", pa.string()),
        ("name", pa.string()),
    ]
)

CONVERSATIONS = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("format", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("tools", pa.string()),
        ("needs_response", pa.bool_()),
        ("tool_arguments", pa.string()),  # how the source wrote tool-call arguments
        ("file", pa.string()),
        ("line", pa.int64()),
    ]
)

# One training row of the tokenize output (a datasets save_to_disk directory).
TOKENIZED_ROWS = pa.schema(
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
    [
        ("source", pa.string()),
        ("file", pa.string()),
        ("line", pa.int64()),
        ("reason", pa.string()),
        ("message", pa.string()),
        ("raw", pa.string()),  # the original text (lossy-escaped when the bytes are not UTF-8)
        ("raw_bytes", pa.binary()),  # the exact original bytes, only when they are not UTF-8
    ]
)

# Quarantine reason codes (a row that is wrong and must be looked at).
Q_INVALID_UTF8 = "invalid_utf8"
Q_MALFORMED_JSON = "malformed_json"
Q_NOT_AN_OBJECT = "not_an_object"
Q_LINE_TOO_LONG = "line_too_long"
Q_UNKNOWN_FORMAT = "unknown_format"
Q_FORMAT_MISMATCH = "format_mismatch"
Q_WRONG_TYPE = "wrong_type"
Q_MISSING_FIELD = "missing_field"
Q_UNKNOWN_ROLE = "unknown_role"
Q_EMPTY_CONVERSATION = "empty_conversation"
Q_EMPTY_CONTENT = "empty_content"
Q_ROLE_ORDER = "role_order"
Q_BAD_TOOL_CALL = "bad_tool_call"
Q_BAD_TOOLS = "bad_tools"
Q_UNPARSEABLE_CHAT = "unparseable_chat"
Q_UNREADABLE_FILE = "unreadable_file"  # a file-level row: the rest of the file cannot be read
Q_DECOMPRESSED_TOO_LARGE = "decompressed_too_large"  # a file-level row: past the ceiling

# Filter reasons (a row that is fine but deliberately not kept).
F_BLANK_LINE = "blank_line"
F_DUPLICATE = "duplicate"
F_MAX_ROWS = "max_rows"
F_MIX_WEIGHT = "mix_weight"
F_NEAR_DUPLICATE = "near_duplicate"  # [ingest] near_dedup: like an earlier row
F_CONTAMINATED = "benchmark_contamination"  # holds a benchmark item ([ingest] decontaminate)
F_PLACEHOLDER = "placeholder_reply"  # a short reply given to many prompts (mix/placeholders.py)

# Conversations per Parquet row group in the conversations shards: a downstream work item reads
# only the row group its rows are in.
ROW_GROUP_ROWS = 1024


def numeric_array(values: np.ndarray) -> pa.Array:
    """A numeric Arrow array over a 1-D numpy array's memory. `pa.array` would do, but on its
    first call it imports pandas to test for a Series (~1 s of CPU in every worker process)."""
    values = np.ascontiguousarray(values)
    if values.dtype == np.bool_:  # Arrow packs booleans into bits
        return pa.Array.from_buffers(pa.bool_(), len(values), [
            None, pa.py_buffer(np.packbits(values, bitorder="little"))])
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values),
                                 [None, pa.py_buffer(values)])


def flat_values(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A list column's values (no nulls) as one numpy array, read from the Arrow buffers:
    `to_numpy` would do, but it imports pandas (~0.5 s of a stage's single-core finish)."""
    import pyarrow.compute as pc

    flat = pc.list_flatten(column)
    if not (pa.types.is_integer(flat.type) or pa.types.is_floating(flat.type)):
        return flat.to_numpy()  # booleans are bits, strings are not one buffer
    chunks = flat.chunks if isinstance(flat, pa.ChunkedArray) else [flat]
    dtype = flat.type.to_pandas_dtype()
    parts = []
    for chunk in chunks:
        if chunk.null_count:
            raise ValueError("flat_values: the list column holds nulls")
        if len(chunk):
            parts.append(np.frombuffer(chunk.buffers()[1], dtype=dtype,
                                       count=chunk.offset + len(chunk))[chunk.offset:])
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def list_lengths(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Each row's list length, from the offsets alone: the values are never read (a 1M-row
    token column combined to count them took 840 MB)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    parts = []
    for chunk in chunks:
        width = np.int64 if pa.types.is_large_list(chunk.type) else np.int32
        offsets = np.frombuffer(chunk.buffers()[1], dtype=width,
                                count=chunk.offset + len(chunk) + 1)[chunk.offset:]
        parts.append(np.diff(offsets).astype(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def string_array(values: list[str]) -> pa.Array:
    """A string Arrow array of non-null `values`, without `pa.array`'s pandas import."""
    encoded = [value.encode() for value in values]
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=offsets[1:])
    small = offsets[-1] < 2**31
    return pa.Array.from_buffers(
        pa.string() if small else pa.large_string(), len(encoded),
        [None, pa.py_buffer(offsets.astype(np.int32) if small else offsets),
         pa.py_buffer(b"".join(encoded))]).cast(pa.string())
