"""DDTree verification in the simulator: the tree holds the most probable prefixes of the
drafter's per-position distributions (brute force, and the reference's own `build_ddtree_tree`
where its snapshot is here), and decoding with it is lossless and accepts what the target's
greedy path follows."""

from __future__ import annotations

import ast
import itertools
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_etl.models.tree_verify import build_tree, tree_decode

REFERENCE = Path(os.environ.get("DDTREE_REFERENCE",
                                "/work/.mirror/liranringel+ddtree/repo"))


def _log_probs(depth: int, vocab: int, seed: int) -> np.ndarray:
    logits = np.random.default_rng(seed).normal(size=(depth, vocab)) * 2
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def _paths(tree) -> list[tuple[int, ...]]:
    """Each node's path of tokens from the root."""
    out = []
    for node in range(1, tree.nodes):
        path, at = [], node
        while at > 0:
            path.append(tree.tokens[at - 1])
            at = tree.parents[at]
        out.append(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_the_tree_holds_the_budgets_most_probable_prefixes(seed):
    depth, vocab = 3, 5
    lp = _log_probs(depth, vocab, seed)
    every = {p: sum(lp[d, t] for d, t in enumerate(p))
             for n in range(1, depth + 1) for p in itertools.product(range(vocab), repeat=n)}
    ranked = sorted(every, key=lambda p: -every[p])
    for budget in (1, 2, 5, 9, 20):
        tree = build_tree(lp, budget)
        assert tree.nodes == 1 + budget
        assert set(_paths(tree)) == set(ranked[:budget])
        for node in range(1, tree.nodes):  # a child one level below its parent, found by token
            parent = tree.parents[node]
            assert tree.depths[node - 1] == (tree.depths[parent - 1] if parent else 0) + 1
            assert tree.children[parent][tree.tokens[node - 1]] == node
    assert build_tree(lp, 0).nodes == 1


def _reference_build():
    """The reference's `build_ddtree_tree`, its own source, read from the snapshot (its module
    imports its model package; the function needs heapq, numpy, torch and two timers)."""
    if not (REFERENCE / "HEAD").exists() and not (REFERENCE / ".git").exists():
        pytest.skip(f"DDTree's reference (github liranringel/ddtree) is not at {REFERENCE}: "
                    "set DDTREE_REFERENCE to its checkout or bare repository")
    source = subprocess.run(["git", "-C", str(REFERENCE), "show", "HEAD:ddtree.py"],
                            capture_output=True, text=True, check=True).stdout
    function = next(n for n in ast.parse(source).body
                    if isinstance(n, ast.FunctionDef) and n.name == "build_ddtree_tree")
    import heapq
    import time

    scope = {"heapq": heapq, "time": time, "np": np, "torch": torch,
             "cuda_time": time.perf_counter,
             "empty_stage_times": lambda names: dict.fromkeys(names, 0.0),
             "DDTREE_TREE_BUILD_STAGE_ORDER": ()}
    exec(compile(ast.Module([function], []), "ddtree.py", "exec"), scope)
    return scope["build_ddtree_tree"]


@pytest.mark.parametrize("seed", range(3))
def test_the_tree_is_the_reference_implementations(seed):
    reference = _reference_build()
    logits = torch.from_numpy(np.random.default_rng(seed).normal(size=(15, 300)) * 3)
    for budget in (4, 16, 64):
        tokens, depths, parents, children, _, _ = reference(logits, budget)
        ours = build_tree(torch.log_softmax(logits.float(), -1).numpy(), budget)
        assert ours.tokens == tokens.tolist() and ours.depths == depths.tolist()
        assert ours.parents == parents and ours.children == children


@pytest.fixture(scope="module")
def decoding(default_run_dir):
    from dflash_etl.models.acceptance import (
        drafter_logits,
        drafter_proposer,
        eos_token_ids,
        speculative_decode,
    )
    from dflash_etl.models.drafter import DFlashDrafter
    from dflash_etl.models.target import Target, TargetSpec
    from dflash_etl.models.tokenizer import load_tokenizer

    run = default_run_dir
    drafter = DFlashDrafter.load(run / "train" / "drafter").eval()
    target = Target(TargetSpec(model=str(run / "target"), layers=",".join(
        map(str, drafter.config.target_layer_ids))))
    tokenizer = load_tokenizer(str(run / "target"))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
               for text in ("What is 7 + 5?", "Write a short sentence about a red fox.")]
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    eos = eos_token_ids(target.model)
    chains = [speculative_decode(target, drafter_proposer(target, drafter), p, 40, eos)
              for p in prompts]
    return target, drafter, prompts, eos, chains, drafter_logits(target, drafter)


