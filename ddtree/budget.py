"""Hardware-aware tree size per round (``budget="auto"``, and ``"chain-auto"`` for DFlash chains).

The best-first tree lists nodes in order of decreasing path probability, and every prefix of that order is itself a
valid (prefix-closed) tree. Verifying the first N nodes commits on average ``1 + sum_{i<=N} a_i`` tokens, a_i the
probability that node i's whole path is accepted, and costs ``round_seconds(N)`` under the machine's cost curve
(:mod:`ddtree.cost`: measured once per machine and context bucket, then corrected online from the loop's own round
timings).

Each round :class:`AutoBudget` keeps the prefix of the tree at a cap that maximizes

* the marginal rule (default): ``1 + sum a_i - rate * seconds(N)``, rate = committed tokens per modeled second over
  the rounds it remembers. This maximizes the long-run rate sum(tokens) / sum(seconds) (Dinkelbach's fixed point of
  the renewal-reward ratio): confident rounds get larger trees and doubtful ones smaller than under
* the ratio rule: ``(1 + sum a_i) / seconds(N)``, the best tokens per second of the round alone.

The a_i are the drafter's path probabilities calibrated online against what the target accepted (default
``depth``: one factor per depth; ``edge``: a reliability curve of the drafter's conditional probabilities, one
Bernoulli trial per edge whose parent was accepted, multiplied along each path; ``power``: p ** beta; ``bucket``: a
reliability histogram over log p; ``none``: the drafter's own numbers), see :func:`calibrated_probs`.
``build`` (:mod:`ddtree.candidates`): ``"adaptive"`` (default) builds once, 1.25 x a high quantile of the recent
verified sizes + 2, and chooses among that tree's prefixes (choices that fill it raise the next builds; building
several times the chosen size made ``auto`` lose live to the best fixed budget). ``"exact"`` always gives the cap's choice: it builds twice as many nodes (up to the cap) while
:func:`~ddtree.candidates.settled_prefix` cannot rule out that a left-out node would change it. ``"cap"`` builds the
cap's tree every round, as ``edge`` calibration always does (a node's value there depends on its siblings).
``python -m experiments.studies.auto_budget_study`` compares rules, calibrations and fixed budgets by offline replay
under several cost curves; ``python -m experiments.studies.auto_oracle_study`` judges them against the per-dataset
oracle as the benchmark does. Neither the rule, the calibration nor the cost curve ever changes the output.

What a policy learns, and how to make runs reproducible. :meth:`AutoBudget.for_models` (what ``budget="auto"``
builds) times its own rounds (``online=True``) and, with ``share_memory=True``, continues the round memory and the
online cost curve of earlier generations with the same models in this process, so a new prompt starts calibrated.
Tree sizes then depend on earlier prompts and on the machine's timing noise (the output never does). For
reproducible tree sizes pass ``share_memory=False, online=False``, e.g.
``ddtree_generate(..., policy=make_policy("auto", target, draft, share_memory=False, online=False))``;
:func:`forget_shared_memory` drops everything shared so far. What is shared is keyed by the policy's configuration
(temperature, cap, rule, kind, calibration, window, build, batch size, and a ``variant`` such as lookup merging, see
:meth:`AutoBudget.share_as`) and the models' identity (:func:`model_identity`, never an ``id()``); no clock is read
unless one is given (``clock=time.perf_counter``): such a policy is replayable.
"""

from __future__ import annotations

import itertools
import math
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from dflash_core.policy import BlockPolicy, DraftBlock, as_block
from dflash_core.tree import DraftTree

from .candidates import (BUILD_LADDER, BUILD_LOOKBACK, best_prefix, build_ladder, build_size, cap_tree,
                         settled_prefix, truncate_tree)
from .cost import CostModel, OnlineCost, context_bucket, default_cap, measure_cost_model
from .edges import EDGE_EDGES, edge_log_q, edge_probs

__all__ = ["AutoBudget", "Round", "RoundMemory", "CALIBRATIONS", "RULES", "calibrated_probs", "value_bound",
           "best_prefix", "truncate_tree", "forget_shared_memory", "model_identity"]


