"""What ``budget="auto"`` policies share across generations: one memory per policy configuration and per model
identity. Lookup rounds record other quantities than plain ones; a model id can be reused after garbage collection;
weights can be edited in place; a drafter can change dtype. None of these may reach another configuration's memory."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from conftest import make_draft, make_target, prompt
from ddtree import budget as budget_module
from ddtree import ddtree_generate
from ddtree.budget import AutoBudget, Round, forget_shared_memory
from ddtree.cost import CostModel
from ddtree.lookup import LookupTreePolicy

COST = CostModel((0, 4, 16), (0.010, 0.012, 0.020), 0.002, key="test-curve")


@pytest.fixture
def pair(monkeypatch, tmp_path):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    monkeypatch.setattr(budget_module, "measure_cost_model", lambda *a, **k: COST)  # no timing in these tests
    forget_shared_memory()
    target = make_target("llama", vocab=8, init=0.3)
    yield target, make_draft(target, block_size=5)
    forget_shared_memory()


def _learn(policy: AutoBudget) -> None:
    policy.memory.append(Round(np.log([0.5, 0.25]), np.array([1, 2]), np.array([True, False]), 0.01))


def test_lookup_rounds_do_not_reach_plain_autos_memory(pair):
    target, draft = pair
    plain = AutoBudget.for_models(target, draft)
    for seed in range(2):  # lookup=True with auto: rounds sized by auto, in a merged tree
        p = prompt(40 + seed, 12, 8)
        ddtree_generate(target, draft, p, budget="auto", lookup=True, max_new_tokens=24, seed=seed)
    assert len(plain.memory) == 0 and plain.online_cost.rounds == 0
    again = LookupTreePolicy(AutoBudget.for_models(target, draft))
    assert len(again.auto.memory) > 0  # lookup policies continue their own memory
    other = LookupTreePolicy(AutoBudget.for_models(target, draft), max_ngram=2)
    assert other.auto.memory is not again.auto.memory  # another lookup configuration: another memory
    assert AutoBudget.for_models(target, draft).memory is plain.memory


def test_models_sharing_an_id_do_not_share_memory(pair, monkeypatch):
    """Two drafters with the same id() (as when one is collected and the next lands at its address)."""
    target, draft = pair
    monkeypatch.setattr(budget_module, "id", lambda obj: 12345, raising=False)  # every object: one id
    _learn(AutoBudget.for_models(target, draft))
    second = make_draft(target, block_size=5, seed=9)
    assert len(AutoBudget.for_models(target, second).memory) == 0


def test_a_collected_models_memory_is_dropped(pair):
    target, _ = pair
    draft = make_draft(target, block_size=5)  # referenced here only (the fixture keeps its own)
    _learn(AutoBudget.for_models(target, draft))
    before = len(budget_module._SHARED_MEMORY)
    del draft
    gc.collect()
    assert len(budget_module._SHARED_MEMORY) == before - 1


def test_weights_edited_in_place_dtype_and_taps_start_a_new_memory(pair):
    target, draft = pair
    policy = AutoBudget.for_models(target, draft)
    _learn(policy)
    with torch.no_grad():
        draft.load_state_dict(make_draft(target, block_size=5, seed=4).state_dict())  # in place: same object
    edited = AutoBudget.for_models(target, draft)
    assert len(edited.memory) == 0 and edited.online_cost is not policy.online_cost
    _learn(edited)
    assert AutoBudget.for_models(target, draft).memory is edited.memory  # unchanged since: shared again
    with torch.no_grad():
        next(target.parameters()).mul_(1.5)  # the target's weights count too
    assert len(AutoBudget.for_models(target, draft).memory) == 0
    draft.float()  # the drafter's dtype
    assert len(AutoBudget.for_models(target, draft).memory) == 0
    same, wider = make_draft(target, block_size=5), make_draft(target, block_size=5, taps=3)  # other taps
    assert budget_module.model_identity(wider)[3] != budget_module.model_identity(same)[3]
