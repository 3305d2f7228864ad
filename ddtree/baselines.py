"""Published tree builders on the DFlash drafter, for comparing them with DDTree's best-first tree at the same budget.

Three builders, each a :class:`~dflash_core.tree.BlockPolicy` the one decode loop runs like any other (the loop
verifies whatever valid tree a policy proposes, so every one of them is lossless; they differ only in which nodes
are verified):

* :class:`EagleTwoTree` -- EAGLE-2's dynamic tree: expand the best nodes level by level, then rerank every expanded
  node by its path probability and keep the best ``budget``;
* :class:`SequoiaTree` -- Sequoia's static tree: the shape (a set of rank paths) of at most ``budget`` nodes that
  maximizes the expected number of accepted tokens under a measured per-depth, per-rank acceptance table, found by
  Sequoia's dynamic program;
* :class:`MedusaTree` -- Medusa's static tree: the rank paths grown greedily by estimated path accuracy.

What changes for all three. Those methods draft depth by depth: EAGLE-2 and Sequoia run the draft model once per
level on the nodes being expanded, Medusa reads one head per depth. A DFlash drafter gives every depth's
distribution in ONE pass (a :class:`~dflash_core.tree.DraftBlock`: logits [D, V'] per depth, an optional
``token_map`` from draft columns to target ids). Without a Markov head a node's children therefore come from its
depth's distribution, the same for every parent at that depth (as Medusa's heads); with one (``block.scorer``) they
come from the distribution given the parent's own token (as a draft model's next step), exactly as
:func:`ddtree.build.best_tree` reads them. Expanding a node costs no drafter forward here, so a depth cap that saved
draft forwards in the original only limits the candidates.

Ranks and scores. A node's rank is its position among its parent's children, best first (log-probability descending,
ties: the lower draft column first, as :func:`ddtree.build.top_children` orders them); a *rank path*
``(r1, ..., rd)`` names the node reached by taking the rank-r1 token at depth 1, its rank-r2 child, and so on. Every
tree stores its nodes' path log-probabilities under the drafter (the float64 sum of float32 log-probabilities along
the path, as :func:`ddtree.build_tree` computes them) in best-first order, so ``tree.expected_acceptance()`` is the
drafter's own expectation for every builder alike.

The static builders take an acceptance table ``acceptance[d - 1][r]``: the probability that, at depth d, the target's
token is the drafter's rank-r token given that the parent was accepted. :func:`fit_rank_acceptance` estimates it from
replayed rounds (:class:`RecordRounds` collects them from :func:`dflash_core.replay.replay`).
"""

from __future__ import annotations

import heapq
import numbers
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from dflash_core.tree import ROOT, BlockPolicy, DraftBlock, DraftTree

from .build import top_children

__all__ = ["EAGLE2_DEPTH", "EAGLE2_TOP_K", "EAGLE2_TOTAL_TOKENS", "EagleTwoTree", "MedusaTree", "RecordRounds",
           "SequoiaTree", "StaticRankTree", "eagle2_tree", "expected_accepted_tokens", "fit_rank_acceptance",
           "medusa_rank_paths", "rank_path_tree", "sequoia_rank_paths"]

# EAGLE-2's published setting (the evaluation scripts of SafeAILab/EAGLE at the EAGLE-2 release, 7B and 13B models):
# total_token=60 positions verified, the root's token included (59 draft nodes); depth=5 expansion steps after the
# root's own top-k, i.e. 6 levels of draft nodes; top_k=10 children per expanded node and 10 expanded nodes per level.
EAGLE2_TOTAL_TOKENS = 60
EAGLE2_DEPTH = 6
EAGLE2_TOP_K = 10

RankPath = tuple[int, ...]


def _count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------------------------- a round's children


