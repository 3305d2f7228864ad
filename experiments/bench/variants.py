"""Method variants: what one generation runs (a method with its budget, tree kind, lookup branches or user policy).

``make_variants`` turns a preset (plus the lookup budgets and user policies asked for on the command line) into the
list the runner measures, AR first. ``Variant.generate`` is the one place that maps a variant to the public
generation functions (``autoregressive_generate``, ``dflash_generate``, ``lookup_generate``, ``ddtree_generate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from experiments.bench.presets import Preset
from experiments.bench.schema import CUSTOM_POLICY, LOOKUP_POLICY, method_label, record_key, tree_kind

if TYPE_CHECKING:
    import torch

    from experiments.bench.models import Models

__all__ = ["Variant", "make_variants", "policy_variant"]


def _int(budget) -> bool:
    return isinstance(budget, int) and not isinstance(budget, bool)


@dataclass(frozen=True)
class Variant:
    """One method as measured.

    ``ar`` and ``pld`` (draft-free prompt lookup) take nothing else. ``dflash``: the drafter's chain (budget None) or
    the chain with a per-round length chosen from the cost curve (``budget="chain-auto"``). ``ddtree``: a node budget
    (int) or a policy (``"auto"``) and a tree kind (``"topk"``, the default, or ``"sampled"``); ``lookup=True`` (int
    budget or ``"auto"``, top-K) merges the context's n-gram continuation into each tree. ``policy_class="module:Class"``: a user's
    policy (:mod:`experiments.bench.policies`), method ``ddtree``, with the policy's name as the budget.
    """

    method: str
    budget: int | str | None = None
    tree: str | None = None
    lookup: bool = False
    policy_class: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tree", tree_kind(self.method, self.tree))
        if self.lookup and not (self.method == "ddtree" and (_int(self.budget) or self.budget == "auto")
                                and self.tree == "topk"):
            raise ValueError(f"lookup branches need DDTree with an int budget or 'auto' and top-K trees, got {self}")
        if self.policy_class is not None and not (self.method == "ddtree" and isinstance(self.budget, str)):
            raise ValueError(f"a user policy is a DDTree variant named by its budget, got {self}")

    @property
    def policy(self) -> str:
        """The record's ``policy``: ar, lookup (PLD, DDTree+lookup), chain, fixed, custom, or the budget's name."""
        if self.policy_class is not None:
            return CUSTOM_POLICY
        if self.lookup or self.method == "pld":
            return LOOKUP_POLICY
        if self.method == "ar":
            return "ar"
        if self.method == "dflash":
            return "chain" if self.budget is None else str(self.budget)
        return "fixed" if _int(self.budget) else str(self.budget)

    @property
    def label(self) -> str:
        return method_label(self.method, self.policy, self.budget, self.tree)

    def key(self, dataset: str, sample_id: str, turn: int, temperature: float) -> tuple:
        return record_key(dataset, sample_id, turn, self.method, self.budget, temperature, self.tree, self.policy)

    def generate(self, models: "Models", input_ids: "torch.Tensor", max_new_tokens: int, temperature: float,
                 seed: int):
        from dflash_core import autoregressive_generate, dflash_generate, lookup_generate

        args = dict(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=models.stop_token_ids,
                    seed=seed)
        if self.method == "ar":
            return autoregressive_generate(models.target, input_ids, **args)
        if self.method == "pld":
            return lookup_generate(models.target, input_ids, **args)
        if self.method == "dflash" and self.budget is None:
            return dflash_generate(models.target, models.draft, input_ids, **args)
        from ddtree import ddtree_generate

        if self.policy_class is not None:
            from experiments.bench.policies import make_policy_instance

            policy = make_policy_instance(self.policy_class)  # fresh per generation: see experiments.bench.policies
            return ddtree_generate(models.target, models.draft, input_ids, policy=policy, **args)
        return ddtree_generate(models.target, models.draft, input_ids, budget=self.budget, tree=self.tree or "topk",
                               lookup=self.lookup, **args)


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
