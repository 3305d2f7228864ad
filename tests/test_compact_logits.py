"""Compact draft logits: a round's DraftBlock holds [b-1, V'] logits over the draft vocabulary and its id map instead
of full-vocabulary rows that are -inf outside it; trees, chains and outputs are the same."""

from __future__ import annotations

import pytest
import torch

from conftest import make_draft, make_target, prompt
from ddtree import build_tree, ddtree_generate
from ddtree.build import reference_build_tree
from dflash_core import Chain, autoregressive_generate, dflash_generate, speculative_generate
from dflash_core.tree import DraftBlock


def _compact_and_full(seed: int, depth: int = 6, subset: int = 300, vocab: int = 2000):
    g = torch.Generator().manual_seed(seed)
    token_map = torch.randperm(vocab, generator=g)[:subset]  # [V'] target ids, in no particular order
    compact = 3 * torch.randn(depth, subset, generator=g)  # continuous: no exact ties
    full = torch.full((depth, vocab), float("-inf"))
    full[:, token_map] = compact
    return compact, full, token_map


@pytest.mark.parametrize("budget", [1, 7, 40, 250])
def test_build_tree_on_compact_logits_equals_the_full_vocabulary_tree(budget):
    """Oracle: the tree from compact logits plus the map is the tree from the -inf-padded full rows."""
    for seed in range(3):
        compact, full, token_map = _compact_and_full(seed)
        want = build_tree(full, budget)
        for got in (build_tree(compact, budget, token_map=token_map),
                    reference_build_tree(compact, budget, token_map=token_map)):
            assert torch.equal(got.token_ids, want.token_ids)
            assert torch.equal(got.parents, want.parents)
            assert torch.equal(got.depths, want.depths)
            torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=1e-5)  # float32 sums


def test_chain_on_compact_logits_maps_columns_to_target_ids():
    compact, full, token_map = _compact_and_full(5)
    got = Chain().propose(DraftBlock(compact, token_map, 0, full.shape[1]), [0])
    want = Chain().propose(DraftBlock(full, None, 0, full.shape[1]), [0])
    assert torch.equal(got.token_ids, want.token_ids)
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=1e-5)


def test_a_wrong_sized_token_map_is_refused():
    compact, _, token_map = _compact_and_full(1)
    with pytest.raises(ValueError, match="one token id per logit column"):
        build_tree(compact, 8, token_map=token_map[:-1])


def test_generate_with_a_draft_vocabulary_equals_plain_decoding():
    """fp64, a drafter with a reduced vocabulary: DFlash, fixed budgets and lookup branches (all compact now) give
    plain decoding's output."""
    target = make_target(vocab=64)
    draft = make_draft(target, block_size=5)
    draft.set_draft_vocab(torch.arange(0, 64, 2))
    for seed in range(2):
        ids = prompt(seed, 12, 64)
        plain = autoregressive_generate(target, ids, max_new_tokens=24).new_token_ids
        assert dflash_generate(target, draft, ids, max_new_tokens=24).new_token_ids == plain
        for budget in (1, 8, 30):
            assert ddtree_generate(target, draft, ids, budget=budget, max_new_tokens=24).new_token_ids == plain
        assert ddtree_generate(target, draft, ids, budget=8, lookup=True, max_new_tokens=24).new_token_ids == plain
