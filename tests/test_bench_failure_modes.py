"""The failure-mode benchmark's verifier: tau on the tiny target is counted against the target
as it generated the rows. Its replies end only through its generation config's length penalty
(a transformers logits processor); a verifier without it never reaches the end of a turn, and
nothing a loss mask does there could show (mistakes d and e)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(scope="module")
def ending_target(tiny_qwen2) -> Path:
    return tiny_qwen2(tie_word_embeddings=False, exponential_decay_length_penalty=(8, 1.1))


def _prompts(project_tok) -> list[list[int]]:
    texts = ["What is 22 * 26?", "Write a haiku about the sea.", "Explain how a lock works."]
    return [project_tok(project_tok.apply_chat_template(
        [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)["input_ids"] for t in texts]


def test_the_verifier_ends_each_reply_where_transformers_generate_does(ending_target,
                                                                      project_tok):
    torch = pytest.importorskip("torch")
    from bench_failure_modes import as_generated
    from transformers import AutoModelForCausalLM

    from dflash_etl.models.acceptance import eos_token_ids, speculative_decode
    from dflash_etl.models.target import Target, TargetSpec

    model = AutoModelForCausalLM.from_pretrained(ending_target).eval()
    target = Target(TargetSpec(model=str(ending_target), device="cpu"))
    eos = eos_token_ids(target.model)
    verifier = as_generated(target, ending_target)
    undrafted: list[int] = []
    for prompt in _prompts(project_tok):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=64)[0, len(prompt):].tolist()
        assert generated[-1] in eos and len(generated) < 64  # the processor ended it

        start = len(prompt)

        def exact(context, seq, room, reply=generated, start=start):  # drafts 3 ahead
            return reply[len(seq) - start:][:3]

        def wrong(context, seq, room):
            return [int(seq[-1])] * 3

        def never_the_end(context, seq, room, undrafted=undrafted, exact=exact):  # e's, at best
            draft = exact(context, seq, room)
            undrafted.extend(t for t in draft if t in eos)
            return [t + 1 if t in eos else t for t in draft]

        for propose in (exact, wrong, lambda *_: [], never_the_end):
            decoded = speculative_decode(verifier, propose, prompt, 64, eos)
            assert decoded.tokens == generated
        steps = speculative_decode(verifier, exact, prompt, 64, eos).accepted
        assert max(steps) == 4
        # the end of turn undrafted costs nothing: the verifier's own next token is it
        assert speculative_decode(verifier, never_the_end, prompt, 64, eos).accepted == steps
        raw = speculative_decode(target, lambda *_: [], prompt, 64, eos).tokens
        assert raw[:len(generated) - 1] == generated[:-1] and raw != generated
    assert undrafted  # some exact draft held the end of turn, never_the_end's never did


def test_a_target_without_a_length_penalty_is_verified_as_it_is(tiny_target):
    from bench_failure_modes import as_generated

    sentinel = object()
    assert as_generated(sentinel, tiny_target) is sentinel


def test_rows_are_picked_by_letter_with_the_serving_side_four_together():
    from bench_failure_modes import MISTAKES, chosen_mistakes

    assert chosen_mistakes("") == list(MISTAKES)
    assert chosen_mistakes("e, d") == ["correct", "d_mask_shifted", "e_no_end_of_turn"]
    assert chosen_mistakes("h") == ["correct", "g_thinking_on", "h_other_template",
                                    "j_other_layers", "k_causal_block", "k_sliding_window"]
    with pytest.raises(SystemExit, match="no mistake m, z"):
        chosen_mistakes("d,z,m")


def test_a_row_is_paired_with_the_correct_run_seed_by_seed():
    from bench_failure_modes import _summary

    summary = _summary([5.0, 6.5, 6.0], [6.0, 6.0, 6.5])
    assert (summary["below_on_seeds"], summary["seeds"]) == (2, 3)
    assert not summary["below_every_seed"] and not summary["above_every_seed"]
    assert summary["paired_difference"] == pytest.approx(-1 / 3, abs=1e-4)
    # differences -1, +0.5, -0.5: their standard deviation over sqrt(3)
    assert summary["paired_standard_error"] == pytest.approx(0.4410, abs=1e-4)