class _Children:
    """One round's children source: the ``k`` best children of a node given its depth and its own token, as
    (float64 log-probabilities, target token ids), best first. Without a Markov head they are the depth's row of the
    block (the parent's token does not matter); with one, the head's distribution given the parent's token.
    ``prepare`` batches the head's products for a level's parents (one product instead of one per parent)."""

    def __init__(self, block: DraftBlock, k: int) -> None:
        self.block, self.k, self.scorer = block, int(k), block.scorer
        self.token_map = None if block.token_map is None else \
            block.token_map.detach().cpu().numpy().astype(np.int64)
        self.rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.log_probs: np.ndarray | None = None

    def prepare(self, depth: int, parent_tokens: Iterable[int]) -> None:
        if self.scorer is not None:
            keys = [(depth, int(self.scorer.index(int(t)))) for t in parent_tokens]
            if keys:
                self.scorer.fill(keys, self.k)

    def __call__(self, depth: int, parent_token: int) -> tuple[np.ndarray, np.ndarray]:
        if self.scorer is not None:
            log_probs, columns = self.scorer.top_children(depth, int(parent_token), self.k)
            return log_probs, (columns if self.token_map is None else self.token_map[columns])
        if depth not in self.rows:
            if self.log_probs is None:
                self.log_probs = torch.log_softmax(self.block.logits.detach().float().cpu(), dim=-1).numpy()
            self.rows[depth] = top_children(self.log_probs[depth - 1], self.k, self.token_map)
        return self.rows[depth]


# ---------------------------------------------------------------------------------------------- EAGLE-2


def _eagle2_candidates(block: DraftBlock, levels: int, top_k: int) -> tuple[list, list, list, list]:
    """Every node EAGLE-2 expands, in expansion order: (tokens, parents, depths, path log-probabilities). Level 1 is
    the root's ``top_k`` children; each later level is the ``top_k`` children of each of the previous level's
    ``top_k`` best nodes (path log-probability descending, ties: the earlier expanded first)."""
    children = _Children(block, top_k)
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    frontier = [ROOT]
    for depth in range(1, levels + 1):
        parent_tokens = [block.root if f == ROOT else tokens[f] for f in frontier]
        children.prepare(depth, parent_tokens)
        first = len(tokens)
        for parent, token in zip(frontier, parent_tokens):
            above = 0.0 if parent == ROOT else scores[parent]
            log_probs, ids = children(depth, token)
            for log_prob, token_id in zip(log_probs.tolist(), ids.tolist()):
                tokens.append(int(token_id))
                parents.append(parent)
                depths.append(depth)
                scores.append(above + log_prob)
        frontier = sorted(range(first, len(tokens)), key=lambda i: (-scores[i], i))[:top_k]
        if not frontier:
            break
    return tokens, parents, depths, scores


def eagle2_tree(block: DraftBlock, budget: int, depth: int | None = None, top_k: int = EAGLE2_TOP_K) -> DraftTree:
    """EAGLE-2's tree from one round's ``block``: expand ``top_k`` children of the ``top_k`` best nodes per level for
    ``depth`` levels (None: every depth of the block), then keep the ``budget`` best expanded nodes by path
    log-probability. Ties are broken by depth, then expansion order: a node's parent always ranks before it (a path
    log-probability never grows down the path), so the kept nodes are closed under ancestors."""
    budget, top_k = _count(budget, "budget"), _count(top_k, "top_k")
    levels = block.depth if depth is None else min(_count(depth, "depth"), block.depth)
    if budget == 0 or levels == 0 or top_k == 0:
        return DraftTree.empty()
    tokens, parents, depths, scores = _eagle2_candidates(block, levels, top_k)
    keep = sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i))[:budget]
    where = {old: new for new, old in enumerate(keep)}
    return DraftTree(torch.tensor([tokens[i] for i in keep], dtype=torch.int64),
                     torch.tensor([ROOT if parents[i] == ROOT else where[parents[i]] for i in keep],
                                  dtype=torch.int64),
                     torch.tensor([depths[i] for i in keep], dtype=torch.int64),
                     torch.tensor([scores[i] for i in keep], dtype=torch.float64))


