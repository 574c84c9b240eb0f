"""The ingest stage end to end on real files: accounting, errors, skip/force/resume, mixing."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import polars as pl
import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.stages import ingest, load_config, parse_config

REPO = Path(__file__).resolve().parents[1]


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chat(k: int) -> dict:
    return {"messages": [{"role": "user", "content": f"question {k}"},
                         {"role": "assistant", "content": f"answer {k}"}]}


def _config(tmp_path: Path, sources: list[dict], **run) -> object:
    return parse_config({"run": {"workers": 1, **run}, "sources": sources}, tmp_path)


@pytest.fixture
def suite_gate_calls(monkeypatch) -> list[str]:
    """Stand in for the suite gate: these tests are about accounting, reruns and mixing, and
    each great_expectations gate costs 10-20 s on a 2-core machine. The gates themselves are
    tested in tests/test_suites.py and on the default run. Returns the stages gated."""
    from dflash_etl.validation import suites

    calls: list[str] = []

    def record(stage, suite, stage_dir, run_root, thresholds):
        calls.append(stage)
        return {"passed": True}

    monkeypatch.setattr(suites, "gate", record)
    return calls


def test_default_data_accounts_for_every_row(default_run_dir):
    run_dir = default_run_dir
    stats = json.loads((run_dir / "ingest" / "stats.json").read_text())
    for name, s in [("total", stats["total"]), *stats["sources"].items()]:
        filtered = sum(s["rows_filtered"].values())
        assert s["rows_in"] == s["rows_out"] + s["rows_quarantined"] + filtered, name
    conversations = pl.read_parquet(run_dir / "ingest" / "conversations" / "*.parquet")
    quarantine = pl.read_parquet(run_dir / "ingest" / "quarantine.parquet")
    assert conversations.height == stats["total"]["rows_out"]
    assert quarantine.height == stats["total"]["rows_quarantined"]
    # The broken lines written on purpose into data/sources/openai_chat.jsonl
    chat = stats["sources"]["openai_chat"]
    assert chat["quarantine_reasons"] == {
        "empty_content": 1, "invalid_utf8": 1, "malformed_json": 1, "not_an_object": 1,
        "role_order": 1, "wrong_type": 1,
    }
    assert chat["rows_filtered"] == {"blank_line": 1, "duplicate": 1}
    bad_utf8 = quarantine.filter(pl.col("reason") == "invalid_utf8").row(0, named=True)
    assert bad_utf8["raw_bytes"] == b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'
    assert bad_utf8["file"].endswith("openai_chat.jsonl") and bad_utf8["line"] > 1
    # every format of the embedded default made it through
    assert set(conversations["format"]) == {
        "openai", "sharegpt", "alpaca", "orca", "prompt", "parts", "glaive"
    }
    assert conversations["id"].is_unique().all()
    assert stats["sources"]["sharegpt"]["rows_out"] == 50  # max_rows = 50
    assert stats["sources"]["orca"]["rows_out"] == stats["sources"]["parts"]["rows_out"]  # weights
    prompts = conversations.filter(pl.col("source") == "prompts")
    assert prompts["needs_response"].all()  # prompt-only rows kept, flagged, not padded
    assert stats["total"]["role_mapping"]["developer->system"] > 0


def test_format_mismatch_is_a_clear_error_not_an_empty_dataset(tmp_path):
    _write_jsonl(tmp_path / "chat.jsonl", [_chat(k) for k in range(20)])
    config = _config(tmp_path, [{"name": "orca", "path": "chat.jsonl", "format": "sharegpt"}])
    with pytest.raises(StageError) as info:
        ingest.run(config, tmp_path / "run")
    message = str(info.value)
    assert "0 of 20 rows of source 'orca'" in message
    assert "format_mismatch" in message and "['messages']" in message
    assert "format='auto'" in message
    assert not (tmp_path / "run" / "ingest").exists()  # nothing that looks finished
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["stages"]["ingest"]["status"] == "failed"


def test_unrecognised_rows_name_the_keys_seen(tmp_path):
    _write_jsonl(tmp_path / "x.jsonl", [{"traj": [{"role": "user", "content": "hi"}]}] * 3)
    config = _config(tmp_path, [{"name": "agentic", "path": "x.jsonl"}])
    with pytest.raises(StageError, match=r"keys seen: \['traj'\]"):
        ingest.run(config, tmp_path / "run")
    # ... and [sources.fields] is the fix the message points to
    config = _config(tmp_path, [{"name": "agentic", "path": "x.jsonl",
                                 "fields": {"messages": "traj"}}], dedup=False)
    doc = ingest.run(config, tmp_path / "run")
    assert doc["total"]["rows_out"] == 3


def test_path_matching_nothing_is_an_error(tmp_path):
    config = _config(tmp_path, [{"name": "gone", "path": "missing/*.jsonl"}])
    with pytest.raises(StageError, match="matched no"):
        ingest.run(config, tmp_path / "run")


def test_rerun_skips_force_redoes_and_changed_input_reruns(tmp_path, suite_gate_calls):
    src = _write_jsonl(tmp_path / "a.jsonl", [_chat(k) for k in range(10)])
    config = _config(tmp_path, [{"name": "a", "path": "a.jsonl"}])
    first = ingest.run(config, tmp_path / "run")
    assert not first.get("skipped")
    assert ingest.run(config, tmp_path / "run").get("skipped") is True
    assert suite_gate_calls == ["ingest"]  # a skipped stage is not validated again
    assert not ingest.run(config, tmp_path / "run", force=True).get("skipped")
    _write_jsonl(src, [_chat(k) for k in range(12)])
    changed = ingest.run(config, tmp_path / "run")
    assert not changed.get("skipped") and changed["total"]["rows_out"] == 12
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["inputs"][0]["size"] == src.stat().st_size
    assert manifest["stages"]["ingest"]["status"] == "complete"


def test_interrupted_run_resumes_from_finished_units(tmp_path, monkeypatch, suite_gate_calls):
    for k in range(3):
        _write_jsonl(tmp_path / f"part{k}.jsonl", [_chat(10 * k + j) for j in range(5)])
    config = _config(tmp_path, [{"name": "p", "path": "part*.jsonl"}])
    real = ingest.IngestStage.process_batch
    calls: list[int] = []

    def crash_on_third(stage, batch, item):
        if item.index == 2:
            raise KeyboardInterrupt
        calls.append(item.index)
        return real(stage, batch, item)

    monkeypatch.setattr(ingest.IngestStage, "process_batch", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        ingest.run(config, tmp_path / "run")
    assert calls == [0, 1] and not (tmp_path / "run" / "ingest").exists()
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["stages"]["ingest"]["status"] == "failed"  # never left "running"

    def count(stage, batch, item):
        calls.append(item.index)
        return real(stage, batch, item)

    monkeypatch.setattr(ingest.IngestStage, "process_batch", count)
    doc = ingest.run(config, tmp_path / "run")
    assert calls == [0, 1, 2]  # only the unfinished unit ran again
    assert doc["total"]["rows_out"] == 15
    ingest.run(config, tmp_path / "other")
    assert _frame(tmp_path / "run").equals(_frame(tmp_path / "other"))


def _frame(run_dir: Path) -> pl.DataFrame:
    return pl.read_parquet(run_dir / "ingest" / "conversations" / "*.parquet")


def test_same_config_and_inputs_give_the_same_output(tmp_path, default_run_dir,
                                                     suite_gate_calls):
    """A copy of data/ ingested with one worker gives the rows of the default run (one worker
    per core, the repository's data/), file paths aside."""
    shutil.copytree(REPO / "data", tmp_path / "data")
    config = load_config(tmp_path / "data" / "pipeline.toml")
    ingest.run(config, tmp_path / "r1", workers=1)
    assert _frame(tmp_path / "r1").drop("file").equals(_frame(default_run_dir).drop("file"))


def test_seeded_sampling_dedup_and_weights_are_counted(tmp_path, suite_gate_calls):
    _write_jsonl(tmp_path / "big.jsonl", [_chat(k) for k in range(100)] + [_chat(0)] * 5)
    _write_jsonl(tmp_path / "small.jsonl", [_chat(1000 + k) for k in range(30)])
    _write_jsonl(tmp_path / "w.jsonl", [_chat(2000 + k) for k in range(40)])
    sources = [
        {"name": "big", "path": "big.jsonl", "max_rows": 60},
        {"name": "small", "path": "small.jsonl", "weight": 1.0},
        {"name": "w", "path": "w.jsonl", "weight": 2.0},
    ]
    doc = ingest.run(_config(tmp_path, sources, seed=7), tmp_path / "a")
    big, small, w = (doc["sources"][n] for n in ("big", "small", "w"))
    assert big["rows_filtered"] == {"duplicate": 5, "max_rows": 40} and big["rows_out"] == 60
    assert small["rows_out"] == 20 and small["rows_filtered"] == {"mix_weight": 10}
    assert w["rows_out"] == 40 and w["rows_filtered"] == {}
    again = ingest.run(_config(tmp_path, sources, seed=7), tmp_path / "b")
    assert again == doc and _frame(tmp_path / "a").equals(_frame(tmp_path / "b"))
    other = ingest.run(_config(tmp_path, sources, seed=8), tmp_path / "c")
    assert other["sources"]["big"]["rows_out"] == 60
    assert not _frame(tmp_path / "a")["id"].equals(_frame(tmp_path / "c")["id"])


# ---------------------------------------------------------------- hostile inputs (issue 16 §4)
def test_unreadable_files_are_quarantined_rows_and_the_run_goes_on(tmp_path, suite_gate_calls):
    data = tmp_path / "data"
    data.mkdir()
    _write_jsonl(data / "good.jsonl", [_chat(k) for k in range(20)])
    (data / "empty.parquet").write_bytes(b"")
    (data / "fake.parquet").write_text(json.dumps(_chat(99)) + "\n")
    (data / "fake.jsonl.gz").write_text(json.dumps(_chat(98)) + "\n")
    config = _config(tmp_path, [{"name": "d", "path": "data/*"}])
    stats = ingest.run(config, tmp_path / "run")
    assert stats["total"]["rows_out"] == 20 and stats["total"]["rows_in"] == 23
    assert stats["total"]["quarantine_reasons"] == {"unreadable_file": 3}
    quarantine = pl.read_parquet(tmp_path / "run" / "ingest" / "quarantine.parquet")
    by_file = {Path(f).name: m for f, m in quarantine.select("file", "message").iter_rows()}
    assert set(by_file) == {"empty.parquet", "fake.parquet", "fake.jsonl.gz"}
    assert "cannot read it as Parquet" in by_file["fake.parquet"]
    assert "cannot decompress" in by_file["fake.jsonl.gz"]


def test_a_gzip_bomb_stops_at_the_configured_ceiling(tmp_path, suite_gate_calls):
    line = (json.dumps(_chat(0)) + "\n").encode()
    _write_jsonl(tmp_path / "ok.jsonl", [_chat(k) for k in range(1, 500)])
    (tmp_path / "bomb.jsonl.gz").write_bytes(gzip.compress(line * 200_000))  # ~14 MB inside
    sources = [{"name": "ok", "path": "ok.jsonl"}, {"name": "bomb", "path": "bomb.jsonl.gz"}]
    config = parse_config({"run": {"workers": 1}, "ingest": {"max_decompressed_bytes": 10_000},
                           "sources": sources}, tmp_path)
    stats = ingest.run(config, tmp_path / "run")
    bomb = stats["sources"]["bomb"]
    assert bomb["quarantine_reasons"] == {"decompressed_too_large": 1}
    assert bomb["rows_in"] == 10_000 // len(line) + 1
    assert bomb["rows_filtered"] == {"duplicate": 10_000 // len(line) - 1}  # the same row
    # the flag wins over the config, and a changed ceiling is a different run
    again = ingest.run(config, tmp_path / "run", max_decompressed_bytes=20_000)
    assert not again.get("skipped") and again["sources"]["bomb"]["rows_in"] > bomb["rows_in"]


def test_symlink_loops_are_not_followed_and_duplicates_are_counted(tmp_path, suite_gate_calls):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    _write_jsonl(d / "a.jsonl", [_chat(k) for k in range(3)])
    _write_jsonl(d / "sub" / "b.jsonl", [_chat(k) for k in range(3, 6)])
    os.symlink(d, d / "sub" / "loop")
    os.symlink(d / "a.jsonl", d / "sub" / "a_again.jsonl")
    config = _config(tmp_path, [{"name": "d", "path": "d/**/*.jsonl"}])
    stats = ingest.run(config, tmp_path / "run")
    assert stats["total"]["rows_in"] == 6 and stats["total"]["rows_out"] == 6
    assert stats["sources"]["d"]["paths_skipped"] == {"duplicate_file": 1,
                                                      "visited_directory": 1}
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert sorted(Path(i["path"]).name for i in manifest["inputs"]) == ["a.jsonl", "b.jsonl"]


def test_a_source_with_no_rows_is_a_warning_or_with_strict_sources_an_error(
        tmp_path, suite_gate_calls, capsys):
    from dflash_etl.cli.main import main

    _write_jsonl(tmp_path / "rows.jsonl", [_chat(k) for k in range(5)])
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "x.jsonl").write_text("\n\n")
    (tmp_path / "half").mkdir()
    _write_jsonl(tmp_path / "half" / "a.jsonl", [_chat(9)])
    (tmp_path / "half" / "b.jsonl").write_bytes(b"")
    sources = [{"name": "rows", "path": "rows.jsonl"}, {"name": "empty", "path": "empty.jsonl"},
               {"name": "blank", "path": "blank/*.jsonl"}, {"name": "half", "path": "half"}]
    config_file = tmp_path / "pipeline.toml"
    config_file.write_text("[run]\nworkers = 1\n" + "".join(
        f'[[sources]]\nname = "{s["name"]}"\npath = "{s["path"]}"\n' for s in sources))
    assert main(["ingest", "--config", str(config_file), "--run", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    stats = json.loads((tmp_path / "run" / "ingest" / "stats.json").read_text())
    warnings = stats["warnings"]
    assert len(warnings) == 3 and all(w in out for w in warnings)
    assert "source 'empty' ('empty.jsonl') yielded no rows" in warnings[0]
    assert "source 'blank' ('blank/*.jsonl') yielded no rows" in warnings[1]
    assert "source 'half': file" in warnings[2] and warnings[2].endswith("b.jsonl yielded no rows")
    from dflash_etl.report.collect import collect
    from dflash_etl.report.pages import summary_page

    html = summary_page(tmp_path / "run", *collect(tmp_path / "run"))
    assert "Warnings" in html and "source &#x27;empty&#x27;" in html
    config_file.write_text(config_file.read_text() + "[ingest]\nstrict_sources = true\n")
    assert main(["ingest", "--config", str(config_file), "--run", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "source 'empty'" in err and "source 'blank'" in err and "strict_sources" in err
    assert "'half'" not in err  # a source with rows but one empty file is only a warning


def test_a_source_its_filters_emptied_gets_the_hint_of_those_filters(tmp_path):
    """Rows read without error and all filtered: the hint says which filter took them, not
    "set format=" (which was said for every empty source)."""
    (tmp_path / "blank.jsonl").write_text("\n\n  \n")
    (tmp_path / "pipeline.toml").write_text('[[sources]]\nname = "blank"\npath = "blank.jsonl"\n')
    with pytest.raises(StageError) as failed:
        ingest.run(load_config(tmp_path / "pipeline.toml"), tmp_path / "run", progress=False,
                   workers=1)
    assert "its lines are blank" in str(failed.value)
    assert "set format=" not in str(failed.value)
