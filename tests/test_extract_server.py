"""`extract --backend server`: hidden states from a server speaking vLLM's extract_hidden_states
protocol (the dev server's StatesEngine, a real HTTP server on 127.0.0.1 over the hooked tiny
target), equal to the hooks backend's; speculators' own client reads the dev server; the faults
servers have had are caught."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dflash_etl.core.errors import ContractError, StageError

torch = pytest.importorskip("torch")
LAYERS = [1, 2]  # ours (0-based decoder layers) of the 4-layer tiny target


@pytest.fixture()
def server(tiny_target, tmp_path):
    from dflash_etl.models.devserver import DevServer
    from dflash_etl.models.states_server import vllm_layer_ids

    states = tmp_path / "server-states"
    with DevServer(str(tiny_target), extract_layers=vllm_layer_ids(LAYERS, 4),
                   states_dir=str(states)) as srv:
        srv.states_dir = states
        yield srv


def _server_kw(server) -> dict:
    return {"backend": "server", "endpoint": server.url, "states_dir": str(server.states_dir),
            "concurrency": 2, "request_deadline_s": 60.0, "retries": 0}


def _assert_same_states(hooks: Path, served: Path) -> None:
    """The served run's extract output equals the hooks run's: the index, then every shard's
    token ids exactly and its states within 1e-6."""
    from safetensors.torch import load_file

    # the rows' digests differ (the states match within 1e-6, not bit for bit): all else equal
    a = pq.read_table(hooks / "extract" / "index.parquet").drop_columns(["sha256"])
    b = pq.read_table(served / "extract" / "index.parquet").drop_columns(["sha256"])
    assert a.equals(b)
    for shard in sorted((hooks / "extract" / "hidden_states").glob("*.safetensors")):
        mine, theirs = load_file(str(shard)), load_file(str(served / "extract" /
                                                             "hidden_states" / shard.name))
        assert torch.equal(mine["token_ids"], theirs["token_ids"])
        torch.testing.assert_close(theirs["hidden_states"], mine["hidden_states"],
                                   atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def hooks_run(tiny_target, default_tokenized, copy_run, tmp_path_factory) -> Path:
    """The embedded default's rows extracted by the hooks backend: what a server must equal."""
    from dflash_etl.stages import extract

    run = copy_run(default_tokenized, tmp_path_factory.mktemp("hooks"))
    extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2")
    return run


@pytest.mark.slow
def test_server_states_equal_the_hooks_states(tiny_target, default_tokenized, copy_run,
                                              tmp_path, server, hooks_run, capsys):
    from dflash_etl.stages import extract

    served = copy_run(default_tokenized, tmp_path / "served")
    doc = extract.run(None, served, progress=False, model=str(tiny_target), layers="1,2",
                      **_server_kw(server))
    printed = capsys.readouterr().err
    assert '"eagle_aux_hidden_state_layer_ids": [2, 3, 4]' in printed
    assert doc["total"]["rows_out"] == doc["total"]["rows_in"] and not doc["health"]["problems"]
    # the spot check compared the layers the printed serve line names, and found them
    check = doc["total"]["server_check"]
    assert check["ran"] and check["layer_ids"] == _printed_layer_ids(printed)
    assert [s["checked"] for s in check["servers"]] == [True]
    assert check["servers"][0]["max_relative_diff"] < 1e-5
    assert sorted(check["norms"]) == ["1", "2", "3"]  # ours: the stored layers' scale limits
    assert not (served / "extract" / "server_check.json").exists()  # a run's record, not data
    _assert_same_states(hooks_run, served)
    assert not list(server.states_dir.glob("*.safetensors"))  # copied, then removed


def _printed_layer_ids(printed: str) -> list[int]:
    import json
    import shlex

    line = next(x for x in printed.splitlines() if x.strip().startswith("vllm serve"))
    argv = shlex.split(line)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    return spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]


