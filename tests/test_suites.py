"""The great-expectations suites on real runs of the embedded default: they pass on a good run,
each important expectation fails on a deliberately corrupted copy, and a failing gate stops the
stage with a message that names the expectation, the column, sample values and the report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_etl.cli.main import main
from dflash_etl.core.config import ConfigError
from dflash_etl.validation import row_features, suites
from run_compare import without_keys
from templates_helpers import runs

DEFAULT_LIMITS = {"max_quarantine_rate_per_source": {"openai_chat": 0.10}}


def _failed(result: dict) -> dict[tuple[str, str], dict]:
    """Failing expectations by (type, first column)."""
    return {(e["type"], (e["columns"] or [""])[0]): e
            for e in result["expectations"] if not e["success"]}


def _rewrite_dataset(stage_dir: Path, change) -> None:
    """Apply `change` (polars frame -> frame) to the datasets Arrow file, keeping its schema."""
    path = next((stage_dir / "dataset").glob("*.arrow"))
    # read a copy, not a memory map: the file is overwritten below
    table = pa.ipc.open_stream(pa.BufferReader(path.read_bytes())).read_all()
    frame = change(pl.from_arrow(table))
    new = frame.to_arrow().cast(table.schema)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(new)


def _rewrite_shard(stage_dir: Path, change) -> None:
    shard = next((stage_dir / "conversations").glob("*.parquet"))
    schema = pq.read_schema(shard)
    pq.write_table(change(pl.read_parquet(shard)).to_arrow().cast(schema), shard)


# --------------------------------------------------------------- pure parts (no GE)
def test_longest_runs_matches_a_plain_loop():
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 2, size=rng.integers(0, 12)).astype(np.int8) for _ in range(300)]
    rows += [np.array([], np.int8), np.ones(5, np.int8), np.array([1, 0, 1, 1], np.int8)]
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    values = np.concatenate(rows)

    def loop(row):
        best = run = 0
        for v in row:
            run = run + 1 if v == 1 else 0
            best = max(best, run)
        return best

    assert row_features.longest_runs(values, offsets).tolist() == [loop(r) for r in rows]


def test_thresholds_come_from_the_config_and_unknown_keys_are_refused():
    t = suites.Thresholds.from_section({"share_tolerance": 0.1,
                                        "max_quarantine_rate_per_source": {"a": 0.5}})
    assert t.values["share_tolerance"] == 0.1 and t.values["max_quarantine_rate"] == 0.05
    assert t.quarantine_limit("a") == 0.5 and t.quarantine_limit("b") == 0.05
    with pytest.raises(ConfigError, match=r"unknown keys.*max_quarantine"):
        suites.Thresholds.from_section({"max_quarantine": 0.1})
    with pytest.raises(ConfigError, match="min_mean_supervised_fraction"):
        suites.Thresholds.from_section({"min_mean_supervised_fraction": 0.9,
                                        "max_mean_supervised_fraction": 0.1})


def test_suite_files_name_only_known_parameters():
    params = {**suites.DEFAULTS, "seq_length": 1, "min_supervised_tokens": 2}
    for name in ("conversations", "tokenized"):
        spec = suites.load_suite(name)
        for frame in spec["frames"].values():
            for item in frame["expectations"]:
                suites.resolve(item["kwargs"], params, name)  # raises on an unknown name
                assert item["type"].startswith("expect_") and item["meta"]["why"]


# --------------------------------------------------------------- the gates on a real run
def test_warming_up_builds_the_ge_context_in_a_thread_and_joins_it(monkeypatch):
    import threading

    monkeypatch.setattr(suites, "_GX", {})
    with suites.warming_up(("dflash_etl.report",)) as start:
        assert "batch_definition" not in suites._GX  # nothing happens before start()
        start()
        start()  # a second call starts nothing more
        warmers = [t for t in threading.enumerate() if t.name == "dflash-etl-warm-up"]
        assert len(warmers) <= 1
    assert not [t for t in threading.enumerate() if t.name == "dflash-etl-warm-up"]
    built = suites._GX["batch_definition"]
    assert suites._batch_definition() is built  # the gate reuses what the thread built

    monkeypatch.setattr(suites, "_GX", {})
    with suites.warming_up(("dflash_etl_no_such_module",)) as start:
        start()  # an error in the thread is left for the gate; it does not escape here
    assert "batch_definition" not in suites._GX


def test_default_run_passes_both_gates_and_saves_results(default_run_dir):
    manifest = json.loads((default_run_dir / "manifest.json").read_text())
    for stage, suite in (("ingest", "conversations"), ("tokenize", "tokenized")):
        assert manifest["stages"][stage]["status"] == "complete"
        result = json.loads((default_run_dir / stage / suites.RESULT_FILE).read_text())
        assert result["suite"] == suite and result["passed"], suites.failure_message(
            result, None, Path("-"))
        assert result["statistics"]["evaluated"] >= 10
        assert result["great_expectations"]["rows"]["success"] is True
    ingest = json.loads((default_run_dir / "ingest" / suites.RESULT_FILE).read_text())
    stats = json.loads((default_run_dir / "ingest" / "stats.json").read_text())
    assert ingest["rows"] == stats["total"]["rows_out"]
    weighted = {r["source"]: r for r in ingest["sources"] if r["target_share"] is not None}
    assert set(weighted) == {"orca", "parts"}
    assert all(r["share_error"] <= 0.05 for r in weighted.values())
    tokenized = json.loads((default_run_dir / "tokenize" / suites.RESULT_FILE).read_text())
    assert tokenized["parameters"]["seq_length"] == 1024
    assert tokenized["profile"]["seq_len"]["n"] == tokenized["rows"]
    assert (default_run_dir / "docs" / "index.html").exists()


def test_broken_role_order_fails_with_the_rows_roles(default_run_dir, tmp_path, copy_run):
    stage = copy_run(default_run_dir / "ingest", tmp_path)

    def reverse_first(frame: pl.DataFrame) -> pl.DataFrame:
        messages = frame["messages"].to_list()
        messages[0] = list(reversed(messages[0]))  # assistant first
        return frame.with_columns(pl.Series("messages", messages, dtype=frame["messages"].dtype))

    _rewrite_shard(stage, reverse_first)
    result = suites.run_suite(stage, "conversations",
                              suites.Thresholds.from_section(DEFAULT_LIMITS))
    failed = _failed(result)
    assert set(failed) == {("expect_column_values_to_be_in_set", "role_order_valid"),
                           ("expect_column_values_to_be_in_set", "first_role")}
    order = failed[("expect_column_values_to_be_in_set", "role_order_valid")]
    assert order["unexpected_count"] == 1 and order["samples"] == [False]
    assert order["sample_rows"][0]["roles"].startswith("A")
    first = failed[("expect_column_values_to_be_in_set", "first_role")]
    assert first["samples"] == ["assistant"]
    message = suites.failure_message(result, Path("r/docs/validations/ingest.html"),
                                     stage / "validation.json")
    assert "the conversations suite failed" in message and "2 of 15 expectations" in message
    assert "column 'role_order_valid'" in message and '"roles": "A' in message
    assert "Report: r/docs/validations/ingest.html" in message and "[expectations]" in message


def test_a_single_supervised_token_and_seq_len_over_the_limit_fail(default_run_dir, tmp_path,
                                                                   copy_run):
    stage = copy_run(default_run_dir / "tokenize", tmp_path)
    settings = json.loads((stage / "settings.json").read_text())
    limit = settings["seq_length"]

    def corrupt(frame: pl.DataFrame) -> pl.DataFrame:
        ids, masks = frame["input_ids"].to_list(), frame["loss_mask"].to_list()
        masks[0] = [0] * len(masks[0])
        masks[0][-1] = 1  # one supervised token: nothing for a block drafter to learn
        ids[1] = (ids[1] * (limit // len(ids[1]) + 2))[: limit + 7]  # over seq_length
        masks[1] = (masks[1] * (limit // len(masks[1]) + 2))[: limit + 7]
        seq = frame["seq_len"].to_list()
        seq[1] = limit + 7
        return frame.with_columns(pl.Series("input_ids", ids), pl.Series("loss_mask", masks),
                                  pl.Series("seq_len", seq))

    _rewrite_dataset(stage, corrupt)
    result = suites.run_suite(stage, "tokenized", suites.Thresholds.from_section(DEFAULT_LIMITS))
    failed = _failed(result)
    assert set(failed) == {("expect_column_values_to_be_between", "longest_supervised_run"),
                           ("expect_column_values_to_be_between", "seq_len")}
    run = failed[("expect_column_values_to_be_between", "longest_supervised_run")]
    assert run["samples"] == [1] and run["kwargs"]["min_value"] == 2
    assert run["sample_rows"][0]["supervised_tokens"] == 1
    seq = failed[("expect_column_values_to_be_between", "seq_len")]
    assert seq["samples"] == [limit + 7] and seq["kwargs"]["max_value"] == limit
    text = "\n".join(suites.describe_failure(e) for e in failed.values())
    assert "column 'longest_supervised_run'" in text and "1 of " in text
    assert f"\"max_value\": {limit}" in text and f"[{limit + 7}]" in text


def test_mean_supervised_fraction_bounds_come_from_the_config(default_run_dir):
    tight = suites.Thresholds.from_section({**DEFAULT_LIMITS,
                                            "min_mean_supervised_fraction": 0.9,
                                            "max_mean_supervised_fraction": 1.0})
    result = suites.run_suite(default_run_dir / "tokenize", "tokenized", tight)
    failed = _failed(result)
    assert list(failed) == [("expect_column_mean_to_be_between", "supervised_fraction")]
    entry = failed[("expect_column_mean_to_be_between", "supervised_fraction")]
    assert 0.05 < entry["observed_value"] < 0.9
    assert "observed 0." in suites.describe_failure(entry)


def test_source_share_off_the_mix_fails(default_run_dir, tmp_path, copy_run):
    stage = copy_run(default_run_dir / "ingest", tmp_path)
    orca = pl.read_parquet(next((stage / "conversations").glob("*.parquet"))).filter(
        pl.col("source") == "orca")
    drop = set(orca["id"].to_list()[4:])  # keep 4 orca rows next to 24 parts rows
    _rewrite_shard(stage, lambda f: f.filter(~pl.col("id").is_in(list(drop))))
    stats = json.loads((stage / "stats.json").read_text())
    stats["sources"]["orca"]["rows_out"] -= len(drop)  # the accounting agrees; the mix does not
    (stage / "stats.json").write_text(json.dumps(stats))
    result = suites.run_suite(stage, "conversations",
                              suites.Thresholds.from_section(DEFAULT_LIMITS))
    failed = _failed(result)
    assert list(failed) == [("expect_column_values_to_be_between", "share_error")]
    entry = failed[("expect_column_values_to_be_between", "share_error")]
    assert entry["unexpected_count"] == 2  # orca too low, parts too high
    assert {r["source"] for r in entry["sample_rows"]} == {"orca", "parts"}


def test_quarantine_rate_over_the_maximum_names_the_sources(default_run_dir):
    strict = suites.Thresholds.from_section({"max_quarantine_rate": 0.02})
    result = suites.run_suite(default_run_dir / "ingest", "conversations", strict)
    failed = _failed(result)
    key = ("expect_column_pair_values_a_to_be_greater_than_b", "max_quarantine_rate")
    assert list(failed) == [key]
    # openai_chat 6/99, openai_tools 1/31, glaive 1/21 are above 2%; sharegpt 1/62 is not
    assert {r["source"] for r in failed[key]["sample_rows"]} == {
        "openai_chat", "openai_tools", "glaive"}
    assert failed[key]["unexpected_count"] == 3


def test_a_failed_gate_stops_the_stage_and_explains_itself(failed_gate_run):
    run, code, stderr = failed_gate_run
    assert code == 1
    assert "the conversations suite failed" in stderr
    assert "expect_column_pair_values_a_to_be_greater_than_b" in stderr
    assert "'max_quarantine_rate', 'quarantine_rate'" in stderr and "openai_chat" in stderr
    report = run / "docs" / "validations" / "ingest.html"
    assert f"Report: {report}" in stderr and report.exists()
    assert "FAILED" in report.read_text()
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["ingest"]["status"] == "failed"
    assert "quarantine_rate" in manifest["stages"]["ingest"]["error"]
    assert not (run / "ingest").exists()  # nothing was published
    result = json.loads((run / ".ingest.partial" / suites.RESULT_FILE).read_text())
    assert result["passed"] is False


def test_check_runs_contracts_and_suites_with_a_one_screen_summary(default_run_dir, tmp_path,
                                                                   capsys, copy_run):
    out = tmp_path / "report"
    assert main(["check", str(default_run_dir), "--report", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "PASS ingest: suite 'conversations'" in summary
    assert "PASS tokenize: suite 'tokenized'" in summary
    assert len(summary.splitlines()) < 25
    html = (out / "index.html").read_text()
    assert "Suite tokenized" in html and 'data-status="fail"' not in html

    broken = copy_run(default_run_dir / "tokenize", tmp_path)
    _rewrite_dataset(broken, lambda f: f.with_columns(pl.col("seq_len") + 5000))
    assert main(["check", str(broken), "--suite", "tokenized", "--report",
                 str(tmp_path / "bad.html")]) == 1
    summary = capsys.readouterr().out
    assert "FAIL tokenize: suite 'tokenized'" in summary and "column 'seq_len'" in summary
    assert len(summary.splitlines()) < 40
    assert 'data-status="fail"' in (tmp_path / "bad.html").read_text()
    assert main(["check", str(default_run_dir), "--suite", "nope"]) == 1
    assert "unknown suite 'nope'" in capsys.readouterr().out


def test_docs_command_rebuilds_the_report(default_run_dir, tmp_path, capsys):
    (default_run_dir / "docs" / "index.html").unlink()
    assert main(["docs", "--run", str(default_run_dir)]) == 0
    assert (default_run_dir / "docs" / "index.html").exists()
    assert main(["docs", "--run", str(tmp_path / "nothing")]) == 1
    assert "not a run directory" in capsys.readouterr().err


def _without_timing(value):
    """A suite result without what differs between two validations of the same data."""
    return without_keys(value, VARYING)


VARYING = {"seconds", "run_id", "run_time", "validation_time", "batch_id", "active_batch_id",
           "checkpoint_id", "batch_spec", "batch_markers"}




def _mask_whole(mask: list[int]) -> list[int]:
    return [1] * len(mask)


def _mask_shifted(mask: list[int]) -> list[int]:
    return [0, *mask[:-1]]


def _mask_without_end_of_turn(mask: list[int]) -> list[int]:
    out = list(mask)
    for _, end in runs(out):
        out[end - 1] = 0
    return out


@pytest.mark.parametrize(("mistake", "failing"), [
    (_mask_whole, {"supervised_turn_starts"}),
    (_mask_shifted, {"spans_without_end_of_turn"}),
    (_mask_without_end_of_turn, {"spans_without_end_of_turn"}),
])
def test_a_loss_mask_over_headers_shifted_or_without_the_end_of_turn_fails_the_suite(
        default_run_dir, tmp_path, copy_run, mistake, failing):
    """Masks made by anyone (a script of the user's, a regression here) are checked by the
    tokens they cover: each reply's last supervised token is the end of turn and no turn-start
    marker is supervised (the markers tokenize recorded). The failure-mode benchmark's c, d, e:
    the same rows' suite passed all three before."""
    stage = copy_run(default_run_dir / "tokenize", tmp_path)
    settings = json.loads((stage / "settings.json").read_text())
    assert settings["end_of_turn_ids"] == [2] and settings["turn_start_ids"] == [1]
    clean = suites.run_suite(stage, "tokenized", suites.Thresholds.from_section(DEFAULT_LIMITS))
    assert not _failed(clean)

    def change(frame: pl.DataFrame) -> pl.DataFrame:
        masks = [mistake(m) for m in frame["loss_mask"].to_list()]
        return frame.with_columns(pl.Series("loss_mask", masks))

    _rewrite_dataset(stage, change)
    result = suites.run_suite(stage, "tokenized", suites.Thresholds.from_section(DEFAULT_LIMITS))
    failed = {column for (kind, column) in _failed(result)
              if kind == "expect_column_values_to_be_between"}
    assert failing <= failed
    entry = next(e for e in result["expectations"] if not e["success"]
                 and e["columns"] == [next(iter(failing))])
    # every row for c and e; d shows where a reply does not end its row (shifted, a span
    # ending at the row's end still ends on the end of turn): the suite fails either way
    rows = len(frame_rows(stage))
    assert entry["unexpected_count"] == rows if mistake is not _mask_shifted \
        else 0 < entry["unexpected_count"] < rows
    why = suites.describe_failure(entry)
    assert ("end-of-turn" in why) if "end_of_turn" in next(iter(failing)) else ("headers" in why)


def _cap_replies(ids: list[int], mask: list[int], cap: int) -> tuple[list[int], list[int]]:
    """Each reply longer than `cap` tokens cut there, its end-of-turn token kept after the cut:
    what a generator stopped at max_new_tokens leaves once a template closes the message."""
    out_ids, out_mask, at = [], [], 0
    for start, end in runs(mask):
        reply = [*ids[start:end - 1][:cap], ids[end - 1]]
        out_ids += ids[at:start] + reply
        out_mask += [0] * (start - at) + [1] * len(reply)
        at = end
    return out_ids + ids[at:], out_mask + [0] * (len(ids) - at)


def test_replies_cut_at_a_generation_limit_fail_the_suite_naming_the_source(
        default_run_dir, default_tokenized, tmp_path, copy_run):
    """Replies a generator cut at max_new_tokens before this tool saw them (the failure-mode
    benchmark's f, arriving as data): one source's replies end at one length, mid-text, which
    the suite finds in the tokens, naming that source; the run's own rows pass, and so do the
    sources' own templated replies, every one of a source as long as the others but ending as
    a sentence ends."""
    templated = suites.source_frame(
        default_tokenized / "tokenize", "tokenized",
        suites.row_features(default_tokenized / "tokenize", "tokenized"),
        suites.Thresholds.from_section(DEFAULT_LIMITS)).to_dicts()
    tools = next(r for r in templated if r["source"] == "openai_tools")
    assert tools["rows_at_longest_reply"] == tools["rows_in_output"] > 3
    assert tools["ending_mid_text"] == 0 and tools["capped_reply_share"] == 0
    stage = copy_run(default_run_dir / "tokenize", tmp_path)
    limits = suites.Thresholds.from_section(DEFAULT_LIMITS)
    clean = suites.run_suite(stage, "tokenized", limits)
    assert not _failed(clean)
    cap = 20

    def change(frame: pl.DataFrame) -> pl.DataFrame:
        cut = [_cap_replies(i, m, cap) if source == "openai_chat" else (i, m) for i, m, source
               in zip(frame["input_ids"].to_list(), frame["loss_mask"].to_list(),
                      frame["source"].to_list(), strict=True)]
        return frame.with_columns(pl.Series("input_ids", [i for i, _ in cut]),
                                  pl.Series("loss_mask", [m for _, m in cut]),
                                  pl.Series("seq_len", [len(i) for i, _ in cut]))

    _rewrite_dataset(stage, change)
    result = suites.run_suite(stage, "tokenized", limits)
    assert set(_failed(result)) == {("expect_column_values_to_be_between", "capped_reply_share")}
    entry = _failed(result)[("expect_column_values_to_be_between", "capped_reply_share")]
    assert entry["unexpected_count"] == 1
    why = suites.describe_failure(entry)
    assert "openai_chat" in why and "max_new_tokens" in why
    sources = {r["source"]: r for r in suites.source_frame(
        stage, "tokenized", suites.row_features(stage, "tokenized"), limits).to_dicts()}
    assert sources["openai_chat"]["longest_reply"] == cap
    assert sources["openai_chat"]["capped_reply_share"] > 0.5
    assert sources["openai_chat"]["ending_mid_text"] > sources["openai_chat"][
        "rows_at_longest_reply"] / 2
    assert all(r["capped_reply_share"] == 0 for name, r in sources.items()
               if name != "openai_chat")


def frame_rows(stage: Path) -> list:
    path = next((stage / "dataset").glob("*.arrow"))
    return pa.ipc.open_stream(pa.BufferReader(path.read_bytes())).read_all().column(
        "id").to_pylist()


def test_replies_bunched_near_the_longest_by_a_length_penalty_are_not_a_cut():
    """A length penalty (the tiny Qwen3.6 target's) bunches natural replies near the longest
    length without a spike at it: 3 of 24 rows at 28 tokens, 6 over the 4 lengths below, all
    ending mid-text on random tokens, is a tail, not a cap (it failed the gate before). A cap
    at 28 moving every longer reply there is a spike and fails."""
    tail = [10, 12, 15, 17, 18, 19, 19, 20, 21, 21, 22, 22, 23, 24, 24, 25, 26, 26, 27, 28,
            28, 28, 16, 14]
    capped = [min(n, 20) for n in [*tail, 30, 33, 35, 40, 41]]

    def frame(lengths: list[int]) -> pl.DataFrame:
        return pl.DataFrame({"source": ["s"] * len(lengths), "longest_complete_reply": lengths,
                             "longest_reply_last_token": list(range(len(lengths)))})

    every_token_mid_text = lambda ids: [True] * len(ids)  # noqa: E731
    assert row_features.capped_replies(frame(tail), every_token_mid_text)["s"][
        "capped_reply_share"] == 0
    cut = row_features.capped_replies(frame(capped), every_token_mid_text)["s"]
    assert cut["longest_reply"] == 20 and cut["rows_at_longest_reply"] == capped.count(20) == 20
    assert cut["capped_reply_share"] == 20 / len(capped)
