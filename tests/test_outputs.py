"""core/outputs.py: what the stages and the export read of an upstream output comes from the
files that stage wrote, and a missing field is an error naming the file and the stage to rerun
(no reader falls back to a default of its own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.core.outputs import DrafterOutput, HiddenStatesOutput, TokenizedOutput
from dflash_etl.validation.suites import Thresholds, stage_parameters


def _tokenized(stage: Path, seq_length: int = 100) -> Path:
    stage.mkdir(parents=True)
    (stage / "settings.json").write_text(json.dumps(
        {"seq_length": seq_length, "min_supervised_tokens": 3, "vocab_size": 1226}))
    (stage / "draft_vocab.json").write_text(json.dumps(
        {"size": 512, "d2t": "d2t-512.npy", "t2d": "t2d-512.npy", "t2d_length": 1226}))
    return stage


def _drop(path: Path, key: str, inside: str | None = None) -> None:
    doc = json.loads(path.read_text())
    del (doc[inside] if inside else doc)[key]
    path.write_text(json.dumps(doc))


def test_tokenized_output_is_what_tokenize_wrote(tmp_path):
    stage = _tokenized(tmp_path / "run" / "tokenize")
    out = TokenizedOutput.read(stage)
    assert (out.seq_length, out.min_supervised_tokens, out.vocab_size) == (100, 3, 1226)
    assert out.t2d_file == stage / "t2d-512.npy" and out.d2t_file == stage / "d2t-512.npy"
    assert (out.draft_vocab_size, out.t2d_length) == (512, 1226)
    assert out.dataset_dir == stage / "dataset"


def test_the_tokenized_suite_checks_the_seq_length_tokenize_ran_with(tmp_path):
    stage = _tokenized(tmp_path / "run" / "tokenize", seq_length=100)
    params = stage_parameters(stage, "tokenized", Thresholds.from_section({}))
    assert params["seq_length"] == 100 and params["min_supervised_tokens"] == 3
    _drop(stage / "settings.json", "seq_length")
    with pytest.raises(StageError, match=r"settings.json has no seq_length .*dflash-etl "
                                         r"tokenize --run"):
        stage_parameters(stage, "tokenized", Thresholds.from_section({}))
    (stage / "settings.json").unlink()  # before: the suite checked against 4096, silently
    with pytest.raises(StageError, match=r"settings\.json is missing or unreadable"):
        stage_parameters(stage, "tokenized", Thresholds.from_section({}))


def test_a_missing_field_names_the_file_and_the_stage_to_rerun(tmp_path):
    stage = _tokenized(tmp_path / "run" / "tokenize")
    _drop(stage / "draft_vocab.json", "t2d")
    with pytest.raises(StageError, match=r"draft_vocab\.json has no t2d"):
        TokenizedOutput.read(stage)

    extract = tmp_path / "run" / "extract"
    extract.mkdir()
    total = {"layers": [1, 2], "stored_layers": [1, 2, 3], "n_layers": 4, "hidden_size": 64,
             "format": "speculators", "dtype": "bf16", "quarantine_reasons": {"x": 1}}
    (extract / "stats.json").write_text(json.dumps({"total": total, "sources": {}}))
    states = HiddenStatesOutput.read(extract)
    assert states.stored_layers == [1, 2, 3] and states.dtype == "bf16"
    assert states.index_file == extract / "index.parquet"
    _drop(extract / "stats.json", "dtype", "total")
    with pytest.raises(StageError, match=r"stats.json has no dtype .*dflash-etl extract"):
        HiddenStatesOutput.read(extract)

    drafter = tmp_path / "run" / "train" / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 1, "loss_decay_gamma": 7.0,
         "dflash_config": {"target_layer_ids": [2], "mask_token_id": 9, "block_size": 4}}))
    trained = DrafterOutput.read(drafter.parent)
    assert (trained.block_size, trained.draft_layers, trained.mask_token_id) == (4, 1, 9)
    assert trained.drafter_dir == drafter
    _drop(drafter / "config.json", "block_size", "dflash_config")
    with pytest.raises(StageError, match=r"config.json has no block_size .*dflash-etl train"):
        DrafterOutput.read(drafter.parent)


def test_the_rendered_template_kwargs_are_what_most_rows_were_rendered_with():
    from dflash_etl.core.outputs import rendered_template_kwargs

    total = {"rows_written": 10, "generation_prompt_kwargs": {"enable_thinking=False": 9,
                                                              "reasoning=low,x=1": 1}}
    assert rendered_template_kwargs({"total": total}) == {"enable_thinking": False}
    assert rendered_template_kwargs({"total": {"rows_written": 10}}) == {}
    few = {"rows_written": 10, "generation_prompt_kwargs": {"enable_thinking=False": 5}}
    assert rendered_template_kwargs({"total": few}) == {}  # half is not most
    served = {"serve_with": {"chat_template_kwargs": {"enable_thinking": True}}}
    assert rendered_template_kwargs({"total": total, "on_policy": served}) == {
        "enable_thinking": True}  # regenerate's mode, which the on-policy check held them to