def test_the_layer_match_names_the_nearest_layer_even_within_the_limit():
    """A deep target's adjacent layers differ by less than the match limit: the layer before
    the expected one is still named when it is clearly nearer; bf16-sized noise passes."""
    from dflash_etl.models.states_server import layer_match, layer_match_problems

    g = torch.Generator().manual_seed(0)
    local = torch.randn(32, 1, 256, generator=g) + (0.05 * torch.randn(
        32, 9, 256, generator=g)).cumsum(dim=1)  # each layer ~5% from the one before
    noise = 0.005 * torch.randn(32, 3, 256, generator=g)
    assert layer_match_problems(layer_match(local[:, [4, 5, 6]] + noise, local, [4, 5, 6])) == []
    shifted = layer_match(local[:, [3, 4, 5]] + noise, local, [4, 5, 6])
    assert all(m["diff_expected"] < 0.1 for m in shifted)  # close enough, yet another layer's
    assert [p.split(" (median")[0] for p in layer_match_problems(shifted)] == [
        f"the server's layer {k} (vLLM layer id {k + 4} expected) holds vLLM layer {k + 3}'s "
        "states" for k in range(3)]
    scaled = layer_match_problems(layer_match(local[:, [4, 5, 6]] * 1000, local, [4, 5, 6]))
    assert len(scaled) == 3 and all("is x1000 the target's own states" in p for p in scaled)


def test_a_server_started_with_our_layer_ids_is_refused_before_any_shard(
        tiny_target, default_tokenized, copy_run, tmp_path):
    """The mistake the docs warn about: vLLM counts the embedding output as layer 0, so our
    ids given as vLLM's capture the layer before each (it gave 257 rows, rc 0)."""
    from dflash_etl.models.devserver import DevServer
    from dflash_etl.models.states_server import vllm_layer_ids
    from dflash_etl.stages import extract

    ours = [i - 1 for i in vllm_layer_ids(LAYERS, 4)]  # [1, 2, 3]
    states = tmp_path / "server-states"
    run = copy_run(default_tokenized, tmp_path / "off-by-one")
    with DevServer(str(tiny_target), extract_layers=ours, states_dir=str(states)) as srv, \
            pytest.raises(StageError) as failed:
        extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2",
                    backend="server", endpoint=srv.url, states_dir=str(states))
    message = str(failed.value)
    for slot, (want, held) in enumerate(zip([2, 3, 4], ours, strict=True)):
        assert f"layer {slot} (vLLM layer id {want} expected) holds vLLM layer {held}'s" \
            in message
    assert "vLLM layer ids [2, 3, 4]; restart the server with the printed `vllm serve`" \
        in message
    assert not list(run.glob("**/*.safetensors")) and not (run / "extract").exists()


@pytest.mark.parametrize(("fault", "message"), [
    ("scaled", r"layer 0 \(vLLM layer id 2 expected\) is x1000 the target's own states"),
    ("integer", r"the server's states are int32, not floats"),
])
def test_scaled_or_cast_server_states_are_refused(tiny_target, default_tokenized, copy_run,
                                                   tmp_path, server, fault, message):
    from dflash_etl.stages import extract

    run = copy_run(default_tokenized, tmp_path / fault)
    server.states.fault = fault
    with pytest.raises(StageError, match=message):
        extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2",
                    **_server_kw(server))


def test_states_scaled_after_the_spot_check_fail_the_shards_health(
        tiny_target, default_tokenized, copy_run, tmp_path, server, monkeypatch):
    """A server that changes after the check (restarted with other settings): each shard's
    median token norms are held to the target's on the spot-check row."""
    from dflash_etl.models import states_server
    from dflash_etl.stages import extract

    checked = states_server.spot_check

    def then_scaled(*args, **kwargs):
        record = checked(*args, **kwargs)
        server.states.fault = "scaled"
        return record

    monkeypatch.setattr(states_server, "spot_check", then_scaled)
    run = copy_run(default_tokenized, tmp_path / "later")
    with pytest.raises(ContractError, match=r"layer 1: median token norm .* is x[\d.]+ the "
                       r"target's own .*limit x4 either way(.|\n)*a server changed since the "
                       r"check"):
        extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2",
                    **_server_kw(server))


