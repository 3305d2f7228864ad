"""Offline replay of greedy decoding equals the decode loop round for round (oracle: the loop itself)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_draft, make_target, prompt
from ddtree import ddtree_generate
from ddtree.generate import make_policy
from dflash_core import BlockPolicy, autoregressive_generate
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


class _Recording(BlockPolicy):
    """A fixed-budget policy that records what the loop tells it after every round."""

    uses_draft = True

    def __init__(self, budget: int) -> None:
        self.inner, self.name, self.seen = make_policy(budget), f"recording-{budget}", []

    def propose(self, block, history):
        return self.inner.propose(block, history)

    def observe(self, path):
        self.seen.append(list(path))


def test_loop_and_replay_report_the_same_committed_nodes_when_a_round_is_cut():
    """The last round is cut by max_new_tokens or a stop token: both the loop and the replay hand the policy only
    the accepted nodes that were committed, so an adaptive policy learns the same from both."""
    target = make_target("llama", vocab=6, init=0.3)
    draft = make_draft(target, block_size=5)
    cases = [(seed, n, stops) for seed in range(3) for n in range(5, 30, 3) for stops in ([], [4])]
    for seed, n, stops in cases:
        p = prompt(400 + seed, 4, 6)
        live_policy, replay_policy = _Recording(16), _Recording(16)
        live = ddtree_generate(target, draft, p, max_new_tokens=n, stop_token_ids=stops, policy=live_policy)
        ids = torch.cat([p[0], torch.tensor(live.new_token_ids)])
        got = replay(target, draft, replay_policy, ids, p.shape[1], n, stops)
        assert got.acceptance_lengths == live.acceptance_lengths
        assert live_policy.seen == replay_policy.seen
        for path, committed in zip(live_policy.seen, live.acceptance_lengths):
            assert len(path) <= committed  # never a node past the cut


class SkipsSomeRounds(BlockPolicy):
    """Fixed budget 6, but every round whose history length is divisible by 3 skips the drafter (and verifies no
    draft: the bonus only), so the features of committed positions pile up between two drafted rounds."""

    name, uses_draft = "skips-some", True

    def wants_draft(self, history):
        return len(history) % 3 != 0

    def propose(self, block, history):
        from ddtree import build_tree
        from dflash_core.tree import DraftTree

        return DraftTree.empty() if block is None else build_tree(block.logits, 6, token_map=block.token_map)


def test_rounds_without_the_drafter_carry_the_unconsumed_features_to_the_next_draft(family):
    """Oracle: replay drafts every round from the teacher-forced features of every committed position. A loop that
    dropped the features of a round without the drafter would draft later rounds from a wrong context and its
    acceptance lengths would leave replay's."""
    target = make_target(family, vocab=6, init=0.3)
    draft = make_draft(target, block_size=5)
    skipped_rounds = 0
    for seed in range(3):
        p = prompt(500 + seed, 4 + seed, 6)
        live = ddtree_generate(target, draft, p, policy=SkipsSomeRounds(), max_new_tokens=40)
        ref = autoregressive_generate(target, p, max_new_tokens=40).new_token_ids
        assert live.new_token_ids == ref
        ids = torch.cat([p[0], torch.tensor(ref)])
        got = replay(target, draft, SkipsSomeRounds(), ids, p.shape[1], 40)
        assert got.acceptance_lengths == live.acceptance_lengths and got.tree_sizes == live.tree_sizes
        skipped_rounds += live.tree_sizes.count(0)
    assert skipped_rounds >= 3 and sum(n > 1 for n in got.acceptance_lengths) >= 2
