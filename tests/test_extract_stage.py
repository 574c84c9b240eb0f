"""The extract stage on a tiny random-weight target (4 layers, hidden 64, the project's tokenizer):
ingest -> tokenize -> extract on real files; the states equal an independent forward pass, the
rows are bucketed with little padding, both output formats, the contract, resume and errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.models.batching import length_batches, padding_share
from dflash_etl.models.target import Target, auto_layers, parse_layers
from dflash_etl.stages import extract
from dflash_etl.validation.model_outputs import verify_states

REPO = Path(__file__).resolve().parents[1]


def test_states_equal_an_independent_forward_pass(tiny_target, default_tokenized, tmp_path,
                                                  copy_run):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    run_dir = copy_run(default_tokenized, tmp_path, "*extract*")
    doc = extract.run(None, run_dir, progress=False, model=str(tiny_target), layers="0,2,3",
                      batch_tokens=2048, shard_rows=100)
    total = doc["total"]
    rows_in = json.loads((run_dir / "tokenize" / "stats.json").read_text())["total"]
    assert total["rows_in"] == total["rows_out"] == rows_in["rows_written"]
    assert total["layers"] == [0, 2, 3] and total["n_layers"] == 4
    assert total["padding_share"] < 0.05
    index = pq.read_table(run_dir / "extract" / "index.parquet").to_pylist()
    assert len(index) == total["rows_out"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target)).eval()
    dataset = tokenize_rows(run_dir)
    for entry in index[:: max(1, len(index) // 12)]:  # a dozen rows across the shards
        ids = dataset[entry["row"]]
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        # hidden_states[0] is the embeddings, [i + 1] layer i's output; the last entry has the
        # final norm applied: a chosen last layer (3) is stored as that, the verifier's column
        # after it as layer 3's own (pre-norm) output, which a consumer norms itself
        want = torch.stack([ref[1][0], ref[3][0], ref[4][0]], dim=1)
        with safe_open(str(run_dir / "extract" / "hidden_states" / entry["shard"]), "pt") as f:
            a, b = entry["offset"], entry["offset"] + entry["length"]
            got = f.get_slice("hidden_states")[a:b]
            assert f.get_slice("token_ids")[a:b].tolist() == ids
        assert got.shape == (len(ids), 4, 64)  # the chosen three, then the verifier's state
        assert torch.allclose(got[:, :3], want, atol=1e-4), entry
        with torch.no_grad():
            assert torch.allclose(model.model.norm(got[:, 3]), ref[4][0], atol=1e-4), entry


def tokenize_rows(run_dir: Path) -> list[list[int]]:
    import datasets

    return datasets.load_from_disk(str(run_dir / "tokenize" / "dataset")).with_format(None)[
        "input_ids"]


def test_speculators_format_resume_and_contract(tiny_target, default_tokenized, tmp_path, copy_run):
    from safetensors.torch import load_file, save_file

    run_dir = copy_run(default_tokenized, tmp_path, "*extract*")
    doc = extract.run(None, run_dir, progress=False, model=str(tiny_target), format="speculators",
                      shard_rows=64)
    layers = auto_layers(4, 5)
    assert doc["total"]["layers"] == layers == [1]  # L-3 = 1: the rule leaves only layer 1
    ids = tokenize_rows(run_dir)
    files = sorted((run_dir / "extract" / "hidden_states").glob("hs_*.safetensors"))
    assert len(files) == len(ids)
    sample = load_file(str(run_dir / "extract" / "hidden_states" / "hs_7.safetensors"))
    assert doc["total"]["stored_layers"] == [1, 3]  # then the last layer, for speculators
    assert sample["hidden_states"].shape == (len(ids[7]), 2, 64)
    assert sample["token_ids"].tolist() == ids[7]

    again = extract.run(None, run_dir, progress=False, model=str(tiny_target), format="speculators",
                        shard_rows=64)
    assert again.get("skipped") is True  # same inputs and settings: not redone

    broken = load_file(str(files[0]))
    broken["token_ids"][0] += 1
    save_file(broken, str(files[0]))
    entries = {r["row"]: r["input_ids"] for r in [{"row": k, "input_ids": v}
                                                  for k, v in enumerate(ids)]}
    problems = verify_states(run_dir / "extract", entries, 2, 64)
    assert problems and "token ids differ" in problems[0]


def test_speculators_export_loads_with_speculators_data_loader(tiny_target, default_tokenized,
                                                               tmp_path, copy_run):
    """speculators' own ArrowDataset reads the export: the chosen layers as its auxiliary states,
    the appended last layer as the verifier's, the tokenized row's ids and loss mask."""
    pytest.importorskip("speculators.train.data")
    import torch
    from hs_connectors import FileTransfer
    from speculators.train.data import ArrowDataset

    run_dir = copy_run(default_tokenized, tmp_path, "*extract*")
    extract.run(None, run_dir, progress=False, model=str(tiny_target), format="speculators",
                layers="1,2")
    loaded = ArrowDataset(max_len=1024, datapath=run_dir / "tokenize" / "dataset",
                          transfer=FileTransfer(run_dir / "extract" / "hidden_states"),
                          on_missing="raise", hidden_states_dtype=torch.float32)
    ids = tokenize_rows(run_dir)
    assert len(loaded) == len(ids)
    sample = loaded[5]
    assert sample["input_ids"].tolist() == ids[5]
    assert sample["hidden_states"].shape == (len(ids[5]), 2 * 64)  # layers 1 and 2
    assert sample["verifier_last_hidden_states"].shape == (len(ids[5]), 64)  # layer 3
    assert int(sample["loss_mask"].sum()) > 0


def test_interrupted_extract_resumes_from_finished_shards(tiny_target, default_tokenized, tmp_path,
                                                          monkeypatch, copy_run):
    run_dir = copy_run(default_tokenized, tmp_path, "*extract*")
    real = extract._write_shard
    written = []

    def stop_after_two(*args, **kw):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(args[3])
        return real(*args, **kw)

    monkeypatch.setattr(extract, "_write_shard", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        extract.run(None, run_dir, progress=False, model=str(tiny_target), shard_rows=64)
    assert written == ["shard-00000", "shard-00001"]
    monkeypatch.setattr(extract, "_write_shard", lambda *a, **k: (written.append(a[3]),
                                                                  real(*a, **k))[1])
    doc = extract.run(None, run_dir, progress=False, model=str(tiny_target), shard_rows=64)
    assert "shard-00000" not in written[2:] and "shard-00001" not in written[2:]
    assert doc["total"]["rows_out"] == len(tokenize_rows(run_dir))


def test_bucketing_and_layer_rules():
    lengths = [5, 100, 7, 98, 6, 99]
    batches = length_batches(lengths, 300)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert all(max(lengths[i] for i in b) * len(b) <= 300 for b in batches)
    assert padding_share(lengths, batches) < 0.05
    assert padding_share(lengths, [list(range(6))]) > 0.4  # one unsorted batch pads a lot
    assert auto_layers(64, 5) == [1, 16, 31, 46, 61]  # the example for L = 64
    with pytest.raises(StageError, match=r"decoder layers 0\.\.3"):
        parse_layers("1,9", 4, 5)


def test_errors_name_the_cause(tiny_target, tmp_path, monkeypatch):
    with pytest.raises(StageError, match="run `dflash-etl tokenize`"):
        extract.run(None, tmp_path / "empty-run", progress=False, model=str(tiny_target))
    with pytest.raises(StageError, match="GiB free"):
        extract._check_disk(tmp_path, 10**12, 5, 4096, "bf16")


@pytest.mark.slow
def test_run_chains_every_stage_on_a_named_target(tiny_target, tmp_path, capsys):
    """`dflash-etl run` on the embedded default's sources with `[target] model = DIR` (a real
    pipeline's form): the prompt-only rows get real replies and every stage completes in order."""
    from dflash_etl.cli.main import main

    data = tmp_path / "data"
    shutil.copytree(REPO / "data", data)
    text = (data / "pipeline.toml").read_text()
    text = re.sub(r"(?m)^tiny = .*$", f'model = "{tiny_target}"', text)
    text = text.replace("max_new_tokens = 64", "max_new_tokens = 8\ntemperature = 1.0").replace(
        "[extract]\n", '[extract]\nlayers = "1,2"\n').replace("steps = 300", "steps = 3").replace(
        "eval_new_tokens = 48", "eval_new_tokens = 8")
    (data / "pipeline.toml").write_text(text)
    run_dir = tmp_path / "run"
    assert main(["run", "--config", str(data / "pipeline.toml"), "--run", str(run_dir)]) == 0
    out = capsys.readouterr().out
    manifest = json.loads((run_dir / "manifest.json").read_text())
    stages = ("ingest", "regenerate", "tokenize", "extract", "train")
    assert [s for s in stages if manifest["stages"][s]["status"] == "complete"] == list(stages)
    assert not (run_dir / "target").exists()  # the named target is used, no tiny one built
    regen = json.loads((run_dir / "regenerate" / "stats.json").read_text())["total"]
    assert regen["generated_turns"] > 0
    tok = json.loads((run_dir / "tokenize" / "stats.json").read_text())["total"]
    assert tok["rows_in"] == regen["rows_out"]  # tokenize read the regenerated conversations
    assert "no_assistant_turn" not in tok["rows_filtered"]  # the prompts were answered
    ext = json.loads((run_dir / "extract" / "stats.json").read_text())["total"]
    assert ext["rows_out"] == tok["rows_written"] and ext["layers"] == [1, 2]
    assert "extract done" in out and "train done" in out
    train = json.loads((run_dir / "train" / "stats.json").read_text())["total"]
    assert train["target_layers"] == [1, 2] and train["steps"] == 3
    report = (run_dir / "docs" / "index.html").read_text()
    assert all(stage in report for stage in stages)
    # the failure-mode table, linked where the source tree is (this checkout)
    page = REPO / "docs" / "failure-modes.md"
    assert page.is_file() and f'href="{page.as_uri()}"' in report


