"""The published tree builders (EAGLE-2, Sequoia, Medusa) on the DFlash drafter.

Oracles: EAGLE-2 against its expand-then-rerank rule evaluated over every token path of a tiny block, and against
DDTree's tree when its beam is as wide as the budget; Sequoia's DP against the best of every shape enumerated on a
tiny table; Medusa's greedy growth by hand; on monotone tables both against the top-n rank paths; the rank-path trees
against ranks recomputed from the block; the table fit against counts written by hand; and every policy through the
one decode loop against the cache-free greedy reference (plain and Markov-head drafters).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from conftest import make_draft, make_target, prompt
from test_markov import _tiny_scorer
from ddtree.baselines import (
    EAGLE2_DEPTH, EAGLE2_TOP_K, EAGLE2_TOTAL_TOKENS, EagleTwoTree, MedusaTree, RecordRounds, SequoiaTree,
    StaticRankTree, eagle2_tree, expected_accepted_tokens, fit_rank_acceptance, medusa_rank_paths, rank_path_tree,
    sequoia_rank_paths,
)
from ddtree.build import best_tree
from ddtree.generate import FixedBudget
from dflash_core import BlockPolicy, speculative_generate
from dflash_core.model import attach_markov_head
from dflash_core.replay import replay
from dflash_core.tree import DraftBlock, DraftTree
from greedy_reference import greedy_reference

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------- tiny blocks and oracles
def _plain_block(seed: int, depth: int = 3, vocab: int = 4, scale: float = 2.0, root: int = 0) -> DraftBlock:
    logits = torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    return DraftBlock(logits=logits, token_map=None, root=root, vocab_size=vocab)


def _markov_block(seed: int, kind: str = "gated", root: int = 2) -> DraftBlock:
    """A real Markov head over a 5-token draft vocabulary of an 8-token target (root 2: outside it, the OOV row)."""
    scorer, base, d2t, _ = _tiny_scorer(seed, kind)
    return DraftBlock(logits=base, token_map=d2t, root=root, vocab_size=8, scorer=scorer)


def _child_rows(block: DraftBlock, depth: int, parent: int) -> list[tuple[int, float]]:
    """(target token, log-prob) of every child of a node carrying ``parent`` at ``depth - 1``, best first (ties: lower
    column), computed directly: the depth's row, or the head's row given ``parent``."""
    if block.scorer is None:
        row = torch.log_softmax(block.logits[depth - 1].double(), dim=-1).tolist()
    else:
        row = block.scorer.log_probs(depth, [parent])[0].astype(np.float64).tolist()
    order = sorted(range(len(row)), key=lambda c: (-row[c], c))
    ids = block.target_ids(torch.tensor(order)).tolist()
    return [(ids[i], row[c]) for i, c in enumerate(order)]


def _all_paths(block: DraftBlock, depth: int) -> dict[tuple[int, ...], tuple[float, int]]:
    """Every token path of 1..depth levels: {path: (path log-prob, rank among its siblings)}."""
    paths: dict[tuple[int, ...], tuple[float, int]] = {}
    frontier = {(): 0.0}
    for d in range(1, depth + 1):
        grown = {}
        for path, score in frontier.items():
            for rank, (token, log_prob) in enumerate(_child_rows(block, d, path[-1] if path else block.root)):
                grown[path + (token,)] = (score + log_prob, rank)
        paths.update(grown)
        frontier = {p: v[0] for p, v in grown.items()}
    return paths


def _token_paths(tree: DraftTree) -> dict[tuple[int, ...], float]:
    out, paths = {}, []
    for i in range(len(tree)):
        parent = int(tree.parents[i])
        paths.append((paths[parent] if parent >= 0 else ()) + (int(tree.token_ids[i]),))
        out[paths[-1]] = float(tree.log_probs[i])
    return out


def _rank_paths(block: DraftBlock, tree: DraftTree) -> set[tuple[int, ...]]:
    """Each node's rank path, its ranks recomputed from the block."""
    ranks: list[tuple[int, ...]] = []
    for i in range(len(tree)):
        parent = int(tree.parents[i])
        parent_token = block.root if parent < 0 else int(tree.token_ids[parent])
        tokens = [t for t, _ in _child_rows(block, int(tree.depths[i]), parent_token)]
        ranks.append((ranks[parent] if parent >= 0 else ()) + (tokens.index(int(tree.token_ids[i])),))
    return set(ranks)


