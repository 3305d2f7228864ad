"""The best draft tree when each depth is drafted after its parent's token (a drafter with a Markov head).

A DFlash drafter with a Markov head (:mod:`dflash_core.markov`) gives, for a node u at depth d carrying token t, its
children's distribution q(. | t) at depth d+1: the block's logits of that depth plus a bias from t. Under this model
the probability that the target accepts a node's whole path is the product of the conditional probabilities along
it, and the expected number of accepted draft tokens of a tree is the sum of its nodes' path probabilities, as for
DDTree's factorized drafter. Only now a node's children depend on which token it carries.

Why best-first with lazy expansion gives the best tree of B nodes. A path's value (the sum of its conditional
log-probabilities) never increases down the path (every term is <= 0), so the B most valuable paths are prefix-closed:
with ties broken by depth, a node's parent always ranks before it, and so does every better sibling. The builder
keeps a heap of open candidates: for each node already in the tree, its best child not yet taken, and the next
sibling of each taken node. Every path outside the tree has an ancestor-or-self whose candidate (the parent's next
untaken child, which is at least as good as it) sits in the heap, and that candidate's value is >= the path's value.
So each pop takes the best path not yet in the tree, and after B pops the tree holds the B best paths. A popped node's
children distribution is computed when it is popped ("lazy expansion": at most B distributions, each over the
draft vocabulary), and only its ``budget - size`` best children are kept (a child ranked lower can never be reached:
its better siblings alone would fill the budget).

``build_conditioned_tree(logits, budget, bias, root)`` takes the per-depth logits and a function giving a node's
bias; :func:`build_markov_tree` takes a round's :class:`~dflash_core.markov.MarkovScorer`. Both return a
:class:`DraftTree` in best-first order (path log-probabilities non-increasing, parents before children). With a zero
bias the tree equals :func:`ddtree.build_tree`'s (same nodes; the order can differ only among exact ties).
"""

from __future__ import annotations

import heapq
from typing import Callable

import numpy as np
import torch

from dflash_core.tree import ROOT, DraftTree

__all__ = ["best_first_conditioned", "build_conditioned_tree", "build_markov_tree", "reference_conditioned_tree"]

# expand(depth, parent_token, k) -> (log-probs [<= k] float64, descending; their target token ids [<= k] int64)
Expander = Callable[[int, int, int], tuple[np.ndarray, np.ndarray]]


