"""``ddtree_generate``: DDTree on dflash_core's one decode loop, with a pluggable tree policy.

Each round the drafter's per-position logits become a best-first draft tree (:func:`ddtree.build_tree`), the target
verifies every branch in one forward under an ancestor mask, and the walk keeps the longest path the target agrees
with plus the target's own next token. Policies:

* ``budget="chain"`` -- the drafter's top-1 token per depth, i.e. exactly DFlash;
* ``budget=<int>``  -- a fixed node budget per round (the DDTree paper's setting);
* ``budget="auto"`` -- per-round budget chosen from a measured verify-cost curve (see :mod:`ddtree.budget`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from dflash_core import Chain, GenerationResult, speculative_generate

from .build import build_tree
from .tree import DraftTree

__all__ = ["FixedBudget", "ddtree_generate", "make_policy"]


class FixedBudget:
    """The best tree of at most ``budget`` nodes under the drafter's factorized distribution, every round."""

    uses_draft = True

    def __init__(self, budget: int) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"budget must be a non-negative int, 'chain' or 'auto', got {budget!r}")
        self.budget = budget
        self.name = f"fixed-{budget}"

    def propose(self, draft_logits: torch.Tensor, history: list[int]) -> DraftTree:
        return build_tree(draft_logits, self.budget)


def make_policy(budget, target=None, draft=None, **auto_options):
    """Turn a ``budget`` argument into a proposal policy for the decode loop."""
    if budget == "chain":
        return Chain()
    if budget == "auto":
        from .budget import AutoBudget

        return AutoBudget.for_models(target, draft, **auto_options)
    if isinstance(budget, str):
        raise ValueError(f"unknown budget policy {budget!r}: use an int >= 0, 'chain' or 'auto'")
    return FixedBudget(budget)


def ddtree_generate(
    target,
    draft,
    input_ids: torch.Tensor,
    budget: int | str = 32,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] | None = None,
    seed: int = 0,
    block_size: int | None = None,
    trace: bool = False,
    policy=None,
) -> GenerationResult:
    """Speculative decoding with a DDTree draft tree per round; the output is exactly the target's.

    ``result.tree_sizes`` / ``result.expected_acceptance`` / ``result.acceptance_lengths`` give per-round tree size,
    the drafter's expected and the actual committed tokens; ``trace=True`` keeps every round's tree in
    ``result.trees``. ``policy`` overrides ``budget`` with any object implementing dflash_core's ProposalPolicy.
    """
    policy = policy or make_policy(budget, target, draft)
    return speculative_generate(target, draft, input_ids, policy, max_new_tokens, temperature, stop_token_ids, seed,
                                block_size=block_size, trace=trace)
