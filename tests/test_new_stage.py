"""A sixth stage is one class plus its place in the order (docs/architecture.md, "Adding a
stage"): declared here, in a test module, it gets its subcommand and flags, its config section
(checked like every other), `run`, its contract and suite as the kind it writes has them, its
accounting checked, its report, and the stage after it reads its output."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from dflash_etl.cli.main import main
from dflash_etl.core.accounting import Stats, stats_document
from dflash_etl.core.outputs import ConversationsOutput
from dflash_etl.core.rundir import sha256_file
from dflash_etl.core.settings import fingerprinted, setting
from dflash_etl.core.stage import Stage, StageContext
from dflash_etl.runner import Pipeline
from dflash_etl.stages.ingest import IngestStage
from dflash_etl.stages.tokenize import TokenizeStage

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------ the whole new stage
@dataclass(frozen=True)
class SignSettings:
    """[sign] in pipeline.toml."""

    signature: str = setting(" -- signed", help="appended to every assistant reply")


class SignStage(Stage):
    """Conversations -> the same conversations, every reply signed."""

    name = "sign"
    help = "append a signature to every assistant reply"
    Settings = SignSettings
    reads = (ConversationsOutput,)
    writes = ConversationsOutput

    def prepare(self, ctx: StageContext) -> dict[str, Any]:
        self.files = ctx.read(ConversationsOutput).files()
        return {"settings": fingerprinted(self.settings),
                "inputs": [sha256_file(f) for f in self.files]}

    def execute(self, ctx: StageContext) -> dict[str, Any]:
        rows = pl.read_parquet(self.files).to_dicts()
        per_source: dict[str, Stats] = {}
        for row in rows:
            stats = per_source.setdefault(row["source"], Stats())
            stats.rows_in += 1
            stats.rows_out += 1
            for message in row["messages"]:
                if message["role"] == "assistant" and message["content"]:
                    message["content"] += self.settings.signature
        (ctx.partial / "conversations").mkdir()
        frame = pl.DataFrame(rows, schema=pl.read_parquet_schema(self.files[0]))
        frame.write_parquet(ctx.partial / "conversations" / "part-00000.parquet")
        return stats_document(per_source, self.name)


# ------------------------------------------------------------ its place in the order
PIPELINE = Pipeline(IngestStage, SignStage, TokenizeStage)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"question {k}?"},
                          {"role": "assistant", "content": f"answer {k}."}]} for k in range(6)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = tmp_path / "pipeline.toml"
    path.write_text(f'[[sources]]\nname = "chat"\npath = "rows.jsonl"\n\n[sign]\n'
                    f'signature = " ~ ok"\n\n[tokenize]\nmodel = "{REPO / "data" / "tokenizer"}"\n'
                    'seq_length = 256\n')
    return path


def test_a_stage_declared_in_one_class_runs_in_its_place(config, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["run", "--config", str(config), "--run", str(run), "--workers", "1"],
                pipeline=PIPELINE) == 0
    out = capsys.readouterr().out
    assert "wall time: ingest" in out and "sign" in out and "tokenize" in out
    signed = pl.read_parquet(run / "sign" / "conversations" / "*.parquet")
    replies = [m["content"] for ms in signed["messages"].to_list() for m in ms
               if m["role"] == "assistant"]
    assert len(replies) == 6 and all(r.endswith(" ~ ok") for r in replies)  # its [sign] section
    # its kind's gates ran on it: the conversations contract and suite
    assert json.loads((run / "sign" / "validation.json").read_text())["passed"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["tokenize"]["built_on"].keys() == {"sign"}  # read its output
    assert "sign" in (run / "docs" / "index.html").read_text()
    assert main(["check", str(run)], pipeline=PIPELINE) == 0
    assert "PASS sign (" in capsys.readouterr().out


def test_its_subcommand_flags_and_section_are_checked(config, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["sign", "--help"], pipeline=PIPELINE)
    assert "appended to every assistant reply" in capsys.readouterr().out
    config.write_text(config.read_text().replace("signature =", "signatur ="))
    assert main(["ingest", "--config", str(config), "--run", str(tmp_path / "r")],
                pipeline=PIPELINE) == 1
    assert "[sign]: unknown key signatur; did you mean signature?" in capsys.readouterr().err
