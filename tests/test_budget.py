"""The 'auto' budget policy: objective oracle, limiting cost curves, calibration, how far it builds, the memory its
caller holds, losslessness.

Oracles for the build: the best prefix of the tree built at the size the policy announced, computed here from the same
memory (with a Markov head: on a fresh copy of the round's scorer, so that no row the policy's build left in its cache
can reach the oracle's tree); hand-computed sizes for the first build."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from conftest import make_draft, make_target, prompt, record_masks
from ddtree import build_tree, ddtree_generate
from ddtree import cost as cost_module
from ddtree.budget import (
    BUILD_FLOOR, BUILD_LOOKBACK, AutoBudget, Round, RoundMemory, best_prefix, build_size, calibrated_probs,
)
from ddtree.build import best_tree
from ddtree.cost import CostModel, OnlineCost, across_contexts, calibrate, curve_error, measure_cost_model
from dflash_core import autoregressive_generate, decoding
from dflash_core.model import MarkovHead, MarkovScorer
from dflash_core.replay import replay
from dflash_core.tree import DraftBlock

CAP = 128
GRID = (0, 1, 2, 4, 8, 16, 32, 64, 128)


def block_of(logits: torch.Tensor, root: int = 0, token_map: torch.Tensor | None = None) -> DraftBlock:
    """A round's drafter block from its logits (over a draft vocabulary when ``token_map`` is given)."""
    return DraftBlock(logits, token_map, root, logits.shape[1] if token_map is None else int(token_map.max()) + 1)


def brute_force_prefix(probs, cost):
    best, best_n = -1.0, 0
    for n in range(len(probs) + 1):
        value = (1 + sum(probs[:n])) / (cost.fixed_s + float(cost.verify(n)))
        if value > best + 1e-15:
            best, best_n = value, n
    return best_n


def test_best_prefix_is_the_argmax_of_the_objective():
    rng = np.random.default_rng(0)
    for trial in range(200):
        probs = np.sort(rng.random(rng.integers(0, 60)) ** rng.uniform(0.5, 6))[::-1]
        grid = np.unique(np.concatenate([[0], rng.integers(1, 200, 5)]))
        verify = np.cumsum(rng.random(len(grid)) * rng.uniform(0.01, 1.0))
        cost = CostModel(tuple(int(g) for g in grid), tuple(verify), fixed_s=float(rng.uniform(0, 0.5)))
        assert best_prefix(probs, cost) == brute_force_prefix(list(probs), cost), trial


def test_flat_cost_takes_the_cap_and_steep_cost_shrinks_to_a_chain():
    logits = torch.full((8, 50), -5.0)
    logits[:, 3] = 4.0  # a confident drafter: the top-1 chain carries most of the mass
    logits[:, 4] = 1.0
    flat = CostModel((0, 1024), (0.02, 0.02), fixed_s=0.005)
    steep = CostModel((0, 1, 1024), (0.02, 0.021, 20.0), fixed_s=0.005)
    policy = AutoBudget(flat, cap=40)  # nothing learnt yet: the choice rule alone
    assert len(policy.propose(block_of(logits), [0])) == BUILD_FLOOR == policy.built[-1]  # the whole build
    chain = AutoBudget(steep, cap=40).propose(block_of(logits), [0])
    assert 1 <= len(chain) <= 8
    assert chain.depths.tolist() == list(range(1, len(chain) + 1))  # one node per depth: a chain
    assert AutoBudget(CostModel((0, 1), (0.01, 10.0), 0.0), cap=40).propose(block_of(logits), [0]).token_ids.numel() \
        == 0


def test_truncated_best_first_prefix_is_a_valid_tree():
    tree = build_tree(torch.randn(6, 30, generator=torch.Generator().manual_seed(1)) * 2, 64)
    for n in (0, 1, 5, 17, 64):
        sub = tree.prefix(n)
        assert len(sub) == n and (sub.parents < torch.arange(n)).all()
        sub.validate()


def test_policy_feedback_moves_the_calibration():
    cost = CostModel((0, 128), (0.02, 0.06), 0.005)
    policy = AutoBudget(cost, cap=32)
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(0)) * 3
    for _ in range(10):
        tree = policy.propose(block_of(logits), [0])
        policy.observe([])  # the target never agrees: the drafter is over-confident
    assert len(policy.memory) == 10 and len(tree) > 0
    _, probs = policy.drafter_tree(block_of(logits), 8)
    raw = np.exp(best_tree(block_of(logits), 8).log_probs.double().numpy())
    assert (probs < raw).all()  # every depth's factor fell below 1


