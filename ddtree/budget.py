"""Hardware-aware tree size per round (``budget="auto"``, and ``"chain-auto"`` for DFlash chains).

The best-first tree lists nodes in order of decreasing path probability, and every prefix of that order is itself a
valid (prefix-closed) tree. Verifying the first N nodes commits on average ``1 + sum_{i<=N} a_i`` tokens, a_i the
probability that node i's whole path is accepted, and costs ``t_fixed + t_verify(N)`` seconds. Both costs are measured
as the decode loop spends them (:func:`measure_cost_model`): ``t_verify(N)`` is everything in a round that grows with
the tree (compiling ids, positions and the ancestor mask, the target's forward over N+1 tokens on a cache of the
caller's context length, the walk, the cache compaction) and ``t_fixed`` the rest (the drafter pass with its LM head,
and the policy building its tree at the cap and choosing the prefix). Curves are cached per machine, model pair,
dtype, thread count, CPU kernels and context length; a GPU profile written by ``experiments.gpu_check`` can stand in
(:meth:`CostModel.from_profile`).

Each round :class:`AutoBudget` builds the tree up to a cap once and keeps the prefix that maximizes

* the marginal rule (default): ``1 + sum a_i - rate * seconds(N)``, rate = committed tokens per modeled second over
  the rounds it remembers. This maximizes the long-run rate sum(tokens) / sum(seconds) (Dinkelbach's fixed point of
  the renewal-reward ratio): confident rounds get larger trees and doubtful ones smaller than under
* the ratio rule: ``(1 + sum a_i) / seconds(N)``, the best tokens per second of the round alone.

The a_i are the drafter's path probabilities calibrated online against what the target accepted (default
``depth``: one factor per depth; ``power``: p ** beta; ``bucket``: a reliability histogram over log p; ``none``: the
drafter's own numbers), see :func:`calibrated_probs`. ``python -m experiments.auto_budget_study`` compares rules,
calibrations and fixed budgets by offline replay under several cost curves. Nothing here reads a clock, so the
choices are replayable, and neither the rule nor the calibration ever changes the output, only the tree size.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .build import build_tree
from .tree import DraftTree

__all__ = ["CostModel", "AutoBudget", "Round", "RoundMemory", "CALIBRATIONS", "RULES", "calibrated_probs", "measure_cost_model",
           "median_seconds", "best_prefix", "truncate_tree", "default_cap", "context_bucket", "forget_shared_memory"]


def default_cap(device: torch.device) -> int:
    """The largest tree ``auto`` builds per round: 1024 nodes on CUDA, 128 on a CPU."""
    return 1024 if torch.device(device).type == "cuda" else 128


def context_bucket(length: int) -> int:
    """The context length a cost curve is measured at for a prompt of ``length`` tokens: the next power of two
    (at least 64), so prompts of similar length share one measurement."""
    return max(64, 1 << max(0, int(length) - 1).bit_length())


# ---------------------------------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class CostModel:
    """Seconds per round as a function of the number of draft nodes: ``fixed_s + verify(N)``.

    ``verify`` is the measured median target forward time over N+1 new tokens at the grid ``nodes``, made monotone
    and interpolated linearly in N (extrapolated linearly past the last point).
    """

    nodes: tuple[int, ...]  # measured tree sizes, increasing, starting at 0
    verify_s: tuple[float, ...]  # median seconds of the N-dependent part of a round (the target forward and more)
    fixed_s: float  # drafter pass + tree building at the cap + per-round overhead (seconds)
    key: str = ""
    context: int = 0  # tokens in the target's cache the curve was measured on (0 = unknown)

    def __post_init__(self) -> None:
        if len(self.nodes) != len(self.verify_s) or len(self.nodes) < 2:
            raise ValueError("CostModel needs at least two (nodes, verify_s) points of equal length")
        if list(self.nodes) != sorted(self.nodes):
            raise ValueError("CostModel.nodes must be increasing")
        monotone = np.maximum.accumulate(np.asarray(self.verify_s, dtype=float))
        object.__setattr__(self, "verify_s", tuple(float(v) for v in monotone))

    def verify(self, n: np.ndarray | int) -> np.ndarray:
        x, y = np.asarray(self.nodes, float), np.asarray(self.verify_s, float)
        n = np.asarray(n, dtype=float)
        out = np.interp(n, x, y)
        slope = (y[-1] - y[-2]) / max(x[-1] - x[-2], 1e-9)
        return np.where(n > x[-1], y[-1] + slope * (n - x[-1]), out)

    def round_seconds(self, n: np.ndarray | int) -> np.ndarray:
        return self.fixed_s + self.verify(n)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> "CostModel":
        return cls(tuple(raw["nodes"]), tuple(raw["verify_s"]), float(raw["fixed_s"]), raw.get("key", ""),
                   int(raw.get("context", 0)))

    @classmethod
    def from_profile(cls, profile: str | Path | dict, model: str | None = None,
                     context: int | None = None) -> "CostModel":
        """The curve of ``model`` (default: the profile's first) from a ``experiments.gpu_check`` profile, at the
        measured context length nearest to ``context`` (by ratio; default: the longest measured)."""
        raw = json.loads(Path(profile).read_text()) if not isinstance(profile, dict) else profile
        models = raw.get("models") or {}
        if not models:
            raise ValueError("the profile holds no models")
        name = model or next(iter(models))
        if name not in models:
            raise ValueError(f"model {name!r} is not in the profile (it has {', '.join(models)})")
        curves = [c for c in models[name].get("cost_models") or [] if "verify_s" in c]
        if not curves:
            raise ValueError(f"the profile has no cost curve for {name!r} (its verify_cost step failed or was skipped)")
        if context is None:
            best = max(curves, key=lambda c: c.get("context", 0))
        else:
            best = min(curves, key=lambda c: abs(math.log(max(c.get("context", 1), 1) / max(context, 1))))
        return cls.from_json(best)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from dflash_core.timing import cpu_model

    return cpu_model()


def _cost_key(target, draft, device: torch.device, dtype: torch.dtype) -> str:
    from dflash_core.cpu_kernels import active_kernels

    cfg = target.config
    from dflash_core.timing import machine_identity

    ident = {
        **(machine_identity() if device.type == "cpu" else {}),
        "device": _device_name(device), "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "dtype": str(dtype), "model": getattr(cfg, "_name_or_path", ""), "type": cfg.model_type,
        "shape": [cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.intermediate_size],
        "draft": [draft.config.num_hidden_layers, draft.config.block_size,
                  getattr(draft.config, "draft_vocab_size", None)] if draft is not None else None,
        "torch": torch.__version__,
        "kernels": active_kernels(target),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _cost_cache_dir() -> Path:
    from dflash_core.timing import cache_root

    return cache_root() / "costs"


def median_seconds(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn()``: CUDA events on ``device``'s current stream on CUDA, perf_counter on CPU."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)  # not the current GPU's: the model may run on another one
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def measure_cost_model(target, draft, grid: tuple[int, ...] | None = None, context: int = 256, repeats: int = 3,
                       use_cache: bool = True, cap: int | None = None) -> CostModel:
    """Time one decoding round as the loop spends it, for N draft nodes on top of a ``context``-token target cache.

    ``verify_s(N)``: compiling root + N nodes (ids, positions, ancestor mask), the target forward over them with the
    drafter's taps, the walk, compacting the cache to an accepted path and gathering the next context features.
    ``fixed_s``: the drafter pass with its LM head and the policy itself (best-first tree at ``cap`` nodes, the size
    ``auto`` really builds, then the choice of prefix). Cached per (device, model, dtype, context, cap) under
    ``$XDG_CACHE_HOME/ddtree/costs``.
    """
    from dflash_core import TargetAdapter
    from dflash_core.decoding import commit_path, draft_block, draft_states, verify_proposal, verify_walk
    from dflash_core.model import DraftCache

    adapter = TargetAdapter(target, draft.config.target_layer_ids if draft is not None else ())
    device, dtype = adapter.device, adapter.dtype
    cap = default_cap(device) if cap is None else cap
    if grid is None:
        grid = (0, 1, 2, 4, 8, 16, 32, 48, 64, 96, 128) + ((192, 256, 384, 512, 768, 1024) if device.type == "cuda" else ())
    key = _cost_key(target, draft, device, dtype)
    path = _cost_cache_dir() / f"{key}-ctx{context}-cap{cap}.json"
    from dflash_core.timing import read_cached_json, write_cached_json

    model = read_cached_json(path, CostModel.from_json) if use_cache else None
    if model is not None and tuple(model.nodes) == tuple(grid):
        return model
    vocab = adapter.vocab_size
    rows = max(draft.block_size - 1 if draft is not None else 15, 1)
    gen = torch.Generator().manual_seed(0)
    cache = adapter.new_cache()
    adapter.forward(torch.randint(0, vocab, (context,), generator=gen), torch.arange(context), cache)
    verify = []
    for n in grid:
        # the tree the policy verifies: a prefix of the best-first tree built at the cap
        tree = truncate_tree(build_tree(torch.randn(rows, vocab, generator=gen) * 3, max(cap, n)), n)
        root = int(torch.randint(0, vocab, (1,), generator=gen))
        deepest = int(tree.depths.argmax()) if len(tree) else -1
        accepted = []
        while deepest >= 0:  # an accepted path that is not a prefix, so compaction really gathers
            accepted.insert(0, deepest)
            deepest = int(tree.parents[deepest])

        def run():  # the loop's verify and commit steps, then back to the measured context
            out = verify_proposal(adapter, cache, tree, root, context, with_features=draft is not None)
            verify_walk(tree, out.logits, 0.0, None)
            commit_path(adapter, cache, context, accepted, out.features)
            adapter.crop(cache, context)

        run()  # warm-up for this shape
        verify.append(median_seconds(run, repeats, device))
    fixed = 0.0
    if draft is not None:
        feats = adapter.forward(torch.randint(0, vocab, (context,), generator=gen), torch.arange(context),
                                adapter.new_cache()).features
        policy = AutoBudget(CostModel((0, 1), (1.0, 1.0), 0.0), cap=cap, calibrate=False)  # any curve: timed, not used
        new = min(4, context - 1)  # a steady round: a few newly committed tokens join the drafter's cache
        dcache = DraftCache()
        draft_states(draft, adapter, 0, feats[: context - new], context - new, dcache)  # the context before them
        root = int(torch.randint(0, vocab, (1,), generator=gen))

        def draft_round():  # the loop's draft step and the policy's tree
            policy.propose(draft_block(draft, adapter, root, feats[context - new:], context, dcache), [])
            dcache.crop(context - new)

        draft_round()
        fixed = median_seconds(draft_round, repeats, device)
    model = CostModel(tuple(grid), tuple(verify), fixed, key, context)
    if use_cache:
        write_cached_json(path, model.to_json())
    return model


# ---------------------------------------------------------------------------------------------------- the policy
def best_prefix(path_probs: np.ndarray, cost: CostModel, rate: float | None = None,
                seconds: np.ndarray | None = None) -> int:
    """The tree size N in 0..len(path_probs) to verify (smallest N on ties).

    ``rate=None`` (the ratio rule): argmax_N (1 + sum_{i<=N} p_i) / round_seconds(N), the best tokens per second of
    this round alone. ``rate`` = lambda > 0 (the marginal rule): argmax_N (1 + sum_{i<=N} p_i) - lambda *
    round_seconds(N), i.e. add nodes while each one's expected tokens pay for its cost at the run's long-run rate.
    The marginal rule maximizes the long-run rate (sum tokens / sum seconds over many rounds) when lambda is that
    rate (Dinkelbach): the ratio rule stops too early in confident rounds and too late in doubtful ones.
    ``seconds``: ``cost.round_seconds(0..M)`` precomputed for some M >= len(path_probs) (saves the interpolation).
    """
    n = np.arange(len(path_probs) + 1)
    gain = 1.0 + np.concatenate([[0.0], np.cumsum(path_probs)])
    seconds = cost.round_seconds(n) if seconds is None else seconds[: len(n)]
    if rate is None:
        return int(np.argmax(gain / seconds))
    return int(np.argmax(gain - rate * seconds))


def truncate_tree(tree: DraftTree, n: int) -> DraftTree:
    """The first ``n`` nodes of a best-first tree (a valid tree: every parent precedes its children)."""
    return DraftTree(tree.token_ids[:n], tree.parents[:n], tree.depths[:n], tree.log_probs[:n])


@dataclass(frozen=True)
class Round:
    """What one verified round tells the policy: the drafter's path log-probabilities and depths of the verified
    nodes, which of them the target accepted, and the round's modeled seconds."""

    log_p: np.ndarray  # [n] float64
    depths: np.ndarray  # [n] int
    accepted: np.ndarray  # [n] bool: node on the accepted path
    seconds: float

    @property
    def tokens(self) -> int:
        """Tokens the round committed: the accepted draft tokens and the bonus."""
        return int(self.accepted.sum()) + 1


CALIBRATIONS = ("none", "power", "depth", "bucket")
RULES = ("marginal", "ratio")
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


def calibrated_probs(log_p: np.ndarray, depths: np.ndarray, rounds, method: str, prior: float = 2.0) -> np.ndarray:
    """The acceptance probability of each node (path log-prob ``log_p``, depth ``depths``) learnt from ``rounds``
    (a :class:`RoundMemory` or a sequence of :class:`Round`).

    * ``none``   -- the drafter's own path probability;
    * ``power``  -- p ** beta, one exponent for all nodes with sum p ** beta = accepted tokens over ``rounds``;
    * ``depth``  -- f_d * p per depth d, f_d = (accepted at d + prior) / (sum of p at d + prior): the drafter's
      over- or under-confidence may grow with depth (depths beyond those seen take the deepest seen factor);
    * ``bucket`` -- per bucket of log p, the observed acceptance rate shrunk toward p:
      (accepted in bucket + prior * p) / (nodes in bucket + prior) (a histogram / reliability-diagram fit).

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
    if method == "depth":
        factor = (memory.depth_obs + prior) / (memory.depth_pred + prior)
        last = 1.0
        for d in range(len(factor)):  # unseen depths: the factor of the deepest seen depth above them
            if memory.depth_nodes[d] > 0:
                last = factor[d]
            else:
                factor[d] = last
        return np.clip(factor[np.minimum(depths.astype(int), _MAX_DEPTH)] * p, 0.0, 1.0)
    mine = np.searchsorted(_BUCKET_EDGES, log_p)
    return (memory.bucket_hits[mine] + prior * p) / (memory.bucket_nodes[mine] + prior)


class AutoBudget:
    """Per-round tree size that maximizes committed tokens per second under a measured cost curve.

    Each round the best-first tree is built up to ``cap`` nodes (``chain=True``: the drafter's top-1 chain, i.e. a
    DFlash block of chosen length), the nodes' acceptance probabilities are estimated (``calibrate``: see
    :func:`calibrated_probs`) and the prefix to verify is chosen by ``rule`` (see :func:`best_prefix`; the marginal
    rule uses the committed tokens per modeled second of the rounds remembered so far as its rate). Nothing here
    reads a clock: given the same drafter logits and feedback the choices are the same (replayable).

    ``memory``: the rounds learnt from (a :class:`RoundMemory` of at most ``window`` rounds). :meth:`for_models`
    shares one memory between the generations of the same target, drafter, machine, temperature and policy kind in a
    process, so a new prompt starts calibrated. Neither calibration nor the rule ever changes the output, only the tree size.
    """

    uses_draft = True

    def __init__(self, cost: CostModel, cap: int = 128, calibrate: bool | str = True, window: int = 256,
                 rule: str = "marginal", chain: bool = False, memory: RoundMemory | None = None,
                 warmup: int = 4) -> None:
        if cap < 0:
            raise ValueError(f"cap must be >= 0, got {cap}")
        method = (DEFAULT_CALIBRATION if calibrate else "none") if isinstance(calibrate, bool) else calibrate
        if method not in CALIBRATIONS:
            raise ValueError(f"unknown calibration {calibrate!r}: use one of {CALIBRATIONS} (or True / False)")
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}: use one of {RULES}")
        self.cost, self.cap, self.calibrate, self.rule, self.chain = cost, cap, method, rule, chain
        self.name = "chain-auto" if chain else "auto"
        self.memory = memory if memory is not None else RoundMemory(window)
        self.warmup = warmup
        self._seconds = np.asarray(cost.round_seconds(np.arange(cap + 1)), dtype=float)  # per tree size, once
        self._pending: tuple[np.ndarray, np.ndarray, float] | None = None
        self.chosen: list[int] = []  # tree size picked each round (for studies)

    @classmethod
    def for_models(cls, target, draft, cap: int | None = None, calibrate: bool | str = True,
                   cost: CostModel | None = None, context: int | None = None, profile: str | Path | None = None,
                   rule: str = "marginal", chain: bool = False, temperature: float = 0.0,
                   shared: bool = True, window: int = 256) -> "AutoBudget":
        """The policy with the cost curve of ``target`` + ``draft`` on this machine: ``cost`` if given, else the
        curve of a GPU ``profile`` (``experiments.gpu_check``), else measured (once, then cached) on a cache of
        ``context_bucket(context)`` tokens (``context``: the prompt length; default 256). ``shared``: continue the
        memory of earlier generations with the same models, machine, ``temperature``, cap, rule and kind."""
        cap = cap if cap is not None else default_cap(target.lm_head.weight.device)
        if cost is None and profile is not None:
            cost = CostModel.from_profile(profile, context=context)
        if cost is None:
            cost = measure_cost_model(target, draft, context=context_bucket(context) if context else 256, cap=cap)
        memory = None
        if shared:
            key = (cost.key or id(target), id(draft), float(temperature), cap, rule, chain, str(calibrate))
            memory = _SHARED_MEMORY.setdefault(key, RoundMemory(window))
        return cls(cost, cap=cap, calibrate=calibrate, rule=rule, chain=chain, memory=memory)

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

    def observe(self, accepted_draft_tokens: int, path: list[int] | None = None) -> None:
        """Feed back the round just verified: how many draft tokens the target accepted and (when known) which
        nodes (indices into the proposal). Without ``path`` the accepted nodes are taken as the best-first
        tree's most probable node at each depth up to the accepted count (exact for a chain)."""
        if self._pending is None:
            return
        log_p, depths, seconds = self._pending
        self._pending = None
        accepted = np.zeros(len(log_p), dtype=bool)
        if path is not None:
            accepted[np.asarray(path, dtype=int)] = True
        else:
            for d in range(1, accepted_draft_tokens + 1):
                at = np.flatnonzero(depths == d)
                if len(at):
                    accepted[at[np.argmax(log_p[at])]] = True
        self.memory.append(Round(log_p, depths, accepted, seconds))

    def propose(self, draft_logits: torch.Tensor, history: list[int]):
        if self.chain:
            from dflash_core.decoding import Chain

            full = Chain().propose(draft_logits[: self.cap], history)
            log_p = full.log_probs.double().numpy()
            depths = np.arange(1, len(log_p) + 1)
        else:
            full = build_tree(draft_logits, self.cap)
            log_p = full.log_probs.double().numpy()
            depths = full.depths.numpy()
        ready = len(self.memory) >= self.warmup
        probs = calibrated_probs(log_p, depths, self.memory if ready else (), self.calibrate)
        n = best_prefix(probs, self.cost, self.rate if self.rule == "marginal" else None, self._seconds)
        self.chosen.append(n)
        self._pending = (log_p[:n], depths[:n], float(self._seconds[n]))
        if self.chain:
            from dflash_core.decoding import ChainProposal

            return ChainProposal(full.token_ids[:n], full.log_probs[:n])
        return truncate_tree(full, n)


_SHARED_MEMORY: dict[tuple, RoundMemory] = {}


def forget_shared_memory() -> None:
    """Drop what ``AutoBudget.for_models`` policies learnt in this process (tests, or a changed workload)."""
    _SHARED_MEMORY.clear()


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
