"""Qwen3.5 / Qwen3.6 (transformers `qwen3_5`: Gated DeltaNet linear attention mixed with full
attention) end to end on tiny random-weight models with the real Qwen3.6 tokenizer: the
text-only `Qwen3_5ForCausalLM` and the published vision-language layout
`Qwen3_5ForConditionalGeneration`, whose config is composite (the decoder's fields sit in
`text_config`) and whose decoder is `model.language_model` beside a vision tower."""

from __future__ import annotations

import functools
import json
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from dflash_etl.stages import extract, ingest, load_config, tokenize
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


@pytest.fixture
def tokenized_copy(tokenized, copy_run) -> Callable[[Path], Path]:
    """`tokenized` copied into a folder, with no stage after tokenize in it or its manifest."""
    def copy(into: Path) -> Path:
        out = copy_run(tokenized, into, "*extract*", "*train*")
        manifest = json.loads((out / "manifest.json").read_text())
        manifest["stages"] = {k: v for k, v in manifest["stages"].items()
                              if k in ("ingest", "tokenize")}
        (out / "manifest.json").write_text(json.dumps(manifest))
        return out

    return copy


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
def test_extract_on_qwen3_5_equals_an_independent_forward_pass(models, tokenized_copy, tmp_path,
                                                               kind):
    import datasets
    import pyarrow.parquet as pq
    import torch
    from safetensors import safe_open

    run_dir = tokenized_copy(tmp_path)
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


def test_check_fails_a_run_whose_stage_failed(models, tokenized_copy, tmp_path):
    """A stage that failed leaves the manifest saying so; `check` on the run directory must not
    print "all checks passed" over the published stages before it."""
    run_dir = tokenized_copy(tmp_path)
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


# ---------------------------------------------------------------- thinking on: one think block
def test_the_splitter_reads_qwen36_replies_that_start_inside_the_think_block():
    from dflash_etl.models.generation.replies import (
        Reply,
        check_reply,
        reply_parts,
        split_reasoning,
    )
    from dflash_etl.stages.regenerate import RegenerateSettings

    qwen36 = "Add two and two.\n</think>\n\n4."  # after a generation prompt ending "<think>\n"
    assert split_reasoning(qwen36, think_open=True) == ("4.", "Add two and two.")
    assert split_reasoning(qwen36) == ("4.", "Add two and two.")  # a server's raw text
    assert split_reasoning("Still thinking and cut", think_open=True) == (
        "", "Still thinking and cut")
    assert split_reasoning("<think>\nR\n</think>\n\nA", think_open=True) == ("A", "R")
    assert split_reasoning("<think>\nR\n</think>\n\nA") == ("A", "R")
    assert split_reasoning("plain answer", think_open=False) == ("plain answer", None)
    # the server's reasoning_content wins; its content is the answer as it is
    assert reply_parts(Reply("4.", "stop", 3, reasoning="Add.", think_open=None)) == ("4.", "Add.")
    assert reply_parts(Reply(qwen36, "stop", 9, think_open=True)) == ("4.", "Add two and two.")
    # thinking off: no prompt opened a block, so a stray closing tag is a leak, not reasoning
    assert reply_parts(Reply("sure </think> answer", "stop", 3), "off") == (
        "sure </think> answer", None)
    settings = RegenerateSettings(model="m", thinking="on")
    assert check_reply(Reply(qwen36, "stop", 9, think_open=True), settings) is None
    unclosed = check_reply(Reply("Thinking on and on.", "stop", 9, think_open=True), settings)
    assert unclosed and unclosed[1] == "reply_inside_think_block" and "no answer" in unclosed[2]
    assert "--max-new-tokens" in unclosed[2] and "--thinking off" in unclosed[2]


def _turn_texts(text: str) -> list[str]:
    """Each assistant turn of a rendered Qwen3.6 row, from its header to its end of turn."""
    return [part.split("<|im_end|>")[0] for part in text.split("<|im_start|>assistant")[1:]]


