"""The Markov head, the conditioned tree builder and the loop's structure check.

Oracles: the conditioned builder against brute-force enumeration of every token sequence; the head's inference scorer
against a direct torch computation; generation with a Markov drafter against plain decoding in fp64; replay against
the loop; the training bias against the head applied to the target's own previous tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_draft, make_target, prompt
from ddtree import build_tree, ddtree_generate
from ddtree.build import build_conditioned_tree, build_markov_tree, reference_conditioned_tree
from ddtree.generate import FixedBudget
from dflash_core import BlockPolicy, Chain, autoregressive_generate, dflash_generate, load_draft, speculative_generate
from dflash_core.model import MarkovHead, MarkovScorer, attach_markov_head, draft_index, markov_scorer
from dflash_core.replay import replay_generate
from dflash_core.tree import DraftTree


def _paths(tree: DraftTree) -> dict[tuple[int, ...], float]:
    out, paths = {}, []
    for i in range(len(tree.token_ids)):
        parent = int(tree.parents[i])
        paths.append((paths[parent] if parent >= 0 else ()) + (int(tree.token_ids[i]),))
        out[paths[-1]] = float(tree.log_probs[i])
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 3, 7, 20, 60])
def test_conditioned_builder_equals_brute_force(seed, budget):
    g = torch.Generator().manual_seed(seed)
    vocab, depth = 4, 3
    logits = torch.randn(depth, vocab, generator=g, dtype=torch.float64) * 2
    table = torch.randn(depth, vocab + 1, vocab, generator=g, dtype=torch.float64) * 2  # bias per depth and parent

    def bias(d, parent):
        return table[d - 1, parent]

    tree = build_conditioned_tree(logits, budget, bias, root=vocab)  # the root: token `vocab` (its own bias row)
    expected = reference_conditioned_tree(logits, budget, bias, root=vocab)
    got = _paths(tree)
    assert set(got) == set(expected)
    for path, value in expected.items():
        assert got[path] == pytest.approx(value, abs=1e-5)
    tree.validate()  # parents first, best-first order, 1-based depths
    assert tree.expected_acceptance() == pytest.approx(1 + sum(np.exp(v) for v in expected.values()), abs=1e-5)


def test_zero_bias_gives_the_factorized_tree():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g) * 3
    for budget in (1, 8, 32, 100):
        conditioned = build_conditioned_tree(logits, budget, lambda d, t: torch.zeros(50), root=0)
        assert _paths(conditioned).keys() == _paths(build_tree(logits, budget)).keys()


def _markov_pair(dtype=torch.float64, kind="gated", vocab_subset=48, seed=0):
    target = make_target("llama", vocab=64, dtype=dtype, init=0.3)
    draft = make_draft(target, block_size=5, dtype=dtype)
    draft.set_draft_vocab(torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:vocab_subset])
    head = attach_markov_head(draft, 6, kind)
    with torch.no_grad():
        torch.manual_seed(seed)
        head.out.weight.normal_(0, 1.0)  # a head that changes the drafter's choices
    return target, draft


def test_scorer_equals_the_head_in_torch():
    target, draft = _markov_pair(torch.float32)
    g = torch.Generator().manual_seed(1)
    base, states = torch.randn(4, 48, generator=g), torch.randn(4, 32, generator=g)
    scorer = markov_scorer(draft, base, states)
    prev = torch.tensor([int(draft.draft_vocab[5]), 63 if 63 not in draft.draft_vocab else 0])
    for depth in (1, 4):
        bias = draft.markov(draft_index(draft, prev), states[depth - 1].expand(2, -1))
        expected = torch.log_softmax(base[depth - 1] + bias, dim=-1)
        assert np.allclose(scorer.log_probs(depth, prev.numpy()), expected.detach().numpy(), atol=1e-5)


def _tiny_scorer(seed: int, kind: str):
    """A real head over a 5-token draft vocabulary of an 8-token target, its scorer, and its bias in float64."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = MarkovHead(5, 6, 3, kind)
    with torch.no_grad():
        head.out.weight.normal_(0, 2.0)
    d2t = torch.tensor([6, 1, 4, 0, 3])
    t2d = np.full(8, 5, dtype=np.int64)
    t2d[d2t.numpy()] = np.arange(5)
    base, states = torch.randn(3, 5, generator=g) * 2, torch.randn(3, 6, generator=g)
    scorer = MarkovScorer(head, base, states, lambda ids: t2d[ids])

    def bias(depth, parent):  # the reference's parents: the root (a target id) at depth 1, else draft columns
        prev = torch.tensor([int(t2d[parent]) if depth == 1 else parent])
        with torch.no_grad():
            return head(prev, states[depth - 1][None])[0].double()

    return scorer, base, d2t, bias