def test_without_the_targets_weights_the_check_is_skipped_loudly(
        tiny_target, default_tokenized, copy_run, tmp_path, server, capsys):
    """A client machine with the config and tokenizer only: warned and recorded; `on` makes
    it an error."""
    import shutil

    from dflash_etl.stages import extract

    config_only = tmp_path / "config-only"
    shutil.copytree(tiny_target, config_only, ignore=shutil.ignore_patterns("*.safetensors*"))
    run = copy_run(default_tokenized, tmp_path / "unchecked")
    doc = extract.run(None, run, progress=False, model=str(config_only), layers="1,2",
                      **_server_kw(server))
    assert "WARNING: the server's states are not checked against the target: " \
        f"{config_only} holds no weights" in capsys.readouterr().err
    assert doc["total"]["server_check"]["ran"] is False
    assert "holds no weights" in doc["total"]["server_check"]["why"]
    with pytest.raises(StageError, match=r'spot_check = "on" but the target cannot load here'):
        extract.run(None, copy_run(default_tokenized, tmp_path / "on"), progress=False,
                    model=str(config_only), layers="1,2", spot_check="on", **_server_kw(server))


def test_a_fleet_with_one_misconfigured_server_names_it(fleet, default_tokenized, copy_run,
                                                        tmp_path, tiny_target):
    from dflash_etl.stages import extract

    good, bad = fleet(2)
    bad.states.fault = "scaled"
    with pytest.raises(StageError, match=f"^{bad.url}: the server's states are not the "):
        extract.run(None, copy_run(default_tokenized, tmp_path / "fleet"), progress=False,
                    model=str(tiny_target), layers="1,2", **_fleet_kw([good, bad]))


def test_speculators_own_client_reads_the_dev_server(server, default_tokenized):
    pytest.importorskip("speculators.data_generation.vllm_client",
                        reason="speculators is not installed: make setup")
    import datasets
    import openai
    from safetensors.torch import load_file
    from speculators.data_generation.offline import check_hidden_states
    from speculators.data_generation.vllm_client import generate_hidden_states

    dataset = datasets.load_from_disk(str(default_tokenized / "tokenize" / "dataset"))
    ids = dataset.with_format(None)[0]["input_ids"]
    client = openai.Client(base_url=server.url, api_key="unused")
    path, params = generate_hidden_states(client, server.model_name, {"input_ids": ids},
                                          max_retries=0)
    data = load_file(path)
    check_hidden_states(data, ids)  # speculators' own checks
    assert data["hidden_states"].shape == (len(ids), 3, 64) and params["hidden_states_path"]


def _target(server, tiny_target, **extra):
    from dflash_etl.models.states_server import ServerTarget
    from dflash_etl.stages.extract import ExtractSettings

    settings = dataclasses.replace(ExtractSettings(model=str(tiny_target)),
                                   **{**_server_kw(server), **extra})
    return ServerTarget(settings, LAYERS, 4, 64)


def test_a_server_returning_another_requests_states_is_a_counted_mismatch(server, tiny_target):
    target = _target(server, tiny_target, concurrency=1, keep_server_files=True)
    server.states.fault = "other"
    _, states = target.forward([[5, 6, 7, 8], [9, 10, 11, 12]], extra_layers=(3,))
    assert isinstance(states[0], torch.Tensor) and states[1] == "state_token_mismatch"


def test_a_cut_or_missing_file_is_the_rows_counted_reason(server, tiny_target):
    target = _target(server, tiny_target, concurrency=1)
    server.states.fault = "other"  # names the first request's file, already copied and removed
    _, states = target.forward([[5, 6, 7, 8], [9, 10, 11, 12]], extra_layers=(3,))
    assert states[1] == "state_file_unreadable"