def _conv(*turns: tuple[str, str, str | None]) -> dict:
    return {"id": "t", "tools": None, "messages": [
        {"role": role, "content": content, "reasoning": reasoning, "tool_calls": None,
         "tool_call_id": None, "name": None} for role, content, reasoning in turns]}


def test_tokenize_never_renders_two_think_blocks_in_one_turn(qwen36_tokenizer):
    """Reasoning left in the content (`R\\n</think>\\n\\nA`, the splitter's old failure) was
    rendered after the thinking-off prompt's empty block: `<think>\\n\\n</think>\\n\\n<think>
    \\nR\\n</think>\\n\\nA`. Such a turn is refused (duplicated_think_markup) or rendered with one
    block; content with two blocks of its own is refused."""
    from dflash_etl.models.tokenizer import load_tokenizer
    from dflash_etl.templates import probe_template
    from dflash_etl.templates.masks import MaskRefused, tokenize_conversation
    from dflash_etl.templates.masks.policy import R_DUPLICATED_THINK

    tok = load_tokenizer(str(qwen36_tokenizer))
    probe = probe_template(tok)
    leaked = _conv(("user", "Hi", None), ("assistant", "Let me think.\n</think>\n\nHello!", None))
    for row in tokenize_conversation(leaked, tok, probe):
        for turn in _turn_texts(tok.decode(row.input_ids)):
            assert turn.count("<think>") <= 1 and turn.count("</think>") <= 1, turn
    twice = _conv(("user", "Hi", None),
                  ("assistant", "<think>\na\n</think>\n\n<think>\nb\n</think>\n\nHello!", None))
    with pytest.raises(MaskRefused) as refused:
        tokenize_conversation(twice, tok, probe)
    assert refused.value.code == R_DUPLICATED_THINK


@pytest.fixture()
def prompts_run(tmp_path) -> Path:
    rows = [{"id": f"p{k}", "prompt": p} for k, p in enumerate(
        ["Name three colours.", "What is the capital of France?", "Say something about rivers."])]
    rows.append({"id": "c1", "messages": [
        {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me about trees."},
        {"role": "assistant", "content": "Trees are tall plants."}]})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "pipeline.toml").write_text('[[sources]]\nname = "mixed"\npath = "rows.jsonl"\n')
    run_dir = tmp_path / "run"
    ingest.run(load_config(tmp_path / "pipeline.toml"), run_dir, progress=False, workers=1)
    return run_dir


@pytest.mark.parametrize("backend", ["transformers", "openai"])
def test_thinking_on_regenerate_then_tokenize_supervises_one_think_block(models, prompts_run,
                                                                         monkeypatch, backend):
    """Thinking on with the real Qwen3.6 template: the generation prompt ends in `<think>\\n`,
    so the target's reply is `reasoning\\n</think>\\n\\nanswer`. The generation is scripted
    (a random model writes no think markup); the template, the backends (the openai one over
    real HTTP to the devserver, which returns the raw text), the splitter and tokenize are
    real. The stored turn holds the reasoning apart, and the supervised text has one block."""
    import hashlib

    import datasets
    import polars as pl

    from dflash_etl.models.devserver import DevServer
    from dflash_etl.models.generation.local import TransformersBackend
    from dflash_etl.models.generation.replies import Reply
    from dflash_etl.models.tokenizer import load_tokenizer
    from dflash_etl.stages import regenerate

    prompts_seen: list[str] = []

    def scripted(self, prompts: list[str]) -> list[Reply]:
        prompts_seen.extend(prompts)
        out = []
        for p in prompts:
            tag = hashlib.sha256(p.encode()).hexdigest()[:6]
            out.append(Reply(f"I weigh the question {tag}.\n</think>\n\nMy answer is {tag}.",
                             "stop", 12))
        return out

    monkeypatch.setattr(TransformersBackend, "generate_text", scripted)
    kw = {"progress": False, "thinking": "on", "mode": "all", "dummy_min_repeats": 99}
    if backend == "openai":
        with DevServer(str(models["text"])) as server:
            regenerate.run(None, prompts_run, backend="openai", endpoint=server.url,
                           model=str(models["text"]), **kw)
    else:
        regenerate.run(None, prompts_run, model=str(models["text"]), **kw)
    assert prompts_seen and all(p.endswith("<think>\n") for p in prompts_seen)
    frame = pl.read_parquet(prompts_run / "regenerate" / "conversations" / "*.parquet")
    replies = [m for c in frame.to_dicts() for m in c["messages"] if m["role"] == "assistant"]
    assert len(replies) == 5
    for m in replies:
        assert m["reasoning"].startswith("I weigh the question") and "think>" not in m["content"]
        assert m["content"].startswith("My answer is")

    tokenize.run(None, prompts_run, progress=False, model=str(models["text"]))
    tok = load_tokenizer(str(models["text"]))
    dataset = datasets.load_from_disk(str(prompts_run / "tokenize" / "dataset")).with_format(None)
    assert len(dataset) >= 4
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"], strict=True):
        supervised = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        assert supervised.count("</think>") == supervised.count("My answer is") >= 1, supervised
        for turn in _turn_texts(tok.decode(ids)):
            assert turn.count("<think>") <= 1 and turn.count("</think>") <= 1, turn


