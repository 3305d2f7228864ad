"""``auto``'s ``edge`` calibration (ddtree.budget.edge_probs): acceptance learnt per tested edge from the drafter's
conditional probabilities, a node's acceptance the product along its path."""

from __future__ import annotations

import numpy as np

from ddtree.budget import Round, RoundMemory, calibrated_probs


def _tree(rng, width=3, depth=3):
    """A full ``width``-ary tree of ``depth`` levels in parent-before-child order: parents, depths and each
    node's conditional drafter probability q (Dirichlet over its siblings, scaled to leave 10% unclaimed)."""
    parents, depths, q = [], [], []
    level = [-1]
    for d in range(1, depth + 1):
        nxt = []
        for p in level:
            for j, share in enumerate(rng.dirichlet(np.ones(width)) * 0.9):
                parents.append(p)
                depths.append(d)
                q.append(share)
                nxt.append(len(parents) - 1)
        level = nxt
    return np.array(parents), np.array(depths), np.array(q)


def _truth(parents, q):
    """The target's greedy choice sharpens the drafter's: at an accepted node it takes child j with probability
    0.9 * q_j^2 / sum(q^2) of the siblings (a likely child more often than q says, an unlikely one less), and no
    child with 0.1. Returns each node's conditional and path acceptance."""
    cond = np.zeros(len(q))
    for p in np.unique(parents):
        kids = np.flatnonzero(parents == p)
        cond[kids] = 0.9 * q[kids] ** 2 / (q[kids] ** 2).sum()
    path = cond.copy()
    for i in range(len(q)):
        if parents[i] >= 0:
            path[i] *= path[parents[i]]
    return cond, path


def _walk(rng, parents, cond):
    accepted = np.zeros(len(parents), dtype=bool)
    at = -1
    while True:
        kids = np.flatnonzero(parents == at)
        if not len(kids):
            return accepted
        u, edges = rng.random(), np.cumsum(cond[kids])
        hit = np.searchsorted(edges, u, side="right")
        if hit >= len(kids):
            return accepted
        at = kids[hit]
        accepted[at] = True


def _log_p(parents, q):
    log_p = np.log(q)
    for i in range(len(q)):
        if parents[i] >= 0:
            log_p[i] += log_p[parents[i]]
    return log_p


def test_edge_calibration_recovers_a_sharpened_target():
    """Oracle: rounds drawn from a known target whose acceptance sharpens the drafter's q per edge. After 3,000
    rounds the edge calibration's path acceptances are within a third of the error of the drafter's own numbers
    and of the per-depth calibration (which scales a confident child and its unlikely siblings alike). Calibrating
    each edge with its path probability instead of its conditional one (log_p instead of log q), or counting
    untested edges (parent rejected) as failures, breaks this."""
    rng = np.random.default_rng(5)
    memory = RoundMemory(window=4000)
    for _ in range(3000):
        parents, depths, q = _tree(rng)
        cond, _ = _truth(parents, q)
        memory.append(Round(_log_p(parents, q), depths, _walk(rng, parents, cond), 0.01, parents))
    errors = {"none": 0.0, "depth": 0.0, "edge": 0.0}
    for _ in range(50):
        parents, depths, q = _tree(rng)
        log_p, (_, truth) = _log_p(parents, q), _truth(parents, q)
        for method in errors:
            got = calibrated_probs(log_p, depths, memory, method, parents=parents)
            errors[method] += float(np.abs(got - truth).sum())
    assert errors["edge"] < errors["none"] / 3 and errors["edge"] < errors["depth"] / 3, errors


def test_edge_calibration_keeps_a_tree_consistent_and_falls_back_without_parents():
    """A node's acceptance never exceeds its parent's, siblings' acceptances never sum past their parent's; rounds
    without parents (a policy that books merged trees) teach no edge statistics, and a calibration without them
    is the per-depth one."""
    rng = np.random.default_rng(1)
    memory = RoundMemory()
    for _ in range(50):
        parents, depths, q = _tree(rng, width=4, depth=2)
        accepted = np.zeros(len(q), dtype=bool)
        accepted[np.flatnonzero(parents == -1)] = True  # an over-optimistic record: every root child "accepted"
        memory.append(Round(_log_p(parents, q), depths, accepted, 0.01, parents))
    parents, depths, q = _tree(rng, width=4, depth=2)
    log_p = _log_p(parents, q)
    got = calibrated_probs(log_p, depths, memory, "edge", parents=parents)
    for i, p in enumerate(parents):
        assert got[i] <= (got[p] if p >= 0 else 1.0) + 1e-12
    for p in (-1, *range(len(q))):
        kids = np.flatnonzero(parents == p)
        if len(kids):
            assert got[kids].sum() <= (got[p] if p >= 0 else 1.0) + 1e-9
    bare = RoundMemory()
    for r in memory:
        bare.append(Round(r.log_p, r.depths, r.accepted, r.seconds))
    assert bare.edge_nodes.sum() == 0
    assert np.allclose(calibrated_probs(log_p, depths, bare, "edge", parents=parents),
                       calibrated_probs(log_p, depths, bare, "depth"))
    assert np.allclose(calibrated_probs(log_p, depths, memory, "edge"), calibrated_probs(log_p, depths, memory,
                                                                                         "depth"))
