"""Hardware-aware node budget per round (``budget="auto"``).

The best-first tree lists nodes in order of decreasing path probability, and every prefix of that order is itself a
valid (prefix-closed) tree. Under the drafter's factorized surrogate, verifying the first N nodes commits on average
``1 + sum_{i<=N} p_i`` tokens (the bonus plus each node whose whole path is accepted) and costs
``t_fixed + t_verify(N)`` seconds, where ``t_verify`` is the target's measured forward time over N+1 new tokens and
``t_fixed`` the drafter pass plus per-round bookkeeping. ``AutoBudget`` builds the tree up to a cap once and keeps the
prefix with the highest expected tokens per second.

The surrogate's probabilities are not the target's. With ``calibrate=True`` the policy fits an exponent beta online so
that ``sum p_i ** beta`` over the verified nodes matches the draft tokens the target actually accepted in recent rounds
(beta > 1 when the drafter is over-confident). Calibration changes only which prefix is chosen, never the output.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .build import build_tree
from .tree import DraftTree

__all__ = ["CostModel", "AutoBudget", "measure_cost_model", "median_seconds", "best_prefix", "truncate_tree"]


# ---------------------------------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class CostModel:
    """Seconds per round as a function of the number of draft nodes: ``fixed_s + verify(N)``.

    ``verify`` is the measured median target forward time over N+1 new tokens at the grid ``nodes``, made monotone
    and interpolated linearly in N (extrapolated linearly past the last point).
    """

    nodes: tuple[int, ...]  # measured tree sizes, increasing, starting at 0
    verify_s: tuple[float, ...]  # median seconds of one target forward over N+1 tokens
    fixed_s: float  # drafter pass + per-round overhead (seconds)
    key: str = ""

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
        return cls(tuple(raw["nodes"]), tuple(raw["verify_s"]), float(raw["fixed_s"]), raw.get("key", ""))


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


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
    """Median seconds of ``fn()``: CUDA events on CUDA, perf_counter on CPU."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def measure_cost_model(target, draft, grid: tuple[int, ...] | None = None, context: int = 256, repeats: int = 3,
                       use_cache: bool = True) -> CostModel:
    """Time the target's verify forward for N draft nodes (plus the root) on top of a ``context``-token cache, and
    the drafter's pass; cached per (device, model, dtype) under ``$XDG_CACHE_HOME/ddtree/costs``."""
    from dflash_core import TargetAdapter
    from dflash_core.model import DraftCache

    adapter = TargetAdapter(target, draft.config.target_layer_ids if draft is not None else ())
    device, dtype = adapter.device, adapter.dtype
    if grid is None:
        grid = (0, 1, 2, 4, 8, 16, 32, 48, 64, 96, 128) + ((192, 256, 384, 512, 768, 1024) if device.type == "cuda" else ())
    key = _cost_key(target, draft, device, dtype)
    path = _cost_cache_dir() / f"{key}.json"
    if use_cache and path.is_file():
        model = CostModel.from_json(json.loads(path.read_text()))
        if tuple(model.nodes) == tuple(grid):
            return model
    vocab = adapter.vocab_size
    gen = torch.Generator().manual_seed(0)
    cache = adapter.new_cache()
    adapter.forward(torch.randint(0, vocab, (context,), generator=gen), torch.arange(context), cache)
    verify = []
    for n in grid:
        tree = build_tree(torch.randn(max(draft.block_size - 1 if draft is not None else 15, 1), vocab, generator=gen) * 3, n)
        ids = torch.randint(0, vocab, (len(tree) + 1,), generator=gen)
        pos = context + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])
        vis = tree.visibility() if len(tree) else None

        def run():
            adapter.forward(ids, pos, cache, visibility=vis)
            adapter.crop(cache, context)

        run()  # warm-up for this shape
        verify.append(median_seconds(run, repeats, device))
    fixed = 0.0
    if draft is not None:
        b = draft.block_size
        feats = adapter.forward(torch.randint(0, vocab, (context,), generator=gen), torch.arange(context),
                                adapter.new_cache()).features

        def draft_pass():
            dcache = DraftCache()
            block = adapter.embed(torch.randint(0, vocab, (b,), generator=gen).to(device))[None]
            hidden = draft(block.to(next(draft.parameters()).dtype), feats[None][:, -16:], torch.arange(context, context + b),
                           torch.arange(context - 16, context), cache=dcache)
            logits = adapter.lm_head(hidden[0, 1:], draft)
            build_tree(logits, 32)

        draft_pass()
        fixed = median_seconds(draft_pass, repeats, device)
    model = CostModel(tuple(grid), tuple(verify), fixed, key)
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
    def for_models(cls, target, draft, cap: int | None = None, calibrate: bool = True,
                   cost: CostModel | None = None) -> "AutoBudget":
        device = target.lm_head.weight.device
        cap = cap if cap is not None else (1024 if device.type == "cuda" else 128)
        return cls(cost or measure_cost_model(target, draft), cap=cap, calibrate=calibrate)

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