class EagleTwoTree(BlockPolicy):
    """EAGLE-2's dynamic draft tree (Li et al., 2024), every round on the DFlash drafter's block.

    The original: the draft model runs once per level on the ``top_k`` nodes being expanded and gives each of them
    ``top_k`` children; the next level expands the ``top_k`` best of those children by cumulative draft probability
    (the draft model's confidence, a proxy of the chance the target accepts the path); after ``depth`` expansion steps
    all expanded nodes are reranked by the same score and the best ``total_token - 1`` are verified with the root.

    Kept: the expand rule (``top_k`` x ``top_k`` per level), the score (path log-probability under the drafter),
    the rerank of ALL expanded nodes, ``top_k`` = 10. Changed: ``budget`` counts draft nodes only (EAGLE-2's
    ``total_token`` = 60 counts the root too: ``budget`` = 59 is its setting); children come from the block's
    per-depth distribution, or given the parent's token with a Markov head; ``depth`` (levels of draft nodes)
    defaults to every depth of the block, because EAGLE-2 caps it to bound its sequential draft forwards and here all
    depths come from one pass. More levels only add candidates (a level's expansion does not depend on deeper ones),
    so the default is never worse under the drafter's own estimate than EAGLE-2's 6 levels, which ``depth=6`` (or
    :meth:`published`) reproduces. Ties, which EAGLE-2's ``topk`` leaves to the kernel, break by depth and expansion
    order, so the verified set is always closed under ancestors.
    """

    uses_draft, proposes_chains = True, False

    def __init__(self, budget: int, depth: int | None = None, top_k: int = EAGLE2_TOP_K) -> None:
        self.budget, self.top_k = _count(budget, "budget"), _count(top_k, "top_k")
        self.depth = None if depth is None else _count(depth, "depth")
        self.name = f"eagle2-{self.budget}"

    @classmethod
    def published(cls) -> EagleTwoTree:
        """EAGLE-2's published setting: 60 positions verified (59 draft nodes), 6 levels, top-10."""
        return cls(EAGLE2_TOTAL_TOKENS - 1, depth=EAGLE2_DEPTH, top_k=EAGLE2_TOP_K)

    def propose(self, block: DraftBlock, history: list[int]) -> DraftTree:
        return eagle2_tree(block, self.budget, self.depth, self.top_k)


# ---------------------------------------------------------------------------------------------- static rank shapes


def _acceptance_table(acceptance) -> tuple[tuple[float, ...], ...]:
    """The table as tuples of floats, checked: one non-empty row per depth, every cell in [0, 1], and a row summing to
    at most 1 (its cells are probabilities of disjoint events: the target's token is the rank-r token)."""
    rows = tuple(tuple(float(x) for x in row) for row in acceptance)
    for d, row in enumerate(rows, start=1):
        if not row:
            raise ValueError(f"acceptance row of depth {d} is empty: give at least rank 0")
        if any(not 0.0 <= x <= 1.0 for x in row):
            raise ValueError(f"acceptance row of depth {d} has a cell outside [0, 1]: {row}")
        if sum(row) > 1.0 + 1e-9:
            raise ValueError(f"acceptance row of depth {d} sums to {sum(row):.4f} > 1: a cell is the probability that "
                             "the target's token IS the rank-r token (disjoint events), not a cumulative top-k "
                             "accuracy; difference cumulative accuracies first")
    return rows


def expected_accepted_tokens(acceptance, paths: Iterable[Sequence[int]]) -> float:
    """The expected number of accepted draft tokens of a shape under the table (the bonus token not counted): a node
    is accepted exactly when every node of its rank path is, so its chance is the product of its path's cells, and
    the expectation is the sum over the nodes."""
    table = _acceptance_table(acceptance)
    total = 0.0
    for path in paths:
        value = 1.0
        for d, r in enumerate(path):
            value *= table[d][r] if d < len(table) and r < len(table[d]) else 0.0
        total += value
    return total


def _shape(paths: Iterable[Sequence[int]]) -> tuple[RankPath, ...]:
    """Rank paths checked (tuples of ints >= 0, no duplicates, every proper prefix present), parents first."""
    shape = [tuple(_count(r, "rank") for r in path) for path in paths]
    if len(set(shape)) != len(shape):
        raise ValueError("rank paths must be distinct")
    if any(not path for path in shape):
        raise ValueError("a rank path must name at least one rank (the root is not a node)")
    known = set(shape)
    for path in shape:
        if len(path) > 1 and path[:-1] not in known:
            raise ValueError(f"rank path {path} is listed without its parent {path[:-1]}")
    return tuple(sorted(shape, key=lambda p: (len(p), p)))