@pytest.mark.measured
def test_auto_measures_its_cost_curve_for_real(monkeypatch, tmp_path, family):
    """The real timer (marked ``measured``): nothing asserted depends on the seconds' values."""
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    target = make_target(family, vocab=64, dtype=torch.float32)
    draft = make_draft(target, block_size=5)
    cost = measure_cost_model(target, draft, grid=(0, 1, 4, 16), context=32, repeats=1)
    # verify_s is made monotone by construction (test_cost_model_rejects_bad_curves); what can be wrong here is
    # what was measured: every size of the grid, finite positive seconds, and the time spent measuring
    assert cost.nodes == (0, 1, 4, 16) and all(0 < s < 10 for s in cost.verify_s) and 0 < cost.fixed_s < 10
    assert cost.measured_s > 0 and cost.context == 32
    assert measure_cost_model(target, draft, grid=(0, 1, 4, 16), context=32) == cost  # read back from the cache
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    (cached,) = (tmp_path / "costs").glob("*.json")
    cached.write_text('{"nodes": [0, 1, 4, 16], "verify_s": [0.1')  # damaged: cut off mid-write by another tool
    with pytest.warns(UserWarning, match="damaged cache file"):
        again = measure_cost_model(target, draft, grid=(0, 1, 4, 16), context=32, repeats=1)
    assert again.nodes == cost.nodes and cached.is_file()  # measured again and rewritten whole


def test_auto_budget_is_lossless(family):
    """budget="auto" on its public path (the curve it measures is the tests' fixed calibration, see conftest:
    verifying is flat, so it grows trees) and on a steep curve (single nodes) gives plain decoding's tokens."""
    target = make_target(family, vocab=64, dtype=torch.float32)
    draft = make_draft(target, block_size=5)
    grown = 0
    for seed in range(3):
        p = prompt(40 + seed, 6, 64)
        ref = autoregressive_generate(target, p, max_new_tokens=32).new_token_ids
        out = ddtree_generate(target, draft, p, budget="auto", max_new_tokens=32, seed=seed)
        assert out.new_token_ids == ref
        grown += max(out.tree_sizes) > 1
        steep = ddtree_generate(target, draft, p, max_new_tokens=32,
                                policy=AutoBudget(CostModel((0, 1, 8), (0.0, 1.0, 100.0), 0.01), cap=16))
        assert steep.new_token_ids == ref and max(steep.tree_sizes) <= 1
    assert grown == 3


def test_cost_model_rejects_bad_curves():
    with pytest.raises(ValueError):
        CostModel((0,), (1.0,), 0.0)
    with pytest.raises(ValueError):
        CostModel((4, 1), (1.0, 2.0), 0.0)
    assert CostModel((0, 2, 4), (1.0, 0.5, 2.0), 0.0).verify_s == (0.75, 0.75, 2.0)  # monotone by least squares


def test_marginal_rule_is_the_argmax_of_its_objective():
    rng = np.random.default_rng(5)
    for trial in range(200):
        probs = np.sort(rng.random(rng.integers(0, 60)) ** rng.uniform(0.5, 6))[::-1]
        cost = CostModel((0, 8, 64), tuple(np.cumsum(rng.random(3) * 0.05)), fixed_s=float(rng.uniform(0, 0.05)))
        rate = float(rng.uniform(1, 200))
        values = [1 + probs[:n].sum() - rate * float(cost.round_seconds(n)) for n in range(len(probs) + 1)]
        assert best_prefix(probs, cost, rate) == int(np.argmax(values)), trial


def _rounds(rng, n_rounds):
    """Synthetic rounds: sorted path probabilities whose spread varies from round to round (confident and doubtful
    drafts), as a best-first tree produces them."""
    return [np.sort(rng.random(48) ** rng.uniform(0.3, 12))[::-1] for _ in range(n_rounds)]


def test_marginal_rule_at_the_long_run_rate_beats_the_ratio_rule_and_every_fixed_size():
    """Renewal-reward oracle: with the true expected tokens per round, the long-run rate sum(gain) / sum(seconds) of
    the marginal rule at its own fixed-point rate (Dinkelbach) is at least that of any other size choice."""
    rng = np.random.default_rng(11)
    rounds = _rounds(rng, 400)
    cost = CostModel((0, 4, 16, 48), (0.020, 0.022, 0.030, 0.060), fixed_s=0.004)

    def long_run(choose):
        gain = sum(1 + p[: choose(p)].sum() for p in rounds)
        return gain / sum(float(cost.round_seconds(choose(p))) for p in rounds)

    rate = long_run(lambda p: best_prefix(p, cost))
    for _ in range(30):  # Dinkelbach's iteration converges to the optimal rate
        rate = long_run(lambda p: best_prefix(p, cost, rate))
    marginal = long_run(lambda p: best_prefix(p, cost, rate))
    ratio = long_run(lambda p: best_prefix(p, cost))
    fixed = max(long_run(lambda p, n=n: n) for n in range(49))
    assert marginal >= ratio - 1e-12 and marginal >= fixed - 1e-12
    assert marginal > ratio * 1.001  # varied rounds: the ratio rule is measurably worse here


