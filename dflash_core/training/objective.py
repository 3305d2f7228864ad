"""Per-position loss weights aimed at acceptance: which predicted positions of a block the loss should care about.

The drafter's loss is a weighted sum over the predicted block positions k = 1..b-1 of a per-position cross-entropy
(:func:`dflash_core.training.loss.sequence_loss`). What decoding rewards is different from what a flat cross-entropy
asks for: a block's tokens count only up to the first one the target rejects, so a position behind an early miss
earns nothing whatever its loss. Three weightings, all computed without gradient from the drafter's own predictions
on the teacher-forced block (the labels are the target's tokens, so the block's prefix is always the accepted one):

``"ce"``
    The fixed decay ``exp(-(k-1)/gamma)`` (DFlash's recipe): deeper positions matter less on average, the same for
    every block.
``"cutoff"``
    The decay, and weight 0 for every position after the drafter's first greedy miss in its block (its argmax differs
    from the label, or the label lies outside the draft vocabulary). The miss itself keeps its weight: it is the
    position whose fix would lengthen the accepted prefix. Positions behind it cannot be accepted in this block, so
    their gradient only spends capacity.
``"credit"``
    The gradient of the expected accepted length. With p_j the drafter's probability of the label at position j (0
    outside its vocabulary), a block accepts at least m tokens with probability R_m = p_1 ... p_m (the factorised
    model of acceptance that the tree builder also uses), and the expected accepted length is E = sum_m R_m. Its
    derivative with respect to log p_k is c_k = sum_{m >= k} R_m: position k gets the credit of every longer prefix
    that runs through it. Weighting each position's cross-entropy (whose gradient is -grad log p_k for the hard
    label) by the detached c_k makes the hard-label gradient exactly -grad E; no decay constant is needed, the
    drafter's own acceptance supplies it (a block that misses early gives its deep positions ~0 weight, a block the
    drafter predicts well keeps them). With soft labels mixed in, the same weights apply to the mixed term.

The weights need no extra forward: they use the log-probabilities the loss computes anyway.
"""

from __future__ import annotations

import torch

from .train_config import OBJECTIVES

__all__ = ["objective_weights"]


@torch.no_grad()
def objective_weights(objective: str, weights: torch.Tensor, logp: torch.Tensor, columns: torch.Tensor,
                      drafted: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N] loss weights of the N predicted rows under ``objective`` (``"ce"``, ``"cutoff"``, ``"credit"``).

    ``weights`` [N]: the position decay of each row; ``logp`` [N, C]: the drafter's log-probabilities; ``columns``
    [N]: the label's column in ``logp``; ``drafted`` [N] bool: whether the label can be drafted at all (False for a
    label outside the draft vocabulary: a certain miss, probability 0); ``valid`` [A, b-1] bool: which block
    positions the N rows are, row-major (each block's valid positions are a prefix of it: labels past the sequence's
    end are the only invalid ones).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if objective == "ce":
        return weights
    dev = logp.device
    valid = valid.to(dev)
    if objective == "cutoff":
        miss = (logp.argmax(-1) != columns) | ~drafted  # [N]
        grid = torch.zeros(valid.shape, dtype=torch.long, device=dev)
        grid[valid] = miss.long()
        before = grid.cumsum(1) - grid  # misses strictly before each position of its block
        return weights * (before[valid] == 0)
    p = logp.gather(1, columns[:, None])[:, 0].double().exp() * drafted  # [N] probability of the label
    grid = torch.ones(valid.shape, dtype=torch.float64, device=dev)
    grid[valid] = p
    reach = grid.cumprod(1) * valid  # R_m: the first m positions all accepted (0 past the block's valid prefix)
    credit = reach.flip(1).cumsum(1).flip(1)  # c_k = sum_{m >= k} R_m
    return credit[valid].to(weights.dtype)
