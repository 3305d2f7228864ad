"""A user's proposal policy as a benchmark variant: ``--policy module:Class``.

Contract: ``module`` is importable (on ``sys.path``, e.g. a file ``my_policy.py`` in the working directory) and
``Class`` is a class (or any callable) that builds a policy when called with no arguments. A policy is what
``ddtree_generate(policy=...)`` takes: a subclass of ``dflash_core.BlockPolicy`` with a non-empty str ``name`` (the
variant's label and its record's budget), a bool ``uses_draft`` (True: it reads the drafter) and ``propose(block,
history)``; optionally ``observe``. The benchmark builds a fresh policy for every generation (warm-ups included), so
each generation starts from the same state and a resumed run records what an uninterrupted one would; the replay
study (``experiments.studies.auto_budget_study``) builds one per replayed prompt.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from dflash_core.tree import BlockPolicy

__all__ = ["PolicyError", "load_policy", "make_policy_instance", "policy_name"]

# Budget names with a meaning of their own: a user policy may not take them (its name becomes the record's budget).
RESERVED_NAMES = ("auto", "chain", "chain-auto")


class PolicyError(ValueError):
    """A ``--policy module:Class`` that cannot be loaded or does not build a proposal policy."""


def load_policy(spec: str) -> Callable[[], Any]:
    """The callable ``spec`` (``"module:Class"``) names, imported; PolicyError when the module or name is missing."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PolicyError(f"--policy {spec!r}: expected module:Class, e.g. my_policy:ChainWithAlternatives")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise PolicyError(f"--policy {spec!r}: cannot import module {module_name!r} ({err}); it must be importable "
                          "from the working directory or PYTHONPATH") from None
    factory: Any = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise PolicyError(f"--policy {spec!r}: module {module_name!r} has no {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise PolicyError(f"--policy {spec!r}: {attr!r} is a {type(factory).__name__}, not a class")
    return factory


def check_policy(policy: Any, spec: str) -> Any:
    """``policy`` itself when it is a proposal policy with a usable name, else PolicyError saying what is missing."""
    missing = []
    if not isinstance(policy, BlockPolicy):
        missing.append("to subclass dflash_core.BlockPolicy (a method propose(block, history) -> DraftTree)")
    if not isinstance(getattr(policy, "uses_draft", None), bool):
        missing.append("a bool attribute uses_draft")
    name = getattr(policy, "name", None)
    if not isinstance(name, str) or not name.strip():
        missing.append("a non-empty str attribute name")
    if missing:
        raise PolicyError(f"--policy {spec!r}: {type(policy).__name__} is not a proposal policy: it needs "
                          + ", ".join(missing) + " (see dflash_core.tree.BlockPolicy)")
    if name in RESERVED_NAMES:
        raise PolicyError(f"--policy {spec!r}: the name {name!r} is taken by a built-in budget; choose another")
    return policy


def make_policy_instance(spec: str) -> Any:
    """A fresh policy built from ``spec`` with no arguments, checked (:func:`check_policy`)."""
    factory = load_policy(spec)
    try:
        policy = factory()
    except TypeError as err:
        raise PolicyError(f"--policy {spec!r}: it must be constructible with no arguments ({err})") from None
    return check_policy(policy, spec)


def policy_name(spec: str) -> str:
    """The ``name`` of the policy ``spec`` builds (loads and checks it)."""
    return make_policy_instance(spec).name
