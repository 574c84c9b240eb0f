"""The CLI as a user runs it: the embedded default end to end, and `check` for CI."""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import sys
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_etl.cli.main import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def default_run(default_cli_run) -> Path:
    """`dflash-etl run` exactly as the README's `make run` calls it (the session's shared run)."""
    cwd, result = default_cli_run
    assert result.returncode == 0, result.stderr
    assert "ingest done" in result.stdout
    assert str(Path("runs/default/ingest/conversations")) in result.stdout
    return cwd / "runs" / "default"


def test_run_writes_outputs_manifest_and_counts(default_run):
    manifest = json.loads((default_run / "manifest.json").read_text())
    stage = manifest["stages"]["ingest"]
    assert stage["status"] == "complete" and stage["counts"]["rows_out"] > 300
    assert {i["source"] for i in manifest["inputs"]} >= {"openai_chat", "glaive", "orca"}
    assert all(len(i["sha256"]) == 64 for i in manifest["inputs"])
    assert manifest["packages"]["polars"] and manifest["config_hash"]
    assert not any(p.name.startswith(".") for p in default_run.iterdir() if p.is_dir())


def test_run_prints_each_stages_wall_time(default_run, default_cli_run):
    """The README promises a default run of about a minute: the run says what each stage took
    (the manifest alone had it)."""
    if os.environ.get("DFLASH_TEST_DEFAULT_RUN"):
        pytest.skip("a reused run has no output of its own")
    line = next(x for x in default_cli_run[1].stdout.splitlines() if x.startswith("wall time:"))
    timed = re.findall(r"(\w+) ([0-9.]+) s", line.split(";")[0])
    assert [name for name, _ in timed] == ["ingest", "regenerate", "tokenize", "extract", "train"]
    total = float(re.search(r"; ([0-9.]+) s in all", line).group(1))
    assert abs(total - sum(float(s) for _, s in timed)) <= 0.05 * len(timed)
    assert all(float(s) > 0 for _, s in timed)


