"""Method variants: what one generation runs, and the list a preset measures.

:class:`~experiments.bench.variant_spec.Variant` is the spec (torch-free: records and figures read it);
:func:`generate` is the one place that maps a spec to the public generation functions (``autoregressive_generate``,
``dflash_generate``, ``lookup_generate``, ``ddtree_generate``); ``make_variants`` turns a preset (plus the lookup
budgets and user policies asked for on the command line) into the list the runner measures, AR first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from experiments.bench.presets import Preset
from experiments.bench.variant_spec import Variant

if TYPE_CHECKING:
    import torch

    from experiments.bench.models import Models

__all__ = ["Variant", "generate", "make_variants", "policy_variant"]


def _int(budget) -> bool:
    return isinstance(budget, int) and not isinstance(budget, bool)


def generate(variant: Variant, models: "Models", input_ids: "torch.Tensor", max_new_tokens: int,
             temperature: float, seed: int, memory=None, filters: dict | None = None):
    """Run ``variant`` on ``input_ids``: the generation function's result. ``memory``: for ``auto`` and
    ``chain-auto``, the :class:`ddtree.RoundMemory` that carries what it learnt from one generation to the next (the
    session holds one per method; None: start fresh). ``filters``: ``top_k`` / ``top_p`` / ``min_p``."""
    from dflash_core import autoregressive_generate, dflash_generate, lookup_generate

    args = dict(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=models.stop_token_ids,
                seed=seed, **(filters or {}))
    if variant.method == "ar":
        return autoregressive_generate(models.target, input_ids, **args)
    if variant.method == "pld":
        return lookup_generate(models.target, input_ids, **args)
    if variant.method == "dflash" and variant.budget is None:
        return dflash_generate(models.target, models.draft, input_ids, **args)
    from ddtree import ddtree_generate

    if variant.policy_class is not None:
        if not variant.policy_class:
            raise ValueError(f"{variant.name}: the record does not name the policy's class; run it as "
                             "--policy module:Class")
        from experiments.bench.policies import make_policy_instance

        policy = make_policy_instance(variant.policy_class)  # fresh per generation: see experiments.bench.policies
        return ddtree_generate(models.target, models.draft, input_ids, policy=policy, **args)
    if variant.budget in ("auto", "chain-auto"):
        from ddtree import make_policy

        policy = make_policy(variant.budget, models.target, models.draft, lookup=variant.lookup,
                             context=int(input_ids.shape[-1]), memory=memory)
        result = ddtree_generate(models.target, models.draft, input_ids, policy=policy, **args)
        if variant.lookup:
            result.lookup_tokens = policy.lookup_committed
        return result
    return ddtree_generate(models.target, models.draft, input_ids, budget=variant.budget, tree=variant.tree or "topk",
                           lookup=variant.lookup, **args)


def policy_variant(spec: str) -> Variant:
    """The variant of a user's policy class ``spec`` (``"module:Class"``), named by the policy's ``name``."""
    from experiments.bench.policies import policy_name

    return Variant("ddtree", policy_name(spec), policy_class=spec)


def _budget_variants(preset: Preset) -> list[Variant]:
    """DDTree's variants of the preset's budgets (``chain-auto``: DFlash's), each with every tree kind of the preset,
    the sampled tree at int budgets only."""
    variants = []
    for budget in preset.budgets:
        if budget == "chain-auto":
            variants.append(Variant("dflash", budget))  # the drafter's chain, with a chosen length
        else:
            variants += [Variant("ddtree", budget, tree) for tree in preset.trees if tree == "topk" or _int(budget)]
    return variants


def make_variants(preset: Preset, *, lookup_budgets: Sequence[int | str] = (),
                  policies: Sequence[str] = ()) -> list[Variant]:
    """The preset's method variants, AR first; optional budgets the installed ddtree lacks are left out.

    DDTree+lookup runs at the preset's ``lookup_budgets`` when it measures ``ddtree``; ``lookup_budgets`` (int
    budgets or ``"auto"``) and ``policies`` (user policy classes, ``"module:Class"``) are asked for explicitly and
    are measured whatever the preset's methods.
    """
    variants = []
    for method in ("ar", "dflash"):
        if method in preset.methods:
            variants.append(Variant(method))
    if "ddtree" in preset.methods:
        variants += _budget_variants(preset)
    if "pld" in preset.methods:
        variants.append(Variant("pld"))
    asked = (tuple(preset.lookup_budgets) if "ddtree" in preset.methods else ()) + tuple(lookup_budgets)
    for budget in dict.fromkeys(asked):
        if not (_int(budget) and budget >= 0 or budget == "auto"):
            raise ValueError(f"lookup budgets must be ints >= 0 or 'auto', got {budget!r}")
        variants.append(Variant("ddtree", budget, lookup=True))
    variants += [policy_variant(spec) for spec in policies]
    labels = [v.label for v in variants]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"variants asked for twice: {', '.join(repeated)}")
    return variants
