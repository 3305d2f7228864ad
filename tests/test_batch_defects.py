"""Defects a review found in the batched loop, one test each (each failed before its fix):

1. a sequence whose first drafter pass comes after other sequences' (its drafter cache still empty) stacks with them;
2. a sequence that never drafts keeps no target features, and one that skips the drafter keeps them as chunks that
   are joined once, when its drafter reads them;
3. a batched prefill of ragged prompts builds no [B, W, W] mask (the model's causal mask is exact for right padding);
4. the verify mask: the committed part is one comparison on the device, only the [B, n, n] tree part on the host;
5. ``auto`` prices a round at the number of sequences still decoding, not at the starting batch size;
6. ``check_verifiable`` counts every sequence's tree of the batch;
7. lookup's skip clock is off in a batch (one sequence's clock times the whole batch's round);
8. the sequences of an ``auto`` batch learn in their own forks of the caller's memory, which takes their rounds back.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_draft, make_target, prompt, record_masks
from ddtree import AutoBudget, RoundMemory, ddtree_generate, make_policy
from ddtree import generate as ddtree_generate_module
from ddtree.budget import SharedBudget, shared_size
from ddtree.cost import CostModel
from dflash_core.decoding import LiveModels, speculative_generate
from dflash_core.tree import Chain, DraftBlock, DraftTree, NoDraft
from greedy_reference import greedy_reference

VOCAB = 32


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama", vocab=VOCAB)  # float64: greedy ties do not occur
    return target, make_draft(target, block_size=4)


class LateChain(Chain):
    """A chain that skips the drafter in its first ``skip`` rounds (the root alone is verified there)."""

    name = "late-chain"

    def __init__(self, skip: int = 1, every: int = 0) -> None:
        self.skip, self.every, self.rounds = skip, every, 0

    def wants_draft(self, history: list[int]) -> bool:
        self.rounds += 1
        if self.rounds <= self.skip:
            return False
        return not self.every or self.rounds % self.every == 0

    def propose(self, block, history):
        return DraftTree.empty() if block is None else super().propose(block, history)


def test_a_sequence_drafting_for_the_first_time_after_others_joins_the_stacked_pass(pair):
    target, draft = pair
    prompts = [prompt(60 + b, n, VOCAB) for b, n in enumerate([5, 9, 7])]
    for policies in ([Chain(), LateChain(1), Chain()], [LateChain(2), Chain(), LateChain(1)]):
        got = speculative_generate(target, draft, prompts, policies, max_new_tokens=14)
        for b, p in enumerate(prompts):
            assert got[b].new_token_ids == greedy_reference(target, p, 14), (policies[b].name, b)


def test_features_are_kept_only_for_a_drafter_that_will_read_them(pair, monkeypatch):
    target, draft = pair
    kept: list[list[int]] = []  # per commit: rows of unread features per sequence
    commit = LiveModels.commit

    def spy(self, seqs, paths, committed):
        commit(self, seqs, paths, committed)
        assert all(isinstance(self.unread[s], list) for s in seqs)
        kept.append([sum(len(chunk) for chunk in self.unread[s]) for s in seqs])

    monkeypatch.setattr(LiveModels, "commit", spy)
    prompts = [prompt(70 + b, 6, VOCAB) for b in range(3)]
    out = speculative_generate(target, draft, prompts, [NoDraft(), Chain(), LateChain(0, every=3)],
                               max_new_tokens=12)
    assert kept and all(rows[0] == 0 for rows in kept if len(rows) == 3)  # plain decoding keeps nothing
    # the skipping chain holds exactly what it committed since its last drafter pass, no more
    late = out[2].acceptance_lengths
    assert max(rows[2] for rows in kept if len(rows) == 3) >= 2
    assert all(rows[2] <= sum(late) for rows in kept if len(rows) == 3)


def test_a_ragged_batch_prefills_under_the_causal_mask_and_stays_exact(pair, monkeypatch):
    target, draft = pair
    masks = record_masks(monkeypatch)
    prompts = [prompt(80 + b, n, VOCAB) for b, n in enumerate([3, 12, 7])]
    got = ddtree_generate(target, draft, prompts, budget=8, max_new_tokens=10)
    assert masks[0] is False  # the prefill: no [B, W, W] mask
    for b, p in enumerate(prompts):
        assert got[b].new_token_ids == greedy_reference(target, p, 10)


def test_the_verify_mask_equals_the_brute_force_one(pair):
    target, draft = pair
    from dflash_core.target import TargetAdapter

    models, _ = LiveModels.prefilled(TargetAdapter(target), None, [prompt(b, n, VOCAB) for b, n in enumerate([4, 9])])
    models.lengths = [4, 9]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root, a child, another child
    got = models._verify_mask([tree, None], [3, 2], 3)
    want = torch.zeros(2, 3, 9 + 3, dtype=torch.bool)
    for b, (length, size) in enumerate(zip([4, 9], [3, 2])):
        for q in range(3):
            want[b, q, :length] = True
            for k in range(3):
                if q < size and k < size:
                    want[b, q, 9 + k] = bool(tree[q, k]) if b == 0 else k <= q
                else:
                    want[b, q, 9 + k] = q == k  # a padding row sees only itself
    assert torch.equal(got, want)


def _auto(cost: CostModel, cap: int = 12) -> AutoBudget:
    return AutoBudget(cost, cap=cap)


def test_auto_prices_a_shrunken_batch_at_its_own_size():
    batch_curve = CostModel((0, 12), (0.010, 0.040), 0.002)  # per sequence at B = 4: nodes are cheap
    policies = [_auto(batch_curve) for _ in range(4)]
    single = np.linspace(0.02, 0.30, 13)  # alone, every node costs much more
    shared = SharedBudget(policies, single)
    assert np.allclose(shared.seconds(4), policies[0]._seconds)
    assert np.allclose(shared.seconds(1), single)
    assert np.all(shared.seconds(2) > shared.seconds(4))  # each sequence's share grows as the batch shrinks
    logits = torch.log_softmax(torch.tensor([[3.0, 1.0, 0.0, -1.0]] * 3), -1)
    block = DraftBlock(logits, None, 0, 4)
    trees = shared.propose([2], [block], [[0, 1]])  # sequences 0, 1 and 3 have finished
    _, probs_alone = _auto(batch_curve).drafter_tree(block, 12)
    assert shared.chosen[-1] == shared_size([probs_alone], single, None) == len(trees[0])
    assert shared.chosen[-1] < shared_size([probs_alone], policies[0]._seconds, None)


def test_ddtree_generate_gives_the_batch_proposer_the_single_curve(pair, monkeypatch):
    target, draft = pair
    seen = []
    init = SharedBudget.__init__

    def spy(self, policies, single=None):
        seen.append(single)
        init(self, policies, single)

    monkeypatch.setattr(SharedBudget, "__init__", spy)
    prompts = [prompt(90 + b, 5, VOCAB) for b in range(2)]
    got = ddtree_generate(target, draft, prompts, budget="auto", max_new_tokens=6)
    assert seen and seen[0] is not None and len(seen[0]) >= 2
    for b, p in enumerate(prompts):
        assert got[b].new_token_ids == greedy_reference(target, p, 6)


def test_check_verifiable_counts_every_tree_of_the_batch(pair, monkeypatch):
    target, draft = pair
    monkeypatch.setattr(ddtree_generate_module, "_memory_bytes", lambda device: 4 * 4_000_000)  # a quarter: 4 MB
    ddtree_generate_module.check_verifiable(target, draft, 32, 2000, batch=1)
    with pytest.raises(ValueError, match="8 trees of 32 nodes.*smaller batch"):
        ddtree_generate_module.check_verifiable(target, draft, 32, 2000, batch=8)


def test_lookup_reads_no_clock_in_a_batch(pair, monkeypatch):
    assert make_policy(8, lookup=True).clock is not None
    assert make_policy(8, lookup=True, batch=2).clock is None
    made = []
    real = ddtree_generate_module.make_policy
    monkeypatch.setattr(ddtree_generate_module, "make_policy", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    target, draft = pair
    ddtree_generate(target, draft, [prompt(1, 6, VOCAB), prompt(2, 6, VOCAB)], budget=8, lookup=True,
                    max_new_tokens=4)
    assert len(made) == 2 and all(p.clock is None and not any(p.skipped) for p in made)


def test_the_sequences_of_an_auto_batch_learn_in_their_own_forks(pair, monkeypatch):
    target, draft = pair
    memories = {}
    drafter_tree = AutoBudget.drafter_tree

    def spy(self, block, size):
        memories.setdefault(id(self), self.memory)
        return drafter_tree(self, block, size)

    monkeypatch.setattr(AutoBudget, "drafter_tree", spy)
    memory = RoundMemory()
    prompts = [prompt(100 + b, 6, VOCAB) for b in range(3)]
    out = ddtree_generate(target, draft, prompts, budget="auto", max_new_tokens=8, memory=memory)
    assert len(memories) == 3 and len({id(m) for m in memories.values()}) == 3
    assert all(m is not memory for m in memories.values())
    # each fork holds its own sequence's rounds only
    assert sorted(len(m) for m in memories.values()) == sorted(len(r.acceptance_lengths) for r in out)
    assert len(memory) == memory.appended == sum(len(r.acceptance_lengths) for r in out)