def rank_path_tree(block: DraftBlock, paths: Iterable[Sequence[int]]) -> DraftTree:
    """The round's tree of a static shape: the node of rank path ``(r1, ..., rd)`` carries the rank-rd child of the
    node of ``(r1, ..., r(d-1))`` (the root for depth 1). A path deeper than the block, or naming a rank the draft
    vocabulary does not have, is left out with everything below it. Returned best first."""
    shape = _shape(paths)
    if not shape:
        return DraftTree.empty()
    children = _Children(block, max(max(path) for path in shape) + 1)
    nodes: dict[RankPath, tuple[int, int, float]] = {(): (ROOT, block.root, 0.0)}  # path -> node, token, score
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    for depth in range(1, min(len(shape[-1]), block.depth) + 1):
        level = [path for path in shape if len(path) == depth and path[:-1] in nodes]
        children.prepare(depth, sorted({nodes[path[:-1]][1] for path in level}))
        for path in level:
            parent, parent_token, above = nodes[path[:-1]]
            log_probs, ids = children(depth, parent_token)
            if path[-1] < len(ids):
                nodes[path] = (len(tokens), int(ids[path[-1]]), above + float(log_probs[path[-1]]))
                tokens.append(nodes[path][1])
                parents.append(parent)
                scores.append(nodes[path][2])
    if not tokens:
        return DraftTree.empty()
    return DraftTree.from_nodes(tokens, parents, scores)


class StaticRankTree(BlockPolicy):
    """A fixed shape, the same set of rank paths every round (:func:`rank_path_tree`): what Sequoia's and Medusa's
    trees are. ``paths`` may be any ancestor-closed set of rank paths."""

    uses_draft, proposes_chains = True, False

    def __init__(self, paths: Iterable[Sequence[int]], name: str = "static") -> None:
        self.paths = _shape(paths)
        self.name = name

    def propose(self, block: DraftBlock, history: list[int]) -> DraftTree:
        return rank_path_tree(block, self.paths)


def medusa_rank_paths(acceptance, budget: int) -> tuple[RankPath, ...]:
    """Medusa's greedy shape: start from the top-1 token of depth 1 and repeatedly add, among the next sibling and
    the first child of every node already in the tree, the one of highest estimated accuracy (the product of its
    path's cells), until ``budget`` nodes; at most one depth per table row and ``len(acceptance[d - 1])`` children
    per node at depth d. Ties break by depth, then rank path. Returned in the order they were added."""
    table, budget = _acceptance_table(acceptance), _count(budget, "budget")
    heap: list[tuple[float, int, RankPath, float]] = []  # (-value, depth, path, the parent's value)
    if budget and table:
        heap.append((-table[0][0], 1, (0,), 1.0))
    paths: list[RankPath] = []
    while heap and len(paths) < budget:
        neg, depth, path, above = heapq.heappop(heap)
        paths.append(path)
        rank = path[-1]
        if rank + 1 < len(table[depth - 1]):  # the next sibling
            heapq.heappush(heap, (-(above * table[depth - 1][rank + 1]), depth, path[:-1] + (rank + 1,), above))
        if depth < len(table):  # the first child
            heapq.heappush(heap, (neg * table[depth][0], depth + 1, path + (0,), -neg))
    return tuple(paths)