@pytest.mark.parametrize("wave,floor", [(8, -8.0), (1, -8.0), (2, float("-inf")), (3, 0.0)])
@pytest.mark.parametrize("kind", ["token", "gated"])
def test_markov_tree_equals_brute_force(kind, wave, floor, monkeypatch):
    """The loop's builder (batched waves, the likely parents guessed first) against every path scored one by one:
    whatever the wave size and the guess (none, all depths), the tree is the best one."""
    import ddtree.build as conditioned

    monkeypatch.setattr(conditioned, "WAVE", wave)
    monkeypatch.setattr(conditioned, "PREFETCH_FLOOR", floor)
    for seed in range(3):
        for budget in (1, 3, 8, 20, 60):
            scorer, base, d2t, bias = _tiny_scorer(seed, kind)
            root = 2 if seed != 1 else 6  # 2: outside the draft vocabulary (the head's OOV row)
            tree = build_markov_tree(scorer, budget, root, d2t)
            expected = {tuple(int(d2t[c]) for c in path): value
                        for path, value in reference_conditioned_tree(base, budget, bias, root).items()}
            got = _paths(tree)
            assert set(got) == set(expected), (seed, budget)
            for path, value in expected.items():
                assert got[path] == pytest.approx(value, abs=1e-5)
            tree.validate()


def test_batched_children_equal_one_by_one():
    """MarkovScorer.fill's batch (mixed depths, gated) gives each parent's children as its own row does."""
    scorer, _, d2t, _ = _tiny_scorer(4, "gated")
    keys = [(1, 5), (2, 0), (3, 4), (2, 3), (3, 0)]
    scorer.fill(keys, 4)
    for depth, column in keys:
        prev = int(d2t[column]) if column < 5 else 2  # column 5: the OOV bucket (target 2 is outside)
        row = scorer.log_probs(depth, [prev])[0]
        values, columns = scorer.known[(depth, column)]
        assert columns.tolist() == np.argsort(-row, kind="stable")[:4].tolist()
        assert np.allclose(values, row[columns], atol=1e-6)


def _table_scorer(base: torch.Tensor, table: torch.Tensor) -> MarkovScorer:
    """A scorer whose head adds ``table[prev]`` (a [V'+1, V'] bias per previous draft column; row V' for the root)
    to each depth's logits: an exact, hand-written Markov head (rank V', identity output)."""
    vocab = base.shape[1]
    head = MarkovHead(vocab, 4, vocab, "token")
    with torch.no_grad():
        head.embed.weight.copy_(table)
        head.out.weight.copy_(torch.eye(vocab))
    return MarkovScorer(head, base, torch.zeros(base.shape[0], 4), lambda ids: np.asarray(ids))


def test_a_larger_build_never_uses_rows_a_smaller_one_cut_short():
    """A small build keeps few children per distribution; a larger build of the same round must not take them as
    complete. Depth 1 is sure of column 0; after it depth 2 is sure of column 1 (not the unconditioned favourite, so
    no prefetch guess covers it), and after column 1 depth 3 is flat: the 16-node tree takes 14 of its children."""
    vocab = 16
    base = torch.zeros(3, vocab)
    base[0, 0], base[1, 5], base[2, 7] = 30.0, 3.0, 5.0
    table = torch.zeros(vocab + 1, vocab)
    table[0, 1] = 30.0  # after column 0, depth 2 takes column 1
    table[1, 7] = -5.0  # after column 1, depth 3 is flat
    root = vocab  # outside the draft vocabulary: the bias row of the root
    want = build_markov_tree(_table_scorer(base, table), 16, root)
    assert want.depths.tolist().count(3) == 14 and want.parents.tolist().count(1) == 14
    scorer = _table_scorer(base, table)
    build_markov_tree(scorer, 4, root)  # leaves depth 3's row after column 1 with 4 children
    assert len(scorer.known[(3, 1)][0]) == 4
    got = build_markov_tree(scorer, 16, root)
    assert all(torch.equal(x, y) for x, y in ((got.token_ids, want.token_ids), (got.parents, want.parents),
                                              (got.depths, want.depths), (got.log_probs, want.log_probs)))


def test_a_new_head_changes_nothing_until_trained():
    target = make_target("llama", vocab=64, dtype=torch.float64)
    draft = make_draft(target, block_size=5)
    draft.set_draft_vocab(torch.arange(40))
    ids = prompt(0, 8, 64)
    before = ddtree_generate(target, draft, ids, budget=8, max_new_tokens=20, trace=True)
    attach_markov_head(draft, 4, "token")
    after = ddtree_generate(target, draft, ids, budget=8, max_new_tokens=20, trace=True)
    assert after.new_token_ids == before.new_token_ids and after.acceptance_lengths == before.acceptance_lengths
    for a, b in zip(after.trees, before.trees):
        assert _paths(a).keys() == _paths(b).keys()


