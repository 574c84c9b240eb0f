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
import os
import shlex
import sys
import threading
import time
from dataclasses import replace
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
SPOT_CHECK_FILE = "server_check.json"  # in the stage's partial dir: the workers' scale limits
PROBE_TOKENS = 64  # the spot-check row: the first tokens of the first row
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
        if self.last_layer in layers:
            raise StageError(
                f"the server backend cannot give layer {self.last_layer} (the target's last) as "
                "a drafter reads it: vLLM's hidden-states connector captures it before the "
                "final norm, z-lab's and SpecForge's drafters read it after (Hugging Face's "
                f"hidden_states[-1]); choose --layers below {self.last_layer} (`auto` does), or "
                "use the local backend")
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
                extra_layers: tuple[int, ...] = (), movable: bool = False
                ) -> tuple[None, list[Any]]:
        """The rows' states (or each failed row's reason). `movable`: a server file that is
        already a speculators row file is kept, named by the states' `server_file`, for the
        caller to move into its output (io.hidden_states.save_states) or drop."""
        want = [*self.layers, *extra_layers]
        if logits or want != [*self.layers, self.last_layer][:len(want)]:
            raise StageError("the server backend gives the chosen layers and the last one")
        bodies = [{"model": self.fleet.served_model, "prompt": list(ids), "max_tokens": 1,
                   "return_token_ids": True} for ids in rows]
        with self.lock:
            replies = self.fleet.send(bodies)
        states = [self._states(list(ids), reply, movable) if not isinstance(reply, str)
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

    def _states(self, ids: list[int], reply: dict[str, Any], movable: bool = False) -> Any:
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
        if not states.is_floating_point():  # quantized or cast: converting would hide it
            raise StageError(f"{path}: the server's states are {str(states.dtype).split('.')[-1]}"
                             ", not floats: the server quantizes or casts them; serve the "
                             "target's own dtype (bf16, fp16 or fp32)")
        want = (len(ids), len(self.layers) + 1, self.hidden)
        if tuple(states.shape) != want:
            raise StageError(
                f"{path}: the server's states are {list(states.shape)}, expected {list(want)} "
                f"(tokens, layers {vllm_layer_ids(self.layers, self.n_layers)} in vLLM's ids, "
                "hidden): the server captures other layers; restart it with the printed "
                "`vllm serve` line")
        states = states.to(self.dtype)
        if self.settings.keep_server_files:
            return states
        if (movable and set(data) == {"hidden_states", "token_ids"}
                and data["token_ids"].dtype == self.torch.long
                and states.data_ptr() == data["hidden_states"].data_ptr()):
            states.server_file = path  # already a speculators row file
        else:
            path.unlink(missing_ok=True)
        return states


MATCH_RELATIVE_DIFF = 0.1  # a served layer against the target's own: bf16 engines, margin


def _median_norm(v: Any) -> float:
    return float(v.norm(dim=-1).median()) if v.numel() else 0.0


def layer_match(served: Any, local: Any, expected: list[int]) -> list[dict[str, Any]]:
    """Which of the target's layers each served layer holds. `served` [seq, slots, hidden];
    `local` [seq, layers + 1, hidden], indexed by vLLM's layer id (0: the embedding output);
    `expected` the vLLM id each slot should be. Per slot: the median per-token relative diff
    to the expected layer and to the nearest one, and the ratio of median token norms. The
    first token is left out when there are others: its massive activations look alike in
    every layer."""
    skip = 1 if served.shape[0] > 1 else 0
    a, b = served[skip:].float(), local[skip:].float()
    scale = b.norm(dim=-1).clamp_min(1e-6)  # [seq, layers + 1]
    out = []
    for k, layer in enumerate(expected):
        diffs = ((a[:, k:k + 1] - b).norm(dim=-1) / scale).median(dim=0).values
        nearest = int(diffs.argmin())
        reference = _median_norm(b[:, layer])
        out.append({"slot": k, "expected": int(layer), "nearest": nearest,
                    "diff_expected": round(float(diffs[layer]), 6),
                    "diff_nearest": round(float(diffs[nearest]), 6),
                    "norm_ratio": round(_median_norm(a[:, k]) / reference, 6)
                    if reference else 0.0, "target_norm_median": round(reference, 4)})
    return out


def layer_match_problems(matches: list[dict[str, Any]]) -> list[str]:
    """What makes served states another layer's, scaled, or not the target's, in vLLM's ids."""
    problems = []
    for m in matches:
        where = f"the server's layer {m['slot']} (vLLM layer id {m['expected']} expected)"
        # another layer clearly nearer: adjacent layers of a deep target can both be within
        # the limit, so being close enough is not enough
        other = (m["nearest"] != m["expected"] and m["diff_nearest"] <= MATCH_RELATIVE_DIFF
                 and m["diff_nearest"] < m["diff_expected"] / 2)
        if not other and m["diff_expected"] <= MATCH_RELATIVE_DIFF:
            continue
        if other:
            problems.append(f"{where} holds vLLM layer {m['nearest']}'s states (median relative "
                            f"diff {m['diff_nearest']:.3g}; {m['diff_expected']:.3g} to layer "
                            f"{m['expected']})")
        elif m["norm_ratio"] == 0:
            problems.append(f"{where} is all zeros (vLLM #46301 on hybrid targets)")
        elif not 1 / 2 <= m["norm_ratio"] <= 2:
            problems.append(f"{where} is x{m['norm_ratio']:.4g} the target's own states (median "
                            "token norm): the server scales or casts them")
        else:
            problems.append(f"{where} matches no layer of the target (median relative diff "
                            f"{m['diff_expected']:.3g}, limit {MATCH_RELATIVE_DIFF:g}): another "
                            "model, revision or quantization than --model")
    return problems


def _available_memory() -> int:
    """Bytes this machine can still give (MemAvailable), for whether the target loads here."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def reference_dtype(model: str) -> tuple[str | None, str]:
    """The dtype to load the target in for the spot check (fp32, else bf16 when only that
    fits), or None and why it cannot load here."""
    from dflash_etl.core.progress import size_text

    directory = Path(model)
    weights = [p for pattern in ("*.safetensors", "*.bin", "*.pt")
               for p in directory.glob(pattern)] if directory.is_dir() else []
    if not weights:
        return None, f"{model} holds no weights (a config and tokenizer only)"
    size, free = sum(p.stat().st_size for p in weights), _available_memory()
    if 3 * size <= free:  # a bf16 checkpoint in fp32, with room to spare
        return "fp32", ""
    if 3 * size <= 2 * free:
        return "bf16", ""
    return None, (f"its weights ({size_text(size)}) do not fit this machine's available memory "
                  f"({size_text(free)})")


def spot_check(settings: Any, layers: list[int], n_layers: int, hidden: int, probe: list[int],
               reference: Any = None, stage: str = "extract") -> dict[str, Any]:
    """One short row through the target here and through each server: each served layer must
    be the target's layer the `vllm serve` line names (vllm_layer_ids, as serve_command), at
    the target's scale. A server's misconfiguration (layer ids off by one, scaled or cast
    states, another model) is then the stage's error before any shard, naming what the
    server captures. `reference`: a loaded Target (train's), else the target is loaded here
    on the CPU when it fits; where it cannot load, the check is skipped loudly (`spot_check =
    "on"`: an error). Returns the record for stats.json (its `norms` the shards' scale limits)."""
    expected = vllm_layer_ids(layers, n_layers)
    record: dict[str, Any] = {"ran": False, "layer_ids": expected, "tokens": len(probe)}
    why = "spot_check = \"off\"" if settings.spot_check == "off" else ""
    dtype = "fp32"
    if not why and reference is None:
        dtype, why = reference_dtype(settings.model)  # type: ignore[assignment]
    if why:
        if settings.spot_check == "on":
            raise StageError(f"spot_check = \"on\" but the target cannot load here: {why}; "
                             "run where it does, or set spot_check = \"auto\"")
        print(f"{stage}: WARNING: the server's states are not checked against the target: "
              f"{why}. A server started with other layer ids gives another layer's states "
              "unnoticed: start it with the printed `vllm serve` line", file=sys.stderr,
              flush=True)
        return {**record, "why": why}
    if reference is None:
        import gc

        from dflash_etl.models.target import Target, TargetSpec

        loaded = Target(TargetSpec(model=settings.model, layers=",".join(map(str, layers)),
                                   dtype=dtype, device="cpu"))
        local = loaded.every_layer(probe)
        del loaded  # a big target's memory back before the stage's work (its hooks: a cycle)
        gc.collect()
    else:
        local = reference.every_layer(probe)
    record.update(ran=True, servers=[], norms={})
    for url in settings.servers:
        try:
            one = ServerTarget(replace(settings, endpoint=url, endpoints=()), layers, n_layers,
                               hidden)
            _, got = one.forward([probe], extra_layers=(n_layers - 1,))
        except StageError as exc:
            if "cannot list the models" not in str(exc):
                raise
            got = [f"{Q_SERVER_FAILED}: {exc}"]
        if isinstance(got[0], str):  # down now: the fleet's failover decides; said, counted
            print(f"{stage}: WARNING: {url} gave no states for the spot check ({got[0]}): not "
                  "checked", file=sys.stderr, flush=True)
            record["servers"].append({"url": url, "checked": False, "why": got[0]})
            continue
        matches = layer_match(got[0], local, expected)
        problems = layer_match_problems(matches)
        if problems:
            raise StageError(
                f"{url}: the server's states are not the target's on a {len(probe)}-token row: "
                + "; ".join(problems) + f". The layers stored here are vLLM layer ids "
                f"{expected}; restart the server with the printed `vllm serve` line (its "
                "eagle_aux_hidden_state_layer_ids), serving --model's weights")
        record["servers"].append({"url": url, "checked": True,
                                  "max_relative_diff": max(m["diff_expected"] for m in matches)})
        record["norms"] = {str(m["expected"] - 1): m["target_norm_median"] for m in matches}
    return record


def begin_server_stage(settings: Any, layers: list[int], n_layers: int, hidden: int,
                       first_row: list[int], partial: Path) -> None:
    """extract --backend server's start: the `vllm serve` line the servers must run, then the
    spot check on the first row's first tokens, its record kept in `partial` (the workers'
    scale limits; `take_spot_check` moves it into stats before publishing)."""
    from dflash_etl.core.rundir import write_json_atomic

    print(f"extract: the states come from the server(s) at {', '.join(settings.servers)}, each "
          "started as:\n  " + serve_command(settings.served_model or settings.model, layers,
                                             n_layers, settings.states_dir),
          file=sys.stderr, flush=True)
    write_json_atomic(partial / SPOT_CHECK_FILE, spot_check(
        settings, layers, n_layers, hidden, first_row[:PROBE_TOKENS]))


def take_spot_check(partial: Path) -> dict[str, Any]:
    """The spot check's record, removed from the output: a run's record (servers), not data."""
    path = partial / SPOT_CHECK_FILE
    record = json.loads(path.read_text()) if path.is_file() else {}
    path.unlink(missing_ok=True)
    return record


def reference_norms(partial: Path) -> dict[int, float]:
    """The spot check's median token norms per stored layer (ours), for the shards' scale
    check; empty when it did not run."""
    path = partial / SPOT_CHECK_FILE
    norms = json.loads(path.read_text()).get("norms", {}) if path.is_file() else {}
    return {int(layer): float(norm) for layer, norm in norms.items()}
