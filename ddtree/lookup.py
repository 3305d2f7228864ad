"""Lookup branches in the draft tree: the context's n-gram continuation and the drafter's prefixes under ONE budget.

Each round two sources propose token paths below the root:

* the drafter: every prefix ``u`` with its path probability ``q(u)`` under the factorized draft distribution (what
  :func:`ddtree.build_tree` ranks);
* the context (:class:`dflash_core.prompt_lookup.NgramIndex`): the continuation ``c_1 .. c_m`` of the longest earlier
  match of the committed suffix, of match length ``n``; its node at depth ``k`` gets the estimate ``a_n(k)``, the
  probability that the target accepts the continuation through depth ``k``, learned online: ``a_n(k) =
  prod_{j <= k} p_n(j)`` with ``p_n(j)`` the share of rounds (match length ``n``) whose walk, having accepted the
  continuation through depth ``j - 1``, also accepted depth ``j``. Depth 1 (does the match continue at all) has a
  Beta(1, 1) prior; a deeper cell is shrunk towards its match length's pooled rate over all depths >= 2 (``PRIOR``
  pseudo-trials), so a depth the rounds have rarely reached is priced like the depths they have. The pooled rate is
  a Beta(1, 1) posterior, H hits in T trials, and at depth ``j`` it takes its posterior predictive given that
  depths 2 .. j - 1 were accepted on this path, ``(H + 1 + (j - 2)) / (T + 2 + (j - 2))``: with the rate unknown, a
  continuation accepted this far is evidence that the rate is high. A product of means, ``E[p] ** k``, undervalues
  deep nodes whenever the rate is uncertain (``E[p ** k]`` is larger: 1 / (k + 1) against 2 ** -k before any
  round), so a fresh call used to verify a few tokens of a continuation that runs for ten.

The continuation needs no drafter row: it runs past the drafter's block (``num_tokens``, default 32, against a
16-position block whose tree is at most 15 deep) wherever the context continues, and ``auto`` decides with its cost
curve how much of it a round verifies, drafter or not.

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

What the branches learnt (the counts above and the skip rule's round timings, :class:`LookupStats`) lives in the
``auto`` policy's :class:`~ddtree.budget.RoundMemory` when there is one, so it carries from call to call like ``auto``'s
calibration: a fresh call on copy-heavy text verifies the continuation a previous call found reliable instead of
learning it again over the three to eight rounds of a short answer. A call begins with the carried counts of each
match length weighed as at most ``LookupStats.CARRY`` rounds, so the rounds of the call at hand soon outweigh them.

**Where a fresh memory starts.** Not from nothing: ``lookup_prior.json`` holds what continuations did in the target's
own answers to the drafter's training prompts (the training-response shards shipped with the embedded drafter; no
benchmark prompt among them), walked as prompt lookup walks them (``python -m experiments.studies.lookup_prior``
rebuilds it). There a continuation's first token held for 24% of one-token matches and 73% of three-token ones, and
deeper tokens held for 55-94%, rising with depth, where the flat priors say 1/2 for every match length. A fresh call
therefore verifies more of a three-token match's continuation and less of a one-token match's than it did, and its
own rounds still outweigh the prior after a few rounds (it weighs as ``CARRY`` rounds).
"""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path

import numpy as np
import torch

from dflash_core.prompt_lookup import NgramIndex
from dflash_core.tree import ROOT, BlockPolicy, DraftBlock, DraftTree

from .budget import AutoBudget
from .build import best_tree

__all__ = ["LookupStats", "LookupTreePolicy", "merge_lookup"]