def test_offline_training_on_the_vl_target(models, tokenized_copy, tmp_path):
    """train on a VL checkpoint's extract: the drafter is shaped from the text config (the
    composite config has no hidden_size of its own) and tau is measured."""
    from dflash_etl.stages import train

    run_dir = tokenized_copy(tmp_path)
    extract.run(None, run_dir, progress=False, model=str(models["vl"]), layers="1,2")
    doc = train.run(None, run_dir, progress=False, target=str(models["vl"]), steps=2,
                    batch_rows=2, anchors_per_row=4, block_size=4, draft_layers=1,
                    eval_prompts=1, eval_new_tokens=4)
    config = json.loads((run_dir / "train" / "drafter" / "config.json").read_text())
    assert config["hidden_size"] == HIDDEN and config["num_target_layers"] == LAYERS
    assert config["dflash_config"]["target_layer_ids"] == [1, 2]
    assert 1 <= doc["total"]["tau_final"] <= 4
    # Qwen3.6's template rendered the rows' prompts with thinking off (the empty think block):
    # the printed `vllm serve` line starts the server in that mode, not its thinking default
    from dflash_etl.models.serving import vllm_command

    rendered = json.loads((run_dir / "tokenize" / "stats.json").read_text())["total"]
    assert 2 * rendered["generation_prompt_kwargs"]["enable_thinking=False"] > rendered[
        "rows_written"]
    argv = shlex.split(vllm_command(run_dir))
    flag = argv.index("--default-chat-template-kwargs")
    assert json.loads(argv[flag + 1]) == {"enable_thinking": False}


