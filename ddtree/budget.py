"""Hardware-aware tree size per round: ``budget="auto"`` (and ``"chain-auto"`` for DFlash chains).

The best-first tree lists nodes in order of decreasing path probability, and every prefix of that order is itself a
valid (prefix-closed) tree. Verifying the first N nodes commits on average ``1 + sum_{i<=N} a_i`` tokens, a_i the
probability that node i's whole path is accepted, and costs ``round_seconds(N)`` under the machine's cost curve
(:mod:`ddtree.cost`: measured once per machine and context bucket, then corrected online from the loop's own round
timings). Each round :class:`AutoBudget` verifies the prefix N that maximizes ``1 + sum a_i - rate * seconds(N)``,
rate = committed tokens per modeled second over the rounds it remembers (:func:`best_prefix`). This maximizes the
long-run rate sum(tokens) / sum(seconds) (Dinkelbach's fixed point of the renewal-reward ratio): confident rounds get
larger trees and doubtful ones smaller than under the best tokens per second of each round alone, which is what it
maximizes until it has seen ``warmup`` rounds.

The a_i are the drafter's path probabilities calibrated against what the target accepted, one factor per depth
(:func:`calibrated_probs`). How far to build: once per round, at :func:`build_size` nodes (a little more than the
recent verified sizes), choosing among that tree's prefixes; a round that takes the whole build raises the next ones.

What ``auto`` learns is held by its caller: a :class:`RoundMemory` (the verified rounds the rate and calibration are
read from, and the online correction of each cost curve the rounds were timed against). A policy made without one
starts fresh, from the cost curve cached on disk and the drafter's own probabilities, so a plain
``ddtree_generate(budget="auto")`` call sizes its trees the same every time (up to the machine's timing noise, which
the online correction follows; ``online=False`` reads no clock). To carry the calibration over from one call to the
next, create a memory and pass it to each call's policy (``make_policy("auto", target, draft, memory=memory)``); a
memory belongs to one method on one model pair (``auto`` with lookup branches learns from other rounds than plain
``auto``). Neither the rule, the calibration nor the cost curve ever changes the output, only the tree size.

In a batch (:class:`SharedBudget`) every tree is padded to the largest one, so a round costs what the largest tree
costs: one size N per round for the whole batch maximizes the batch's committed tokens per second,
``sum_b (1 + sum_{i<=N} a_{b,i}) - R * s(N)`` (:func:`shared_size`), with a_{b,i} sequence b's calibrated path
probabilities (its own :class:`AutoBudget` builds and calibrates them, as alone), s(N) the per-sequence share of the
batch round (the batch size's cost curve) and R the sum of the sequences' long-run rates. Each sequence verifies the
first N nodes of its tree and books the round in its own policy's memory (``ddtree_generate`` forks the caller's memory
per sequence, :meth:`RoundMemory.fork`, and takes every sequence's rounds back into it after the call).
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from dflash_core.tree import BlockPolicy, DraftBlock, DraftTree

from .build import best_tree
from .cost import CostModel, OnlineCost, context_bucket, default_cap, measure_cost_model

__all__ = ["AutoBudget", "BUILD_FLOOR", "BUILD_LOOKBACK", "Round", "RoundMemory", "SharedBudget", "best_prefix",
           "build_size", "calibrated_probs", "shared_size"]

_MAX_DEPTH = 64  # depths beyond share the calibration factor of this one

BUILD_FLOOR = 8  # nodes auto builds at least (also before it has verified any round)
BUILD_GROWTH = 1.25  # ... else this many times the robust recent size
BUILD_MARGIN = 2  # ... plus these nodes,
BUILD_QUANTILE = 0.75  # the robust size: this quantile of the drafter nodes verified over the last
BUILD_LOOKBACK = 16  # rounds
SKIP_LOOKBACK = 32  # drafted rounds whose rate decides whether the drafter pays (AutoBudget.wants_draft)
SKIP_AFTER = 16  # ... at least this many before a drafting policy begins to skip
PROBE_FIRST = 2  # a policy that skips the drafter drafts a probe round after this many rounds without it;
PROBE_EVERY = 16  # ... the gap doubles after each probe that did not pay, up to this, and falls back after one that did
RESUME_AFTER = 4  # ... and it drafts every round again once the last this many probes say drafting pays
PLAIN_TIMED = 3  # rounds without the drafter timed before their median prices a plain step (until then: verify(0))


@dataclass(frozen=True)
class Round:
    """What one verified round tells the policy: the drafter's path log-probabilities and depths of the verified
    nodes, which of them the target accepted, the round's modeled seconds, and the accepted nodes that were not the
    drafter's (``extra``: a lookup branch's, :mod:`ddtree.lookup`): they count in the rate, not in the calibration."""

    log_p: np.ndarray  # [n] float64
    depths: np.ndarray  # [n] int
    accepted: np.ndarray  # [n] bool: node on the accepted path
    seconds: float
    extra: int = 0  # accepted tokens from nodes that are not the drafter's

    @property
    def tokens(self) -> int:
        """Tokens the round committed: the accepted draft tokens (the drafter's and any others) and the bonus."""
        return int(self.accepted.sum()) + self.extra + 1


class RoundMemory:
    """What ``auto`` learnt, held by its caller (module docstring): the last ``window`` verified rounds with running
    totals (tokens, modeled seconds, per-depth predicted and observed acceptance), so a policy reads its rate and
    calibration in O(depths) per round; the online correction of each measured cost curve a clocked policy timed
    its rounds against (:meth:`online_cost`); the wall times of the last rounds without the drafter over their
    curve's ``verify(0)`` (``plain``, what a clocked policy prices a plain step with:
    :meth:`AutoBudget.plain_seconds`); and, for ``auto`` with lookup branches, what the branches learnt (``lookup``,
    a :class:`ddtree.lookup.LookupStats`; None until one is used)."""

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.rounds: deque[Round] = deque()
        self.tokens, self.seconds = 0, 0.0
        self.depth_pred, self.depth_obs = np.zeros(_MAX_DEPTH + 1), np.zeros(_MAX_DEPTH + 1)
        self.depth_nodes = np.zeros(_MAX_DEPTH + 1, dtype=np.int64)
        self.curves: dict[CostModel, OnlineCost] = {}
        self.plain: deque[float] = deque(maxlen=16)
        self.lookup = None
        self.appended = 0  # rounds ever stored (the window keeps the last ``window``)
        self.forked_at = 0  # ``appended`` of the memory this one was forked from, at the fork

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

    def append(self, r: Round) -> None:
        self.appended += 1
        self.rounds.append(r)
        self._add(r, +1)
        if len(self.rounds) > self.window:
            self._add(self.rounds.popleft(), -1)

    def fork(self) -> "RoundMemory":
        """A copy that goes on learning by itself (one sequence of a batch learns its own rounds: its calibration
        and rate are its prompt's, not a mix of the batch's); :meth:`absorb` takes back what the forks learnt."""
        fork = copy.deepcopy(self)
        fork.forked_at = self.appended
        return fork

    def absorb(self, forks: Iterable["RoundMemory"]) -> None:
        """Store the rounds each fork learnt since :meth:`fork` (fork by fork, each in its own order)."""
        for fork in forks:
            new = min(fork.appended - fork.forked_at, len(fork.rounds))
            for r in list(fork.rounds)[len(fork.rounds) - new:]:
                self.append(r)
            if fork.lookup is not None:
                fork.lookup.add_to(self)

    def online_cost(self, cost: CostModel) -> OnlineCost:
        """The online correction of the measured curve ``cost`` (a new one, equal to it, on first use)."""
        if cost not in self.curves:
            self.curves[cost] = OnlineCost(cost)
        return self.curves[cost]

    @classmethod
    def of(cls, rounds) -> "RoundMemory":
        if isinstance(rounds, RoundMemory):
            return rounds
        memory = cls(max(1, len(rounds)))
        for r in rounds:
            memory.append(r)
        return memory


def calibrated_probs(log_p: np.ndarray, depths: np.ndarray, rounds, prior: float = 2.0) -> np.ndarray:
    """The acceptance probability of each node (path log-prob ``log_p``, depth ``depths``) learnt from ``rounds``
    (a :class:`RoundMemory` or a sequence of :class:`Round`; none: the drafter's own probabilities).

    f_d * p per depth d, f_d = (accepted at d + prior) / (sum of p at d + prior): the drafter's over- or
    under-confidence may grow with depth (depths beyond those seen take the deepest seen factor). A node counts as
    accepted when it lies on the path the target accepted, so its probability is that of its whole path: exactly the
    quantity the expected committed tokens ``1 + sum p_i`` add up.
    """
    p = np.exp(log_p)
    if not len(rounds):
        return p
    memory = RoundMemory.of(rounds)
    factor = (memory.depth_obs + prior) / (memory.depth_pred + prior)
    # unseen depths: the factor of the deepest seen depth above them (1.0 above every seen one)
    seen = np.maximum.accumulate(np.where(memory.depth_nodes > 0, np.arange(len(factor)), -1))
    factor = np.where(seen >= 0, factor[np.maximum(seen, 0)], 1.0)
    return np.clip(factor[np.minimum(depths.astype(int), _MAX_DEPTH)] * p, 0.0, 1.0)


def best_prefix(path_probs: np.ndarray, cost, rate: float | None = None, seconds: np.ndarray | None = None) -> int:
    """The tree size N in 0..len(path_probs) to verify (smallest N on ties).

    ``rate`` = lambda > 0: argmax_N (1 + sum_{i<=N} p_i) - lambda * round_seconds(N), i.e. add nodes while each one's
    expected tokens pay for its cost at the run's long-run rate. ``rate=None`` (before the rate is known):
    argmax_N (1 + sum_{i<=N} p_i) / round_seconds(N), the best tokens per second of this round alone. ``cost``: the
    :class:`~ddtree.cost.CostModel` (its ``round_seconds``); ``seconds``: ``cost.round_seconds(0..M)`` precomputed
    for some M >= len(path_probs) (saves the interpolation; ``cost`` is then not read).
    """
    if seconds is None:
        seconds = np.asarray(cost.round_seconds(np.arange(len(path_probs) + 1)), dtype=float)
    gain = 1.0 + np.concatenate([[0.0], np.cumsum(np.asarray(path_probs, dtype=float))])
    seconds = seconds[: len(gain)]
    return int(np.argmax(gain / seconds if rate is None else gain - rate * seconds))


def build_size(recent: Iterable[int], cap: int) -> int:
    """How many nodes to build this round: ``BUILD_GROWTH`` times the ``BUILD_QUANTILE`` quantile of the ``recent``
    verified sizes (the value at that rank of the sorted list), rounded up, plus ``BUILD_MARGIN``; at least
    ``BUILD_FLOOR``, at most ``cap``. A high quantile, not the largest, so that one confident round does not enlarge
    the next builds; the margin lets a round choose a little more than the recent ones, and a round that takes the
    whole build raises the next."""
    sizes = sorted(recent)
    typical = sizes[min(len(sizes) - 1, int(BUILD_QUANTILE * len(sizes)))] if sizes else 0
    return min(cap, max(BUILD_FLOOR, math.ceil(BUILD_GROWTH * typical) + BUILD_MARGIN))


class AutoBudget(BlockPolicy):
    """Per-round tree size that maximizes committed tokens per second under the machine's cost curve.

    Each round the best-first tree (``chain=True``: the drafter's top-1 chain, a DFlash block of chosen length) is
    built at :meth:`next_build_size` nodes, the nodes' acceptance probabilities are estimated
    (:func:`calibrated_probs`) and the prefix to verify is chosen (:func:`best_prefix`). ``chosen`` / ``built``: the
    nodes verified / built per round.

    ``cost``: the measured curve (:mod:`ddtree.cost`). ``memory``: the :class:`RoundMemory` learnt from and into
    (default: a fresh one). ``clock`` (e.g. ``time.perf_counter``, what :meth:`for_models` passes): the policy times
    its rounds (between consecutive :meth:`propose` calls: one whole round of the previous proposal's size) and
    corrects the curve with them (``online_cost``, the memory's :class:`~ddtree.cost.OnlineCost` of ``cost``).
    Without a clock (the default) nothing reads one: the same logits and feedback give the same choices
    (replayable). ``calibration_s``: seconds :meth:`for_models` spent measuring the curve (0.0 when cached).

    A clocked policy also skips the drafter where it does not pay (:meth:`wants_draft`): when its recent drafted
    rounds committed fewer tokens per second than plain steps would (one token per ``verify(0)`` of its curve: a
    round of the root alone, without the drafter's pass), its rounds verify the root alone, with probe rounds that
    draft: the first after ``PROBE_FIRST`` rounds without the drafter, and not before the skip is confirmed at the
    timed price of a plain step (below), the gap doubling after each probe that did not pay (up to ``PROBE_EVERY``)
    and falling back to ``PROBE_FIRST`` after one that did; once the last ``RESUME_AFTER`` probes say drafting pays,
    it drafts every round again. On long contexts or unpredictable text the drafter's pass then costs a probe's
    share instead of every round, while a skip begun on a hard stretch of text ends a few rounds after it (with
    probes every 17 rounds, a skip lasted at least 68 rounds, about 13% of a 1,024-token answer that drafting would
    have doubled). Leaving takes ``SKIP_AFTER`` drafted rounds and coming back ``RESUME_AFTER`` probes, so that the
    noise of a few rounds (tokens per round vary from 1 to the block) neither stops a drafter that pays nor keeps one
    that does not.
    The rounds without the drafter are timed (from one :meth:`wants_draft` to the next) and kept in the memory as
    multiples of the curve's ``verify(0)``, so a later call, at any context length, starts with them: once
    ``PLAIN_TIMED`` were, the median of the last 16 times the curve's ``verify(0)`` prices a plain step instead of
    ``verify(0)`` alone, which leaves out the loop's own work per round, and the drafted rounds that began the skipping
    are judged again at that price (drafting resumes at once where they pay after all). ``skipped``: per round, whether
    it skipped the drafter.
    """

    uses_draft = True

    def __init__(self, cost: CostModel, cap: int = 128, chain: bool = False, memory: RoundMemory | None = None,
                 warmup: int = 4, clock: Callable[[], float] | None = None) -> None:
        if cap < 0:
            raise ValueError(f"cap must be >= 0, got {cap}")
        self.cost, self.cap, self.chain, self.proposes_chains = cost, cap, chain, chain
        self.name = "chain-auto" if chain else "auto"
        self.memory = memory if memory is not None else RoundMemory()
        self.warmup = warmup
        self.clock = clock
        self.online_cost = self.memory.online_cost(cost) if clock is not None else None
        self.calibration_s = 0.0
        self._seconds = self._round_seconds()  # [cap + 1] modeled seconds per tree size
        self._held: tuple | None = None  # (log_p, depths, modeled seconds) of the round in flight
        self._timing: list | None = None  # [clock at the last propose, its size, history length, tokens committed]
        self.chosen: list[int] = []  # tree size picked each round (for studies)
        self.built: list[int] = []  # nodes built each round (for studies)
        self._building = 0  # nodes built so far in the round in flight
        self.skipped: list[bool] = []  # per round: the drafter skipped (for studies)
        # skipping now; memory.appended where the deciding rounds begin: a call judges the drafter on its own rounds
        self._skipping, self._window = False, self.memory.appended
        self._plain = self.memory.plain  # the last rounds without the drafter, in multiples of verify(0)
        self._plain_open: tuple[float, int] | None = None  # (clock, history length) of the skipped round in flight
        self._confirmed = False  # the skipping was judged at the timed price of a plain step
        self._gap = PROBE_FIRST  # rounds without the drafter before the next probe

    @classmethod
    def for_models(cls, target, draft, cap: int | None = None, cost: CostModel | None = None,
                   context: int | None = None, profile: str | Path | None = None, chain: bool = False,
                   memory: RoundMemory | None = None, online: bool = True, batch: int = 1) -> "AutoBudget":
        """The policy with the cost curve of ``target`` + ``draft`` on this machine: ``cost``, else a GPU
        ``profile``'s (``experiments.studies.gpu_check``), else the cached curve of ``context_bucket(context)`` tokens
        (``context``: the prompt length; default 256; derived from :func:`ddtree.cost.calibrate`'s buckets, or
        measured now, ``calibration_s``). ``memory``: what earlier calls learnt (module docstring; default: start
        fresh). ``online``: correct the curve from the policy's own round timings. ``batch`` > 1: the batch round's
        curve per sequence (``measure_cost_model``), no online correction."""
        cap = cap if cap is not None else default_cap(target.lm_head.weight.device, batch)
        if cost is None and profile is not None:
            cost = CostModel.from_profile(profile, context=context)
        if cost is None:
            cost = measure_cost_model(target, draft, context=context_bucket(context) if context else 256, cap=cap,
                                      chain=chain, extrapolate=True, batch=batch)
        online = online and batch == 1  # a sequence's clock sees the whole batch's round, not its share
        policy = cls(cost, cap=cap, chain=chain, memory=memory, clock=time.perf_counter if online else None)
        policy.calibration_s = cost.measured_s
        return policy

    @property
    def curve(self) -> CostModel:
        """The cost curve the policy prices rounds with now: the online one when it times rounds, else ``cost``."""
        return self.online_cost.curve if self.online_cost is not None else self.cost

    @property
    def rate(self) -> float | None:
        """Committed tokens per modeled second over the remembered rounds (None until ``warmup`` rounds)."""
        if len(self.memory) < self.warmup:
            return None
        return self.memory.tokens / max(self.memory.seconds, 1e-12)

    def wants_draft(self, history: list[int]) -> bool:
        """Whether this round runs the drafter (class docstring). Without a clock: always. With one, the drafted
        rounds since the call began or the policy last began skipping (at most ``SKIP_LOOKBACK``) decide; an earlier
        call's rounds do not, since another prompt's text says little about this one's. While drafting, it begins to
        skip once ``SKIP_AFTER`` of them committed fewer tokens per second than plain steps (:meth:`plain_seconds`);
        while skipping, once the plain step is timed it judges those rounds again, then drafts probe rounds (their
        gaps: class docstring) and drafts every round again once the last ``RESUME_AFTER`` probes say it pays."""
        if self.clock is None:
            return True
        now = self.clock() if self._plain_open is not None else None  # read only around rounds without the drafter
        self._time_plain(history, now)
        since = self.memory.appended - self._window
        recent = list(itertools.islice(reversed(self.memory.rounds), min(since, SKIP_LOOKBACK)))
        pays = self._pays(recent)
        if not self._skipping:
            if len(recent) >= SKIP_AFTER and not pays:
                self._skipping, self._confirmed, self._gap = True, False, PROBE_FIRST
            return self._time_if_skipped(not self._skipping, history, now)
        if self.skipped and not self.skipped[-1] and self.memory.rounds:  # the round just verified was a probe
            paid = self._pays([self.memory.rounds[-1]])
            self._gap = PROBE_FIRST if paid else min(2 * self._gap, PROBE_EVERY)
        if not self._confirmed and len(self._plain) >= PLAIN_TIMED:
            self._confirmed = True  # the rounds that began the skipping, at the plain step's timed price
            if pays:
                self._skipping = False
                return True
            self._window = self.memory.appended  # the probes start a fresh window
        elif self._confirmed and len(recent) >= RESUME_AFTER and self._pays(recent[:RESUME_AFTER]):
            self._skipping = False
            return True
        run = 0
        for skipped in reversed(self.skipped):
            if not skipped:
                break
            run += 1
        return self._time_if_skipped(self._confirmed and run >= self._gap, history, now)  # (probes: once confirmed)

    def _pays(self, rounds) -> bool:
        """Whether ``rounds`` (drafted) committed at least as many tokens per second as plain steps would."""
        return sum(r.tokens for r in rounds) * self.plain_seconds() >= sum(r.seconds for r in rounds)

    def plain_seconds(self) -> float:
        """Seconds of a round without the drafter: the curve's ``verify(0)``, times the median of the last timed
        ones over it once ``PLAIN_TIMED`` were."""
        step = float(self.curve.verify(0))
        return step * statistics.median(self._plain) if len(self._plain) >= PLAIN_TIMED else step

    def _time_if_skipped(self, draft: bool, history: list[int], now: float | None) -> bool:
        """Return ``draft``; a round that skips the drafter starts its timing (:meth:`_time_plain` ends it)."""
        self._plain_open = None if draft else (self.clock() if now is None else now, len(history))
        return draft

    def _time_plain(self, history: list[int], now: float | None) -> None:
        """The skipped round in flight ended ``now``: its wall time over the curve's ``verify(0)``, when it committed
        one token (the root's)."""
        if self._plain_open is not None and len(history) == self._plain_open[1] + 1:
            self._plain.append((now - self._plain_open[0]) / float(self.curve.verify(0)))
        self._plain_open = None

    def propose(self, block: DraftBlock | None, history: list[int]) -> DraftTree:
        """The prefix of the best-first tree (or chain) worth verifying this round; ``block`` None (the drafter
        skipped, :meth:`wants_draft`): the root alone, a plain step."""
        self.skipped.append(block is None)
        if block is None:
            self._timing = None  # the next drafted round follows other work: not one timed round
            return DraftTree.chain(torch.zeros(0, dtype=torch.long), torch.zeros(0))
        now = self.start_round(history)
        tree, probs = self.drafter_tree(block, self.next_build_size())
        n = self.choose(probs)
        self.hold_proposal(tree.log_probs.double().numpy()[:n], tree.depths.numpy()[:n], n, now, len(history))
        return tree.prefix(n)  # a chain's prefix is a chain: verified without a mask

    def observe(self, path: list[int]) -> None:
        """The loop's feedback: the accepted nodes that were committed this round."""
        self.store_round(len(path), path)

    # The steps of a round, public so that a policy can add nodes of its own (``ddtree.lookup``) or size several
    # sequences together (:class:`SharedBudget`).
    def start_round(self, history: list[int]) -> float | None:
        """Read the clock (when the policy times rounds) and close the previous round's timing."""
        now = self.clock() if self.clock is not None else None
        if now is not None:
            self._time_round(now, len(history))
        return now

    def next_build_size(self) -> int:
        """How many nodes to build this round: :func:`build_size` of the drafter nodes verified in the last
        ``BUILD_LOOKBACK`` rounds of the memory."""
        recent = (len(r.log_p) for r in itertools.islice(reversed(self.memory.rounds), BUILD_LOOKBACK))
        return build_size(recent, self.cap)

    def drafter_tree(self, block: DraftBlock, size: int) -> tuple[DraftTree, np.ndarray]:
        """The drafter's best tree (or chain) of at most ``size`` nodes (:func:`ddtree.build.best_tree`: conditioned
        when the drafter has a Markov head) and its nodes' calibrated acceptance probabilities."""
        tree = best_tree(block, min(size, self.cap), self.chain)
        self._building += len(tree)
        rounds = self.memory if len(self.memory) >= self.warmup else ()
        return tree, calibrated_probs(tree.log_probs.double().numpy(), tree.depths.numpy(), rounds)

    def choose(self, probs: np.ndarray) -> int:
        """How many of the nodes (in the order of ``probs``, a valid tree order) to verify."""
        return best_prefix(probs, self.curve, self.rate, self._seconds)

    def hold_proposal(self, log_p: np.ndarray, depths: np.ndarray, n: int, now: float | None, length: int,
                      seconds: float | None = None) -> None:
        """Hold the round in flight until the target's verdict (:meth:`store_round`): ``n`` nodes verified, of which
        the drafter's have these log-probs and depths, its modeled seconds (default: the policy's curve at ``n``),
        and the clock for the online curve."""
        self.chosen.append(n)
        self.built.append(self._building)
        self._building = 0
        self._held = (log_p, depths, float(self._seconds[n] if seconds is None else seconds))
        if now is not None:
            self._timing = [now, n, length, None]

    def store_round(self, committed_draft_tokens: int, drafter_path: list[int]) -> None:
        """Store the verdict on the round held: the target accepted ``committed_draft_tokens`` draft tokens, of
        which ``drafter_path`` are the held drafter nodes (indices among them); the rest (a lookup branch's) count
        in the rate the next rounds are sized against."""
        if self._timing is not None:
            self._timing[3] = committed_draft_tokens + 1  # with the bonus: the history grows by this much
        if self._held is None:
            return
        log_p, depths, seconds = self._held
        self._held = None
        accepted = np.zeros(len(log_p), dtype=bool)
        accepted[np.asarray(drafter_path, dtype=int)] = True
        self.memory.append(Round(log_p, depths, accepted, seconds, committed_draft_tokens - len(drafter_path)))

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


def shared_size(probs: list[np.ndarray], seconds: np.ndarray, rate: float | None) -> int:
    """The size N in 0..len(seconds)-1 maximizing the batch objective of the module docstring (smallest on ties):
    ``probs`` one array of calibrated path probabilities per sequence (a tree shorter than N contributes all it
    has), ``seconds`` the per-sequence round seconds at 0..cap nodes, ``rate`` the batch's long-run rate or None
    (before it is known: the batch's tokens per second of this round alone)."""
    gain = np.full(len(seconds), float(len(probs)))
    for p in probs:
        cum = np.concatenate([[0.0], np.cumsum(np.asarray(p, dtype=float))])[: len(seconds)]
        gain += np.concatenate([cum, np.full(len(seconds) - len(cum), cum[-1])])
    objective = gain / seconds if rate is None else gain - rate * seconds
    return int(np.argmax(objective))


class SharedBudget:
    """The batch proposer of ``budget="auto"``: one tree size per round for the whole batch (module docstring);
    ``policies[b]``: sequence b's :class:`AutoBudget` (all on the batch's cost curve, per-sequence seconds).

    As sequences finish, the batch shrinks and each remaining sequence's share of a round grows. ``single``: the
    batch-1 round seconds at 0..cap nodes; with them a round of k sequences is priced between the two measured
    curves, ``T_k(N) = T_1(N) + (k - 1) / (B - 1) * (T_B(N) - T_1(N))`` (T the whole round's seconds, B the starting
    batch), i.e. linear in the number of sequences verified; k = B gives the batch curve, k = 1 the single one.
    Without ``single`` every round is priced at the starting batch size."""

    def __init__(self, policies: list[AutoBudget], single: np.ndarray | None = None) -> None:
        if not policies or not all(isinstance(p, AutoBudget) for p in policies):
            raise TypeError("SharedBudget sizes the trees of AutoBudget policies (budget='auto'), one per sequence")
        self.policies = policies
        self.single = None if single is None else np.asarray(single, dtype=float)
        self.chosen: list[int] = []  # the shared size of every round (for studies)

    def seconds(self, k: int) -> np.ndarray:
        """Per-sequence seconds of a round of ``k`` sequences at 0..cap nodes (class docstring)."""
        batch, share = len(self.policies), self.policies[0]._seconds
        if self.single is None or k == batch or batch == 1:
            return share
        whole = self.single[: len(share)] + (k - 1) / (batch - 1) * (batch * share - self.single[: len(share)])
        return whole / k

    def propose(self, seqs: list[int], blocks: list[DraftBlock | None], histories: list[list[int]]) -> list:
        built = []
        for s, block, history in zip(seqs, blocks, histories):
            policy = self.policies[s]
            now = policy.start_round(history)
            tree, probs = policy.drafter_tree(block, policy.next_build_size())
            built.append((policy, tree, probs, now, len(history)))
        rates = [policy.rate for policy, *_ in built]
        rate = None if any(r is None for r in rates) else float(sum(rates))
        seconds = self.seconds(len(seqs))
        n = shared_size([probs for _, _, probs, _, _ in built], seconds, rate)
        self.chosen.append(n)
        trees = []
        for policy, tree, _, now, length in built:
            k = min(n, len(tree))  # the round costs what its largest tree costs
            policy.hold_proposal(tree.log_probs.double().numpy()[:k], tree.depths.numpy()[:k], k, now, length,
                                 float(seconds[n]))
            trees.append(tree.prefix(k))
        return trees
