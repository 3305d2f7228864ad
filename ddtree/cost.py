"""Round cost curves for ``budget="auto"``: what one decoding round costs on this machine, by tree size.

A round verifying N draft nodes costs ``t_fixed + t_verify(N)`` seconds (:class:`CostModel`). Both parts are measured
as the decode loop spends them (:func:`measure_cost_model`): ``t_verify(N)`` is everything in a round that grows with
the tree (compiling ids, positions and the ancestor mask, the target's forward over N+1 tokens on a cache of the
caller's context length, the walk, the cache compaction) and ``t_fixed`` the rest (the drafter pass with its LM head,
and the policy building its tree at the cap and choosing the prefix). For chains (``chain=True``, what
``budget="chain-auto"`` prices) the N nodes form a chain verified causally, without a mask, exactly as the loop
verifies chains; so chains are priced on targets whose attention refuses masks (flash attention) too.

Curves are cached (:func:`dflash_core.timing.cached_json`) per machine (CPU, threads, torch, the speed environment),
device, model pair, dtype, CPU kernels, proposal kind, cap and context length; a prompt's context length is rounded up
to its bucket (:func:`context_bucket`, powers of two). :func:`calibrate` measures every bucket once per machine, ahead
of any timed generation; ``auto`` then asks ``measure_cost_model(..., extrapolate=True)``, which reads the bucket, or
derives a bucket nobody measured from those measured (:func:`across_contexts`: between or below measured lengths, or
past them where the bucket cannot be measured on the target), and otherwise measures it (logged on the ``ddtree``
logger, and reported by the policy as ``calibration_s``). A GPU profile written by
``experiments.studies.gpu_check`` can stand in (:meth:`CostModel.from_profile`).

A measured curve is a starting point: :class:`OnlineCost` corrects it from the loop's own round timings, and
:func:`curve_error` says how far the corrected curve moved from the measured one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from dflash_core import decoding
from dflash_core.cpu_kernels import active_kernels
from dflash_core.target import TargetAdapter
from dflash_core.timing import cache_path, cached_json, machine_key, read_cached_json, time_samples
from dflash_core.tree import DraftTree

from .build import best_tree, build_tree

__all__ = ["CostModel", "OnlineCost", "across_contexts", "calibrate", "context_bucket", "cost_key", "curve_error",
           "default_cap", "default_grid", "isotonic", "measure_cost_model"]

log = logging.getLogger("ddtree")


def default_cap(device: torch.device, batch: int = 1) -> int:
    """The largest tree ``auto`` builds per round: 1024 nodes on CUDA, 128 on a CPU; 24 per sequence on a CPU in a
    batch of ``batch`` > 1 sequences (in a batch every tree is padded to the largest, so a CPU's batch round grows
    steeply with the cap; the cap was chosen against others side by side, docs/results.md)."""
    if torch.device(device).type == "cuda":
        return 1024
    return 128 if batch == 1 else 24


def context_bucket(length: int) -> int:
    """The context length a cost curve is measured at for a prompt of ``length`` tokens: the next power of two
    (at least 64), so prompts of similar length share one measurement."""
    return max(64, 1 << max(0, int(length) - 1).bit_length())


def default_grid(device: torch.device, rows: int, chain: bool = False) -> tuple[int, ...]:
    """The tree sizes a curve is measured at: 0..128 on a CPU, 0..1024 on CUDA; for chains 0..``rows`` (the
    drafter's block minus its root: no chain is longer)."""
    grid = (0, 1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
    if torch.device(device).type == "cuda":
        grid += (192, 256, 384, 512, 768, 1024)
    if chain:
        return tuple(n for n in grid if n < rows) + (rows,)
    return grid


# ---------------------------------------------------------------------------------------------------- cost model
def isotonic(y: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to ``y`` in least squares (pool adjacent violators, equal weights)."""
    blocks: list[list[float]] = []  # [sum, count] per pooled block
    for v in np.asarray(y, dtype=float):
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.concatenate([np.full(int(c), t / c) for t, c in blocks]) if blocks else np.zeros(0)


@dataclass(frozen=True)
class CostModel:
    """Seconds per round as a function of the number of draft nodes: ``fixed_s + verify(N)``.

    ``verify`` is the measured median time of the N-dependent part of a round at the grid ``nodes``, made monotone
    and interpolated linearly in N (extrapolated linearly past the last point). Monotone by the least-squares
    non-decreasing fit (:func:`isotonic`), not a running maximum: one point slowed by another process would lift
    every larger size to its value under a running maximum (a flat curve on which every tree looks free), while the
    fit pools it with its neighbours.
    """

    nodes: tuple[int, ...]  # measured tree sizes, increasing, starting at 0
    verify_s: tuple[float, ...]  # median seconds of the N-dependent part of a round (the target forward and more)
    fixed_s: float  # drafter pass + tree building at the cap + per-round overhead (seconds)
    key: str = ""
    context: int = 0  # tokens in the target's cache the curve was measured on (0 = unknown)
    measured_s: float = field(default=0.0, compare=False)  # seconds spent measuring it just now (0: cache, profile)

    def __post_init__(self) -> None:
        if len(self.nodes) != len(self.verify_s) or len(self.nodes) < 2:
            raise ValueError("CostModel needs at least two (nodes, verify_s) points of equal length")
        if list(self.nodes) != sorted(self.nodes):
            raise ValueError("CostModel.nodes must be increasing")
        monotone = isotonic(np.asarray(self.verify_s, dtype=float))
        object.__setattr__(self, "nodes", tuple(int(n) for n in self.nodes))
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
        return {"nodes": list(self.nodes), "verify_s": list(self.verify_s), "fixed_s": self.fixed_s, "key": self.key,
                "context": self.context}

    @classmethod
    def from_json(cls, raw: dict) -> "CostModel":
        return cls(tuple(raw["nodes"]), tuple(raw["verify_s"]), float(raw["fixed_s"]), raw.get("key", ""),
                   int(raw.get("context", 0)))

    @classmethod
    def from_profile(cls, profile: str | Path | dict, model: str | None = None,
                     context: int | None = None) -> "CostModel":
        """The curve of ``model`` (default: the profile's first) from a ``experiments.studies.gpu_check`` profile, at
        the measured context length nearest to ``context`` (by ratio; default: the longest measured)."""
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


def across_contexts(curves: Sequence[CostModel], context: int) -> CostModel:
    """The curve at ``context`` tokens from curves measured at other context lengths (same models and grid).

    Per tree size (and for ``fixed_s``), linear in the context length: between the two measured lengths around
    ``context``; past the longest, extrapolated from the two longest with a slope of at least 0 (attention over a
    longer cache never costs less); below the shortest, the shortest's curve (a slight overestimate). The online
    correction (:class:`OnlineCost`) takes it from there."""
    curves = sorted(curves, key=lambda c: c.context)
    nodes = curves[0].nodes
    lengths = np.array([c.context for c in curves], dtype=float)
    verify = np.stack([c.verify(np.asarray(nodes)) for c in curves])  # [curves, nodes]
    fixed = np.array([c.fixed_s for c in curves])
    if len(curves) == 1 or context <= lengths[0]:
        v, f = verify[0], fixed[0]
    else:
        j = min(int(np.searchsorted(lengths, context)), len(curves) - 1)
        i = j - 1
        w = (context - lengths[i]) / (lengths[j] - lengths[i])
        if context > lengths[-1]:  # extrapolate: never cheaper than the longest measured
            w = max(w, 1.0)
            v = verify[j] + (w - 1.0) * np.maximum(verify[j] - verify[i], 0.0)
            f = fixed[j] + (w - 1.0) * max(fixed[j] - fixed[i], 0.0)
        else:
            v, f = verify[i] + w * (verify[j] - verify[i]), fixed[i] + w * (fixed[j] - fixed[i])
    return CostModel(nodes, tuple(v), float(f), curves[0].key, int(context))


# ---------------------------------------------------------------------------------------------------- measuring
def cost_key(target, draft, device: torch.device, dtype: torch.dtype, chain: bool = False) -> str:
    """The name of a cost curve's cache entry, without the context and cap: this machine, device, models, dtype,
    CPU kernels and proposal kind (chains and trees are priced apart)."""
    cfg = target.config
    return machine_key({
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype), "model": cfg._name_or_path, "type": cfg.model_type,
        "shape": [cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.intermediate_size],
        "draft": [draft.config.num_hidden_layers, draft.config.block_size,
                  draft.config.draft_vocab_size] if draft is not None else None,
        "kernels": active_kernels(target), "proposal": "chain" if chain else "tree",
        # how, and on which attention path: curves measured by an older rule or path are measured again
        "measured": "interleaved-3", "attention": "folded-groups",
    })


def _rows(draft) -> int:
    """Draft tokens per block: the deepest tree, the longest chain."""
    return max(draft.block_size - 1 if draft is not None else 15, 1)


@torch.inference_mode()
def measure_cost_model(target, draft, grid: Sequence[int] | None = None, context: int = 256, repeats: int = 3,
                       use_cache: bool = True, cap: int | None = None, chain: bool = False,
                       extrapolate: bool = False, batch: int = 1) -> CostModel:
    """Time one decoding round as the loop spends it, for N draft nodes on top of a ``context``-token target cache.

    ``verify_s(N)``: compiling root + N nodes (ids, positions, ancestor mask), the target forward over them with the
    drafter's taps, the walk, compacting the cache to an accepted path and gathering the next context features.
    ``fixed_s``: the drafter pass with its LM head and the best-first tree at ``cap`` nodes, the size ``auto`` really
    builds (:func:`ddtree.build.best_tree`, the same function the policy calls). ``chain=True``: the N nodes are a
    chain, verified without a mask, and the policy is ``chain-auto``'s. ``grid``: the sizes N (default
    :func:`default_grid`).

    Cached per machine, models, dtype, kernels, kind, ``context`` and ``cap`` under ``$XDG_CACHE_HOME/ddtree/costs``
    (``use_cache=False``: always measure, write nothing). ``extrapolate=True``: a context nobody measured is derived
    from the contexts measured for the same models (:func:`across_contexts`) when one at least as long was measured
    (or this one cannot be: ``context`` plus the largest tree past the target's positions); else it is measured now.
    A measurement is logged; its seconds are in the result's ``measured_s``.

    ``batch`` > 1: the round of a batch of that many sequences, each with its own N-node tree on its own
    ``context``-token cache (one drafter pass, one verify forward), priced
    per sequence: the batch round's seconds divided by ``batch``, so one sequence's ``auto`` weighs its nodes against
    its share of the round. One curve per batch size: the cost surface (tokens per sequence x batch size).
    """
    adapter = TargetAdapter(target, draft.config.target_layer_ids if draft is not None else ())
    cap = default_cap(adapter.device) if cap is None else cap
    grid = tuple(int(n) for n in grid) if grid is not None else default_grid(adapter.device, _rows(draft), chain)
    key = cost_key(target, draft, adapter.device, adapter.dtype, chain)
    name = f"{key}-ctx{context}-cap{cap}" + (f"-batch{batch}" if batch > 1 else "")

    def load(raw: dict) -> CostModel | None:
        model = CostModel.from_json(raw)
        return model if model.nodes == grid else None  # another grid: measured again

    if use_cache and extrapolate and batch == 1 and read_cached_json(cache_path("costs", name), load) is None:
        measured = _cached_contexts(key, cap, grid)
        fits = context + max(grid) + 1 <= _positions(target)
        # derived only within or below what was measured, or where this context cannot be measured: a curve carried
        # far past the longest measured context would price a node's attention over a cache many times shorter
        if measured and (not fits or max(c.context for c in measured) >= context):
            log.info("cost curve at %d context tokens derived from the ones measured at %s", context,
                     sorted(c.context for c in measured))
            return across_contexts(measured, context)

    def measure() -> CostModel:
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(0)
        verify, fixed = _round_seconds(adapter, draft, grid, context, repeats, cap, chain, gen, batch)
        seconds = time.perf_counter() - t0
        log.info("measured the round cost curve (%s, %d context tokens, cap %d) in %.2f s",
                 "chains" if chain else "trees", context, cap, seconds)
        return CostModel(grid, verify, fixed, key, context, measured_s=seconds)

    return cached_json("costs", name, measure, load, CostModel.to_json, use_cache)


def _positions(target) -> int:
    """The longest sequence ``target`` takes (its ``max_position_embeddings``; 32768 when it names none)."""
    return int(getattr(target.config, "max_position_embeddings", None) or 32768)


def _cached_contexts(key: str, cap: int, grid: tuple[int, ...]) -> list[CostModel]:
    """The curves cached for ``key`` and ``cap`` at any context, on ``grid``."""
    pattern = cache_path("costs", f"{key}-ctx*-cap{cap}")
    found = (read_cached_json(path, CostModel.from_json) for path in sorted(pattern.parent.glob(pattern.name)))
    return [c for c in found if c is not None and c.nodes == grid]


def _round_proposal(n: int, rows: int, vocab: int, chain: bool, gen: torch.Generator):
    """(proposal of ``n`` nodes as the policy makes it, the accepted path the commit step keeps)."""
    if chain:  # the chain is accepted whole: the commit keeps a prefix, as for every chain
        return DraftTree.chain(torch.randint(0, vocab, (n,), generator=gen), torch.zeros(n)), list(range(n))
    # the first n nodes of the tree at the cap, which the policy verifies, are the best-first tree of n nodes
    tree = build_tree(torch.randn(rows, vocab, generator=gen) * 3, n)
    deepest = int(tree.depths.argmax()) if len(tree) else -1
    accepted = []
    while deepest >= 0:  # an accepted path that is not a prefix, so compaction really gathers
        accepted.insert(0, deepest)
        deepest = int(tree.parents[deepest])
    return tree, accepted


def _round_seconds(adapter: TargetAdapter, draft, grid: tuple[int, ...], context: int, repeats: int, cap: int,
                   chain: bool, gen: torch.Generator, batch: int) -> tuple[tuple[float, ...], float]:
    """(verify seconds per grid size, fixed seconds), per sequence, of the loop's round for ``batch`` sequences on
    ``context``-token caches (:class:`~dflash_core.decoding.LiveModels`, as the loop runs it; one sequence is a
    batch of one): its verify forward with every sequence's N-node tree, the walks and the commit of an accepted
    path that is not a prefix (so the commit really gathers); and its drafter pass for all plus one cap tree per
    sequence. Each is the median of ``2 * repeats`` timings taken with every size in turn (:func:`time_samples`),
    divided by ``batch``."""
    vocab, new = adapter.vocab_size, min(4, context - 1)
    prompts = [torch.randint(0, vocab, (1, context), generator=gen) for _ in range(batch)]
    models, _ = decoding.LiveModels.prefilled(adapter, draft, prompts, draft is not None)
    features = [models.unread[s][0] if models.unread[s] else None for s in range(batch)]
    seqs, roots = list(range(batch)), [int(t) for t in torch.randint(0, vocab, (batch,), generator=gen)]

    def rewind():  # every sequence back to its context, the drafter holding all but the last ``new`` tokens
        models.rewind([context] * batch)
        for s in seqs:
            models.unread[s] = [] if features[s] is None else [features[s][context - new:]]
            models.draft_caches[s].crop(context - new)

    if draft is not None:
        for s in seqs:
            models.unread[s] = [features[s][: context - new]]
        models.lengths = [context - new] * batch  # the drafter's cache first takes the context before the round
        models.draft(seqs, roots)
        rewind()
    runs = []
    for n in grid:
        tree, accepted = _round_proposal(n, _rows(draft), vocab, chain, gen)

        def run(tree=tree, accepted=accepted):  # the loop's verify, walks and commit, then back
            for rows in models.verify(seqs, [tree] * batch, roots):
                decoding.verify_walk(tree, rows, 0.0, None)
            models.commit(seqs, [accepted] * batch, [[0]] * batch)
            rewind()

        runs.append(run)
    if draft is not None:
        def draft_round():  # the drafter pass and every sequence's tree at the cap (the tree auto chooses a prefix of)
            for block, root in zip(models.draft(seqs, roots), roots):
                best_tree(block, cap, chain)
            rewind()

        runs.append(draft_round)
    # every size in turn, repeat after repeat (each shape once untimed first): a machine whose speed drifts (memory
    # bandwidth shared with other tenants moves by 20% within seconds) slows every size alike, so the curve's shape,
    # what auto's choices read, stays right; the online correction follows its level
    seconds = [statistics.median(s) / batch for s in time_samples(runs, 2 * repeats, adapter.device, warmup=1)]
    if draft is None:
        return tuple(seconds), 0.0
    return tuple(seconds[:-1]), seconds[-1]


def calibrate(target, draft, contexts: Iterable[int] | None = None, cap: int | None = None, chain: bool = False,
              repeats: int = 3, max_context: int | None = None) -> dict[int, CostModel]:
    """Measure the round cost curve at every context bucket ``auto`` can meet, once per machine (cache hits are
    free), so that no generation measures inside its own timing: {bucket: curve}.

    ``contexts``: the prompt lengths to cover (their buckets), default every bucket from 64 up to the target's limit
    (``max_context``, default ``config.max_position_embeddings``). A bucket is measured when it fits the limit with
    the largest tree on top; the others (and any a later prompt needs) are derived from the measured ones by
    :func:`across_contexts` when ``auto`` asks for them. ``cap`` and ``chain`` as for :func:`measure_cost_model`
    (default cap: the one ``auto`` uses). (Calibrates cost curves, not the drafter's acceptance probabilities,
    which ``auto`` learns from its rounds.)"""
    device = target.lm_head.weight.device
    cap = default_cap(device) if cap is None else cap
    largest = max(default_grid(device, _rows(draft), chain))
    limit = max_context or _positions(target)
    if contexts is None:
        wanted = [1 << k for k in range(6, max(6, int(limit).bit_length()) + 1)]
    else:
        wanted = sorted({context_bucket(c) for c in contexts})
    buckets = [b for b in wanted if b + largest + 1 <= limit]
    t0 = time.perf_counter()
    curves = {b: measure_cost_model(target, draft, context=b, repeats=repeats, cap=cap, chain=chain) for b in buckets}
    log.info("cost curves for context buckets %s ready in %.1f s (%d measured now); beyond them derived",
             buckets, time.perf_counter() - t0, sum(c.measured_s > 0 for c in curves.values()))
    return curves


# ---------------------------------------------------------------------------------------------------- online
class OnlineCost:
    """A measured cost curve corrected online by the decode loop's own round timings.

    A timed round of N nodes that took s seconds gives the residual r = log(s / measured.round_seconds(N)) -- in log
    space, since a busier or slower machine is slower by a factor -- attributed to the measured grid size nearest to
    N. The correction at a grid size is the median of its last ``window`` residuals: robust to outliers (a round
    stretched by a page fault, a collector pause or another process moves nothing), and following drift. A grid size
    with fewer than ``min_rounds`` residuals takes the median of the last ``window`` residuals of all sizes (a
    machine slower at the sizes seen is taken to be slower at the others too); before ``min_rounds`` rounds the
    correction is 0. :attr:`curve` is the measured curve times exp(correction) at each grid size, interpolated
    between them as :class:`CostModel` does (``fixed_s`` takes the correction at the first grid size); it is rebuilt
    when a correction moved by more than ``tolerance`` (in log space: 0.01 ~ 1%), so a steady curve costs nothing.
    """

    def __init__(self, measured: CostModel, window: int = 32, min_rounds: int = 3, tolerance: float = 0.01) -> None:
        if window < 1 or min_rounds < 1:
            raise ValueError(f"window and min_rounds must be >= 1, got {window} and {min_rounds}")
        self.measured, self.window, self.min_rounds, self.tolerance = measured, window, min_rounds, tolerance
        self._grid = np.asarray(measured.nodes, dtype=float)
        self._base = np.asarray(measured.round_seconds(self._grid), dtype=float)  # [grid] measured round seconds
        self._local = [deque(maxlen=window) for _ in measured.nodes]  # residuals per grid size
        self._local_median = np.full(len(measured.nodes), np.nan)
        self._all: deque[float] = deque(maxlen=window)
        self._applied = np.zeros(len(measured.nodes))  # the corrections :attr:`curve` carries
        self.rounds = 0  # rounds observed
        self.curve = measured

    def observe(self, nodes: int, seconds: float) -> None:
        """One round of ``nodes`` draft nodes took ``seconds`` (wall time, draft to commit)."""
        expected = float(self.measured.round_seconds(nodes))
        if not (math.isfinite(seconds) and seconds > 0 and expected > 0):
            return
        residual = math.log(seconds / expected)
        at = int(np.argmin(np.abs(self._grid - nodes)))
        self._local[at].append(residual)
        self._all.append(residual)
        self.rounds += 1
        if len(self._local[at]) >= self.min_rounds:
            self._local_median[at] = statistics.median(self._local[at])
        corrections = self.corrections()
        if np.abs(corrections - self._applied).max() > self.tolerance:
            self._applied = corrections
            self.curve = self._corrected()

    def corrections(self) -> np.ndarray:
        """[grid] the log-factor applied to the measured curve at each grid size."""
        fallback = statistics.median(self._all) if len(self._all) >= self.min_rounds else 0.0
        return np.where(np.isnan(self._local_median), fallback, self._local_median)

    def _corrected(self) -> CostModel:
        factor = np.exp(self._applied)
        fixed = self.measured.fixed_s * float(factor[0])
        verify = np.maximum(self._base * factor - fixed, 0.0)
        return dataclasses.replace(self.measured, verify_s=tuple(verify), fixed_s=fixed, measured_s=0.0)

    def round_seconds(self, n: np.ndarray | int) -> np.ndarray:
        return self.curve.round_seconds(n)


def curve_error(online: OnlineCost | CostModel, measured: CostModel, nodes: Sequence[int] | None = None
                ) -> dict[int, float]:
    """{N: relative difference of the online curve's round seconds from the measured curve's} at ``nodes``
    (default: the measured grid): +1.0 means rounds of N nodes ran twice as long as measured."""
    nodes = measured.nodes if nodes is None else nodes
    curve = online.curve if isinstance(online, OnlineCost) else online
    return {int(n): float(curve.round_seconds(n) / measured.round_seconds(n) - 1.0) for n in nodes}