def _accepted_path(rng, log_p, depths, truth):
    """Draw which nodes the target accepts when node i's path is accepted with probability truth[i] and at most one
    node per depth is accepted (the accepted path): depth by depth, pick one node or none."""
    accepted = np.zeros(len(log_p), dtype=bool)
    for d in np.unique(depths):
        at = np.flatnonzero(depths == d)
        u, edges = rng.random(), np.cumsum(truth[at])
        hit = np.searchsorted(edges, u, side="right")
        if hit < len(at):
            accepted[at[hit]] = True
    return accepted


def test_calibration_recovers_a_miscalibrated_drafter():
    """Synthetic drafter whose true acceptance is 0.6 ** depth times its claim: the calibration must move the
    predicted total toward the observed one and recover the per-depth factors."""
    rng = np.random.default_rng(2)
    history = []
    for _ in range(3000):
        depths = np.repeat(np.arange(1, 5), 3)
        log_p = -rng.uniform(0.0, 0.4, len(depths)) * depths - np.log(3)
        truth = np.exp(log_p) * 0.6 ** depths
        history.append(Round(log_p, depths, _accepted_path(rng, log_p, depths, truth), 0.01))
    log_p, depths = history[0].log_p, history[0].depths
    raw = calibrated_probs(log_p, depths, [])  # nothing learnt: the drafter's own probabilities
    assert np.array_equal(raw, np.exp(log_p))
    fitted = calibrated_probs(log_p, depths, history)
    truth = np.exp(log_p) * 0.6 ** depths
    assert abs(fitted.sum() - truth.sum()) < abs(raw.sum() - truth.sum()) * 0.5
    assert np.allclose(fitted / raw, 0.6 ** depths, rtol=0.15)


def test_chain_auto_is_lossless_and_proposes_chains(family):
    target = make_target(family, vocab=6, init=0.3)
    draft = make_draft(target, block_size=5)
    cost = CostModel((0, 1, 2, 4), (0.010, 0.011, 0.013, 0.020), 0.002)
    for seed in range(3):
        p = prompt(60 + seed, 5, 6)
        ref = autoregressive_generate(target, p, max_new_tokens=30).new_token_ids
        policy = AutoBudget(cost, chain=True)
        out = ddtree_generate(target, draft, p, max_new_tokens=30, policy=policy, trace=True)
        assert out.new_token_ids == ref
        assert all(t.depths.tolist() == list(range(1, len(t.token_ids) + 1)) for t in out.trees)
        assert out.tree_sizes == policy.chosen and max(policy.chosen) <= 4


@pytest.mark.parametrize("chain", [False, True])
def test_auto_replays_exactly(chain):
    """The policy reads no clock: replaying its rounds offline gives the decode loop's rounds, feedback included."""
    target = make_target("llama", vocab=6, init=0.3)
    draft = make_draft(target, block_size=5)
    cost = CostModel((0, 2, 8, 24), (0.010, 0.011, 0.014, 0.030), 0.002)
    live_policy, replay_policy = AutoBudget(cost, cap=24, chain=chain), AutoBudget(cost, cap=24, chain=chain)
    for seed in range(3):  # one memory across prompts, as a caller that holds it
        p = prompt(80 + seed, 4, 6)
        live = ddtree_generate(target, draft, p, max_new_tokens=36, policy=live_policy)
        ids = torch.cat([p[0], torch.tensor(live.new_token_ids)])
        got = replay(target, draft, replay_policy, ids, p.shape[1], 36)
        assert got.acceptance_lengths == live.acceptance_lengths and got.tree_sizes == live.tree_sizes
    assert len(live_policy.memory) >= live_policy.warmup and live_policy.rate is not None
    assert len(set(live_policy.chosen)) > 1  # the size moved with the drafter's confidence


def test_the_caller_holds_the_memory_and_bad_options(monkeypatch, tmp_path):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    target = make_target("llama", vocab=16, dtype=torch.float32)
    draft = make_draft(target, block_size=4)
    cost = CostModel((0, 4), (0.01, 0.02), 0.001, key="k")
    a, b = AutoBudget.for_models(target, draft, cost=cost), AutoBudget.for_models(target, draft, cost=cost)
    assert a.memory is not b.memory and a.online_cost is not b.online_cost  # nothing held: each starts fresh
    assert len(a.memory) == 0 and a.online_cost.rounds == 0 and a.clock is not None
    memory = RoundMemory()
    c, d = (AutoBudget.for_models(target, draft, cost=cost, memory=memory) for _ in range(2))
    assert c.memory is d.memory is memory and c.online_cost is d.online_cost is memory.online_cost(cost)
    other = CostModel((0, 4), (0.01, 0.03), 0.001, key="k", context=512)  # another context's curve: its own
    assert AutoBudget.for_models(target, draft, cost=other, memory=memory).online_cost is not c.online_cost
    assert AutoBudget.for_models(target, draft, cost=cost, online=False).clock is None
    with pytest.raises(ValueError, match="cap"):
        AutoBudget(cost, cap=-1)
    with pytest.raises(ValueError, match="window"):
        RoundMemory(window=0)
    with pytest.raises(ValueError, match="chain-auto"):
        ddtree_generate(target, draft, prompt(1, 3, 16), budget="chains")