def test_check_passes_on_a_good_output_and_fails_on_a_corrupted_one(default_run, tmp_path,
                                                                     capsys):
    assert main(["check", str(default_run / "ingest")]) == 0
    assert "PASS ingest" in capsys.readouterr().out

    broken = tmp_path / "ingest"
    import shutil

    shutil.copytree(default_run / "ingest", broken)
    shard = next((broken / "conversations").glob("*.parquet"))
    frame = pl.read_parquet(shard)
    swapped = frame["messages"].to_list()
    swapped[0] = list(reversed(swapped[0]))  # assistant first: role order broken
    frame = frame.with_columns(
        pl.Series("messages", swapped, dtype=frame.schema["messages"]),
        pl.when(pl.int_range(pl.len()) == 1).then(pl.lit("user")).otherwise(pl.col("source"))
        .alias("source"),
    )
    frame = pl.concat([frame, frame.head(1)])  # a duplicated id
    pq.write_table(frame.to_arrow().cast(pa.schema(pq.read_schema(shard))), shard)
    report_path = tmp_path / "report.json"
    assert main(["check", str(broken), "--json", str(report_path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL ingest" in out and "role_order_valid" in out and "unique" in out
    report = json.loads(report_path.read_text())
    checks = {f["check"] for s in report["stages"] for f in s["failures"]}
    assert {"role_order_valid", "unique"} <= checks

    stats = json.loads((broken / "stats.json").read_text())
    stats["total"]["rows_out"] += 1
    (broken / "stats.json").write_text(json.dumps(stats))
    assert main(["check", str(broken)]) == 1
    assert "accounting" in capsys.readouterr().out


def test_check_on_a_run_dir_and_on_nothing(default_run, tmp_path, capsys):
    assert main(["check", str(default_run)]) == 0
    out = capsys.readouterr().out
    for stage in ("ingest", "regenerate", "tokenize", "extract", "train"):
        assert f"PASS {stage} (" in out, stage
    assert main(["check", str(tmp_path)]) == 1
    assert "no stage output found" in capsys.readouterr().out


def test_check_catches_corrupted_hidden_states_and_a_broken_drafter(default_run, tmp_path,
                                                                   capsys):
    """The extract and train contracts, as CI runs them: a NaN in a shard and an out-of-range
    tau fail with what and where; the intact copies pass."""
    import torch
    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    shutil.copytree(default_run, run, ignore=shutil.ignore_patterns("target", "docs"))
    assert main(["check", str(run / "extract")]) == 0
    assert main(["check", str(run / "train")]) == 0
    capsys.readouterr()
    shard = sorted((run / "extract" / "hidden_states").glob("*.safetensors"))[0]
    tensors = load_file(str(shard))
    tensors["hidden_states"][0, 0, 0] = torch.nan
    save_file(tensors, str(shard))
    evaluation = json.loads((run / "train" / "eval.json").read_text())
    (run / "train" / "eval.json").write_text(json.dumps({**evaluation, "tau_final": 99.0}))
    assert main(["check", str(run)]) == 1
    out = capsys.readouterr().out
    assert "FAIL extract" in out and "non-finite values" in out
    assert "FAIL train" in out and "tau_final = 99.0" in out


def test_python_dash_m_runs_like_the_subcommand(tmp_path, monkeypatch, capsys):
    """`python -m dflash_etl ingest ...` (the one entry; no per-module shims), run in this
    process (a subprocess would pay great_expectations' import again)."""
    rows = [{"messages": [{"role": "user", "content": f"q{k}"},
                          {"role": "assistant", "content": f"a{k}"}]} for k in range(5)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "pipeline.toml").write_text('[[sources]]\nname = "mini"\npath = "rows.jsonl"\n')
    monkeypatch.setattr(sys, "argv", [
        "dflash_etl", "ingest", "--config", str(tmp_path / "pipeline.toml"),
        "--run", str(tmp_path / "r"), "--workers", "1",
    ])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("dflash_etl", run_name="__main__", alter_sys=True)
    assert exit_info.value.code == 0, capsys.readouterr().err
    stats = json.loads((tmp_path / "r" / "ingest" / "stats.json").read_text())
    assert stats["total"]["rows_out"] == 5
    assert "ingest done" in capsys.readouterr().out


def test_the_entries_before_the_one_entry_are_refused_not_silent(tmp_path):
    """`python -m dflash_etl.stages.ingest` ran the stage before `python -m dflash_etl ingest`
    did: it now ends with exit 1 naming the command to run, never exit 0 having done nothing."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    for module, command in (("dflash_etl.stages.ingest", "ingest"),
                            ("dflash_etl.evaluate", "eval")):
        result = subprocess.run([sys.executable, "-m", module, "--run", str(tmp_path / "r")],
                                capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 1
        assert f"run `python -m dflash_etl {command} ...`" in result.stderr
    assert not (tmp_path / "r").exists()


def test_errors_exit_nonzero_with_a_message(tmp_path, capsys):
    (tmp_path / "bad.toml").write_text(
        '[[sources]]\nname = "x"\npath = "x.jsonl"\nformat = "csv"\n'
    )
    assert main(["ingest", "--config", str(tmp_path / "bad.toml"), "--run", str(tmp_path)]) == 1
    assert "format='csv'" in capsys.readouterr().err


def test_check_names_a_corrupt_manifest(ingest_rows, capsys):
    """`check` on a run whose manifest.json is cut was an internal error (reliability issue,
    item 13): it names the file, as the other commands do."""
    run = ingest_rows([{"messages": [{"role": "user", "content": f"q{k}"},
                                     {"role": "assistant", "content": f"a{k}"}]}
                       for k in range(3)], "mini")
    (run / "manifest.json").write_text('{"stages": {"ingest": {"status": "compl')
    assert main(["check", str(run)]) == 1
    captured = capsys.readouterr()
    assert "manifest.json is not valid JSON" in captured.err + captured.out
    assert "internal error" not in captured.err


def test_the_report_never_writes_into_a_folder_it_did_not_make(ingest_rows, capsys):
    """A stage run with `--run .` in a project that has a docs/ folder overwrote its index.html
    and deleted its docs/validations/*.html (reliability issue, item 17): a docs/ holding files
    the report did not write is left as it is, and `dflash-etl docs` says why."""
    rows = [{"messages": [{"role": "user", "content": f"q{k}"},
                          {"role": "assistant", "content": f"a{k}"}]} for k in range(3)]
    run = ingest_rows(rows, "mini")
    shutil.rmtree(run / "docs")
    (run / "docs" / "validations").mkdir(parents=True)
    (run / "docs" / "index.html").write_text("the project's own page")
    (run / "docs" / "validations" / "ingest.html").write_text("the project's own")
    (run / "docs" / "guide.md").write_text("# the project's guide")
    assert main(["docs", "--run", str(run)]) == 1
    assert "holds files the report did not write" in capsys.readouterr().err
    assert (run / "docs" / "index.html").read_text() == "the project's own page"
    assert (run / "docs" / "validations" / "ingest.html").read_text() == "the project's own"