def test_a_server_with_other_layers_or_a_foreign_path_is_refused(server, tiny_target,
                                                                  tmp_path):
    target = _target(server, tiny_target)
    server.states.fault = "short"
    with pytest.raises(StageError, match=r"the server's states are \[4, 2, 64\], expected "
                       r"\[4, 3, 64\] .*layers \[2, 3, 4\] in vLLM's ids"):
        target.forward([[5, 6, 7, 8]], extra_layers=(3,))
    server.states.fault = ""
    elsewhere = _target(server, tiny_target, states_dir=str(tmp_path / "mine"))
    with pytest.raises(StageError, match="outside --states-dir"):
        elsewhere.forward([[5, 6, 7, 8]], extra_layers=(3,))


def test_all_zero_states_from_a_server_fail_the_stage_naming_the_layer(
        tiny_target, default_tokenized, copy_run, tmp_path, server):
    from dflash_etl.stages import extract

    run = copy_run(default_tokenized, tmp_path / "zeros")
    server.states.fault = "zeros"
    # the spot check sees it first, before any shard; without it, the shards' health
    with pytest.raises(StageError, match=r"layer 0 \(vLLM layer id 2 expected\) is all zeros"):
        extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2",
                    **_server_kw(server))
    assert not list((run / ".extract.partial").glob("**/*.safetensors"))  # no shard written
    with pytest.raises(ContractError, match="exactly zero"):
        extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2",
                    **_server_kw(server), spot_check="off")


def test_a_dead_server_quarantines_its_rows_with_the_reason(tiny_target):
    """As regenerate's openai backend: with the served model named nothing is asked at the
    start, and the dead server's rows are counted failures; without it the model list is asked
    for, and the start fails naming the server."""
    from dflash_etl.models.states_server import ServerTarget
    from dflash_etl.stages.extract import ExtractSettings

    settings = ExtractSettings(model=str(tiny_target), backend="server",
                               endpoint="http://127.0.0.1:9/v1", states_dir="/tmp",
                               served_model="m", request_deadline_s=2.0, retries=0)
    _, states = ServerTarget(settings, LAYERS, 4, 64).forward([[1, 2, 3]], extra_layers=(3,))
    assert states == ["state_request_failed"]
    with pytest.raises(StageError, match=r"cannot list the models of http://127.0.0.1:9/v1/"):
        ServerTarget(dataclasses.replace(settings, served_model=None), LAYERS, 4, 64)


def test_online_training_stops_at_a_row_no_server_gives(tiny_target):
    """train --states-from server's source: a row with no states stops the run naming it."""
    from dflash_etl.models.states_server import ServerTarget
    from dflash_etl.models.training.states import ServerStates
    from dflash_etl.stages.extract import ExtractSettings

    settings = ExtractSettings(model=str(tiny_target), backend="server",
                               endpoint="http://127.0.0.1:9/v1", states_dir="/tmp",
                               served_model="m", request_deadline_s=2.0, retries=0)
    states = ServerStates(ServerTarget(settings, LAYERS, 4, 64))
    with pytest.raises(StageError, match="the states server gave no states for row r7 "
                       r"\(state_request_failed: http://127.0.0.1:9/v1/completions failed"):
        states([{"id": "r7", "input_ids": [1, 2, 3]}])
    states.close()


def test_the_server_backend_needs_its_endpoint_and_states_dir(tiny_target):
    from dflash_etl.models.states_server import ServerTarget
    from dflash_etl.stages.extract import ExtractSettings

    with pytest.raises(StageError, match="needs --endpoint"):
        ServerTarget(ExtractSettings(model=str(tiny_target), backend="server"), LAYERS, 4, 64)
    with pytest.raises(StageError, match="needs --states-dir"):
        ServerTarget(ExtractSettings(model=str(tiny_target), backend="server",
                                     endpoint="http://x/v1"), LAYERS, 4, 64)


