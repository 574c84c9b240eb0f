"""`dflash-etl export`: the run as speculators and SpecForge read it, checked with their own code
(speculators' trainer runs a few steps on the export, on CPU).

speculators 0.9 is installed `--no-deps` by `make setup` (see the Makefile); SpecForge's package
is ../shared/fixtures/specforge (not on the registry), put on sys.path here. Each test skips
with the install step when its consumer is absent.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.handoff.export import export

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # every test reads native_run: extract and train of the default

REPO = Path(__file__).resolve().parents[1]
SPECFORGE = REPO.parent / "shared" / "fixtures" / "specforge"
SPECULATORS_HINT = ("speculators is not installed: make setup (it runs uv pip install --no-deps "
                    "speculators==0.9.0 hs-connectors==0.9.0)")


def _tokenized(run: Path) -> list[dict]:
    import datasets

    return list(datasets.load_from_disk(str(run / "tokenize" / "dataset")).with_format(None))


def _specforge() -> None:
    if not SPECFORGE.is_dir():
        pytest.skip(f"{SPECFORGE} is absent (SpecForge's package, from ../shared/fixtures)")
    if str(SPECFORGE) not in sys.path:
        sys.path.insert(0, str(SPECFORGE))


@pytest.fixture(scope="module")
def native_run(tmp_path_factory, tiny_target, default_tokenized, copy_run) -> Path:
    """The embedded default's sources tokenized, extracted natively (2 layers of a tiny target
    whose embedding is padded beyond the tokenizer) and a drafter trained for a few steps."""
    from dflash_etl.stages import extract, train

    base = tmp_path_factory.mktemp("handoff")
    target = base / "target"
    shutil.copytree(tiny_target, target)  # the shared target stays as it is (head_dim and all)
    run = copy_run(default_tokenized, base)
    extract.run(None, run, progress=False, model=str(target), layers="1,2")
    train.run(None, run, progress=False, target=str(target), layers="1,2", draft_layers=1,
              block_size=4, steps=2, batch_rows=2, eval_prompts=1, eval_new_tokens=4,
              save_every=100)
    return run


@pytest.fixture(scope="module")
def speculators_run(native_run, tmp_path_factory) -> Path:
    """The same run with extract redone in speculators' format (one file per row)."""
    from dflash_etl.stages import extract

    run = tmp_path_factory.mktemp("spec") / "run"
    shutil.copytree(native_run, run, ignore=shutil.ignore_patterns("docs", ".lock"))
    target = json.loads((run / "manifest.json").read_text())["stages"]["extract"]["settings"][
        "model"]
    extract.run(None, run, force=True, progress=False, model=target, format="speculators",
                layers="1,2")
    return run


