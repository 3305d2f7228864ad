"""ddtree: the optimal best-first draft tree from one DFlash pass, one-pass tree verification, ddtree_generate;
sampled trees with recursive rejection sampling for T > 0 (``tree="sampled"``)."""

from dflash_core.decoding import compile_proposal as compile_tree
from dflash_core.decoding import follow

from .build import build_tree, reference_build_tree
from .generate import TREE_KINDS, FixedBudget, ddtree_generate, make_policy
from .sampled import RecursiveRejection, SampledDraftTree, SampledTree, sample_tree
from .tree import DraftTree

__all__ = [
    "DraftTree", "FixedBudget", "RecursiveRejection", "SampledDraftTree", "SampledTree", "TREE_KINDS", "build_tree",
    "compile_tree", "ddtree_generate", "follow", "make_policy", "reference_build_tree", "sample_tree",
]
