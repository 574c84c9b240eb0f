"""Where a training batch's hidden states come from: the extract stage's files, or the target
itself for each batch (online)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError
from dflash_etl.models.states_server import Q_SERVER_FAILED


class ExtractedStates:
    """Hidden states the extract stage wrote (either format), per tokenized row."""

    def __init__(self, extract_dir: Path, n_layers: int, index: list[dict[str, Any]],
                 hidden_size: int | None = None, last: bool = False) -> None:
        """`last`: each row's states end with the last decoder layer's (which extract stores
        after the chosen layers), for the target's labels."""
        from safetensors import safe_open

        self.dir = extract_dir / "hidden_states"
        self.where = {e["row"]: e for e in index}
        self.n_layers = n_layers
        self.hidden_size = hidden_size
        self.last = last
        self._open = safe_open
        import torch

        self._torch = torch
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
            self._check(row, entry, tuple(states.shape))
            chosen = states[:, :self.n_layers]  # both formats append the last layer
            out.append(self._torch.cat([chosen, states[:, -1:]], 1) if self.last else chosen)
        return out

    def _check(self, row: dict[str, Any], entry: dict[str, Any], shape: tuple[int, ...]) -> None:
        """The row's states are [its tokens, >= the chosen layers, the hidden size], or the
        error names the row and the file (a corrupt or foreign shard, not a crash mid-run)."""
        want_hidden = self.hidden_size if self.hidden_size is not None else shape[-1]
        want_layers = self.n_layers + int(self.last)
        if (len(shape) != 3 or shape[0] != len(row["input_ids"]) or shape[1] < want_layers
                or shape[2] != want_hidden):
            raise StageError(
                f"{self.dir / entry['shard']}: the hidden states of row {row['row']} "
                f"({row.get('id')!r}) are {list(shape)}, expected [{len(row['input_ids'])}, "
                f">= {want_layers}, {want_hidden}] (its tokens, the chosen layers, extract's "
                "hidden size): the extract output is corrupt or not this run's; `dflash-etl "
                "check` shows it, `dflash-etl extract --force` remakes it")

    def close(self) -> None:
        self.files.close()


class ServerStates:
    """Hidden states for each batch from a hidden-states server (models/states_server.py: the
    token ids and every file checked), the next step's rows requested while this step trains:
    one batch ahead, so memory holds two batches' states at most."""

    def __init__(self, server: Any, last: bool = False) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.server = server
        self.extra = (server.last_layer,) if last else ()  # the target's labels need it
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.ahead: tuple[tuple[int, ...], Any] | None = None
        self.requested = 0  # rows asked of the server (prefetched or not)
        self.prefetched = 0  # of them, those a step found already asked for

    def prefetch(self, rows: list[dict[str, Any]]) -> None:
        self.ahead = (tuple(map(id, rows)), self.pool.submit(self._fetch, rows))

    def __call__(self, rows: list[dict[str, Any]]) -> list[Any]:
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == tuple(map(id, rows)):
            self.prefetched += len(rows)
            return ahead[1].result()
        return self._fetch(rows)

    def _fetch(self, rows: list[dict[str, Any]]) -> list[Any]:
        self.requested += len(rows)
        _, states = self.server.forward([list(r["input_ids"]) for r in rows],
                                        extra_layers=self.extra)
        for row, state in zip(rows, states, strict=True):
            if isinstance(state, str):
                why = getattr(self.server, "last_problem", "") if state == Q_SERVER_FAILED \
                    else ""
                raise StageError(f"the states server gave no states for row {row.get('id')} "
                                 f"({state}{': ' + why if why else ''}): training stops here, "
                                 "its checkpoints kept; "
                                 "check the server (or extract with --backend server first) "
                                 "and rerun to resume")
        return states

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class OnlineStates:
    """Hidden states computed from the target for each batch (no extract output needed)."""

    def __init__(self, target: Any, last: bool = False) -> None:
        self.target = target
        self.extra = (target.last_layer,) if last else ()  # the target's labels need it

    def __call__(self, rows: list[dict[str, Any]]) -> list[Any]:
        if not self.extra:
            return self.target.states([list(r["input_ids"]) for r in rows])
        return self.target.forward([list(r["input_ids"]) for r in rows],
                                   extra_layers=self.extra)[1]

    def close(self) -> None:
        return None