def test_round_memory_running_totals_equal_a_fresh_count():
    """The running sums after evictions equal the sums over the rounds still held (oracle: recount)."""
    rng = np.random.default_rng(4)
    memory = RoundMemory(window=7)
    for _ in range(30):
        n = int(rng.integers(0, 12))
        memory.append(Round(np.sort(np.log(rng.random(n)))[::-1], rng.integers(1, 6, n), rng.random(n) < 0.3,
                            float(rng.random())))
    fresh = RoundMemory.of(list(memory))
    assert len(memory) == 7 and memory.tokens == fresh.tokens == sum(r.tokens for r in memory)
    assert memory.seconds == pytest.approx(fresh.seconds)
    for name in ("depth_pred", "depth_obs", "depth_nodes"):
        assert np.allclose(getattr(memory, name), getattr(fresh, name), atol=1e-9), name
    log_p, depths = np.log(np.array([0.9, 0.5, 0.05])), np.array([1, 2, 9])
    assert np.allclose(calibrated_probs(log_p, depths, memory), calibrated_probs(log_p, depths, list(memory)))


# ---------------------------------------------------------------------------------------------------- online cost
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run_rounds(policy, clock, seconds_of, rounds, rng, history):
    """Drive ``policy`` as the decode loop does: propose, the round takes ``seconds_of(n)``, observe, commit; returns
    the history (a round is timed at the next propose). The target accepts up to 2 tokens along the tree's most
    probable path."""
    for _ in range(rounds):
        logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30)))) * 3
        tree = policy.propose(block_of(logits, history[-1]), history)
        n = len(tree.token_ids)
        clock.now += seconds_of(n)
        path, node = [], -1
        for _ in range(int(rng.integers(0, min(n, 2) + 1))):
            kids = [i for i in range(n) if int(tree.parents[i]) == node]
            if not kids:
                break
            node = kids[0]  # best first: the most probable child
            path.append(node)
        policy.observe(path)
        history = history + [5] * (len(path) + 1)
    return history


def test_online_curve_learns_round_times_twice_the_measured_ones():
    """Rounds that take twice what the measured curve says move the online curve to ~2x at every size; a single
    stalled round (an outlier) moves nothing, and a gap between generations is not taken for a round."""
    measured = CostModel((0, 4, 16, 32), (0.010, 0.012, 0.020, 0.030), fixed_s=0.004)
    clock = FakeClock()
    policy = AutoBudget(measured, cap=32, clock=clock)
    rng = np.random.default_rng(0)
    twice = lambda n: 2.0 * float(measured.round_seconds(n))  # noqa: E731
    history = _run_rounds(policy, clock, twice, 40, rng, [1, 2, 3])
    assert policy.online_cost.rounds == 39  # the last round ends at the next propose
    error = curve_error(policy.online_cost, measured)
    assert set(error) == {0, 4, 16, 32} and all(abs(e - 1.0) < 1e-9 for e in error.values()), error
    assert np.allclose(policy._seconds, 2.0 * measured.round_seconds(np.arange(33)))  # the policy prices with it
    assert policy.cost is measured and curve_error(measured, measured) == {0: 0.0, 4: 0.0, 16: 0.0, 32: 0.0}
    history = _run_rounds(policy, clock, lambda n: 100.0, 1, rng, history)  # one stalled round
    _run_rounds(policy, clock, twice, 1, rng, history)
    assert policy.online_cost.rounds == 41
    assert all(abs(e - 1.0) < 1e-9 for e in curve_error(policy.online_cost, measured).values())
    clock.now += 50.0  # prefill of the next prompt
    policy.propose(block_of(torch.randn(6, 40), 3), [1, 2, 3])  # a new generation: not grown from the last round
    assert policy.online_cost.rounds == 41


def test_online_curve_tracks_each_size_and_stays_replayable_without_a_clock():
    measured = CostModel((0, 8, 64), (0.01, 0.02, 0.05), fixed_s=0.0)
    online = OnlineCost(measured, window=32, min_rounds=3)
    for _ in range(9):
        online.observe(0, 3.0 * float(measured.round_seconds(0)))  # size 0 runs 3x slower than measured
        online.observe(9, 2.0 * float(measured.round_seconds(9)))  # size 9 (nearest grid size: 8) 2x
    # size 64 was never seen: the median over all recent rounds
    assert online.corrections() == pytest.approx([math.log(3.0), math.log(2.0), math.log(6.0) / 2])
    assert float(online.round_seconds(9)) == pytest.approx(2.0 * float(measured.round_seconds(9)), rel=0.05)
    online.observe(8, float("nan"))  # ignored
    assert online.rounds == 18
    with pytest.raises(ValueError):
        OnlineCost(measured, window=0)
    assert AutoBudget(measured, cap=8).online_cost is None  # no clock: replayable, nothing timed