@dataclass(frozen=True)
class Round:
    """What one verified round tells the policy: the drafter's path log-probabilities and depths of the verified
    nodes, which of them the target accepted, and the round's modeled seconds."""

    log_p: np.ndarray  # [n] float64
    depths: np.ndarray  # [n] int
    accepted: np.ndarray  # [n] bool: node on the accepted path
    seconds: float
    parents: np.ndarray | None = None  # [n] int, -1 for the root's children (None: unknown, no edge statistics)

    @property
    def tokens(self) -> int:
        """Tokens the round committed: the accepted draft tokens and the bonus."""
        return int(self.accepted.sum()) + 1


CALIBRATIONS = ("none", "power", "depth", "bucket", "edge")
RULES = ("marginal", "ratio")
BUILDS = ("adaptive", "exact", "cap")  # how far AutoBudget builds each round (module docstring)
DEFAULT_CALIBRATION = "depth"
_BUCKET_EDGES = np.array([-6.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.7, -0.4, -0.2, -0.1])  # on log p
_MAX_DEPTH = 64


class RoundMemory:
    """The last ``window`` rounds with running totals (tokens, modeled seconds, per-depth and per-bucket counts),
    so a policy reads its rate and calibration in O(depths + buckets) per round."""

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.rounds: deque[Round] = deque()
        self.tokens, self.seconds = 0, 0.0
        self.depth_pred, self.depth_obs = np.zeros(_MAX_DEPTH + 1), np.zeros(_MAX_DEPTH + 1)
        self.depth_nodes = np.zeros(_MAX_DEPTH + 1, dtype=np.int64)
        self.bucket_nodes = np.zeros(len(_BUCKET_EDGES) + 1, dtype=np.int64)
        self.bucket_hits = np.zeros(len(_BUCKET_EDGES) + 1)
        self.edge_q, self.edge_hits = np.zeros(len(EDGE_EDGES) + 1), np.zeros(len(EDGE_EDGES) + 1)
        self.edge_nodes = np.zeros(len(EDGE_EDGES) + 1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rounds)

    def __iter__(self):
        return iter(self.rounds)

    def _add(self, r: Round, sign: int) -> None:
        self.tokens += sign * r.tokens
        self.seconds += sign * r.seconds
        depths = np.minimum(r.depths.astype(int), _MAX_DEPTH)
        self.depth_pred += sign * np.bincount(depths, weights=np.exp(r.log_p), minlength=_MAX_DEPTH + 1)
        self.depth_obs += sign * np.bincount(depths, weights=r.accepted.astype(float), minlength=_MAX_DEPTH + 1)
        self.depth_nodes += sign * np.bincount(depths, minlength=_MAX_DEPTH + 1)
        which = np.searchsorted(_BUCKET_EDGES, r.log_p)
        self.bucket_nodes += sign * np.bincount(which, minlength=len(_BUCKET_EDGES) + 1)
        self.bucket_hits += sign * np.bincount(which, weights=r.accepted.astype(float),
                                               minlength=len(_BUCKET_EDGES) + 1)
        if r.parents is not None and len(r.parents):
            self._add_edges(r, sign)

    def _add_edges(self, r: Round, sign: int) -> None:
        """Count the edges the round tested: a node is tested when its parent was accepted (the root always is),
        and then accepted with a probability that depends on its conditional probability only."""
        parents = np.asarray(r.parents, dtype=int)
        tested = np.where(parents >= 0, r.accepted[np.maximum(parents, 0)], True)
        log_q = edge_log_q(r.log_p, parents)[tested]
        which = np.searchsorted(EDGE_EDGES, log_q)
        size = len(EDGE_EDGES) + 1
        self.edge_q += sign * np.bincount(which, weights=np.exp(log_q), minlength=size)
        self.edge_hits += sign * np.bincount(which, weights=r.accepted[tested].astype(float), minlength=size)
        self.edge_nodes += sign * np.bincount(which, minlength=size)

    def append(self, r: Round) -> None:
        self.rounds.append(r)
        self._add(r, +1)
        if len(self.rounds) > self.window:
            self._add(self.rounds.popleft(), -1)

    @classmethod
    def of(cls, rounds) -> "RoundMemory":
        if isinstance(rounds, RoundMemory):
            return rounds
        memory = cls(max(1, len(rounds)))
        for r in rounds:
            memory.append(r)
        return memory


