"""The drafter directory as its consumers read it, with their own code: transformers' remote-code
route (`AutoModel.from_pretrained(dir, trust_remote_code=True)`, z-lab's documented one), z-lab's
`dflash.model.DFlashDraftModel`, SpecForge's `DFlashDraftModel`, speculators' `DFlashConverter`
and the config fields vLLM's DFlash loader reads; and the `vllm serve` line. A tiny random-weight
Qwen3 target (4 layers, hidden 64) and a 2-layer drafter with randomised weights (norms too, so
every tensor matters)."""

from __future__ import annotations

import json
import shlex
import sys
import types
from pathlib import Path

import pytest

from dflash_etl.models.serving import aux_hidden_state_layer_ids, vllm_serve_command

torch = pytest.importorskip("torch")

BLOCK = 4
LAYERS = [1, 2]
HIDDEN = 64
TARGET_CONTEXT = 4096  # not transformers' default (32768): the drafter must copy the target's


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Qwen3 target saved as a model directory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("handoff-target") / "target"
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=300, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=TARGET_CONTEXT, rope_theta=10_000.0,
        tie_word_embeddings=False)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def drafter(target_dir, tmp_path_factory):
    """(our DFlashDrafter, the directory it saved) with every weight randomised."""
    from transformers import AutoConfig

    from dflash_etl.models.drafter import DrafterConfig

    config = DrafterConfig.from_target(AutoConfig.from_pretrained(target_dir), draft_layers=2,
                                       target_layer_ids=LAYERS, mask_token_id=299,
                                       block_size=BLOCK)
    return randomized(config, tmp_path_factory.mktemp("handoff-drafter") / "drafter")


def randomized(config, out: Path):
    """(our drafter of `config` with every weight moved by seeded noise, `out` where it is
    saved)."""
    from dflash_etl.models.drafter import DFlashDrafter

    torch.manual_seed(1)
    model = DFlashDrafter(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save(out)
    return model, out


def _inputs(seed: int = 2, context: int = 9, blocks: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, context, len(LAYERS) * HIDDEN, generator=g)
    embeds = torch.randn(1, blocks, BLOCK, HIDDEN, generator=g)
    return hidden, embeds


def _ours(model, hidden, embeds, anchors):
    valid = torch.ones(hidden.shape[:2], dtype=torch.bool)
    with torch.no_grad():
        return model(hidden, valid, embeds, torch.tensor([anchors]))[0]


def _one_block(model, hidden, embeds):
    """z-lab's call for one block right after the context: positions 0..C+S-1, no mask."""
    c = hidden.shape[1]
    with torch.no_grad():
        return model(position_ids=torch.arange(c + BLOCK)[None], noise_embedding=embeds[:, 0],
                     target_hidden=hidden)[0]


def test_config_json_states_every_field_vllm_reads(drafter, target_dir):
    _, out = drafter
    config = json.loads((out / "config.json").read_text())
    # what vLLM's DFlash drafter reads from the draft config: vllm/model_executor/models/
    # qwen3_dflash.py (DFlashQwen3DecoderLayer, DFlashQwen3Model, DFlashQwen3ForCausalLM) and
    # vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (get_eagle3_aux_layers_from_config);
    # missing ones it defaults (max_position_embeddings to 32768), which is what went wrong
    vllm_reads = ["architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act",
                  "rms_norm_eps", "attention_bias", "max_position_embeddings",
                  "rope_parameters", "layer_types", "vocab_size", "target_hidden_size",
                  "dflash_config", "eagle_aux_hidden_state_layer_ids"]
    assert not [k for k in vllm_reads if k not in config]
    assert {"target_layer_ids", "mask_token_id"} <= set(config["dflash_config"])
    assert config["architectures"] == ["DFlashDraftModel"]
    target = json.loads((target_dir / "config.json").read_text())
    assert config["max_position_embeddings"] == target["max_position_embeddings"] == 4096
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10_000.0}
    assert config["layer_types"] == ["full_attention"] * 2  # vLLM: non-causal, no window
    assert (config["hidden_act"], config["attention_bias"]) == ("silu", False)
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert config["block_size"] == config["dflash_config"]["block_size"] == BLOCK
    # both conventions: ours (vLLM adds 1 to it when reading) and the embedding-offset one,
    # which vLLM's capture reads first; they name the same layers
    assert config["dflash_config"]["target_layer_ids"] == LAYERS
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3]
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert (out / "dflash.py").is_file()


