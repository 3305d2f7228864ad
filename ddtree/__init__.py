"""ddtree: the optimal best-first draft tree from one DFlash pass and ``ddtree_generate``, with its tree policies
(fixed budgets, ``auto`` and the round memory it learns into, sampled trees for T > 0, lookup branches).

The root exports what a researcher uses; internals stay importable from their modules (``ddtree.build`` for the
reference builder, ``ddtree.sampled`` for the recursive rejection rule, ``ddtree.cost`` for the cost model, ...).
"""

from dflash_core.tree import DraftTree

from .budget import AutoBudget, RoundMemory
from .build import build_tree
from .generate import FixedBudget, ddtree_generate, make_policy
from .lookup import LookupTreePolicy
from .sampled import SampledTreePolicy

__all__ = ["AutoBudget", "DraftTree", "FixedBudget", "LookupTreePolicy", "RoundMemory", "SampledTreePolicy",
           "build_tree", "ddtree_generate", "make_policy"]