def calibrated_probs(log_p: np.ndarray, depths: np.ndarray, rounds, method: str, prior: float = 2.0,
                     parents: np.ndarray | None = None) -> np.ndarray:
    """The acceptance probability of each node (path log-prob ``log_p``, depth ``depths``) learnt from ``rounds``
    (a :class:`RoundMemory` or a sequence of :class:`Round`).

    * ``none``   -- the drafter's own path probability;
    * ``power``  -- p ** beta, one exponent for all nodes with sum p ** beta = accepted tokens over ``rounds``;
    * ``depth``  -- f_d * p per depth d, f_d = (accepted at d + prior) / (sum of p at d + prior): the drafter's
      over- or under-confidence may grow with depth (depths beyond those seen take the deepest seen factor);
    * ``bucket`` -- per bucket of log p, the observed acceptance rate shrunk toward p:
      (accepted in bucket + prior * p) / (nodes in bucket + prior) (a histogram / reliability-diagram fit);
    * ``edge``   -- per edge: a node whose parent is accepted is accepted with probability g(q), q its conditional
      probability given the parent, g(q) = F_b * q with F_b = (accepted + prior) / (sum of q + prior) over the
      tested edges in q's bucket b; a node's acceptance is the product of g along its path (needs ``parents``;
      without them, or before any edge was seen, ``depth``). See :func:`edge_probs` for why.

    A node counts as accepted when it lies on the path the target accepted, so its probability is that of its whole
    path: exactly the quantity the expected committed tokens ``1 + sum p_i`` add up.
    """
    p = np.exp(log_p)
    if method not in CALIBRATIONS:
        raise ValueError(f"unknown calibration {method!r}: use one of {CALIBRATIONS}")
    if method == "none" or not len(rounds):
        return p
    if method == "power":
        return np.exp(_fit_beta([(r.log_p, int(r.accepted.sum())) for r in rounds]) * log_p)
    memory = RoundMemory.of(rounds)
    if method == "edge" and parents is not None and memory.edge_nodes.sum() > 0:
        return edge_probs(log_p, depths, parents, memory, prior)
    if method in ("depth", "edge"):
        factor = (memory.depth_obs + prior) / (memory.depth_pred + prior)
        # unseen depths: the factor of the deepest seen depth above them (1.0 above every seen one)
        seen = np.maximum.accumulate(np.where(memory.depth_nodes > 0, np.arange(len(factor)), -1))
        factor = np.where(seen >= 0, factor[np.maximum(seen, 0)], 1.0)
        return np.clip(factor[np.minimum(depths.astype(int), _MAX_DEPTH)] * p, 0.0, 1.0)
    mine = np.searchsorted(_BUCKET_EDGES, log_p)
    return (memory.bucket_hits[mine] + prior * p) / (memory.bucket_nodes[mine] + prior)


def value_bound(log_p: float, rounds, method: str, prior: float = 2.0) -> float:
    """An upper bound on :func:`calibrated_probs` of every node whose path log-probability is at most ``log_p``, at
    any depth (what :mod:`ddtree.candidates` needs to know of the nodes a build left out).

    Every calibration but ``edge`` values a node by its path probability and depth alone, increasingly in p at a
    given depth and within a bucket of log p; so the bound is the largest value at ``log_p`` and at the top of each
    bucket below it, over all depths, raised by a relative 1e-9 so that rounding never puts a node above it.
    ``edge`` scales a node by its siblings' share: no bound from the path probability alone (ValueError)."""
    if method == "edge":
        raise ValueError("the edge calibration values a node by its siblings too: it has no bound by path probability")
    probe = np.concatenate([[log_p], _BUCKET_EDGES[_BUCKET_EDGES < log_p]])
    depths = np.arange(1, _MAX_DEPTH + 1)
    values = calibrated_probs(np.repeat(probe, len(depths)), np.tile(depths, len(probe)), rounds, method, prior)
    return float(values.max()) * (1.0 + 1e-9)