ARCHITECTURES = {  # tiny configs of the families the hooks must serve, beyond dense Qwen2
    "moe (Qwen3-MoE)": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                           "moe_intermediate_size": 64}),
    "hybrid linear attention + moe (Qwen3-Next)": (
        "Qwen3NextConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                            "moe_intermediate_size": 64, "linear_num_value_heads": 2,
                            "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                            "linear_value_head_dim": 16, "full_attention_interval": 2}),
    "hybrid mamba (Falcon-H1)": ("FalconH1Config", {}),
    "hybrid short convolution (LFM2)": ("Lfm2Config", {}),
}


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_hooks_capture_moe_and_hybrid_architectures(family, tmp_path):
    """Batched, right-padded extraction equals each row's own transformers forward pass
    (output_hidden_states) for MoE, hybrid linear-attention, Mamba and convolution models."""
    import torch
    import transformers

    name, extra = ARCHITECTURES[family]
    config = getattr(transformers, name)(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "model")
    target = Target(extract.ExtractSettings(model=str(tmp_path / "model"),
                                                    layers="1,2", device="cpu"))
    rows = [[int(t) for t in torch.randint(3, 300, (n,))] for n in (17, 5, 11)]
    got = target.states(rows)
    for row, states in zip(rows, got, strict=True):
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([row]), output_hidden_states=True)
        expected = torch.stack([alone.hidden_states[i + 1][0] for i in (1, 2)], dim=1)
        assert states.shape == (len(row), 2, 64)
        assert torch.allclose(states, expected, atol=1e-4), family