def test_the_printed_serve_line_names_vllms_layer_ids():
    import json
    import shlex

    from dflash_etl.models.states_server import serve_command

    argv = shlex.split(serve_command("/m", [1, 16, 31], 64, "/states"))
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    # ours + 1 (vLLM counts the embedding output as 0), then the last decoder layer (= L)
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2, 17, 32, 64]
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == "/states"
    assert Path(argv[2]) == Path("/m")


# ---------------------------------------------------------------- a fleet of servers
@pytest.fixture()
def fleet(dev_servers, tiny_target, tmp_path):
    """Hidden-states dev servers sharing one states_dir (as vLLM servers share storage):
    `fleet(n)` starts n."""
    from dflash_etl.models.states_server import vllm_layer_ids

    states = tmp_path / "fleet-states"

    def start(n: int = 2) -> list:
        servers = dev_servers(n, str(tiny_target), extract_layers=vllm_layer_ids(LAYERS, 4),
                              states_dir=str(states))
        for srv in servers:
            srv.states_dir = states
        return servers

    return start


def _fleet_kw(servers, **extra) -> dict:
    return {"backend": "server", "endpoints": [s.url for s in servers],
            "states_dir": str(servers[0].states_dir), "concurrency": 2, "timeout_s": 10.0,
            "request_deadline_s": 30.0, "retries": 1, "cooldown_s": 60.0, **extra}


def test_a_server_killed_mid_stage_is_taken_out_and_its_rows_retried(
        fleet, default_tokenized, copy_run, tmp_path, tiny_target, hooks_run):
    import time

    from dflash_etl.stages import extract

    a, b = fleet(2)
    a.die_after = 6  # the 7th request kills it: new connections refused, in-flight dropped
    run = copy_run(default_tokenized, tmp_path / "killed")
    start = time.monotonic()
    doc = extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2",
                      **_fleet_kw([a, b]))
    total = doc["total"]
    assert total["rows_out"] == total["rows_in"] and total["rows_quarantined"] == 0
    assert a.dead and 0 < a.requests <= 7 + 2  # those it took before it died (+ retries)
    assert b.requests >= total["rows_in"] - 6  # b answered the rest, a's lost ones included
    _assert_same_states(hooks_run, run)
    assert not list(a.states_dir.glob("*.safetensors"))
    assert time.monotonic() - start < 120


@pytest.mark.slow
def test_a_slow_server_is_taken_out_past_its_deadline_and_its_rows_retried(
        fleet, default_tokenized, copy_run, tmp_path, tiny_target, hooks_run):
    import time

    from dflash_etl.stages import extract

    a, b = fleet(2)
    a.delay_next, a.delay_s = 10**6, 120.0  # every request it takes stalls (until it stops)
    run = copy_run(default_tokenized, tmp_path / "slow")
    start = time.monotonic()
    doc = extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2",
                      # out for longer than the stage: its probe (GET /models) would pass
                      **_fleet_kw([a, b], request_deadline_s=3.0, retries=0, cooldown_s=600.0))
    total = doc["total"]
    assert total["rows_out"] == total["rows_in"] and total["rows_quarantined"] == 0
    # out after its first requests passed request_deadline_s (concurrency 2: two at most)
    assert 1 <= a.requests <= 2 and b.requests >= total["rows_in"]
    _assert_same_states(hooks_run, run)
    assert time.monotonic() - start < 120


