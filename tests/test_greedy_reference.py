"""Every greedy path of the loop against the independent cache-free reference (``greedy_reference``), in fp64, for
both target families: plain decoding, DFlash chains, DDTree trees, lookup trees, rounds that skip the drafter,
``auto`` and ``chain-auto``, and the offline replay. The loop's own plain decoding is not the reference here: it shares
the prefill, the cache and the commit with every other path, so a bug there would cancel out of a comparison with it.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_draft, make_target, prompt
from ddtree import ddtree_generate, make_policy
from ddtree.cost import CostModel
from ddtree.lookup import LookupTreePolicy
from dflash_core import autoregressive_generate, dflash_generate, speculative_generate
from dflash_core.prompt_lookup import lookup_generate
from dflash_core.replay import replay
from greedy_reference import greedy_reference
from test_ddtree_generate import OracleTree
from test_decoding import OracleChain
from test_lookup import FakeClock

NEW = 40
FLAT = CostModel((0, 8, 64), (0.010, 0.011, 0.013), 0.004)  # cheap verification: auto sizes trees past one node
STEEP = CostModel((0, 1, 2, 64), (0.010, 0.012, 0.030, 1.0), 0.004)  # auto shrinks to chains of one or two


@pytest.fixture(scope="module")
def pairs():
    out = {}
    for family in ("llama", "qwen3"):
        target = make_target(family, vocab=32, init=0.4)
        out[family] = target, make_draft(target, block_size=5)
    return out


def _prompts(vocab):
    repetitive = torch.tensor([[3, 9, 4, 1, 5, 3, 9, 4, 1, 5, 3, 9]]) % vocab  # the lookup finds continuations
    return [prompt(11, 5, vocab), repetitive]


def _cases(family, pairs):
    target, draft = pairs[family]
    for p in _prompts(target.config.vocab_size):
        ref = greedy_reference(target, p, NEW)
        stop = max(ref, key=ref.index)  # the token that first occurs latest: a stop mid-answer
        yield target, draft, p, ref, stop, greedy_reference(target, p, NEW, [stop])


def test_plain_decoding_and_chains_equal_the_reference(family, pairs):
    for target, draft, p, ref, stop, stopped in _cases(family, pairs):
        assert autoregressive_generate(target, p, NEW).new_token_ids == ref
        assert autoregressive_generate(target, p, NEW, stop_token_ids=[stop]).new_token_ids == stopped
        assert dflash_generate(target, draft, p, NEW).new_token_ids == ref
        assert ddtree_generate(target, draft, p, budget="chain", max_new_tokens=NEW,
                               stop_token_ids=[stop]).new_token_ids == stopped
        oracle = speculative_generate(target, draft, p, OracleChain(ref, p.shape[1], 1), NEW)
        assert oracle.new_token_ids == ref and max(oracle.acceptance_lengths) == 5  # whole blocks were accepted


def test_trees_equal_the_reference(family, pairs):
    for target, draft, p, ref, stop, stopped in _cases(family, pairs):
        assert ddtree_generate(target, draft, p, budget=16, max_new_tokens=NEW).new_token_ids == ref
        oracle = ddtree_generate(target, draft, p, max_new_tokens=NEW, policy=OracleTree(ref, p.shape[1], 16, 2))
        assert oracle.new_token_ids == ref and max(oracle.acceptance_lengths) >= 3
        assert ddtree_generate(target, draft, p, max_new_tokens=NEW, stop_token_ids=[stop],
                               policy=OracleTree(ref, p.shape[1], 16, 3)).new_token_ids == stopped


def test_auto_and_chain_auto_equal_the_reference(family, pairs):
    for target, draft, p, ref, stop, stopped in _cases(family, pairs):
        for budget, cost in (("auto", FLAT), ("auto", STEEP), ("chain-auto", FLAT)):
            policy = make_policy(budget, target, draft, cost=cost, cap=16, online=False)
            out = ddtree_generate(target, draft, p, max_new_tokens=NEW, policy=policy, stop_token_ids=[stop])
            assert out.new_token_ids == stopped, (budget, cost)
        assert max(out.tree_sizes) >= 2  # the flat curve verified more than one node


def test_lookup_trees_and_rounds_without_the_drafter_equal_the_reference(family, pairs):
    skipped = 0
    for target, draft, p, ref, stop, stopped in _cases(family, pairs):
        assert lookup_generate(target, p, NEW).new_token_ids == ref
        assert speculative_generate(target, draft, p, LookupTreePolicy(8), NEW).new_token_ids == ref
        auto = make_policy("auto", target, draft, cost=FLAT, cap=16, online=False)
        assert speculative_generate(target, draft, p, LookupTreePolicy(auto), NEW,
                                    stop_token_ids=[stop]).new_token_ids == stopped
        skipping = LookupTreePolicy(8)
        skipping.clock = FakeClock(skipping, drafted_s=1.0, alone_s=0.01)  # the drafter pass is the whole round
        out = speculative_generate(target, draft, p, skipping, NEW, stop_token_ids=[stop])
        assert out.new_token_ids == stopped
        skipped += sum(skipping.skipped)
    assert skipped > 0  # rounds without the drafter (carrying its unconsumed features) were compared


def test_replay_follows_the_reference_continuation(family, pairs):
    for target, draft, p, ref, _, _ in _cases(family, pairs):
        ids = torch.cat([p[0], torch.tensor(ref)])
        for make in (lambda: make_policy(16), lambda: make_policy("chain"),
                     lambda: OracleTree(ref, p.shape[1], 16, 4)):
            live = speculative_generate(target, draft, p, make(), NEW)
            got = replay(target, draft, make(), ids, p.shape[1], NEW)
            assert live.new_token_ids == ref
            assert got.acceptance_lengths == live.acceptance_lengths and got.tree_sizes == live.tree_sizes
            assert sum(got.acceptance_lengths) == NEW - 1  # the prefill's token is not a round


def test_stop_tokens_fall_mid_answer(family, pairs):
    """The cases above stop mid-answer, not at the first token (else the stop comparisons would be trivial)."""
    assert all(len(stopped) >= 3 for *_, stopped in _cases(family, pairs))