@pytest.mark.parametrize("kind", ["text", "vl"])
def test_online_training_equals_offline_on_qwen3_5(models, tokenized_copy, tmp_path, kind):
    """train --online computes the hybrid target's states per padded batch (Gated DeltaNet
    layers are where padding leaks): the drafter equals the one trained offline on extract's
    states of the same rows, and tau is measured."""
    import torch
    from safetensors.torch import load_file

    from dflash_etl.stages import train

    settings = {"steps": 2, "batch_rows": 2, "anchors_per_row": 4, "block_size": 4,
                "draft_layers": 1, "eval_prompts": 1, "eval_new_tokens": 4, "layers": "1,2"}
    offline = tokenized_copy(tmp_path / "offline")
    extract.run(None, offline, progress=False, model=str(models[kind]), layers="1,2")
    train.run(None, offline, progress=False, target=str(models[kind]), **settings)
    online = tokenized_copy(tmp_path / "online")
    doc = train.run(None, online, progress=False, target=str(models[kind]), online=True,
                    **settings)
    assert doc["total"]["online"] is True and doc["total"]["target_layers"] == [1, 2]
    assert 1 <= doc["total"]["tau_final"] <= 4
    a = load_file(str(offline / "train" / "drafter" / "model.safetensors"))
    b = load_file(str(online / "train" / "drafter" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_the_mask_token_on_qwen36_is_the_first_unused_embedding_row(models, qwen36_tokenizer):
    """Qwen3.6's tokenizer has no <|MASK|> (nor any mask token): the drafter's blocks use the
    first embedding row no token uses, as DFlash's Qwen drafters do, and say so; a tokenizer
    that has <|MASK|> gets it."""
    from dflash_etl.models.mask_token import resolve_mask_token
    from dflash_etl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(qwen36_tokenizer))
    assert "<|MASK|>" not in tok.get_vocab() and tok.mask_token_id is None
    config = json.loads((models["vl"] / "config.json").read_text())["text_config"]
    assert config["vocab_size"] > len(tok)
    token, why = resolve_mask_token(str(models["vl"]), config["vocab_size"], -1)
    assert token == len(tok) and "embedding row" in why
    with_mask = models["vl"].parent / "with-mask"
    shutil.copytree(models["vl"], with_mask, dirs_exist_ok=True)
    token_spec = {"content": "<|MASK|>", "single_word": False, "lstrip": False,
                  "rstrip": False, "normalized": False, "special": True}
    spec = json.loads((with_mask / "tokenizer.json").read_text())
    spec["added_tokens"].append({"id": len(tok), **token_spec})
    (with_mask / "tokenizer.json").write_text(json.dumps(spec))
    spec = json.loads((with_mask / "tokenizer_config.json").read_text())
    spec.setdefault("added_tokens_decoder", {})[str(len(tok))] = token_spec
    (with_mask / "tokenizer_config.json").write_text(json.dumps(spec))
    token, why = resolve_mask_token(str(with_mask), config["vocab_size"], -1)
    assert token == len(tok) and "<|MASK|>" in why


def test_tau_verify_pass_keeps_only_the_last_blocks_logits(models):
    """qwen3_5's cache cannot be cropped, so tau's verify pass re-reads the sequence; the LM head
    (248k columns) then runs over the anchor and the drafts only, never every position, and
    tau and the tokens are what full logits give."""
    import torch

    from dflash_etl.models.acceptance import (
        _croppable_cache,
        drafter_proposer,
        speculative_decode,
    )
    from dflash_etl.models.drafter import DFlashDrafter, DrafterConfig
    from dflash_etl.models.target import Target, TargetSpec

    target = Target(TargetSpec(model=str(models["text"]), layers="1", device="cpu"))
    assert _croppable_cache(target) is None
    block = 4
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig.from_target(
        target.model.config, draft_layers=1, target_layer_ids=[1], mask_token_id=248000,
        block_size=block)).eval()
    propose = drafter_proposer(target, drafter)
    prompt = [1000 + (7 * i) % 5000 for i in range(40)]
    head_positions: list[int] = []

    def count(_module, inputs, _output) -> None:  # the target's calls ([1, k, hidden])
        if inputs[0].dim() == 3:
            head_positions.append(inputs[0].shape[1])

    hook = target.model.get_output_embeddings().register_forward_hook(count)
    try:
        got = speculative_decode(target, propose, prompt, 12, set())
    finally:
        hook.remove()
    # the anchor and its drafts: the block, shrunk near the end to the room max_new_tokens
    # leaves (z-lab's loop: verify_size = min(block_size, max_length - start))
    rooms = [12 - 1 - sum(got.accepted[:k]) for k in range(len(got.accepted))]
    assert head_positions[0] == 1 and head_positions[1:] == [min(block, r + 1) for r in rooms]

    class FullLogits(Target):  # the old verify pass: every position's logits, then a slice
        def forward(self, rows, logits=False, extra_layers=(), logits_keep=0):
            out, states = Target.forward(self, rows, logits, extra_layers)
            return ([o[-logits_keep:] for o in out] if out and logits_keep else out), states

    full = FullLogits.__new__(FullLogits)
    full.__dict__.update(target.__dict__)
    want = speculative_decode(full, propose, prompt, 12, set())
    assert (got.tokens, got.accepted) == (want.tokens, want.accepted)
    greedy = target.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert got.tokens == greedy


