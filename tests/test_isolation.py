"""What conftest's autouse fixture promises every test: no measured cache left by the tests before it, and no branch
taken on the wall clock (``auto`` keeps no state between calls at all: tests/test_auto_memory.py).

The first two tests run in this order in one process (pytest keeps a file's order, and xdist hands a file to one
worker): the first leaves a cached curve behind, the second must not see it. The third makes the
machine's clock as erratic as a loaded machine can make it, differently in two runs, and asks for the same rounds.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from conftest import make_draft, make_target
from ddtree import ddtree_generate
from dflash_core.timing import cache_root

REPETITIVE = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2]])  # the lookup finds continuations


@pytest.fixture(scope="module")
def pair():
    """Models that outlive a test, as module fixtures' do."""
    target = make_target("llama", vocab=8, init=0.3)
    return target, make_draft(target, block_size=5)


def _leftovers() -> list[str]:
    return sorted(p.name for p in (cache_root() / "costs").glob("*.json"))


def test_a_generation_leaves_a_cached_curve(pair):
    target, draft = pair
    ddtree_generate(target, draft, REPETITIVE, budget="auto", max_new_tokens=16)
    assert len(_leftovers()) == 1  # what the next test must not inherit


def test_the_next_test_starts_without_it(pair):
    assert _leftovers() == [], "a cost curve cached by an earlier test"


def _erratic_wall_clock(monkeypatch, seed: int) -> None:
    """``time.perf_counter`` of a machine under heavy, bursty load: every read jumps 1 ms to 2 s."""
    rng = random.Random(seed)
    now = [time.perf_counter()]

    def read() -> float:
        now[0] += rng.choice((1e-3, 1e-3, 0.5, 2.0)) * rng.random()
        return now[0]

    monkeypatch.setattr(time, "perf_counter", read)


def test_lookup_and_auto_rounds_do_not_depend_on_the_wall_clock(pair, monkeypatch):
    """``lookup=True`` under ``auto``: whether a round skips the drafter, auto's measured curve and its online
    correction would all follow the clock; under the fixture the rounds are the same whatever the clock does."""
    target, draft = pair
    runs = []
    for seed in range(2):
        for path in (cache_root() / "costs").glob("*.json"):
            path.unlink()  # and measures its curve again
        with monkeypatch.context() as m:
            _erratic_wall_clock(m, seed)
            out = ddtree_generate(target, draft, REPETITIVE, budget="auto", lookup=True, max_new_tokens=60)
        runs.append((out.tree_sizes, out.lookup_tokens, out.new_token_ids))
    assert runs[0] == runs[1]
    assert len(set(runs[0][0])) > 1  # rounds of different sizes: there were branches to take