class MedusaTree(StaticRankTree):
    """Medusa's static tree (Cai et al., 2024): the rank paths :func:`medusa_rank_paths` grows from an accuracy table,
    then the same shape every round.

    The original: each Medusa head predicts one future position from the last hidden state; the accuracy of each
    head's rank-k prediction is measured on calibration text, a candidate path's accuracy is estimated as the product
    of its ranks' accuracies (heads taken as independent), and the tree is grown greedily from the top-1 token of the
    first head by adding the neighbour (next sibling or first child) of highest estimated accuracy until the node
    count is reached; the resulting ``medusa_choices`` are then used unchanged for every step.

    Kept: the greedy growth, its neighbours, the product estimate, the fixed shape (no per-round adaptation). Changed:
    the heads are the DFlash block's depths (one table row per depth, the depth cap = the table's depth); with a
    Markov head the rank-r child is taken from the distribution given the parent's token instead of the depth's
    unconditioned row. Medusa's per-head accuracies are measured teacher-forced at every position, which
    ``fit_rank_acceptance(..., stop_at_miss=False)`` reproduces; the default (conditioned on the parent's acceptance,
    Sequoia's table) serves both builders.
    """

    def __init__(self, acceptance, budget: int) -> None:
        self.acceptance, self.budget = _acceptance_table(acceptance), _count(budget, "budget")
        super().__init__(medusa_rank_paths(self.acceptance, self.budget), name=f"medusa-{self.budget}")
        self.expected = expected_accepted_tokens(self.acceptance, self.paths)


# ---------------------------------------------------------------------------------------------- Sequoia


