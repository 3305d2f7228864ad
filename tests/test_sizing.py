"""The benchmark's self-sizing (experiments.bench.sizing): what a turn costs, the rule that leaves work out, and whether
the default preset fits its budget on the slowest 2-core bf16 CPU measured. The first tests import nothing heavy:
units, conversations and variants are plain namespaces."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from experiments.bench.sizing import TurnCosts, Unit, size_run


@dataclass(frozen=True)
class _V:  # what the sizing reads of a variant (experiments.bench.variants.Variant imports torch)
    method: str
    budget: int | str | None
    policy: str
    label: str


def _variant(method, budget=None):
    label = f"{method}-{budget}" if budget is not None else method
    return _V(method, budget, "fixed" if isinstance(budget, int) else method, label)


def _grid(datasets, variants, samples, turns_of, temperature=0.0):
    units, index = [], 0
    for d in datasets:
        for k in range(samples):
            conv = SimpleNamespace(index=index, temperature=temperature,
                                   item=SimpleNamespace(dataset=d, sample_id=f"{d}{k}"))
            index += 1
            units += [Unit(conv, t, v) for t in range(turns_of(d)) for v in variants]
    return units


def test_turn_costs_count_every_part_of_a_turn():
    """Oracle by hand: per unit, tokens x seconds per token and the prefill, both times its turn's context factor;
    per speculative unit at T = 0 one check forward (times the factor); per turn one replay (times the factor).
    Dropping the factor, charging AR a check or charging the replay per unit instead of per turn fails it."""
    ar, tree = _variant("ar"), _variant("ddtree", 8)
    units = _grid(["gsm8k", "mt-bench"], [ar, tree], 1, lambda d: 2 if d == "mt-bench" else 1)
    scale = {(1, 1): 2.0}  # mt-bench's second turn: a step costs twice as much at its context
    costs = TurnCosts(per_turn=3.0, per_check=0.5, scale=scale)
    kept, report = size_run(units, {ar: 0.04, tree: 0.02}, 10, float("inf"), {ar: 0.1, tree: 0.2}, costs=costs)
    factors = [1.0, 1.0, 2.0]  # gsm8k, mt-bench turn 0, mt-bench turn 1
    decode = sum(f * 10 * (0.04 + 0.02) for f in factors)
    prefill = sum(f * (0.1 + 0.2) for f in factors)
    checks = sum(f * 0.5 for f in factors)  # the tree only
    replay = sum(f * 3.0 for f in factors)
    assert report["parts_s"] == pytest.approx({"decode": round(decode, 1), "prefill": round(prefill, 1),
                                               "checks": round(checks, 1), "replay": round(replay, 1)}, abs=0.051)
    assert report["projected_s"] == pytest.approx(decode + prefill + checks + replay, abs=0.1)
    assert kept == units
    sampled = _grid(["gsm8k"], [ar, tree], 1, lambda d: 1, temperature=1.0)  # no check forward when sampling
    assert size_run(sampled, {ar: 0.04, tree: 0.02}, 10, float("inf"), costs=costs)[1]["parts_s"]["checks"] == 0


def test_sizing_keeps_min_budgets_fixed_budgets_live():
    """Over budget with three fixed budgets and min_budgets=2: after the samples beyond the minimum the rule drops
    one outer budget (8: with an odd count the smallest goes first) and keeps 16 and 32; with min_budgets=1 it
    drops 32 too (what the paper preset may do)."""
    variants = [_variant("ar"), _variant("ddtree", 8), _variant("ddtree", 16), _variant("ddtree", 32)]
    units = _grid(["gsm8k", "math500"], variants, 4, lambda d: 1)
    per_token = {v: 0.01 for v in variants}  # 1 s per generation of 100 tokens: 4 s per turn
    kept, report = size_run(units, per_token, 100, 2 * 2 * 3.0 + 0.01, min_samples=2, min_budgets=2)
    assert report["left_out"][-1] == "DDTree budget 8" and report["projected_s"] <= 12.01
    assert {v.budget for v in {u.variant for u in kept}} == {None, 16, 32}
    _, report1 = size_run(units, per_token, 100, 2 * 2 * 2.0 + 0.01, min_samples=2, min_budgets=1)
    assert report1["left_out"][-2:] == ["DDTree budget 8", "DDTree budget 32"]
    kept2, report2 = size_run(units, per_token, 100, 2 * 2 * 2.0 + 0.01, min_samples=2, min_budgets=2)
    assert "DDTree budget 32" not in report2["left_out"]  # samples go instead: one prompt per dataset is left
    assert {u.conv.item.sample_id for u in kept2} == {"gsm8k0", "math5000"} and report2["projected_s"] == 6.0


def _cpu_costs(variants):
    """A 2-core bf16 CPU at 22 plain tokens/s (the AMD EPYC Zen 4 of the docs): seconds per token of each default
    live variant from the cost curve's round over its replayed tau (DFlash 0.52, B=8 0.45, B=16 0.44, auto 0.45, PLD
    0.59, DDTree+lookup auto 0.40 of a plain token), a 0.2 s prefill, a 0.25 s check forward, ~1.8 s of replay per
    turn at 48 tokens (3.3 s at 96), and a second turn 1.2x as slow as a first (its longer context)."""
    ratio = {"AR": 1.0, "DFlash": 0.52, "DDTree (B=8)": 0.45, "DDTree (B=16)": 0.44, "DDTree (auto)": 0.45,
             "PLD": 0.59, "DDTree+lookup (auto)": 0.40}
    per_token = {v: ratio[v.label] / 22.0 for v in variants}
    return per_token, {v: 0.2 for v in variants}


def test_default_preset_fits_a_slow_two_core_cpu_with_six_prompts_and_every_live_variant():
    """The preset's numbers against the sizing rule: on the slowest CPU measured, and on one 20% slower still, the
    default grid keeps six prompts per dataset and all seven live variants within its budget (second turns only
    where time is left), and the same grid at 96 tokens would not (why the preset decodes 48)."""
    from experiments.bench.presets import DEFAULT, with_overrides
    from experiments.bench.variants import make_variants

    variants = make_variants(DEFAULT)
    assert [v.label for v in variants] == ["AR", "DFlash", "DDTree (B=8)", "DDTree (B=16)", "DDTree (auto)", "PLD",
                                           "DDTree+lookup (auto)"]
    per_token, per_call = _cpu_costs(variants)

    def size(preset, replay_s, slower=1.0):
        units = _grid(preset.datasets, variants, preset.max_samples,
                      lambda d: 2 if d in ("mt-bench", "grounded") else 1)
        scale = {(u.conv.index, 1): 1.2 for u in units if u.turn == 1}
        costs = TurnCosts(per_turn=replay_s * slower, per_check=0.25 * slower, scale=scale)
        return size_run(units, {v: t * slower for v, t in per_token.items()}, preset.max_new_tokens,
                        preset.time_budget_s, {v: t * slower for v, t in per_call.items()},
                        min_samples=preset.min_samples, costs=costs, min_budgets=preset.min_budgets)

    for slower in (1.0, 1.2):
        kept, report = size(DEFAULT, 1.8, slower)
        assert report["projected_s"] <= DEFAULT.time_budget_s
        assert {u.variant.label for u in kept} == {v.label for v in variants}
        for d in DEFAULT.datasets:
            assert len({u.conv.item.sample_id for u in kept if u.conv.item.dataset == d and u.turn == 0}) == 6, d
        assert all("sample" not in what or "later turns" in what for what in report["left_out"])
    assert report["left_out"] and len(kept) > 42 * 7  # some second turns run, not all of them
    _, longer = size(with_overrides(DEFAULT, max_new_tokens=96), 3.3)
    assert longer["projected_s"] > DEFAULT.time_budget_s or any(
        "later turns" not in what for what in longer["left_out"])