def merge_lookup(tree: DraftTree, continuation: list[int], estimates: list[float], budget: int,
                 values: np.ndarray | None = None) -> tuple[DraftTree, list[int], list[int]]:
    """The ``budget`` best nodes of the union of ``tree`` and the chain ``continuation``.

    ``values``: the drafter nodes' values (default exp(log_probs); ``auto`` passes its calibrated acceptance
    probabilities), clipped to their parent's so that a child never outranks its parent; ``estimates``: the
    continuation's (non-increasing). Returns the merged tree (log_probs = log of the values), per continuation depth
    that made it into the tree the node index carrying it, and per merged node the index of the drafter node it came
    from (-1: a lookup node only)."""
    nodes: dict[tuple[int, ...], float] = {}
    origin: dict[tuple[int, ...], int] = {}
    paths: list[tuple[int, ...]] = []
    drafter = np.exp(tree.log_probs.double().numpy()) if values is None else np.asarray(values, dtype=float)
    for i in range(len(tree)):  # the drafter's nodes; parents come first, so their paths are known
        parent = int(tree.parents[i])
        path = (paths[parent] if parent != ROOT else ()) + (int(tree.token_ids[i]),)
        paths.append(path)
        nodes[path] = min(float(drafter[i]), nodes[paths[parent]]) if parent != ROOT else float(drafter[i])
        origin[path] = i
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
    placed = [index[chain[:k]] for k in range(1, len(estimates) + 1) if chain[:k] in index]
    return merged, placed, [origin.get(p, -1) for p in chosen]


class LookupStats:
    """What a :class:`LookupTreePolicy` learnt (module docstring): ``counts[n, k]`` = [rounds that accepted depth
    ``k`` of a match-length-``n`` continuation having accepted depth ``k - 1``, rounds that tried depth ``k``], and the
    skip rule's timings: ``timed[False]`` / ``timed[True]`` the (duration, committed tokens) of the last ``WINDOW``
    rounds with / without the drafter, durations in multiples of the ``auto`` curve's ``verify(0)`` (seconds under a
    fixed budget), so that rounds timed at other context lengths compare. Held by an ``auto`` policy's
    :class:`~ddtree.budget.RoundMemory` (``memory.lookup``), it carries over from one call to the next. New
    statistics start from the corpus prior (``prior=True``, :meth:`corpus_counts`) weighed as ``CARRY`` rounds per
    match length, as if carried from earlier calls; ``prior=False``: from nothing (the flat Beta priors alone).
    ``seeded``: the prior's share of ``counts``, weighed down with them as real rounds accumulate."""

    CARRY = 8  # rounds of depth 1 per match length that earlier calls weigh as, at most, when a call begins
    WINDOW = 64  # rounds of each kind the skip rule's rates are taken over
    PRIOR_FILE = Path(__file__).with_name("lookup_prior.json")  # python -m experiments.studies.lookup_prior

    def __init__(self, max_ngram: int, num_tokens: int, prior: bool = True) -> None:
        self.counts, self.prior = np.zeros((max_ngram + 1, num_tokens + 1, 2)), prior
        if prior:
            self.counts += self.corpus_counts(max_ngram, num_tokens)
        self.seeded = self.counts.copy()  # the prior's share of ``counts`` (weighed with them)
        self.begin_call()  # (sets ``_base``: the counts when the call began; what the call learnt is the difference)
        self.timed: dict[bool, deque] = {False: deque(maxlen=self.WINDOW), True: deque(maxlen=self.WINDOW)}

    @classmethod
    def corpus_counts(cls, max_ngram: int, num_tokens: int) -> np.ndarray:
        """The counts ``PRIOR_FILE`` holds (the module docstring: what continuations did in the target's answers to
        the drafter's training prompts), in this shape: a depth the file does not reach stays empty (priced by the
        pooled rate), and a match length above the file's takes the file's longest (a longer match is at least as
        reliable)."""
        try:
            table = np.asarray(json.loads(cls.PRIOR_FILE.read_text(encoding="utf-8"))["counts"], dtype=float)
        except (OSError, ValueError, KeyError) as e:
            raise FileNotFoundError(f"the lookup branches' corpus prior {cls.PRIOR_FILE} is missing or unreadable "
                                    f"({e}): reinstall the toolkit, rebuild it with `python -m "
                                    "experiments.studies.lookup_prior`, or pass prior=False") from e
        out = np.zeros((max_ngram + 1, num_tokens + 1, 2))
        depths = min(num_tokens, table.shape[1] - 1) + 1
        for n in range(1, max_ngram + 1):
            out[n, :depths] = table[min(n, table.shape[0] - 1), :depths]
        return out

    @classmethod
    def held_by(cls, memory, max_ngram: int, num_tokens: int, prior: bool = True) -> "LookupStats":
        """The statistics ``memory`` holds (new ones on first use, from the corpus prior unless ``prior`` is False;
        ``memory`` None: new ones held by none), weighed for a call that begins now (class docstring)."""
        shape = (max_ngram + 1, num_tokens + 1, 2)
        stats = getattr(memory, "lookup", None)
        if stats is None:
            stats = cls(max_ngram, num_tokens, prior)
            if memory is not None:
                memory.lookup = stats
        elif stats.counts.shape != shape:
            raise ValueError(f"this memory learnt lookup branches with max_ngram={stats.counts.shape[0] - 1} and "
                             f"num_tokens={stats.counts.shape[1] - 1}, not {max_ngram} and {num_tokens}: give each "
                             "lookup setting a RoundMemory of its own")
        stats.begin_call()
        return stats

    def begin_call(self) -> None:
        """Weigh each match length's counts as at most ``CARRY`` rounds of depth 1 (the proportions stay)."""
        tried = self.counts[:, 1, 1]
        scale = np.minimum(1.0, self.CARRY / np.maximum(tried, 1e-12))
        self.counts *= scale[:, None, None]
        self.seeded *= scale[:, None, None]
        self._base = self.counts.copy()

    def add_to(self, memory) -> None:
        """Add what these statistics learnt since their call began to ``memory``'s (a fork's to the memory it was
        forked from: :meth:`~ddtree.budget.RoundMemory.absorb`); a batch times no rounds, so no timings go."""
        if memory.lookup is None:
            memory.lookup = type(self)(self.counts.shape[0] - 1, self.counts.shape[1] - 1, self.prior)
        memory.lookup.counts += self.counts - self._base

    def record(self, n: int, verified: int, accepted: int) -> None:
        """One round's walk along a match-length-``n`` continuation of which the first ``verified`` depths were
        verified: the target accepted it through depth ``accepted``. The depths tried are the accepted ones and the
        first miss (a depth below a miss was never put to the test)."""
        tried = min(verified, accepted + 1)
        self.counts[n, 1:tried + 1, 1] += 1
        self.counts[n, 1:min(accepted, tried) + 1, 0] += 1


