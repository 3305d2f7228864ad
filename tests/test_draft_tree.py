"""DraftTree itself: visibility against a naive ancestor walk, paths in and out, helpers, and the checks that refuse a
broken tree (the builders that make trees: tests/test_tree.py, whose oracles this file reuses)."""

from __future__ import annotations

import math

import pytest
import torch

from ddtree.build import build_tree
from dflash_core.tree import ROOT, DraftTree
from test_tree import assert_same_tree, drafter_like_logits, naive_visibility, random_logits, tree_paths


def make_tree(parents, tokens=None, depths=None, log_probs=None) -> DraftTree:
    n = len(parents)
    if depths is None:
        depths = []
        for p in parents:
            depths.append(depths[p] + 1 if 0 <= p < len(depths) else 1)
    return DraftTree(torch.tensor(tokens if tokens is not None else list(range(n)), dtype=torch.int64),
                     torch.tensor(parents, dtype=torch.int64), torch.tensor(depths, dtype=torch.int64),
                     torch.tensor(log_probs if log_probs is not None else [-0.1 * (i + 1) for i in range(n)],
                                  dtype=torch.float64))


def test_visibility_equals_naive_ancestor_walk() -> None:
    trees = [DraftTree.empty(), make_tree([-1]), make_tree([-1, 0, 1, 2]), make_tree([-1, -1, 0, 1, 0, 2, 5, 3])]
    trees += [build_tree(drafter_like_logits(15, 2000, seed), budget) for seed, budget in [(0, 64), (1, 300)]]
    trees += [build_tree(random_logits(4, 30, seed=2), 50)]
    for tree in trees:
        vis = tree.visibility()
        assert vis.dtype == torch.bool and vis.shape == (len(tree) + 1, len(tree) + 1)
        assert torch.equal(vis, naive_visibility(tree))
    chain = DraftTree.chain([5, 6, 7]).visibility()
    assert torch.equal(chain, torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_paths_round_trip_and_medusa_example() -> None:
    tree = DraftTree.from_paths([(0,), (0, 0), (1,)])
    assert tree.parents.tolist() == [-1, 0, -1] and tree.depths.tolist() == [1, 2, 1]
    assert tree.token_ids.tolist() == [0, 0, 1]  # placeholders: the child index
    assert tree.to_paths() == [(0,), (0, 0), (1,)]
    for seed in range(3):
        built = build_tree(drafter_like_logits(10, 2000, seed), 120)
        paths = built.to_paths()
        assert len(set(paths)) == len(paths)
        rebuilt = DraftTree.from_paths(paths, built.token_ids, built.log_probs)
        assert_same_tree(rebuilt, built)
        structure = DraftTree.from_paths(paths)
        assert torch.equal(structure.parents, built.parents) and torch.equal(structure.depths, built.depths)
        structure.validate()
    # an inconsistent order (child before parent) is replaced by breadth-first order; tokens follow their paths
    shuffled = DraftTree.from_paths([(0, 1), (1,), (0,), (0, 0)], token_ids=[11, 20, 10, 12])
    assert shuffled.to_paths() == [(0,), (1,), (0, 0), (0, 1)]
    assert tree_paths(shuffled) == [(10,), (20,), (10, 12), (10, 11)]
    assert shuffled.validate().parents.tolist() == [-1, -1, 0, 0]


def test_from_paths_rejects_bad_paths() -> None:
    with pytest.raises(ValueError, match="parent"):
        DraftTree.from_paths([(0,), (1, 0)])
    with pytest.raises(ValueError, match="twice"):
        DraftTree.from_paths([(0,), (0,)])
    with pytest.raises(ValueError, match="previous sibling"):
        DraftTree.from_paths([(1,)])
    assert DraftTree.from_paths([(1,), (0,)]).to_paths() == [(0,), (1,)]  # siblings out of order: reordered
    with pytest.raises(ValueError, match="empty"):
        DraftTree.from_paths([()])
    with pytest.raises(ValueError, match="token ids"):
        DraftTree.from_paths([(0,)], token_ids=[1, 2])


def test_children_lookup_and_helpers() -> None:
    tree = make_tree([-1, -1, 0, 0, 2], tokens=[7, 8, 7, 9, 4])
    assert tree.children(ROOT) == [0, 1] and tree.children(0) == [2, 3] and tree.children(4) == []
    assert tree.child_with_token(ROOT, 8) == 1 and tree.child_with_token(0, 9) == 3
    assert tree.child_with_token(0, 8) is None
    with pytest.raises(IndexError):
        tree.children(5)
    assert len(tree) == tree.num_nodes == 5 and tree.max_depth == 3
    assert "num_nodes=5" in repr(tree) and repr(DraftTree.empty()) == "DraftTree(num_nodes=0)"
    assert DraftTree.empty().max_depth == 0 and DraftTree.empty().to_paths() == []
    chain = DraftTree.chain([3, 4], token_log_probs=[-0.5, -0.25])
    assert chain.log_probs.tolist() == [-0.5, -0.75]
    assert chain.expected_acceptance() == pytest.approx(1 + math.exp(-0.5) + math.exp(-0.75))
    assert tree.equals(make_tree([-1, -1, 0, 0, 2], tokens=[7, 8, 7, 9, 4]))
    assert not tree.equals(make_tree([-1, -1, 0, 0, 1], tokens=[7, 8, 7, 9, 4]))


@pytest.mark.parametrize("fields,match", [
    (dict(parents=[-1, 1]), "parent"),
    (dict(parents=[-1, -2]), "parent"),
    (dict(parents=[-1, 0], depths=[1, 1]), "depth"),
    (dict(parents=[-1, 0], depths=[2, 3]), "depth"),
    (dict(parents=[-1, -1], tokens=[5, 5]), "same token"),
    (dict(parents=[-1, 0, 0], tokens=[1, 2, 2]), "same token"),
    (dict(parents=[-1], tokens=[-3]), "negative"),
    (dict(parents=[-1, -1], log_probs=[-1.0, -0.5]), "best first"),
    (dict(parents=[-1, 0], log_probs=[-1.0, -0.5]), "parent"),
    (dict(parents=[-1, 0], log_probs=[-1.0, float("nan")]), "NaN"),  # all NaN means unknown: allowed
])
def test_validate_catches_broken_trees(fields, match) -> None:
    with pytest.raises(ValueError, match=match):
        make_tree(**fields).validate()


def test_validate_rechecks_layout_after_in_place_changes() -> None:
    tree = make_tree([-1, 0])
    tree.log_probs.resize_(1)
    with pytest.raises(ValueError, match="equal lengths"):
        tree.validate()


def test_constructor_checks_shapes_and_dtypes() -> None:
    ids = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="equal lengths"):
        DraftTree(ids, ids, ids, torch.zeros(3))
    with pytest.raises(TypeError, match="int64"):
        DraftTree(ids.int(), ids, ids, torch.zeros(2))
    with pytest.raises(TypeError, match="float"):
        DraftTree(ids, ids, ids, ids)
    with pytest.raises(ValueError, match="1-D"):
        DraftTree(ids[None], ids[None], ids[None], torch.zeros(1, 2))
    with pytest.raises(TypeError, match="torch.Tensor"):
        DraftTree([0], ids, ids, torch.zeros(2))
