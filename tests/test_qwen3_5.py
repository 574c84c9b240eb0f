"""Qwen3.5 / Qwen3.6 (transformers `qwen3_5`: Gated DeltaNet linear attention mixed with full
attention) end to end on tiny random-weight models with the real Qwen3.6 tokenizer: the
text-only `Qwen3_5ForCausalLM` and the published vision-language layout
`Qwen3_5ForConditionalGeneration`, whose config is composite (the decoder's fields sit in
`text_config`) and whose decoder is `model.language_model` beside a vision tower."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest

from dflash_etl.core.config import load_config
from dflash_etl.stages import extract, ingest, tokenize
from dflash_etl.validation.check import check_path

REPO = Path(__file__).resolve().parents[1]
LAYERS = 4  # the tiny models' decoder (and vision tower) depth
HIDDEN = 32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: these models are tiny, and on a shared CI machine torch's thread pool
    makes their forward passes many times slower, not faster."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def qwen36_tokenizer(fixtures_dir: Path) -> Path:
    path = fixtures_dir / "qwen36-tokenizer"
    if not (path / "tokenizer.json").exists():
        pytest.skip(f"the Qwen3.6 tokenizer is not at {path}")
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory, qwen36_tokenizer) -> dict[str, Path]:
    pytest.importorskip("torch")
    from dflash_etl.models.tiny_model import build_tiny_qwen3_5

    root = tmp_path_factory.mktemp("qwen3_5")
    return {kind: build_tiny_qwen3_5(root / kind, tokenizer_dir=qwen36_tokenizer,
                                     vl=kind == "vl", hidden_size=HIDDEN, layers=LAYERS)
            for kind in ("text", "vl")}


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, models) -> Path:
    """Three of the embedded default's sources (multi-turn, tool calls), tokenized with the real
    Qwen3.6 template (both tiny models carry the same tokenizer: one run serves both)."""
    root = tmp_path_factory.mktemp("qwen3_5-run")
    (root / "pipeline.toml").write_text("".join(
        f'[[sources]]\nname = "{name}"\npath = "{REPO / "data" / "sources" / name}.jsonl"\n'
        + (f'format = "{fmt}"\n' if fmt else "")
        for name, fmt in (("openai_tools", "openai"), ("glaive", "glaive"), ("parts", None))))
    run_dir = root / "run"
    ingest.run(load_config(root / "pipeline.toml"), run_dir, progress=False)
    tokenize.run(None, run_dir, progress=False, model=str(models["vl"]))
    return run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run_dir, out, ignore=shutil.ignore_patterns("*extract*", "*train*"))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["stages"] = {k: v for k, v in manifest["stages"].items()
                          if k in ("ingest", "tokenize")}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@functools.cache
def _reference_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True).eval()


def _reference(model_dir: Path, ids: list[int]):
    """Each decoder layer's output for one row run alone (no padding), from a model loaded
    independently of the code under test."""
    import torch

    model = _reference_model(model_dir)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    return [h[0] for h in out[1:]]  # [i] is layer i's output (the last one after the norm)


def test_the_vl_layouts_decoder_layers_are_the_language_models(models):
    """Hooks go on `model.language_model.layers`, never on the vision tower's blocks (as many
    here: a search for a ModuleList of the decoder's length finds the tower first)."""
    from transformers import Qwen3_5ForConditionalGeneration

    from dflash_etl.models.target import decoder_layers, text_config

    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(models["vl"]))
    assert len(model.model.visual.blocks) == LAYERS
    assert decoder_layers(model) is model.model.language_model.layers
    assert text_config(model.config).num_hidden_layers == LAYERS


def test_the_vl_checkpoint_loads_as_its_text_decoder_only(models):
    """The target of a VL checkpoint is its language model: the vision tower is never loaded
    (nor run) for text rows."""
    from dflash_etl.models.target import Target, TargetSpec

    target = Target(TargetSpec(model=str(models["vl"]), layers="1,2", device="cpu"))
    names = [name for name, _ in target.model.named_modules()]
    assert not any("visual" in name for name in names)
    assert (target.n_layers, target.hidden) == (LAYERS, HIDDEN)


@pytest.mark.parametrize("kind", ["text", "vl"])
def test_a_padded_batch_of_different_lengths_equals_unbatched_runs(models, kind):
    """Rows of 5, 70 and 130 tokens in one right-padded batch (longer than the delta rule's
    64-token chunks): every layer's states, linear-attention and full-attention alike, equal
    each row run alone."""
    import torch

    from dflash_etl.models.target import Target, TargetSpec

    target = Target(TargetSpec(model=str(models[kind]), layers="0,1,2,3", device="cpu"))
    rows = [[1000 + (7 * i + k) % 5000 for i in range(n)] for k, n in enumerate((5, 70, 130))]
    _, batched = target.forward(rows)
    for ids, got in zip(rows, batched, strict=True):
        want = _reference(models[kind], ids)
        assert got.shape == (len(ids), LAYERS, HIDDEN)
        for layer in range(LAYERS - 1):  # the reference's last entry has the final norm applied
            assert torch.allclose(got[:, layer], want[layer], atol=1e-5), (len(ids), layer)


@pytest.mark.parametrize("kind", ["text", "vl"])
def test_extract_on_qwen3_5_equals_an_independent_forward_pass(models, tokenized, tmp_path,
                                                               kind):
    import datasets
    import pyarrow.parquet as pq
    import torch
    from safetensors import safe_open

    run_dir = _copy(tokenized, tmp_path)
    doc = extract.run(None, run_dir, progress=False, model=str(models[kind]), layers="0,1,2",
                      batch_tokens=4096, shard_rows=100)
    assert doc["total"]["n_layers"] == LAYERS and doc["total"]["hidden_size"] == HIDDEN
    index = pq.read_table(run_dir / "extract" / "index.parquet").to_pylist()
    ids = datasets.load_from_disk(str(run_dir / "tokenize" / "dataset")).with_format(None)[
        "input_ids"]
    assert len(index) == len(ids)
    for entry in index[:: max(1, len(index) // 6)]:
        want = _reference(models[kind], ids[entry["row"]])
        with safe_open(str(run_dir / "extract" / "hidden_states" / entry["shard"]), "pt") as f:
            got = f.get_slice("hidden_states")[entry["offset"]:entry["offset"] + entry["length"]]
        for k in range(3):
            assert torch.allclose(got[:, k], want[k], atol=1e-5), (entry, k)
    assert check_path(run_dir, suites=False)["passed"]


def test_check_fails_a_run_whose_stage_failed(models, tokenized, tmp_path):
    """A stage that failed leaves the manifest saying so; `check` on the run directory must not
    print "all checks passed" over the published stages before it."""
    run_dir = _copy(tokenized, tmp_path)
    broken = tmp_path / "broken-model"
    shutil.copytree(models["vl"], broken)
    (broken / "config.json").write_text('{"model_type": "qwen3_5", "text_config": 7}')
    with pytest.raises(Exception, match="cannot read the target's config"):
        extract.run(None, run_dir, progress=False, model=str(broken))
    assert json.loads((run_dir / "manifest.json").read_text())["stages"]["extract"][
        "status"] == "failed"
    result = check_path(run_dir, suites=False)
    assert not result["passed"]
    assert "FAIL extract" in result["summary"] and "cannot read the target's config" in result[
        "summary"]
    assert "all checks passed" not in result["summary"]
