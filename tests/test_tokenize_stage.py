"""The tokenize stage on real files: the project's tokenizer and the real Qwen3.6 one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dflash_etl.cli.main import main
from dflash_etl.core.errors import StageError
from dflash_etl.core.schema import TOKENIZED_ROWS
from dflash_etl.io.hf_dataset import save_dataset
from dflash_etl.models.tokenizer import load_tokenizer
from dflash_etl.stages import ingest, parse_config, tokenize

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = REPO / "data" / "tokenizer"
QWEN = REPO.parent / "shared" / "fixtures" / "qwen36-tokenizer"


def _rows() -> list[dict]:
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    return [
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "What is 12 + 30?"},
                      {"role": "assistant", "content": "12 + 30 = 42."},
                      {"role": "user", "content": "And 5 * 6?"},
                      {"role": "assistant", "content": "5 * 6 = 30.",
                       "reasoning_content": "Multiply five by six."}]},
        {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                      {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                          "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                      {"role": "tool", "content": "{\"temp_c\": 3}"},
                      {"role": "assistant", "content": "It is 3 degrees in Oslo."}],
         "tools": [weather]},
        {"prompt": "Summarize the water cycle."},  # no reply yet: filtered, never padded
        {"messages": [{"role": "user", "content": "Say hi"},
                      {"role": "assistant", "content": "Hello there, friend."}]},
    ]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("tok")
    (base / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    config = parse_config({"run": {"workers": 1},
                           "sources": [{"name": "mini", "path": "rows.jsonl"}]}, base)
    ingest.run(config, base / "run")
    tokenize.run(config, base / "run", workers=1, model=str(DEFAULT_TOKENIZER),
                 draft_vocab_size=64, seq_length=512)
    return base / "run"


def test_dataset_loads_with_datasets_and_masks_decode_to_replies(run_dir):
    from datasets import load_from_disk

    dataset = load_from_disk(str(run_dir / "tokenize" / "dataset"))
    # torch format, as speculators' preprocessing saves its datasets and its loader expects
    assert dataset.format["type"] == "torch" and dataset.format["output_all_columns"]
    assert dataset.format["columns"] == ["input_ids", "loss_mask", "seq_len"]
    dataset = dataset.with_format("numpy")
    assert {"input_ids", "loss_mask", "seq_len", "id", "source", "turn"} <= set(
        dataset.column_names)
    assert dataset.features["input_ids"].feature.dtype == "int32"
    assert dataset.num_rows == 3  # the prompt-only conversation has nothing to supervise
    tok = load_tokenizer(str(DEFAULT_TOKENIZER))
    texts = []
    for row in dataset:
        ids, mask = np.array(row["input_ids"]), np.array(row["loss_mask"])
        assert len(ids) == len(mask) == row["seq_len"]
        # supervised spans, decoded independently of the stage's own verification
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        spans = [tok.decode(ids[s:e].tolist()) for s, e in zip(edges[::2], edges[1::2])]
        texts.append(spans)
        for s, e in zip(edges[::2], edges[1::2]):
            assert mask[s - 1] == 0 and tok.decode(ids[s - 1:s].tolist()).endswith("\n")
            assert e == len(mask) or mask[e] == 0
    flat = [t for spans in texts for t in spans]
    assert "12 + 30 = 42.<|im_end|>" in flat
    assert "<think>\nMultiply five by six.\n</think>\n\n5 * 6 = 30.<|im_end|>" in flat
    assert any('"arguments": {"city": "Oslo"}' in t and t.endswith("<|im_end|>") for t in flat)
    assert "It is 3 degrees in Oslo.<|im_end|>" in flat
    assert not any("Summarize" in t or "user" in t for t in flat)


def _load_torch_dict(path: Path) -> dict:
    """torch.load's reading of a tensor-free file, without importing torch (a minute or two here):
    torch's zip records, and a pickle that needs no class at all (so weights_only=True loads it).
    Checked against torch 2.13's own torch.save output and torch.load (see the torch_pickle
    module)."""
    import pickle
    import zipfile

    class NoClasses(pickle.Unpickler):
        def find_class(self, module, name):
            raise AssertionError(f"token_freq.pt must hold plain data, found {module}.{name}")

    with zipfile.ZipFile(path) as zf:
        names = {n.split("/", 1)[1] for n in zf.namelist()}
        assert names == {"data.pkl", ".format_version", ".storage_alignment", "byteorder",
                         "version", ".data/serialization_id"}
        root = zf.namelist()[0].split("/", 1)[0]
        assert zf.read(f"{root}/version") == b"3\n" and zf.read(f"{root}/byteorder") == b"little"
        return NoClasses(zf.open(f"{root}/data.pkl")).load()


def test_accounting_token_freq_and_draft_vocab(run_dir):
    from datasets import load_from_disk

    out = run_dir / "tokenize"
    stats = json.loads((out / "stats.json").read_text())
    total = stats["total"]
    assert total["rows_in"] == 4 and total["rows_out"] == 3
    assert total["rows_in"] == total["rows_out"] + total["rows_quarantined"] + sum(
        total["rows_filtered"].values())
    assert sum(total["rows_filtered"].values()) == 1
    dataset = load_from_disk(str(out / "dataset")).with_format(None)
    counted: dict[int, int] = {}
    for row in dataset:
        for t, m in zip(row["input_ids"], row["loss_mask"]):
            if m:
                counted[t] = counted.get(t, 0) + 1
    assert _load_torch_dict(out / "token_freq.pt") == counted
    assert json.loads((out / "token_freq.json").read_text())["supervised_tokens"] == sum(
        counted.values())
    d2t, t2d = np.load(out / "d2t-64.npy"), np.load(out / "t2d-64.npy")  # speculators' names
    assert d2t.shape == (64,) and t2d.dtype == bool and t2d.sum() == 64
    assert t2d.shape == (len(load_tokenizer(str(DEFAULT_TOKENIZER))),)  # no config.json there
    assert t2d[np.arange(64) + d2t].all()  # target = draft index + offset
    top = sorted(counted, key=lambda t: (-counted[t], t))[:64]
    assert set(top) <= set(np.flatnonzero(t2d).tolist())
    probe = json.loads((out / "probe.json").read_text())
    assert probe["strategy"] and probe["reason"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"]["tokenize"]["status"] == "complete"
    assert manifest["stages"]["tokenize"]["settings"]["seq_length"] == 512


def test_stats_say_how_each_conversation_was_rendered(run_dir):
    """stats.json: the written conversations per render path and the renders they took;
    probe.json: whether the one-render path is on for the template (checked by the probe)."""
    out = run_dir / "tokenize"
    total = json.loads((out / "stats.json").read_text())["total"]
    probe = json.loads((out / "probe.json").read_text())
    assert probe["fast_paths"]["one_render"] is True
    assert sum(total["render_paths"].values()) == total["rows_out"] == 3
    assert total["render_paths"] == {"one_render": 3}, total["render_paths"]
    assert total["renders"] == 3  # one each (no cross-checked conversation among three)


def test_check_fails_on_a_corrupted_mask(run_dir, tmp_path, capsys):
    import shutil

    from datasets import load_from_disk

    assert main(["check", str(run_dir / "tokenize")]) == 0
    broken = tmp_path / "tokenize"
    shutil.copytree(run_dir / "tokenize", broken)
    dataset = load_from_disk(str(broken / "dataset"), keep_in_memory=True)
    bad = dataset.map(lambda r: {"loss_mask": [0] * len(r["loss_mask"])}
                      if r["turn"] in (-1, 0) else r, features=dataset.features,
                      keep_in_memory=True)
    shutil.rmtree(broken / "dataset")
    bad.save_to_disk(str(broken / "dataset"))
    assert main(["check", str(broken)]) == 1
    assert "enough_supervised" in capsys.readouterr().out


def test_missing_ingest_and_missing_model_are_clear_errors(tmp_path):
    with pytest.raises(StageError, match="run `dflash-etl ingest`"):
        tokenize.run(None, tmp_path / "nothing", model=str(DEFAULT_TOKENIZER))
    with pytest.raises(StageError, match="--model"):
        tokenize.run(None, tmp_path / "nothing")


@pytest.mark.parametrize("layout", ["text", "vision_language"])
def test_t2d_spans_the_models_padded_vocabulary(run_dir, tmp_path, layout):
    """A checkpoint pads its embedding beyond the tokenizer; t2d is sized to the model (what
    speculators checks it against), and draft tokens stay real tokens."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(DEFAULT_TOKENIZER, model)
    real = len(load_tokenizer(str(DEFAULT_TOKENIZER)))
    padded = real + 11
    config = ({"model_type": "qwen3", "vocab_size": padded} if layout == "text" else
              {"model_type": "qwen3_5", "text_config": {"vocab_size": padded}})
    (model / "config.json").write_text(json.dumps(config))
    shutil.copytree(run_dir / "ingest", tmp_path / "run" / "ingest")
    size = real - 3  # more than the supervised tokens: filled up with unused ids
    doc = tokenize.run(None, tmp_path / "run", workers=1, model=str(model),
                       draft_vocab_size=size, seq_length=512)
    out = tmp_path / "run" / "tokenize"
    d2t, t2d = np.load(out / f"d2t-{size}.npy"), np.load(out / f"t2d-{size}.npy")
    assert t2d.shape == (padded,) and doc["total"]["model_vocab_size"] == padded
    assert doc["total"]["vocab_size"] == real
    assert t2d.sum() == size and not t2d[real:].any()  # padding rows are never draft tokens
    assert np.flatnonzero(t2d).tolist() == (np.arange(size) + d2t).tolist()
    draft = json.loads((out / "draft_vocab.json").read_text())
    assert draft["t2d_length"] == padded and "vocab_size" in draft["t2d_length_from"]


