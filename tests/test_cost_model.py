"""The budget cost model: whole rounds timed at the caller's context, auto's context buckets, GPU profiles."""

import json
import statistics

import pytest
import torch

from conftest import make_draft, make_target, prompt
from dflash_core.target import TargetAdapter


def test_cost_model_times_whole_rounds_at_the_callers_context(monkeypatch, tmp_path):
    import ddtree.budget as budget
    import ddtree.build as build_module
    import dflash_core.decoding as decoding

    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    seen = {"build": [], "walk": 0, "compact": [], "prefill": []}
    real_build, real_walk = build_module.build_tree, decoding.verify_walk
    real_commit, real_forward = decoding.LiveModels.commit, TargetAdapter.forward

    def build(logits, n, token_map=None):
        seen["build"].append(n)
        return real_build(logits, n, token_map=token_map)

    def walk(*args, **kwargs):
        seen["walk"] += 1
        return real_walk(*args, **kwargs)

    def commit(self, seqs, paths, *args):
        seen["compact"] += [[0] + [i + 1 for i in path] for path in paths]
        return real_commit(self, seqs, paths, *args)

    def forward(self, token_ids, position_ids, cache, *args, **kwargs):
        if cache.get_seq_length() == 0:
            seen["prefill"].append(token_ids.shape[1])
        return real_forward(self, token_ids, position_ids, cache, *args, **kwargs)

    monkeypatch.setattr(build_module, "build_tree", build)  # the tree auto builds at its cap (best_tree's)
    monkeypatch.setattr(decoding, "verify_walk", walk)
    monkeypatch.setattr(decoding.LiveModels, "commit", commit)
    monkeypatch.setattr(TargetAdapter, "forward", forward)
    target = make_target("qwen3", vocab=64, dtype=torch.float32)
    draft = make_draft(target, block_size=5)
    cost = budget.measure_cost_model(target, draft, grid=(0, 2, 8), context=48, repeats=1, cap=24)
    assert cost.context == 48 and set(seen["prefill"]) == {48}
    assert seen["build"] and set(seen["build"]) == {24}  # trees are built at the cap, as the policy builds them
    assert seen["walk"] >= 3 * 2  # warm-up + one timed run per size: the walk is inside the timed round
    assert any(keep != list(range(len(keep))) for keep in seen["compact"])  # a real gather, not a crop
    assert budget.measure_cost_model(target, draft, grid=(0, 2, 8), context=48, cap=24) == cost  # cached
    assert budget.measure_cost_model(target, draft, grid=(0, 2, 8), context=96, repeats=1, cap=24).context == 96


def test_auto_measures_at_the_prompt_length(monkeypatch):
    import ddtree.budget as budget
    from ddtree import ddtree_generate

    contexts = []

    def fake(target, draft, context=256, cap=None, **kwargs):
        contexts.append(context)
        return budget.CostModel((0, 8), (0.01, 0.02), 0.001, context=context)

    monkeypatch.setattr(budget, "measure_cost_model", fake)
    target = make_target("llama", vocab=64)
    draft = make_draft(target, block_size=4)
    ddtree_generate(target, draft, prompt(1, 100, 64), budget="auto", max_new_tokens=4)
    ddtree_generate(target, draft, prompt(1, 20, 64), budget="auto", max_new_tokens=4)
    assert contexts == [128, 64] and budget.context_bucket(4097) == 8192


def test_auto_reads_a_gpu_profile(tmp_path):
    from ddtree.budget import AutoBudget
    from ddtree.cost import CostModel

    curves = [{"nodes": [0, 1, 3], "verify_s": [0.01, 0.011, 0.012], "fixed_s": 0.002, "key": "k", "context": c}
              for c in (512, 4096)]
    path = tmp_path / "h200.json"
    path.write_text(json.dumps({"models": {"qwen3-8b": {"cost_models": curves}}}))
    assert CostModel.from_profile(path, context=3000).context == 4096
    assert CostModel.from_profile(path, context=600).context == 512
    assert CostModel.from_profile(path).context == 4096
    target = make_target("llama", vocab=64)
    policy = AutoBudget.for_models(target, make_draft(target), profile=path, context=700)
    assert policy.cost.context == 512 and policy.cap == 128
    with pytest.raises(ValueError, match="not in the profile"):
        CostModel.from_profile(path, model="qwen3-4b")


