"""Sampling inside the decode loop away from T = 1: chi-square tests of the first three tokens against the exact
joint of plain sampling at T = 0.6 and T = 1.7 (``exact_joint``, cache-free full forwards), for plain decoding,
DFlash chains, top-K trees and sampled trees. Each passing test has a control at the same N that fails: the same loop
with the temperature dropped from the verification (it samples softmax(logits) instead of softmax(logits / T)). The
four broken rules of the sampled tree (``test_sampled_tree``) run through the loop too, each failing at its N.
"""

from __future__ import annotations

import pytest
import torch

import dflash_core.decoding as decoding
from conftest import answer_counts, make_draft, make_target, prompt, sampled_answers
from ddtree.sampled import SampledDraftTree, SampledTreePolicy
from dflash_core import speculative_generate
from dflash_core.tree import Chain, DraftBlock, NoDraft
from greedy_reference import exact_joint
from test_ddtree_generate import PeakedTree
from test_decoding import chi_square_p
from test_sampled_tree import DRAFT_LOGITS, NoRenormalisation, NoResidual, Unclipped, WithReplacement

N_TEMPERATURE = 300  # dropping T moves the joint by >= 0.33 chi-square units per sample here: ~100 at this N
PASS, FAIL = 1e-3, 1e-6


class FixedSampled(SampledTreePolicy):
    """A sampled tree drawn from fixed, confident and often wrong drafter logits (by default those of the
    model-free tests) instead of the random drafter's: the children differ from the target's choice, so a broken
    rule shows."""

    logits = DRAFT_LOGITS

    def propose(self, block, history):
        logits = self.logits[: block.depth]
        return super().propose(DraftBlock(logits, None, block.root, logits.shape[1]), history)


class ConfidentWithReplacement(WithReplacement):
    """Drawing with replacement only matters where draws repeat: a more confident drafter and more siblings."""

    logits = 1.5 * DRAFT_LOGITS

    def propose(self, block, history):
        logits = self.logits[: block.depth]
        return super().propose(DraftBlock(logits, None, block.root, logits.shape[1]), history)


class Confident(FixedSampled):
    logits = 1.5 * DRAFT_LOGITS


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama", vocab=4, layers=2, init=0.3, dtype=torch.float32, seed=5)
    return target, make_draft(target, block_size=4, dtype=torch.float32), prompt(1, 4, 4)


def loop_p_value(pair, make_policy, n: int, temperature: float, claimed: float | None = None) -> float:
    """p-value of the loop's first three tokens (n seeds, one fresh policy each) against plain sampling at
    ``claimed`` (default: the loop's temperature)."""
    target, draft, p = pair
    counts = answer_counts(sampled_answers(lambda seeds: speculative_generate(
        target, draft, [p] * len(seeds), [make_policy(seed) for seed in seeds], max_new_tokens=3,
        temperature=temperature, seed=seeds[0]), n))
    return chi_square_p(counts, exact_joint(target, p, 3, temperature if claimed is None else claimed), n)


def drop_the_temperature(monkeypatch) -> None:
    """The broken loop: every verification (sample-and-match and the sampled tree's rule) ignores T."""
    follow, verify = decoding.follow, SampledDraftTree.verify
    monkeypatch.setattr(decoding, "follow", lambda ids, parents, logits, t, g: follow(ids, parents, logits,
                                                                                       min(t, 1.0) and 1.0, g))
    monkeypatch.setattr(SampledDraftTree, "verify", lambda self, logits, t, g: verify(self, logits, min(t, 1.0) and 1.0,
                                                                                    g))


POLICIES = {
    "plain": lambda seed: NoDraft(),
    "chain": lambda seed: Chain(),
    "topk-tree": lambda seed: PeakedTree(),
}


@pytest.mark.parametrize("temperature", [0.6, 1.7])
@pytest.mark.parametrize("kind", ["plain", "chain", "topk-tree", "sampled-tree"])
def test_loop_samples_the_target_at_temperature(pair, kind, temperature, monkeypatch):
    make = POLICIES.get(kind) or (lambda seed: FixedSampled(6, temperature, seed=seed))
    assert loop_p_value(pair, make, N_TEMPERATURE, temperature) > PASS
    drop_the_temperature(monkeypatch)  # the control: same N, the temperature ignored by the verification
    assert loop_p_value(pair, make, N_TEMPERATURE, temperature) < FAIL


N_RULES = 600


@pytest.mark.parametrize("make,exact", [
    (lambda seed: FixedSampled(6, 1.0, seed=seed), True),
    (lambda seed: Confident(8, 1.0, seed=seed), True),
    (lambda seed: FixedSampled(6, 1.0, seed=seed, rule=NoResidual()), False),
    (lambda seed: FixedSampled(6, 1.0, seed=seed, rule=Unclipped()), False),
    (lambda seed: FixedSampled(6, 1.0, seed=seed, rule=NoRenormalisation()), False),
    (lambda seed: ConfidentWithReplacement(8, 1.0, seed=seed), False),
], ids=["exact", "exact-confident", "no-residual", "unclipped", "no-renormalisation", "with-replacement"])
def test_broken_sampled_tree_rules_are_detected_through_the_loop(pair, make, exact):
    """The real rule passes and each broken one fails on the same drafter logits, through the whole loop (prefill,
    the tree's verify forward, compaction), not just on a synthetic target."""
    p_value = loop_p_value(pair, make, N_RULES, 1.0)
    assert p_value > PASS if exact else p_value < FAIL


def test_stop_tokens_inside_a_sampled_tree(pair):
    """A stop token accepted inside a sampled tree ends the answer there: the loop's answers (cut at token 1, which
    the fixed drafter proposes at depth 2) follow plain sampling with that stop token."""
    target, draft, p = pair
    results = sampled_answers(lambda seeds: speculative_generate(
        target, draft, [p] * len(seeds), [FixedSampled(6, 1.0, seed=seed) for seed in seeds], max_new_tokens=3,
        temperature=1.0, seed=seeds[0], stop_token_ids=[1], trace=True), N_TEMPERATURE)
    counts = answer_counts(results)
    cut_in_round = 0
    for out in results:
        if out.trees and out.new_token_ids[-1] == 1:
            last = out.new_token_ids[-out.acceptance_lengths[-1]:]
            tree, node = out.trees[-1], -1
            for token in last:  # does the round's whole commit lie on one root path of its tree?
                node = next((k for k in tree.children(node) if int(tree.token_ids[k]) == token), None)
                if node is None:
                    break
            cut_in_round += node is not None and len(tree.children(node)) > 0  # accepted, with deeper nodes dropped
    assert cut_in_round > 0  # the stop token was an accepted node, with the tree's deeper nodes dropped
    assert chi_square_p(counts, exact_joint(target, p, 3, 1.0, stop_token_ids=[1]), N_TEMPERATURE) > PASS