def test_auto_reports_the_time_it_spent_measuring(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    target = make_target("llama", vocab=32, layers=2, dtype=torch.float32)
    draft = make_draft(target, block_size=4)
    with caplog.at_level("INFO", logger="ddtree"):
        policy = AutoBudget.for_models(target, draft, cap=8, context=20, chain=True)
    assert policy.calibration_s > 0 and policy.cost.context == 64 and policy.chain
    assert any("measured the round cost curve" in r.getMessage() for r in caplog.records)
    again = AutoBudget.for_models(target, draft, cap=8, context=20, chain=True)
    assert again.calibration_s == 0.0 and again.cost == policy.cost  # read from the cache: nothing measured


def test_calibrate_measures_each_bucket_once_and_auto_derives_the_others(monkeypatch, tmp_path):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    target = make_target("llama", vocab=32, layers=2, dtype=torch.float32)
    draft = make_draft(target, block_size=4)
    curves = calibrate(target, draft, contexts=[20, 100, 400], cap=8, repeats=1)
    assert sorted(curves) == [64, 128]  # 512 + a tree of 128 nodes does not fit the target's 512 positions
    assert all(c.measured_s > 0 and c.context == b for b, c in curves.items())
    monkeypatch.setattr(cost_module, "_round_seconds", lambda *a, **k: pytest.fail("measured again"))
    assert calibrate(target, draft, contexts=[20, 100], cap=8) == curves  # cache hits: free
    assert calibrate(target, draft, cap=8, max_context=300) == curves  # every bucket that fits 300 positions
    derived = AutoBudget.for_models(target, draft, cap=8, context=300)
    assert derived.calibration_s == 0.0 and derived.cost.context == 512
    assert derived.cost == across_contexts(list(curves.values()), 512)


def test_curves_across_context_lengths():
    short = CostModel((0, 8), (0.010, 0.020), 0.002, key="k", context=64)
    long = CostModel((0, 8), (0.014, 0.030), 0.003, key="k", context=128)
    middle = across_contexts([long, short], 96)
    assert middle.verify_s == pytest.approx((0.012, 0.025)) and middle.fixed_s == pytest.approx(0.0025)
    assert middle.context == 96 and middle.key == "k"
    far = across_contexts([short, long], 256)  # extrapolated from the two longest
    assert far.verify_s == pytest.approx((0.022, 0.050)) and far.fixed_s == pytest.approx(0.005)
    assert across_contexts([short, long], 32).verify_s == short.verify_s
    shrinking = CostModel((0, 8), (0.009, 0.019), 0.002, context=128)  # noise: the longer measured cheaper
    assert across_contexts([short, shrinking], 512).verify_s == pytest.approx(shrinking.verify_s)


def test_chain_auto_prices_chains_without_a_mask(monkeypatch):
    """chain-auto's curve verifies chains causally (no visibility mask: a flash-attention target can run it); the
    tree curve verifies under the ancestor mask."""
    masks = record_masks(monkeypatch)
    target = make_target("qwen3", vocab=32, layers=2, dtype=torch.float32)
    draft = make_draft(target, block_size=5)
    chain = measure_cost_model(target, draft, context=16, repeats=1, cap=8, chain=True, use_cache=False)
    assert chain.nodes == (0, 1, 2, 4) and masks and not any(masks)  # chains of up to block - 1 nodes
    masks.clear()
    tree = measure_cost_model(target, draft, grid=(0, 2, 8), context=16, repeats=1, cap=8, use_cache=False)
    assert any(masks) and tree.key != chain.key  # priced apart
    seen = {}
    monkeypatch.setattr("ddtree.budget.measure_cost_model", lambda *a, **k: seen.update(k) or chain)
    assert AutoBudget.for_models(target, draft, chain=True).cost is chain
    assert seen["chain"] is True and seen["extrapolate"] is True


@pytest.mark.parametrize("chain", [False, True])
def test_auto_maps_compact_draft_columns_to_target_ids(chain):
    cost = CostModel((0, 64), (0.01, 0.01), 0.0)  # flat: verify everything up to the cap
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)) * 3
    token_map = torch.tensor([10, 11, 12, 13, 14, 15])
    plain = AutoBudget(cost, cap=12, chain=chain).propose(block_of(logits), [0])
    mapped = AutoBudget(cost, cap=12, chain=chain).propose(block_of(logits, 10, token_map), [10])
    assert torch.equal(mapped.token_ids, token_map[plain.token_ids]) and len(mapped.token_ids) > 0


# ---------------------------------------------------------------------------------------------------- how far it builds
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


