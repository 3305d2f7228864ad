"""Compact draft logits: policies that take ``token_map`` get [b-1, V'] logits over the draft vocabulary and its id
map instead of full-vocabulary rows that are -inf outside it; trees, chains and outputs are the same."""

from __future__ import annotations

import pytest
import torch

from conftest import make_draft, make_target, prompt
from ddtree import build_tree, ddtree_generate
from ddtree.build import reference_build_tree
from dflash_core import Chain, autoregressive_generate, dflash_generate, speculative_generate
from dflash_core.policy import LegacyPolicy


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
    got, want = Chain().propose(compact, [], token_map=token_map), Chain().propose(full, [])
    assert torch.equal(got.token_ids, want.token_ids)
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=1e-5)


def test_a_wrong_sized_token_map_is_refused():
    compact, _, token_map = _compact_and_full(1)
    with pytest.raises(ValueError, match="one token id per logit column"):
        build_tree(compact, 8, token_map=token_map[:-1])


class _Spy:
    """A fixed-budget policy that records the shapes the loop hands it."""

    uses_draft = True

    def __init__(self, compact: bool):
        self.name, self.shapes, self.maps = "spy", [], []
        if compact:
            self.propose = self._propose_compact

    def propose(self, draft_logits, history):
        self.shapes.append(tuple(draft_logits.shape))
        return build_tree(draft_logits, 6)

    def _propose_compact(self, draft_logits, history, token_map=None):
        self.shapes.append(tuple(draft_logits.shape))
        self.maps.append(token_map)
        return build_tree(draft_logits, 6, token_map=token_map)


def test_the_loop_hands_compact_logits_only_to_policies_that_take_the_map():
    target = make_target(vocab=64)
    draft = make_draft(target, block_size=4)
    draft.set_draft_vocab(torch.arange(63, 23, -1))  # 40 of 64 target ids, most frequent first
    ids = prompt(3, 10, 64)
    plain = autoregressive_generate(target, ids, max_new_tokens=20).new_token_ids
    outputs = {}
    for compact in (False, True):
        spy = _Spy(compact)
        outputs[compact] = speculative_generate(target, draft, ids, spy, max_new_tokens=20).new_token_ids
        assert set(spy.shapes) == {(3, 40 if compact else 64)}
        if compact:
            assert all(torch.equal(m.cpu(), draft.draft_vocab) for m in spy.maps)
        assert LegacyPolicy(spy)._compact is compact  # older-contract policies: how they are called, read once
    assert outputs[True] == outputs[False] == plain  # fp64: both equal plain decoding


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
