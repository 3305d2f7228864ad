"""Self-sizing: after the warm-up, project the run's decoding time on this machine and leave work out by a fixed
rule until it fits the preset's time budget (``--full`` runs everything)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from experiments.session import Conversation
    from experiments.variants import Variant

__all__ = ["Unit", "size_run", "sizing_message"]


@dataclass(frozen=True)
class Unit:
    """One pending generation: a turn of a conversation with one variant."""

    conv: "Conversation"
    turn: int
    variant: "Variant"


def _samples_by_dataset(units: list[Unit]) -> dict[str, list[tuple[int, str]]]:
    """{dataset: [(conversation index, sample id)]} in the order the units hold them."""
    samples: dict[str, dict[tuple[int, str], None]] = {}  # dicts: ordered sets
    for u in units:
        samples.setdefault(u.conv.item.dataset, {})[(u.conv.index, u.conv.item.sample_id)] = None
    return {dataset: list(entries) for dataset, entries in samples.items()}


def _drop_samples(units: list[Unit], unit_cost, budget_s: float) -> tuple[list[Unit], list[str]]:
    """Step 1 of the rule, all at once: drop the last sample of the dataset with the most samples left while the
    projection exceeds the budget and some dataset has more than one (linear in the units)."""
    samples = _samples_by_dataset(units)
    conv_cost: dict[int, float] = {}
    for u in units:
        conv_cost[u.conv.index] = conv_cost.get(u.conv.index, 0.0) + unit_cost(u)
    total, dropped, left_out = sum(conv_cost.values()), set(), []
    while total > budget_s and samples:
        dataset = max(samples, key=lambda d: (len(samples[d]), d))
        if len(samples[dataset]) <= 1:
            break
        index, sid = max(samples[dataset])
        samples[dataset].remove((index, sid))
        total -= conv_cost[index]
        dropped.add(index)
        left_out.append(f"{dataset} sample {sid}")
    return [u for u in units if u.conv.index not in dropped], left_out


def _leave_one_out(kept: list[Unit]) -> tuple[list[Unit], str] | None:
    """One step of rules 2-3 (see :func:`size_run`): the units left and what went, or None when nothing may go."""
    samples = _samples_by_dataset(kept)
    fixed = sorted({u.variant.budget for u in kept if u.variant.method == "ddtree" and u.variant.policy == "fixed"})
    if len(fixed) > 1:
        drop = fixed[-1] if len(fixed) % 2 == 0 else fixed[0]  # outside in: the middle budget stays
        kept = [u for u in kept if not (u.variant.policy == "fixed" and u.variant.budget == drop)]
        return kept, f"DDTree budget {drop}"
    if len(samples) > 1:
        last = max(samples, key=lambda d: min(samples[d]))  # the dataset that comes last in the run's order
        return [u for u in kept if u.conv.item.dataset != last], f"dataset {last}"
    return None


def size_run(units: list[Unit], per_token: dict["Variant", float], max_new_tokens: int,
             budget_s: float, per_call: dict["Variant", float] | None = None) -> tuple[list[Unit], dict[str, Any]]:
    """Leave work out until the projected decoding time fits ``budget_s``; returns (kept units, report).

    Projection: every generation runs ``max_new_tokens`` at its variant's warm-up seconds per token, plus its
    ``per_call`` seconds (the prefill of a typical prompt; default 0). The rule, in
    order, while the projection exceeds the budget:
    1. drop the last selected sample (all its turns and variants) of the dataset with the most samples left,
       down to one sample per dataset;
    2. drop DDTree fixed budgets from the outside in (the largest, then the smallest, ...) down to the middle one;
       AR, DFlash, PLD, lookup trees and policies such as ``auto`` always stay;
    3. drop datasets from the end of the run's order, down to one;
    4. run what is left, and say that it will take longer than the budget.
    """
    per_call = per_call or {}

    def unit_cost(u):
        return per_token.get(u.variant, 0.0) * max_new_tokens + per_call.get(u.variant, 0.0)

    def cost(us):
        return sum(map(unit_cost, us))

    full = cost(units)
    kept, left_out = _drop_samples(list(units), unit_cost, budget_s)
    while cost(kept) > budget_s:
        step = _leave_one_out(kept)
        if step is None:
            break
        kept, what = step
        left_out.append(what)
    report = {"budget_s": budget_s if budget_s != float("inf") else None, "projected_full_s": round(full, 1),
              "projected_s": round(cost(kept), 1), "left_out": left_out,
              "seconds_per_token": {v.label: round(t, 5) for v, t in per_token.items()}}
    return kept, report


def sizing_message(slug: str, report: dict[str, Any], budget_s: float | None) -> str:
    """The log line that says what a sized run left out (or what the whole grid projects to)."""
    if budget_s and report["left_out"]:
        return (f"{slug}: the full grid projects to {report['projected_full_s'] / 60:.1f} min of decoding on this "
                f"machine, over the {budget_s / 60:.0f}-minute budget; left out by the stated rule (samples, then "
                f"outer DDTree budgets, then the last datasets): {', '.join(report['left_out'])}; projected now "
                f"{report['projected_s'] / 60:.1f} min"
                + (" (still over: nothing more is left out)" if report["projected_s"] > budget_s else "")
                + ". --full runs everything.")
    return (f"{slug}: projected decoding time {report['projected_full_s'] / 60:.1f} min"
            + (f" (budget {budget_s / 60:.0f} min)" if budget_s else ""))