def test_automodel_with_remote_code_is_our_class_and_computes_our_drafter(drafter):
    """Before: AutoModel fell back to a plain Qwen3Model (embed_tokens missing, fc unexpected).
    Now: dflash.py's DFlashDraftModel, equal to DFlashDrafter on one block (z-lab's call) and on
    several blocks at once (our training layout, through attention_mask)."""
    from transformers import AutoModel

    ours, out = drafter
    model, info = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32,
                                            output_loading_info=True)
    model.eval()
    assert type(model).__name__ == "DFlashDraftModel"
    assert type(model).__module__.endswith(".dflash")  # loaded from the drafter's dflash.py
    assert not info["missing_keys"] and not info["unexpected_keys"]
    hidden, embeds = _inputs()
    expected = _ours(ours, hidden, embeds, [hidden.shape[1]])[0]
    assert float((_one_block(model, hidden, embeds) - expected).abs().max()) < 1e-6
    # three blocks at anchors 2, 5, 7: each sees the context before its anchor and itself
    anchors = [2, 5, 7]
    hidden, embeds = _inputs(seed=3, blocks=len(anchors))
    c = hidden.shape[1]
    positions = torch.cat([torch.arange(c), (torch.tensor(anchors)[:, None]
                                             + torch.arange(BLOCK)).flatten()])
    block_of = torch.arange(len(anchors)).repeat_interleave(BLOCK)
    sees = torch.arange(c)[None] < torch.tensor(anchors).repeat_interleave(BLOCK)[:, None]
    mask = torch.cat([sees, block_of[:, None] == block_of[None]], dim=1)[None, None]
    with torch.no_grad():
        got = model(position_ids=positions[None], attention_mask=mask,
                    noise_embedding=embeds.reshape(1, -1, HIDDEN), target_hidden=hidden)[0]
    expected = _ours(ours, hidden, embeds, anchors).reshape(-1, HIDDEN)
    assert float((got - expected).abs().max()) < 1e-6


def _zlab():
    return pytest.importorskip("dflash.model", reason="z-lab's DFlash package is not installed: "
                               "pip install --no-deps dflash==0.1.0")


def test_zlab_loads_the_drafter_with_no_missing_keys_and_computes_the_same(drafter):
    zlab = _zlab()
    from transformers import AutoModel, DynamicCache

    ours, out = drafter
    model, info = zlab.DFlashDraftModel.from_pretrained(out, dtype=torch.float32,
                                                        output_loading_info=True)
    model.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (model.target_layer_ids, model.block_size, model.mask_token_id) == (LAYERS, BLOCK, 299)
    hidden, embeds = _inputs()
    expected = _ours(ours, hidden, embeds, [hidden.shape[1]])[0]
    assert float((_one_block(model, hidden, embeds) - expected).abs().max()) < 1e-5
    # z-lab's decode loop: the drafter's KV cache keeps the context (cropped after each block),
    # and the next call brings only the new context states; ours must do the same with it
    remote = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    hidden, embeds = _inputs(seed=4, context=12, blocks=2)
    results = []
    for drafter_model in (model, remote):
        cache = DynamicCache(config=drafter_model.config)
        steps = []
        with torch.no_grad():
            for start, end, block in ((0, 7, 0), (7, 12, 1)):  # context [start, end), then a block
                steps.append(drafter_model(
                    position_ids=torch.arange(start, end + BLOCK)[None],
                    noise_embedding=embeds[:, block], target_hidden=hidden[:, start:end],
                    past_key_values=cache, use_cache=True)[0])
                cache.crop(end - cache.get_seq_length())  # drop the block (z-lab's _crop_to)
        results.append(steps)
    for zlab_step, our_step in zip(*results, strict=True):
        assert float((zlab_step - our_step).abs().max()) < 1e-5
    whole = _ours(ours, hidden, embeds[:, 1:], [12])[0]  # one pass over the whole context
    assert float((results[1][1] - whole).abs().max()) < 1e-5


