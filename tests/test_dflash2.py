"""DFlash2 (`[train] arch = "dflash2"`) as its consumers read it, with their own code: z-lab's
`dflash.model.DFlash2DraftModel` (weights loaded from our directory: the same block states, the
same selector path), transformers' remote-code route, and the training objective (speculators'
selector loss). A tiny random-weight Qwen3 target (4 layers, hidden 64) and a 2-layer DFlash2
drafter with every weight randomised (the convolutions too, so they matter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
# the DFlash hand-off tests' shapes and inputs: a block of 4 over target layers 1, 2 of hidden 64
from test_drafter_handoff import BLOCK, HIDDEN, LAYERS, _inputs, _ours, randomized  # noqa: E402

VOCAB = 300


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("dflash2-target") / "target"
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0,
        tie_word_embeddings=False)).save_pretrained(out)
    return out


def _config(target_dir: Path, **extra):
    from transformers import AutoConfig

    from dflash_etl.models.drafter import DrafterConfig

    config = DrafterConfig.from_target(AutoConfig.from_pretrained(target_dir), draft_layers=2,
                                       target_layer_ids=LAYERS, mask_token_id=VOCAB - 1,
                                       block_size=BLOCK)
    config.arch, config.selector_rank, config.selector_top_k = "dflash2", 8, 5
    for key, value in extra.items():
        setattr(config, key, value)
    return config


@pytest.fixture(scope="module")
def drafter(target_dir, tmp_path_factory):
    """(our DFlash2 drafter, the directory it saved) with every weight randomised."""
    return randomized(_config(target_dir), tmp_path_factory.mktemp("dflash2-drafter") / "drafter")


def _zlab():
    return pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")


def test_config_names_dflash2_and_its_settings(drafter):
    _, out = drafter
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["auto_map"] == {"AutoModel": "dflash.DFlash2DraftModel"}
    assert {k: config["dflash_config"][k] for k in (
        "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5}


def test_zlab_dflash2_loads_every_tensor_and_computes_our_block_and_path(drafter, target_dir):
    """z-lab's own DFlash2DraftModel.from_pretrained on our directory: no missing or unexpected
    key; its forward over a block equals ours: max |diff| <= 1e-6 in float64 (both norm in
    float32, as z-lab's do), < 2e-5 in float32 (the two sum in other orders); and its selector
    (`propose` at temperature 0) picks the drafts ours picks."""
    import copy

    zlab = _zlab()
    from transformers import AutoModelForCausalLM

    ours, out = drafter
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = target.get_output_embeddings()
    for dtype, within in ((torch.float64, 1e-6), (torch.float32, 2e-5)):
        model, info = zlab.DFlash2DraftModel.from_pretrained(out, dtype=dtype,
                                                             output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        model.eval()
        mine_model = copy.deepcopy(ours).to(dtype)
        for seed in range(3):
            hidden, embeds = (x.to(dtype) for x in _inputs(seed))
            c = hidden.shape[1]
            with torch.no_grad():
                theirs = model(position_ids=torch.arange(c + BLOCK)[None],
                               noise_embedding=embeds[:, 0], target_hidden=hidden)[0]
            mine = _ours(mine_model, hidden, embeds, [c])[0]
            assert (theirs - mine).abs().max() <= within
            if dtype is torch.float32:
                anchor = torch.tensor([7 + seed])
                with torch.no_grad():
                    their_path = model.propose(theirs[None, 1:], anchor, head, 0.0)[0][0]
                    my_path = ours.candidate_selector.path(mine[None, 1:], head(mine[None, 1:]),
                                                           anchor)[0]
                assert their_path.tolist() == my_path.tolist()
    # the selector matters: its path differs from the unary argmax somewhere on these weights
    hidden, embeds = _inputs(5)
    states = _ours(ours, hidden, embeds, [hidden.shape[1]])[0, 1:]
    with torch.no_grad():
        paths = [ours.candidate_selector.path(states[None], head(states[None]),
                                              torch.tensor([a]))[0] for a in range(40)]
        unary = head(states).argmax(-1).tolist()
    assert any(p.tolist() != unary for p in paths)


def test_remote_code_is_dflash2_and_equal(drafter):
    from transformers import AutoModel

    ours, out = drafter
    model = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(model).__name__ == "DFlash2DraftModel"
    hidden, embeds = _inputs(3)
    c = hidden.shape[1]
    with torch.no_grad():
        theirs = model(position_ids=torch.arange(c + BLOCK)[None], noise_embedding=embeds[:, 0],
                       target_hidden=hidden)[0]
    assert (theirs - _ours(ours, hidden, embeds, [c])[0]).abs().max() <= 1e-6


def test_blocks_trained_together_are_each_computed_as_alone(drafter):
    """The convolutions stay inside a block: two blocks in one training pass give each block's
    states as that block alone (a convolution over the whole sequence would mix them)."""
    ours, _ = drafter
    hidden, embeds = _inputs(4, context=12, blocks=2)
    together = _ours(ours, hidden, embeds, [3, 8])
    for k, anchor in enumerate([3, 8]):
        alone = _ours(ours, hidden, embeds[:, k:k + 1], [anchor])[0]
        assert (together[k] - alone).abs().max() <= 1e-5


def test_the_selector_loss_is_speculators_objective(drafter):
    """Our selector loss and its gradient equal speculators 0.9's own DFlash2 pieces on the same
    weights: its `selector_training_candidates` (the label injected at rank k when the top-k
    misses it) and its CandidateSelector's `score_candidates` over the full unary logits."""
    pytest.importorskip("speculators.models.dflash2", reason="pip install --no-deps "
                        "speculators==0.9.0")
    from speculators.models.dflash2.metrics import selector_training_candidates
    from speculators.models.dflash2.model_definitions import CandidateSelector

    from dflash_etl.models.training.loss import selector_loss

    ours, _ = drafter
    top_k = ours.candidate_selector.top_k
    theirs = CandidateSelector(vocab_size=VOCAB, hidden_size=HIDDEN, rank=8, top_k=top_k)
    theirs.load_state_dict(ours.candidate_selector.state_dict())
    g = torch.Generator().manual_seed(7)
    head = torch.randn(VOCAB, HIDDEN, generator=g)
    states = torch.randn(40, HIDDEN, generator=g, requires_grad=True)
    candidates = (states @ head.T).topk(top_k, dim=-1).indices.detach()
    labels = torch.where(torch.arange(40) % 2 == 0, candidates[:, 2],  # half inside the top-k
                         torch.randint(0, VOCAB, (40,), generator=g))
    before = torch.randint(0, VOCAB, (40,), generator=g)
    weights = torch.rand(40, generator=g)
    total, picked = selector_loss(ours.candidate_selector, states, head, None, candidates,
                                  labels, before, weights)
    total.backward()
    mine = states.grad.clone()
    states.grad = None
    injected, where, found = selector_training_candidates(candidates, labels)
    assert not bool(found.all())  # some labels are injected
    scores = theirs.score_candidates(states @ head.T, states, before, injected)
    want = (torch.nn.functional.cross_entropy(scores, where, reduction="none") * weights).sum()
    want.backward()
    assert abs(float(total.detach()) - float(want.detach())) <= 1e-5 * float(want.detach())
    assert torch.allclose(mine, states.grad, atol=1e-5)
    assert picked.tolist() == ((scores.argmax(-1) == where) & found).tolist()


def test_dflash2_with_a_draft_vocabulary_head_is_refused_before_any_work():
    from dflash_etl.core.errors import StageError
    from dflash_etl.stages.train import TrainSettings

    with pytest.raises(StageError, match="whole LM head"):
        TrainSettings(target="/t", arch="dflash2", head_vocab="draft")
    assert TrainSettings(target="/t", arch="dflash", head_vocab="draft").head_vocab == "draft"
