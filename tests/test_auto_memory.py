"""What ``budget="auto"`` learns is held by its caller (a :class:`ddtree.RoundMemory`), never by the process: a plain
call starts fresh from the cost curve on disk and sizes its trees the same every time; a memory passed to two calls
carries what the first learnt over to the second; nothing in the library keeps state between calls."""

from __future__ import annotations

import collections
import importlib
import itertools
import pkgutil
import weakref

import pytest

import ddtree
from conftest import make_draft, make_target, prompt
from ddtree import RoundMemory, ddtree_generate, make_policy
from ddtree import budget as budget_module
from ddtree.cost import CostModel

COST = CostModel((0, 4, 16), (0.010, 0.012, 0.020), 0.002, key="test-curve")


@pytest.fixture
def pair(monkeypatch):
    monkeypatch.setattr(budget_module, "measure_cost_model", lambda *a, **k: COST)  # the curve "on disk"
    target = make_target("llama", vocab=8, init=0.3)
    return target, make_draft(target, block_size=5)


def test_plain_auto_calls_start_fresh_and_size_their_trees_the_same(pair):
    target, draft = pair
    p = prompt(40, 12, 8)
    first = ddtree_generate(target, draft, p, budget="auto", max_new_tokens=32)
    ddtree_generate(target, draft, prompt(41, 12, 8), budget="auto", max_new_tokens=32)  # another prompt between
    again = ddtree_generate(target, draft, p, budget="auto", max_new_tokens=32)
    assert again.tree_sizes == first.tree_sizes and again.new_token_ids == first.new_token_ids
    looked_up = [ddtree_generate(target, draft, p, budget="auto", lookup=True, max_new_tokens=32).tree_sizes
                 for _ in range(2)]
    assert looked_up[0] == looked_up[1]


def test_a_memory_the_caller_holds_carries_over_to_the_next_call(pair, monkeypatch):
    monkeypatch.setattr(ddtree.budget, "SKIP_AFTER", 10**9)  # every round drafts and is remembered (the subject)
    target, draft = pair
    p = prompt(40, 12, 8)
    fresh = ddtree_generate(target, draft, p, budget="auto", max_new_tokens=32)
    memory = RoundMemory()
    policy = make_policy("auto", target, draft, context=p.shape[1], memory=memory)
    first = ddtree_generate(target, draft, p, policy=policy, max_new_tokens=32)
    assert first.tree_sizes == fresh.tree_sizes  # an empty memory is a fresh start
    learnt = len(memory)
    assert learnt == len(first.tree_sizes) and memory.curves[COST].rounds > 0  # rounds and the online curve
    second = ddtree_generate(target, draft, p, max_new_tokens=32,
                             policy=make_policy("auto", target, draft, context=p.shape[1], memory=memory))
    assert len(memory) == learnt + len(second.tree_sizes)  # the second call continued the same memory
    assert second.tree_sizes != fresh.tree_sizes  # ... and sized its trees from what the first learnt
    assert second.tree_sizes[0] > fresh.tree_sizes[0]  # its first build follows the sizes verified before
    lookup = make_policy("auto", target, draft, lookup=True, memory=RoundMemory())
    assert lookup.auto.memory is not memory and len(lookup.auto.memory) == 0  # a method's own memory


def _mutable(value) -> bool:
    return isinstance(value, (dict, list, set, collections.deque, collections.Counter, itertools.count,
                              weakref.WeakKeyDictionary, weakref.WeakValueDictionary))


def test_no_module_of_ddtree_keeps_mutable_state():
    """Module-level containers that calls could fill (registries, caches, counters): none (constants are tuples)."""
    found = []
    for info in pkgutil.iter_modules(ddtree.__path__):
        module = importlib.import_module(f"ddtree.{info.name}")
        found += [f"{info.name}.{name}" for name, value in vars(module).items()
                  if name != "__all__" and not name.startswith("__") and _mutable(value)]
    assert found == []


def test_the_benchmark_holds_one_memory_per_method_and_carries_it_over(pair, monkeypatch):
    """The benchmark session keeps one round memory per model pair (the session), method and temperature, and every
    generation of ``auto`` continues it; the throughput mode keeps one per method and batch size."""
    from types import SimpleNamespace

    monkeypatch.setattr(ddtree.budget, "SKIP_AFTER", 10**9)  # every round drafts and is remembered (the subject)

    from experiments.bench.session import Session
    from experiments.bench.throughput import make_runner
    from experiments.bench.variants import Variant, generate

    target, draft = pair
    session = SimpleNamespace(memories={})
    auto, lookup = Variant("ddtree", "auto", "topk"), Variant("ddtree", "auto", lookup=True)
    memory = Session.memory(session, auto, 0.0)
    assert memory is Session.memory(session, auto, 0.0) and len(memory) == 0
    assert Session.memory(session, lookup, 0.0) is not memory and Session.memory(session, auto, 1.0) is not memory
    assert Session.memory(session, Variant("ddtree", 4, "topk"), 0.0) is None
    models = SimpleNamespace(target=target, draft=draft, stop_token_ids=[])
    p = prompt(40, 12, 8)
    fresh = generate(auto, models, p, 24, 0.0, 0)
    first = generate(auto, models, p, 24, 0.0, 0, memory)
    second = generate(auto, models, p, 24, 0.0, 0, memory)
    assert first.tree_sizes == fresh.tree_sizes and second.tree_sizes != first.tree_sizes
    assert len(memory) == len(first.tree_sizes) + len(second.tree_sizes)
    merged = generate(lookup, models, p, 24, 0.0, 0, Session.memory(session, lookup, 0.0))
    assert len(merged.lookup_tokens) == len(merged.tree_sizes)
    run = make_runner("auto", target, draft, [])
    batch = [prompt(50, 10, 8), prompt(51, 12, 8)]
    once, twice = run(batch, 16), run(batch, 16)
    assert [r.tree_sizes for r in twice] != [r.tree_sizes for r in once]  # the second batch continued the memory
    assert [r.tree_sizes for r in make_runner("auto", target, draft, [])(batch, 16)] == [r.tree_sizes for r in once]
