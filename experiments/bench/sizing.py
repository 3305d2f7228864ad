"""Self-sizing: after the warm-up, project the run's decoding time on this machine and leave work out by a fixed
rule until it fits the preset's time budget (``--full`` runs everything).

What a turn costs (:class:`TurnCosts`, every part measured on this machine in the warm-up): each variant's prefill
and ``max_new_tokens`` at its seconds per token, scaled by how much slower a step is at the turn's context than at
the warm-up's (the measured cost curves' one-token step at the two context buckets: a second turn carries the first
answer, a grounded prompt its document); at T = 0 one more prefill-sized forward per speculative variant (the run
prices where an output first leaves plain decoding's, :func:`experiments.bench.session.top2_margin`); and the turn's
replay of every replayed budget on plain decoding's text (:mod:`experiments.bench.replayer`), measured on the warm-up's
text and scaled to the run's tokens. The sum over the kept turns is the projection the run states, with its parts,
and compares with the time it really took at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from experiments.bench.conversation import Conversation
    from experiments.bench.variants import Variant

__all__ = ["TurnCosts", "Unit", "coverage", "coverage_message", "size_run", "sizing_message"]


@dataclass(frozen=True)
class Unit:
    """One pending generation: a turn of a conversation with one variant."""

    conv: "Conversation"
    turn: int
    variant: "Variant"


@dataclass(frozen=True)
class TurnCosts:
    """What one turn costs besides its variants' decoding, and how a turn's context changes every cost.

    ``per_turn``: the replay of the turn (seconds, at the warm-up's context); ``per_check``: one prefill-sized
    forward per speculative variant at T = 0 (where its output first left plain decoding's); ``scale``: {(conversation
    index, turn): seconds at that turn's context / seconds at the warm-up's}, 1.0 for turns not listed."""

    per_turn: float = 0.0
    per_check: float = 0.0
    scale: dict = field(default_factory=dict)

    def factor(self, u: "Unit") -> float:
        return self.scale.get((u.conv.index, u.turn), 1.0)


def _samples_by_dataset(units: list[Unit]) -> dict[str, list[tuple[int, str]]]:
    """{dataset: [(conversation index, sample id)]} in the order the units hold them."""
    samples: dict[str, dict[tuple[int, str], None]] = {}  # dicts: ordered sets
    for u in units:
        samples.setdefault(u.conv.item.dataset, {})[(u.conv.index, u.conv.item.sample_id)] = None
    return {dataset: list(entries) for dataset, entries in samples.items()}


def _drop_samples(units: list[Unit], cost, budget_s: float, floor: int) -> tuple[list[Unit], list[str]]:
    """Drop the last sample of the dataset with the most samples left while the projection exceeds the budget and
    some dataset has more than ``floor`` (all at once: linear in the units)."""
    samples = _samples_by_dataset(units)
    by_conv: dict[int, list[Unit]] = {}
    for u in units:
        by_conv.setdefault(u.conv.index, []).append(u)
    total, dropped, left_out = cost(units), set(), []
    while total > budget_s and samples:
        dataset = max(samples, key=lambda d: (len(samples[d]), d))
        if len(samples[dataset]) <= floor:
            break
        index, sid = max(samples[dataset])
        samples[dataset].remove((index, sid))
        total -= cost(by_conv[index])
        dropped.add(index)
        left_out.append(f"{dataset} sample {sid}")
    return [u for u in units if u.conv.index not in dropped], left_out


def _drop_later_turns(units: list[Unit], cost, budget_s: float) -> tuple[list[Unit], list[str]]:
    """Drop the later turns (MT-Bench's and grounded's second) of one conversation at a time, the last first,
    while the projection exceeds the budget."""
    later: dict[int, list[Unit]] = {}
    for u in units:
        if u.turn > 0:
            later.setdefault(u.conv.index, []).append(u)
    total, dropped, left_out = cost(units), set(), []
    for index in sorted(later, reverse=True):
        if total <= budget_s:
            break
        total -= cost(later[index])
        dropped.add(index)
        conv = later[index][0].conv
        left_out.append(f"{conv.item.dataset} sample {conv.item.sample_id} later turns")
    return [u for u in units if not (u.turn > 0 and u.conv.index in dropped)], left_out


def _drop_budget(kept: list[Unit], keep: int = 1) -> tuple[list[Unit], str] | None:
    """Drop one DDTree fixed budget from the outside in (the middle one stays), or None when ``keep`` are left."""
    fixed = sorted({u.variant.budget for u in kept if u.variant.method == "ddtree" and u.variant.policy == "fixed"})
    if len(fixed) <= max(1, keep):
        return None
    drop = fixed[-1] if len(fixed) % 2 == 0 else fixed[0]  # outside in: the middle budget stays
    return [u for u in kept if not (u.variant.policy == "fixed" and u.variant.budget == drop)], f"DDTree budget {drop}"


def _drop_dataset(kept: list[Unit]) -> tuple[list[Unit], str] | None:
    samples = _samples_by_dataset(kept)
    if len(samples) <= 1:
        return None
    last = max(samples, key=lambda d: min(samples[d]))  # the dataset that comes last in the run's order
    return [u for u in kept if u.conv.item.dataset != last], f"dataset {last}"


def size_run(units: list[Unit], per_token: dict["Variant", float], max_new_tokens: int,
             budget_s: float, per_call: dict["Variant", float] | None = None, *, min_samples: int = 1,
             per_turn: float = 0.0, costs: TurnCosts | None = None,
             min_budgets: int = 1) -> tuple[list[Unit], dict[str, Any]]:
    """Leave work out until the projected decoding time fits ``budget_s``; returns (kept units, report).

    Projection: every generation runs ``max_new_tokens`` at its variant's warm-up seconds per token, plus its
    ``per_call`` seconds (the prefill of a typical prompt; default 0), both times its turn's context factor, plus per
    kept turn its replay and checks (``costs``, :class:`TurnCosts`; ``per_turn``: the replay alone, for callers
    without one). The report states the parts (decoding, prefill, checks, replay) of what is kept. The rule, in
    order, while the projection exceeds the budget:
    1. drop the last selected sample (all its turns and variants) of the dataset with the most samples left, down
       to ``min_samples`` per dataset;
    2. drop the later turns (MT-Bench's and grounded's second) of one conversation at a time, the last first;
    3. drop DDTree fixed budgets from the outside in (the largest, then the smallest, ...) down to the middle one
       (down to ``min_budgets``: the preset's live minimum); AR, DFlash, PLD, lookup trees and policies such as
       ``auto`` always stay;
    4. drop samples as in 1, down to one per dataset;
    5. drop datasets from the end of the run's order, down to one;
    6. run what is left, and say that it will take longer than the budget.
    """
    per_call = per_call or {}
    costs = costs if costs is not None else TurnCosts(per_turn=per_turn)
    parts = _parts(per_token, max_new_tokens, per_call, costs)

    def cost(us):
        return sum(parts(us).values())

    full = cost(units)
    kept, left_out = _drop_samples(list(units), cost, budget_s, max(1, min_samples))
    kept, more = _drop_later_turns(kept, cost, budget_s)
    left_out += more
    while cost(kept) > budget_s and (step := _drop_budget(kept, min_budgets)) is not None:
        kept, what = step
        left_out.append(what)
    kept, more = _drop_samples(kept, cost, budget_s, 1)
    left_out += more
    while cost(kept) > budget_s and (step := _drop_dataset(kept)) is not None:
        kept, what = step
        left_out.append(what)
    report = {"budget_s": budget_s if budget_s != float("inf") else None, "projected_full_s": round(full, 1),
              "projected_s": round(cost(kept), 1), "left_out": left_out,
              "seconds_per_token": {v.label: round(t, 5) for v, t in per_token.items()},
              "replay_s_per_turn": round(costs.per_turn, 3), "check_s": round(costs.per_check, 3),
              "parts_s": {k: round(v, 1) for k, v in parts(kept).items()}}
    return kept, report


def _parts(per_token: dict, max_new_tokens: int, per_call: dict, costs: TurnCosts):
    """The function that projects units to {decode, prefill, checks, replay} seconds."""
    def parts(us: list[Unit]) -> dict[str, float]:
        out = {"decode": 0.0, "prefill": 0.0, "checks": 0.0, "replay": 0.0}
        turns: dict[tuple[int, int], Unit] = {}
        for u in us:
            f = costs.factor(u)
            out["decode"] += per_token.get(u.variant, 0.0) * max_new_tokens * f
            out["prefill"] += per_call.get(u.variant, 0.0) * f
            if u.variant.method != "ar" and getattr(u.conv, "temperature", 0.0) == 0:
                out["checks"] += costs.per_check * f
            turns.setdefault((u.conv.index, u.turn), u)
        out["replay"] = sum(costs.per_turn * costs.factor(u) for u in turns.values())
        return out
    return parts


def sizing_message(slug: str, report: dict[str, Any], budget_s: float | None) -> str:
    """The log line that says what a sized run left out (or what the whole grid projects to)."""
    if budget_s and report["left_out"]:
        return (f"{slug}: the full grid projects to {report['projected_full_s'] / 60:.1f} min of decoding on this "
                f"machine, over the {budget_s / 60:.0f}-minute budget; left out by the stated rule (samples beyond "
                f"the preset's minimum, later turns, outer DDTree budgets, more samples, the last datasets): "
                f"{', '.join(report['left_out'])}; projected now "
                f"{report['projected_s'] / 60:.1f} min ("
                + ", ".join(f"{k} {v / 60:.1f}" for k, v in (report.get("parts_s") or {}).items()) + ")"
                + (" (still over: nothing more is left out)" if report["projected_s"] > budget_s else "")
                + ". --full runs everything.")
    parts = report.get("parts_s") or {}
    return (f"{slug}: projected decoding time {report['projected_full_s'] / 60:.1f} min"
            + (f" (budget {budget_s / 60:.0f} min)" if budget_s else "")
            + (" = " + ", ".join(f"{k} {v / 60:.1f}" for k, v in parts.items()) if parts else ""))


def coverage(todo: list["Conversation"], variants: list["Variant"], replayer=None) -> dict[str, Any]:
    """What this session measures: the live variants, the prompts (first turns) and later turns per dataset and
    temperature, and the replayed variants (:mod:`experiments.bench.replayer`; empty without a replay)."""
    prompts: dict[str, dict[str, int]] = {}
    for c in todo:
        entry = prompts.setdefault(f"{c.item.dataset} T={c.temperature:g}", {"prompts": 0, "later_turns": 0})
        entry["prompts"] += 1
        entry["later_turns"] += c.num_turns - 1
    return {"variants": [v.label for v in variants], "prompts": prompts,
            "replayed": [v.label for v in replayer.variants] if replayer is not None else []}


def coverage_message(slug: str, live: dict[str, Any]) -> str:
    """The log line that says which variants run live, how many prompts each dataset gets, and what is replayed."""
    per = ", ".join(f"{name} {e['prompts']}" + (f" (+{e['later_turns']} later turns)" if e["later_turns"] else "")
                    for name, e in live["prompts"].items())
    text = (f"{slug}: live ({len(live['variants'])} variants, each on every prompt): {', '.join(live['variants'])}; "
            f"prompts per dataset: {per or 'none left to run'}")
    if live["replayed"]:
        text += (f"; replayed on plain decoding's text and priced by the cost curve: {', '.join(live['replayed'])}")
    return text
