"""Where a drafter learns: anchors in the response and the loss weight of each block position.

Per sequence, ``anchors`` random anchor positions are drawn inside the response; every anchor opens a block
``[token at anchor, MASK x (b-1)]`` whose position k predicts the token k places after the anchor. All blocks of a
sequence go through ONE drafter forward: the blocks are concatenated and an attention mask lets each block see the
context features strictly before its anchor plus its own block (bidirectionally), exactly what the drafter sees when it
drafts from that anchor during decoding. The loss at block position k (1-based among predicted positions) is weighted
by ``exp(-(k-1)/gamma)``: early positions gate the acceptance of every later one. The block inputs, labels and
attention mask are :mod:`dflash_core.blocks` (offline replay lays blocks out the same way).
"""

from __future__ import annotations

import torch

__all__ = ["position_weights", "sample_anchors"]


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[b-1] loss weight of predicted block position k = 1..b-1: exp(-(k-1)/gamma)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(prompt_len: int, seq_len: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """[A] sorted distinct anchor positions in [prompt_len, seq_len-2] (each has at least one label after it).

    During decoding the block root is always a generated token, so anchors lie in the response; A = min(n, #valid).
    """
    lo, hi = prompt_len, seq_len - 1  # anchors in [lo, hi)
    count = hi - lo
    if count <= 0:
        return torch.zeros(0, dtype=torch.long)
    pick = torch.randperm(count, generator=generator)[: min(n, count)]
    return (lo + pick).sort().values
