"""Where a training batch's hidden states come from: the extract stage's files, or the target
itself for each batch (online)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any


class ExtractedStates:
    """Hidden states the extract stage wrote (either format), per tokenized row."""

    def __init__(self, extract_dir: Path, n_layers: int, index: list[dict[str, Any]]) -> None:
        from safetensors import safe_open

        self.dir = extract_dir / "hidden_states"
        self.where = {e["row"]: e for e in index}
        self.n_layers = n_layers
        self._open = safe_open
        self.handles: dict[str, Any] = {}
        self.files = contextlib.ExitStack()

    def __call__(self, rows: list[dict[str, Any]]) -> list[Any]:
        out = []
        for row in rows:
            entry = self.where[row["row"]]
            if entry["shard"] not in self.handles:
                self.handles[entry["shard"]] = self.files.enter_context(
                    self._open(str(self.dir / entry["shard"]), "pt"))
            a = entry["offset"]
            states = self.handles[entry["shard"]].get_slice("hidden_states")[a:a + entry["length"]]
            out.append(states[:, :self.n_layers])  # speculators' files append the last layer
        return out

    def close(self) -> None:
        self.files.close()


class OnlineStates:
    """Hidden states computed from the target for each batch (no extract output needed)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __call__(self, rows: list[dict[str, Any]]) -> list[Any]:
        return self.target.states([list(r["input_ids"]) for r in rows])

    def close(self) -> None:
        return None
