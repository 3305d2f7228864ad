"""This machine's round cost curve, and the one-line verdict on why trees pay here or not (stored in the manifest,
printed with the summary)."""

from __future__ import annotations

from typing import Any

from ddtree.cost import measure_cost_model

__all__ = ["explain_cost_curve", "machine_cost_curve"]


def explain_cost_curve(verify_s: dict[int, float], fixed_s: float) -> str:
    """One line on why trees pay or not on this machine, from round costs at N draft nodes (N = 0: one token)."""
    one = verify_s[0]
    r8, r32 = verify_s[8] / one, verify_s[32] / one
    if r32 <= 1.5:
        verdict = "big trees are nearly free to verify here: large budgets win"
    elif r8 <= 1.5:
        verdict = "verifying up to ~8 nodes is cheap, more is not: mid-size trees (8-16) win"
    else:
        verdict = "every verified node costs: small trees win"
    return (f"this machine verifies 8 draft tokens at {r8:.2f}x and 32 at {r32:.2f}x the cost of one token; the "
            f"drafter pass and tree cost {fixed_s / one:.2f} of a plain step: {verdict}")


def machine_cost_curve(models, context: int = 256) -> dict[str, Any]:
    """The measured round cost curve of this machine (``ddtree.cost.measure_cost_model``, cached per machine) as
    plain data for the manifest, with the one-line explanation. ``models``: an ``experiments.bench.models.Models``."""

    cost = measure_cost_model(models.target, models.draft, context=context)
    verify = {int(n): float(v) for n, v in zip(cost.nodes, cost.verify_s)}
    return {"context": context, "nodes": list(verify), "verify_s": list(verify.values()), "fixed_s": cost.fixed_s,
            "relative_to_one_token": {n: round(v / verify[0], 3) for n, v in verify.items()},
            "explanation": explain_cost_curve(verify, cost.fixed_s)}