def test_the_build_follows_a_high_quantile_of_recent_sizes():
    """1.25 x the 4th largest of the last 16 verified sizes, rounded up, + 2; at least 8, at most the cap."""
    cost = CostModel((0, CAP), (0.03, 0.03 + CAP * 1e-5), 0.005)
    policy = AutoBudget(cost, cap=CAP)
    assert policy.next_build_size() == BUILD_FLOOR  # nothing verified yet: the floor

    def remember(sizes):
        for n in sizes:
            policy.memory.append(Round(np.log(np.full(n, 0.5)), np.arange(1, n + 1), np.zeros(n, bool), 0.03))

    remember([10] * BUILD_LOOKBACK)
    assert policy.next_build_size() == 15  # ceil(12.5) + 2
    remember([40] * 3)  # three outliers among the last 16: the 4th largest is still 10
    assert policy.next_build_size() == 15
    remember([40])  # a fourth: 40 -> 52
    assert policy.next_build_size() == 52
    remember([3] * 13)  # three 40s left among the last 16: the 4th largest is 3 -> ceil(3.75) + 2 = 6 < 8
    assert policy.next_build_size() == BUILD_FLOOR
    remember([12] * BUILD_LOOKBACK)
    assert policy.next_build_size() == 17
    remember([200] * BUILD_LOOKBACK)
    assert policy.next_build_size() == CAP  # at most the cap
    assert AutoBudget(cost, cap=8).next_build_size() == 8
    assert build_size([], 5) == 5 and build_size([1, 2, 3, 4, 200], CAP) == BUILD_FLOOR  # sorted[3] = 4 -> 7
    assert build_size([8, 9, 10, 11, 12, 8, 9, 10], CAP) == 16  # sorted[6] = 11 -> ceil(13.75) + 2


@pytest.mark.parametrize("markov", [False, True])
def test_every_round_is_one_build_and_the_best_prefix_of_it(markov):
    """Every round: one build of ``next_build_size()`` nodes and the best prefix of exactly that tree (the oracle
    builds it with ``best_tree`` and chooses with ``best_prefix`` over the same calibrated values)."""
    rng = np.random.default_rng(11)
    cost = curve(rng)
    policy = AutoBudget(cost, cap=CAP)
    history = [int(t) for t in rng.integers(0, 40, 24)]
    for i in range(40):
        block = markov_block(rng, i) if markov else block_of(random_logits(rng), history[-1])
        size = policy.next_build_size()
        rounds = policy.memory if len(policy.memory) >= policy.warmup else ()
        ref = best_tree(copy.deepcopy(block), size)
        probs = calibrated_probs(ref.log_probs.double().numpy(), ref.depths.numpy(), rounds)
        n = best_prefix(probs, policy.curve, policy.rate)
        got = policy.propose(block, history)
        assert same_tree(got, ref.prefix(n)), i
        assert policy.built[-1] == len(ref) <= size and policy.chosen[-1] == n
        path = accepted_path(rng, got)
        policy.observe(path)
        history += [int(got.token_ids[j]) for j in path] + [int(rng.integers(0, 40))]
    assert len(set(policy.built)) > 1 and policy.rate is not None  # the size moved with the rounds


def test_the_build_grows_while_choices_fill_it():
    """Nearly free nodes and a confident drafter that the target agrees with (it accepts the drafter's best chain
    whole): each build is chosen whole, so the builds grow round after round (1.25 x the window's high quantile + 2)
    until the cap."""
    cost = CostModel((0, CAP), (0.03, 0.03 + CAP * 1e-5), 0.005)
    policy = AutoBudget(cost, cap=CAP)
    sure = torch.full((15, 50), -8.0)
    sure[:, :4] = torch.tensor([6.0, 5.5, 5.0, 4.5])
    for _ in range(40):
        tree = policy.propose(block_of(sure, 1), [1])
        parents, path = tree.parents.tolist(), []
        while (kids := [i for i, p in enumerate(parents) if p == (path[-1] if path else -1)]):
            path.append(kids[0])  # the best child: the drafter's top-1 chain
        policy.observe(path)
    assert policy.built[0] == BUILD_FLOOR and policy.chosen == policy.built  # every build chosen whole
    assert policy.built == sorted(policy.built) and policy.built[-1] == CAP and policy.built[1] > BUILD_FLOOR


def test_auto_measures_a_context_far_past_every_measured_one(monkeypatch, tmp_path, caplog):
    """A curve measured at 64 tokens is no estimate for 256: a node's attention reads a cache 4x longer. ``auto``
    derives a bucket only within or below the measured ones (or past them where the bucket cannot be measured on the
    target); past them it measures. (Before, one measured bucket stood for every longer context.)"""
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    target = make_target("llama", vocab=32, layers=2, dtype=torch.float32)
    draft = make_draft(target, block_size=4)
    assert calibrate(target, draft, contexts=[40], cap=8, repeats=1)[64].context == 64
    far = AutoBudget.for_models(target, draft, cap=8, context=200)
    assert far.calibration_s > 0 and far.cost.context == 256  # measured now, at its own bucket
    below = AutoBudget.for_models(target, draft, cap=8, context=100)  # 128: between the measured 64 and 256
    assert below.calibration_s == 0.0 and below.cost.context == 128
    unmeasurable = AutoBudget.for_models(target, draft, cap=8, context=400)  # 512 + 128 nodes > 512 positions
    assert unmeasurable.calibration_s == 0.0 and unmeasurable.cost.context == 512