def test_replacing_pytorch_model_bin_redoes_extract(tiny_target, default_tokenized, tmp_path,
                                                    copy_run):
    """A target whose weights are pytorch_model.bin: new weights are a new model, never a
    skip as "complete" on the old model's hidden states (issue 16)."""
    import torch
    from safetensors.torch import load_file

    model = tmp_path / "bin-target"
    shutil.copytree(tiny_target, model)
    weights = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    torch.save(weights, model / "pytorch_model.bin")
    run_dir = copy_run(default_tokenized, tmp_path, "*extract*")
    first = extract.run(None, run_dir, progress=False, model=str(model), shard_rows=64)
    states = load_file(str(sorted((run_dir / "extract").rglob("*.safetensors"))[0]))
    torch.save({k: v * 0.5 for k, v in weights.items()}, model / "pytorch_model.bin")
    again = extract.run(None, run_dir, progress=False, model=str(model), shard_rows=64)
    assert not again.get("skipped") and first["total"]["rows_out"] == again["total"]["rows_out"]
    redone = load_file(str(sorted((run_dir / "extract").rglob("*.safetensors"))[0]))
    assert any(not torch.equal(states[k], redone[k]) for k in states if k in redone)


def _bytes_on_disk(out: Path) -> int:
    return sum(f.stat().st_size for f in (out / "hidden_states").iterdir()) + (
        out / "index.parquet").stat().st_size


