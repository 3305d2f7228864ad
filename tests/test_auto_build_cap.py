"""How far ``auto`` builds (ddtree.candidates). ``build="exact"``: only as far as its choice can reach, the same choice
as the cap's tree, always. ``build="adaptive"`` (the default): one build at the adaptive size, the best prefix of it.

Oracles: the same policy forced to build the cap's tree every round (the behaviour before the adaptive build), fed
the same rounds (with a Markov head: on a fresh copy of the round's scorer, so that no row the adaptive builds left in
its cache can reach the oracle's tree); the complete list's best prefix for :func:`settled_prefix`; every node's
calibrated value for :func:`value_bound`; hand-computed sizes for the first build and the ladder; for the default
build, the best prefix of the tree built at the size it announced, computed here from the same memory.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from ddtree.budget import AutoBudget, Round, RoundMemory, best_prefix, calibrated_probs, value_bound
from ddtree.candidates import BUILD_FLOOR, BUILD_LOOKBACK, build_ladder, build_size, cap_tree, settled_prefix, \
    truncate_tree
from ddtree.conditioned import build_markov_tree
from ddtree.cost import CostModel
from ddtree.lookup import LookupTreePolicy
from dflash_core.markov import MarkovHead, MarkovScorer
from dflash_core.policy import DraftBlock, as_block

CAP = 128
GRID = (0, 1, 2, 4, 8, 16, 32, 64, 128)


class FullBuild(AutoBudget):
    """The oracle: the cap's tree every round (what auto built before it learnt to stop early)."""

    def build_sizes(self) -> tuple[int, ...]:
        return (self.cap,)


def curve(rng) -> CostModel:
    """A convex-ish CPU-like curve: flat for a few nodes, then steeper (random slopes)."""
    slopes = np.concatenate([[0.0, 0.0], rng.uniform(1e-4, 1.5e-3, len(GRID) - 2)])
    verify = 0.03 + np.cumsum(slopes * np.diff(np.concatenate([[0], GRID])))
    return CostModel(GRID, tuple(float(v) for v in verify), fixed_s=float(rng.uniform(0.002, 0.01)))


def random_logits(rng, depth: int = 15, vocab: int = 300) -> torch.Tensor:
    """A drafter block whose confidence varies from round to round (so the chosen sizes do)."""
    logits = rng.normal(0.0, 1.0, (depth, vocab)) * rng.uniform(0.5, 3.0)
    top = rng.integers(0, vocab, depth)
    logits[np.arange(depth), top] += rng.uniform(0.0, 12.0, depth)
    return torch.tensor(logits, dtype=torch.float32)


def markov_block(rng, seed: int, depth: int = 8, vocab: int = 64) -> DraftBlock:
    """A block of a drafter with a (random, trained-looking) Markov head over a compact draft vocabulary."""
    torch.manual_seed(seed)
    head = MarkovHead(vocab, 16, 4, "gated")
    with torch.no_grad():
        head.out.weight.normal_(0, 1.5)
    token_map = torch.tensor(rng.permutation(2 * vocab)[:vocab], dtype=torch.int64)
    to_index = np.full(2 * vocab, vocab, dtype=np.int64)
    to_index[token_map.numpy()] = np.arange(vocab)
    base = random_logits(rng, depth, vocab)
    states = torch.tensor(rng.normal(0.0, 1.0, (depth, 16)), dtype=torch.float32)
    scorer = MarkovScorer(head, base, states, lambda ids: to_index[ids])
    return DraftBlock(base, token_map, int(token_map[0]), 2 * vocab, states, scorer)


def accepted_path(rng, tree) -> list[int]:
    """A walk the target might accept: from the root, each step takes one of the node's children or stops."""
    parents, path, at = tree.parents.tolist(), [], -1
    while True:
        kids = [i for i, p in enumerate(parents) if p == at]
        if not kids or rng.random() < 0.3:
            return path
        at = kids[min(int(rng.geometric(0.6)) - 1, len(kids) - 1)]
        path.append(at)


def same_tree(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in ((a.token_ids, b.token_ids), (a.parents, b.parents),
                                              (a.depths, b.depths), (a.log_probs, b.log_probs)))


def run_side_by_side(make, blocks, rng):
    """Drive the adaptive policy and the full-build oracle through the same rounds; both must propose the same
    trees (and so learn the same). Returns the adaptive policy."""
    adaptive, full = make(AutoBudget), make(FullBuild)
    history = [int(t) for t in rng.integers(0, 40, 24)]
    for i, block in enumerate(blocks):
        fresh = copy.deepcopy(block)  # the oracle's own scorer cache (a Markov head's rows)
        got, want = adaptive.propose(block, history), full.propose(fresh, history)
        assert same_tree(got, want), i
        path = accepted_path(rng, got)
        adaptive.observe(path)
        full.observe(path)
        history += [int(got.token_ids[j]) for j in path] + [int(rng.integers(0, 40))]
    assert adaptive.chosen == full.chosen
    assert len(adaptive.rebuilds) == len(adaptive.built) == len(blocks) and full.rebuilds == [0] * len(blocks)
    return adaptive