def test_specforge_loads_the_drafter_with_no_missing_or_unexpected_keys_and_computes_it(
        drafter, fixtures_dir, monkeypatch):
    root = fixtures_dir / "specforge"
    if not (root / "specforge" / "modeling" / "draft" / "dflash.py").is_file():
        pytest.skip(f"SpecForge's source not found at {root} (expected ../shared/fixtures/"
                    "specforge next to the repository)")
    monkeypatch.syspath_prepend(str(root))
    from specforge.modeling.draft.dflash import DFlashDraftModel

    ours, out = drafter
    model, info = DFlashDraftModel.from_pretrained(out, dtype=torch.float32,
                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert list(model.target_layer_ids) == LAYERS and model.block_size == BLOCK
    assert model.mask_token_id == 299
    hidden, embeds = _inputs()  # and it computes what we trained
    expected = _ours(ours, hidden, embeds, [hidden.shape[1]])[0]
    assert float((_one_block(model.eval(), hidden, embeds) - expected).abs().max()) < 1e-5
    for name in [k for k in sys.modules if k == "specforge" or k.startswith("specforge.")]:
        monkeypatch.delitem(sys.modules, name)  # the path goes; so does what it imported


def test_speculators_converter_reads_our_layer_ids_as_the_embedding_offset_ones(
        drafter, target_dir, tmp_path, monkeypatch):
    """speculators' own DFlashConverter turns our config's dflash_config.target_layer_ids into
    its aux_hidden_state_layer_ids: the ids config.json records for vLLM, ours + 1."""
    pytest.importorskip("speculators", reason="speculators is not installed: pip install "
                        "--no-deps speculators==0.9.0 hs-connectors==0.9.0")
    try:
        import loguru  # noqa: F401
    except ImportError:  # its converter only logs with it (a --no-deps install lacks it)
        quiet = types.SimpleNamespace(**{level: lambda *_a, **_k: None for level in (
            "debug", "info", "success", "warning", "error")})
        monkeypatch.setitem(sys.modules, "loguru", types.SimpleNamespace(logger=quiet))
    from speculators.convert.dflash.converter import DFlashConverter

    _, out = drafter
    DFlashConverter().convert(out, tmp_path / "converted", base_model=str(target_dir),
                              validate=False)
    converted = json.loads((tmp_path / "converted" / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert converted["aux_hidden_state_layer_ids"] == config[
        "eagle_aux_hidden_state_layer_ids"] == aux_hidden_state_layer_ids(LAYERS) == [2, 3]


def test_vllm_serve_command_is_one_copy_pasteable_line(tmp_path):
    target = tmp_path / "my target"  # a space: the line must quote it
    target.mkdir()
    drafter = tmp_path / "run" / "train" / "drafter"
    line = vllm_serve_command(target, drafter, block_size=16)
    argv = shlex.split(line)
    assert argv[:3] == ["vllm", "serve", str(target.resolve())]
    assert argv[3] == "--speculative-config" and len(argv) == 5
    assert json.loads(argv[4]) == {"method": "dflash", "model": str(drafter.resolve()),
                                   "num_speculative_tokens": 15}
    assert shlex.split(vllm_serve_command("Qwen/Qwen3-8B", drafter, 8))[2] == "Qwen/Qwen3-8B"
    # the thinking mode the rows were rendered in is the server's default: on-policy serving
    argv = shlex.split(vllm_serve_command(target, drafter, 16, {"enable_thinking": False}))
    assert argv[5] == "--default-chat-template-kwargs" and len(argv) == 7
    assert json.loads(argv[6]) == {"enable_thinking": False}


def _greedy(target, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation, one full forward pass per token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def _oracle(model, greedy: list[int], prompt_len: int, right: int) -> list[int]:
    """Make the loaded drafter propose the target's greedy tokens, right on the first `right`
    drafts of each block and wrong after: the decode loop under test stays real, and its
    acceptance path is exercised (a random drafter's drafts are all rejected). Returns the list
    the anchors of its blocks are appended to."""
    anchors: list[int] = []
    forward, compute_logits = model.forward, model.compute_logits

    def recording_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        anchors.append(int(kwargs["position_ids"][0, -out.shape[1]]))
        return out

    def proposing(hidden, head):
        logits = compute_logits(hidden, head)
        done = anchors[-1] - prompt_len + 1  # greedy tokens before this block's first draft
        wanted = greedy[done:done + logits.shape[1]]
        wanted = wanted[:right] + [(t + 1) % logits.shape[-1] for t in wanted[right:]]
        fake = torch.full_like(logits, -1e4)
        fake[0, torch.arange(len(wanted)), torch.tensor(wanted)] = 0.0
        return fake

    model.forward, model.compute_logits = recording_forward, proposing
    return anchors


def test_spec_generate_and_zlabs_decode_loop_give_the_targets_greedy_text(drafter, target_dir):
    """z-lab's documented route after AutoModel is `model.spec_generate(...)`; dflash.py's own
    greedy loop and z-lab's `dflash_generate` (driving our class through its KV cache) both
    decode the target's greedy continuation, keeping the accepted drafts + 1 per step."""
    from transformers import AutoModel, AutoModelForCausalLM

    _, out = drafter
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt, n = [5, 17, 42, 8, 99, 23], 16
    greedy = _greedy(target, prompt, n)
    ids = torch.tensor([prompt])
    model = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    for right in (0, 2, 3):  # every draft wrong; 2 of 3 right (3 tokens a step); all right
        anchors = _oracle(model, greedy, len(prompt), right)
        got = model.spec_generate(target=target, input_ids=ids, max_new_tokens=n,
                                  stop_token_ids=None, temperature=0.0)
        assert got[0, len(prompt):].tolist() == greedy
        # the first token comes from the prefill; each step keeps right + 1 (the last may be cut)
        assert len(anchors) == -(-(n - 1) // (right + 1))
        assert anchors[:3] == [len(prompt) + k * (right + 1) for k in range(3)]
        del model.forward, model.compute_logits  # the class's own again
    stop = greedy[7]  # a stop token ends the text right after it
    _oracle(model, greedy, len(prompt), 2)
    got = model.spec_generate(target=target, input_ids=ids, max_new_tokens=n,
                              stop_token_ids=[stop])
    assert got[0, len(prompt):].tolist() == greedy[:greedy.index(stop) + 1]
    zlab = _zlab()
    anchors = _oracle(model, greedy, len(prompt), 2)
    got = zlab.dflash_generate(model, target, ids, n, None)
    assert got[0, len(prompt):].tolist() == greedy and len(anchors) == 5