@pytest.mark.slow
def test_the_linear_attention_kernels_are_named_once_per_process(models):
    """Two stages in one process (`dflash-etl run`) load the hybrid target twice and run it:
    which linear-attention kernels it uses is said once, and transformers' per-function
    fallback warnings are not repeated after it. The kernel status is the real one here."""
    import subprocess
    import sys

    from dflash_etl.models.kernels import kernel_status

    script = (
        "from dflash_etl.models.target import Target, TargetSpec\n"
        "for layers in ('1', '2'):\n"
        f"    t = Target(TargetSpec(model={str(models['text'])!r}, layers=layers, device='cpu'))\n"
        "    t.forward([[1000, 1001, 1002]], logits=True)\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    said = [line for line in result.stderr.splitlines() if "linear-attention layers" in line]
    assert len(said) == 1, result.stderr
    assert f"{LAYERS // 2} linear-attention layers of {LAYERS}" in said[0]
    for distribution, version in kernel_status().items():
        assert (f"{distribution} {version}" if version else distribution) in said[0]
    if not all(kernel_status().values()):
        assert "pip install" in said[0] and "falling back" not in result.stderr


def test_a_dense_target_says_nothing_about_kernels():
    import transformers

    from dflash_etl.models.kernels import linear_attention_layers

    assert linear_attention_layers(transformers.Qwen2Config()) == 0
    assert linear_attention_layers(transformers.Qwen3NextConfig(
        num_hidden_layers=4, full_attention_interval=2)) == 2


@pytest.mark.parametrize("cut_all", [True, False])
def test_replies_cut_inside_the_think_block_name_the_fix_with_counts(models, prompts_run,
                                                                     monkeypatch, cut_all):
    """Thinking on with the Qwen3.6 template and replies that never leave the think block (too
    few tokens): counted as their own reason, and the error (nothing kept) or the failing
    suite (most prompt-only rows lost) names --max-new-tokens / --thinking off with the counts,
    not only "fix the data"."""
    from dflash_etl.core.errors import StageError
    from dflash_etl.models.generation.local import TransformersBackend
    from dflash_etl.models.generation.replies import Q_INSIDE_THINK, Reply
    from dflash_etl.stages import regenerate
    from dflash_etl.validation.suites import SuiteError

    def scripted(self, prompts: list[str]) -> list[Reply]:
        return [Reply(f"Let me think about {k} and" if cut_all or k else
                      "Brief.\n</think>\n\nAn answer.", "stop", 8)
                for k, _ in enumerate(prompts)]

    monkeypatch.setattr(TransformersBackend, "generate_text", scripted)
    kw = {"progress": False, "thinking": "on", "mode": "missing", "dummy_min_repeats": 99,
          "max_new_tokens": 8, "model": str(models["text"])}
    if cut_all:
        prompts_only = prompts_run.parent / "prompts.jsonl"
        prompts_only.write_text("".join(json.dumps({"id": f"p{k}", "prompt": f"Question {k}?"})
                                        + "\n" for k in range(3)))
        (prompts_run.parent / "p.toml").write_text(
            '[[sources]]\nname = "p"\npath = "prompts.jsonl"\n')
        run_dir = prompts_run.parent / "cut"
        ingest.run(load_config(prompts_run.parent / "p.toml"), run_dir, progress=False,
                   workers=1)
        with pytest.raises(StageError) as failed:
            regenerate.run(None, run_dir, **kw)
    else:
        run_dir = prompts_run
        with pytest.raises(SuiteError) as failed:
            regenerate.run(None, run_dir, **kw)
    message = str(failed.value)
    assert Q_INSIDE_THINK in message and "--max-new-tokens" in message
    assert "--thinking off" in message
    if cut_all:
        assert f"'{Q_INSIDE_THINK}': 3" in message
    else:  # 2 of the 3 prompt-only rows: the count is in the warning
        assert "2 of 3 replies ended inside the think block" in message
        stats = json.loads((run_dir / ".regenerate.partial" / "stats.json").read_text())
        assert stats["total"]["quarantine_reasons"][Q_INSIDE_THINK] == 2


def _specforge_on_path() -> None:
    import sys

    specforge = REPO.parent / "shared" / "fixtures" / "specforge"
    if not specforge.is_dir():
        pytest.skip(f"{specforge} is absent (SpecForge's package, from ../shared/fixtures)")
    if str(specforge) not in sys.path:
        sys.path.insert(0, str(specforge))


def _grid_mask(mask_mod, q_len: int, kv_len: int):
    """A flex-attention mask_mod evaluated on every (query, key) pair."""
    import torch

    q = torch.arange(q_len)[:, None].expand(q_len, kv_len)
    kv = torch.arange(kv_len)[None, :].expand(q_len, kv_len)
    zero = torch.zeros((), dtype=torch.long)
    return mask_mod(zero, zero, q, kv)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["text", "vl"])