@pytest.mark.parametrize("kind", ["token", "gated"])
def test_markov_drafter_is_lossless_and_replay_equals_the_loop(kind):
    target, draft = _markov_pair(kind=kind)
    for seed in range(3):
        ids = prompt(seed, 7, 64)
        plain = autoregressive_generate(target, ids, max_new_tokens=24).new_token_ids
        chain = dflash_generate(target, draft, ids, max_new_tokens=24)
        tree = ddtree_generate(target, draft, ids, budget=12, max_new_tokens=24)
        assert chain.new_token_ids == plain and tree.new_token_ids == plain
        replayed = replay_generate(target, draft, ids, {"chain": Chain(), "b12": FixedBudget(12)}, max_new_tokens=24)
        assert replayed["chain"].acceptance_lengths == chain.acceptance_lengths
        assert replayed["b12"].acceptance_lengths == tree.acceptance_lengths


def test_markov_trees_follow_each_nodes_own_token():
    """The loop's tree for a Markov drafter is the conditioned builder's on the round's scorer, not build_tree's."""
    target, draft = _markov_pair()
    res = ddtree_generate(target, draft, prompt(4, 7, 64), budget=10, max_new_tokens=12, trace=True)
    differs = 0
    for tree in res.trees:
        tree.validate()
        differs += _paths(tree).keys() != set()
    assert differs


def test_saved_markov_drafter_reloads_and_plain_checkpoints_stay_headless(tmp_path):
    target, draft = _markov_pair(torch.float32, kind="gated")
    draft.save_pretrained(tmp_path / "m")
    loaded = load_draft(tmp_path / "m")
    assert loaded.config.markov_rank == 6 and loaded.config.markov_kind == "gated"
    for (name, a), (_, b) in zip(sorted(draft.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name
    plain = make_draft(target, dtype=torch.float32)
    plain.save_pretrained(tmp_path / "p")
    assert load_draft(tmp_path / "p").markov is None
    assert "markov_head" not in (tmp_path / "p" / "config.json").read_text()


def test_training_bias_uses_the_targets_previous_tokens():
    from dflash_core.training.train_config import TrainConfig
    from dflash_core.training.loss import _markov_bias

    target, draft = _markov_pair(torch.float32)
    ids = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(0))
    src = torch.tensor([5, 6, 7, 20])  # the rows predicting ids[6], ids[7], ids[8], ids[21]
    hidden = torch.randn(4, 32)
    bias = _markov_bias(draft, TrainConfig(loss_vocab="draft"), ids, src, hidden, torch.device("cpu"))
    expected = draft.markov(draft_index(draft, ids[src]), hidden)
    assert torch.allclose(bias, expected)
    with pytest.raises(ValueError, match="loss_vocab='draft'"):
        _markov_bias(draft, TrainConfig(loss_vocab="batch"), ids, src, hidden, torch.device("cpu"))


class _Malformed(BlockPolicy):
    """Proposes the target's own continuation (all accepted if the tree were honoured) in a broken layout."""

    name = "malformed"

    def __init__(self, target, layout):
        self.target, self.layout = target, layout

    def propose(self, block, history):
        ids = torch.tensor([history])
        nxt = [int(t) for t in autoregressive_generate(self.target, ids, max_new_tokens=3).new_token_ids]
        if self.layout == "zero-based":
            return DraftTree(torch.tensor(nxt), torch.tensor([-1, 0, 1]), torch.tensor([0, 1, 2]),
                             torch.zeros(3, dtype=torch.float64))
        if self.layout == "children-first":
            return DraftTree(torch.tensor(nxt[::-1]), torch.tensor([1, 2, -1]), torch.tensor([3, 2, 1]),
                             torch.zeros(3, dtype=torch.float64))
        return DraftTree(torch.tensor(nxt), torch.tensor([-1, 0, 1]), torch.tensor([1, 3, 4]),  # skips depth 2
                         torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("layout", ["zero-based", "children-first", "skipped-depth"])
def test_the_loop_refuses_malformed_trees_every_round(layout):
    target = make_target("llama", vocab=64, dtype=torch.float64)
    draft = make_draft(target, block_size=5)
    with pytest.raises(ValueError, match="policy 'malformed' proposed an invalid tree"):
        speculative_generate(target, draft, prompt(1, 6, 64), _Malformed(target, layout), max_new_tokens=8)


def test_from_nodes_sorts_any_order_and_prefix_stays_valid():
    g = torch.Generator().manual_seed(5)
    tree = build_tree(torch.randn(5, 30, generator=g) * 2, 25)
    perm = torch.randperm(25, generator=g)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(25)
    parents = torch.where(tree.parents[perm] >= 0, inverse[tree.parents[perm].clamp(min=0)], -1)
    rebuilt = DraftTree.from_nodes(tree.token_ids[perm], parents, tree.log_probs[perm])
    rebuilt.validate()
    assert rebuilt.equals(tree)
    assert _paths(rebuilt.prefix(10)) == dict(list(_paths(tree).items())[:10])
    unsorted = DraftTree.from_nodes([7, 8, 9], [2, -1, 1])  # no log-probabilities: breadth first
    assert unsorted.depths.tolist() == [1, 2, 3] and unsorted.token_ids.tolist() == [8, 9, 7]
    with pytest.raises(ValueError, match="no cycles"):
        DraftTree.from_nodes([1, 2], [1, 0])