def test_a_slow_point_does_not_flatten_the_curve():
    """The measured verify times are made monotone by least squares (ddtree.cost.isotonic), checked against the
    min-max formula of the isotonic fit (x_i = max over j <= i of min over k >= i of mean(y[j..k])) on random
    sequences. A first point slowed 3x by another process (as one bucket of the AMD EPYC's curves was: 161 ms at
    every size up to 96 under a running maximum, every tree free) now lifts its neighbours only: the running
    maximum fails the oracle and leaves verifying 64 nodes as cheap as one."""
    import numpy as np

    from ddtree.cost import CostModel, isotonic

    rng = np.random.default_rng(0)
    for _ in range(200):
        y = rng.normal(size=int(rng.integers(1, 9)))
        oracle = [max(min(float(np.mean(y[j:k + 1])) for k in range(i, len(y))) for j in range(i + 1))
                  for i in range(len(y))]
        assert np.allclose(isotonic(y), oracle)
    nodes = (0, 1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
    quiet = (0.055, 0.055, 0.055, 0.055, 0.055, 0.064, 0.084, 0.093, 0.143, 0.143, 0.190)
    slowed = (0.161,) + quiet[1:]
    curve = CostModel(nodes, slowed, 0.006)
    assert curve.verify(64) > 1.5 * curve.verify(1)  # 64 nodes still cost more than one
    assert curve.verify(128) == pytest.approx(0.190) and curve.verify(0) < 0.161


class _DriftingClock:
    """A fake ``time`` module for :mod:`dflash_core.timing`: each timed call lasts its function's cost times a machine
    speed factor that drifts up by ``drift`` per call (a slowly busier machine)."""

    def __init__(self, drift: float) -> None:
        self.now, self.calls, self.drift = 0.0, 0, drift

    def perf_counter(self) -> float:
        return self.now

    def run(self, cost: float) -> None:
        self.now += cost * (1.0 + self.drift * self.calls)
        self.calls += 1


def test_interleaved_timings_keep_the_ratios_under_a_steady_drift(monkeypatch):
    """Functions timed together (the sizes of one cost curve) keep their true cost ratios on a machine whose speed
    drifts steadily: called in turn, forwards then backwards, every function sees the same average speed. (Called
    forwards only, as before, the later functions of each repeat ran slower: the curve's shape bent.)"""
    import dflash_core.timing as timing

    clock = _DriftingClock(0.02)
    monkeypatch.setattr(timing, "time", clock)
    costs = [1.0, 1.5, 2.0, 4.0, 8.0]
    for repeats in (2, 4, 6):
        samples = timing.time_samples([lambda c=c: clock.run(c) for c in costs], repeats, warmup=1)
        medians = [statistics.median(s) for s in samples]
        assert all(len(s) == repeats for s in samples)
        assert [m / medians[0] for m in medians] == pytest.approx(costs, rel=1e-9)


def test_a_cost_curve_times_every_size_and_the_drafter_round_together(monkeypatch):
    """One interleaved measurement holds every grid size and the drafter's round (so a change in the machine's speed
    during it moves the whole curve, not its shape), each timed 2 x ``repeats`` times after one untimed call."""
    import ddtree.cost as cost

    calls = []

    def samples(functions, repeats, device=None, warmup=0):
        calls.append((len(functions), repeats, warmup))
        for _ in range(warmup + repeats):
            for fn in functions:
                fn()
        return [[0.001 * (i + 1)] * repeats for i in range(len(functions))]

    monkeypatch.setattr(cost, "time_samples", samples)
    target = make_target("qwen3", vocab=64, dtype=torch.float32)
    draft = make_draft(target, block_size=5)
    curve = cost.measure_cost_model(target, draft, grid=(0, 2, 8), context=24, repeats=2, cap=16, use_cache=False)
    assert calls == [(4, 4, 1)]
    assert curve.verify_s == pytest.approx((0.001, 0.002, 0.003)) and curve.fixed_s == pytest.approx(0.004)