@pytest.mark.parametrize("fmt", ["native", pytest.param("speculators", marks=pytest.mark.slow)])
def test_the_plan_projects_the_actual_run_and_publishes_nothing(tiny_target, default_tokenized,
                                                                tmp_path,
                                                                fmt, copy_run):
    """`extract --plan` measures a few batches of the real run and projects the whole dataset:
    the bytes within 30% of what the run then writes, the tokens exact; it is a dry run (no
    output, no partial, no manifest entry), and the real run after it is not changed by it."""
    run_dir = copy_run(default_tokenized, tmp_path, "*extract*")
    layers = {"model": str(tiny_target), "layers": "0,2", "format": fmt, "batch_tokens": 2048}
    doc = extract.run(None, run_dir, progress=False, plan=True, plan_batches=3, **layers)
    assert not (run_dir / "extract").exists() and not list(run_dir.glob(".extract*"))
    assert "extract" not in json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert json.loads((run_dir / extract.PLAN_FILE).read_text()) == doc
    assert doc["measured"]["batches"] == 3 < doc["dataset"]["batches"]
    assert doc["projected"]["fits"] and doc["advice"].startswith("fits")

    actual = extract.run(None, run_dir, progress=False, **layers)
    written = _bytes_on_disk(run_dir / "extract")
    assert abs(doc["projected"]["bytes"] - written) / written < 0.3, (doc["projected"], written)
    assert doc["dataset"]["tokens"] == actual["total"]["tokens"]
    assert doc["dataset"]["rows"] == actual["total"]["rows_in"]
    assert doc["measured"]["tokens_per_s"] > 0 and doc["projected"]["hours"] > 0


def test_the_plan_recommends_online_training_when_the_output_would_not_fit(
        tiny_target, default_tokenized, tmp_path, monkeypatch, capsys, copy_run):
    """Free disk smaller than the projected output: the plan says by how much and to train
    with --online (through the CLI, as a user runs it)."""
    import collections

    from dflash_etl.cli.main import main

    run_dir = copy_run(default_tokenized, tmp_path, "*extract*")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(10**9, 10**9 - 10**5, 10**5))
    code = main(["extract", "--run", str(run_dir), "--model", str(tiny_target), "--plan",
                 "--plan-batches", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    doc = json.loads((run_dir / extract.PLAN_FILE).read_text())
    assert not doc["projected"]["fits"]
    assert doc["projected"]["short_by_bytes"] == doc["projected"]["bytes"] - 10**5 > 0
    assert "does NOT fit" in out and "short by" in out and "--online" in out
    assert "tokens/s" in out and "hours" in out
    assert not (run_dir / "extract").exists()


def test_the_disk_check_counts_the_shards_written_before(tmp_path, monkeypatch):
    """After a full disk, a rerun resumes when the space left holds what is still to write
    (it asked for the whole estimate again, and said both figures as "0.0 GiB")."""
    import collections

    usage = collections.namedtuple("usage", "total used free")
    need = 1000 * 2 * 16 * 4 + 1000 * 8  # 1000 tokens x 2 layers x 16 x fp32, + token ids
    (tmp_path / "hidden_states").mkdir()
    (tmp_path / "hidden_states" / "shard-00000.safetensors").write_bytes(b"x" * 100_000)
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10**9, 0, need - 100_000))
    assert extract._check_disk(tmp_path, 1000, 2, 16, "fp32") == need
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10**9, 0, need - 100_001))
    with pytest.raises(StageError, match=r"~132\.8 KiB .*97\.7 KiB of it written before.* "
                                         r"35\.2 KiB free"):  # not "0.0 MiB": the unit fits
        extract._check_disk(tmp_path, 1000, 2, 16, "fp32")


