"""Lookup branches in the draft tree: the context's n-gram continuation and the drafter's prefixes under ONE budget.

Each round two sources propose token paths below the root:

* the drafter: every prefix ``u`` with its path probability ``q(u)`` under the factorized draft distribution (what
  :func:`ddtree.build_tree` ranks);
* the context (:class:`dflash_core.lookup.NgramIndex`): the continuation ``c_1 .. c_m`` of the longest earlier match
  of the committed suffix, of match length ``n``; its node at depth ``k`` gets the estimate ``a_n(k)``, the
  probability that the target accepts the continuation through depth ``k``, learned online: ``a_n(k) =
  prod_{j <= k} p_n(j)`` with ``p_n(j)`` the share of rounds (match length ``n``) whose walk, having accepted the
  continuation through depth ``j - 1``, also accepted depth ``j`` (a Beta(1, 1) prior per cell).

A token path proposed by both sources is one node whose value is the larger of the two estimates. The tree keeps the
``budget`` nodes of largest value. **Why that is the best tree under these estimates**: the expected number of
accepted tokens of a prefix-closed tree is the sum of its nodes' acceptance probabilities, so the best tree of B nodes
takes the B largest values provided they form a prefix-closed set. They do, because a value never exceeds its
parent's: ``q`` of a child is ``q`` of its parent times a probability, ``a_n(k) <= a_n(k - 1)``, a lookup node's parent
lies on the same continuation, and the maximum of two non-increasing sequences is non-increasing; sorting by value
and then by depth puts every parent before its children. Only the drafter's own B best prefixes can be among the B
best of the union (any other prefix is beaten by B drafter prefixes already), so the union is built from
``build_tree(draft_logits, B)`` and the m lookup nodes. Verification is sample-and-match as for every top-K tree, so
the output stays exactly the target's whatever the estimates are.
"""

from __future__ import annotations

import math

import torch

from dflash_core.lookup import NgramIndex

from .build import build_tree
from .tree import ROOT, DraftTree

__all__ = ["LookupTree", "merge_lookup"]


def merge_lookup(tree: DraftTree, continuation: list[int], estimates: list[float], budget: int) -> tuple[DraftTree, list[int]]:
    """The ``budget`` best nodes of the union of ``tree`` (values exp(log_probs)) and the chain ``continuation``
    (values ``estimates``, non-increasing); returns the merged tree and, per continuation depth that made it into
    the tree, the node index carrying it."""
    nodes: dict[tuple[int, ...], float] = {}
    paths: list[tuple[int, ...]] = []
    for i in range(len(tree)):  # the drafter's nodes; parents come first, so their paths are known
        parent = int(tree.parents[i])
        path = (paths[parent] if parent != ROOT else ()) + (int(tree.token_ids[i]),)
        paths.append(path)
        nodes[path] = math.exp(float(tree.log_probs[i]))
    chain = tuple(int(t) for t in continuation)
    for k, value in enumerate(estimates, start=1):
        path = chain[:k]
        nodes[path] = max(nodes.get(path, 0.0), value)
    chosen = sorted(nodes, key=lambda p: (-nodes[p], len(p), p))[:budget]  # parents first (see the module)
    index = {p: i for i, p in enumerate(chosen)}
    parents = [index[p[:-1]] if len(p) > 1 else ROOT for p in chosen]
    with torch.no_grad():
        merged = DraftTree(torch.tensor([p[-1] for p in chosen], dtype=torch.long),
                           torch.tensor(parents, dtype=torch.long), torch.tensor([len(p) for p in chosen]),
                           torch.tensor([math.log(max(nodes[p], 1e-300)) for p in chosen], dtype=torch.float64))
    return merged, [index[chain[:k]] for k in range(1, len(estimates) + 1) if chain[:k] in index]


class LookupTree:
    """Proposal policy: the DDTree of ``budget`` nodes with the context's continuation merged in (module docstring).

    ``stats`` per round: match length, continuation tokens proposed and placed in the tree, and (after the walk)
    how many committed tokens were lookup nodes (``lookup_committed``).
    """

    uses_draft = True

    def __init__(self, budget: int, max_ngram: int = 3, num_tokens: int = 10) -> None:
        self.budget, self.max_ngram, self.num_tokens = int(budget), max_ngram, num_tokens
        self.name = f"lookup-tree-{budget}"
        self.index = NgramIndex(max_ngram)
        # per match length n and depth k: [accepted given depth k-1 accepted, trials]
        self.counts = [[[0, 0] for _ in range(num_tokens + 1)] for _ in range(max_ngram + 1)]
        self._round: tuple[int, list[int]] | None = None  # (match length, node index per continuation depth)
        self.lookup_committed: list[int] = []

    def estimates(self, n: int, m: int) -> list[float]:
        """a_n(1..m): the learned probability that the target accepts a match-length-n continuation through depth k."""
        out, a = [], 1.0
        for k in range(1, m + 1):
            hits, trials = self.counts[n][k]
            a *= (hits + 1) / (trials + 2)
            out.append(a)
        return out

    def propose(self, draft_logits: torch.Tensor, history: list[int]) -> DraftTree:
        self.index.follow(history)
        tree = build_tree(draft_logits, self.budget)
        n, continuation = self.index.continuation(self.num_tokens)
        if n == 0 or not continuation or self.budget == 0:
            self._round = None
            return tree
        merged, placed = merge_lookup(tree, continuation, self.estimates(n, len(continuation)), self.budget)
        self._round = (n, placed)
        return merged

    def observe(self, accepted: int, path: list[int]) -> None:
        """Learn from the walk: how deep along the continuation's nodes the accepted path went."""
        if self._round is None:
            self.lookup_committed.append(0)
            return
        n, placed = self._round
        on_path = set(path)
        depth = 0
        while depth < len(placed) and placed[depth] in on_path:
            depth += 1
        for k in range(1, min(len(placed), depth + 1) + 1):  # depths tried: all accepted ones and the first miss
            self.counts[n][k][1] += 1
            self.counts[n][k][0] += k <= depth
        self.lookup_committed.append(depth)
