"""The public surface: the names researchers import, z-lab's entry point, and what a first hour with a policy needs
(clear errors for the usual mistakes)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_draft, make_target, prompt
from ddtree import DraftTree, build_tree, ddtree_generate
from dflash_core import autoregressive_generate, check_compatibility, dflash_generate, load_draft
from dflash_core.decoding import tree_inputs
from dflash_core.tree import BlockPolicy
from dflash_core.replay import replay_generate


def test_the_documented_names_import_from_the_package_roots():
    import ddtree
    import dflash_core

    for name in ("DraftTree", "build_tree", "ddtree_generate", "FixedBudget", "AutoBudget", "SampledTreePolicy",
                 "LookupTreePolicy", "make_policy"):
        assert name in ddtree.__all__ and hasattr(ddtree, name), name
    for name in ("DFlashDraftModel", "load_draft", "load_default_pair", "autoregressive_generate", "dflash_generate",
                 "speculative_generate", "lookup_generate", "GenerationResult", "BlockPolicy", "DraftBlock"):
        assert name in dflash_core.__all__ and hasattr(dflash_core, name), name
    assert len(ddtree.__all__) <= 10 and len(dflash_core.__all__) <= 14  # small on purpose


def test_spec_generate_is_a_drop_in_for_z_labs_entry_point():
    """z-lab's argument names and return shape ([1, prompt + new]), our loop's tokens."""
    target = make_target(vocab=64)
    draft = make_draft(target, block_size=4)
    ids = prompt(2, 9, 64)
    out = draft.spec_generate(input_ids=ids, max_new_tokens=16, temperature=0.0, target=target, stop_token_ids=[7])
    ours = dflash_generate(target, draft, ids, max_new_tokens=16, stop_token_ids=[7]).new_token_ids
    assert out.shape == (1, ids.shape[1] + len(ours)) and out.dtype == ids.dtype
    assert torch.equal(out[0, : ids.shape[1]], ids[0]) and out[0, ids.shape[1]:].tolist() == ours


def test_check_compatibility_reports_the_pair_and_flags_a_dtype_mismatch():
    target = make_target(vocab=64)
    report = check_compatibility(target, make_draft(target))
    assert "compatible: yes" in report and "trees: yes" in report and "warning" not in report
    mixed = check_compatibility(target, make_draft(target, dtype=torch.float32))
    assert "warning: drafter dtype torch.float32 differs from the target's torch.float64" in mixed


def test_a_mistyped_local_drafter_path_says_so_instead_of_asking_the_hub(tmp_path):
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no drafter checkpoint folder at .*check the folder name"):
        load_draft(str(tmp_path / "runs" / "drafter-typo"))
    with pytest.raises(FileNotFoundError, match="no drafter checkpoint folder"):
        load_draft("./drafter")


def test_trees_from_paths_without_log_probs_do_not_invent_an_expected_acceptance():
    tree = build_tree(torch.tensor([[3.0, 1.0, 0.0], [2.0, 0.5, 0.0]]), 4)
    bare = DraftTree.from_paths(tree.to_paths())
    assert math.isnan(bare.expected_acceptance()) and not bare.has_log_probs
    assert bare.validate(best_first=True) is bare  # unknown probabilities: the structure is still checked
    rebuilt = DraftTree.from_paths(tree.to_paths(), tree.token_ids, tree.log_probs)
    assert rebuilt.equals(tree) and rebuilt.expected_acceptance() == pytest.approx(tree.expected_acceptance())


def test_a_chain_is_a_draft_tree_verified_without_a_mask():
    chain = DraftTree.chain([4, 2, 9], [-0.1, -0.2, -0.3])
    assert chain.is_chain and not DraftTree.from_paths([(0,), (1,)]).is_chain
    ids, positions, visibility = tree_inputs(chain, root=5, start=10)
    assert visibility is None and ids.tolist() == [5, 4, 2, 9] and positions.tolist() == [10, 11, 12, 13]
    assert chain.expected_acceptance() == pytest.approx(1 + sum(math.exp(x) for x in (-0.1, -0.3, -0.6)))


class ZeroBasedDepths(BlockPolicy):
    """A policy with the classic mistake: depths counted from 0."""

    name, uses_draft = "zero-based", True

    def propose(self, block, history):
        tree = build_tree(block.full_logits(), 4)
        return DraftTree(tree.token_ids, tree.parents, tree.depths - 1, tree.log_probs)


@pytest.mark.parametrize("check_trees", [False, True])
def test_the_loop_refuses_a_policy_with_zero_based_depths(check_trees):
    target = make_target(vocab=64)
    draft = make_draft(target)
    ids = prompt(1, 8, 64)
    with pytest.raises(ValueError, match="'zero-based' proposed an invalid tree: node 0 has depth 0"):
        ddtree_generate(target, draft, ids, policy=ZeroBasedDepths(), max_new_tokens=8, check_trees=check_trees)


def test_policy_together_with_budget_is_refused():
    target = make_target(vocab=64)
    draft = make_draft(target)
    with pytest.raises(ValueError, match="either policy= or budget="):
        ddtree_generate(target, draft, prompt(1, 8, 64), budget=16, policy=ZeroBasedDepths(), max_new_tokens=4)


def test_replay_generate_takes_a_prompt_and_matches_the_loop():
    """[1, T] ids like every *_generate; plain decoding runs inside; fp64 rounds equal the decode loop's."""
    from ddtree.generate import FixedBudget

    target = make_target(vocab=64)
    draft = make_draft(target, block_size=5)
    ids = prompt(4, 10, 64)
    replayed = replay_generate(target, draft, ids, {"b8": FixedBudget(8), "b2": FixedBudget(2)}, max_new_tokens=20)
    for name, budget in (("b8", 8), ("b2", 2)):
        live = ddtree_generate(target, draft, ids, budget=budget, max_new_tokens=20)
        assert replayed[name].acceptance_lengths == live.acceptance_lengths
    assert sum(replay_generate(target, draft, ids, FixedBudget(8), 20).acceptance_lengths) == len(
        autoregressive_generate(target, ids, 20).new_token_ids) - 1  # every token but the prefill's
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        replay_generate(target, draft, ids[0], FixedBudget(8), 20)