def test_tree_decoding_is_lossless_and_verifies_at_most_the_budget(decoding):
    """The text is the target's greedy text (the chain's, itself lossless) at any budget; no
    budget means the target's token alone each step; the nodes a step verifies stay within the
    budget, and every token after the first is counted in some step."""
    target, _, prompts, eos, chains, logits = decoding
    for prompt, chain in zip(prompts, chains, strict=True):
        alone = tree_decode(target, logits, prompt, 40, eos, budget=0)
        assert alone.tokens == chain.tokens and set(alone.accepted) == {1}
        for budget in (4, 16, 64):
            tree = tree_decode(target, logits, prompt, 40, eos, budget)
            assert tree.tokens == chain.tokens
            assert max(tree.nodes) == budget + 1
            assert sum(tree.accepted) == len(chain.tokens) - 1


def test_a_drafter_that_knows_the_text_is_accepted_a_whole_block_per_step(decoding):
    """An oracle proposer (one-hot at the target's own next tokens): every step takes the
    block's drafts and the target's token after them, block_size tokens, whatever the budget
    (the top path is the greedy one)."""
    target, drafter, prompts, eos, chains, _ = decoding
    block = drafter.config.block_size
    prompt, chain = prompts[0], chains[0]
    text = [*prompt, *chain.tokens]

    def oracle(context, seq, room):
        ahead = text[len(seq):len(seq) + min(block - 1, room)]
        rows = torch.full((len(ahead), target.model.config.vocab_size), -30.0)
        rows[torch.arange(len(ahead)), torch.tensor(ahead, dtype=torch.long)] = 0.0
        return rows

    decoded = tree_decode(target, oracle, prompt, 40, eos, budget=block - 1)
    assert decoded.tokens == chain.tokens
    assert decoded.accepted[:-1] == [block] * (len(decoded.accepted) - 1)


def test_eval_measures_the_tree_beside_the_chain_per_benchmark(default_run_dir, tmp_path):
    """`eval --tree-budget 4,16`: per benchmark, each budget's tau, tokens and nodes verified
    per step beside the chain's; the per-prompt turns too; the line names them; sampled
    verification of a tree is refused, not approximated."""
    from dflash_etl import evaluate
    from dflash_etl.core.errors import StageError

    bench = str(Path(__file__).resolve().parents[1] / "data" / "sources" / "prompts.jsonl")
    docs = evaluate.evaluate([bench], run=default_run_dir, out=tmp_path, limit=3,
                             decoding=evaluate.Decoding(16), tree_budgets=(4, 16))
    doc = docs["prompts"]
    assert set(doc["tree"]) == {"4", "16"} and doc["settings"]["tree_budgets"] == [4, 16]
    for budget, tree in doc["tree"].items():
        assert 1 < tree["nodes_per_step"] <= int(budget) + 1
        assert 1 <= tree["tau"] <= 16 and tree["verify_steps"] >= doc["prompts"]
    assert all(set(p["tree"]) == {"4", "16"} for p in doc["per_prompt"])
    line = "; ".join(evaluate._summary_parts(doc))
    assert f"DDTree of 16 nodes: tau {doc['tree']['16']['tau']:.3f}" in line
    # the report: the chain beside each budget, and the budget curve per benchmark
    from dflash_etl.report.pages import evaluation_section

    (tmp_path / "run" / "eval").mkdir(parents=True)
    (tmp_path / "run" / "eval" / "prompts.json").write_text((tmp_path / "prompts.json"
                                                              ).read_text())
    html = evaluation_section(tmp_path / "run")
    assert "Tree verification (DDTree)" in html and "<th>tree 16</th>" in html
    assert "prompts: tau by tree budget" in html
    assert f"{doc['tree']['4']['tau']} ({doc['tree']['4']['nodes_per_step']} nodes)" in html
    with pytest.raises(StageError, match="greedy only"):
        evaluate.evaluate([bench], run=default_run_dir, out=tmp_path, limit=1,
                          decoding=evaluate.Decoding(16, temperature=0.7), tree_budgets=(4,))