def _skip_rounds(policy, clock, rounds, accept, history, plain_s=None):
    """Drive ``policy`` as the loop does, asking first whether to draft: a drafted round of n nodes takes its modeled
    seconds and the target accepts up to ``accept`` nodes along the most probable path; a round without the drafter
    takes ``plain_s`` (default ``verify(0)``). Returns the per-round drafted flags and the history."""
    drafted = []
    for _ in range(rounds):
        wants = policy.wants_draft(history)
        drafted.append(wants)
        block = block_of(torch.randn(6, 40, generator=torch.Generator().manual_seed(len(history))) * 3 + 0,
                         history[-1]) if wants else None
        tree = policy.propose(block, history)
        n = len(tree.token_ids)
        plain = float(policy.cost.verify(0)) if plain_s is None else plain_s
        clock.now += float(policy.cost.round_seconds(n)) if wants else plain
        path, node = [], -1
        while len(path) < accept:
            kids = [i for i in range(n) if int(tree.parents[i]) == node]
            if not kids:
                break
            node = kids[0]
            path.append(node)
        policy.observe(path)
        history = history + [5] * (len(path) + 1)
    return drafted, history


def _unpaid_probes(rounds: int) -> list[int]:
    """Where the probes of a skip fall (counted from its first round without the drafter) while none pays: after
    ``PROBE_FIRST`` rounds without the drafter, or ``PLAIN_TIMED`` on a fresh memory (the plain step's price is timed
    first), the gap doubling after each, up to ``PROBE_EVERY``."""
    from ddtree.budget import PLAIN_TIMED, PROBE_EVERY, PROBE_FIRST

    probes, gap, at = [], PROBE_FIRST, max(PROBE_FIRST, PLAIN_TIMED)
    while at < rounds:
        probes.append(at)
        gap = min(2 * gap, PROBE_EVERY)
        at += gap + 1
    return probes


def test_auto_skips_the_drafter_where_it_does_not_pay_and_probes_to_come_back():
    """A drafter pass of 20 ms in front of 10 ms plain steps pays only when a round commits more than 3 tokens. While
    the target accepts nothing, a clocked ``auto`` verifies the root alone after ``SKIP_AFTER`` drafted rounds, with
    probe rounds that draft, the first once the plain step's price is timed and then at gaps of 4, 8 and 16 rounds;
    once the target accepts 5 nodes a round, a probe that sees it brings the gap back to ``PROBE_FIRST``, and once the
    last ``RESUME_AFTER`` probes pay every round drafts again: within 32 rounds, where probes every 17 rounds took 68
    and more. Without a clock (replayable) it always drafts."""
    from ddtree.budget import PROBE_EVERY, RESUME_AFTER, SKIP_AFTER

    measured = CostModel((0, 4, 16, 32), (0.010, 0.011, 0.014, 0.020), fixed_s=0.020)
    clock = FakeClock()
    policy = AutoBudget(measured, cap=16, clock=clock)
    drafted, history = _skip_rounds(policy, clock, 80, 0, [1, 2, 3])
    first = drafted.index(False)
    assert first == SKIP_AFTER
    tail = drafted[first:]
    assert [i for i, d in enumerate(tail) if d] == _unpaid_probes(len(tail))
    assert policy.skipped[first:] == [not d for d in tail] and policy._gap == PROBE_EVERY
    drafted, _ = _skip_rounds(policy, clock, 100, 5, history)
    back = len(drafted) - drafted[::-1].index(False)  # drafting every round from here on
    assert drafted.index(True) <= PROBE_EVERY and all(drafted[back:])
    assert back < 2 * PROBE_EVERY < RESUME_AFTER * (PROBE_EVERY + 1)  # the old spacing: 68 rounds and more
    replayable = AutoBudget(measured, cap=16)
    assert all(_skip_rounds(replayable, FakeClock(), 40, 0, [1, 2, 3])[0])