class AutoBudget(BlockPolicy):
    """Per-round tree size that maximizes committed tokens per second under the machine's cost curve.

    Each round the best-first tree (``chain=True``: the drafter's top-1 chain, a DFlash block of chosen length) is
    built to :meth:`build_sizes` (``build``: see the module docstring), the nodes' acceptance probabilities are
    estimated (``calibrate``: :func:`calibrated_probs`) and the prefix to verify is chosen by ``rule``
    (:func:`best_prefix`; the marginal rule's rate is the committed tokens per modeled second of the rounds
    remembered). ``built`` / ``rebuilds``: the nodes built per round (every build counted) / builds after the first.

    ``cost``: the measured curve (:mod:`ddtree.cost`). ``clock`` (e.g. ``time.perf_counter``, what :meth:`for_models`
    passes): the policy times its rounds (between consecutive :meth:`propose` calls: one whole round of the previous
    proposal's size) and corrects the curve with them (``online_cost``, an :class:`~ddtree.cost.OnlineCost`). Without
    a clock (the default) nothing reads one: the same logits and feedback give the same choices (replayable).
    ``memory``: the rounds learnt from (at most ``window``). ``calibration_s``: seconds :meth:`for_models` spent
    measuring the curve (0.0 when cached). Nothing here changes the output, only the tree size.
    """

    uses_draft = True

    def __init__(self, cost: CostModel, cap: int = 128, calibrate: bool | str = True, window: int = 256,
                 rule: str = "marginal", chain: bool = False, memory: RoundMemory | None = None,
                 warmup: int = 4, clock: Callable[[], float] | None = None,
                 online_cost: OnlineCost | None = None, build: str = "adaptive") -> None:
        if cap < 0:
            raise ValueError(f"cap must be >= 0, got {cap}")
        if build not in BUILDS:
            raise ValueError(f"unknown build {build!r}: use one of {BUILDS}")
        self.build = build
        method = (DEFAULT_CALIBRATION if calibrate else "none") if isinstance(calibrate, bool) else calibrate
        if method not in CALIBRATIONS:
            raise ValueError(f"unknown calibration {calibrate!r}: use one of {CALIBRATIONS} (or True / False)")
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}: use one of {RULES}")
        self.cost, self.cap, self.calibrate, self.rule, self.chain = cost, cap, method, rule, chain
        self.name = "chain-auto" if chain else "auto"
        self.memory = memory if memory is not None else RoundMemory(window)
        self.warmup = warmup
        self.clock = clock
        self.online_cost = online_cost if online_cost is not None or clock is None else OnlineCost(cost)
        self.calibration_s = 0.0
        self._seconds = self._round_seconds()  # [cap + 1] modeled seconds per tree size
        self._pending: tuple | None = None  # (log_p, depths, modeled seconds, parents) of the round in flight
        self._timing: list | None = None  # [clock at the last propose, its size, history length, tokens committed]
        self.chosen: list[int] = []  # tree size picked each round (for studies)
        self.built: list[int] = []  # nodes built each round, all builds together (for studies)
        self.rebuilds: list[int] = []  # builds each round after the first (for studies)
        self._building, self._builds = 0, 0  # nodes built and builds so far in the round in flight
        self._shared: tuple | None = None  # for_models: (memory key, online curve key) before the variant

    @classmethod
    def for_models(cls, target, draft, cap: int | None = None, calibrate: bool | str = True,
                   cost: CostModel | None = None, context: int | None = None, profile: str | Path | None = None,
                   rule: str = "marginal", chain: bool = False, temperature: float = 0.0,
                   share_memory: bool = True, window: int = 256, online: bool = True,
                   build: str = "adaptive", batch: int = 1) -> "AutoBudget":
        """The policy with the cost curve of ``target`` + ``draft`` on this machine: ``cost``, else a GPU
        ``profile``'s (``experiments.studies.gpu_check``), else the cached curve of ``context_bucket(context)`` tokens
        (``context``: the prompt length; default 256; derived from :func:`ddtree.cost.calibrate`'s buckets, or
        measured now, ``calibration_s``). ``online``: correct the curve from the policy's own round timings.
        ``share_memory``: continue the round memory and online curve of earlier generations in this process with
        the same models and configuration; False for reproducible tree sizes (see the module doc). ``batch`` > 1:
        the batch round's curve per sequence (``measure_cost_model``), its own memory, no online correction."""
        cap = cap if cap is not None else default_cap(target.lm_head.weight.device, batch)
        if cost is None and profile is not None:
            cost = CostModel.from_profile(profile, context=context)
        if cost is None:
            cost = measure_cost_model(target, draft, context=context_bucket(context) if context else 256, cap=cap,
                                      chain=chain, extrapolate=True, batch=batch)
        online = online and batch == 1  # a sequence's clock sees the whole batch's round, not its share
        policy = cls(cost, cap=cap, calibrate=calibrate, window=window, rule=rule, chain=chain,
                     clock=time.perf_counter if online else None, build=build)
        if share_memory:
            models = (model_identity(target), model_identity(draft))
            policy._shared = (models + (cost.key, float(temperature), cap, rule, chain, str(calibrate), window, build,
                                        batch),  # rounds are booked in their batch curve's seconds
                              (models + (cost, cap, chain)) if online else None)
            policy.share_as(())
        policy.calibration_s = cost.measured_s
        return policy

    def share_as(self, variant: tuple) -> None:
        """Continue the shared round memory and online curve of ``for_models`` policies of this ``variant`` (a
        hashable tuple; ``()``: plain ``auto``). A policy that sizes other rounds than its own -- ``auto`` inside a
        :class:`~ddtree.lookup.LookupTreePolicy` books drafter nodes of merged trees and times merged rounds -- must
        not teach plain ``auto`` (nor learn from it). Nothing happens for a policy that shares nothing."""
        if self._shared is None:
            return
        memory_key, curve_key = self._shared
        self.memory = _SHARED_MEMORY.setdefault(memory_key + (variant,), RoundMemory(self.memory.window))
        if curve_key is not None:
            self.online_cost = _SHARED_CURVES.setdefault(curve_key + (variant,), OnlineCost(self.cost))
            self._seconds = self._round_seconds()

    @property
    def curve(self) -> CostModel:
        """The cost curve the policy prices rounds with now: the online one when it times rounds, else ``cost``."""
        return self.online_cost.curve if self.online_cost is not None else self.cost

    @property
    def beta(self) -> float:
        """The power calibration's exponent on the remembered rounds (1.0 before any)."""
        return _fit_beta([(r.log_p, int(r.accepted.sum())) for r in self.memory]) if self.memory else 1.0

    @property
    def rate(self) -> float | None:
        """Committed tokens per modeled second over the remembered rounds (None until ``warmup`` rounds)."""
        if len(self.memory) < self.warmup:
            return None
        return self.memory.tokens / max(self.memory.seconds, 1e-12)

    def observe(self, path: list[int]) -> None:
        """The loop's feedback: the accepted nodes that were committed this round."""
        self.record(len(path), path)

    def record(self, accepted_draft_tokens: int, path: list[int] | None = None) -> None:
        """Feed back the round just verified: how many draft tokens the target accepted and (when known) which
        nodes (indices into the proposal). Without ``path`` the accepted nodes are taken as the best-first
        tree's most probable node at each depth up to the accepted count (exact for a chain)."""
        if self._timing is not None:
            self._timing[3] = accepted_draft_tokens + 1  # with the bonus: the history grows by this much
        if self._pending is None:
            return
        log_p, depths, seconds, parents = self._pending
        self._pending = None
        accepted = np.zeros(len(log_p), dtype=bool)
        if path is not None:
            accepted[np.asarray(path, dtype=int)] = True
        else:
            for d in range(1, accepted_draft_tokens + 1):
                at = np.flatnonzero(depths == d)
                if len(at):
                    accepted[at[np.argmax(log_p[at])]] = True
        self.memory.append(Round(log_p, depths, accepted, seconds, parents))

    def propose(self, block: DraftBlock, history: list[int], token_map: torch.Tensor | None = None):
        """The prefix of the best-first tree (or chain) worth verifying this round. ``block`` is the round's
        :class:`DraftBlock` (or logits with their ``token_map``, as callers of the older contract pass them)."""
        now = self.start_round(history)
        block = as_block(block, history, token_map)
        for size in self.build_sizes():  # the last one is the cap, where a choice always comes
            full, probs, beyond = self.candidates(block, history, size)
            n = self.choose(probs, beyond)
            if n is not None:
                break
        self.remember(full.log_probs.double().numpy()[:n], full.depths.numpy()[:n], n, now, len(history),
                      parents=full.parents.numpy()[:n])
        return truncate_tree(full, n)  # a chain's prefix is a chain: verified without a mask

    # The steps of a round, public so that a policy can add candidates of its own (``ddtree.lookup``).
    def start_round(self, history: list[int]) -> float | None:
        """Read the clock (when the policy times rounds) and close the previous round's timing."""
        now = self.clock() if self.clock is not None else None
        if now is not None:
            self._time_round(now, len(history))
        return now

    def build_sizes(self) -> tuple[int, ...]:
        """The tree sizes to try this round, in order: :func:`~ddtree.candidates.build_size` of the drafter nodes
        verified in the last rounds remembered (so it follows the memory shared by ``share_as``); for ``"exact"``
        followed by its :func:`~ddtree.candidates.build_ladder` (each built only when the one before could not
        settle the choice, the last one the cap); the cap alone for ``"cap"`` and for ``edge``."""
        if self.calibrate == "edge" or self.build == "cap":
            return (self.cap,)
        recent = (len(r.log_p) for r in itertools.islice(reversed(self.memory.rounds), BUILD_LOOKBACK))
        first = build_size(recent, self.cap)
        return build_ladder(first, self.cap) if self.build == "exact" else (first,)

    def candidates(self, block: DraftBlock, history: list[int], size: int | None = None
                   ) -> tuple[DraftTree, np.ndarray, float | None]:
        """The drafter's best tree (or chain) of ``size`` nodes (default: the cap), its nodes' calibrated acceptance
        probabilities, and a bound on the probability of every node it left out (:func:`value_bound`; None when it
        left none out -- the cap's tree, or one the drafter cannot fill -- and for ``build="adaptive"``, which
        chooses among the built tree's prefixes as if it were complete). Under the conditioned distribution when the
        drafter has a Markov head (``block.scorer``, which keeps each children distribution wide enough for the next
        size of the ladder, so that a rebuild reuses them)."""
        size = self.cap if size is None else min(size, self.cap)
        width = min(self.cap, BUILD_LADDER * size) if self.build == "exact" else size  # rows a rebuild would reuse
        tree = cap_tree(block, size, self.chain, history, width=width)
        self._building += len(tree)
        self._builds += 1
        rounds = self.memory if len(self.memory) >= self.warmup else ()
        probs = calibrated_probs(tree.log_probs.double().numpy(), tree.depths.numpy(), rounds, self.calibrate,
                                 parents=tree.parents.numpy())
        left_out = len(tree) == size < self.cap and self.build == "exact"
        return tree, probs, value_bound(float(tree.log_probs[-1]), rounds, self.calibrate) if left_out else None

    def choose(self, probs: np.ndarray, beyond: float | None = None, exact: int | None = None) -> int | None:
        """How many of the nodes (in the order of ``probs``, a valid tree order) to verify. ``beyond`` None:
        ``probs`` is the complete list. Else its first ``exact`` values (default: all) are those of the complete list
        and every later one is at most ``beyond``: the complete list's choice, or None when it cannot be told
        (:func:`~ddtree.candidates.settled_prefix`)."""
        rate = self.rate if self.rule == "marginal" else None
        if beyond is None:
            return best_prefix(probs, self.curve, rate, self._seconds)
        return settled_prefix(probs, self._seconds, rate, len(probs) if exact is None else exact, beyond)

    def remember(self, log_p: np.ndarray, depths: np.ndarray, n: int, now: float | None, length: int,
                 parents: np.ndarray | None = None) -> None:
        """Book the round: ``n`` nodes verified, of which the drafter's have these log-probs, depths and
        ``parents`` (indices among them; None when unknown: the round then teaches no edge statistics), what
        :meth:`observe` learns from, its modeled seconds, and the clock for the online curve."""
        self.chosen.append(n)
        self.built.append(self._building)
        self.rebuilds.append(max(0, self._builds - 1))
        self._building, self._builds = 0, 0
        self._pending = (log_p, depths, float(self._seconds[n]), parents)
        if now is not None:
            self._timing = [now, n, length, None]

    def _time_round(self, now: float, length: int) -> None:
        """The previous round ended now: feed its wall time to the online curve when it was one round of the same
        generation (observed, and the history grew by exactly what it committed); else it spanned other work."""
        last, self._timing = self._timing, None
        if last is None or last[3] is None or length != last[2] + last[3] or self.online_cost is None:
            return
        before = self.online_cost.curve
        self.online_cost.observe(last[1], now - last[0])
        if self.online_cost.curve is not before:  # rebuilt: it moved by more than its tolerance
            self._seconds = self._round_seconds()

    def _round_seconds(self) -> np.ndarray:
        return np.asarray(self.curve.round_seconds(np.arange(self.cap + 1)), dtype=float)


