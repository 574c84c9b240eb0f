"""Write a plain Python dict as `torch.save` does, without importing torch.

The trainers read `token_freq.pt` with `torch.load`; importing torch only to write a dict of
ints costs one to two minutes per process on a small machine. A dict without tensors is, in
torch's zip format, a protocol-2 pickle plus five small records, so it is written here directly.
Checked with torch 2.13.0: `torch.load` returns the dict with weights_only=True (the default),
weights_only=False and mmap=True.
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


def save_plain_dict(mapping: dict[Any, Any], path: Path) -> None:
    """Save `mapping` (ints, floats, strings, lists, dicts only) so `torch.load(path)` returns it,
    including with torch's default `weights_only=True`."""
    path = Path(path)
    data = pickle.dumps(mapping, protocol=2)
    archive = path.stem or "archive"  # torch names the folder inside after the file
    serialization_id = str(int(hashlib.sha1(data).hexdigest(), 16))[:40].rjust(40, "0")
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{archive}/data.pkl", data)
        for name, value in _RECORDS.items():
            zf.writestr(f"{archive}/{name}", value)
        zf.writestr(f"{archive}/.data/serialization_id", serialization_id.encode())
    tmp.replace(path)