class LookupTreePolicy(BlockPolicy):
    """Proposal policy: the DDTree with the context's continuation merged in (module docstring), under a fixed node
    ``budget`` (an int) or sized per round by an :class:`~ddtree.budget.AutoBudget` (``budget=AutoBudget(...)``):
    ``auto`` then ranks its calibrated drafter nodes and the lookup nodes together and chooses how many of the
    merged best-first list to verify with its cost curve; it learns its calibration from the drafter's nodes only
    (so its memory belongs to lookup rounds: do not share it with a plain ``auto``).

    ``lookup_committed``: per round, how many committed tokens were lookup nodes. ``stats``: what the branches
    learnt (:class:`LookupStats`), the ``auto`` policy's memory's (``budget.memory.lookup``) under ``auto``, so it
    carries over to the next call that policy's memory is given to; the policy's own otherwise. ``prior``: whether
    statistics made new here start from the corpus prior (:class:`LookupStats`).

    Skipping the drafter (``clock``, e.g. ``time.perf_counter``; what ``ddtree_generate(lookup=True)`` passes): the
    policy times its rounds (the clock between consecutive :meth:`wants_draft` calls spans one whole round) and keeps
    the committed tokens per second of rounds with the drafter and the seconds of rounds without it. A round whose
    continuation promises more, 1 + sum_k a_n(k) tokens in a round without the drafter pass, than the drafted
    rounds deliver per second, skips the pass and verifies the continuation alone. The promise is taken from the
    rounds the memory saw, not from the corpus prior: a prior fit to many kinds of text may set the tree's
    composition, where a node costs a fraction of a round, but not forgo the drafter's tokens for a whole round. Until
    rounds without the drafter were timed, their cost is taken as ``SKIP_PRIOR`` of a drafted round's; the timings
    are the ``stats``', so they too carry over from earlier calls. Without a clock every round drafts (replayable).
    Whatever is skipped, the output is the target's: only which positions are verified changes.
    ``skipped``: per round, whether the drafter was skipped.
    """

    uses_draft = True
    SKIP_PRIOR = 0.85  # a round without the drafter pass, relative to one with it, before any was timed
    SKIP_WARMUP = 4  # drafted rounds timed before a round may skip the drafter
    PRIOR = 2.0  # pseudo-trials at the pooled rate of a continuation depth >= 2 (module docstring)

    def __init__(self, budget: int | AutoBudget, max_ngram: int = 3, num_tokens: int = 32,
                 clock=None, prior: bool = True) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.auto = budget if isinstance(budget, AutoBudget) else None
        if self.auto is not None and self.auto.chain:
            raise ValueError("lookup branches join trees: use budget='auto', not 'chain-auto'")
        self.budget = self.auto.cap if self.auto is not None else int(budget)
        self.max_ngram, self.num_tokens = max_ngram, num_tokens
        self.name = "lookup-auto" if self.auto is not None else f"lookup-tree-{budget}"
        self.index = NgramIndex(max_ngram)
        self.stats = LookupStats.held_by(self.auto.memory if self.auto is not None else None, max_ngram, num_tokens,
                                         prior)
        self.counts = self.stats.counts  # [n, k]: [accepted given depth k - 1 accepted, trials] (LookupStats)
        self._round: tuple[int, list[int]] | None = None  # (match length, node index per continuation depth)
        self._drafter_nodes: dict[int, int] | None = None  # auto: merged node -> position among the drafter's
        self.lookup_committed: list[int] = []
        self.clock, self.skipped = clock, []
        self._timed = self.stats.timed
        self._open: tuple[float, int, bool] | None = None  # (clock, history length, skipped) of the round in flight
        self._lookup: tuple[int, list[int], list[float]] | None = None  # this round's match, from wants_draft

    def wants_draft(self, history: list[int]) -> bool:
        """Whether this round runs the drafter (the loop asks before the draft step; see the class docstring)."""
        now = self.clock() if self.clock is not None else None
        if self._open is not None and now is not None and len(history) > self._open[1]:
            began, length, skipped = self._open  # the previous round: its seconds and committed tokens
            unit = float(self.auto.curve.verify(0)) if self.auto is not None else 1.0  # (LookupStats)
            self._timed[skipped].append(((now - began) / unit, len(history) - length))
        self._lookup = self._match(history)
        n, continuation, _ = self._lookup
        skip = now is not None and bool(continuation) and self._skip_pays(self.estimates(n, len(continuation), True))
        self._open = (now, len(history), skip) if now is not None else None
        return not skip

    def _match(self, history: list[int]) -> tuple[int, list[int], list[float]]:
        self.index.follow(history)
        n, continuation = self.index.continuation(self.num_tokens)
        return n, continuation, self.estimates(n, len(continuation)) if n and continuation else []

    def _alone(self, estimates: list[float]) -> int:
        """How much of the continuation a round without the drafter verifies: all of it within the budget; under
        ``auto``, the prefix its cost curve prices best (the same rule as for a tree)."""
        m = min(len(estimates), self.budget)
        return self.auto.choose(np.asarray(estimates[:m])) if self.auto is not None and m else m

    def _skip_pays(self, estimates: list[float]) -> bool:
        drafted = self._timed[False]
        if not estimates or len(drafted) < self.SKIP_WARMUP:
            return False
        seconds = sum(s for s, _ in drafted)
        rate = sum(t for _, t in drafted) / max(seconds, 1e-12)  # committed tokens per second with the drafter
        alone = self._timed[True]
        round_s = (sorted(s for s, _ in alone)[len(alone) // 2] if alone
                   else self.SKIP_PRIOR * seconds / len(drafted))
        return (1.0 + sum(estimates[: self._alone(estimates)])) / max(round_s, 1e-12) > rate

    @property
    def calibration_s(self) -> float:
        return self.auto.calibration_s if self.auto is not None else 0.0

    def estimates(self, n: int, m: int, seen_only: bool = False) -> list[float]:
        """a_n(1..m): the learned probability that the target accepts a match-length-n continuation through depth k
        (the module docstring: depth 1 on its own, deeper cells shrunk towards the pooled rate's predictive).
        ``seen_only``: from the rounds this memory saw, without the corpus prior (what the skip rule decides on)."""
        cells = self.counts[n] - self.stats.seeded[n] if seen_only else self.counts[n]
        hits, trials = cells[2:].sum(axis=0)
        out, a = [], 1.0
        for k in range(1, m + 1):
            h, t = cells[k]
            if k == 1:
                a *= (h + 1) / (t + 2)
            else:  # the pooled rate's predictive, depths 2 .. k - 1 accepted on this path
                pooled = (hits + 1 + k - 2) / (trials + 2 + k - 2)
                a *= (h + self.PRIOR * pooled) / (t + self.PRIOR)
            out.append(float(a))
        return out

    def propose(self, block: DraftBlock | None, history: list[int]) -> DraftTree:
        """The round's tree: the drafter's (conditioned when it has a Markov head) with the continuation merged in;
        ``block`` None (the drafter skipped): the continuation alone."""
        n, continuation, estimates = self._lookup if self._lookup is not None else self._match(history)
        self._lookup = None
        self.skipped.append(block is None)
        if block is None:  # the drafter was skipped: the continuation alone (values: its estimates)
            m = self._alone(estimates) if estimates else min(len(continuation), self.budget)
            self._drafter_nodes, self._round = {}, ((n, list(range(m))) if m else None)
            log_p = [math.log(max(a, 1e-300)) for a in estimates[:m]]
            return DraftTree(torch.tensor(continuation[:m], dtype=torch.long), torch.arange(-1, m - 1),
                             torch.arange(1, m + 1), torch.tensor(log_p, dtype=torch.float64))
        if self.auto is not None:
            return self._propose_auto(block, history, n, continuation, estimates)
        tree = best_tree(block, self.budget)
        if not estimates or self.budget == 0:
            self._round = None
            return tree
        merged, placed, _ = merge_lookup(tree, continuation, estimates, self.budget)
        self._round = (n, placed)
        return merged

    def _propose_auto(self, block, history, n, continuation, estimates) -> DraftTree:
        auto = self.auto
        now = auto.start_round(history)
        drafted, probs = auto.drafter_tree(block, auto.next_build_size())
        merged, placed, origin = merge_lookup(drafted, continuation, estimates, auto.cap, values=probs)
        size = auto.choose(np.exp(merged.log_probs.numpy()))
        # the drafter's nodes among those verified (a lookup node that a larger build would hold too, deep down,
        # counts as the lookup's)
        kept = [o for o in origin[:size] if o >= 0]
        self._drafter_nodes = {i: j for j, i in enumerate(i for i in range(size) if origin[i] >= 0)}
        auto.hold_proposal(drafted.log_probs.double().numpy()[kept], drafted.depths.numpy()[kept], size, now,
                           len(history))
        leading = 0
        while leading < len(placed) and placed[leading] < size:  # the continuation's nodes that stay (a prefix)
            leading += 1
        self._round = (n, placed[:leading]) if leading else None
        return merged.prefix(size)

    def observe(self, path: list[int]) -> None:
        """Learn from the walk: how deep along the continuation's nodes the accepted path went (and, under
        ``auto``, which of the drafter's nodes were accepted)."""
        if self.auto is not None and not self.skipped[-1]:  # auto learns from the rounds it sized
            mine = [self._drafter_nodes[i] for i in path if i in self._drafter_nodes]
            self.auto.store_round(len(path), mine)
        if self._round is None:
            self.lookup_committed.append(0)
            return
        n, placed = self._round
        on_path = set(path)
        depth = 0
        while depth < len(placed) and placed[depth] in on_path:
            depth += 1
        self.stats.record(n, len(placed), depth)
        self.lookup_committed.append(depth)