def _best_splits(subtree: np.ndarray, rest: np.ndarray, index: tuple[np.ndarray, np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """One rank of the DP: for every m, the best of leaving this rank and all later ones out (0) and giving this rank
    a subtree of s = 1..m nodes (``subtree[s - 1]``) plus the later ranks the rest (``rest[m - s]``). Returns the
    values [m] and the chosen s [m] (0: left out; the first best, so a tie leaves nodes out)."""
    m, s = index
    n = subtree.shape[0]
    value = np.where((s >= 1) & (s <= m), subtree[np.clip(s - 1, 0, n - 1)] + rest[np.clip(m - s, 0, n)], -np.inf)
    value[:, 0] = 0.0
    chosen = value.argmax(axis=1)
    return value[np.arange(n + 1), chosen], chosen


def _sequoia_choices(table: tuple[tuple[float, ...], ...], n: int) -> list[np.ndarray]:
    """The DP tables, deepest depth first, returned depth 1 first: ``choices[d - 1][r, m]`` is the size of the
    rank-r child's subtree in the best forest of at most m nodes below a node of depth d - 1 using ranks r, r+1, ...
    (0: rank r and every later one left out)."""
    index = np.indices((n + 1, n + 1))
    below = np.zeros(n + 1)  # F(d + 1, m): past the last level nothing more can hang
    choices = []
    for row in reversed(table):
        ranks = min(len(row), n)
        rest = np.zeros(n + 1)  # G(d, ranks, m) = 0: no rank left
        choice = np.zeros((ranks, n + 1), dtype=np.int64)
        for r in range(ranks - 1, -1, -1):
            rest, choice[r] = _best_splits(row[r] * (1.0 + below[:n]), rest, index)
        below = rest
        choices.append(choice)
    return choices[::-1]


def _unfold(choices: list[np.ndarray], n: int) -> tuple[RankPath, ...]:
    """The shape the DP chose: each node's children take ranks 0, 1, ... with the recorded subtree sizes."""
    paths: list[RankPath] = []
    stack: list[tuple[RankPath, int]] = [((), n)]
    while stack:
        prefix, room = stack.pop()
        if len(prefix) >= len(choices):
            continue
        choice = choices[len(prefix)]
        for r in range(choice.shape[0]):
            size = int(choice[r, room])
            if size == 0:
                break
            paths.append(prefix + (r,))
            stack.append((prefix + (r,), size - 1))
            room -= size
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


def sequoia_rank_paths(acceptance, budget: int, max_depth: int | None = None) -> tuple[RankPath, ...]:
    """Sequoia's best shape: the tree of at most ``budget`` nodes and at most ``max_depth`` levels (None: the table's
    depth) in which each node's children are its top-b tokens (ranks 0..b-1) for some b, maximizing
    :func:`expected_accepted_tokens`. Returned parents first (by depth, then rank path).

    The dynamic program. F(d, m) is the best value of at most m nodes hanging below one node of depth d - 1 (so its
    children sit at depth d); F(max_depth + 1, m) = 0. Its children are filled rank by rank: G(d, r, m), the best
    using ranks r, r+1, ... only, is the larger of 0 (rank r and all later ones left out: children are contiguous
    from rank 0) and, over the rank-r child's subtree size s = 1..m, ``a[d][r] * (1 + F(d + 1, s - 1)) + G(d, r + 1,
    m - s)``; F(d, m) = G(d, 0, m), and the answer is F(1, budget). That is Sequoia's recursion over (nodes, depth,
    branches) with a row of the table per depth instead of one vector for all depths; ties keep the smaller tree.

    Where the DP is needed. A node's value is its path's product of cells, each at most 1, so a node never beats its
    parent. When every row is also non-increasing in rank, a node never beats its better sibling either, and the n
    most valuable rank paths of depth <= max_depth already form a valid shape: greedy top-n (and Medusa's greedy
    growth, which reaches the same set) is optimal and the DP finds a shape of the same value. When a measured row is
    not monotone (at some depth the drafter's rank-2 token is right more often than its rank-1 token), a valuable
    child costs its worse siblings ranked before it too, and whether it is worth them depends on how many nodes its
    subtree and theirs get: a knapsack over the budget that greedy growth can get wrong and the DP solves exactly.
    """
    table, budget = _acceptance_table(acceptance), _count(budget, "budget")
    levels = len(table) if max_depth is None else min(_count(max_depth, "max_depth"), len(table))
    if budget == 0 or levels == 0:
        return ()
    return _unfold(_sequoia_choices(table[:levels], budget), budget)


class SequoiaTree(StaticRankTree):
    """Sequoia's static tree (Chen et al., 2024): the shape :func:`sequoia_rank_paths` finds for a measured acceptance
    table, then the same shape every round.

    The original: measure the acceptance vector p (the chance that the draft's rank-k token is the accepted one),
    assume it holds at every position of the tree, and find by dynamic programming the tree of n nodes and depth at
    most D (each node's children being its top-b draft tokens) of largest expected accepted length; then pick n and D
    by the measured draft and verify times (the draft model runs once per level). Kept: the model (a node's chance is
    the product of its path's acceptance), the shape constraint, the DP with its depth cap, the fixed shape. Changed:
    one row of acceptance per depth (the DFlash drafter's accuracy falls with depth; equal rows give Sequoia's
    vector), estimated by :func:`fit_rank_acceptance` from replayed rounds; the budget is given (at most ``budget``
    draft nodes, the root not counted) and not chosen from timings, since the drafter's cost does not grow with depth
    here (one pass) and picking a size from the verify cost is ``budget="auto"``'s job; the rank-r token at a node is
    the block's rank-r token at that depth, or given the parent's token with a Markov head.
    """

    def __init__(self, acceptance, budget: int, max_depth: int | None = None) -> None:
        self.acceptance, self.budget = _acceptance_table(acceptance), _count(budget, "budget")
        self.max_depth = None if max_depth is None else _count(max_depth, "max_depth")
        super().__init__(sequoia_rank_paths(self.acceptance, self.budget, self.max_depth),
                         name=f"sequoia-{self.budget}")
        self.expected = expected_accepted_tokens(self.acceptance, self.paths)


# ---------------------------------------------------------------------------------------------- the table


def _observed_ranks(block: DraftBlock, continuation: Sequence[int], depth: int, ranks: int,
                    stop_at_miss: bool) -> list[int]:
    """Per depth along the true path, the drafter's rank of the target's token given the true parent (``ranks``:
    not among the ``ranks`` best). With ``stop_at_miss`` the first miss is the last depth observed: below it no
    node of a rank-limited tree can be accepted, so deeper depths have no accepted parent to condition on."""
    children = _Children(block, ranks)
    observed: list[int] = []
    parent = block.root
    for d in range(1, min(depth, block.depth, len(continuation)) + 1):
        token = int(continuation[d - 1])
        hits = np.flatnonzero(children(d, parent)[1] == token)
        observed.append(int(hits[0]) if hits.size else ranks)
        if stop_at_miss and observed[-1] == ranks:
            break
        parent = token
    return observed


def fit_rank_acceptance(rounds: Iterable[tuple[DraftBlock, Sequence[int]]], depth: int, ranks: int,
                        prior: float = 1.0, stop_at_miss: bool = True) -> tuple[tuple[float, ...], ...]:
    """The acceptance table ``acceptance[d - 1][r]`` (``depth`` rows of ``ranks`` cells) from replayed rounds.

    ``rounds``: (a round's :class:`~dflash_core.tree.DraftBlock`, the target's greedy continuation after its root:
    the token at depth 1 first) pairs, e.g. :meth:`RecordRounds.rounds`. Along each round's true path the drafter's
    rank of the target's token at depth d is counted, given the true parent (the token before it; with a Markov
    head the children's distribution is the one given that token), among ``ranks`` + 1 outcomes: ranks 0..ranks-1
    or none of them. A round adds to depth d only if the true path reached it with every earlier token among the
    ``ranks`` best (the parent could be accepted), so a cell estimates P(the target's token is rank r | the parent
    was accepted); ``stop_at_miss=False`` counts every depth the continuation reaches instead (Medusa's per-head
    accuracy on teacher-forced text).

    The estimate is Laplace's rule: (count + ``prior``) / (rounds at that depth + ``prior`` x (``ranks`` + 1)), the
    count over all ``ranks`` + 1 outcomes starting at ``prior`` each. No cell is then exactly 0 (a rank never seen
    in a small sample still gets a little of the budget), and a depth with no observation gets
    1 / (``ranks`` + 1) per rank. ``prior=0`` gives the raw frequencies (a depth never observed then gets zeros).
    """
    depth, ranks = _count(depth, "depth"), _count(ranks, "ranks")
    if ranks == 0:
        raise ValueError("ranks must be >= 1")
    if not prior >= 0:
        raise ValueError(f"prior must be >= 0, got {prior!r}")
    counts = np.zeros((depth, ranks + 1))
    for block, continuation in rounds:
        tokens = torch.as_tensor(continuation).reshape(-1).tolist() if isinstance(continuation, torch.Tensor) \
            else [int(t) for t in continuation]
        for d, rank in enumerate(_observed_ranks(block, tokens, depth, ranks, stop_at_miss)):
            counts[d, rank] += 1
    totals = counts.sum(axis=1, keepdims=True) + prior * (ranks + 1)
    table = np.divide(counts[:, :ranks] + prior, totals, out=np.zeros((depth, ranks)), where=totals > 0)
    return tuple(tuple(float(x) for x in row) for row in table)


class RecordRounds(BlockPolicy):
    """Run ``policy`` and keep every round's block with its root's position in the sequence, for
    :func:`fit_rank_acceptance`: replay a prompt with it (:func:`dflash_core.replay.replay`), then
    :meth:`rounds` pairs each block with the continuation after its root. It keeps every block (a round's logits
    over the draft vocabulary), so record a sample of prompts, not a benchmark's worth at once."""

    def __init__(self, policy: BlockPolicy) -> None:
        self.policy = policy
        self.name = f"record-{policy.name}"
        self.uses_draft, self.proposes_chains = policy.uses_draft, policy.proposes_chains
        self.blocks: list[tuple[DraftBlock, int]] = []

    def propose(self, block: DraftBlock | None, history: list[int]) -> DraftTree:
        if block is not None:
            self.blocks.append((block, len(history) - 1))
        return self.policy.propose(block, history)

    def observe(self, path: list[int]) -> None:
        self.policy.observe(path)

    def wants_draft(self, history: list[int]) -> bool:
        return self.policy.wants_draft(history)

    def rounds(self, ids) -> list[tuple[DraftBlock, list[int]]]:
        """(block, the tokens of ``ids`` after the block's root) per recorded round; ``ids``: the prompt followed by
        the target's greedy continuation, the sequence the rounds were replayed on."""
        tokens = torch.as_tensor(ids).reshape(-1).tolist()
        return [(block, tokens[at + 1:]) for block, at in self.blocks]
