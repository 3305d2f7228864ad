"""The drafter's best tree (or chain) at a node cap: what ``budget="auto"`` chooses a prefix of each round, and what
the fixed part of its measured round cost times.

One function, below both users: the policy (:mod:`ddtree.budget`) proposes a prefix of this tree, and the cost
measurement (:mod:`ddtree.cost`) times building it; the two must build the same tree, and neither module has to
import the other for it.
"""

from __future__ import annotations

import dataclasses

from dflash_core.policy import Chain, DraftBlock
from dflash_core.tree import DraftTree

from .build import build_tree
from .conditioned import build_markov_tree


def cap_tree(block: DraftBlock, cap: int, chain: bool, history: list[int]) -> DraftTree:
    """The best-first tree of ``cap`` nodes from the round's ``block`` (the top-1 chain of at most ``cap`` tokens
    when ``chain``), under the conditioned distribution when the drafter has a Markov head (``block.scorer``)."""
    if chain:
        return Chain().propose(dataclasses.replace(block, logits=block.logits[:cap], _full=None), history)
    if block.scorer is not None:
        return build_markov_tree(block.scorer, cap, block.root, block.token_map)
    return build_tree(block.logits, cap, token_map=block.token_map)
