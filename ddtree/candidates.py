"""The drafter's best tree (or chain) at a node cap, how far ``budget="auto"`` builds it, and which prefix it verifies.

:func:`cap_tree` is one function below both of its users: the policy (:mod:`ddtree.budget`) proposes a prefix of this
tree, and the cost measurement (:mod:`ddtree.cost`) times building it; the two must build the same tree, and neither
module has to import the other for it.

How far ``auto`` builds depends on its ``build`` (:class:`ddtree.budget.AutoBudget`). The default, ``"adaptive"``,
builds once at :func:`build_size` and chooses among that tree's prefixes: measured live (2-core AMD EPYC, bf16,
54 prompts) it matched the best fixed budget, where the ladder below rebuilt about one round in three and trailed
it by 5%. ``"exact"`` always chooses what the cap's tree would:

Building less than the cap without changing the choice. Both builders list nodes best first (path probabilities
non-increasing, ties in a fixed order), so the tree of B nodes is the first B nodes of the tree at the cap, and a
node's calibrated value depends on its own path probability and depth only (every calibration but ``edge``): the
values of a small build are the first values of the full one. :func:`settled_prefix` then decides from the small
build alone whether the full build could choose differently: every node left out has a path probability at most the
last built one's, so its value is at most a bound the calibration gives (:func:`ddtree.budget.value_bound`); if
even nodes of that value at every position up to the cap cannot beat the best prefix found, the full build chooses
the same prefix (the same size and nodes). Otherwise ``auto`` builds again at twice the size, and so on up to the cap
(:func:`build_ladder`), where the choice is always final.

How far to build first (:func:`build_size`). Building costs about the same per node as verifying a few more draft
tokens on a CPU (B=16's tree stage is ~0.3 ms over B=8's on the 2-core EPYC), so every node built past what settling
needs is waste, and a rebuild costs one more (smaller) build. Settling needs the build to reach a little past the
choice: the nodes just after it, whose values fall below the marginal cost, bound what is left out. So the first
build is ``BUILD_GROWTH`` (1.25) times a robust recent choice plus ``BUILD_MARGIN`` (2) nodes, at least
``BUILD_FLOOR`` (8): for choices of 8-12 nodes, 12-17 nodes. The robust choice is a high quantile
(``BUILD_QUANTILE``, 0.75: the 4th largest of the last ``BUILD_LOOKBACK`` = 16), not the largest: one confident
round would otherwise enlarge the next 16 builds (the rule before built twice the largest: ~28 nodes to choose
~9), while a round that wants more than the first build pays one rebuild at twice the size, which with a Markov head
reuses every children distribution of the first build (``cap_tree``'s ``width``: each build keeps as many children
per row as the next rung needs; top-k over the draft vocabulary costs about the same at k = 32 as at 16).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import numpy as np

from dflash_core.policy import Chain, DraftBlock
from dflash_core.tree import DraftTree

from .build import build_tree
from .conditioned import build_markov_tree

__all__ = ["BUILD_FLOOR", "BUILD_GROWTH", "BUILD_LADDER", "BUILD_LOOKBACK", "BUILD_MARGIN", "BUILD_QUANTILE",
           "best_prefix", "build_ladder", "build_size", "cap_tree", "settled_prefix", "truncate_tree"]

BUILD_FLOOR = 8  # nodes auto builds first at least (also before it has verified any round)
BUILD_GROWTH = 1.25  # ... else this many times the robust recent size
BUILD_MARGIN = 2  # ... plus these nodes,
BUILD_QUANTILE = 0.75  # the robust size: this quantile of the drafter nodes verified over the last
BUILD_LOOKBACK = 16  # rounds
BUILD_LADDER = 2  # a build that cannot settle the choice is followed by one this many times larger (up to the cap)
SLACK = 1e-9  # relative margin by which the left-out nodes must lose, so that float rounding cannot flip a choice


def cap_tree(block: DraftBlock, cap: int, chain: bool, history: list[int], width: int | None = None) -> DraftTree:
    """The best-first tree of ``cap`` nodes from the round's ``block`` (the top-1 chain of at most ``cap`` tokens
    when ``chain``), under the conditioned distribution when the drafter has a Markov head (``block.scorer``; it
    keeps ``width`` >= ``cap`` best children per distribution, for a larger build of the round to reuse)."""
    if chain:
        return Chain().propose(dataclasses.replace(block, logits=block.logits[:cap], _full=None), history)
    if block.scorer is not None:
        return build_markov_tree(block.scorer, cap, block.root, block.token_map, width)
    return build_tree(block.logits, cap, token_map=block.token_map)


def truncate_tree(tree: DraftTree, n: int) -> DraftTree:
    """The first ``n`` nodes of a best-first tree (a valid tree: every parent precedes its children)."""
    return DraftTree(tree.token_ids[:n], tree.parents[:n], tree.depths[:n], tree.log_probs[:n])


def _gain(path_probs: np.ndarray) -> np.ndarray:
    """Expected committed tokens of the prefixes N = 0..len(path_probs): 1 + sum_{i<=N} p_i."""
    return 1.0 + np.concatenate([[0.0], np.cumsum(np.asarray(path_probs, dtype=float))])


def _objective(gain: np.ndarray, seconds: np.ndarray, rate: float | None) -> np.ndarray:
    """What the rule maximizes for the prefixes of these gains (see :func:`best_prefix`)."""
    seconds = seconds[: len(gain)]
    return gain / seconds if rate is None else gain - rate * seconds


def best_prefix(path_probs: np.ndarray, cost, rate: float | None = None, seconds: np.ndarray | None = None) -> int:
    """The tree size N in 0..len(path_probs) to verify (smallest N on ties).

    ``rate=None`` (the ratio rule): argmax_N (1 + sum_{i<=N} p_i) / round_seconds(N), the best tokens per second of
    this round alone. ``rate`` = lambda > 0 (the marginal rule): argmax_N (1 + sum_{i<=N} p_i) - lambda *
    round_seconds(N), i.e. add nodes while each one's expected tokens pay for its cost at the run's long-run rate.
    The marginal rule maximizes the long-run rate (sum tokens / sum seconds over many rounds) when lambda is that
    rate (Dinkelbach): the ratio rule stops too early in confident rounds and too late in doubtful ones.
    ``cost``: the :class:`~ddtree.cost.CostModel` (its ``round_seconds``); ``seconds``: ``cost.round_seconds(0..M)``
    precomputed for some M >= len(path_probs) (saves the interpolation; ``cost`` is then not read).
    """
    if seconds is None:
        seconds = np.asarray(cost.round_seconds(np.arange(len(path_probs) + 1)), dtype=float)
    return int(np.argmax(_objective(_gain(path_probs), seconds, rate)))


def settled_prefix(values: np.ndarray, seconds: np.ndarray, rate: float | None, exact: int,
                   beyond: float) -> int | None:
    """:func:`best_prefix` of a list known only in part, or None when the unknown part could change it.

    ``values[:exact]`` are the complete list's first values; every later value of the complete list (at most
    ``len(seconds) - 1`` entries in all, the cap) is at most ``beyond``. The choice among the first ``exact`` sizes is
    the complete list's if no longer prefix can beat it even with every unknown value at ``beyond`` (by a relative
    ``SLACK``); the rule's objective of a size N > exact is then at most that of the known prefix plus
    ``(N - exact) * beyond`` in gain."""
    if not 0 <= exact <= min(len(values), len(seconds) - 1):
        raise ValueError(f"exact must be in 0..{min(len(values), len(seconds) - 1)}, got {exact}")
    gain = _gain(values[:exact])
    known = _objective(gain, seconds, rate)
    n = int(np.argmax(known))
    if exact == len(seconds) - 1:
        return n
    upper_gain = gain[-1] + beyond * np.arange(1, len(seconds) - exact)
    later = seconds[exact + 1:]
    upper = upper_gain / later if rate is None else upper_gain - rate * later
    return n if float(upper.max()) < known[n] - SLACK * max(1.0, abs(float(known[n]))) else None


def build_size(recent: Iterable[int], cap: int) -> int:
    """How many nodes to build first (module docstring): ``BUILD_GROWTH`` times the ``BUILD_QUANTILE`` quantile of
    the ``recent`` verified sizes (the value at that rank of the sorted list), rounded up, plus ``BUILD_MARGIN``; at
    least ``BUILD_FLOOR``, at most ``cap``."""
    sizes = sorted(recent)
    typical = sizes[min(len(sizes) - 1, int(BUILD_QUANTILE * len(sizes)))] if sizes else 0
    return min(cap, max(BUILD_FLOOR, math.ceil(BUILD_GROWTH * typical) + BUILD_MARGIN))


def build_ladder(first: int, cap: int) -> tuple[int, ...]:
    """The sizes a round builds until its choice settles: ``first``, ``BUILD_LADDER`` times that, and so on below
    ``cap``, then ``cap`` (where the choice is final)."""
    if first < 1 and cap > 0:
        raise ValueError(f"the first build must hold at least one node below a cap of {cap}, got {first}")
    sizes = []
    while first < cap:
        sizes.append(first)
        first *= BUILD_LADDER
    return tuple(sizes) + (cap,)