def test_specforge_export_reads_with_specforge_own_reader_and_model(native_run, tmp_path):
    _specforge()
    from specforge.algorithms.common.dflash_family_data import (
        build_collator,
        build_offline_reader,
        normalize_offline_sample,
    )
    from specforge.config.schema import Config
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from transformers import Qwen3Config

    out = tmp_path / "specforge"
    doc = export(native_run, "specforge", out)
    rows = _tokenized(native_run)
    assert doc["rows_in"] == len(rows)
    assert doc["rows_out"] + doc["rows_quarantined"] + sum(doc["rows_filtered"].values()) \
        == len(rows)
    paired = [r for r in rows if any(a and b for a, b in zip(r["loss_mask"], r["loss_mask"][1:]))]
    assert doc["rows_out"] == len(paired)  # the rest SpecForge would raise on: filtered

    refs = build_offline_reader("dflash", str(out / "features"), run_id="t", ttt_length=7,
                                max_len=4096).read()
    assert len(refs) == doc["rows_out"]
    samples = []
    for ref in refs[:4]:
        path = Path(ref.feature_store_uri.removeprefix("file://"))
        row = int(path.stem.split("_")[1])
        sample = normalize_offline_sample(load_feature_file(str(path)), max_len=4096)
        assert sample["input_ids"][0].tolist() == rows[row]["input_ids"]
        assert sample["loss_mask"][0].tolist() == rows[row]["loss_mask"]
        assert sample["hidden_states"].shape == (1, len(rows[row]["input_ids"]),
                                                 len(doc["layers"]) * doc["hidden_size"])
        samples.append(sample)
    batch = build_collator()(samples)
    assert batch["hidden_states"].shape[0] == 4

    draft = json.loads((out / "dflash_draft_config.json").read_text())
    model = DFlashDraftModel(Qwen3Config(**draft))
    assert model.fc.in_features == len(doc["layers"]) * doc["hidden_size"]
    assert model.target_layer_ids == doc["layers"]
    # our trained drafter's weights are the model SpecForge would warm-start from
    from safetensors.torch import load_file

    missing, unexpected = model.load_state_dict(
        load_file(str(native_run / "train" / "drafter" / "model.safetensors")), strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k]

    run_config = json.loads((out / "specforge_run.json").read_text())
    parsed = Config.model_validate(run_config)  # SpecForge's own schema
    assert parsed.mode == "offline" and parsed.training.strategy == "dflash"
    assert shlex.split(doc["command"])[-1] == str((out / "specforge_run.json").resolve())
    # the drafter SpecForge's trainer resolves from the run config, with its own code (its
    # overrides included): the layers the features hold (1,2: no rule of SpecForge's gives
    # them for one draft layer), our block size and mask token
    from specforge.algorithms.dflash.providers import algorithm_providers
    from specforge.training.model_loading import resolve_draft_config

    resolved = resolve_draft_config(parsed,
                                    provider=algorithm_providers().model.draft_config)
    ours = json.loads((native_run / "train" / "drafter" / "config.json").read_text())
    assert resolved.dflash_config["target_layer_ids"] == doc["layers"] == [1, 2]
    assert resolved.num_hidden_layers == ours["num_hidden_layers"]
    assert resolved.block_size == ours["block_size"]
    assert resolved.dflash_config["mask_token_id"] == ours["dflash_config"]["mask_token_id"]
    # each row's record holds its own states alone: the export is about the extract's size
    # (the chosen layers of the extract's, which also keeps the last one for speculators)
    exported = _size(out / "features", "*.ckpt")
    extracted = _size(native_run / "extract" / "hidden_states", "*.safetensors")
    share = len(doc["layers"]) / (len(doc["layers"]) + 1)
    assert exported < 1.1 * share * extracted + 2048 * doc["rows_out"], (exported, extracted)


# What CPU forces on SpecForge's trainer (nothing else of the printed command changes):
SPECFORGE_ON_CPU = [
    "training.fsdp_sharding=NO_SHARD",  # FSDP needs an accelerator; NO_SHARD is its DDP path
    "training.max_steps=2",  # a bound for the test, not a CPU need
]