_SHARED_MEMORY: dict[tuple, RoundMemory] = {}  # what for_models policies learnt, per models and configuration
_SHARED_CURVES: dict[tuple, OnlineCost] = {}  # their online cost curves, per models, measured curve, kind
_TOKENS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its token (lives as long as it does)
_NEXT_TOKEN = itertools.count(1)


def model_identity(model) -> tuple:
    """What shared ``auto`` state is keyed by for ``model`` (None for no model): (token, weights, dtype, shape).

    ``token``: a number given on first use and never again (a model made after another was collected does not
    inherit its memory, as it would an ``id()``; a collected model's entries are dropped). ``weights``: each tensor's
    storage and version counter, which in-place edits advance (one through ``p.data`` does not: call
    :func:`forget_shared_memory` after it). ``shape``: taps, width, block and vocabulary sizes, depth."""
    if model is None:
        return (None,)
    token = _TOKENS.get(model)
    if token is None:
        token = _TOKENS[model] = next(_NEXT_TOKEN)
        weakref.finalize(model, _forget_model, token)
    tensors = itertools.chain(model.parameters(), model.buffers())
    weights = hash(tuple((t.data_ptr(), _version(t)) for t in tensors))
    cfg = model.config
    shape = (tuple(getattr(cfg, "target_layer_ids", ())), cfg.hidden_size, getattr(cfg, "block_size", None),
             getattr(cfg, "draft_vocab_size", None), cfg.num_hidden_layers, cfg.vocab_size)
    return token, weights, str(next(model.parameters()).dtype), shape


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter (-1 for a tensor made under ``torch.inference_mode``: it keeps none)."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


