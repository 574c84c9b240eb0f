"""Tree verification of DFlash drafts (DDTree, Ringel & Romano): what a tree budget buys.

A DFlash drafter predicts every position of its block in one pass, so each position has its
own distribution. DDTree builds from them a tree of at most B draft tokens, best-first on the
path's log-probability (the sum over its depths of each token's log-probability at that depth),
and the target verifies the whole tree in one pass: the accepted drafts are the longest root
path the target's own greedy continuation follows, then the target's next token.

`build_tree` follows the reference (github liranringel/ddtree, `build_ddtree_tree`: top-B
candidates per depth, a heap of (path log-probability, rank)); `tree_decode` is the simulator's
loop. Greedy only: the target's greedy token at each node along the accepted path is what one
tree pass gives there, so the simulator feeds the target the accepted tokens one by one (no
tree attention mask, and no rejected token in the cache: any architecture, linear attention
included) and counts the tree's size as the nodes one pass would verify.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# (the target's states before the anchor, the text so far, the tokens the step may add) ->
# the drafter's logits [drafts, vocab], one row per block position after the anchor
LogitsProposer = Callable[[Any, list[int], int], Any]


@dataclass
class DraftTree:
    """Nodes in the order best-first search took them; node 0 is the root (the anchor)."""

    tokens: list[int] = field(default_factory=list)  # per node after the root
    depths: list[int] = field(default_factory=list)  # 1 = the first draft position
    parents: list[int] = field(default_factory=lambda: [-1])  # per node, the root's first
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])  # token -> node

    @property
    def nodes(self) -> int:
        """The tokens one verify pass reads: the root and every draft."""
        return 1 + len(self.tokens)


def build_tree(log_probs: np.ndarray, budget: int) -> DraftTree:
    """At most `budget` draft nodes from per-depth log-probabilities [depth, vocab]: a node's
    children are its depth's candidates in rank order, and the next node taken is always the
    open one of highest path log-probability, so the tree holds the `budget` most probable
    prefixes."""
    tree = DraftTree()
    depth_limit = int(log_probs.shape[0])
    if budget <= 0 or depth_limit == 0:
        return tree
    top_k = min(budget, log_probs.shape[1])
    # the top_k of each depth without sorting a whole vocabulary, then those in rank order
    candidates = np.argpartition(-log_probs, top_k - 1, axis=1)[:, :top_k]
    order = np.argsort(-np.take_along_axis(log_probs, candidates, axis=1), axis=1,
                       kind="stable")
    ranked = np.take_along_axis(candidates, order, axis=1)
    ranked_lp = np.take_along_axis(log_probs, ranked, axis=1).astype(np.float64)
    first = float(ranked_lp[0, 0])
    # (-path log-prob, tie order, parent node, depth, rank, path log-prob)
    heap: list[tuple[float, int, int, int, int, float]] = [(-first, 0, 0, 1, 0, first)]
    pushed = 1
    while heap and len(tree.tokens) < budget:
        _, _, parent, depth, rank, logw = heapq.heappop(heap)
        token = int(ranked[depth - 1, rank])
        node = len(tree.tokens) + 1
        tree.tokens.append(token)
        tree.depths.append(depth)
        tree.parents.append(parent)
        tree.children.append({})
        tree.children[parent][token] = node
        if rank + 1 < top_k:  # the next candidate at this depth, beside this one
            sibling = logw - ranked_lp[depth - 1, rank] + ranked_lp[depth - 1, rank + 1]
            heapq.heappush(heap, (-sibling, pushed, parent, depth, rank + 1, sibling))
            pushed += 1
        if depth < depth_limit:  # the best candidate one depth further, below this one
            child = logw + ranked_lp[depth, 0]
            heapq.heappush(heap, (-child, pushed, node, depth + 1, 0, child))
            pushed += 1
    return tree


@dataclass(frozen=True)
class TreeDecoded:
    tokens: list[int]
    accepted: list[int]  # tokens each step added (accepted drafts + the target's next)
    nodes: list[int]  # the tree's size each step: what one verify pass would read

    @property
    def tau(self) -> float | None:
        return sum(self.accepted) / len(self.accepted) if self.accepted else None


def tree_decode(target: Any, propose: LogitsProposer, prompt: list[int], max_new_tokens: int,
                eos_ids: set[int], budget: int) -> TreeDecoded:
    """Greedy decoding of `max_new_tokens` after `prompt`, each step verifying a DDTree of at
    most `budget` drafts built from `propose`'s logits. The text is the target's own greedy
    text (lossless); what a step adds is counted as `speculative_decode` counts it."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=target.model.config)  # only grows: nothing rejected is fed
    logits, context = target.extend(prompt, cache)
    seq = [*prompt, int(logits[-1].argmax())]
    new, accepted, nodes = [seq[-1]], [], []
    with torch.no_grad():
        while len(new) < max_new_tokens and new[-1] not in eos_ids:
            room = max_new_tokens - len(new)
            draft_logits = propose(context, seq, room)[:room]
            tree = build_tree(torch.log_softmax(draft_logits.float(), -1).cpu().numpy(), budget)
            logits, states = target.extend([seq[-1]], cache)  # the anchor
            fed, node, gained = [states], 0, []
            following = int(logits[-1].argmax())
            while following in tree.children[node] and len(gained) < room:
                node = tree.children[node][following]
                gained.append(following)
                if following in eos_ids or len(gained) == room:
                    break  # the next anchor: the cache holds what comes before it
                logits, states = target.extend([following], cache)
                fed.append(states)
                following = int(logits[-1].argmax())
            if len(gained) < room and not (gained and gained[-1] in eos_ids):
                gained.append(following)  # the target's own token after the accepted path
            accepted.append(len(gained))
            nodes.append(tree.nodes)
            seq += gained
            new += gained
            context = torch.cat([context, *fed])
    return TreeDecoded(tokens=new[:max_new_tokens], accepted=accepted, nodes=nodes)
