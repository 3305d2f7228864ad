"""The 'auto' budget policy: objective oracle, limiting cost curves, calibration, losslessness."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_draft, make_target, prompt
from ddtree import build_tree, ddtree_generate
from ddtree.budget import AutoBudget, CostModel, _fit_beta, best_prefix, measure_cost_model, truncate_tree
from dflash_core import autoregressive_generate


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
    policy = AutoBudget(flat, cap=40, calibrate=False)
    assert len(policy.propose(logits, [])) == 40
    chain = AutoBudget(steep, cap=40, calibrate=False).propose(logits, [])
    assert 1 <= len(chain) <= 8
    assert chain.depths.tolist() == list(range(1, len(chain) + 1))  # one node per depth: a chain
    assert AutoBudget(CostModel((0, 1), (0.01, 10.0), 0.0), cap=40).propose(logits, []).token_ids.numel() == 0


def test_truncated_best_first_prefix_is_a_valid_tree():
    tree = build_tree(torch.randn(6, 30, generator=torch.Generator().manual_seed(1)) * 2, 64)
    for n in (0, 1, 5, 17, 64):
        sub = truncate_tree(tree, n)
        assert len(sub) == n and (sub.parents < torch.arange(n)).all()
        sub.validate()


def test_calibration_exponent_matches_observed_acceptance():
    rng = np.random.default_rng(3)
    history = []
    for _ in range(30):
        log_p = np.sort(np.log(rng.random(20)))[::-1] * 0.5
        history.append((log_p, int(round(np.exp(2.0 * log_p).sum()))))  # the truth is p ** 2 (over-confident drafter)
    beta = _fit_beta(history)
    assert 1.7 < beta < 2.3
    expected = sum(np.exp(beta * lp).sum() for lp, _ in history)
    assert abs(expected - sum(a for _, a in history)) < 1e-6 * max(expected, 1)


def test_policy_feedback_moves_beta():
    cost = CostModel((0, 128), (0.02, 0.06), 0.005)
    policy = AutoBudget(cost, cap=32)
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(0)) * 3
    for _ in range(10):
        policy.propose(logits, [])
        policy.observe(0)  # the target never agrees: the drafter is over-confident
    assert policy.beta > 1.0


def test_auto_budget_is_lossless_and_measures_a_monotone_cost(monkeypatch, tmp_path, family):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    target = make_target(family, vocab=64, dtype=torch.float32)
    draft = make_draft(target, block_size=5)
    cost = measure_cost_model(target, draft, grid=(0, 1, 4, 16), context=32, repeats=1)
    assert list(cost.verify_s) == sorted(cost.verify_s) and cost.fixed_s > 0
    assert measure_cost_model(target, draft, grid=(0, 1, 4, 16), context=32) == cost  # read back from the cache
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    for seed in range(3):
        p = prompt(40 + seed, 6, 64)
        ref = autoregressive_generate(target, p, max_new_tokens=32).new_token_ids
        out = ddtree_generate(target, draft, p, budget="auto", max_new_tokens=32, seed=seed)
        assert out.new_token_ids == ref
        steep = ddtree_generate(target, draft, p, max_new_tokens=32,
                                policy=AutoBudget(CostModel((0, 1, 8), (0.0, 1.0, 100.0), 0.01), cap=16))
        assert steep.new_token_ids == ref and max(steep.tree_sizes) <= 1


def test_cost_model_rejects_bad_curves():
    with pytest.raises(ValueError):
        CostModel((0,), (1.0,), 0.0)
    with pytest.raises(ValueError):
        CostModel((4, 1), (1.0, 2.0), 0.0)
    assert CostModel((0, 2, 4), (1.0, 0.5, 2.0), 0.0).verify_s == (1.0, 1.0, 2.0)  # made monotone