def test_specforge_trains_from_the_printed_command_the_drafter_we_trained(native_run, tmp_path):
    """The printed `torchrun ... -m specforge.cli train --config ...` runs (one process, gloo)
    from another directory, and the drafter SpecForge writes (its own `export --to hf`) has our
    layers, block, mask token, depth, attention and vocabulary, and loads into our class."""
    import os
    import subprocess

    _specforge()
    pytest.importorskip("yunchang", reason="yunchang (SpecForge's trainer needs it) is not "
                        "installed: make setup")
    from dflash_etl.models.drafter import DFlashDrafter

    out = tmp_path / "specforge"
    doc = export(native_run, "specforge", out, gpus=1)
    argv = shlex.split(doc["command"])
    assert argv[:3] == ["torchrun", "--nproc-per-node", "1"]
    run_config = json.loads((out / "specforge_run.json").read_text())
    assert run_config["model"]["torch_dtype"] == "float32"  # the features' (fp32 extract)
    assert run_config["model"]["embedding_key"] == "model.embed_tokens.weight"
    env = {**os.environ, "PYTHONPATH": str(SPECFORGE), "OMP_NUM_THREADS": "1"}
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    result = subprocess.run([torchrun, *argv[1:], *SPECFORGE_ON_CPU], cwd=elsewhere, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = tmp_path / "specforge-drafter" / "specforge-run-step2"
    assert (checkpoint / "training_state.pt").is_file()
    hf = tmp_path / "specforge-hf"
    result = subprocess.run(
        [sys.executable, "-m", "specforge.cli", "export", "--to", "hf", "--checkpoint",
         str(checkpoint), "--draft-config", str(out / "dflash_draft_config.json"),
         "--output-dir", str(hf)], cwd=elsewhere, env=env, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = json.loads((hf / "config.json").read_text())
    ours = json.loads((native_run / "train" / "drafter" / "config.json").read_text())
    for key in ("num_hidden_layers", "block_size", "vocab_size", "hidden_size", "layer_types"):
        assert theirs[key] == ours[key], key
    assert theirs["dflash_config"]["target_layer_ids"] == ours["dflash_config"][
        "target_layer_ids"] == [1, 2]
    assert theirs["dflash_config"]["mask_token_id"] == ours["dflash_config"]["mask_token_id"]
    shutil.copy(native_run / "train" / "drafter" / "config.json", hf / "config.json")
    trained = DFlashDrafter.load(hf)  # strict: every tensor of ours, no other
    assert trained.fc.in_features == 2 * doc["hidden_size"]


def test_speculators_export_is_one_data_path_its_loader_and_cli_read(speculators_run, tmp_path):
    pytest.importorskip("speculators.train.data", reason=SPECULATORS_HINT)
    from speculators.train.config import TrainConfig
    from speculators.train.data import ArrowDataset

    out = tmp_path / "speculators"
    doc = export(speculators_run, "speculators", out)
    rows = _tokenized(speculators_run)
    assert doc["rows_out"] == len(rows) and doc["rows_quarantined"] == 0
    assert doc["aux_hidden_state_layer_ids"] == [layer + 1 for layer in doc["layers"]]
    # hard links: the hidden states are not stored twice
    first = out / "hidden_states" / "hs_0.safetensors"
    assert first.stat().st_ino == (speculators_run / "extract" / "hidden_states"
                                   / "hs_0.safetensors").stat().st_ino

    loaded = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise",
                          hidden_states_dtype=torch.float32)  # its defaults: out/hidden_states
    assert len(loaded) == len(rows)
    sample = loaded[3]
    assert sample["input_ids"].tolist() == rows[3]["input_ids"]
    assert sample["hidden_states"].shape == (len(rows[3]["input_ids"]),
                                             len(doc["layers"]) * doc["hidden_size"])

    argv = shlex.split(doc["command"])
    assert argv[:3] == ["python", "-m", "speculators.train"]
    cfg = TrainConfig.resolve(argv[3:])  # its own CLI resolution of the printed command
    flat = cfg.flatten()
    assert flat["data_path"] == str(out.resolve())
    assert flat["target_layer_ids"] == doc["aux_hidden_state_layer_ids"]
    assert flat["speculator_type"] == "dflash"
    # ours trains the whole LM head (head_vocab full): the command asks for no pruned head
    assert doc["head"]["vocab"] == "full" and flat["draft_vocab_size"] is None
    size = doc["draft_vocab_size"]
    d2t, t2d = np.load(out / f"d2t-{size}.npy"), np.load(out / f"t2d-{size}.npy")
    target = Path(json.loads((speculators_run / "manifest.json").read_text())["stages"][
        "extract"]["settings"]["model"])
    verifier = json.loads((target / "config.json").read_text())
    tokenizer_rows = len(np.load(speculators_run / "tokenize" / f"t2d-{size}.npy"))
    assert verifier["vocab_size"] > tokenizer_rows  # the tiny target pads its embedding
    assert d2t.shape == (size,) and t2d.shape == (verifier["vocab_size"],)  # what it checks
    assert "padded" in doc["t2d"]
    assert doc["head"]["rows"] == verifier["vocab_size"]


def test_a_draft_vocabulary_head_is_asked_for_with_its_size(tmp_path):
    """head_vocab = "draft": the printed command asks speculators for the same pruned head
    (its CLI resolution of the argv)."""
    pytest.importorskip("speculators.train.config", reason=SPECULATORS_HINT)
    from speculators.train.config import TrainConfig

    from dflash_etl.handoff.speculators import SpeculatorsTraining

    training = SpeculatorsTraining(
        target="/t", data_path=str(tmp_path), save_path=str(tmp_path / "out"), layers=[1, 2],
        draft_vocab_size=512, draft_layers=1, block_size=4, seq_length=64, mask_token_id=None,
        rows_without_states=0, states_dtype="fp32", head_vocab="draft")
    assert TrainConfig.resolve(training.argv()[3:]).flatten()["draft_vocab_size"] == 512
    full = SpeculatorsTraining(**{**training.__dict__, "head_vocab": "full"})
    assert TrainConfig.resolve(full.argv()[3:]).flatten()["draft_vocab_size"] is None


def test_speculators_trains_a_few_steps_from_the_printed_command(speculators_run, tmp_path,
                                                                 monkeypatch):
    """speculators' own CLI entry, on the export, with the printed command: only device
    placement is patched (it puts the model on accelerator 0) plus CPU-only switches."""
    pytest.importorskip("speculators.train.cli", reason=SPECULATORS_HINT)
    import speculators.train.trainer as trainer_module
    from speculators.train import cli
    from speculators.train.config import TrainConfig

    doc = export(speculators_run, "speculators", tmp_path / "speculators")
    saved = tmp_path / "drafter"
    argv = [*shlex.split(doc["command"])[3:],
            "--save-path", str(saved), "--max-steps", "3", "--epochs", "1", "--num-workers", "0",
            "--logger", "", "--draft-attn-impl", "sdpa",  # no flex attention / Triton on CPU
            "--loss-implementation", "eager"]
    monkeypatch.setattr(trainer_module, "get_local_rank", lambda: "cpu")
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    cli.main(TrainConfig.resolve(argv))
    checkpoint = saved / "0"
    assert json.loads((checkpoint / "training_state.json").read_text())["global_step"] == 3
    val_loss = json.loads((checkpoint / "val_metrics.json").read_text())["loss_epoch"]
    assert np.isfinite(val_loss) and val_loss > 0
    config = json.loads((checkpoint / "config.json").read_text())
    # its drafter captures the layers we extracted, in the serving convention (ours + 1)
    assert config["aux_hidden_state_layer_ids"] == doc["aux_hidden_state_layer_ids"]
    # the head it trained is ours: the target's whole vocabulary, not 512 draft rows
    assert config["draft_vocab_size"] == doc["head"]["rows"] > doc["draft_vocab_size"]
    # and attends as ours does: full attention on every layer (bidirectional within a block),
    # not its default sliding window, causal within the block
    layers = config["transformer_layer_config"]
    assert layers["layer_types"] == ["full_attention"] * layers["num_hidden_layers"]
    assert layers["use_sliding_window"] is False


def test_a_dflash2_run_exports_a_command_speculators_trains_as_dflash2(speculators_run,
                                                                      tmp_path, monkeypatch):
    """train arch = "dflash2": the printed command asks speculators 0.9 for its dflash2 with our
    convolution and selector settings (its CLI resolution), its own trainer trains a few steps
    from it, and the drafter it saves holds the tensors ours holds, of the same shapes."""
    pytest.importorskip("speculators.train.cli", reason=SPECULATORS_HINT)
    import speculators.train.trainer as trainer_module
    from safetensors.torch import load_file
    from speculators.train import cli
    from speculators.train.config import TrainConfig

    from dflash_etl.stages import train

    run = tmp_path / "run"
    shutil.copytree(speculators_run, run, ignore=shutil.ignore_patterns("docs", ".lock"))
    target = json.loads((run / "manifest.json").read_text())["stages"]["extract"]["settings"][
        "model"]
    train.run(None, run, progress=False, target=target, layers="1,2", draft_layers=1,
              block_size=4, steps=2, batch_rows=2, eval_prompts=1, eval_new_tokens=4,
              save_every=100, arch="dflash2", selector_rank=8, selector_top_k=4)
    from dflash_etl.models.serving import DFLASH2_SERVING, serve_notes

    assert DFLASH2_SERVING in serve_notes(run)  # the serve line's engines, said
    doc = export(run, "speculators", tmp_path / "speculators")
    argv = shlex.split(doc["command"])[3:]
    flat = TrainConfig.resolve(argv).flatten()
    assert flat["speculator_type"] == "dflash2"
    assert (flat["selector_rank"], flat["selector_top_k"], flat["conv_kernel_size"],
            flat["conv_group_size"]) == (8, 4, 2, 16)
    saved = tmp_path / "drafter"
    argv += ["--save-path", str(saved), "--max-steps", "2", "--epochs", "1", "--num-workers",
             "0", "--logger", "", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    monkeypatch.setattr(trainer_module, "get_local_rank", lambda: "cpu")
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    cli.main(TrainConfig.resolve(argv))
    config = json.loads((saved / "0" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2"
    assert (config["selector_rank"], config["selector_top_k"]) == (8, 4)
    theirs = load_file(str(saved / "0" / "model.safetensors"))
    ours = load_file(str(run / "train" / "drafter" / "model.safetensors"))
    shared = {k: v.shape for k, v in theirs.items() if k in ours}
    assert shared == {k: v.shape for k, v in ours.items()}  # every tensor of ours, same shape


def _size(directory: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in directory.rglob(pattern))


def test_a_native_extract_exports_to_speculators_without_a_re_extract(native_run,
                                                                      speculators_run, tmp_path):
    """Native shards -> one file per row, each holding its row alone (the chosen layers and the
    last), read by speculators' own loader as the same states a speculators-format extract
    gives; the export is the extract's size, not a shard per row."""
    pytest.importorskip("speculators.train.data", reason=SPECULATORS_HINT)
    from safetensors.torch import load_file
    from speculators.train.data import ArrowDataset

    out = tmp_path / "speculators"
    doc = export(native_run, "speculators", out)
    rows = _tokenized(native_run)
    assert doc["rows_out"] == len(rows) and doc["stored_layers"] == [1, 2, 3]
    loaded = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise",
                          hidden_states_dtype=torch.float32)
    for row in (0, 5, len(rows) - 1):
        mine = load_file(str(out / "hidden_states" / f"hs_{row}.safetensors"))
        theirs = load_file(str(speculators_run / "extract" / "hidden_states"
                               / f"hs_{row}.safetensors"))
        assert mine["token_ids"].tolist() == theirs["token_ids"].tolist() == rows[row][
            "input_ids"]
        torch.testing.assert_close(mine["hidden_states"], theirs["hidden_states"])
        sample = loaded[row]
        assert sample["verifier_last_hidden_states"].shape == (len(rows[row]["input_ids"]),
                                                               doc["hidden_size"])
    exported = _size(out / "hidden_states", "*.safetensors")
    extracted = _size(native_run / "extract" / "hidden_states", "*.safetensors")
    assert exported < 1.1 * extracted + 1024 * len(rows), (exported, extracted)


def test_a_speculators_extract_exports_to_specforge_at_its_size(speculators_run, tmp_path):
    _specforge()
    from specforge.runtime.data_plane.feature_store import load_feature_file

    out = tmp_path / "specforge"
    doc = export(speculators_run, "specforge", out)
    rows = _tokenized(speculators_run)
    first = sorted((out / "features").rglob("*.ckpt"))[0]
    row = int(first.stem.split("_")[1])
    record = load_feature_file(str(first))
    assert record["hidden_states"].shape == (1, len(rows[row]["input_ids"]),
                                             len(doc["layers"]) * doc["hidden_size"])
    # the chosen layers only: the last layer speculators needs is not copied to SpecForge
    exported = _size(out / "features", "*.ckpt")
    extracted = _size(speculators_run / "extract" / "hidden_states", "*.safetensors")
    share = len(doc["layers"]) / (len(doc["layers"]) + 1)
    assert exported < 1.1 * share * extracted + 2048 * doc["rows_out"], (exported, extracted)


def test_an_extract_without_the_last_layer_is_refused_with_the_rerun(native_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(native_run, run, ignore=shutil.ignore_patterns("docs", ".lock", "export"))
    stats_path = run / "extract" / "stats.json"
    stats = json.loads(stats_path.read_text())
    stats["total"]["stored_layers"] = stats["total"]["layers"]  # as extracts before this wrote
    stats_path.write_text(json.dumps(stats))
    with pytest.raises(StageError, match=r"extract --run .* --model .* --layers 1,2 --force"):
        export(run, "speculators", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_export_never_replaces_a_directory_it_did_not_write(native_run, tmp_path):
    _specforge()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(StageError, match="not an export this tool wrote"):
        export(native_run, "specforge", mine)
    assert (mine / "notes.txt").read_text() == "keep me"
    out = tmp_path / "again"
    first = export(native_run, "specforge", out)
    second = export(native_run, "specforge", out)  # its own export: replaced whole
    assert first["rows_out"] == second["rows_out"] and (out / "export.json").is_file()
    assert not list(tmp_path.glob(".*.partial")) and not list(tmp_path.glob(".*.old"))


def test_an_export_whose_publish_fails_leaves_the_previous_one_in_place(native_run, tmp_path,
                                                                        monkeypatch):
    """The export publishes as the run's stages do (core.rundir.swap_in): the old export is
    renamed away, not deleted, until the new one is in; a failed rename puts it back."""
    import os

    _specforge()
    out = tmp_path / "out"
    export(native_run, "specforge", out)
    before = (out / "export.json").read_bytes()
    real = os.replace

    def refuse_the_new(src, dst):
        if str(src).endswith(".out.partial"):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", refuse_the_new)
    with pytest.raises(OSError, match="No space left"):
        export(native_run, "specforge", out)
    assert (out / "export.json").read_bytes() == before
    assert not (tmp_path / ".out.old").exists()


def test_the_cli_prints_the_commands_and_says_what_is_wrong(native_run, tmp_path, capsys):
    """`dflash-etl export`: the serve line for the drafter, the trainer command, and a user
    error as one line with exit 1 (no traceback)."""
    from dflash_etl.cli.main import main

    assert main(["export", "--run", str(native_run), "--to", "vllm"]) == 0
    out = capsys.readouterr().out
    serve = shlex.split(out.splitlines()[1])
    assert serve[:2] == ["vllm", "serve"]
    assert json.loads(serve[4])["model"] == str((native_run / "train" / "drafter").resolve())
    assert main(["export", "--run", str(tmp_path), "--to", "speculators",
                 "--out", str(tmp_path / "s")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "is not a run directory (no manifest.json)" in err
    assert "Traceback" not in err
    # --out with --to vllm (which writes nothing) was ignored in silence
    assert main(["export", "--run", str(native_run), "--to", "vllm", "--out",
                 str(tmp_path / "v")]) == 1
    assert "writes nothing: drop --out" in capsys.readouterr().err


def test_the_export_reads_what_tokenize_and_train_wrote_and_names_a_missing_field(native_run,
                                                                                    tmp_path):
    """seq_length comes from tokenize's output (its settings.json, here 100, not the 8192 the
    export once assumed nor the manifest's copy), the block from the trained drafter; a field
    missing there is an error naming the file and the stage to rerun."""
    run = tmp_path / "run"
    shutil.copytree(native_run, run, ignore=shutil.ignore_patterns("docs", ".lock", "export"))
    settings = run / "tokenize" / "settings.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "seq_length": 100}))
    export(run, "specforge", tmp_path / "sf")
    config = json.loads((tmp_path / "sf" / "specforge_run.json").read_text())
    assert config["data"]["max_length"] == 100
    drafter = json.loads((run / "train" / "drafter" / "config.json").read_text())
    # the block is the draft config's (SpecForge's resolved config: test above), and the run
    # config overrides nothing of the drafter's shape
    draft = json.loads((tmp_path / "sf" / "dflash_draft_config.json").read_text())
    assert draft["block_size"] == drafter["dflash_config"]["block_size"] == 4
    assert not {"draft_block_size", "draft_num_hidden_layers"} & set(config["model"])
    del drafter["dflash_config"]["block_size"]
    (run / "train" / "drafter" / "config.json").write_text(json.dumps(drafter))
    with pytest.raises(StageError, match=r"config\.json has no block_size .*dflash-etl train"):
        export(run, "specforge", tmp_path / "again")


def test_a_failed_forced_rerun_leaves_the_complete_stage_as_it_was(native_run, tmp_path):
    """The trap: `extract --format speculators --force` without --model (a usage error) marked
    the complete extract `failed`, after which the export and `check` refused the run. Now a
    failed attempt, before or after its partial directory began, leaves the stage complete with
    its output, the attempt under `last_attempt`; a successful rerun clears it."""
    from dflash_etl.cli.main import main
    from dflash_etl.stages import extract
    from dflash_etl.validation.check import check_path

    _specforge()
    run = tmp_path / "run"
    shutil.copytree(native_run, run, ignore=shutil.ignore_patterns("docs", ".lock", "export"))

    def entry() -> dict:
        return json.loads((run / "manifest.json").read_text())["stages"]["extract"]

    before = entry()
    assert main(["extract", "--run", str(run), "--format", "speculators", "--force"]) != 0
    after = entry()
    assert (after["status"], after["fingerprint"]) == ("complete", before["fingerprint"])
    assert "model" in after["last_attempt"]["error"]
    broken = tmp_path / "broken"  # its config reads, its weights are gone: it fails at load
    shutil.copytree(before["settings"]["model"], broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(StageError):
        extract.run(None, run, force=True, progress=False, model=str(broken), layers="1,2")
    assert (run / ".extract.partial").is_dir()  # it had begun
    after = entry()
    assert (after["status"], after["fingerprint"]) == ("complete", before["fingerprint"])
    assert {k: v for k, v in after.items() if k != "last_attempt"} == before
    assert check_path(run, suites=False)["passed"]
    assert export(run, "specforge", tmp_path / "sf")["rows_out"] > 0
    target = before["settings"]["model"]
    extract.run(None, run, force=True, progress=False, model=target, layers="1,2")
    assert "last_attempt" not in entry() and "published" not in entry()


def test_a_drafter_of_other_layers_is_refused_naming_both_lists(native_run, tmp_path):
    _specforge()
    run = tmp_path / "run"
    shutil.copytree(native_run, run, ignore=shutil.ignore_patterns("docs", ".lock", "export"))
    path = run / "train" / "drafter" / "config.json"
    config = json.loads(path.read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 3]
    path.write_text(json.dumps(config))
    with pytest.raises(StageError) as refused:
        export(run, "specforge", tmp_path / "sf")
    message = str(refused.value)
    assert "reads layers [0, 3] but extract stored [1, 2]" in message
    assert "mask_token_id" not in message  # the lists, not the whole dflash_config


def test_a_drafter_declaring_another_attention_is_refused_wherever_it_would_be_served(
        native_run, tmp_path):
    """The failure-mode benchmark's k: a drafter directory whose config.json declares a
    sliding window (or causal attention) that it never trained with — an engine reading those
    keys serves another attention pattern. export (SpecForge, vLLM's serve line) and eval's
    load refuse it, naming the keys; the run's own drafter passes."""
    _specforge()
    from dflash_etl.models.drafter import DFlashDrafter
    from dflash_etl.models.serving import vllm_command

    run = tmp_path / "run"
    shutil.copytree(native_run, run, ignore=shutil.ignore_patterns("docs", ".lock", "export"))
    assert "--speculative-config" in vllm_command(run)
    path = run / "train" / "drafter" / "config.json"
    config = json.loads(path.read_text())
    config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    config["use_sliding_window"] = True
    path.write_text(json.dumps(config))
    for attempt in (lambda: export(run, "specforge", tmp_path / "sf"),
                    lambda: vllm_command(run), lambda: DFlashDrafter.load(path.parent)):
        with pytest.raises(StageError) as refused:
            attempt()
        message = str(refused.value)
        assert "layer_types ['sliding_attention'], use_sliding_window = True" in message
        assert "full_attention" in message and str(path) in message


def test_a_rerun_with_other_settings_says_what_differs_and_check_reports_train_stale(
        native_run, tmp_path, capsys):
    """Re-extracting other layers under a trained drafter: the rerun names the settings that
    differ and that train depends on the output; `check` then fails train as stale until train
    is rerun. A forced rerun that gives the same output leaves nothing stale."""
    from dflash_etl.stages import extract, train
    from dflash_etl.validation.check import check_path

    run = tmp_path / "run"
    shutil.copytree(native_run, run, ignore=shutil.ignore_patterns("docs", ".lock", "export"))
    target = json.loads((run / "manifest.json").read_text())["stages"]["extract"]["settings"][
        "model"]
    assert check_path(run, suites=False)["passed"]
    extract.run(None, run, force=True, progress=False, model=target, layers="1,2")
    assert "redoing" not in capsys.readouterr().err  # same settings
    assert check_path(run, suites=False)["passed"]  # the same output: train still follows

    extract.run(None, run, progress=False, model=target, layers="2")
    err = capsys.readouterr().err
    assert "extract: redoing with other settings than its published output" in err
    assert "layers [1, 2] -> [2]" in err and "settings.layers \"1,2\" -> \"2\"" in err
    assert "train was built on that output and will be stale" in err
    checked = check_path(run, suites=False)
    assert not checked["passed"]
    assert "FAIL train (manifest.json): the stage is stale: built on the extract output" in \
        checked["summary"] and f"dflash-etl train --run {run}" in checked["summary"]
    from dflash_etl.report import build_docs

    page = (build_docs(run) / "index.html").read_text()
    assert 'data-status="fail">STALE</span>' in page
    train.run(None, run, progress=False, target=target, layers="2", draft_layers=1,
              block_size=4, steps=2, batch_rows=2, eval_prompts=1, eval_new_tokens=4,
              save_every=100)
    assert check_path(run, suites=False)["passed"]


def test_an_export_that_cannot_fit_is_refused_first_and_a_full_disk_leaves_no_partial(
        native_run, tmp_path, monkeypatch):
    """Free space is checked before anything is written (the figure in the right unit), and a
    disk that fills up anyway is "disk full" with the partial export removed, not a torch
    internal error with its partial left on the full disk."""
    import errno
    import os

    import dflash_etl.handoff.export as export_module

    _specforge()
    real_usage = shutil.disk_usage
    monkeypatch.setattr(export_module.shutil, "disk_usage",
                        lambda p: real_usage(p)._replace(free=1000))
    with pytest.raises(StageError, match=r"the export needs ~[\d.]+ [KM]i?B but .* has "
                       r"1000 B free.*nothing was written"):
        export(native_run, "specforge", tmp_path / "sf")
    assert not (tmp_path / "sf").exists() and not (tmp_path / ".sf.partial").exists()
    monkeypatch.setattr(export_module.shutil, "disk_usage", real_usage)

    written = []

    def full(obj, path, *a, **k):
        written.append(path)
        if len(written) > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, path, *a, **k)

    real_save = torch.save
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(StageError, match=r"filled up while the export was written.*partial "
                       r"export was removed"):
        export(native_run, "specforge", tmp_path / "sf")
    assert not (tmp_path / ".sf.partial").exists() and not (tmp_path / "sf").exists()


def test_a_read_only_run_exports_to_an_out_elsewhere(native_run, tmp_path, monkeypatch, capsys):
    """An archived run on a read-only disk could not be exported at all (the run lock is a file
    in it). Now it is read unlocked into --out elsewhere; into itself it is refused, clearly.
    (The tests run as root, whom permissions do not stop: the disk's refusal is simulated at
    the lock file, where a read-only mount refuses.)"""
    import errno

    import dflash_etl.core.lock as lock_module

    _specforge()
    real_open = lock_module.os.open

    def read_only(path, flags, *args):
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(lock_module.os, "open", read_only)
    doc = export(native_run, "specforge", tmp_path / "sf")
    assert doc["rows_out"] > 0 and (tmp_path / "sf" / "export.json").is_file()
    assert "is read-only (Read-only file system): reading it without the run lock" in \
        capsys.readouterr().err
    with pytest.raises(StageError, match=r"is read-only .*give the export an --out directory"):
        export(native_run, "specforge")


KILLED_RERUN = """
import os, signal, sys
from dflash_etl.core.lock import run_lock
from dflash_etl.core.rundir import RunDir
with run_lock(sys.argv[1], "extract"):
    RunDir(sys.argv[1]).begin("extract", "a-forced-rerun")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_an_export_after_a_killed_forced_extract_rerun_exports_the_complete_one(
        native_run, tmp_path, capsys):
    """A `--force` extract SIGKILLed mid-way left extract `running` over its complete output:
    export refused it until the next stage command. Now export, holding the run lock, settles
    it as a stage would and exports the complete extract."""
    import os
    import signal
    import subprocess

    run = tmp_path / "run"
    shutil.copytree(native_run, run, ignore=shutil.ignore_patterns("docs", ".lock", "export"))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    killed = subprocess.run([sys.executable, "-c", KILLED_RERUN, str(run)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]

    def extract_status() -> str:
        return json.loads((run / "manifest.json").read_text())["stages"]["extract"]["status"]

    assert extract_status() == "running"
    doc = export(run, "specforge", out=tmp_path / "out", progress=False)
    assert extract_status() == "complete" and doc["rows_out"] > 0
    assert "extract: the process running it (pid" in capsys.readouterr().err