def test_every_consumer_rebuilds_the_drafter_we_trained(models, tokenized_copy, tmp_path,
                                                        kind):
    """Layers 1,3 with two draft layers (no consumer's default rule gives them), block 4: the
    drafter SpecForge resolves from its export (its own resolve_draft_config and model class),
    the one speculators' CLI builds from the printed command (--dry-run: built and saved, not
    trained) and what vLLM reads all have our layers, depth, block, mask token, vocabulary and
    attention pattern (each one's own mask builder against ours on a small block), and the
    target's embedding loads by the key the export names (a VL target's sits under
    model.language_model)."""
    import torch

    _specforge_on_path()
    pytest.importorskip("speculators.train.cli", reason="speculators is not installed: make setup")
    from safetensors import safe_open
    from specforge.algorithms.common.dflash_family_model import create_dflash_sdpa_mask
    from specforge.algorithms.dflash.providers import algorithm_providers
    from specforge.config.schema import Config
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead
    from specforge.training.model_loading import resolve_draft_config
    from speculators.models.dflash.attention import create_anchor_block_mask_mod
    from speculators.train import cli
    from speculators.train.config import TrainConfig

    from dflash_etl.handoff.export import export
    from dflash_etl.models.drafter import block_attention_mask
    from dflash_etl.models.serving import vllm_command
    from dflash_etl.stages import train

    target = str(models[kind])
    run_dir = tokenized_copy(tmp_path)
    extract.run(None, run_dir, progress=False, model=target, layers="1,3")
    train.run(None, run_dir, progress=False, target=target, layers="1,3", steps=2,
              batch_rows=2, anchors_per_row=4, block_size=4, draft_layers=2, eval_prompts=1,
              eval_new_tokens=4)
    ours = json.loads((run_dir / "train" / "drafter" / "config.json").read_text())
    layers, block, mask_token = [1, 3], 4, ours["dflash_config"]["mask_token_id"]
    assert ours["dflash_config"]["target_layer_ids"] == layers
    assert (ours["num_hidden_layers"], ours["block_size"]) == (2, block)
    anchors, context = torch.tensor([[1, 5]]), 9
    mine = block_attention_mask(anchors, torch.ones(1, context, dtype=torch.bool), block)[0]

    # SpecForge
    sf = export(run_dir, "specforge", tmp_path / "sf", gpus=1)
    parsed = Config.model_validate(json.loads((tmp_path / "sf" / "specforge_run.json"
                                               ).read_text()))
    resolved = resolve_draft_config(parsed, provider=algorithm_providers().model.draft_config)
    assert resolved.dflash_config["target_layer_ids"] == layers == sf["layers"]
    assert resolved.num_hidden_layers == 2 and resolved.block_size == block
    assert resolved.dflash_config["mask_token_id"] == mask_token
    assert resolved.vocab_size == ours["vocab_size"]
    model = DFlashDraftModel(resolved)
    theirs = create_dflash_sdpa_mask(anchors, torch.ones(1, 2, dtype=torch.bool), context,
                                     block, "cpu", sliding_window=model.sliding_window)
    assert torch.equal(theirs[0, 0], mine)
    key = parsed.model.embedding_key
    assert key == ("model.language_model.embed_tokens.weight" if kind == "vl"
                   else "model.embed_tokens.weight")
    parts = TargetEmbeddingsAndHead.from_pretrained(
        target, embed_key=key, lm_head_key=parsed.model.lm_head_key, device="cpu",
        dtype=torch.float32)
    with safe_open(str(models[kind] / "model.safetensors"), "pt") as f:
        assert torch.equal(parts.embed_tokens.weight, f.get_tensor(key))

    # speculators, from the native extract (no re-extract)
    sp = export(run_dir, "speculators", tmp_path / "sp")
    assert sp["aux_hidden_state_layer_ids"] == [2, 4]
    saved = tmp_path / "sp-drafter"
    argv = [*shlex.split(sp["command"])[3:], "--save-path", str(saved), "--dry-run",
            "--draft-attn-impl", "sdpa"]  # CPU: no flex attention kernels
    cli.main(TrainConfig.resolve(argv))
    built = json.loads((saved / "config.json").read_text())
    decoder = built["transformer_layer_config"]
    assert built["aux_hidden_state_layer_ids"] == [2, 4]
    assert decoder["num_hidden_layers"] == 2 and built["block_size"] == block
    assert built["mask_token_id"] == mask_token
    assert built["draft_vocab_size"] == sp["head"]["rows"]  # ours: the whole LM head
    for layer_type in decoder["layer_types"]:
        window = None if layer_type == "full_attention" else decoder["sliding_window"]
        mask_mod, q_len, kv_len = create_anchor_block_mask_mod(
            torch.zeros(context, dtype=torch.long), context, anchors[0], block,
            sliding_window=window,
            sliding_window_non_causal=built.get("sliding_window_non_causal", False))
        assert torch.equal(_grid_mask(mask_mod, q_len, kv_len), mine), layer_type

    # vLLM reads the drafter directory itself, and serves in the rows' thinking mode
    argv = shlex.split(vllm_command(run_dir))
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == block - 1
    served = json.loads((Path(spec["model"]) / "config.json").read_text())
    assert served["dflash_config"]["target_layer_ids"] == layers
    kwargs = json.loads(argv[argv.index("--default-chat-template-kwargs") + 1])
    assert kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("kind", ["text", "vl"])