def test_auto_prices_a_plain_step_by_its_timed_rounds_and_takes_back_a_skip_that_paid():
    """A round without the drafter costs the loop more than the curve's ``verify(0)`` (its own work per round). Here
    it takes 15 ms against 10 ms modeled, and drafted rounds commit 3 tokens: below a plain step's rate at 10 ms, above
    it at 15. ``auto`` begins to skip on the curve's price, times ``PLAIN_TIMED`` rounds without the drafter, judges
    the rounds that began the skipping again at their median, and drafts every round again at once. (Before, it kept
    skipping, priced at 10 ms, until probes said otherwise.)"""
    from ddtree.budget import PLAIN_TIMED, SKIP_AFTER

    measured = CostModel((0, 4, 16, 32), (0.010, 0.011, 0.014, 0.020), fixed_s=0.020)
    clock = FakeClock()
    policy = AutoBudget(measured, cap=16, clock=clock)
    drafted, _ = _skip_rounds(policy, clock, 60, 2, [1, 2, 3], plain_s=0.015)
    first = drafted.index(False)
    assert first == SKIP_AFTER and policy.plain_seconds() == pytest.approx(0.015)
    assert drafted[first:first + PLAIN_TIMED] == [False] * PLAIN_TIMED and all(drafted[first + PLAIN_TIMED:])
    cheap = AutoBudget(measured, cap=16, clock=(cheap_clock := FakeClock()))  # where a plain step is what it models
    drafted, _ = _skip_rounds(cheap, cheap_clock, 60, 2, [1, 2, 3])
    tail = drafted[SKIP_AFTER:]
    assert drafted.index(False) == SKIP_AFTER and [i for i, d in enumerate(tail) if d] == _unpaid_probes(len(tail))


def test_a_later_call_prices_a_plain_step_by_the_rounds_an_earlier_call_timed():
    """The timed plain steps live in the memory, as multiples of their curve's ``verify(0)``: a later call on it
    prices a plain step at their median from its first round, on its own curve (another context length's), instead
    of spending rounds without the drafter to time them again (what a fresh call starting from a skip did before); a
    fresh memory starts from the curve's ``verify(0)``."""
    measured = CostModel((0, 4, 16, 32), (0.010, 0.011, 0.014, 0.020), fixed_s=0.020)
    memory = RoundMemory()
    clock = FakeClock()
    _skip_rounds(AutoBudget(measured, cap=16, clock=clock, memory=memory), clock, 60, 2, [1, 2, 3], plain_s=0.015)
    later = AutoBudget(measured, cap=16, clock=FakeClock(), memory=memory)
    assert later.plain_seconds() == pytest.approx(0.015)
    longer = CostModel((0, 4, 16, 32), (0.020, 0.022, 0.028, 0.040), fixed_s=0.020)  # a longer context's curve
    elsewhere = AutoBudget(longer, cap=16, clock=FakeClock(), memory=memory)
    assert elsewhere.plain_seconds() == pytest.approx(0.030)  # 1.5x the step, on its own curve
    fresh = AutoBudget(measured, cap=16, clock=FakeClock(), memory=RoundMemory())
    assert fresh.plain_seconds() == pytest.approx(float(measured.verify(0)))


def test_a_later_call_judges_the_drafter_on_its_own_rounds():
    """A call whose drafter did not pay ends skipping; the next call on the same memory (another prompt) drafts from
    its first round and begins to skip only after ``SKIP_AFTER`` of its own drafted rounds did not pay either. (It
    used to inherit the skip and spend 16 rounds before its first probe: a whole short answer.)"""
    from ddtree.budget import SKIP_AFTER

    measured = CostModel((0, 4, 16, 32), (0.010, 0.011, 0.014, 0.020), fixed_s=0.020)
    memory = RoundMemory()
    clock = FakeClock()
    drafted, history = _skip_rounds(AutoBudget(measured, cap=16, clock=clock, memory=memory), clock, 40, 0, [1, 2, 3])
    assert not drafted[-1]  # the first call ended skipping
    later = AutoBudget(measured, cap=16, clock=(later_clock := FakeClock()), memory=memory)
    drafted, _ = _skip_rounds(later, later_clock, 40, 0, [4, 5, 6])
    assert drafted.index(False) == SKIP_AFTER


def test_auto_skipping_the_drafter_is_lossless_and_drafts_less():
    """On the loop: a clocked ``auto`` whose drafter never pays (a random tiny drafter whose pass takes 20 ms on the
    policy's clock, where a plain step takes a few ms) verifies the root alone in most rounds, runs the drafter only on
    its warm-up and probes, and gives plain decoding's tokens."""
    from conftest import TickClock

    target = make_target("llama", vocab=64, dtype=torch.float32)
    draft = make_draft(target, block_size=5)
    p = prompt(7, 6, 64)
    ref = autoregressive_generate(target, p, max_new_tokens=60).new_token_ids
    curve = CostModel((0, 4, 16), (0.010, 0.011, 0.014), fixed_s=0.010)
    drafts, clock = [], TickClock(step=0.001)  # no test reads the wall clock
    real_draft = decoding.LiveModels.draft

    def timed_draft(self, seqs, roots):
        drafts.append(len(seqs))
        clock.now += 0.020
        return real_draft(self, seqs, roots)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoding.LiveModels, "draft", timed_draft)
        policy = AutoBudget(curve, cap=16, clock=clock.perf_counter)
        out = ddtree_generate(target, draft, p, max_new_tokens=60, policy=policy)
    assert out.new_token_ids == ref
    assert out.tau < 2 and sum(policy.skipped) > len(policy.skipped) / 2
    assert len(drafts) == len(policy.skipped) - sum(policy.skipped)  # a skipped round runs no drafter pass