def test_a_model_vocab_smaller_than_the_tokenizer_is_refused(run_dir, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(DEFAULT_TOKENIZER, model)
    (model / "config.json").write_text(json.dumps({"vocab_size": 10}))
    shutil.copytree(run_dir / "ingest", tmp_path / "run" / "ingest")
    with pytest.raises(StageError, match="do not belong together"):
        tokenize.run(None, tmp_path / "run", workers=1, model=str(model), seq_length=512)


@pytest.mark.skipif(not QWEN.is_dir(), reason="../shared/fixtures/qwen36-tokenizer is absent")
def test_qwen36_multi_turn_reasoning_and_tool_calls(run_dir, tmp_path):
    import shutil

    from datasets import load_from_disk

    shutil.copytree(run_dir / "ingest", tmp_path / "run" / "ingest")
    doc = tokenize.run(None, tmp_path / "run", workers=1, model=str(QWEN), seq_length=2048)
    assert doc["total"]["rows_out"] == 3 and doc["total"]["rows_quarantined"] == 0
    dataset = load_from_disk(str(tmp_path / "run" / "tokenize" / "dataset")).with_format(None)
    tok = load_tokenizer(str(QWEN))
    supervised = [tok.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if m])
                  for r in dataset]
    joined = "\n".join(supervised)
    assert "Multiply five by six." in joined  # reasoning of the last turn is supervised
    assert "<tool_call>" in joined and "Oslo" in joined
    assert all(s.rstrip().endswith("<|im_end|>") for s in supervised)
    assert "What is 12 + 30?" not in joined