def test_every_server_dead_stops_the_stage_naming_them(fleet, default_tokenized, copy_run,
                                                      tmp_path, tiny_target, hooks_run):
    """Dead at the start, the stage stops naming every server (as regenerate); dying during
    the stage, the shard whose rows no server answered stops it, naming the servers and
    unwritten, so a rerun resumes there (regenerate fails its stage on such rows too); never
    a hang."""
    import json
    import time

    from dflash_etl.stages import extract

    a, b = fleet(2)
    a.stop()
    b.stop()
    run = copy_run(default_tokenized, tmp_path / "dead")
    with pytest.raises(StageError, match="cannot list the models of any of --endpoints") as err:
        extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2",
                    **_fleet_kw([a, b]))
    assert a.url in str(err.value) and b.url in str(err.value)

    c, d = fleet(2)
    c.die_after = d.die_after = 3
    run = copy_run(default_tokenized, tmp_path / "dying")
    start = time.monotonic()
    with pytest.raises(StageError, match=r"rows got no states from the servers \(.*--endpoints"
                       ) as err:
        extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2",
                    **_fleet_kw([c, d], cooldown_s=1.0))
    assert time.monotonic() - start < 60
    assert c.url in str(err.value) and d.url in str(err.value)
    assert "rerun to resume" in str(err.value)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["extract"]["status"] == "failed"
    assert not list((run / ".extract.partial" / "hidden_states").glob("shard-00000*"))
    again, = fleet(1)  # a server back: the rerun resumes and asks for the rows again
    doc = extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2",
                      **_fleet_kw([again]))
    assert doc["total"]["rows_out"] == doc["total"]["rows_in"]
    _assert_same_states(hooks_run, run)


def test_the_fleet_keeps_both_servers_busy_and_the_stats_say_how_busy(
        fleet, default_tokenized, copy_run, tmp_path, tiny_target):
    from dflash_etl.stages import extract

    a, b = fleet(2)
    run = copy_run(default_tokenized, tmp_path / "busy")
    doc = extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2",
                      **_fleet_kw([a, b], concurrency=2))
    total, servers = doc["total"], doc["total"]["servers"]
    assert set(servers) == {a.url, b.url}
    # every row once, and each shard's reference re-run (one row alone) once more
    assert sum(s["served"] for s in servers.values()) == (
        total["rows_in"] + doc["health"]["reference_rows"])
    for url, s in servers.items():
        assert s["served"] > 0 and s["requests"] == s["served"] and s["failed"] == 0, url
        assert 0 < s["busy_share"] <= 1 and 0 < s["mean_in_flight"] <= 2, url
    assert "servers" not in _extract_stats(run)  # timing: the run's record, not data


def _extract_stats(run: Path) -> dict:
    import json

    return json.loads((run / "extract" / "stats.json").read_text())["total"]


@pytest.mark.slow
def test_a_server_fault_stops_the_stage_and_a_rerun_retries_its_rows(
        server, tiny_target, default_tokenized, copy_run, tmp_path, hooks_run):
    """A server answering with another row's states file: "257 in -> 3 out, 254 quarantined",
    rc 0, and a rerun skipped them for good (reliability issue, item 1). Such rows are the
    server's failure: the stage stops at the shard, unwritten, and once the server is right a
    rerun resumes and gets every row."""
    from dflash_etl.stages import extract

    run = copy_run(default_tokenized, tmp_path / "faulty")
    server.states.fault = "other"
    with pytest.raises(StageError, match=r"rows got no states from the servers \(\{'state_"):
        extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2",
                    **_server_kw(server))
    assert not (run / "extract").exists()
    server.states.fault = ""
    doc = extract.run(None, run, progress=False, model=str(tiny_target), layers="1,2",
                      **_server_kw(server))
    total = doc["total"]
    assert total["rows_out"] == total["rows_in"] > 200 and total["rows_quarantined"] == 0
    _assert_same_states(hooks_run, run)


def test_a_reply_without_a_states_path_says_the_connector_is_missing(tmp_path):
    """A plain vLLM (no connector) answers without a states path: the error named the
    client's working directory as what "the server named" (reliability issue, item 14)."""
    from dflash_etl.models.states_server import ServerTarget

    target = object.__new__(ServerTarget)
    target.states_dir = tmp_path
    reply = {"choices": [{"prompt_token_ids": [5, 6]}], "kv_transfer_params": None}
    with pytest.raises(StageError, match=r"names no states file .* extract_hidden_states "
                                         r"connector"):
        target._states([5, 6], reply)


