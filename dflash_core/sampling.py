"""The target's sampling distribution: temperature, then top-k, top-p and min-p, with transformers' names and meaning.

transformers' ``generate()`` samples from ``softmax(filtered(logits / T))``, where the warpers run in the order
temperature, top-k, top-p, min-p and each sets the logits it removes to -inf:

* ``top_k`` (int, 0 or None = off): keep the k largest logits (and every logit tied with the k-th);
* ``top_p`` (in (0, 1], 1 or None = off): sort ascending, remove the tokens whose cumulative probability is at most
  1 - top_p, always keeping the most likely token (nucleus sampling);
* ``min_p`` (in [0, 1], 0 or None = off): remove the tokens whose probability is below min_p times the most likely
  token's, always keeping that token.

Every verification rule of this toolkit reads the target's distribution at a node as ``softmax(logits / T)``. Since
the filters only remove tokens, ``softmax(filtered / T)`` is ``softmax(logits' / T)`` with ``logits'`` the logits
whose removed entries are -inf (:meth:`Sampling.filter`): so filtering the verified logits before the walk makes
every rule (sample-and-match over chains and top-K trees, recursive rejection over sampled trees, any tree's own
``verify``) sample from the filtered distribution, exactly as plain decoding with the same filters does. At T = 0
nothing is filtered: the argmax survives every filter.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

__all__ = ["Sampling"]


@dataclass(frozen=True)
class Sampling:
    """A checked sampling setting (``Sampling.check`` validates; None means off for every filter)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    @classmethod
    def check(cls, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
              min_p: float | None = None) -> Sampling:
        """Raise ValueError for an out-of-range setting, saying which and what is allowed; normalise "off" values
        (top_k 0, top_p 1, min_p 0) to None."""
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
                or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0):
            raise ValueError(f"top_k must be an int >= 0 (0 or None = off), got {top_k!r}")
        for name, value, low_open in (("top_p", top_p, True), ("min_p", min_p, False)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                    or not (0 < value <= 1 if low_open else 0 <= value <= 1):
                allowed = "in (0, 1] (1 or None = off)" if low_open else "in [0, 1] (0 or None = off)"
                raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
        return cls(float(temperature), int(top_k) if top_k else None,
                   float(top_p) if top_p is not None and top_p < 1 else None,
                   float(min_p) if min_p else None)

    @property
    def filters(self) -> bool:
        """Whether anything is filtered (a filter is set and the temperature samples)."""
        return self.temperature > 0 and (self.top_k is not None or self.top_p is not None or self.min_p is not None)

    def describe(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}

    def filter(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [..., V] with the entries the filters remove set to -inf (float32; unchanged when nothing is
        filtered). ``softmax(result / T)`` is the distribution transformers samples from with these settings."""
        if not self.filters:
            return logits
        scores = logits.float() / self.temperature  # the filters see the tempered logits, as transformers' do
        remove = torch.zeros_like(scores, dtype=torch.bool)
        if self.top_k is not None:
            k = min(self.top_k, scores.shape[-1])
            remove |= scores < torch.topk(scores, k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(remove, -math.inf)
        if self.top_p is not None:
            ordered, order = torch.sort(scores, dim=-1)  # ascending
            drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - self.top_p
            drop[..., -1] = False  # the most likely token stays
            remove |= torch.zeros_like(drop).scatter(-1, order, drop)
            scores = scores.masked_fill(remove, -math.inf)
        if self.min_p is not None:
            probs = scores.softmax(dim=-1)
            drop = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
            drop.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
            remove |= drop
        return logits.float().masked_fill(remove, -math.inf)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] the sampling distribution softmax(filtered / T) (T > 0)."""
        return torch.softmax(self.filter(logits).float() / self.temperature, dim=-1)