@pytest.mark.skipif(not QWEN.is_dir(), reason="../shared/fixtures/qwen36-tokenizer is absent")
def test_fast_loader_matches_autotokenizer_on_qwen36():
    """The stage loads tokenizer.json directly (no torch import); it must equal AutoTokenizer."""
    from transformers import AutoTokenizer

    fast = load_tokenizer(str(QWEN))
    auto = AutoTokenizer.from_pretrained(str(QWEN))
    assert load_tokenizer(str(QWEN)) is fast  # parsed once per process
    assert len(fast) == len(auto)
    assert (fast.eos_token, fast.bos_token, fast.pad_token) == (
        auto.eos_token, auto.bos_token, auto.pad_token)
    assert fast.all_special_tokens == auto.all_special_tokens
    for row in _rows()[:2]:
        kwargs = {"tools": row.get("tools"), "add_generation_prompt": False}
        messages = [{**m, "tool_calls": [{**c, "function": {
            **c["function"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in m["tool_calls"]]} if "tool_calls" in m else m for m in row["messages"]]
        text = fast.apply_chat_template(messages, tokenize=False, **kwargs)
        assert text == auto.apply_chat_template(messages, tokenize=False, **kwargs)
        assert "<tool_call>" in text or "Multiply five by six." in text
        ids = fast(text, add_special_tokens=False)["input_ids"]
        assert ids == auto(text, add_special_tokens=False)["input_ids"]
        assert fast.decode(ids) == text


def test_dataset_directory_in_several_shards_loads_as_datasets_wrote_it(tmp_path):
    """The stage writes the save_to_disk layout itself (pyarrow, no `datasets`): split into
    shards as datasets splits a large dataset, it must load with `datasets` row for row, with
    the features, split size and torch format the trainers read."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import load_from_disk

    rng = np.random.default_rng(0)
    rows = []
    for k in range(2500):
        n = int(rng.integers(3, 40))
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        rows.append({"input_ids": rng.integers(0, 1000, n).astype(np.int32).tolist(),
                     "loss_mask": mask, "seq_len": n, "id": f"c{k}", "source": "s",
                     "turn": k % 3 - 1})
    files = []
    for start in range(0, len(rows), 500):
        files.append(tmp_path / f"c{start}.rows.parquet")
        pq.write_table(pa.Table.from_pylist(rows[start:start + 500], schema=TOKENIZED_ROWS),
                       files[-1])
    out = tmp_path / "dataset"
    save_dataset(files, out, "0123456789abcdef0123", shard_bytes=100_000)
    shards = sorted(p.name for p in out.glob("*.arrow"))
    assert len(shards) >= 2 and shards[0] == f"data-00000-of-{len(shards):05d}.arrow"
    dataset = load_from_disk(str(out))
    assert dataset.format["type"] == "torch"
    assert dataset.format["columns"] == ["input_ids", "loss_mask", "seq_len"]
    assert dataset.info.splits["train"].num_examples == len(rows)
    assert dataset.features["loss_mask"].feature.dtype == "int8"
    assert dataset.with_format(None).to_list() == rows


def test_forked_workers_and_a_resumed_run_write_the_rows_of_one_process(tmp_path, monkeypatch):
    """600 conversations are 3 chunks: two forked workers, and a run that failed after its
    chunks were done and then resumed without redoing any, write what one process writes."""
    import shutil

    from datasets import load_from_disk

    rows = [{"messages": [{"role": "user", "content": f"Question {k}: what is {k} + {k}?"},
                          {"role": "assistant", "content": f"{k} + {k} = {2 * k}."}]}
            for k in range(600)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = parse_config({"run": {"workers": 1},
                           "sources": [{"name": "sums", "path": "rows.jsonl"}]},
                          base_dir=tmp_path)
    ingest.run(config, tmp_path / "one")
    for name in ("two", "resumed"):
        shutil.copytree(tmp_path / "one", tmp_path / name)
    kw = {"model": str(DEFAULT_TOKENIZER), "seq_length": 512}

    def dataset(name: str) -> list[dict]:
        return load_from_disk(str(tmp_path / name / "tokenize" / "dataset")).with_format(
            None).to_list()

    tokenize.run(config, tmp_path / "one", workers=1, **kw)
    tokenize.run(config, tmp_path / "two", workers=2, **kw)
    assert len(dataset("one")) == 600 and dataset("two") == dataset("one")

    def fail(*args, **kwargs):
        raise StageError("interrupted after the chunks")

    with monkeypatch.context() as patch:
        patch.setattr(tokenize, "_finish", fail)
        with pytest.raises(StageError, match="interrupted"):
            tokenize.run(config, tmp_path / "resumed", workers=2, **kw)
    units = tmp_path / "resumed" / ".tokenize.partial" / "units"
    assert len(list(units.glob("u*.done.json"))) == 3
    manifest = json.loads((tmp_path / "resumed" / "manifest.json").read_text())
    assert manifest["stages"]["tokenize"] == {**manifest["stages"]["tokenize"],
                                              "status": "failed",
                                              "error": "interrupted after the chunks"}
    redone = []
    real = tokenize.TokenizeStage.process_batch

    def count(stage, batch, item):
        redone.append(item.index)
        return real(stage, batch, item)

    monkeypatch.setattr(tokenize.TokenizeStage, "process_batch", count)
    doc = tokenize.run(config, tmp_path / "resumed", workers=1, **kw)
    assert redone == [] and doc["total"]["rows_in"] == 600
    assert dataset("resumed") == dataset("one")


def test_a_chunks_result_holds_no_per_token_counts(run_dir):
    """What a worker sends the parent per chunk stays small whatever the vocabulary: the token
    frequencies are counted from the row files (per-chunk counts kept by the parent grew it by
    ~1.5 kB per conversation, 1.5 GB at 1M conversations)."""
    import pyarrow as pa

    settings = tokenize.TokenizeSettings(model=str(QWEN))
    stage = tokenize.TokenizeStage(settings, tokenize.probe(settings))
    stage.setup()
    import random

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
             for _ in range(300)]
    batch = pa.Table.from_pylist([{
        "id": f"c{k}", "source": "s", "file": "f", "line": k, "tools": None,
        "messages": [{"role": "user", "content": words[k]},
                     {"role": "assistant", "content": " ".join(words[k:k + 40])}]}
        for k in range(100)])
    out = stage.process_batch(batch, None)
    assert out.rows.num_rows == 100
    distinct = len(set(pa.compute.list_flatten(out.rows.column("input_ids")).to_pylist()))
    assert distinct > 300
    assert len(json.dumps(out.extra)) < 100


def test_contract_checks_a_shard_slice_by_slice_and_names_rows_in_the_shard(run_dir, tmp_path,
                                                                         monkeypatch):
    """A 500 MB Arrow shard is validated in slices (bounded memory); a bad row in a later
    slice is reported by its row number in the shard."""
    import pyarrow as pa

    from dflash_etl.validation import contracts

    (shard,) = sorted((run_dir / "tokenize" / "dataset").glob("*.arrow"))
    table = contracts.read_arrow(shard)
    rows = [{**row, "id": f"r{k}"} for k, row in enumerate(table.to_pylist() * 40)]
    bad = 97
    rows[bad] = {**rows[bad], "loss_mask": [0] * len(rows[bad]["loss_mask"])}  # none supervised
    big = pa.Table.from_pylist(rows, schema=table.schema)
    path = tmp_path / "data-00000-of-00001.arrow"
    with pa.ipc.new_stream(str(path), big.schema) as writer:
        writer.write_table(big, max_chunksize=10)
    monkeypatch.setattr(contracts, "SLICE_BYTES", 4096)
    assert len(list(contracts._slices(path))) > 5
    params = {"vocab_size": len(load_tokenizer(str(DEFAULT_TOKENIZER))), "seq_length": 512,
              "min_supervised_tokens": 2}
    report = contracts.validate_files(contracts.load_contract("tokenized", params), [path])
    assert report["rows"] == len(rows) and not report["passed"]
    assert {r for f in report["failures"] for r in f["rows"]} == {bad}, report["failures"]



def test_arrow_builders_equal_pa_array():
    import pyarrow as pa

    from dflash_etl.core.schema import numeric_array, string_array

    for values in (np.arange(7, dtype=np.int32), np.array([1, -1, 0], np.int8),
                   np.arange(10, dtype=np.int64)[::3], np.array([], np.int32),
                   np.array([True, False, True] * 5)):
        assert numeric_array(values).equals(pa.array(values))
    for values in (["c1", "", "é ✓", "x" * 1000], []):
        assert string_array(values).equals(pa.array(values, pa.string()))


def test_list_readers_equal_arrows_own_on_sliced_chunked_and_large_lists():
    """`flat_values` and `list_lengths` read the buffers themselves (no pandas, no copy of
    the values): the same numbers as pyarrow's own readers, wherever a slice starts."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from dflash_etl.core.schema import flat_values, list_lengths

    rows = [[1, 2, 3], [], [4], [5, 6], [7, 8, 9, 10], [11]]
    for kind in (pa.list_(pa.int32()), pa.large_list(pa.int8()), pa.list_(pa.int64())):
        whole = pa.array(rows, kind)
        for column in (whole, whole.slice(1, 4), whole.slice(5),
                       pa.chunked_array([whole.slice(0, 2), whole.slice(3, 3)]),
                       pa.chunked_array([], kind)):
            assert list_lengths(column).tolist() == pc.list_value_length(column).to_pylist()
            assert flat_values(column).tolist() == pc.list_flatten(column).to_pylist()


def test_a_worker_writes_its_rows_without_importing_pandas(run_dir):
    """pyarrow's `pa.array` imports pandas on first use (~1 s of CPU in each worker process):
    a worker reads its chunk, tokenizes it and writes its files without it."""
    import subprocess
    import sys

    code = f"""
import sys
from pathlib import Path
from dflash_etl.core.stage import run_item
from dflash_etl.stages import tokenize
settings = tokenize.TokenizeSettings(model={str(QWEN)!r}, seq_length=512)
files = sorted((Path({str(run_dir)!r}) / "ingest" / "conversations").glob("*.parquet"))
stage = tokenize.TokenizeStage(settings, tokenize.probe(settings))
stage.setup()
out = Path(sys.argv[1])
for item in tokenize.plan_chunks(files):
    run_item(stage, item, out)
print(len(list(out.glob("*.rows.parquet"))), "pandas" in sys.modules)
"""
    out = run_dir.parent / "no_pandas"
    out.mkdir(exist_ok=True)
    result = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["1", "False"]


def test_a_template_that_prints_the_date_renders_a_fixed_one(ingest_rows, tmp_path,
                                                             fixtures_dir):
    """Llama 3.2's real template prints today's date (strftime_now) into every system header:
    the rows used to change from day to day, found by nobody. The probe names it, every render
    reads [tokenize] template_clock, and another clock is another fingerprint (a redo)."""
    import datetime

    import datasets

    template = fixtures_dir / "templates" / "meta-llama-Llama-3.2-3B-Instruct.jinja"
    run_dir = ingest_rows([{"id": "a", "messages": [
        {"role": "user", "content": "What day is it?"},
        {"role": "assistant", "content": "A good one."}]}], "dated")
    model = str(REPO / "data" / "tokenizer")
    tok = load_tokenizer(model)

    def text() -> str:
        ids = datasets.load_from_disk(str(run_dir / "tokenize" / "dataset"))["input_ids"][0]
        return tok.decode(ids)

    doc = tokenize.run(None, run_dir, progress=False, model=model, chat_template=str(template))
    assert "Today Date: 01 Jan 2025" in text()
    assert datetime.date.today().strftime("%d %b %Y") not in text()
    probe = json.loads((run_dir / "tokenize" / "probe.json").read_text())
    assert any("strftime_now" in n and "fixed time 2025-01-01T00:00:00" in n
               for n in probe["notes"])
    again = tokenize.run(None, run_dir, progress=False, model=model, chat_template=str(template))
    assert again.get("skipped") and doc["total"] == again["total"]
    tokenize.run(None, run_dir, progress=False, model=model, chat_template=str(template),
                 template_clock="2031-05-06T00:00:00")
    assert "Today Date: 06 May 2031" in text()
    with pytest.raises(StageError, match="template_clock='tomorrow': give an ISO 8601"):
        tokenize.run(None, run_dir, progress=False, model=model, chat_template=str(template),
                     template_clock="tomorrow")


def test_template_kwargs_reach_every_render_and_a_missing_variable_is_named(ingest_rows,
                                                                            tmp_path):
    """A template that needs a variable no render gave it (FireFunction's `functions`) was
    refused outright; `[tokenize] template_kwargs` / `--template-kwarg KEY=JSON` now reaches the
    probe and every row's render, is in the fingerprint, and the refusal names the variable."""
    import datasets

    from dflash_etl.cli.main import main as cli_main

    base = (REPO / "data" / "tokenizer" / "chat_template.jinja").read_text()
    template = tmp_path / "functions.jinja"
    template.write_text("{{- '<|im_start|>system\\nFunctions: ' + functions[0].name + "
                        "'<|im_end|>\\n' -}}" + base)
    run_dir = ingest_rows([{"id": "a", "messages": [
        {"role": "user", "content": "Call it."},
        {"role": "assistant", "content": "Done."}]}], "fn")
    model = str(REPO / "data" / "tokenizer")
    with pytest.raises(StageError, match=r"reads a variable 'functions' no render gives it: "
                       r"pass it with \[tokenize\] template_kwargs"):
        tokenize.run(None, run_dir, progress=False, model=model, chat_template=str(template))
    assert cli_main(["tokenize", "--run", str(run_dir), "--model", model, "--chat-template",
                     str(template), "--template-kwarg", 'functions=[{"name": "get_time"}]',
                     "--template-kwarg", "unused=yes"]) == 0
    ids = datasets.load_from_disk(str(run_dir / "tokenize" / "dataset"))["input_ids"][0]
    assert "Functions: get_time" in load_tokenizer(model).decode(ids)
    probe = json.loads((run_dir / "tokenize" / "probe.json").read_text())
    assert probe["render_kwargs"]["functions"] == [{"name": "get_time"}]
    assert probe["render_kwargs"]["unused"] == "yes"  # not JSON: the string as given
    again = tokenize.run(None, run_dir, progress=False, model=model, chat_template=str(template),
                         template_kwargs={"functions": [{"name": "other"}]})
    assert not again.get("skipped")  # other kwargs, other rows: redone
    ids = datasets.load_from_disk(str(run_dir / "tokenize" / "dataset"))["input_ids"][0]
    assert "Functions: other" in load_tokenizer(model).decode(ids)


def test_stats_and_report_show_what_the_drafter_learns_from_per_source(default_tokenized,
                                                                       tmp_path, copy_run):
    """Per source: rows, tokens and supervised tokens with their shares (each sums to 1 and
    matches the dataset), beside the row share a weighted source asked for; in the report."""
    import datasets

    from dflash_etl.report import build_docs

    run = copy_run(default_tokenized, tmp_path)
    mix = json.loads((run / "tokenize" / "stats.json").read_text())["learning_mix"]
    rows = list(datasets.load_from_disk(str(run / "tokenize" / "dataset")).with_format(None))
    for key in ("rows_written", "tokens", "supervised_tokens"):
        assert abs(sum(m[f"{key}_share"] for m in mix.values()) - 1) < 1e-3
    for name, m in mix.items():
        mine = [r for r in rows if r["source"] == name]
        assert m["rows_written"] == len(mine)
        assert m["tokens"] == sum(len(r["input_ids"]) for r in mine)
        assert m["supervised_tokens"] == sum(sum(r["loss_mask"]) for r in mine)
    assert mix["orca"]["asked_row_share"] == mix["parts"]["asked_row_share"] == 0.5
    assert "asked_row_share" not in mix["alpaca"]
    page = (build_docs(run) / "index.html").read_text()
    assert "What the drafter learns from, per source" in page
    assert "renders per written conversation" in page
