"""Hidden states from a vLLM server started with the `extract_hidden_states` speculative method
and a hidden-states KV connector: the engine the field uses at scale, in place of the hooked
transformers forward, behind the same `forward` extract calls.

The protocol (speculators 0.9's `generate_hidden_states`, vLLM's ExampleHiddenStatesConnector):
POST /v1/completions with `prompt` = the row's token ids, `max_tokens` 1 and `return_token_ids`;
the reply's `choices[0].prompt_token_ids` must be the row's ids, and
`kv_transfer_params.hidden_states_path` names a safetensors file (`hidden_states` [seq, layers,
hidden], `token_ids` [seq]) the connector wrote, under the server's `shared_storage_path`.
vLLM's layer ids count the embedding output as 0 (`eagle_aux_hidden_state_layer_ids`; the last
decoder layer is `num_hidden_layers`): ours + 1, as speculators'.

Every reply is checked before its states are used: the token ids (a mismatch is the row's
`state_token_mismatch`: an older client returned another request's states with batch > 1), a
file under `states_dir` only, its layer count, length and hidden size; the extract stage's
health checks (zeros: vLLM #46301's all-zero states on hybrid targets) then run unchanged.
"""

from __future__ import annotations

import json
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dflash_etl.core.errors import StageError
from dflash_etl.models.fleet import Fleet
from dflash_etl.models.http import (
    REPLY_BYTES_BASE,
    json_object,
    read_capped,
    refusal,
)

Q_TOKEN_MISMATCH = "state_token_mismatch"
Q_SERVER_FAILED = "state_request_failed"  # no server answered: extract and train stop
Q_FILE_UNREADABLE = "state_file_unreadable"  # missing or cut
# a row's states the servers failed to give: extract and train stop (a rerun asks again)
SERVER_FAULTS = (Q_SERVER_FAILED, Q_TOKEN_MISMATCH, Q_FILE_UNREADABLE)
LOCK_WAIT_S = 30.0  # the connector's .lock on a file it is still writing
REPLY_BYTES_PER_ID = 32  # a reply's bytes per prompt token, with margin (the cap's)


def vllm_layer_ids(layers: list[int], n_layers: int) -> list[int]:
    """vLLM's ids for our chosen decoder layers, then the last one (the verifier's state)."""
    return [layer + 1 for layer in layers] + [n_layers]


