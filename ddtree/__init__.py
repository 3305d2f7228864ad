"""ddtree: the optimal best-first draft tree from one DFlash pass, one-pass tree verification, ddtree_generate."""

from dflash_core.decoding import compile_proposal as compile_tree
from dflash_core.decoding import follow

from .build import build_tree, reference_build_tree
from .generate import FixedBudget, ddtree_generate, make_policy
from .tree import DraftTree

__all__ = [
    "DraftTree", "FixedBudget", "build_tree", "compile_tree", "ddtree_generate", "follow", "make_policy",
    "reference_build_tree",
]
