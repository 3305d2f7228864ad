"""Sampled trees over a Markov drafter: each node's children drawn from that node's own conditioned distribution.

Two levels of evidence that the recursive rejection rule stays lossless when siblings of different parents come from
different proposals:

1. exact: every tree the policy can draw (its real builder, with the draws enumerated instead of sampled) on a
   3-token draft vocabulary over a 4-token target, each walked with the rule's exact outcome probabilities; the
   committed tokens, continued by the target, have exactly the target's joint distribution. The trees' proposal rows
   are checked against the head's conditioned distribution computed directly;
2. through the decode loop: a tiny random target and a tiny drafter with a random gated Markov head, chi-square of the
   first three tokens against plain sampling at T = 0.5, 1 and 1.7.

Each has a broken control that fails at the same size: the children drawn from the conditioned q, but the rule run
with the block's unconditioned q of that depth.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import answer_counts, make_draft, make_target, prompt, sampled_answers
from ddtree import ddtree_generate
from ddtree.sampled import RecursiveRejection, SampledDraftTree, SampledTreePolicy
from dflash_core import speculative_generate
from dflash_core.model import MarkovHead, MarkovScorer, attach_markov_head
from dflash_core.tree import DraftBlock
from greedy_reference import exact_joint
from test_decoding import chi_square_p
from test_sampled_tree import SyntheticTarget

F64 = torch.float64
D2T = torch.tensor([2, 0, 3])  # draft index -> target id; target token 1 is outside the draft vocabulary
TARGET_VOCAB, DEPTH, BUDGET = 4, 3, 5


class Unconditioned(SampledTreePolicy):
    """Broken: children drawn from each node's conditioned q, but the tree hands the rule the block's unconditioned
    q of the children's depth (softmax(base[d] / T), the head's bias left out), as a headless drafter's tree would."""

    def propose(self, block, history):
        tree = super().propose(block, history)
        if len(tree) == 0 or block.scorer is None:
            return tree
        rows = torch.softmax(block.logits.double() / self.draft_temperature, dim=-1)  # [D, V'] per depth
        depth_of = torch.cat([torch.zeros(1, dtype=torch.int64), tree.depths])  # [n+1] root first
        return dataclasses.replace(tree, proposals=rows,
                                   proposal_rows=torch.where(tree.proposal_rows >= 0, depth_of, -1))