def top_children(row: np.ndarray, k: int, token_map: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best columns of a log-prob row, best first (ties: lower column first), as (log-probs, token ids);
    columns at -inf (outside the draft vocabulary) are dropped."""
    k = min(k, row.shape[0])
    cols = np.argpartition(-row, k - 1)[:k] if k < row.shape[0] else np.arange(row.shape[0])
    cols = cols[np.lexsort((cols, -row[cols]))]
    cols = cols[np.isfinite(row[cols])]
    return row[cols].astype(np.float64), (cols if token_map is None else token_map[cols])


def best_first_conditioned(expand: Expander, max_depth: int, budget: int, root: int) -> DraftTree:
    """The best tree of at most ``budget`` nodes and depth ``max_depth`` under a conditioned drafter (see the module
    docstring); ``expand(depth, parent_token, k)`` gives the k best children of a node carrying ``parent_token``
    (the root for depth 1)."""
    if budget <= 0 or max_depth <= 0:
        return DraftTree.empty()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    kids = {ROOT: expand(1, root, budget)}
    heap: list[tuple[float, int, int, int, int]] = []  # (-value, depth, counter, parent, rank among its children)
    if len(kids[ROOT][0]):
        heap.append((-float(kids[ROOT][0][0]), 1, 0, ROOT, 0))
    counter = 1
    while heap and len(tokens) < budget:
        neg, depth, _, parent, rank = heapq.heappop(heap)
        log_probs, ids = kids[parent]
        node = len(tokens)
        tokens.append(int(ids[rank]))
        parents.append(parent)
        depths.append(depth)
        scores.append(-neg)
        above = scores[parent] if parent != ROOT else 0.0
        if rank + 1 < len(log_probs):  # the next sibling
            heapq.heappush(heap, (-(above + float(log_probs[rank + 1])), depth, counter, parent, rank + 1))
            counter += 1
        if depth < max_depth and len(tokens) < budget:  # the node's own best child
            kids[node] = expand(depth + 1, tokens[node], budget - len(tokens))
            if len(kids[node][0]):
                heapq.heappush(heap, (neg - float(kids[node][0][0]), depth + 1, counter, node, 0))
                counter += 1
    return DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64),
                     torch.tensor(depths, dtype=torch.int64), torch.tensor(scores, dtype=torch.float64))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def build_conditioned_tree(logits: torch.Tensor, budget: int, bias: Callable[[int, int], object], root: int,
                           token_map: torch.Tensor | None = None) -> DraftTree:
    """The best ``budget``-node tree when depth d's distribution is ``softmax(logits[d-1] + bias(d, parent_token))``.

    ``logits`` [D, V'] (row d-1 = depth d; over the target vocabulary, or over a draft vocabulary whose column j is
    target token ``token_map[j]``); ``bias(depth, parent_token)`` returns a [V'] array or tensor for the children of
    a node carrying ``parent_token`` (a target id; the root ``root`` for depth 1).
    """
    base = logits.detach().float().cpu().numpy()
    ids = None if token_map is None else token_map.detach().cpu().numpy().astype(np.int64)

    def expand(depth: int, parent_token: int, k: int):
        b = bias(depth, parent_token)
        b = b.detach().float().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b, dtype=np.float32)
        return top_children(_log_softmax(base[depth - 1] + b), k, ids)

    return best_first_conditioned(expand, base.shape[0], int(budget), int(root))


PREFETCH_BELOW = 8  # budgets from here on batch the likely parents' children up front (MarkovScorer.prefetch)
PREFETCH_WIDTH = 1  # the guess: children of each depth's most likely token under the unconditioned logits,
PREFETCH_FLOOR = -8.0  # down to where that chain's log-probability falls below this (MarkovScorer.likely_parents)
WAVE = 8  # unknown distributions gathered per batched product


class _Growth:
    """The state of a best-first build over draft columns, resumable: nodes so far, the children rows of the nodes
    that have them, and the heap of candidates (the next untaken child of a node: -value, depth, counter, parent,
    rank). ``grow`` pops best-first; ``fork`` copies the state for a look-ahead (rows are shared, never written).
    ``need``: how many children a known row must hold to be used (min(budget, draft vocabulary)); a shorter one,
    left by an earlier, smaller build of the round, counts as unknown, so it is computed again at full width."""

    def __init__(self, root_row, budget: int, max_depth: int, need: int) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.scores: list[float] = []
        self.kids = {ROOT: root_row}
        self.heap = [(-float(root_row[0][0]), 1, 0, ROOT, 0)] if len(root_row[0]) and root_row[0][0] > -np.inf \
            else []
        self.counter, self.budget, self.max_depth, self.need = 1, budget, max_depth, need

    def fork(self) -> _Growth:
        other = object.__new__(_Growth)
        other.__dict__.update(self.__dict__)
        for name in ("tokens", "parents", "depths", "scores", "heap"):
            setattr(other, name, list(getattr(self, name)))
        other.kids = dict(self.kids)
        return other

    def grow(self, known: dict, wanted: list | None = None, wave: int = 0):
        """Pop best-first until the budget is spent. Exact (``wanted`` None): stop BEFORE taking a node whose
        children are not in ``known`` and return its key (depth, column). Look-ahead: take such a node as childless,
        note its key in ``wanted`` and stop at the ``wave``-th."""
        heap, kids, tokens, scores = self.heap, self.kids, self.tokens, self.scores
        while heap and len(tokens) < self.budget:
            neg, depth, _, parent, rank = heap[0]
            log_probs, columns = kids[parent]
            column = int(columns[rank])
            row = None
            if depth < self.max_depth and len(tokens) + 1 < self.budget:  # the node will want its children
                row = known.get((depth + 1, column))
                if row is None or len(row[0]) < self.need:
                    row = None
                    if wanted is None:
                        return depth + 1, column
                    wanted.append((depth + 1, column))
                    if len(wanted) >= wave:
                        return None
            heapq.heappop(heap)
            node = len(tokens)
            tokens.append(column)
            self.parents.append(parent)
            self.depths.append(depth)
            scores.append(-neg)
            if rank + 1 < len(log_probs) and log_probs[rank + 1] > -np.inf:  # the next sibling
                above = scores[parent] if parent != ROOT else 0.0
                heapq.heappush(heap, (-(above + float(log_probs[rank + 1])), depth, self.counter, parent, rank + 1))
                self.counter += 1
            if row is not None:
                kids[node] = row
                if len(row[0]) and row[0][0] > -np.inf:  # the node's own best child
                    heapq.heappush(heap, (neg - float(row[0][0]), depth + 1, self.counter, node, 0))
                    self.counter += 1
        return None


def build_markov_tree(scorer, budget: int, root: int, token_map: torch.Tensor | None = None,
                      width: int | None = None) -> DraftTree:
    """The best ``budget``-node tree of a round's :class:`~dflash_core.markov.MarkovScorer` (the loop's path).

    The lazy best-first builder of the module docstring, with the head's products batched instead of one per node
    (each product call has a fixed cost of a few rows; see :meth:`~dflash_core.markov.MarkovScorer.fill`). The
    build runs exactly until the next node to take needs children that are not known yet; from there a look-ahead
    on a copy of the state takes unknown nodes as childless and notes the first ``WAVE`` of them (in pop order, so
    the most valuable: the ones the exact build is about to want); all are computed in ONE batched product and the
    exact build resumes. The look-ahead only chooses what to compute, never what is taken, so the tree is exactly
    the lazy builder's (a node keeps all ``budget`` best children computed, not ``budget - size``: the extra ones
    could only be taken after their better siblings, which alone would overrun the budget). From 8 nodes on, the
    first batch also holds the children of each depth's most likely token under the unconditioned logits, down to
    where that chain's log-probability falls below ``PREFETCH_FLOOR``
    (:meth:`~dflash_core.markov.MarkovScorer.likely_parents`): the chain most trees grow along. On the shipped
    drafter's rounds at 32 nodes this computes ~27 distributions in ~4.4 batches, for ~25 the tree needs (before:
    ~67 distributions, 56 of them guessed). The builder works on draft columns (the head's keys) and maps them to
    target ids once, at the end.

    ``width`` (default and at least ``budget``): how many best children each distribution computed here keeps, so
    that a later, larger build of the same round (``auto``'s rebuild, :mod:`ddtree.candidates`) up to ``width`` nodes
    reuses every row (the scorer keeps them). A row held with fewer than min(``budget``, draft vocabulary) children
    is computed again: it could cut a node's children short. Wider rows never change the tree (see above)."""
    budget = int(budget)
    width = budget if width is None else max(budget, int(width))
    if budget <= 0 or scorer.depth <= 0:
        return DraftTree.empty()
    first = (1, int(scorer.index(root)))
    guess = scorer.likely_parents(PREFETCH_WIDTH, PREFETCH_FLOOR) if budget >= PREFETCH_BELOW and scorer.depth > 1 \
        else []
    need = min(budget, scorer.base.shape[1])
    known = scorer.known
    scorer.fill([key for key in [first] + guess if key not in known or len(known[key][0]) < need], width)
    growth = _Growth(known[first], budget, scorer.depth, need)
    while growth.grow(known) is not None:
        wanted: list[tuple[int, int]] = []  # the look-ahead's first pop is the node the exact build stopped at
        growth.fork().grow(known, wanted, WAVE)
        scorer.fill(wanted, width)  # unknown or too short for this budget: computed at the full width
    columns = torch.tensor(growth.tokens, dtype=torch.int64)
    return DraftTree(columns if token_map is None else token_map.detach().cpu().to(torch.int64)[columns],
                     torch.tensor(growth.parents, dtype=torch.int64), torch.tensor(growth.depths, dtype=torch.int64),
                     torch.tensor(growth.scores, dtype=torch.float64))


def reference_conditioned_tree(logits: torch.Tensor, budget: int, bias: Callable[[int, int], object],
                               root: int) -> dict[tuple[int, ...], float]:
    """Brute force for tiny cases: every token sequence of every depth scored under the conditioned model, the
    ``budget`` best kept (ties by depth). Returns {path (token ids from depth 1): path log-probability}."""
    base = logits.detach().double().cpu().numpy()
    paths: dict[tuple[int, ...], float] = {}
    frontier = {(): (0.0, root)}
    for depth in range(1, base.shape[0] + 1):
        grown = {}
        for path, (value, last) in frontier.items():
            b = bias(depth, last)
            b = b.detach().double().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b, dtype=np.float64)
            row = _log_softmax(base[depth - 1] + b)
            for token in range(row.shape[0]):
                grown[path + (token,)] = (value + float(row[token]), token)
        paths.update({p: v for p, (v, _) in grown.items()})
        frontier = grown
    best = sorted(paths.items(), key=lambda kv: (-kv[1], len(kv[0])))[:budget]
    return dict(best)
