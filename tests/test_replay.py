"""Offline replay of greedy decoding equals the decode loop round for round (oracle: the loop itself)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_draft, make_target, prompt
from ddtree import ddtree_generate
from ddtree.generate import make_policy
from dflash_core import autoregressive_generate
from dflash_core.replay import draft_hidden_all_rounds, replay, replay_policies


@pytest.mark.parametrize("budget", ["chain", 6, 24])
def test_replay_equals_decode_loop(family, budget):
    target = make_target(family, vocab=6, init=0.3)  # a small vocabulary: a random drafter is often right
    draft = make_draft(target, block_size=5)
    lengths = []
    for seed in range(4):
        p = prompt(300 + seed, 3 + 2 * seed, 6)
        stops = [4] if seed % 2 else []
        live = ddtree_generate(target, draft, p, budget=budget, max_new_tokens=40, stop_token_ids=stops)
        ref = autoregressive_generate(target, p, max_new_tokens=40, stop_token_ids=stops).new_token_ids
        assert live.new_token_ids == ref
        ids = torch.cat([p[0], torch.tensor(ref)])
        got = replay(target, draft, make_policy(budget), ids, p.shape[1], 40, stops)
        assert got.acceptance_lengths == live.acceptance_lengths
        assert got.tree_sizes == live.tree_sizes
        lengths += got.acceptance_lengths
    assert sum(n > 1 for n in lengths) >= 3  # multi-token rounds were replayed, not only bonus tokens


def test_replay_policies_share_one_pass_and_check_input():
    target = make_target("llama", vocab=12, init=0.3)
    draft = make_draft(target, block_size=4)
    p = prompt(7, 5, 12)
    ref = autoregressive_generate(target, p, max_new_tokens=20).new_token_ids
    ids = torch.cat([p[0], torch.tensor(ref)])
    both = replay_policies(target, draft, {"chain": make_policy("chain"), "8": make_policy(8)}, ids, 5, 20)
    assert set(both) == {"chain", "8"} and all(r.tau >= 1.0 for r in both.values())
    hidden = draft_hidden_all_rounds(target, draft, ids, 5, chunk=3)  # chunking does not change the states
    assert torch.allclose(hidden, draft_hidden_all_rounds(target, draft, ids, 5), atol=1e-10)
    with pytest.raises(ValueError, match="continuation ended"):
        replay(target, draft, make_policy("chain"), ids[:-4], 5, 20)
    with pytest.raises(ValueError, match="prompt_len"):
        draft_hidden_all_rounds(target, draft, ids, 0)


def test_replay_evaluator_equals_the_live_evaluator():
    from dflash_core.training.evaluate import replay_evaluator, tau_evaluator

    target = make_target("llama", vocab=6, init=0.3)
    draft = make_draft(target, block_size=5)
    prompts = [prompt(300 + k, 3 + 2 * k, 6)[0].tolist() for k in range(4)]
    live = tau_evaluator(target, None, prompts, 40, [4])(draft)
    replayed = replay_evaluator(target, prompts, 40, [4])(draft)
    assert replayed["tau"] == pytest.approx(live["tau"], abs=1e-12) and live["tau"] > 1.0