def serve_command(model: str, layers: list[int], n_layers: int, states_dir: str) -> str:
    """The `vllm serve` line that captures exactly the layers this extract stores."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(layers, n_layers)}}}
    transfer = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": states_dir}}
    return shlex.join(["vllm", "serve", model, "--no-enable-chunked-prefill",
                       "--speculative-config", json.dumps(spec),
                       "--kv-transfer-config", json.dumps(transfer)])


class _Failed(str):
    """A request no server answered: why (a str, so it is never taken for a reply)."""


class StatesFleet(Fleet):
    """The fleet client (models/fleet.py, regenerate's) speaking the hidden-states protocol:
    each body a completions request of one row's token ids; its result the reply's JSON object
    (checked by ServerTarget) or `_Failed` with why."""

    route = "/completions"
    client_name = "hidden-states"

    async def _attempt(self, client: Any, url: str, body: dict[str, Any]) -> Any:
        # the reply echoes the prompt's ids (and vLLM's output ids): a few bytes each
        cap = REPLY_BYTES_BASE + REPLY_BYTES_PER_ID * len(body["prompt"])
        async with client.stream("POST", url, json=body) as response:
            status = response.status_code
            text = (await read_capped(response, cap, f"{len(body['prompt'])} prompt tokens")
                    ).decode("utf-8", "replace")
        refused = refusal(url, status, text)
        if refused:
            return _Failed(refused)
        return json_object(text, "a malformed reply", "HTTP 200, ")

    def _failed(self, problem: str) -> _Failed:
        return _Failed(problem)


class ServerTarget:
    """`Target`'s forward for extract, answered by hidden-states servers (one, or a fleet
    through the fleet client regenerate uses): the chosen layers, then the last one, per row;
    a row the servers failed or misaligned is its reason (a str)."""

    def __init__(self, settings: Any, layers: list[int], n_layers: int, hidden: int) -> None:
        import torch

        self.torch, self.settings = torch, settings
        self.layers, self.n_layers, self.hidden = layers, n_layers, hidden
        self.last_layer = n_layers - 1
        self.device = "cpu"
        if not settings.servers:
            raise StageError("extract --backend server needs --endpoint URL (the vLLM server's "
                             "/v1 base) or --endpoints URL,URL (several)")
        if not settings.states_dir:
            raise StageError("extract --backend server needs --states-dir DIR: the server's "
                             "shared_storage_path (files elsewhere are refused)")
        self.states_dir = Path(settings.states_dir).resolve()
        self.fleet = StatesFleet(settings, settings.served_model)
        self.dtype = torch.bfloat16 if settings.dtype == "bf16" else torch.float32
        self.failed = 0
        self.last_problem = ""  # why the last row no server answered failed
        self.lock = threading.Lock()  # one batch at a time (online training prefetches)

    def forward(self, rows: list[list[int]], logits: bool = False,
                extra_layers: tuple[int, ...] = ()) -> tuple[None, list[Any]]:
        want = [*self.layers, *extra_layers]
        if logits or want != [*self.layers, self.last_layer][:len(want)]:
            raise StageError("the server backend gives the chosen layers and the last one")
        bodies = [{"model": self.fleet.served_model, "prompt": list(ids), "max_tokens": 1,
                   "return_token_ids": True} for ids in rows]
        with self.lock:
            replies = self.fleet.send(bodies)
        states = [self._states(list(ids), reply) if not isinstance(reply, str)
                  else self._failed_row(reply) for ids, reply in zip(rows, replies, strict=True)]
        if not extra_layers:  # the chosen layers alone
            states = [s if isinstance(s, str) else s[:, :len(self.layers)] for s in states]
        return None, states

    def _failed_row(self, problem: str) -> str:
        self.last_problem = problem
        self._say(f"no server gave a row's states: {problem}")
        return Q_SERVER_FAILED

    def _say(self, problem: str) -> None:
        self.failed += 1
        if self.failed <= 5:  # the first few say why; the rest are counted
            print(f"extract: {problem}", file=sys.stderr, flush=True)

    def _states(self, ids: list[int], reply: dict[str, Any]) -> Any:
        from safetensors.torch import load_file

        choice = (reply.get("choices") or [{}])[0]
        if choice.get("prompt_token_ids") != ids:
            return Q_TOKEN_MISMATCH
        named = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not named:
            raise StageError("the server's reply names no states file (no kv_transfer_params."
                             "hidden_states_path): it does not run vLLM's extract_hidden_states "
                             "connector; start it with the printed `vllm serve` line")
        path = Path(str(named)).resolve()
        if not path.is_relative_to(self.states_dir):
            raise StageError(f"the server named {path} for a row's states, outside --states-dir "
                             f"{self.states_dir}: refused (start the server with "
                             "shared_storage_path there, or give that directory)")
        lock = path.with_name(path.name + ".lock")
        deadline = time.monotonic() + LOCK_WAIT_S
        while lock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if lock.exists():  # not a row's problem: every row after it would wait as long
            raise StageError(f"{lock} is still there after {LOCK_WAIT_S:g} s: the server has "
                             f"not finished writing {path.name} (or died writing it); the "
                             "stage stops here, the shards done kept: check the server, remove "
                             "the stale lock, and rerun to resume")
        try:
            data = load_file(str(path))
        except Exception as exc:  # a cut or missing file: the row's, counted (a rerun retries)
            self._say(f"{path}: the server's states file cannot be read ({exc})")
            return Q_FILE_UNREADABLE
        if data.get("token_ids") is None or data["token_ids"].tolist() != ids:
            return Q_TOKEN_MISMATCH
        states = data["hidden_states"]
        want = (len(ids), len(self.layers) + 1, self.hidden)
        if tuple(states.shape) != want:
            raise StageError(
                f"{path}: the server's states are {list(states.shape)}, expected {list(want)} "
                f"(tokens, layers {vllm_layer_ids(self.layers, self.n_layers)} in vLLM's ids, "
                "hidden): the server captures other layers; restart it with the printed "
                "`vllm serve` line")
        if not self.settings.keep_server_files:
            path.unlink(missing_ok=True)
        return states.to(self.dtype)