def test_a_states_file_whose_lock_stays_stops_the_stage_once(tmp_path, monkeypatch):
    """A states file whose `.lock` was never removed cost 30 s per row, serially and silently
    (about 2 h for 257 rows; reliability issue, item 10): the first such lock stops the stage,
    naming it."""
    import time

    from dflash_etl.models import states_server
    from dflash_etl.models.states_server import ServerTarget

    monkeypatch.setattr(states_server, "LOCK_WAIT_S", 0.3)
    target = object.__new__(ServerTarget)
    target.states_dir = tmp_path
    states = tmp_path / "req-1.safetensors"
    states.write_bytes(b"")
    (tmp_path / "req-1.safetensors.lock").write_text("")
    reply = {"choices": [{"prompt_token_ids": [5, 6]}],
             "kv_transfer_params": {"hidden_states_path": str(states)}}
    start = time.monotonic()
    with pytest.raises(StageError, match=r"req-1\.safetensors\.lock is still there after 0\.3 s"):
        target._states([5, 6], reply)
    assert time.monotonic() - start < 5


def test_the_server_backend_refuses_the_last_layer_it_would_give_before_the_norm(tiny_target):
    """vLLM's connector captures the last decoder layer before the final norm; a drafter reads
    a chosen last layer after it (z-lab's dflash_generate): the server backend refuses it
    rather than store another state than the local backend does."""
    from dflash_etl.models.states_server import ServerTarget
    from dflash_etl.stages.extract import ExtractSettings

    settings = ExtractSettings(model=str(tiny_target), backend="server",
                               endpoint="http://127.0.0.1:9/v1", states_dir="/tmp",
                               served_model="m")
    with pytest.raises(StageError, match=r"cannot give layer 3 .*before the final norm.*"
                                         r"below 3"):
        ServerTarget(settings, [1, 3], 4, 64)


def test_a_synthetic_width_server_passes_extracts_checks_and_serves_its_table(
        tiny_target, default_tokenized, copy_run, tmp_path):
    """The dev server's width mode (`--synthetic-states`): no model, a config's width (here 6
    layers x 256, bf16). extract --backend server, whose client machine holds the config and
    tokenizer only, stores every row through the protocol's checks (token ids, shapes, paths
    under states_dir), each token's states the table row its token id picks."""
    import json
    import shutil

    from safetensors.torch import load_file

    from dflash_etl.models.devserver import DevServer, SyntheticStates
    from dflash_etl.models.states_server import vllm_layer_ids
    from dflash_etl.stages import extract

    wide = tmp_path / "wide"
    shutil.copytree(tiny_target, wide, ignore=shutil.ignore_patterns("*.safetensors*"))
    config = json.loads((wide / "config.json").read_text())
    config.pop("layer_types", None)  # the tiny target's 4 layers'
    config.update(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, head_dim=64,
                  intermediate_size=512, torch_dtype="bfloat16")
    (wide / "config.json").write_text(json.dumps(config))
    run = copy_run(default_tokenized, tmp_path / "run")
    with DevServer(str(wide), extract_layers=vllm_layer_ids([1, 3], 6),
                   states_dir=str(tmp_path / "served"), synthetic=True) as srv:
        assert isinstance(srv.states, SyntheticStates)
        # shards of at most 1 MB of states (bf16, 3 x 256: ~680 tokens): a shard is built in
        # memory, and 256 rows at a 27B width would not fit it (the benchmark's first run)
        kw = {"model": str(wide), "layers": "1,3", "backend": "server", "endpoint": srv.url,
              "states_dir": str(tmp_path / "served"), "concurrency": 2, "retries": 0,
              "dtype": "bf16", "shard_mb": 1}
        # --plan through the same client (before: it loaded the target here, which a client
        # machine of a 27B server cannot): its projected bytes against what the stage writes
        planned = extract.run(None, run, progress=False, plan=True, plan_batches=2, **kw)
        doc = extract.run(None, run, progress=False, **kw)
        table = srv.states.table
    total = doc["total"]
    assert total["rows_out"] == total["rows_in"] > 0 and total["rows_quarantined"] == 0
    assert total["server_check"]["ran"] is False  # no weights here: skipped, said
    shards = sorted((run / "extract" / "hidden_states").glob("*.safetensors"))
    index = pq.read_table(run / "extract" / "index.parquet").to_pylist()
    per_shard: dict[str, int] = {}
    for e in index:
        per_shard[e["shard"]] = per_shard.get(e["shard"], 0) + e["length"]
    longest = max(e["length"] for e in index)
    assert len(shards) > 5 and all(t <= max(682, longest) for t in per_shard.values())
    checked = 0
    for shard in shards:
        data = load_file(str(shard))
        ids = data["token_ids"].long()
        assert data["hidden_states"].shape[1:] == (3, 256)  # the chosen layers and the last
        expected = table[ids % SyntheticStates.TABLE_ROWS].float()
        assert torch.equal(data["hidden_states"].float(), expected)
        checked += len(ids)
    assert checked == sum(e["length"] for e in pq.read_table(
        run / "extract" / "index.parquet").to_pylist())
    assert not list((tmp_path / "served").glob("*.safetensors"))  # the client removed them
    written = sum(f.stat().st_size for f in shards)
    assert abs(planned["projected"]["bytes"] - written) <= 0.1 * written