def _forget_model(token: int) -> None:
    """A model was collected: drop the shared state keyed by it (its token is never used again)."""
    for shared in (_SHARED_MEMORY, _SHARED_CURVES):
        for key in [k for k in shared if token in (k[0][0], k[1][0])]:
            del shared[key]


def forget_shared_memory() -> None:
    """Drop what ``AutoBudget.for_models`` policies learnt in this process: round memories and online cost curves
    (tests, a changed workload, weights edited through ``.data``, or a reproducible run after others)."""
    _SHARED_MEMORY.clear()
    _SHARED_CURVES.clear()


def _fit_beta(history) -> float:
    """Solve sum_rounds sum_i p_i**beta = sum_rounds accepted for beta in [0.25, 8] by bisection (monotone)."""
    log_p = np.concatenate([lp for lp, _ in history]) if history else np.zeros(0)
    observed = float(sum(a for _, a in history))
    if log_p.size == 0:
        return 1.0
    lo, hi = 0.25, 8.0
    expected = lambda beta: float(np.exp(beta * log_p).sum())  # noqa: E731  decreasing in beta (log p <= 0)
    if expected(lo) <= observed:
        return lo
    if expected(hi) >= observed:
        return hi
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if expected(mid) > observed else (lo, mid)
    return math.sqrt(lo * hi)
