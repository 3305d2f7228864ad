"""One ``auto`` tree size for a whole batch: :class:`SharedBudget`.

In a batch every tree is padded to the largest one, so a round costs what the largest tree costs: a sequence that
verifies fewer nodes saves nothing while another verifies more. Each sequence's own ``auto`` (the per-sequence
choice) prices its nodes with its share of the batch round as if every other sequence chose as it did; the shared
choice instead picks ONE size N per round for all, the one that maximizes the batch's committed tokens per second:

    sum_b (1 + sum_{i<=N} a_{b,i}) - R * s(N)        (R: the batch's long-run rate; the ratio rule before it is known)

with a_{b,i} sequence b's calibrated path probabilities (its own :class:`~ddtree.budget.AutoBudget` builds and
calibrates them, as alone), s(N) the per-sequence share of the batch round at N nodes (the batch size's cost curve,
:func:`ddtree.cost.measure_cost_model`) and R the sum of the sequences' own long-run rates. Each sequence then
verifies the first N nodes of its tree (fewer when its tree has fewer) and books the round in its own memory, so
its calibration learns as before. Only the tree sizes change, never the output.
"""

from __future__ import annotations

import numpy as np

from dflash_core.policy import DraftBlock, as_block

from .budget import AutoBudget
from .candidates import truncate_tree

__all__ = ["SharedBudget", "shared_size"]


def shared_size(probs: list[np.ndarray], seconds: np.ndarray, rate: float | None) -> int:
    """The size N in 0..len(seconds)-1 maximizing the batch objective of the module docstring (smallest on ties):
    ``probs`` one array of calibrated path probabilities per sequence (a tree shorter than N contributes all it
    has), ``seconds`` the per-sequence round seconds at 0..cap nodes, ``rate`` the batch's long-run rate or None
    (ratio rule)."""
    gain = np.full(len(seconds), float(len(probs)))
    for p in probs:
        cum = np.concatenate([[0.0], np.cumsum(np.asarray(p, dtype=float))])[: len(seconds)]
        gain += np.concatenate([cum, np.full(len(seconds) - len(cum), cum[-1])])
    objective = gain / seconds if rate is None else gain - rate * seconds
    return int(np.argmax(objective))


class SharedBudget:
    """The :class:`~dflash_core.rounds.BatchProposer` of ``budget="auto"`` with one size per round for the batch
    (see the module docstring); ``policies[b]``: sequence b's :class:`AutoBudget` (all on the same cost curve)."""

    def __init__(self, policies: list[AutoBudget]) -> None:
        if not policies or not all(isinstance(p, AutoBudget) for p in policies):
            raise TypeError("SharedBudget sizes the trees of AutoBudget policies (budget='auto'), one per sequence")
        self.policies = policies
        self.chosen: list[int] = []  # the shared size of every round (for studies)

    def propose(self, seqs: list[int], blocks: list[DraftBlock | None], histories: list[list[int]]) -> list:
        found = []
        for s, block, history in zip(seqs, blocks, histories):
            policy = self.policies[s]
            now = policy.start_round(history)
            tree, probs, _ = policy.candidates(as_block(block, history), history, policy.build_sizes()[0])
            found.append((policy, tree, probs, now, len(history)))
        policies = [f[0] for f in found]
        rates = [p.rate for p in policies]
        rate = None if any(r is None for r in rates) or policies[0].rule != "marginal" else float(sum(rates))
        n = shared_size([f[2] for f in found], policies[0]._seconds, rate)
        self.chosen.append(n)
        trees = []
        for policy, tree, _, now, length in found:
            k = min(n, len(tree))
            policy.remember(tree.log_probs.double().numpy()[:k], tree.depths.numpy()[:k], k, now, length,
                            parents=tree.parents.numpy()[:k])
            trees.append(truncate_tree(tree, k))
        return trees
