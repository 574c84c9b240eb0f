"""The train stage on a tiny random-weight target (4 layers, hidden 64, untied head, the project's
tokenizer): the data is the target's own greedy replies (regenerate --mode all), the hidden states
come from extract; a drafter trained a few hundred steps reaches a tau clearly above an untrained
one, speculative decoding reproduces the target's greedy output, blocks see only the context
before their anchor, resume equals an uninterrupted run, online equals offline, and DDP runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_etl.core.errors import StageError
from dflash_etl.handoff.export import vllm_command
from dflash_etl.models.training import loss as training_loss
from dflash_etl.stages import extract, ingest, load_config, regenerate, tokenize, train

torch = pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[1]
SMALL = {"draft_layers": 1, "block_size": 8, "batch_rows": 4, "anchors_per_row": 8,
         "eval_prompts": 4, "eval_new_tokens": 16, "lr": 3e-3}


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, untied_target) -> Path:
    """The embedded default's sources, replies rewritten by the target, tokenized, extracted."""
    run_dir = tmp_path_factory.mktemp("train-run") / "run"
    config = load_config(REPO / "data" / "pipeline.toml")
    ingest.run(config, run_dir, progress=False)
    regenerate.run(config, run_dir, progress=False, model=str(untied_target), max_new_tokens=48)
    tokenize.run(config, run_dir, progress=False)
    extract.run(config, run_dir, progress=False, model=str(untied_target), draft_layers=1)
    return run_dir