def run_lookup_rounds(auto: AutoBudget, blocks, rng) -> LookupTreePolicy:
    """Lookup branches under the adaptive ``auto``; every round the oracle is a copy of the policy as it stands with
    the cap's tree built instead: the same tree. (Whole runs may part: a verified lookup node that only the cap's
    tree holds as a drafter node is booked as the drafter's there, as the lookup's after a smaller build.)"""
    policy = LookupTreePolicy(auto)
    history = [int(t) for t in rng.integers(0, 40, 24)]
    for i, block in enumerate(blocks):
        policy.wants_draft(history)
        oracle = copy.deepcopy(policy)
        oracle.auto.__class__ = FullBuild
        got = policy.propose(block, history)
        assert same_tree(got, oracle.propose(block, history)), i
        path = accepted_path(rng, got)
        policy.observe(path)
        history += [int(got.token_ids[j]) for j in path] + [int(rng.integers(0, 40))]
    return policy


@pytest.mark.parametrize("calibrate", ["depth", "none", "power", "bucket"])
@pytest.mark.parametrize("rule", ["marginal", "ratio"])
def test_adaptive_build_chooses_what_the_full_build_chooses(calibrate, rule):
    rng = np.random.default_rng(7)
    cost = curve(rng)
    blocks = [random_logits(rng) for _ in range(60)]
    auto = run_side_by_side(lambda cls: cls(cost, cap=CAP, calibrate=calibrate, rule=rule, build="exact"), blocks,
                            rng)
    small = [b for b in auto.built if b < CAP]
    assert len(small) > len(auto.built) // 3  # many rounds were settled by a small build: the test is not vacuous
    assert max(auto.rebuilds) > 0 and max(auto.chosen) > 0  # ... and some only by a rebuild


def test_adaptive_build_on_a_markov_head():
    """The conditioned tree (a drafter with a Markov head): the same trees as the oracle."""
    rng = np.random.default_rng(3)
    cost = curve(rng)
    blocks = [markov_block(rng, seed) for seed in range(30)]
    auto = run_side_by_side(lambda cls: cls(cost, cap=CAP, build="exact"), blocks, rng)
    assert min(auto.built) < CAP and max(auto.rebuilds) > 0


@pytest.mark.parametrize("calibrate", ["depth", "bucket", "power"])
def test_adaptive_build_with_lookup_branches(calibrate):
    """Merged with the context's continuation (a small vocabulary: the history repeats, so matches are found), only
    the merged values above every left-out node's are final: the same trees as the oracle."""
    rng = np.random.default_rng(1)
    cost = curve(rng)
    blocks = [random_logits(rng, vocab=60) for _ in range(60)]
    policy = run_lookup_rounds(AutoBudget(cost, build="exact", cap=CAP, calibrate=calibrate), blocks, rng)
    assert sum(b < CAP for b in policy.auto.built) > 5 and sum(policy.lookup_committed) > 0
    assert max(policy.auto.rebuilds) > 0


def test_chain_auto_builds_adaptively_too():
    rng = np.random.default_rng(5)
    cost = curve(rng)
    blocks = [random_logits(rng) for _ in range(30)]
    run_side_by_side(lambda cls: cls(cost, cap=12, chain=True, build="exact"), blocks, rng)