def test_a_rerun_that_drops_the_chosen_layers_is_refused(tiny_target, default_tokenized,
                                                         tmp_path, copy_run):
    """`extract --model M` alone after `--layers 0,2` re-extracted the default layers (a warning
    said so): now refused, naming the value to give, the output kept complete; given, the
    choice is kept or changed on purpose."""
    from dflash_etl.core.errors import StageError

    run_dir = copy_run(default_tokenized, tmp_path, "*extract*")
    extract.run(None, run_dir, progress=False, model=str(tiny_target), layers="0,2")
    before = json.loads((run_dir / "manifest.json").read_text())["stages"]["extract"]
    for dropped in ({}, {"force": True}):
        with pytest.raises(StageError, match=r'extract: its published output was made with '
                           r'--layers "0,2" \(it would be "auto", the default\); this command '
                           r"does not give it"):
            extract.run(None, run_dir, progress=False, model=str(tiny_target), **dropped)
    after = json.loads((run_dir / "manifest.json").read_text())["stages"]["extract"]
    assert after["status"] == "complete" and after["fingerprint"] == before["fingerprint"]
    kept = extract.run(None, run_dir, progress=False, model=str(tiny_target), layers="0,2")
    assert kept.get("skipped") is True
    changed = extract.run(None, run_dir, progress=False, model=str(tiny_target), layers="auto")
    assert changed["total"]["layers"] == [1]


def test_the_final_norm_stays_callable_after_a_pass_that_stopped_at_it(tiny_target):
    """A chosen last layer is read at the final norm's hook, where the pass stops; the labels
    of `labels = "target"` call that norm again afterwards, which must not end anything."""
    import torch

    from dflash_etl.models.target import Target, TargetSpec
    from dflash_etl.models.training.labels import final_norm

    target = Target(TargetSpec(model=str(tiny_target), layers="1,3"))
    states = target.states([[5, 6, 7, 8]])
    assert states[0].shape == (4, 2, 64)
    assert final_norm(target.model)(torch.ones(1, 64)).shape == (1, 64)


def test_a_shard_is_streamed_row_by_row_into_the_bytes_safetensors_writes(tmp_path):
    """A native shard was joined (torch.cat) and serialized by safetensors before its write:
    two copies of up to a GB each (~1 CPU s per GB at a 27B width). Now the rows are written
    one after another behind the header; the file is byte for byte safetensors' own for the
    joined tensors, so its readers (ours, speculators', SpecForge's) see the same file."""
    import filecmp

    import torch
    from safetensors.torch import load_file, save_file

    from dflash_etl.io.hidden_states import write_states_file

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for lengths in ((5, 1, 7), (3,)):
            rows = [torch.randn(n, 3, 8, generator=g).to(dtype) for n in lengths]
            ids = list(range(100, 100 + sum(lengths)))
            theirs, ours = tmp_path / "theirs.safetensors", tmp_path / "ours.safetensors"
            save_file({"hidden_states": torch.cat(rows), "token_ids": torch.tensor(ids)},
                      str(theirs))
            write_states_file(ours, rows, ids)
            assert filecmp.cmp(theirs, ours, shallow=False), (dtype, lengths)
            assert load_file(str(ours))["token_ids"].tolist() == ids
            assert not ours.with_suffix(".tmp").exists()