def test_server_backed_extract_equals_the_hooks_on_qwen3_5(models, tokenized_copy, tmp_path,
                                                           kind):
    """extract --backend server against the dev server's vLLM-protocol engine: the same states
    (<= 1e-6) and index as the hooks, on a hybrid text and a VL checkpoint."""
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import load_file

    from dflash_etl.models.devserver import DevServer
    from dflash_etl.models.states_server import vllm_layer_ids

    hooks, served = tokenized_copy(tmp_path / "hooks"), tokenized_copy(tmp_path / "served")
    target = str(models[kind])
    extract.run(None, hooks, progress=False, model=target, layers="1,2")
    states = tmp_path / "server-states"
    with DevServer(target, extract_layers=vllm_layer_ids([1, 2], LAYERS),
                   states_dir=str(states)) as server:
        extract.run(None, served, progress=False, model=target, layers="1,2",
                    backend="server", endpoint=server.url, states_dir=str(states),
                    retries=0)
    # the rows' digests differ (the states match within 1e-6, not bit for bit): all else equal
    assert pq.read_table(hooks / "extract" / "index.parquet").drop_columns(["sha256"]).equals(
        pq.read_table(served / "extract" / "index.parquet").drop_columns(["sha256"]))
    for shard in sorted((hooks / "extract" / "hidden_states").glob("*.safetensors")):
        mine = load_file(str(shard))
        theirs = load_file(str(served / "extract" / "hidden_states" / shard.name))
        torch.testing.assert_close(theirs["hidden_states"], mine["hidden_states"], atol=1e-6,
                                   rtol=0)