@pytest.mark.slow
def test_training_lifts_tau_clearly_above_an_untrained_drafter(extracted, untied_target, tmp_path,
                                                               copy_run, monkeypatch):
    run_dir = copy_run(extracted, tmp_path, "*train*", "docs")
    doc = train.run(None, run_dir, progress=False, target=str(untied_target),
                    **{**SMALL, "block_size": 16, "steps": 250, "batch_rows": 8,
                       "anchors_per_row": 32, "eval_prompts": 8, "eval_new_tokens": 32,
                       "save_every": 100})
    total = doc["total"]
    assert total["rows_in"] == total["rows_out"] + sum(total["rows_filtered"].values())
    assert total["rows_filtered"]["held_out_for_eval"] >= 8
    evaluation = json.loads((run_dir / "train" / "eval.json").read_text())
    assert evaluation["tau_untrained"] < 1.3  # random drafts are almost never accepted
    assert evaluation["tau_final"] > evaluation["tau_untrained"] + 1.5
    assert evaluation["tau_final"] == total["tau_final"] and evaluation["prompts"] == 8
    log = [json.loads(line) for line in (run_dir / "train" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 251))
    assert np.mean([r["loss"] for r in log[-20:]]) < np.mean([r["loss"] for r in log[:20]]) - 0.5
    config = json.loads((run_dir / "train" / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    from transformers import AutoConfig  # z-lab's loader reads it as a Qwen3 config

    qwen3 = AutoConfig.from_pretrained(run_dir / "train" / "drafter")
    assert type(qwen3).__name__ == "Qwen3Config" and qwen3.num_hidden_layers == 1
    assert (qwen3.hidden_size, qwen3.head_dim, qwen3.vocab_size) == (64, 16, 1237)
    assert config["dflash_config"]["target_layer_ids"] == [2]  # extract's choice for K = 1
    assert config["dflash_config"]["mask_token_id"] == 1226  # the first row no token uses
    from safetensors.torch import load_file

    weights = load_file(str(run_dir / "train" / "drafter" / "model.safetensors"))
    assert weights["fc.weight"].shape == (64, 64) and "layers.0.self_attn.k_norm.weight" in weights
    assert not any("embed" in k or "lm_head" in k for k in weights)  # shared with the target
    assert json.loads((run_dir / "train" / "contract.json").read_text())["passed"]
    assert sorted(p.name for p in (run_dir / "train" / "checkpoints").iterdir()) == [
        "step-000200", "step-000250"]  # the newest two are kept
    report = (run_dir / "docs" / "index.html").read_text()
    assert f'data-key="train-tau_final">{evaluation["tau_final"]:.3f}' in report
    # z-lab's own decode loop (`dflash.model.dflash_generate`, its DFlashDraftModel loaded from
    # the drafter directory) on the same target and held-out prompts counts the same tau
    zlab = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")
    from transformers import AutoModelForCausalLM


    target = AutoModelForCausalLM.from_pretrained(untied_target, dtype=torch.float32).eval()
    tau = zlab_tau(zlab, run_dir, target, prompts=8, new_tokens=32, monkeypatch=monkeypatch)
    assert abs(tau - evaluation["tau_final"]) < 1e-9


def zlab_tau(zlab, run_dir: Path, target, prompts: int, new_tokens: int, monkeypatch,
             model_class: str = "DFlashDraftModel") -> float:
    """tau as z-lab's own decode loop counts it (`dflash.model.dflash_generate`, its
    `model_class` loaded from the run's drafter directory) on train's held-out prompts."""
    import time

    from dflash_etl.models.acceptance import eos_token_ids

    _, held, _ = train._split(tokenize_rows(run_dir),
                              train.TrainSettings(eval_prompts=prompts))
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # CPU only: its timer syncs CUDA
    drafter = getattr(zlab, model_class).from_pretrained(run_dir / "train" / "drafter",
                                                         dtype=torch.float32).eval()
    per_prompt = []
    for prompt in held:
        out = zlab.dflash_generate(drafter, target, torch.tensor([prompt]), new_tokens,
                                   sorted(eos_token_ids(target)), return_stats=True)
        if out.acceptance_lengths:  # z-lab's benchmark averages the prompts that took a step
            per_prompt.append(np.mean(out.acceptance_lengths))
    return float(np.mean(per_prompt))


def test_a_dflash2_drafter_trains_and_zlabs_decode_counts_its_tau(
        extracted, untied_target, tmp_path, copy_run, monkeypatch):
    """[train] arch = "dflash2": the selector's loss falls, the convolutions leave the identity,
    tau rises clearly above the untrained drafter's, and z-lab's own DFlash2DraftModel and
    dflash_generate (its selector path) on the saved directory count exactly our tau."""
    zlab = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir = copy_run(extracted, tmp_path, "*train*", "docs")
    doc = train.run(None, run_dir, progress=False, target=str(untied_target), arch="dflash2",
                    selector_rank=32, eval_tree_budget=6,
                    **{**SMALL, "steps": 120, "eval_prompts": 6, "eval_new_tokens": 24,
                       "anchors_per_row": 16})
    evaluation = json.loads((run_dir / "train" / "eval.json").read_text())
    assert evaluation["tau_final"] > evaluation["tau_untrained"] + 1.0
    # the tree's tau at one budget, beside the chain's: the same drafter's unary distributions
    tree = evaluation["tree"]
    # a verify pass reads the anchor and at most 6 drafts
    assert tree["budget"] == 6 and 1 < tree["nodes_per_step"] <= 7 and tree["tau"] > 1.0
    assert doc["total"]["tau_tree"] == tree and doc["total"]["arch"] == "dflash2"
    record = json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]
    assert any(f"tau {tree['tau']:.3f}" in line and "<= 6 drafts" in line
               for line in train.TrainStage.summary(doc, record, run_dir / "train"))
    log = [json.loads(line) for line in (run_dir / "train" / "log.jsonl").read_text().splitlines()]
    assert np.mean([r["selector_loss"] for r in log[-10:]]) < np.mean(
        [r["selector_loss"] for r in log[:10]]) - 0.5
    config = json.loads((run_dir / "train" / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"]["selector_rank"] == 32
    weights = load_file(str(run_dir / "train" / "drafter" / "model.safetensors"))
    assert float(weights["layers.0.mlp_conv.kernel_projection.weight"].abs().max()) > 0
    assert weights["candidate_selector.predecessor_codebook"].shape == (1237, 32)
    assert doc["total"]["tau_final"] == evaluation["tau_final"]
    target = AutoModelForCausalLM.from_pretrained(untied_target, dtype=torch.float32).eval()
    tau = zlab_tau(zlab, run_dir, target, prompts=6, new_tokens=24, monkeypatch=monkeypatch,
                   model_class="DFlash2DraftModel")
    assert abs(tau - evaluation["tau_final"]) < 1e-9


def test_speculative_decoding_is_the_targets_greedy_decoding(extracted, untied_target):
    """Whatever is proposed, the output is the target's greedy continuation (transformers'
    generate), and each step scores the accepted prefix + 1: a drafter, an oracle that is right
    on the first 2 of each block's 3 drafts, and a perfect one."""
    from dflash_etl.models.acceptance import drafter_proposer, eos_token_ids, speculative_decode
    from dflash_etl.models.drafter import DFlashDrafter, DrafterConfig
    from dflash_etl.models.target import Target, TargetSpec

    tgt = Target(TargetSpec(model=str(untied_target), layers="1,2", device="cpu"))
    config = DrafterConfig.from_target(tgt.model.config, draft_layers=1, target_layer_ids=[1, 2],
                                       mask_token_id=1226, block_size=4)
    drafter = DFlashDrafter(config).eval()
    rows = tokenize_rows(extracted)
    prompt = train.eval_prompt(rows[3]["input_ids"], rows[3]["loss_mask"])
    eos = eos_token_ids(tgt.model)
    n = 24
    greedy = tgt.model.generate(torch.tensor([prompt]), max_new_tokens=n + 8, do_sample=False,
                                eos_token_id=sorted(eos), pad_token_id=0)[0, len(prompt):].tolist()
    assert not eos & set(greedy[:n])  # the oracles below assume no early end

    def oracle(right: int):
        def propose(context, seq, room):
            assert context.shape[0] == len(seq) - 1  # the states of every token before the anchor
            done = len(seq) - len(prompt)
            truth = greedy[done:done + min(3, room)]
            return truth[:right] + [(t + 1) % 1226 for t in truth[right:]]
        return propose

    for use_cache in (True, False):  # KV cache with cropping, and re-reading the sequence
        got = speculative_decode(tgt, drafter_proposer(tgt, drafter), prompt, n, eos,
                                 use_cache=use_cache)
        assert got.tokens == greedy[:n]
        assert all(1 <= a <= 4 for a in got.accepted)
        two = speculative_decode(tgt, oracle(2), prompt, n, eos, use_cache=use_cache)
        # 23 tokens after the prefill's: 7 steps of 3, then the 2 max_new_tokens leaves room for
        # (z-lab's count: a step scores what it adds to the text, not accepted + 1 past the end)
        assert two.tokens == greedy[:n] and two.accepted == [3] * 7 + [2]
        assert two.tau == 23 / 8
        perfect = speculative_decode(tgt, oracle(3), prompt, n, eos, use_cache=use_cache)
        assert perfect.tokens == greedy[:n] and perfect.accepted[:-1] == [4] * (len(
            perfect.accepted) - 1)
    trained = DFlashDrafter(config).eval()  # cached and uncached agree on a drafter's proposals
    torch.nn.init.normal_(trained.fc.weight, std=0.5)
    a = speculative_decode(tgt, drafter_proposer(tgt, trained), prompt, n, eos, use_cache=True)
    b = speculative_decode(tgt, drafter_proposer(tgt, trained), prompt, n, eos, use_cache=False)
    assert a == b


def tokenize_rows(run_dir: Path) -> list[dict]:
    import datasets

    return datasets.load_from_disk(str(run_dir / "tokenize" / "dataset")).with_format(
        None).to_list()


def test_blocks_see_only_the_context_before_their_anchor():
    """make_batch labels a block with the row's tokens at anchor+k, supervised where the loss
    mask is; the drafter's block output ignores context at or after the anchor."""
    from dflash_etl.models.drafter import DFlashDrafter, DrafterConfig

    ids = list(range(10, 30))
    mask = [0] * 8 + [1] * 12  # anchors can be 8..18 (position 19 has no successor)
    rng = np.random.default_rng(0)
    states = [torch.randn(20, 2, 16)]
    rows = [{"input_ids": ids, "loss_mask": mask}]
    picks = training_loss.sample_anchors(rows, 5, rng)
    batch = training_loss.make_batch(rows, states, picks, 4, 99)
    anchors = batch["anchors"][0].tolist()
    assert len(anchors) == 5 and all(8 <= a <= 18 for a in anchors)
    for n, a in enumerate(anchors):
        assert batch["block_ids"][0, n].tolist() == [ids[a], 99, 99, 99]
        for k in range(1, 4):
            inside = a + k < 20
            assert bool(batch["label_ok"][0, n, k]) == inside
            if inside:
                assert int(batch["labels"][0, n, k]) == ids[a + k]
    assert not batch["label_ok"][0, :, 0].any()  # the anchor itself is given, not predicted

    config = DrafterConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=8, intermediate_size=32,
                           vocab_size=100, target_layer_ids=[0, 1], mask_token_id=99,
                           block_size=4)
    drafter = DFlashDrafter(config).eval()
    context = torch.randn(1, 20, 32)
    blocks = torch.randn(1, 1, 4, 16)
    anchor = torch.tensor([[12]])
    valid = torch.ones(1, 20, dtype=torch.bool)
    with torch.no_grad():
        base = drafter(context, valid, blocks, anchor)
        later = context.clone()
        later[:, 12:] = torch.randn(1, 8, 32)  # the anchor's own state and everything after
        assert torch.allclose(base, drafter(later, valid, blocks, anchor), atol=1e-6)
        earlier = context.clone()
        earlier[:, 11] += 1.0
        assert not torch.allclose(base, drafter(earlier, valid, blocks, anchor), atol=1e-4)
    assert training_loss.anchor_candidates(np.array([1, 1, 0, 1, 1, 1, 0])).tolist() == [0, 3, 4]


def test_interrupted_training_resumes_to_the_same_weights(extracted, untied_target, tmp_path,
                                                          monkeypatch, copy_run):
    from safetensors.torch import load_file

    settings = {**SMALL, "steps": 6, "save_every": 3}
    whole = copy_run(extracted, tmp_path / "whole", "*train*", "docs")
    train.run(None, whole, progress=False, target=str(untied_target), **settings)

    broken = copy_run(extracted, tmp_path / "broken", "*train*", "docs")
    real = train.Trainer.step

    def crash_at_five(self, step):
        if step == 4:
            raise KeyboardInterrupt
        return real(self, step)

    monkeypatch.setattr(train.Trainer, "step", crash_at_five)
    with pytest.raises(KeyboardInterrupt):
        train.run(None, broken, progress=False, target=str(untied_target), **settings)
    partial = broken / ".train.partial"
    assert [p.name for p in (partial / "checkpoints").iterdir()] == ["step-000003"]
    monkeypatch.setattr(train.Trainer, "step", real)
    doc = train.run(None, broken, progress=False, target=str(untied_target), **settings)
    assert doc["total"]["steps_this_run"] == 3  # steps 4..6 only
    a = load_file(str(whole / "train" / "drafter" / "model.safetensors"))
    b = load_file(str(broken / "train" / "drafter" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = [json.loads(x)["step"] for x in (broken / "train" / "log.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3, 4, 5, 6]
    again = train.run(None, broken, progress=False, target=str(untied_target), **settings)
    assert again.get("skipped") is True


@pytest.fixture(scope="module")
def interrupted(extracted, untied_target, tmp_path_factory, copy_run) -> Path:
    """A run killed after its step-3 checkpoint (settings: INTERRUPTED): resumable as it is."""
    run_dir = copy_run(extracted, tmp_path_factory.mktemp("interrupted"), "*train*", "docs")
    real = train.Trainer.step

    def crash_at_five(self, step):
        if step == 4:
            raise KeyboardInterrupt
        return real(self, step)

    train.Trainer.step = crash_at_five
    try:
        with pytest.raises(KeyboardInterrupt):
            train.run(None, run_dir, progress=False, target=str(untied_target), **INTERRUPTED)
    finally:
        train.Trainer.step = real
    return run_dir


INTERRUPTED = {**SMALL, "steps": 6, "save_every": 3}


def _tamper_step(ckpt: Path) -> None:
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "step": 6}))


def _published_as_more_steps(ckpt: Path) -> None:
    """A 3-step checkpoint renamed and relabelled step 6, consistently."""
    _tamper_step(ckpt)
    ckpt.rename(ckpt.with_name("step-000006"))


def _tamper_tensors(ckpt: Path) -> None:
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "tensors": state["tensors"] + 1}))