def _close(got, want) -> bool:
    return np.shape(got) == np.shape(want) and np.allclose(np.array(got), np.array(want), atol=1e-12)


def _checked(tree: DraftTree, budget: int) -> DraftTree:
    assert len(tree) <= budget
    return tree.validate()


# ---------------------------------------------------------------------------------------------- EAGLE-2
def _eagle2_by_rule(block: DraftBlock, budget: int, levels: int, top_k: int) -> set[tuple[int, ...]]:
    """The rule over every enumerated path: a path of depth d is expanded when its rank is below ``top_k`` and its
    parent is one of the ``top_k`` best expanded paths of depth d - 1 (the root for d = 1); the tree is the
    ``budget`` best expanded paths."""
    paths = _all_paths(block, levels)
    expanded, frontier = set(), {()}
    for d in range(1, levels + 1):
        level = [p for p in paths if len(p) == d and p[:-1] in frontier and paths[p][1] < top_k]
        expanded.update(level)
        frontier = set(sorted(level, key=lambda p: -paths[p][0])[:top_k])
    return set(sorted(expanded, key=lambda p: (-paths[p][0], len(p)))[:budget])


@pytest.mark.parametrize("head", [None, "token", "gated"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_eagle2_equals_the_expand_then_rerank_rule_over_every_path(head, top_k):
    for seed in range(3):
        for budget in (1, 4, 9, 30):
            block = _plain_block(seed) if head is None else _markov_block(seed, head)
            tree = _checked(eagle2_tree(block, budget, depth=None, top_k=top_k), budget)
            got = _token_paths(tree)
            assert set(got) == _eagle2_by_rule(block, budget, 3, top_k), (seed, budget)
            paths = _all_paths(block, 3)
            for path, value in got.items():
                assert value == pytest.approx(paths[path][0], abs=1e-5)
            shallow = _checked(eagle2_tree(block, budget, depth=2, top_k=top_k), budget)
            assert set(_token_paths(shallow)) == _eagle2_by_rule(block, budget, 2, top_k)


@pytest.mark.parametrize("head", [None, "gated"])
def test_eagle2_with_a_beam_as_wide_as_the_budget_is_the_ddtree_tree(head):
    """With top_k >= budget every node of the best tree gets expanded, so the rerank keeps exactly DDTree's nodes."""
    for seed in range(3):
        for budget in (3, 12, 40):
            block = _plain_block(seed, depth=5, vocab=30, scale=3.0) if head is None else _markov_block(seed, head)
            got = _token_paths(eagle2_tree(block, budget, top_k=budget))
            assert set(got) == set(_token_paths(best_tree(block, budget)))


def test_eagle2_published_setting():
    policy = EagleTwoTree.published()
    assert (policy.budget, policy.depth, policy.top_k) == (59, 6, 10)
    assert (EAGLE2_TOTAL_TOKENS, EAGLE2_DEPTH, EAGLE2_TOP_K) == (60, 6, 10)
    block = _plain_block(0, depth=8, vocab=50, scale=0.5)  # flat rows: the tree wants depth and width
    tree = _checked(policy.propose(block, [0]), 59)
    assert len(tree) == 59 and tree.max_depth <= 6
    deeper = _checked(EagleTwoTree(59, top_k=10).propose(block, [0]), 59)
    assert deeper.expected_acceptance() >= tree.expected_acceptance() - 1e-12  # more levels: more candidates


# ---------------------------------------------------------------------------------------------- Sequoia and Medusa
def _value(table, shape) -> float:
    return sum(float(np.prod([table[d][r] for d, r in enumerate(path)])) for path in shape)


def _every_shape(widths: tuple[int, ...], n: int) -> set[frozenset]:
    """Every Sequoia shape of at most ``n`` nodes: closed under parents, each node's children ranks 0..b-1, depth at
    most len(widths), ranks below widths[d] at depth d + 1; grown one node at a time from the empty shape."""
    shapes, layer = {frozenset()}, {frozenset()}
    for _ in range(n):
        grown = set()
        for shape in layer:
            for parent in [()] + list(shape):
                if len(parent) < len(widths):
                    rank = sum(1 for p in shape if p[:-1] == parent)  # the next child's rank
                    if rank < widths[len(parent)]:
                        grown.add(shape | {parent + (rank,)})
        shapes |= grown
        layer = grown
    return shapes


def _random_table(seed: int, depth: int = 3, ranks: int = 3, monotone: bool = False):
    rng = np.random.default_rng(seed)
    rows = [rng.dirichlet(np.ones(ranks + 1))[:ranks] for _ in range(depth)]
    return tuple(tuple(sorted(row, reverse=True) if monotone else row) for row in rows)


@pytest.mark.parametrize("max_depth", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_sequoia_dp_equals_the_best_of_every_shape(seed, max_depth):
    table = _random_table(seed)  # rows in random rank order: the DP's shape constraint binds
    shapes = _every_shape(tuple(len(row) for row in table[:max_depth]), 7)
    for n in range(0, 8):
        best = max(_value(table, s) for s in shapes if len(s) <= n)
        got = sequoia_rank_paths(table, n, max_depth=max_depth)
        assert frozenset(got) in shapes and len(got) <= n
        assert _value(table, got) == pytest.approx(best, abs=1e-12), (n, got)
        assert expected_accepted_tokens(table, got) == pytest.approx(best, abs=1e-12)


def test_medusa_grows_by_hand():
    table = ((0.6, 0.2), (0.5, 0.3))  # (0,) .6, (0,0) .3, (1,) .2, (0,1) .18, (1,0) .1, (1,1) .06
    assert medusa_rank_paths(table, 4) == ((0,), (0, 0), (1,), (0, 1))
    assert medusa_rank_paths(table, 1) == ((0,),)
    assert medusa_rank_paths(table, 0) == ()
    assert set(medusa_rank_paths(table, 10)) == set(itertools.product((0, 1), repeat=1)) | \
        set(itertools.product((0, 1), repeat=2))
    tree = MedusaTree(table, 4)
    assert set(tree.paths) == {(0,), (0, 0), (1,), (0, 1)} and tree.expected == pytest.approx(1.28)


def test_sequoia_dp_beats_medusa_greedy_where_a_row_is_not_monotone():
    """Depth 2's rank 1 is right far more often than its rank 0: reaching it costs its rank-0 sibling. Medusa's greedy
    growth takes the root's rank 1 instead; the DP sees that the two depth-2 children are worth more."""
    table = ((0.5, 0.4), (0.01, 0.9))
    assert set(medusa_rank_paths(table, 3)) == {(0,), (1,), (0, 0)}  # .5 + .4 + .005
    assert set(sequoia_rank_paths(table, 3)) == {(0,), (0, 0), (0, 1)}  # .5 + .005 + .45
    assert SequoiaTree(table, 3).expected == pytest.approx(0.955)
    assert MedusaTree(table, 3).expected == pytest.approx(0.905)


@pytest.mark.parametrize("seed", range(4))
def test_on_monotone_rows_greedy_top_n_is_optimal(seed):
    """Rows non-increasing in rank: Medusa's growth, the DP and the n best rank paths have the same value."""
    table = _random_table(seed, depth=3, ranks=4, monotone=True)
    every = [p for d in (1, 2, 3) for p in itertools.product(range(4), repeat=d)]
    for n in (1, 2, 5, 11, 20):
        top = sorted(every, key=lambda p: -_value(table, [p]))[:n]
        assert _value(table, medusa_rank_paths(table, n)) == pytest.approx(_value(table, top), abs=1e-12)
        assert _value(table, sequoia_rank_paths(table, n)) == pytest.approx(_value(table, top), abs=1e-12)
        assert set(medusa_rank_paths(table, n)) == set(top)  # random cells: no ties


def test_rank_path_tree_takes_the_ranked_tokens():
    block = _plain_block(5, depth=2, vocab=3)
    ranked = [[t for t, _ in _child_rows(block, d, 0)] for d in (1, 2)]
    paths = [(0,), (1,), (0, 0), (0, 2), (1, 0), (0, 3), (1, 0, 0)]  # (0, 3): no rank 3; (1, 0, 0): too deep
    tree = _checked(rank_path_tree(block, paths), 7)
    assert set(_token_paths(tree)) == {(ranked[0][0],), (ranked[0][1],), (ranked[0][0], ranked[1][0]),
                                       (ranked[0][0], ranked[1][2]), (ranked[0][1], ranked[1][0])}
    markov = _markov_block(1)
    shape = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 2), (1, 0, 0)]
    tree = _checked(rank_path_tree(markov, shape), len(shape))
    assert _rank_paths(markov, tree) == set(shape)  # each child ranked given its own parent's token
    with pytest.raises(ValueError, match="without its parent"):
        rank_path_tree(block, [(0, 0)])


@pytest.mark.parametrize("head", [None, "gated"])
def test_no_builder_beats_ddtree_under_the_drafter(head):
    """DDTree's tree is the best of its budget under the drafter's distribution: no other builder's tree, scored the
    same way, may expect more."""
    table = _random_table(0, depth=3, ranks=3, monotone=True)
    for seed in range(3):
        block = _plain_block(seed, depth=3, vocab=6) if head is None else _markov_block(seed, head)
        for budget in (2, 7, 15):
            ddtree = best_tree(block, budget).expected_acceptance()
            for policy in (EagleTwoTree(budget, top_k=2), SequoiaTree(table, budget), MedusaTree(table, budget)):
                tree = _checked(policy.propose(block, [block.root]), budget)
                assert tree.expected_acceptance() <= ddtree + 1e-9, (policy.name, seed, budget)


def test_bad_tables_and_shapes_are_refused():
    with pytest.raises(ValueError, match="sums to"):
        SequoiaTree(((0.6, 0.8),), 3)  # cumulative top-k accuracies, not per-rank ones
    with pytest.raises(ValueError, match="outside"):
        MedusaTree(((-0.1,),), 3)
    with pytest.raises(ValueError, match="empty"):
        medusa_rank_paths(((0.5,), ()), 3)
    with pytest.raises(ValueError, match="budget"):
        EagleTwoTree(-1)
    with pytest.raises(ValueError, match="distinct"):
        StaticRankTree([(0,), (0,)])


# ---------------------------------------------------------------------------------------------- the table fit
def test_fit_counts_the_ranks_along_the_true_path():
    """Row d of the block ranks token t at rank_d[t]; four rounds with known ranks along their true paths."""
    perms = [[2, 0, 5, 1, 3, 4], [1, 4, 0, 2, 5, 3], [3, 1, 2, 0, 4, 5]]  # token at rank r of depth d: perms[d][r]
    rank_of = [{t: r for r, t in enumerate(p)} for p in perms]
    logits = torch.tensor([[-float(rank_of[d][t]) for t in range(6)] for d in range(3)])
    block = DraftBlock(logits=logits, token_map=None, root=0, vocab_size=6)

    def cont(*ranks):
        return [perms[d][r] for d, r in enumerate(ranks)]

    rounds = [(block, cont(0, 1, 0)), (block, cont(2, 0)), (block, cont(0, 4, 1)), (block, torch.tensor(cont(1, 0, 2)))]
    # ranks=3: depth 1 sees 0, 2, 0, 1; depth 2 sees 1, 0, miss, 0; depth 3 sees 0, 2 (the third round stopped)
    assert _close(fit_rank_acceptance(rounds, 3, 3), ((3 / 8, 2 / 8, 2 / 8), (3 / 8, 2 / 8, 1 / 8),
                                                      (2 / 6, 1 / 6, 2 / 6)))
    assert _close(fit_rank_acceptance(rounds, 3, 3, prior=0.0), ((2 / 4, 1 / 4, 1 / 4), (2 / 4, 1 / 4, 0),
                                                                 (1 / 2, 0, 1 / 2)))
    # teacher-forced at every depth (Medusa's accuracies): the third round's depth 3 (rank 1) counts too
    assert _close(fit_rank_acceptance(rounds, 3, 3, prior=0.0, stop_at_miss=False)[2], (1 / 3, 1 / 3, 1 / 3))
    assert _close(fit_rank_acceptance(rounds, 4, 3)[3], (1 / 4, 1 / 4, 1 / 4))  # never observed: the prior


class _ShiftScorer:
    """A stand-in head over 5 tokens: after token p the children rank (p, p+1, ...) mod 5 (rank of t: t - p)."""

    def top_children(self, depth, prev_id, k):
        return -np.arange(5.0)[:k], (np.arange(5) + int(prev_id))[:k] % 5


def test_fit_conditions_on_the_true_parent():
    def block(root: int) -> DraftBlock:
        return DraftBlock(logits=torch.zeros(3, 5), token_map=None, root=root, vocab_size=5, scorer=_ShiftScorer())

    rounds = [(block(2), [4, 0, 3]), (block(0), [1, 1])]  # ranks: 2, 1, (3: a miss at ranks=3); 1, 0
    assert _close(fit_rank_acceptance(rounds, 3, 3, prior=0.0), ((0, 0.5, 0.5), (0.5, 0.5, 0), (0, 0, 0)))


def test_fit_from_replayed_rounds(pairs):
    """RecordRounds pairs each replayed round's block with the continuation after its root; the fit's table is the
    frequencies of the ranks recomputed from those blocks (a random drafter: wide rank rows, so some ranks hit)."""
    target, drafts = pairs
    p, ranks = prompt(3, 6, 64), 24
    ids = torch.cat([p[0], torch.tensor(greedy_reference(target, p, 16))])
    recorder = RecordRounds(FixedBudget(4))
    replay(target, drafts["plain"], recorder, ids, p.shape[1], 16)
    rounds = recorder.rounds(ids)
    assert len(rounds) >= 2
    counts = np.zeros((3, ranks + 1))
    for (block, after), (_, at) in zip(rounds, recorder.blocks):
        assert block.root == int(ids[at]) and after == ids[at + 1:].tolist()
        parent = block.root
        for d in range(1, min(3, len(after)) + 1):
            tokens = [t for t, _ in _child_rows(block, d, parent)][:ranks]
            rank = tokens.index(after[d - 1]) if after[d - 1] in tokens else ranks
            counts[d - 1, rank] += 1
            if rank == ranks:
                break
            parent = after[d - 1]
    assert counts[0, :ranks].sum() > 0 and counts[1].sum() > 0  # the rounds do reach below depth 1
    totals = counts.sum(axis=1, keepdims=True)
    expected = counts[:, :ranks] / np.maximum(totals, 1)
    assert _close(fit_rank_acceptance(rounds, 3, ranks, prior=0.0), expected)
    laplace = (counts[:, :ranks] + 1) / (totals + ranks + 1)
    assert _close(fit_rank_acceptance(rounds, 3, ranks), laplace)


# ---------------------------------------------------------------------------------------------- through the loop
@pytest.fixture(scope="module")
def pairs():
    target = make_target("llama", vocab=64, dtype=torch.float64, init=0.3)
    plain = make_draft(target, block_size=4)
    markov = make_draft(target, block_size=5)
    markov.set_draft_vocab(torch.randperm(64, generator=torch.Generator().manual_seed(0))[:48])
    head = attach_markov_head(markov, 6, "gated")
    with torch.no_grad():
        torch.manual_seed(0)
        head.out.weight.normal_(0, 1.0)
    return target, {"plain": plain, "markov": markov}


TABLE = ((0.5, 0.2, 0.1), (0.4, 0.2, 0.1), (0.3, 0.2, 0.1), (0.3, 0.1, 0.1))
POLICIES = {
    "eagle2": lambda: EagleTwoTree(10, top_k=3),
    "eagle2-published": EagleTwoTree.published,
    "sequoia": lambda: SequoiaTree(TABLE, 10, max_depth=3),
    "medusa": lambda: MedusaTree(TABLE, 10),
}


class _Spy(BlockPolicy):
    def __init__(self, policy: BlockPolicy) -> None:
        self.policy, self.seen = policy, []

    def propose(self, block, history):
        tree = self.policy.propose(block, history)
        self.seen.append((block, tree))
        return tree


@pytest.mark.parametrize("drafter", ["plain", "markov"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_every_builder_is_lossless(pairs, drafter, name):
    target, drafts = pairs
    for seed in range(2):
        p = prompt(seed, 7, 64)
        spy = _Spy(POLICIES[name]())
        out = speculative_generate(target, drafts[drafter], p, spy, max_new_tokens=20, check_trees=True)
        assert out.new_token_ids == greedy_reference(target, p, 20)
        budget = spy.policy.budget
        for block, tree in spy.seen:
            _checked(tree, budget)
            if isinstance(spy.policy, StaticRankTree):  # the same shape every round
                assert _rank_paths(block, tree) == {q for q in spy.policy.paths if len(q) <= block.depth}