def test_the_first_build_follows_a_high_quantile_of_recent_sizes():
    """1.25 x the 4th largest of the last 16 verified sizes, rounded up, + 2; at least 8, at most the cap."""
    cost = CostModel((0, CAP), (0.03, 0.03 + CAP * 1e-5), 0.005)
    policy = AutoBudget(cost, build="exact", cap=CAP, calibrate=False)
    assert policy.build_sizes() == (8, 16, 32, 64, CAP)  # nothing verified yet: the floor

    def remember(sizes):
        for n in sizes:
            policy.memory.append(Round(np.log(np.full(n, 0.5)), np.arange(1, n + 1), np.zeros(n, bool), 0.03))

    remember([10] * BUILD_LOOKBACK)
    assert policy.build_sizes() == (15, 30, 60, 120, CAP)  # ceil(12.5) + 2
    remember([40] * 3)  # three outliers among the last 16: the 4th largest is still 10
    assert policy.build_sizes() == (15, 30, 60, 120, CAP)
    remember([40])  # a fourth: 40 -> 52
    assert policy.build_sizes() == (52, 104, CAP)
    remember([3] * 13)  # three 40s left among the last 16: the 4th largest is 3 -> ceil(3.75) + 2 = 6 < 8
    assert policy.build_sizes() == (BUILD_FLOOR, 16, 32, 64, CAP)
    remember([12] * BUILD_LOOKBACK)
    assert policy.build_sizes() == (17, 34, 68, CAP)
    assert build_size([], 5) == 5 and build_size([1, 2, 3, 4, 200], CAP) == BUILD_FLOOR  # sorted[3] = 4 -> 7
    assert build_size([8, 9, 10, 11, 12, 8, 9, 10], CAP) == 16  # sorted[6] = 11 -> ceil(13.75) + 2
    # edge: no bound, the cap's tree
    assert AutoBudget(cost, cap=CAP, calibrate="edge", build="exact").build_sizes() == (CAP,)
    assert AutoBudget(cost, build="exact", cap=8).build_sizes() == (8,)
    assert build_ladder(0, 0) == (0,) and build_ladder(5, 5) == (5,) and build_ladder(7, 20) == (7, 14, 20)
    with pytest.raises(ValueError, match="at least one node"):
        build_ladder(0, 4)


def test_the_ladder_doubles_up_to_the_cap_when_only_the_cap_settles():
    cost = CostModel((0, CAP), (0.03, 0.03 + CAP * 1e-5), 0.005)  # nearly free nodes: a confident tree grows large
    policy = AutoBudget(cost, build="exact", cap=CAP, calibrate=False)
    sure = torch.full((15, 50), -8.0)
    sure[:, :4] = torch.tensor([6.0, 5.5, 5.0, 4.5])  # many likely prefixes: worth far more than any rung
    oracle = FullBuild(cost, cap=CAP, calibrate=False).propose(sure, [1])
    tree = policy.propose(sure, [1])
    assert same_tree(tree, oracle) and len(tree) > 64  # beyond every rung: built again at each, then at the cap
    assert policy.built == [8 + 16 + 32 + 64 + CAP] and policy.rebuilds == [4]


def markov_table_scorer(base: torch.Tensor, table: torch.Tensor) -> MarkovScorer:
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
    want = build_markov_tree(markov_table_scorer(base, table), 16, root)
    assert want.depths.tolist().count(3) == 14 and want.parents.tolist().count(1) == 14
    scorer = markov_table_scorer(base, table)
    build_markov_tree(scorer, 4, root)  # leaves depth 3's row after column 1 with 4 children
    assert len(scorer.known[(3, 1)][0]) == 4
    assert same_tree(build_markov_tree(scorer, 16, root), want)
    wide = markov_table_scorer(base, table)
    build_markov_tree(wide, 4, root, width=16)  # rows wide enough for the larger build
    assert len(wide.known[(3, 1)][0]) == 16
    assert same_tree(build_markov_tree(wide, 16, root), want)


def test_a_rebuild_reuses_every_row_of_the_first_build(monkeypatch):
    """Each build keeps as many children per distribution as the next rung needs: in a round built twice, no
    distribution is computed twice (a third rung may recompute the first rung's rows: they are too short for it)."""
    rng = np.random.default_rng(3)
    cost = curve(rng)
    computed: list[tuple[int, int]] = []
    fill = MarkovScorer.fill

    def spy(self, keys, k):  # a key is computed when it is not held with min(k, V') children
        held = self.known
        need = min(k, self.base.shape[1])
        computed.extend(key for key in dict.fromkeys(keys) if key not in held or len(held[key][0]) < need)
        fill(self, keys, k)

    monkeypatch.setattr(MarkovScorer, "fill", spy)
    policy = AutoBudget(cost, build="exact", cap=CAP)
    history = [int(t) for t in rng.integers(0, 40, 24)]
    twice = 0
    for seed in range(30):
        computed.clear()
        tree = policy.propose(markov_block(rng, seed), history)
        policy.observe(accepted_path(rng, tree))
        if policy.rebuilds[-1] <= 1:
            assert len(computed) == len(set(computed)), seed
            twice += policy.rebuilds[-1] == 1
    assert twice > 0  # some round was built twice: the test is not vacuous


