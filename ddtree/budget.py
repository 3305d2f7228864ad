"""Hardware-aware node budget per round (``budget="auto"``).

The best-first tree lists nodes in order of decreasing path probability, and every prefix of that order is itself a
valid (prefix-closed) tree. Under the drafter's factorized surrogate, verifying the first N nodes commits on average
``1 + sum_{i<=N} p_i`` tokens (the bonus plus each node whose whole path is accepted) and costs
``t_fixed + t_verify(N)`` seconds. Both are measured as the decode loop spends them (:func:`measure_cost_model`):
``t_verify(N)`` is everything in a round that grows with the tree (compiling ids, positions and the ancestor mask, the
target's forward over N+1 tokens on a cache of the caller's context length, the walk, the cache compaction) and
``t_fixed`` the rest (the drafter pass with its LM head, and the policy building its tree at the cap and choosing the
prefix). ``AutoBudget`` builds the tree up to a cap once and keeps the prefix with the highest expected tokens per
second. A GPU profile written by ``experiments.gpu_check`` can stand in for a measurement
(:meth:`CostModel.from_profile`).

The surrogate's probabilities are not the target's. With ``calibrate=True`` the policy fits an exponent beta online so
that ``sum p_i ** beta`` over the verified nodes matches the draft tokens the target actually accepted in recent rounds
(beta > 1 when the drafter is over-confident). Calibration changes only which prefix is chosen, never the output.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .build import build_tree
from .tree import DraftTree

__all__ = ["CostModel", "AutoBudget", "measure_cost_model", "median_seconds", "best_prefix", "truncate_tree",
           "default_cap", "context_bucket"]


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
    cfg = target.config
    ident = {
        "device": _device_name(device), "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "dtype": str(dtype), "model": getattr(cfg, "_name_or_path", ""), "type": cfg.model_type,
        "shape": [cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.intermediate_size],
        "draft": [draft.config.num_hidden_layers, draft.config.block_size,
                  getattr(draft.config, "draft_vocab_size", None)] if draft is not None else None,
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _cost_cache_dir() -> Path:
    base = os.environ.get("DDTREE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ddtree")
    return Path(base) / "costs"


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
    from dflash_core.decoding import compile_proposal, verify_walk
    from dflash_core.model import DraftCache

    adapter = TargetAdapter(target, draft.config.target_layer_ids if draft is not None else ())
    device, dtype = adapter.device, adapter.dtype
    cap = default_cap(device) if cap is None else cap
    if grid is None:
        grid = (0, 1, 2, 4, 8, 16, 32, 48, 64, 96, 128) + ((192, 256, 384, 512, 768, 1024) if device.type == "cuda" else ())
    key = _cost_key(target, draft, device, dtype)
    path = _cost_cache_dir() / f"{key}-ctx{context}-cap{cap}.json"
    if use_cache and path.is_file():
        model = CostModel.from_json(json.loads(path.read_text()))
        if tuple(model.nodes) == tuple(grid):
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
        path_nodes = []
        while deepest >= 0:  # an accepted path that is not a prefix, so compaction really gathers
            path_nodes.append(deepest)
            deepest = int(tree.parents[deepest])
        keep = torch.tensor([0] + [i + 1 for i in reversed(path_nodes)], dtype=torch.long)

        def run():
            ids, pos, vis = compile_proposal(tree, root, context)
            out = adapter.forward(ids, pos, cache, visibility=vis, with_features=draft is not None)
            verify_walk(tree, out.logits, 0.0, None)
            adapter.compact(cache, context, keep)
            if out.features is not None:
                out.features[keep.to(device)]  # the drafter's next context
            adapter.crop(cache, context)

        run()  # warm-up for this shape
        verify.append(median_seconds(run, repeats, device))
    fixed = 0.0
    if draft is not None:
        b = draft.block_size
        feats = adapter.forward(torch.randint(0, vocab, (context,), generator=gen), torch.arange(context),
                                adapter.new_cache()).features
        draft_param = next(draft.parameters())
        policy = AutoBudget(CostModel((0, 1), (1.0, 1.0), 0.0), cap=cap, calibrate=False)  # any curve: timed, not used
        new = min(16, context)  # a round adds the accepted tokens' features to the drafter's cache

        def draft_round():
            dcache = DraftCache()
            block = adapter.embed(torch.randint(0, vocab, (b,), generator=gen))[None]
            where = draft_param.device
            hidden = draft(block.to(where, draft_param.dtype), feats[None][:, -new:].to(where),
                           torch.arange(context, context + b, device=where),
                           torch.arange(context - new, context, device=where), cache=dcache)
            policy.propose(adapter.lm_head(hidden[0, 1:], draft), [])

        draft_round()
        fixed = median_seconds(draft_round, repeats, device)
    model = CostModel(tuple(grid), tuple(verify), fixed, key, context)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(model.to_json(), indent=1))
        tmp.replace(path)
    return model


# ---------------------------------------------------------------------------------------------------- the policy
def best_prefix(path_probs: np.ndarray, cost: CostModel) -> int:
    """argmax_N (1 + sum_{i<=N} p_i) / round_seconds(N) over N = 0..len(path_probs) (smallest N on ties)."""
    n = np.arange(len(path_probs) + 1)
    gain = 1.0 + np.concatenate([[0.0], np.cumsum(path_probs)])
    return int(np.argmax(gain / cost.round_seconds(n)))


def truncate_tree(tree: DraftTree, n: int) -> DraftTree:
    """The first ``n`` nodes of a best-first tree (a valid tree: every parent precedes its children)."""
    return DraftTree(tree.token_ids[:n], tree.parents[:n], tree.depths[:n], tree.log_probs[:n])


class AutoBudget:
    """Per-round node budget that maximizes expected committed tokens per second under a measured cost curve."""

    uses_draft = True
    name = "auto"

    def __init__(self, cost: CostModel, cap: int = 128, calibrate: bool = True, window: int = 64) -> None:
        if cap < 0:
            raise ValueError(f"cap must be >= 0, got {cap}")
        self.cost, self.cap, self.calibrate = cost, cap, calibrate
        self.beta = 1.0
        self._history: deque[tuple[np.ndarray, int]] = deque(maxlen=window)  # (log p of verified nodes, accepted)
        self._pending: np.ndarray | None = None
        self.chosen: list[int] = []  # tree size picked each round (for studies)

    @classmethod
    def for_models(cls, target, draft, cap: int | None = None, calibrate: bool = True, cost: CostModel | None = None,
                   context: int | None = None, profile: str | Path | None = None) -> "AutoBudget":
        """The policy with the cost curve of ``target`` + ``draft`` on this machine: ``cost`` if given, else the
        curve of a GPU ``profile`` (``experiments.gpu_check``), else measured (once, then cached) on a cache of
        ``context_bucket(context)`` tokens (``context``: the prompt length; default 256)."""
        cap = cap if cap is not None else default_cap(target.lm_head.weight.device)
        if cost is None and profile is not None:
            cost = CostModel.from_profile(profile, context=context)
        if cost is None:
            cost = measure_cost_model(target, draft, context=context_bucket(context) if context else 256, cap=cap)
        return cls(cost, cap=cap, calibrate=calibrate)

    def observe(self, accepted_draft_tokens: int) -> None:
        """Feed back how many draft tokens the target accepted in the round just verified."""
        if self._pending is not None:
            self._history.append((self._pending, accepted_draft_tokens))
            self._pending = None
            if self.calibrate and len(self._history) >= 4:
                self.beta = _fit_beta(self._history)

    def propose(self, draft_logits: torch.Tensor, history: list[int]) -> DraftTree:
        tree = build_tree(draft_logits, self.cap)
        log_p = tree.log_probs.double().numpy()
        n = best_prefix(np.exp(self.beta * log_p), self.cost)
        self.chosen.append(n)
        self._pending = log_p[:n]
        return truncate_tree(tree, n)


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