def _corrupt_optimizer(ckpt: Path) -> None:
    """Garbage of the file's own size (state.json's record of it still matches)."""
    size = (ckpt / "optimizer.pt").stat().st_size
    (ckpt / "optimizer.pt").write_bytes((b"\x80\x02garbage" * size)[:size])


def _pickle_of_other_objects(ckpt: Path) -> None:
    import datetime

    import torch

    torch.save({"optimizer": {}, "scheduler": datetime.date(2020, 1, 1)}, ckpt / "optimizer.pt")
    state = json.loads((ckpt / "state.json").read_text())
    state["files"]["optimizer.pt"] = (ckpt / "optimizer.pt").stat().st_size
    (ckpt / "state.json").write_text(json.dumps(state))


TAMPERED = {
    "a step that is not the directory's": (_tamper_step, "state.json says step 6 but the "
                                                         "directory is step-000003"),
    "a 3-step checkpoint published as 6": (_published_as_more_steps,
                                           "its scheduler has made 3 steps, state.json says 6"),
    "a missing optimizer file": (lambda c: (c / "optimizer.pt").unlink(), "optimizer.pt missing"),
    "a tampered tensor count": (_tamper_tensors, "state.json records .* tensors, "
                                                 "model.safetensors holds"),
    "a corrupt optimizer.pt": (_corrupt_optimizer, "optimizer.pt is not an optimizer state torch "
                                                   "loads as weights only"),
    "a pickle of other objects": (_pickle_of_other_objects, "optimizer.pt is not an optimizer "
                                                            "state torch loads as weights only"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_checkpoint_that_does_not_match_its_files_is_refused(interrupted, untied_target, tmp_path,
                                                               case):
    run_dir = tmp_path / "run"
    shutil.copytree(interrupted, run_dir)
    ckpt = run_dir / ".train.partial" / "checkpoints" / "step-000003"
    tamper, reason = TAMPERED[case]
    tamper(ckpt)
    with pytest.raises(StageError, match="cannot resume from the checkpoint .*step-00000[36]: "
                                         + reason) as caught:
        train.run(None, run_dir, progress=False, target=str(untied_target), **INTERRUPTED)
    assert "Delete that directory" in str(caught.value)


def test_online_and_speculators_format_states_train_like_native_ones(extracted, untied_target,
                                                                     tmp_path, copy_run):
    from safetensors.torch import load_file

    settings = {**SMALL, "steps": 3, "eval_prompts": 2, "eval_new_tokens": 4}
    offline = copy_run(extracted, tmp_path / "offline", "*train*", "docs")
    train.run(None, offline, progress=False, target=str(untied_target), **settings)
    online = copy_run(extracted, tmp_path / "online", "*train*", "docs")
    shutil.rmtree(online / "extract")
    # online takes [extract]'s layers (no config: extract's default, K = 5); name extract's here
    doc = train.run(None, online, progress=False, target=str(untied_target), online=True,
                    layers="2", **settings)
    assert doc["total"]["target_layers"] == [2] and doc["total"]["online"] is True
    # per-row files + the last layer
    speculators = copy_run(extracted, tmp_path / "speculators", "*train*", "docs")
    extract.run(None, speculators, force=True, progress=False, model=str(untied_target),
                draft_layers=1, format="speculators")
    train.run(None, speculators, progress=False, target=str(untied_target), **settings)
    a = load_file(str(offline / "train" / "drafter" / "model.safetensors"))
    for other in (online, speculators):
        b = load_file(str(other / "train" / "drafter" / "model.safetensors"))
        assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a), other.parent.name


def test_online_training_with_states_from_a_server_trains_the_offline_drafter(
        extracted, untied_target, tmp_path, copy_run, capsys):
    """train --online --states-from server: each batch's states from a server speaking vLLM's
    extract_hidden_states protocol (the dev server), the next batch asked for while a step
    trains; the drafter equals offline training on extracted states. A dead server stops the
    run at its start, named (a row no server gives stops it naming the row: test_extract_server)."""
    from safetensors.torch import load_file

    from dflash_etl.models.devserver import DevServer
    from dflash_etl.models.states_server import vllm_layer_ids

    settings = {**SMALL, "steps": 3, "eval_prompts": 2, "eval_new_tokens": 4}
    offline = copy_run(extracted, tmp_path / "offline", "*train*", "docs")
    train.run(None, offline, progress=False, target=str(untied_target), **settings)
    served = copy_run(extracted, tmp_path / "served", "*train*", "docs")
    shutil.rmtree(served / "extract")
    states = tmp_path / "server-states"
    with DevServer(str(untied_target), extract_layers=vllm_layer_ids([2], 4),
                   states_dir=str(states)) as server:
        doc = train.run(None, served, progress=False, target=str(untied_target), online=True,
                        layers="2", states_from="server", states_endpoint=server.url,
                        states_dir=str(states), **settings)
        asked = server.requests
    assert doc["total"]["online"] is True and asked >= 3 * SMALL["batch_rows"]
    assert doc["total"]["target_loaded"] == "whole"  # tau is measured here: the decoder runs
    (load,) = doc["total"]["states_server"].pop("servers").values()  # the one server's
    assert load["served"] == load["requests"] == 3 * SMALL["batch_rows"] and load["failed"] == 0
    assert 0 < load["busy_share"] <= 1 and load["mean_in_flight"] > 0
    # every step after the first found its rows already asked for
    assert doc["total"]["states_server"] == {"rows_requested": 3 * SMALL["batch_rows"],
                                             "rows_prefetched": 2 * SMALL["batch_rows"]}
    assert '"eagle_aux_hidden_state_layer_ids": [3, 4]' in capsys.readouterr().err
    a = load_file(str(offline / "train" / "drafter" / "model.safetensors"))
    b = load_file(str(served / "train" / "drafter" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert not list(states.glob("*.safetensors"))  # each file removed once read
    dead = copy_run(extracted, tmp_path / "dead", "*train*", "docs")
    with DevServer(str(untied_target), extract_layers=vllm_layer_ids([2], 4),
                   states_dir=str(states)) as server:
        url = server.url
    # as regenerate's fleet client: the model list is asked for first, the start fails
    with pytest.raises(StageError, match=f"cannot list the models of {url}/models"):
        train.run(None, dead, progress=False, target=str(untied_target), online=True,
                  layers="2", states_from="server", states_endpoint=url,
                  states_dir=str(states), **settings)
    with pytest.raises(StageError, match="--states-from server needs --online"):
        train.run(None, dead, progress=False, target=str(untied_target),
                  states_from="server", **settings)
    # a server started with our layer ids (not vLLM's, ours + 1): refused at the start, each
    # layer named by what it holds
    with DevServer(str(untied_target), extract_layers=[2, 3], states_dir=str(states)) as server, \
            pytest.raises(StageError, match=r"layer 0 \(vLLM layer id 3 expected\) holds vLLM "
                          r"layer 2's states.*layer 1 \(vLLM layer id 4 expected\) holds vLLM "
                          r"layer 3's"):
        train.run(None, dead, progress=False, target=str(untied_target), online=True,
                  layers="2", states_from="server", states_endpoint=server.url,
                  states_dir=str(states), **settings)


def test_training_from_a_server_without_tau_reads_only_the_embedding_and_head_of_the_target(
        extracted, untied_target, tmp_path, copy_run, capsys):
    """A 27B target's decoder does not fit beside the drafter on a training node. With the
    states from a server and no tau measured here (eval_prompts = 0), train reads the target's
    embedding and LM head alone: a checkpoint holding nothing else trains the drafter the whole
    target trains offline. Before, train loaded the whole target and refused eval_prompts 0
    (the whole target with eval_prompts > 0: test_online_training_with_states_from_a_server)."""
    from safetensors.torch import load_file, save_file

    from dflash_etl.models.devserver import DevServer
    from dflash_etl.models.states_server import vllm_layer_ids

    settings = {**SMALL, "steps": 3, "eval_prompts": 0}
    offline = copy_run(extracted, tmp_path / "offline", "*train*", "docs")
    train.run(None, offline, progress=False, target=str(untied_target), **settings)
    head = tmp_path / "head-only-target"
    shutil.copytree(untied_target, head)
    weights = load_file(str(head / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if k.endswith(("embed_tokens.weight",
                                                              "lm_head.weight"))}
    assert len(kept) == 2 and len(weights) > 20
    save_file(kept, str(head / "model.safetensors"), metadata={"format": "pt"})
    config = load_config(REPO / "data" / "pipeline.toml")
    # the spot check would load the target (random decoder weights here): off, loudly
    config.raw["extract"] = {**config.raw.get("extract", {}), "spot_check": "off"}
    served = copy_run(extracted, tmp_path / "served", "*train*", "docs")
    shutil.rmtree(served / "extract")
    states = tmp_path / "server-states"
    with DevServer(str(untied_target), extract_layers=vllm_layer_ids([2], 4),
                   states_dir=str(states)) as server:
        doc = train.run(config, served, progress=False, target=str(head), online=True,
                        layers="2", states_from="server", states_endpoint=server.url,
                        states_dir=str(states), **settings)
    assert doc["total"]["target_loaded"] == "embedding and head"
    assert doc["total"]["tau_final"] is None and doc["total"]["eval_prompts"] == 0
    err = capsys.readouterr().err
    assert "not checked against the target" in err and "tau: not measured here" in err
    a = load_file(str(offline / "train" / "drafter" / "model.safetensors"))
    b = load_file(str(served / "train" / "drafter" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert json.loads((served / "train" / "contract.json").read_text())["passed"]
    assert json.loads((served / "train" / "eval.json").read_text())["tau_final"] is None


def test_the_target_head_alone_refuses_a_checkpoint_that_is_not_its_configs(untied_target,
                                                                          tmp_path):
    """Reading two tensors by name must not pair a config with another model's embedding, nor
    tie a head the config unties: each is refused naming the file and what differs."""
    from safetensors.torch import load_file, save_file

    from dflash_etl.models.target import TargetSpec
    from dflash_etl.models.target_head import HeadTarget

    weights = load_file(str(untied_target / "model.safetensors"))
    embed = next(k for k in weights if k.endswith("embed_tokens.weight"))
    head = HeadTarget(TargetSpec(model=str(untied_target), layers="2", device="cpu"))
    assert torch.equal(head.model.get_input_embeddings().weight, weights[embed])
    assert torch.equal(head.model.get_output_embeddings().weight, weights["lm_head.weight"])
    assert head.model.model.layers[0].mlp.up_proj.weight.device.type == "meta"
    no_head = tmp_path / "no-head"
    shutil.copytree(untied_target, no_head)
    save_file({embed: weights[embed]}, str(no_head / "model.safetensors"))
    with pytest.raises(StageError, match=r"unties the LM head.*no `lm_head\.weight`"):
        HeadTarget(TargetSpec(model=str(no_head), layers="2", device="cpu"))
    save_file({embed: weights[embed][:, :32].contiguous(),
               "lm_head.weight": weights["lm_head.weight"]}, str(no_head / "model.safetensors"))
    with pytest.raises(StageError, match=r"is \[1237, 32\], but the config's vocabulary x hidden "
                                         r"is \[1237, 64\]"):
        HeadTarget(TargetSpec(model=str(no_head), layers="2", device="cpu"))


def test_the_published_drafter_describes_itself_and_train_prints_its_serve_line(
        extracted, untied_target, tmp_path, capsys, copy_run):
    """Before: no model code and no auto_map (AutoModel with remote code gave a plain
    Qwen3Model), max_position_embeddings left to vLLM's default, one layer-id convention. Now
    train/drafter holds dflash.py, AutoModel gives our drafter's output, config.json names the
    layers both ways (as extract's stats do), and train prints the `vllm serve` line."""
    import shlex

    from transformers import AutoConfig, AutoModel

    from dflash_etl.models.drafter import DFlashDrafter

    ext = json.loads((extracted / "extract" / "stats.json").read_text())["total"]
    assert (ext["target_layer_ids"], ext["aux_hidden_state_layer_ids"]) == ([2], [3])
    run_dir = copy_run(extracted, tmp_path, "*train*", "docs")
    with pytest.raises(StageError, match="no trained drafter"):
        vllm_command(run_dir)
    capsys.readouterr()
    train.run(None, run_dir, progress=False, target=str(untied_target),
              **{**SMALL, "steps": 2, "eval_prompts": 2, "eval_new_tokens": 4})
    line = vllm_command(run_dir)
    assert line in capsys.readouterr().err
    drafter_dir = run_dir / "train" / "drafter"
    argv = shlex.split(line)
    assert argv[:3] == ["vllm", "serve", str(untied_target.resolve())]
    assert json.loads(argv[4]) == {"method": "dflash", "model": str(drafter_dir.resolve()),
                                   "num_speculative_tokens": 7}  # block_size 8
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["max_position_embeddings"] == AutoConfig.from_pretrained(
        untied_target).max_position_embeddings
    assert config["dflash_config"]["target_layer_ids"] == [2]
    assert config["eagle_aux_hidden_state_layer_ids"] == [3]
    assert (drafter_dir / "dflash.py").is_file()
    assert (run_dir / "train" / "checkpoints" / "step-000002" / "dflash.py").is_file()
    remote = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True,
                                       dtype=torch.float32).eval()
    ours = DFlashDrafter.load(drafter_dir).eval()
    g = torch.Generator().manual_seed(0)
    hidden, embeds = torch.randn(1, 5, 64, generator=g), torch.randn(1, 1, 8, 64, generator=g)
    with torch.no_grad():
        expected = ours(hidden, torch.ones(1, 5, dtype=torch.bool), embeds, torch.tensor([[5]]))
        got = remote(position_ids=torch.arange(13)[None], noise_embedding=embeds[:, 0],
                     target_hidden=hidden)
    assert float((got - expected[:, 0]).abs().max()) < 1e-6


def test_errors_name_the_cause(extracted, untied_target, tmp_path, copy_run):
    run_dir = copy_run(extracted, tmp_path, "*train*", "docs")
    shutil.rmtree(run_dir / "extract")
    with pytest.raises(StageError, match="run `dflash-etl extract` first, or train with --online"):
        train.run(None, run_dir, progress=False, target=str(untied_target), **SMALL)
    with pytest.raises(StageError, match="needs the target model"):
        train.run(None, run_dir, progress=False, **SMALL)
    with pytest.raises(StageError, match="eval_tree_budget needs held-out prompts"):
        train.run(None, run_dir, progress=False, target=str(untied_target), online=True,
                  **{**SMALL, "eval_prompts": 0, "eval_tree_budget": 4})
    with pytest.raises(StageError, match="a block needs the anchor"):
        train.run(None, run_dir, progress=False, target=str(untied_target), block_size=1)


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo on Linux")
@pytest.mark.parametrize("mode", ["offline", "launcher", "dflash2",
                                  pytest.param("online", marks=pytest.mark.slow)])
def test_torchrun_two_processes_train_one_drafter(extracted, untied_target, tmp_path, mode,
                                                  copy_run):
    """`torchrun --nproc-per-node 2 -m -- dflash_etl train`: DDP over gloo on CPU; each rank
    takes half of every batch, rank 0 writes, and the drafter equals one process's on the whole
    batches (the loss is normalised by the whole batch's weight total on every rank). Online,
    each rank holds a target replica and computes its half's states per batch: the drafter
    still equals one process's trained offline on the extracted states of the same batches.
    A DFlash2 drafter (its selector's loss computed beside DDP's forward) too."""
    run_dir = copy_run(extracted, tmp_path, "*train*", "docs")
    online = ["--online", "--layers", "2"] if mode == "online" else []
    arch = {"arch": "dflash2", "selector_rank": 16} if mode == "dflash2" else {}
    if online:
        shutil.rmtree(run_dir / "extract")  # nothing but the target gives the states
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # `launcher`: `dflash-etl train --launcher torchrun` starts the same launch itself
    launch = ([sys.executable, "-m", "dflash_etl", "train", "--launcher", "torchrun",
               "--nproc-per-node", "2"] if mode == "launcher" else
              [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(29500 + os.getpid() % 1000), "-m", "--",
               "dflash_etl", "train"])
    result = subprocess.run(
        [*launch, "--run", str(run_dir), "--target", str(untied_target), "--draft-layers", "1",
         "--block-size", "8", "--steps", "4", "--batch-rows", "4", "--anchors-per-row", "8",
         "--eval-prompts", "2", "--eval-new-tokens", "4", *online,
         *(f"--{k.replace('_', '-')}={v}" for k, v in arch.items())],
        capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    if mode == "launcher":
        assert "torch.distributed.run --standalone --nproc-per-node 2 -m --" in result.stderr
    assert result.stdout.count("train done") == 1  # rank 0 wrote and reports
    stats = json.loads((run_dir / "train" / "stats.json").read_text())["total"]
    assert stats["steps"] == 4
    assert (stats["online"], stats["target_layers"]) == (mode == "online", [2])
    # the same steps in one process on the whole batches: the same drafter
    from safetensors.torch import load_file

    single = copy_run(extracted, tmp_path / "single", "*train*", "docs")
    train.run(None, single, progress=False, target=str(untied_target), draft_layers=1, block_size=8,
              steps=4, batch_rows=4, anchors_per_row=8, eval_prompts=2, eval_new_tokens=4,
              **arch)
    a = load_file(str(run_dir / "train" / "drafter" / "model.safetensors"))
    b = load_file(str(single / "train" / "drafter" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert ("candidate_selector.successor_codebook" in a) == (mode == "dflash2")
    log = [json.loads(x) for x in (run_dir / "train" / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3, 4]
    alone = [json.loads(x) for x in (single / "train" / "log.jsonl").read_text().splitlines()]
    assert np.allclose([x["loss"] for x in log], [x["loss"] for x in alone], atol=1e-4)


def test_online_and_offline_take_their_target_layers_by_one_rule(extracted, untied_target,
                                                                 tmp_path, copy_run):
    """Before: offline trained on the layers extract chose ([extract] draft_layers = 1: [2]),
    online on layers its own draft_layers chose (2: [1]), so one config gave two drafters
    reading different target layers. Now online resolves [extract] as extract does, offline
    refuses train layers the extract output does not hold, and the stats say where they came
    from."""
    config_path = tmp_path / "pipeline.toml"
    (tmp_path / "chat.jsonl").write_text("")
    config_path.write_text('[[sources]]\nname = "chat"\npath = "chat.jsonl"\n\n'
                           "[extract]\ndraft_layers = 1\n")
    config = load_config(config_path)
    settings = {**SMALL, "draft_layers": 2, "steps": 1, "eval_prompts": 2, "eval_new_tokens": 4}
    offline = copy_run(extracted, tmp_path / "offline", "*train*", "docs")
    with pytest.raises(StageError, match=r"train --layers 1 \(\[1\]\) but the extract output "
                                         r"holds layers \[2\]"):
        train.run(config, offline, progress=False, target=str(untied_target), layers="1",
                  **settings)
    doc = train.run(config, offline, progress=False, target=str(untied_target), **settings)
    assert doc["total"]["target_layers"] == [2]
    assert doc["total"]["target_layers_from"] == "the extract output (extract/stats.json)"
    online = copy_run(extracted, tmp_path / "online", "*train*", "docs")
    shutil.rmtree(online / "extract")
    doc = train.run(config, online, progress=False, target=str(untied_target), online=True,
                    **settings)
    assert doc["total"]["target_layers"] == [2]
    assert "[extract] layers = 'auto', draft_layers = 1" in doc["total"]["target_layers_from"]
    manifest = json.loads((online / "manifest.json").read_text())["stages"]["train"]
    assert manifest["layers"] == [2] and manifest["layers_from"].startswith("[extract]")


def test_drafter_layers_compute_what_speculators_dflash_layers_compute():
    """Our drafter, two blocks in one pass, against speculators' own Qwen3DFlashDecoderLayer
    (the published DFlash attention: context keys/values first, q/k norms, RoPE at absolute
    positions) run block by block with the same weights. Skipped without speculators."""
    definitions = pytest.importorskip("speculators.models.dflash.model_definitions")
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from dflash_etl.models.drafter import DFlashDrafter, DrafterConfig

    config = DrafterConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, intermediate_size=64,
                           vocab_size=50, target_layer_ids=[0, 1], mask_token_id=49,
                           block_size=4, rope_theta=10000.0)
    torch.manual_seed(0)
    ours = DFlashDrafter(config).eval()
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.3)
    qwen3 = Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, intermediate_size=64, rms_norm_eps=config.rms_norm_eps,
                        rope_theta=10000.0, vocab_size=50, attention_bias=False)
    qwen3._attn_implementation = "eager"
    reference = []
    for n in range(2):
        layer = definitions.Qwen3DFlashDecoderLayer(qwen3, n).eval()
        prefix = f"layers.{n}."
        layer.load_state_dict({k[len(prefix):]: v for k, v in ours.state_dict().items()
                               if k.startswith(prefix)}, strict=True)
        reference.append(layer)
    rope = Qwen3RotaryEmbedding(qwen3)
    t, s, anchors = 12, 4, [3, 8]
    context, blocks = torch.randn(1, t, 64), torch.randn(1, 2, s, 32)
    with torch.no_grad():
        got = ours(context, torch.ones(1, t, dtype=torch.bool), blocks, torch.tensor([anchors]))
        target_hidden = ours.hidden_norm(ours.fc(context))
        for n, anchor in enumerate(anchors):
            positions = torch.cat([torch.arange(t), anchor + torch.arange(s)])[None]
            cos_sin = rope(blocks[:, n], positions)
            allowed = torch.cat([torch.arange(t) < anchor, torch.ones(s, dtype=torch.bool)])
            mask = torch.zeros(1, 1, s, t + s).masked_fill(~allowed, float("-inf"))
            x = blocks[:, n]
            for layer in reference:
                x = layer(target_hidden=target_hidden, hidden_states=x, attention_mask=mask,
                          position_embeddings=cos_sin)
            assert torch.allclose(got[:, n], ours.norm(x), atol=1e-5), n


def test_chunked_loss_equals_the_whole_batch_loss_and_gradients():
    """block_loss sends only supervised positions through the LM head, a chunk at a time under
    checkpointing; loss and gradients equal the plain formula over every block's logits."""
    from dflash_etl.models.drafter import DFlashDrafter, DrafterConfig, block_loss_weights

    config = DrafterConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=8, intermediate_size=32,
                           vocab_size=40, target_layer_ids=[0], mask_token_id=39, block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    embed, lm_head = torch.nn.Embedding(40, 16), torch.nn.Linear(16, 40, bias=False)
    rows = [{"input_ids": [int(t) for t in torch.randint(0, 39, (n,))],
             "loss_mask": [0] * 3 + [1] * (n - 3)} for n in (14, 9)]
    anchors = training_loss.sample_anchors(rows, 6, np.random.default_rng(1))
    states = [torch.randn(14, 1, 16), torch.randn(9, 1, 16)]
    batch = training_loss.make_batch(rows, states, anchors, 4, 39)
    weights = block_loss_weights(4, 7.0)

    loss, metrics = training_loss.block_loss(drafter, embed, lm_head, batch, weights, chunk=5)
    loss.backward()
    chunked = [p.grad.clone() for p in drafter.parameters()]
    drafter.zero_grad()
    hidden = drafter(batch["hidden"], batch["valid"], embed(batch["block_ids"]).detach(),
                     batch["anchors"])
    logits = lm_head(hidden[:, :, 1:])
    ok = batch["label_ok"][:, :, 1:]
    w = weights[1:] * ok
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 2),
                                           batch["labels"][:, :, 1:].flatten(),
                                           reduction="none").view_as(w)
    plain = (ce * w).sum() / (w.sum() + 1e-6)
    plain.backward()
    # the normaliser DDP ranks use, from the rows alone, is the same weight total
    assert training_loss.loss_weight_total(rows, anchors, weights.numpy()) == pytest.approx(
        float(w.sum()), rel=1e-6)
    assert metrics["supervised"] == int(ok.sum()) > 5  # more than one chunk
    assert torch.allclose(loss, plain, atol=1e-6)
    assert all(torch.allclose(g, p.grad, atol=1e-6)
               for g, p in zip(chunked, drafter.parameters(), strict=True))


def test_tau_evaluation_on_a_hybrid_target_without_a_croppable_cache(tmp_path):
    """A hybrid linear-attention target (Qwen3-Next): its cache cannot drop rejected drafts, so
    the evaluation re-reads the sequence; the output is still the target's greedy decoding."""
    import transformers

    from dflash_etl.models.acceptance import _croppable_cache, drafter_proposer, speculative_decode
    from dflash_etl.models.drafter import DFlashDrafter, DrafterConfig
    from dflash_etl.models.target import Target, TargetSpec

    config = transformers.Qwen3NextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        full_attention_interval=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    tgt = Target(TargetSpec(model=str(tmp_path / "model"), layers="1", device="cpu"))
    assert _croppable_cache(tgt) is None
    drafter = DFlashDrafter(DrafterConfig.from_target(
        tgt.model.config, draft_layers=1, target_layer_ids=[1], mask_token_id=299,
        block_size=4)).eval()
    prompt = [int(t) for t in torch.randint(3, 299, (12,))]
    got = speculative_decode(tgt, drafter_proposer(tgt, drafter), prompt, 10, set())
    greedy = tgt.model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert got.tokens == greedy


def test_the_tiny_target_follows_its_config(tmp_path):
    """[target] tiny is rebuilt when its spec changes (so the stages' fingerprints change with
    it), reused when it does not, and an unknown key is an error that lists the known ones."""
    from dflash_etl.models.tiny_model import configured_target

    def config_with(spec: str):
        path = tmp_path / "pipeline.toml"
        path.write_text(f'[[sources]]\npath = "{REPO / "data" / "sources" / "prompts.jsonl"}"\n'
                        f"\n[target]\ntiny = {{ {spec} }}\n")
        return load_config(path)

    def hidden(directory: str) -> int:
        return json.loads((Path(directory) / "config.json").read_text())["hidden_size"]

    first = configured_target(config_with("hidden_size = 32, layers = 2"), tmp_path / "run")
    stamp = (Path(first) / "model.safetensors").stat().st_mtime_ns
    again = configured_target(config_with("hidden_size = 32, layers = 2"), tmp_path / "run")
    assert hidden(again) == 32 and (Path(again) / "model.safetensors").stat().st_mtime_ns == stamp
    changed = configured_target(config_with("hidden_size = 16, layers = 2"), tmp_path / "run")
    assert hidden(changed) == 16
    with pytest.raises(StageError, match=r"unknown keys \['hiden_size'\]; known: .*hidden_size"):
        configured_target(config_with("hiden_size = 16"), tmp_path / "run")


def test_the_manifests_seconds_count_every_call_of_a_resumed_training(extracted, untied_target,
                                                                        tmp_path, monkeypatch,
                                                                        copy_run):
    """A call that spends >= 1.8 s on its 3 steps before a kill, then a resumed call: the
    manifest's train seconds are both calls' (it counted the last call only), and say which
    part was this call's; the checkpoints' state.json stays free of timings (it is data)."""
    import time

    run_dir = copy_run(extracted, tmp_path, "*train*", "docs")
    real = train.Trainer.step

    def slow_then_killed(self, step):
        if step == 3:
            raise KeyboardInterrupt
        time.sleep(0.6)
        return real(self, step)

    monkeypatch.setattr(train.Trainer, "step", slow_then_killed)
    with pytest.raises(KeyboardInterrupt):
        train.run(None, run_dir, progress=False, target=str(untied_target), **INTERRUPTED)
    monkeypatch.setattr(train.Trainer, "step", real)
    start = time.perf_counter()
    train.run(None, run_dir, progress=False, target=str(untied_target), **INTERRUPTED)
    wall = time.perf_counter() - start
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"]["train"]
    assert stage["seconds"] > wall and stage["seconds"] >= 1.8, (stage, wall)
    assert stage["seconds_this_run"] <= wall < stage["seconds"]
    assert stage["steps_this_run"] == 3
    for ckpt in (run_dir / "train" / "checkpoints").iterdir():
        assert "seconds" not in json.loads((ckpt / "state.json").read_text())


def test_training_over_the_draft_vocabulary_converges_and_counts_what_it_leaves_out(
        extracted, untied_target, tmp_path, copy_run):
    """--head-vocab draft: the loss over tokenize's t2d rows of the head (here cut to the most
    frequent supervised tokens, ~90% of them, so that labels fall outside); the drafter learns
    (loss down, tau up with the full head, as served) and stats.json counts the labels left
    out, at about the data's own share of supervised tokens outside the draft vocabulary."""
    run_dir = copy_run(extracted, tmp_path, "*train*", "docs")
    rows = tokenize_rows(run_dir)
    supervised = np.concatenate([np.asarray(r["input_ids"])[np.asarray(r["loss_mask"]) == 1]
                                 for r in rows])
    counts = np.bincount(supervised)
    ranked = np.argsort(-counts, kind="stable")
    # the most frequent tokens up to ~90% of the supervised ones (a random target's greedy
    # replies use few distinct tokens)
    keep = int(np.searchsorted(np.cumsum(counts[ranked]) / counts.sum(), 0.9)) + 1
    draft = ranked[:keep]
    vocab_doc = json.loads((run_dir / "tokenize" / "draft_vocab.json").read_text())
    t2d = np.zeros(len(np.load(run_dir / "tokenize" / vocab_doc["t2d"])), dtype=bool)
    t2d[draft] = True
    np.save(run_dir / "tokenize" / vocab_doc["t2d"], t2d)
    doc = train.run(None, run_dir, progress=False, target=str(untied_target), head_vocab="draft",
                    **{**SMALL, "block_size": 16, "steps": 120, "batch_rows": 8,
                       "anchors_per_row": 32, "eval_prompts": 8, "eval_new_tokens": 32})
    total = doc["total"]
    log = [json.loads(line) for line in (run_dir / "train" / "log.jsonl").read_text().splitlines()]
    first, last = (np.mean([r["loss"] for r in part]) for part in (log[:20], log[-20:]))
    assert last < 0.85 * first, (first, last, keep)
    assert total["tau_final"] > total["tau_untrained"] + 0.5, (total, keep)
    counted = total["draft_vocab"]
    assert counted["size"] == keep < len(np.flatnonzero(counts))
    assert counted["labels_outside"] == sum(r["outside_draft_vocab"] for r in log) > 0
    share = 1 - counts[draft].sum() / counts.sum()
    assert abs(counted["share_outside"] - share) < 0.1


def test_corrupt_inputs_are_named_before_they_crash_a_run(extracted, untied_target, tmp_path,
                                                          copy_run):
    """A tokenized row whose loss_mask is shorter than its input_ids, and a shard of another
    hidden size: each is an error naming the row (and the file), not an internal error when
    the row is first sampled."""
    import pyarrow as pa
    from safetensors.torch import load_file, save_file

    run_dir = copy_run(extracted, tmp_path / "mask", "*train*", "docs")
    path = next((run_dir / "tokenize" / "dataset").glob("*.arrow"))
    table = pa.ipc.open_stream(pa.BufferReader(path.read_bytes())).read_all()
    rows = table.to_pylist()
    rows[3]["loss_mask"] = rows[3]["loss_mask"][:-1]
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(pa.Table.from_pylist(rows, schema=table.schema))
    with pytest.raises(StageError, match=rf"tokenized row '{rows[3]['id']}' \(row 3 .*loss_mask "
                       rf"has {len(rows[3]['input_ids']) - 1} entries for "
                       rf"{len(rows[3]['input_ids'])} input_ids"):
        train.run(None, run_dir, progress=False, target=str(untied_target), **SMALL)

    run_dir = copy_run(extracted, tmp_path / "shard", "*train*", "docs")
    shard = sorted((run_dir / "extract" / "hidden_states").glob("*.safetensors"))[0]
    data = load_file(str(shard))
    data["hidden_states"] = data["hidden_states"][..., :32].contiguous()
    save_file(data, str(shard))
    with pytest.raises(StageError, match=rf"{shard.name}: the hidden states of row \d+ .* are "
                       r"\[\d+, \d+, 32\], expected \[\d+, >= 1, 64\]"):
        train.run(None, run_dir, progress=False, target=str(untied_target), **SMALL)


def test_target_labels_are_the_targets_greedy_tokens_from_a_real_forward(extracted,
                                                                         untied_target):
    """labels = "target": at every supervised position a block predicts, the label is the
    argmax of the target's logits there (a real forward of the tiny target, its final norm and
    LM head), read off the extract output's last layer and off the online target alike; the
    anchor and the other positions keep the row's tokens; with a draft vocabulary, the argmax
    over its rows. Passing the rows' own tokens as labels reproduces the data labels exactly."""
    from dflash_etl.core.outputs import HiddenStatesOutput, TokenizedOutput
    from dflash_etl.core.rundir import RunDir
    from dflash_etl.models.target import Target, TargetSpec
    from dflash_etl.models.training.labels import final_norm, predicted_positions, target_labels
    from dflash_etl.models.training.states import ExtractedStates, OnlineStates

    rows = train._load_rows(TokenizedOutput.read(extracted / "tokenize"), RunDir(extracted))[:6]
    output = HiddenStatesOutput.read(extracted / "extract")
    assert output.stored_layers == [2, 3]
    target = Target(TargetSpec(model=str(untied_target), layers="2"))
    norm, head = final_norm(target.model), target.model.get_output_embeddings()
    picks = training_loss.sample_anchors(rows, 8, np.random.default_rng(0))
    logits = target.forward([r["input_ids"] for r in rows], logits=True)[0]
    stored = ExtractedStates(extracted / "extract", 1, train._read_index(output.index_file),
                             last=True)(rows)
    online = OnlineStates(target, last=True)(rows)
    changed = 0
    for states in (stored, online):
        assert all(s.shape[1] == 2 for s in states)  # the chosen layer, then the last
        labels = target_labels(rows, [s[:, -1] for s in states], picks, 8, norm, head)
        for row, got, p, row_logits in zip(rows, labels, picks, logits, strict=True):
            ids = np.asarray(row["input_ids"])
            at = predicted_positions(row["loss_mask"], p, 8)
            assert len(at) and (at >= 1).all()
            assert (got[at] == row_logits[at - 1].argmax(-1).numpy()).all()
            rest = np.setdiff1d(np.arange(len(ids)), at)
            assert (got[rest] == ids[rest]).all()
            changed += int((got[at] != ids[at]).sum())
    assert changed > 0  # the target's tokens are not simply the data's here
    states = [s[:, :-1] for s in stored]
    batch = training_loss.make_batch(rows, states, picks, 8, 1226, labels)
    data = training_loss.make_batch(rows, states, picks, 8, 1226)
    assert torch.equal(batch["block_ids"], data["block_ids"])  # anchors: the rows' tokens
    assert torch.equal(batch["label_ok"], data["label_ok"])
    assert batch["labels_changed"] == int(((batch["labels"] != data["labels"])
                                           & data["label_ok"]).sum()) > 0
    same = training_loss.make_batch(rows, states, picks, 8, 1226,
                                    [np.asarray(r["input_ids"]) for r in rows])
    assert all(torch.equal(same[k], data[k]) for k in data)
    # over a draft vocabulary: the argmax among its rows, as target token ids
    inside = np.zeros(head.weight.shape[0], dtype=bool)
    inside[::3] = True
    vocab = training_loss.DraftVocab(inside, head.weight.shape[0])
    drafted = target_labels(rows, [s[:, -1] for s in online], picks, 8, norm, head, vocab)
    for row, got, p, row_logits in zip(rows, drafted, picks, logits, strict=True):
        at = predicted_positions(row["loss_mask"], p, 8)
        masked = row_logits[at - 1].clone()
        masked[:, ~torch.as_tensor(inside)] = -torch.inf
        assert (got[at] == masked.argmax(-1).numpy()).all() and inside[got[at]].all()


def test_training_on_the_targets_labels_offline_online_and_served(extracted, untied_target,
                                                                  tmp_path, copy_run):
    """--labels target trains the same drafter from the extract output, online and from a
    states server (each gives the last layer), counts the labels the target changed, and is
    refused, with the rerun, on an extract that did not store the last layer; --labels data
    (the default) leaves the fingerprint and the drafter as they were."""
    from safetensors.torch import load_file

    from dflash_etl.models.devserver import DevServer
    from dflash_etl.models.states_server import vllm_layer_ids

    settings = {**SMALL, "steps": 3, "eval_prompts": 2, "eval_new_tokens": 4, "labels": "target"}
    offline = copy_run(extracted, tmp_path / "offline", "*train*", "docs")
    doc = train.run(None, offline, progress=False, target=str(untied_target), **settings)
    counted = doc["total"]["labels_from_target"]
    assert doc["total"]["labels"] == "target"
    assert 0 < counted["changed"] < counted["supervised"]
    log = [json.loads(line) for line in (offline / "train" / "log.jsonl").read_text().splitlines()]
    assert counted["changed"] == sum(r["labels_changed"] for r in log)
    online = copy_run(extracted, tmp_path / "online", "*train*", "docs")
    shutil.rmtree(online / "extract")
    train.run(None, online, progress=False, target=str(untied_target), online=True,
              layers="2", **settings)
    served = copy_run(extracted, tmp_path / "served", "*train*", "docs")
    shutil.rmtree(served / "extract")
    states = tmp_path / "server-states"
    with DevServer(str(untied_target), extract_layers=vllm_layer_ids([2], 4),
                   states_dir=str(states)) as server:
        train.run(None, served, progress=False, target=str(untied_target), online=True,
                  layers="2", states_from="server", states_endpoint=server.url,
                  states_dir=str(states), **settings)
    a = load_file(str(offline / "train" / "drafter" / "model.safetensors"))
    for other in (online, served):
        b = load_file(str(other / "train" / "drafter" / "model.safetensors"))
        assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a), other.parent.name
    data = copy_run(extracted, tmp_path / "data", "*train*", "docs")
    train.run(None, data, progress=False, target=str(untied_target),
              **{**settings, "labels": "data"})
    b = load_file(str(data / "train" / "drafter" / "model.safetensors"))
    assert not all(torch.equal(a[k], b[k]) for k in a)  # other labels, another drafter
    payload = train._fingerprint_payload(train.TrainSettings(target=str(untied_target)), [], None)
    assert "labels" not in payload["settings"]  # runs made before the setting are not redone
    old = copy_run(extracted, tmp_path / "old", "*train*", "docs")
    stats = json.loads((old / "extract" / "stats.json").read_text())
    stats["total"]["stored_layers"] = [2]
    (old / "extract" / "stats.json").write_text(json.dumps(stats))
    with pytest.raises(StageError, match=r"labels = \"target\" needs the target's last layer "
                       r"\(3\) .* rerun `dflash-etl extract --force`"):
        train.run(None, old, progress=False, target=str(untied_target), **settings)


def test_a_chosen_last_layer_is_read_after_the_final_norm_as_zlabs_decode_reads_it(
        extracted, untied_target, tmp_path, copy_run, monkeypatch):
    """--layers naming the target's last layer: extract stores its state after the final norm
    (Hugging Face's hidden_states[-1], what z-lab's dflash_generate feeds the drafter), the
    verifier's column after it before the norm (speculators' loader norms it itself), and
    z-lab's decode of the trained drafter counts exactly our tau (3.516 against 3.559 when the
    chosen last layer was stored before the norm)."""
    zlab = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")
    import pyarrow.parquet as pq
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from dflash_etl.models.serving import last_layer_caveat

    run_dir = copy_run(extracted, tmp_path, "*train*", "docs")
    extract.run(None, run_dir, progress=False, model=str(untied_target), layers="1,3",
                draft_layers=2)
    target = AutoModelForCausalLM.from_pretrained(untied_target, dtype=torch.float32).eval()
    entry = pq.read_table(run_dir / "extract" / "index.parquet").to_pylist()[0]
    stored = load_file(str(run_dir / "extract" / "hidden_states" / entry["shard"]))
    states = stored["hidden_states"][entry["offset"]:entry["offset"] + entry["length"]]
    ids = stored["token_ids"][entry["offset"]:entry["offset"] + entry["length"]]
    with torch.no_grad():
        hf = target(ids[None], output_hidden_states=True).hidden_states
        before_norm = {}
        hook = target.model.layers[3].register_forward_hook(
            lambda _m, _i, out: before_norm.setdefault("state", out[0] if isinstance(
                out, tuple) else out))
        target(ids[None])
        hook.remove()
    assert states.shape[1] == 3  # layers 1 and 3, then the verifier's state
    assert torch.allclose(states[:, 0], hf[2][0], atol=1e-5)
    assert torch.allclose(states[:, 1], hf[-1][0], atol=1e-5)  # after the final norm
    assert torch.allclose(states[:, 2], before_norm["state"][0], atol=1e-5)
    assert not torch.allclose(states[:, 1], states[:, 2], atol=1e-3)

    train.run(None, run_dir, progress=False, target=str(untied_target),
              **{**SMALL, "steps": 60, "eval_prompts": 6, "eval_new_tokens": 24})
    evaluation = json.loads((run_dir / "train" / "eval.json").read_text())
    config = json.loads((run_dir / "train" / "drafter" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [1, 3]
    assert config["target_last_layer_state"] == "after_final_norm"
    assert "vLLM captures that layer before the norm" in last_layer_caveat(run_dir)
    tau = zlab_tau(zlab, run_dir, target, prompts=6, new_tokens=24, monkeypatch=monkeypatch)
    assert abs(tau - evaluation["tau_final"]) < 1e-9


def test_a_reextract_with_the_same_states_in_another_format_keeps_train_valid(
        extracted, untied_target, tmp_path, copy_run):
    """Staleness follows content: extract's output is named by its rows' states, so rewriting
    the same states in speculators' layout leaves train complete and current (it was stale,
    and `train` retrained); other states (other layers) make it stale."""
    from dflash_etl.core.rundir import RunDir

    run_dir = copy_run(extracted, tmp_path, "*train*", "docs")
    kw = {**SMALL, "steps": 4, "eval_prompts": 2, "eval_new_tokens": 4}
    train.run(None, run_dir, progress=False, target=str(untied_target), **kw)
    run = RunDir(run_dir)
    native = run.record("extract").content
    assert native and native.startswith("content:")
    extract.run(None, run_dir, progress=False, model=str(untied_target), draft_layers=1,
                format="speculators")
    assert (run_dir / "extract" / "hidden_states" / "hs_0.safetensors").exists()
    assert run.record("extract").content == native
    assert run.stale() == {}
    assert train.run(None, run_dir, progress=False, target=str(untied_target), **kw)["skipped"]
    extract.run(None, run_dir, progress=False, model=str(untied_target), layers="1",
                draft_layers=1, format="speculators")
    assert run.record("extract").content != native
    assert "train" in run.stale()


def test_extract_reads_whether_the_replies_are_the_targets(extracted, untied_target,
                                                          tiny_target, default_tokenized,
                                                          tmp_path, copy_run, capsys):
    """Before its work extract says when the replies a drafter would learn are not the
    target's: regenerate wrote them with another model (its model_identity), or they are the
    sources' own; it reads the data then: the target's own greedy agreement on a sample
    (84% on its own greedy replies here: the tiny random target's near-tied logits, and each
    reply cut at max_new_tokens ends on a template's end of turn; 0% on the sources' own). The
    failure-mode benchmark's b and i, which trained silently before."""
    from dflash_etl.models.reply_check import agreement, sample
    from dflash_etl.models.target import Target, TargetSpec

    own = json.loads((extracted / "extract" / "stats.json").read_text())
    assert own["replies"] == {"origin": "target", "warning": ""} and not own.get("warnings")
    rows = tokenize_rows(extracted)
    picked = [rows[k] for k in sample([len(r["input_ids"]) for r in rows])]
    mine = agreement(Target(TargetSpec(model=str(untied_target))), picked)["agreement"]
    assert mine > 0.75

    other = copy_run(extracted, tmp_path / "other", "*train*", "docs")
    doc = extract.run(None, other, progress=False, model=str(tiny_target), draft_layers=1)
    # the tied tiny target shares the untied one's initial weights: it agrees more than a
    # stranger would, and is still another model, warned whatever it measures
    assert doc["replies"]["origin"] == "other_model" and doc["replies"]["agreement"] < mine
    assert "written by another model than this target" in doc["warnings"][0]
    sources = copy_run(default_tokenized, tmp_path / "sources", "*extract*")
    doc = extract.run(None, sources, progress=False, model=str(untied_target), draft_layers=1)
    replies = doc["replies"]
    assert replies["origin"] == "sources" and replies["rows"] == 16
    assert replies["agreement"] < 0.5 and "the sources' own" in replies["warning"]
    assert "WARNING: the replies are the sources' own" in capsys.readouterr().err
    off = copy_run(default_tokenized, tmp_path / "off", "*extract*")
    assert "replies" not in extract.run(None, off, progress=False, model=str(untied_target),
                                        draft_layers=1, reply_check="off")
    # train --online reads no extract output: it checks the replies itself, on its target
    online = copy_run(default_tokenized, tmp_path / "online", "*extract*")
    doc = train.run(None, online, progress=False, target=str(untied_target), online=True,
                    **{**SMALL, "steps": 2, "eval_prompts": 1, "eval_new_tokens": 2})
    assert doc["replies"]["origin"] == "sources" and doc["replies"]["agreement"] < 0.5
    assert doc["warnings"] == [doc["replies"]["warning"]]
