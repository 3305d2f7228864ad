"""The ``edge`` calibration of ``budget="auto"`` (:mod:`ddtree.budget`): the drafter's conditional probabilities
calibrated per tested edge, a node's acceptance the product along its path. The counts live in
:class:`ddtree.budget.RoundMemory` (``edge_q``, ``edge_hits``, ``edge_nodes`` per bucket of :data:`EDGE_EDGES`)."""

from __future__ import annotations

import numpy as np

__all__ = ["EDGE_EDGES", "edge_log_q", "edge_probs"]

EDGE_EDGES = np.array([-4.0, -3.0, -2.3, -1.6, -1.2, -0.9, -0.6, -0.4, -0.25, -0.12, -0.05])  # on log q


def edge_log_q(log_p: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """Each node's conditional log-probability given its parent: its path log-prob minus its parent's (the root's
    children: their own)."""
    parents = np.asarray(parents, dtype=int)
    return log_p - np.where(parents >= 0, log_p[np.maximum(parents, 0)], 0.0)


def edge_probs(log_p: np.ndarray, depths: np.ndarray, parents: np.ndarray, memory, prior: float = 2.0) -> np.ndarray:
    """The ``edge`` calibration: path acceptance as the product of calibrated conditional acceptances.

    At T = 0 the target accepts the child of an accepted node whose token is its argmax, so a child with drafter
    probability q is accepted with the probability g(q) that a token the drafter gives q is the target's argmax.
    The drafter is trained toward the target's distribution, not its argmax: g sharpens q (a confident child is the
    argmax more often than q says, an unlikely sibling less often), and by a curve that no single factor per depth
    (``depth``) or per path probability (``bucket``, which mixes a likely deep node with an unlikely shallow one)
    can represent. Each tested edge (its parent accepted) is one Bernoulli trial of g at its q, whatever its depth,
    so the memory holds several times more trials per bucket than per-depth or per-path counts of the same rounds,
    and an estimate for a deep node is built from the edges that lead to it. Depth enters only through the path
    product. Siblings are exclusive: the children's g are scaled down where they would sum past 1."""
    q = np.exp(edge_log_q(log_p, parents))
    factor = (memory.edge_hits + prior) / (memory.edge_q + prior)
    g = np.clip(q * factor[np.searchsorted(EDGE_EDGES, np.log(np.maximum(q, 1e-300)))], 0.0, 1.0)
    parents = np.asarray(parents, dtype=int)
    total = np.bincount(parents + 1, weights=g, minlength=len(g) + 1)  # per parent (root = 0): sum of children's g
    g = g / np.maximum(total[parents + 1], 1.0)
    out = g.copy()
    depths = np.asarray(depths, dtype=int)
    for d in range(2, int(depths.max(initial=0)) + 1):  # depth by depth: a parent is final before its children
        at = depths == d
        out[at] *= out[parents[at]]
    return out
