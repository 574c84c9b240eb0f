"""Write a plain Python dict as `torch.save` does, without importing torch.

The trainers read `token_freq.pt` with `torch.load`; importing torch only to write a dict of
ints costs one to two minutes per process on a small machine. A dict without tensors is, in
torch's zip format, a protocol-2 pickle plus five small records, so it is written here directly.
Checked with torch 2.13.0: `torch.load` returns the dict with weights_only=True (the default),
weights_only=False and mmap=True.

The file is byte-identical for equal dicts: every record carries the same fixed date (torch's own
writer stores none, i.e. DOS time 0; zipfile would store the current time), so two runs of the
same data give the same `token_freq.pt`.
"""

from __future__ import annotations

import hashlib
import pickle
import zipfile
from pathlib import Path
from typing import Any

# torch.serialization's record names and values for a file with no tensor storages
# (torch 2.x: format version 1, 64-byte storage alignment, archive version 3).
_RECORDS = {
    ".format_version": b"1",
    ".storage_alignment": b"64",
    "byteorder": b"little",
    "version": b"3\n",
}
# zipfile's earliest valid date; a fixed one keeps the bytes independent of when they are written
_DATE_TIME = (1980, 1, 1, 0, 0, 0)


def _record(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_DATE_TIME)
    info.compress_type = zipfile.ZIP_STORED
    info.create_system = 3  # unix, on every platform (zipfile says 0 on Windows)
    info.external_attr = 0o600 << 16  # what writestr gives a name; a ZipInfo gets 0
    return info


def save_plain_dict(mapping: dict[Any, Any], path: Path) -> None:
    """Save `mapping` (ints, floats, strings, lists, dicts only) so `torch.load(path)` returns it,
    including with torch's default `weights_only=True`."""
    path = Path(path)
    data = pickle.dumps(mapping, protocol=2)
    archive = path.stem or "archive"  # torch names the folder inside after the file
    serialization_id = str(int(hashlib.sha1(data).hexdigest(), 16))[:40].rjust(40, "0")
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(_record(f"{archive}/data.pkl"), data)
        for name, value in _RECORDS.items():
            zf.writestr(_record(f"{archive}/{name}"), value)
        zf.writestr(_record(f"{archive}/.data/serialization_id"), serialization_id.encode())
    tmp.replace(path)