def test_speculators_layout_moves_the_servers_files_into_place_instead_of_copying(
        tiny_target, default_tokenized, copy_run, tmp_path, monkeypatch):
    """--format speculators through a server: the server's file already is the row's file (the
    same two tensors, checked), so it is renamed into the output, not read and written again:
    the output's files are the server's inodes, none left behind, and the content digest is the
    native layout's. With keep_server_files the server's files stay and the output is a copy."""
    import json
    import os
    import shutil

    from dflash_etl.models.devserver import DevServer, SyntheticStates
    from dflash_etl.models.states_server import vllm_layer_ids
    from dflash_etl.stages import extract

    written: dict[str, int] = {}
    complete = SyntheticStates.complete

    def recording(self, ids):
        reply = complete(self, ids)
        path = reply["kv_transfer_params"]["hidden_states_path"]
        written[path] = os.stat(path).st_ino
        return reply

    monkeypatch.setattr(SyntheticStates, "complete", recording)
    served = tmp_path / "served"
    config_only = tmp_path / "config-only"  # the synthetic states are not the target's
    shutil.copytree(tiny_target, config_only, ignore=shutil.ignore_patterns("*.safetensors*"))
    docs, runs = {}, {}
    with DevServer(str(config_only), extract_layers=vllm_layer_ids(LAYERS, 4),
                   states_dir=str(served), synthetic=True) as srv:
        srv.states_dir = served
        for layout, keep in (("native", False), ("speculators", False), ("speculators", True)):
            written.clear()
            run = runs[layout, keep] = copy_run(default_tokenized, tmp_path / f"{layout}-{keep}")
            docs[layout, keep] = extract.run(
                None, run, progress=False, model=str(config_only), layers="1,2",
                format=layout, keep_server_files=keep, **_server_kw(srv))
            files = list((run / "extract" / "hidden_states").glob("*.safetensors"))
            inodes = {f.stat().st_ino for f in files}
            if layout == "speculators" and not keep:
                assert inodes <= set(written.values()) and len(files) == docs[layout, keep][
                    "total"]["rows_out"]  # every row file is a server file, moved
                assert not list(served.glob("*.safetensors"))  # the re-run row's dropped too
            elif keep:
                assert not inodes & set(written.values())  # copies: the server's stay
                assert len(list(served.glob("*.safetensors"))) == len(written)
    content = {k: json.loads((run / "extract" / "stats.json").read_text())["total"][
        "content_sha256"] for k, run in runs.items()}
    assert len(set(content.values())) == 1  # the same states whatever the layout or the move