# ---------------------------------------------------------------------------------------------- 1. exact
def tiny_block(seed: int, root: int) -> tuple[DraftBlock, MarkovHead, torch.Tensor]:
    """A conditioned drafter on the draft vocabulary D2T: random base logits, a random gated head (strong enough
    to reorder the children), the drafter states its gate reads."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = MarkovHead(len(D2T), 8, 2, "gated")
    with torch.no_grad():
        head.out.weight.normal_(0, 2.0)
        head.gate.weight.normal_(0, 1.0)
    base, states = torch.randn(DEPTH, len(D2T), generator=g), torch.randn(DEPTH, 8, generator=g)
    t2d = np.full(TARGET_VOCAB, len(D2T), dtype=np.int64)
    t2d[D2T.numpy()] = np.arange(len(D2T))
    scorer = MarkovScorer(head, base, states, lambda ids: t2d[ids])
    return DraftBlock(base, D2T, root, TARGET_VOCAB, states, scorer), head, torch.from_numpy(t2d)


class _Branch(Exception):
    def __init__(self, options):
        self.options = options  # [(token, probability of drawing it next)]


class Scripted:
    """Wraps a policy class so that its draws follow a script; a draw past the script raises the possible next
    draws with their probabilities under the law the policy samples (q without the siblings already taken,
    renormalised), so the caller can enumerate every tree."""

    @staticmethod
    def policy(kind, temperature: float, script: list[int]):
        class Policy(kind):
            def draw_child(self, rows, row, taken):
                if script:
                    return script.pop(0)
                q = rows.prob(row).copy()
                left = 1.0 - float(q[taken].sum()) if taken else 1.0
                q[taken] = 0.0
                raise _Branch([(x, float(q[x]) / left) for x in np.flatnonzero(q > 0)])

        return Policy(BUDGET, temperature, seed=0)


def every_tree(kind, block: DraftBlock, temperature: float):
    """(tree, probability) for every tree ``kind`` can propose on ``block`` (the probabilities sum to 1)."""
    stack = [([], 1.0)]
    while stack:
        script, prob = stack.pop()
        try:
            yield Scripted.policy(kind, temperature, list(script)).propose(block, [block.root]), prob
        except _Branch as branch:
            stack += [(script + [int(x)], prob * px) for x, px in branch.options]


def round_outcomes(tree: SampledDraftTree, target: SyntheticTarget, rule: RecursiveRejection):
    """{committed tokens of the round: exact probability}: the rule walked with its outcome probabilities."""
    out: dict[tuple[int, ...], float] = {}
    stack = [(-1, (), 1.0)]
    tokens = tree.token_ids.tolist()
    while stack:
        node, prefix, weight = stack.pop()
        kids = tree.children(node)
        q = tree.proposal(node, TARGET_VOCAB) if kids else None
        move, bonus = rule.outcomes(target.probs(prefix), q, [tokens[k] for k in kids])
        for x in range(TARGET_VOCAB):
            out[prefix + (x,)] = out.get(prefix + (x,), 0.0) + weight * float(bonus[x])
        stack += [(k, prefix + (tokens[k],), weight * float(move[i])) for i, k in enumerate(kids)]
    return out


def continued(committed: dict[tuple[int, ...], float], target: SyntheticTarget, steps: int):
    """The joint of the first ``steps`` tokens when the target samples on after the round."""
    out: dict[tuple[int, ...], float] = {}
    frontier = list(committed.items())
    while frontier:
        seq, prob = frontier.pop()
        if len(seq) >= steps:
            out[seq[:steps]] = out.get(seq[:steps], 0.0) + prob
            continue
        p = target.probs(seq)
        frontier += [(seq + (x,), prob * float(p[x])) for x in range(TARGET_VOCAB)]
    return out


def committed_joint(kind, seed: int, root: int, temperature: float, check_rows: bool = False):
    block, head, t2d = tiny_block(seed, root)
    target = SyntheticTarget(TARGET_VOCAB, seed=seed)
    committed: dict[tuple[int, ...], float] = {}
    total = trees = 0
    for tree, prob in every_tree(kind, block, temperature):
        total, trees = total + prob, trees + 1
        for seq, pr in round_outcomes(tree, target, RecursiveRejection()).items():
            committed[seq] = committed.get(seq, 0.0) + prob * pr
        if check_rows:
            conditioned_rows_are_the_heads(tree, block, head, t2d, temperature)
    assert total == pytest.approx(1.0, abs=1e-12) and trees > 20
    got = continued(committed, target, DEPTH + 1)
    return got, target.joint(DEPTH + 1)


def conditioned_rows_are_the_heads(tree, block, head, t2d, temperature):
    """Each node's proposal is softmax((base[d] + head(token, state_d)) / T), computed here from the head itself."""
    for node in range(-1, len(tree)):
        if not tree.children(node):
            continue
        depth = 1 if node < 0 else int(tree.depths[node]) + 1
        prev = block.root if node < 0 else int(tree.token_ids[node])
        with torch.no_grad():
            bias = head(t2d[prev].view(1), block.states[depth - 1].view(1, -1))[0]
        q = torch.zeros(TARGET_VOCAB, dtype=F64)
        q[D2T] = torch.softmax((block.logits[depth - 1] + bias).double() / temperature, 0)
        torch.testing.assert_close(tree.proposal(node, TARGET_VOCAB), q, atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("seed,root", [(0, 1), (1, 3), (2, 0)])  # root 1: the head's out-of-vocabulary bucket
def test_conditioned_sampled_tree_is_exact(seed, root, temperature):
    got, expected = committed_joint(SampledTreePolicy, seed, root, temperature, check_rows=True)
    assert max(abs(got.get(s, 0.0) - pr) for s, pr in expected.items()) < 1e-12
    broken, _ = committed_joint(Unconditioned, seed, root, temperature)
    assert 0.5 * sum(abs(broken.get(s, 0.0) - pr) for s, pr in expected.items()) > 0.01


# ---------------------------------------------------------------------------------------------- 2. the loop
N_LOOP = 200  # the control's p-values at this N: 5e-55, 9e-18, 2e-12 at T = 0.5, 1, 1.7
PASS, FAIL = 1e-3, 1e-6


@pytest.fixture(scope="module")
def markov_pair():
    # a flat target (init 0.15): at T = 0.5 a peaked one would commit its favourite token whatever the tree holds
    target = make_target("llama", vocab=TARGET_VOCAB, layers=2, init=0.15, dtype=torch.float32, seed=5)
    draft = make_draft(target, block_size=4, dtype=torch.float32)
    draft.set_draft_vocab(D2T)
    head = attach_markov_head(draft, 3, "gated")
    with torch.no_grad():
        torch.manual_seed(7)
        head.out.weight.normal_(0, 4.0)  # the head, not the random drafter's flat rows, decides the children
    return target, draft, prompt(1, 4, TARGET_VOCAB)


def loop_counts(markov_pair, make_policy, temperature: float) -> tuple[dict, list]:
    target, draft, p = markov_pair
    results = sampled_answers(lambda seeds: speculative_generate(
        target, draft, [p] * len(seeds), [make_policy(seed) for seed in seeds], max_new_tokens=3,
        temperature=temperature, seed=seeds[0], trace=True), N_LOOP)
    return answer_counts(results), [tree for out in results[:20] for tree in out.trees]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_conditioned_sampled_trees_sample_the_target_through_the_loop(markov_pair, temperature):
    target, _, p = markov_pair
    joint = exact_joint(target, p, 3, temperature)
    counts, trees = loop_counts(markov_pair, lambda seed: SampledTreePolicy(6, temperature, seed=seed), temperature)
    assert chi_square_p(counts, joint, N_LOOP) > PASS
    # the loop handed the policy the head: some node's children came from a row of their own, not their depth's
    assert any(t.proposals.shape[0] > t.max_depth for t in trees if len(t))
    broken, _ = loop_counts(markov_pair, lambda seed: Unconditioned(6, temperature, seed=seed), temperature)
    assert chi_square_p(broken, joint, N_LOOP) < FAIL


def test_ddtree_generate_sampled_uses_the_head(markov_pair):
    """``tree="sampled"`` through the public entry point draws conditioned trees (the proposals differ from the
    headless drafter's per-depth rows)."""
    target, draft, p = markov_pair
    res = ddtree_generate(target, draft, p, budget=6, max_new_tokens=6, temperature=1.0, seed=3, tree="sampled",
                          trace=True)
    assert all(isinstance(t, SampledDraftTree) for t in res.trees)
    assert any(t.proposals.shape[0] > t.max_depth for t in res.trees if len(t))
