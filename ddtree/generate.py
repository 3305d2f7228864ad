"""``ddtree_generate``: DDTree on dflash_core's one decode loop, with a pluggable tree policy.

Each round the drafter's per-position logits become a best-first draft tree (:func:`ddtree.build_tree`), the target
verifies every branch in one forward under an ancestor mask, and the walk keeps the longest path the target agrees
with plus the target's own next token. Policies:

* ``budget="chain"`` -- the drafter's top-1 token per depth, i.e. exactly DFlash;
* ``budget=<int>``  -- a fixed node budget per round (the DDTree paper's setting);
* ``budget="auto"`` -- per-round tree size chosen from a measured round-cost curve (see :mod:`ddtree.budget`);
* ``budget="chain-auto"`` -- DFlash with a per-round chain length chosen the same way.

Tree kinds (``tree=``), for a fixed budget:

* ``"topk"``    -- (default) the deterministic best-first tree of the drafter's most probable prefixes, verified by
  sample-and-match (at T > 0 the target samples at each node and the walk moves into the child with that token);
* ``"sampled"`` -- children drawn without replacement from the drafter's distribution and verified by recursive
  rejection sampling (:mod:`ddtree.sampled`); lossless at T > 0 and usually accepting more there. At T = 0 there is
  nothing to sample, so ``tree="sampled"`` falls back to the top-K tree and the greedy walk.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dflash_core import Chain, GenerationResult, speculative_generate
from dflash_core.target import check_tree_attention

from .build import build_tree
from .sampled import SampledTree
from .tree import DraftTree

__all__ = ["FixedBudget", "TREE_KINDS", "ddtree_generate", "make_policy"]

TREE_KINDS = ("topk", "sampled")


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


def make_policy(budget, target=None, draft=None, tree: str = "topk", temperature: float = 0.0, seed: int = 0,
                **auto_options):
    """Turn ``budget`` and ``tree`` arguments into a proposal policy for the decode loop.

    ``tree="sampled"`` needs an int budget; at ``temperature`` 0 it gives the top-K tree (nothing to sample). The
    sampled tree draws from the drafter at the decoding temperature with a generator seeded by ``seed``. A drafter
    with a reduced vocabulary exposes its target ids (``d2t`` or ``draft_vocab``, [V'] draft index -> target id);
    they map the draft logits' columns when the loop hands over logits over those V' ids only (logits over the full
    target vocabulary, -inf outside the subset, need no map: those tokens get q = 0).
    """
    if tree not in TREE_KINDS:
        raise ValueError(f"unknown tree kind {tree!r}: use one of {TREE_KINDS}")
    if tree == "sampled":
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise ValueError(f"tree='sampled' needs an int budget >= 0, got {budget!r}")
        if temperature > 0:
            token_map = getattr(draft, "d2t", None)
            if token_map is None:
                token_map = getattr(draft, "draft_vocab", None)
            return SampledTree(budget, temperature, seed=seed, token_map=token_map)
    if budget == "chain":
        return Chain()
    if budget in ("auto", "chain-auto"):
        from .budget import AutoBudget

        return AutoBudget.for_models(target, draft, chain=budget == "chain-auto", temperature=temperature,
                                     **auto_options)
    if isinstance(budget, str):
        raise ValueError(f"unknown budget policy {budget!r}: use an int >= 0, 'chain', 'auto' or 'chain-auto'")
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
    tree: str = "topk",
) -> GenerationResult:
    """Speculative decoding with a DDTree draft tree per round; the output is exactly the target's.

    ``tree``: ``"topk"`` (default, deterministic best-first tree) or ``"sampled"`` (sampled children verified by
    recursive rejection sampling; an int budget; at T = 0 the top-K tree and greedy walk). ``result.tree_sizes`` /
    ``result.expected_acceptance`` / ``result.acceptance_lengths`` give per-round tree size, the drafter's expected
    and the actual committed tokens; ``trace=True`` keeps every round's tree in ``result.trees``. ``policy``
    overrides ``budget`` and ``tree`` with any object implementing dflash_core's ProposalPolicy. ``budget="auto"``
    (and ``"chain-auto"``) measures its cost curve at the prompt's length (rounded up to a power of two; cached per machine and model).
    Trees need a target whose attention backend applies a 4D mask (SDPA, eager, flex): anything else raises
    ``IncompatibleModelError``; ``budget="chain"`` and ``"chain-auto"`` run on any backend.
    """
    chain = isinstance(policy, Chain) or getattr(policy, "chain", False) is True
    if not chain and (policy is not None or budget not in ("chain", "chain-auto")):
        check_tree_attention(target)  # before any work: a tree needs a backend that applies the 4D mask
    if policy is None:
        context = int(input_ids.shape[-1]) if isinstance(input_ids, torch.Tensor) else None
        policy = make_policy(budget, target, draft, tree=tree, temperature=temperature, seed=seed,
                             **({"context": context} if budget in ("auto", "chain-auto") else {}))
    return speculative_generate(target, draft, input_ids, policy, max_new_tokens, temperature, stop_token_ids, seed,
                                block_size=block_size, trace=trace)