def test_settled_prefix_never_disagrees_with_the_complete_list():
    rng = np.random.default_rng(0)
    settled = 0
    for trial in range(400):
        cap = int(rng.integers(1, 80))
        seconds = 0.03 + np.cumsum(np.concatenate([[0.0], rng.uniform(0.0, 2e-3, cap)]))
        rate = None if trial % 3 == 0 else float(rng.uniform(10, 200))
        exact = int(rng.integers(0, cap + 1))
        known = np.sort(rng.random(exact) ** rng.uniform(1, 8))[::-1]
        beyond = float(rng.uniform(0, known[-1] if exact else 1.0))
        rest = rng.uniform(0, beyond, int(rng.integers(0, cap - exact + 1)))  # any unknown tail below the bound
        n = settled_prefix(known, seconds, rate, exact, beyond)
        if n is not None:
            settled += 1
            assert n == best_prefix(np.concatenate([known, rest]), None, rate, seconds), trial
    assert 50 < settled < 400  # both outcomes occur
    with pytest.raises(ValueError, match="exact"):
        settled_prefix(np.ones(3), np.ones(3), None, 3, 0.1)


@pytest.mark.parametrize("method", ["none", "power", "depth", "bucket"])
def test_value_bound_bounds_every_node_below_the_path_probability(method):
    rng = np.random.default_rng(1)
    memory = RoundMemory(64)
    for _ in range(64):
        depths = rng.integers(1, 12, 20)
        log_p = -rng.exponential(1.5, 20) * depths / 3
        memory.append(Round(log_p, depths, rng.random(20) < np.exp(log_p) * rng.uniform(0.3, 1.8), 0.03))
    for trial in range(50):
        top = -float(rng.exponential(2.0))
        log_p = top - rng.exponential(1.0, 500) * (rng.random(500) < 0.9)  # some exactly at the bound's log p
        depths = rng.integers(1, 80, 500)
        bound = value_bound(top, memory, method)
        assert calibrated_probs(log_p, depths, memory, method).max() <= bound, trial
        if method != "bucket":  # values grow with p at every depth: the bound is the largest value at the probe
            at_top = calibrated_probs(np.full(64, top), np.arange(1, 65), memory, method).max()
            assert bound == pytest.approx(at_top, rel=1e-8)
    with pytest.raises(ValueError, match="edge"):
        value_bound(-1.0, memory, "edge")


@pytest.mark.parametrize("markov", [False, True])
def test_the_default_build_is_one_build_at_the_adaptive_size(markov):
    """Every round: one build of ``build_sizes()[0]`` nodes and the best prefix of exactly that tree (the oracle
    builds it with ``cap_tree`` and chooses with ``best_prefix`` over the same calibrated values)."""
    rng = np.random.default_rng(11)
    cost = curve(rng)
    policy = AutoBudget(cost, cap=CAP)
    assert policy.build == "adaptive"
    history = [int(t) for t in rng.integers(0, 40, 24)]
    for i in range(40):
        block = markov_block(rng, i) if markov else random_logits(rng)
        as_draft = as_block(block, history, None)
        (size,) = policy.build_sizes()
        rounds = policy.memory if len(policy.memory) >= policy.warmup else ()
        ref = cap_tree(copy.deepcopy(as_draft), size, False, history)
        probs = calibrated_probs(ref.log_probs.double().numpy(), ref.depths.numpy(), rounds, policy.calibrate,
                                 parents=ref.parents.numpy())
        n = best_prefix(probs, policy.curve, policy.rate if policy.rule == "marginal" else None)
        got = policy.propose(block, history)
        assert same_tree(got, truncate_tree(ref, n)), i
        assert policy.rebuilds[-1] == 0 and policy.built[-1] == len(ref) <= size
        path = accepted_path(rng, got)
        policy.observe(path)
        history += [int(got.token_ids[j]) for j in path] + [int(rng.integers(0, 40))]
    assert len(set(policy.built)) > 1  # the size moved with the rounds


def test_the_default_build_grows_while_choices_fill_it():
    """Nearly free nodes and a confident drafter: each build is chosen whole, so the builds grow round after round
    (1.25 x the window's high quantile + 2) until the cap."""
    cost = CostModel((0, CAP), (0.03, 0.03 + CAP * 1e-5), 0.005)
    policy = AutoBudget(cost, cap=CAP, calibrate=False)
    sure = torch.full((15, 50), -8.0)
    sure[:, :4] = torch.tensor([6.0, 5.5, 5.0, 4.5])
    for _ in range(40):
        tree = policy.propose(sure, [1])
        policy.observe(list(range(min(len(tree), 3))))
    assert policy.built[0] == BUILD_FLOOR and policy.chosen == policy.built  # every build chosen whole
    assert policy.built == sorted(policy.built) and policy.built[-1] == CAP and policy.built[1] > BUILD_FLOOR
    assert policy.rebuilds == [0] * 40
    with pytest.raises(ValueError, match="unknown build"):
        AutoBudget(cost, build="ladder")

