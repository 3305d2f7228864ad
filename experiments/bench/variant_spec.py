"""A method variant as one named spec: what the runner measures, what a record stores, what a figure draws.

A variant used to be spelled five ways (the runner's ``Variant`` fields, the record's method / budget / policy / tree
fields, the resume key, the display label and the display order, each with its own rules). Now :class:`Variant` is
the one spec: a frozen value with one canonical name, parsed and formatted here and nowhere else. A record stores the
name once (``SampleRecord.variant``); its label, display order and resume key are read off the spec.

Canonical names::

    ar                          plain decoding
    pld                         draft-free prompt lookup
    dflash                      the drafter's chain
    dflash:chain-auto           the chain with a per-round length chosen from the cost curve
    ddtree:B=32                 DDTree, top-K tree, node budget 32 (``ddtree:auto``: a budget policy by name)
    ddtree-sampled:B=32         DDTree, sampled tree
    ddtree+lookup:B=16          DDTree with the context's n-gram continuation merged in (``ddtree+lookup:auto``)
    policy:NAME=module:Class    a user's policy class, called NAME in tables (``policy:NAME``: class not recorded)

Pure Python (no torch, no numpy): ``plots`` reads it on machines that have neither. Records written before the spec
existed are read through :func:`legacy_variant`, the one migration from the old fields.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["Variant", "legacy_variant", "METHODS", "METHOD_LABELS", "TREE_KINDS", "LOOKUP_POLICY", "CUSTOM_POLICY"]

# ar: plain decoding; dflash: the drafter's chain (``budget="chain-auto"``: with a chosen length); ddtree: trees;
# pld: draft-free prompt lookup (``dflash_core.lookup_generate``).
METHODS = ("ar", "dflash", "ddtree", "pld")
METHOD_LABELS = {"ar": "AR", "dflash": "DFlash", "ddtree": "DDTree", "pld": "PLD"}
# DDTree tree kinds: the deterministic top-K tree (sample-and-match) and the sampled tree (recursive rejection
# sampling).
TREE_KINDS = ("topk", "sampled")
# The record's derived ``policy`` of variants whose budget does not say it all: trees (and PLD) that take in the
# context's n-gram continuation, and a user's policy class.
LOOKUP_POLICY = "lookup"
CUSTOM_POLICY = "custom"

_SAMPLED, _LOOKUP, _CUSTOM = "ddtree-sampled", "ddtree+lookup", "policy"


def _int(budget) -> bool:
    return isinstance(budget, int) and not isinstance(budget, bool)


@dataclass(frozen=True)
class Variant:
    """One method variant.

    ``ar`` and ``pld`` take nothing else. ``dflash``: the drafter's chain (budget None) or the chain with a chosen
    length (``budget="chain-auto"``). ``ddtree``: a node budget (int) or a budget policy by name (``"auto"``), a tree
    kind (``"topk"``, the default, or ``"sampled"``); ``lookup=True`` (int budget or ``"auto"``, top-K) merges the
    context's n-gram continuation into each tree. ``policy_class="module:Class"``: a user's policy
    (:mod:`experiments.bench.policies`), method ``ddtree``, named by ``budget`` (the policy's ``name``); an empty
    ``policy_class`` marks a record that did not keep the class (it can be read and plotted, not run).
    """

    method: str
    budget: int | str | None = None
    tree: str | None = None
    lookup: bool = False
    policy_class: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; expected one of {METHODS}")
        if hasattr(self.budget, "item") and not isinstance(self.budget, str):  # a numpy / torch scalar
            object.__setattr__(self, "budget", self.budget.item())
        if isinstance(self.budget, bool) or not (self.budget is None or isinstance(self.budget, (int, str))):
            raise TypeError(f"budget must be int, str or None, got {self.budget!r}")
        if self.tree is not None and self.tree not in TREE_KINDS:
            raise ValueError(f"unknown tree kind {self.tree!r}; expected one of {TREE_KINDS}")
        object.__setattr__(self, "tree", (self.tree or "topk") if self.method == "ddtree" else None)
        if self.method in ("ar", "pld") and self.budget is not None:
            raise ValueError(f"{self.method} takes no budget, got {self.budget!r}")
        if self.lookup and not (self.method == "ddtree" and (_int(self.budget) or self.budget == "auto")
                                and self.tree == "topk"):
            raise ValueError(f"lookup branches need DDTree with an int budget or 'auto' and top-K trees, got {self}")
        if self.policy_class is not None and not (self.method == "ddtree" and isinstance(self.budget, str)
                                                  and self.budget and not self.lookup and "=" not in self.budget):
            raise ValueError(f"a user policy is a DDTree variant named by its budget (a name without '='), "
                             f"got {self}")

    # ---- the canonical name: formatted and parsed here only ---------------------------------------------------
    @property
    def name(self) -> str:
        """The canonical name (module docstring); ``Variant.parse(v.name) == v``."""
        if self.policy_class is not None:
            return f"{_CUSTOM}:{self.budget}" + (f"={self.policy_class}" if self.policy_class else "")
        head = _LOOKUP if self.lookup else _SAMPLED if self.tree == "sampled" else self.method
        if self.budget is None:
            return head
        return f"{head}:B={self.budget}" if _int(self.budget) else f"{head}:{self.budget}"

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def parse(name: str) -> "Variant":
        """The variant called ``name`` (a canonical name, see the module docstring)."""
        if not isinstance(name, str):
            raise TypeError(f"a variant name is a str, got {name!r}")
        head, colon, rest = name.partition(":")
        if head == _CUSTOM:
            policy, _, policy_class = rest.partition("=")
            return Variant("ddtree", policy, policy_class=policy_class)
        if colon and not rest:
            raise ValueError(f"variant {name!r} has an empty budget after ':'; write e.g. 'ddtree:B=32' or 'ar'")
        budget: int | str | None = rest or None
        if rest.startswith("B="):
            try:
                budget = int(rest[2:])
            except ValueError:
                raise ValueError(f"variant {name!r}: B= takes an integer node budget, e.g. 'ddtree:B=32'") from None
        if head == _LOOKUP:
            return Variant("ddtree", budget, lookup=True)
        if head == _SAMPLED:
            return Variant("ddtree", budget, "sampled")
        if head not in METHODS:
            raise ValueError(f"unknown variant {name!r}: expected ar, pld, dflash[:chain-auto], ddtree:B=<int>, "
                             f"ddtree:<policy>, ddtree-sampled:B=<int>, ddtree+lookup:B=<int> or policy:NAME=mod:Class")
        return Variant(head, budget)

    # ---- what the record, the tables and the resume key read off the spec -------------------------------------
    @property
    def policy(self) -> str:
        """How a round's proposal is shaped: ar, lookup (PLD, DDTree+lookup), chain, fixed, custom, or the budget's
        policy name (``auto``, ``chain-auto``)."""
        if self.policy_class is not None:
            return CUSTOM_POLICY
        if self.lookup or self.method == "pld":
            return LOOKUP_POLICY
        if self.method == "ar":
            return "ar"
        if self.budget is None:
            return "chain" if self.method == "dflash" else "fixed"
        return "fixed" if _int(self.budget) else str(self.budget)

    @property
    def label(self) -> str:
        """Human-readable name: ``DDTree (B=32)``, ``DDTree (auto)``, ``DDTree sampled (B=32)``,
        ``DDTree+lookup (B=16)``, ``DFlash (auto)``; a user's policy is called by its name."""
        name = METHOD_LABELS[self.method]
        if self.policy_class is not None:
            return str(self.budget)
        if self.method == "dflash" and isinstance(self.budget, str):
            return f"{name} ({self.budget.removeprefix('chain-')})"
        if self.method != "ddtree":
            return name
        name = f"{name}+lookup" if self.lookup else name if self.tree == "topk" else f"{name} {self.tree}"
        if self.budget is None:
            return name
        return f"{name} (B={self.budget})" if _int(self.budget) else f"{name} ({self.budget})"

    @property
    def sort_key(self) -> tuple:
        """Display order: by method (``METHODS``); within one, the budget-less variant (plain DFlash), then int
        budgets ascending with the tree kinds and the lookup tree of one budget side by side, then policies."""
        rank, kind = METHODS.index(self.method), self.tree or ""
        kind_rank = TREE_KINDS.index(self.tree) if self.tree in TREE_KINDS else len(TREE_KINDS)
        if _int(self.budget):
            return (rank, 1, self.budget, kind_rank, self.lookup, kind)
        if self.budget is None:
            return (rank, 0, 0, kind_rank, False, self.policy)
        return (rank, 2, 0, kind_rank, False, self.name)

    @property
    def key(self) -> tuple:
        """The variant's part of a resume key: (method, budget), plus the tree kind for trees other than top-K and
        ``"lookup"`` for lookup trees -- the shape keys had before the spec, so older run folders still resume."""
        key = (self.method, self.budget)
        if self.tree not in (None, "topk"):
            key += (self.tree,)
        return key + ("lookup",) if self.lookup else key

    @property
    def is_fixed_tree(self) -> bool:
        """A top-K DDTree variant with an integer node budget, no lookup branches (a candidate for the oracle)."""
        return self.method == "ddtree" and _int(self.budget) and self.tree == "topk" and not self.lookup

    @property
    def is_lookup_tree(self) -> bool:
        return self.method == "ddtree" and _int(self.budget) and self.lookup

    @property
    def is_sampled_tree(self) -> bool:
        return self.method == "ddtree" and _int(self.budget) and self.tree == "sampled"

    @property
    def is_policy(self) -> bool:
        """A budget policy: a string budget such as ``auto``, DFlash's ``chain-auto`` or a user policy's name."""
        return self.method in ("ddtree", "dflash") and isinstance(self.budget, str)


def legacy_variant(method: str, budget: int | str | None, policy: str | None = None, tree: str | None = None,
                   policy_class: str | None = None) -> Variant:
    """The one migration from the fields records had before the spec (method, budget, policy, tree; a user
    policy's class was kept in ``extra["policy_class"]``). ``chain-auto`` filed under DDTree (older runs) is DFlash's;
    a tree kind of None is DDTree's top-K tree."""
    if method == "ddtree" and budget == "chain-auto":
        return Variant("dflash", budget)
    if policy == CUSTOM_POLICY:
        return Variant("ddtree", budget, tree, policy_class=policy_class or "")
    if policy == LOOKUP_POLICY and method == "ddtree":
        return Variant("ddtree", budget, lookup=True)
    return Variant(method, budget, tree if method == "ddtree" else None)
