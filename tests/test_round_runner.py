"""The decode loop on scripted models: what the live loop and replay share, checked without any model.

The scripted models verify against a fixed "true" continuation (one-hot logits) and records every call, so each rule
of a round is visible: the drafter runs only when the policy wants it, the walk accepts the longest matching path,
a stop token or the length limit cuts the committed tokens, the policy hears only the committed nodes, and the
target side commits exactly what the result books.
"""

from __future__ import annotations

import torch

from dflash_core.decoding import GenerationResult, SequenceDecoder, StageTimer, run_rounds, speculative_generate
from dflash_core.replay import replay_generate
from dflash_core.tree import BlockPolicy, DraftTree

VOCAB = 20
TRUE = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 3]  # the target's continuation after the prompt


class ScriptedModels:
    """One sequence's models verifying against ``TRUE``: after a node at depth d the target's choice is the token
    d + 1 past the root."""

    def __init__(self) -> None:
        self.pos = 0  # index in TRUE of the current root
        self.calls: list[tuple] = []

    def draft(self, seqs, roots):
        self.calls.append(("draft", roots[0]))
        return [f"block@{roots[0]}"]

    def verify(self, seqs, trees, roots) -> list[torch.Tensor]:
        self.calls.append(("verify", roots[0], trees[0].token_ids.tolist()))
        depths = [0] + trees[0].depths.tolist()
        logits = torch.zeros(len(depths), VOCAB)
        for row, d in enumerate(depths):
            logits[row, TRUE[self.pos + d + 1]] = 1.0
        return [logits]

    def commit(self, seqs, paths, committed) -> None:
        self.calls.append(("commit", list(paths[0]), list(committed[0])))
        self.pos += len(committed[0])

    def finish(self, seqs) -> None:
        self.calls.append(("finish", seqs))


class EveryOtherRound(BlockPolicy):
    """Drafts on even history lengths only; proposes the next three true tokens with the third one wrong."""

    name = "every-other"

    def __init__(self) -> None:
        self.blocks: list = []
        self.observed: list[list[int]] = []

    def wants_draft(self, history: list[int]) -> bool:
        return len(history) % 2 == 0

    def propose(self, block, history):
        self.blocks.append(block)
        if block is None:
            return DraftTree.chain([], [])
        at = TRUE.index(history[-1])
        return DraftTree.chain([TRUE[at + 1], TRUE[at + 2], 0], [-0.1, -0.2, -0.3])

    def observe(self, path: list[int]) -> None:
        self.observed.append(list(path))


def _run(policy, side, stops, max_new_tokens):
    history = [1, 2, TRUE[0]]  # a 2-token prompt and the prefill's token (odd length: round 1 skips the drafter)
    result = GenerationResult([TRUE[0]], [], {}, 2)
    decoder = SequenceDecoder(policy, stops=stops, max_new_tokens=max_new_tokens)
    run_rounds([decoder], side, [history], [result], StageTimer(enabled=False))
    return history, result


def test_a_round_drafts_only_when_asked_and_commits_the_walk_cut_at_a_stop():
    policy, side = EveryOtherRound(), ScriptedModels()
    history, result = _run(policy, side, stops={11}, max_new_tokens=50)
    # round 1 (no drafter): the bonus 6; round 2: 7, 8 accepted, 0 rejected, bonus 9; round 3 (no drafter): 10;
    # round 4: 11 and 12 accepted, but 11 is a stop token: 12 and the bonus are cut and the policy hears node 0 only
    assert result.acceptance_lengths == [1, 3, 1, 1] and result.tree_sizes == [0, 3, 0, 3]
    assert result.new_token_ids == TRUE[:7] and history == [1, 2] + TRUE[:7]
    assert policy.blocks == [None, "block@6", None, "block@10"]
    assert policy.observed == [[], [0, 1], [], [0]]
    assert [c for c in side.calls if c[0] == "commit"] == [
        ("commit", [], [6]), ("commit", [0, 1], [7, 8, 9]), ("commit", [], [10]), ("commit", [0, 1], [11])]
    assert [c[1] for c in side.calls if c[0] == "draft"] == [6, 10]


def test_the_length_limit_cuts_a_round_and_a_finished_start_runs_none():
    policy, side = EveryOtherRound(), ScriptedModels()
    _, result = _run(policy, side, stops=set(), max_new_tokens=3)
    assert result.acceptance_lengths == [1, 1] and result.new_token_ids == TRUE[:3]  # round 2 keeps 7 of 7, 8, 9
    assert policy.observed == [[], [0]]
    for stops, limit in (({TRUE[0]}, 50), (set(), 1)):  # the prefill's token is a stop, or already the limit
        side = ScriptedModels()
        history, result = _run(EveryOtherRound(), side, stops=stops, max_new_tokens=limit)
        assert result.acceptance_lengths == [] and side.calls == [("finish", [0])] and history == [1, 2, TRUE[0]]


def test_the_live_loop_and_replay_run_the_same_rounds(monkeypatch):
    """Both drive the loop's one round (run_rounds, SequenceDecoder.walk once per booked round): a replay with its
    own loop body fails this."""
    import dflash_core.decoding as decoding
    from conftest import make_draft, make_target, prompt
    from dflash_core.tree import Chain

    seen = []
    real_walk, real_rounds = SequenceDecoder.walk, decoding.run_rounds

    def counted(self, tree, logits, result):
        seen.append(current[-1])
        return real_walk(self, tree, logits, result)

    def rounds(decoders, models, *args, **kwargs):
        current.append(type(models).__name__)
        return real_rounds(decoders, models, *args, **kwargs)

    current: list[str] = []
    monkeypatch.setattr(SequenceDecoder, "walk", counted)
    monkeypatch.setattr(decoding, "run_rounds", rounds)
    import dflash_core.replay as replay
    monkeypatch.setattr(replay, "run_rounds", rounds)
    target = make_target("llama", vocab=64)
    draft = make_draft(target, block_size=4)
    ids = prompt(3, 8, 64)
    live = speculative_generate(target, draft, ids, Chain(), max_new_tokens=14)
    n_plain = len(seen)  # replay_generate runs plain decoding (one round per token) before replaying
    replayed = replay_generate(target, draft, ids, Chain(), max_new_tokens=14)
    assert replayed.acceptance_lengths == live.acceptance_lengths
    assert seen[:n_plain] == ["LiveModels"] * n_plain and n_plain == len(live.acceptance_lengths)
    assert seen[n_plain:] == ["LiveModels"] * 13 + ["TeacherForcedModels"] * len(live.acceptance_lengths)
