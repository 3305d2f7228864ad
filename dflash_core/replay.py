"""Replay greedy speculative decoding offline: the rounds' acceptance from one batched drafter pass.

At temperature 0 a lossless decoder outputs the target's greedy continuation, so the whole run is determined by it:
a round whose root sits at sequence position ``a`` drafts from the target features of positions ``< a`` (exactly the
context the drafter would have seen), the policy builds its tree from those draft logits, and the walk accepts the
longest path that spells the continuation. The next root is the bonus token right after the accepted path. Given
the continuation (plain decoding, once per prompt) and ONE teacher-forced target pass, every possible round start is
drafted in one batched drafter forward (the training code's block attention mask), and the rounds are then replayed
in order by the decode loop itself (:func:`~dflash_core.decoding.run_rounds`), with the verify step reading the
continuation (:class:`TeacherForcedModels`) instead of running the target.

In exact arithmetic the acceptance lengths equal those of :func:`dflash_core.decoding.speculative_generate`; in
fp32/fp64 they match it exactly in the tests. In bf16 the decode loop's multi-token forwards round differently from
one-token plain decoding, so its output (and tau) can drift from the replay's. The gain: evaluating a drafter costs
one drafter pass per prompt instead of a target forward per round, which makes ablations and frequent evaluation
during training cheap.

Policies are replayed faithfully when they do not read a clock: the chain, fixed budgets, and ``budget="auto"`` (it
learns from the ``observe`` feedback, which the replay gives after each round exactly as the loop does, and prices
trees with its cost model, not with timings).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .blocks import block_attention_mask, block_inputs
from .decoding import (
    GenerationResult, SequenceDecoder, StageTimer, autoregressive_generate, make_blocks, policies_for, run_rounds,
)
from .target import TargetAdapter, tapped_forward
from .tree import BlockPolicy

__all__ = ["ReplayResult", "TeacherForcedModels", "draft_hidden_all_rounds", "replay", "replay_policies",
           "replay_generate"]


@dataclass
class ReplayResult:
    acceptance_lengths: list[int]  # committed tokens per round (accepted draft tokens + the bonus), as the loop's
    tree_sizes: list[int]

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))


@torch.no_grad()
def draft_hidden_all_rounds(target, draft, ids: torch.Tensor, prompt_len: int, chunk: int = 64) -> torch.Tensor:
    """[T - prompt_len, b - 1, hidden]: the drafter's output states for a round rooted at every response position.

    ``ids`` [T] is the prompt followed by the target's continuation; row j belongs to the round whose root is
    ``ids[prompt_len + j]`` (context: target features of positions < prompt_len + j). One teacher-forced target pass,
    then drafter passes over ``chunk`` blocks at a time.
    """
    adapter = TargetAdapter(target, draft.config.target_layer_ids)
    device = adapter.device
    ids = ids.to(device)
    t = ids.shape[0]
    if not 0 < prompt_len < t:
        raise ValueError(f"need 0 < prompt_len < len(ids), got prompt_len={prompt_len}, len(ids)={t}")
    feats = tapped_forward(target, ids[None], adapter.layer_ids, use_cache=False).features[0]  # [T, taps*H]
    d_param = next(draft.parameters())
    b = draft.block_size
    anchors_all = torch.arange(prompt_len, t, device=device)
    parts = []
    for lo in range(0, len(anchors_all), chunk):
        anchors = anchors_all[lo: lo + chunk]
        n_ctx = int(anchors.max())
        tokens, positions, _ = block_inputs(ids, anchors, b, draft.mask_token_id)
        mask = block_attention_mask(anchors, b, n_ctx, device=d_param.device)[None, None]
        hidden = draft(adapter.embed(tokens)[None].to(d_param.device, d_param.dtype),
                       feats[:n_ctx][None].to(d_param.device), positions.to(d_param.device),
                       torch.arange(n_ctx, device=d_param.device), attn_mask=mask)  # [1, A*b, H]
        parts.append(hidden[0].view(len(anchors), b, -1)[:, 1:])
    return torch.cat(parts)


_SHORT = ("the continuation ended before max_new_tokens without a stop token: pass the full greedy continuation "
          "(plain decoding with the same stop tokens and max_new_tokens)")


class TeacherForcedModels:
    """Replay's model side of the decode loop (:class:`~dflash_core.decoding.ModelSide`, one sequence): the known
    greedy continuation ``ids`` stands in for the target, and the drafter's block comes from the batched drafter
    pass (``hidden``).

    The round rooted at sequence position ``anchor`` drafts from row ``anchor - prompt_len`` of ``hidden``. Its
    verification needs no forward: the target's greedy choice after a node at depth d is the continuation's token at
    ``anchor + d + 1`` (only nodes on the continuation's path are ever reached by the walk), so each row of the logits
    is one-hot on that token. Past the continuation's end a row points at token 0; such a row can only be reached
    when the continuation is too short, which :meth:`commit` reports.
    """

    def __init__(self, draft, adapter: TargetAdapter, hidden: torch.Tensor, ids: torch.Tensor, prompt_len: int):
        self.drafter, self.adapter, self.hidden, self.ids = draft, adapter, hidden, ids
        self.prompt_len = self.anchor = prompt_len

    def draft(self, seqs: list[int], roots: list[int]):
        row = self.anchor - self.prompt_len
        if row >= len(self.hidden):
            raise ValueError(_SHORT)
        return make_blocks(self.drafter, self.adapter, self.hidden[row][None].to(self.adapter.device), roots)

    def verify(self, seqs: list[int], trees: list, roots: list[int]) -> list[torch.Tensor]:
        t = self.ids.shape[0]
        depths = torch.cat([torch.zeros(1, dtype=torch.long), trees[0].depths.cpu().long()])
        nxt = self.anchor + depths + 1
        choice = torch.where(nxt < t, self.ids[nxt.clamp(max=t - 1)], torch.zeros_like(nxt))
        logits = torch.zeros(len(depths), self.adapter.vocab_size)
        logits[torch.arange(len(depths)), choice] = 1.0
        return [logits]

    def commit(self, seqs: list[int], paths: list[list[int]], committed: list[list[int]]) -> None:
        tokens = committed[0]
        if self.anchor + len(tokens) >= self.ids.shape[0]:
            raise ValueError(_SHORT)
        if tokens != self.ids[self.anchor + 1: self.anchor + 1 + len(tokens)].tolist():
            raise AssertionError("replay left the continuation: the policy or walk is not greedy")
        self.anchor += len(tokens)

    def finish(self, seqs: list[int]) -> None:
        pass


@torch.no_grad()
def replay(target, draft, policy: BlockPolicy, ids: torch.Tensor, prompt_len: int, max_new_tokens: int,
           stop_token_ids: Sequence[int] | None = None, hidden: torch.Tensor | None = None) -> ReplayResult:
    """Replay greedy decoding of ``ids[prompt_len:]`` (the target's greedy continuation) with ``policy``.

    The rounds are the decode loop's own (:func:`~dflash_core.decoding.run_rounds`), on
    :class:`TeacherForcedModels` instead of the live models. ``hidden`` may pass :func:`draft_hidden_all_rounds`'
    result to replay several policies from one drafter pass. The continuation must be what plain greedy decoding
    produced (it ends at a stop token or ``max_new_tokens``).
    """
    ids = ids.cpu()
    if not 0 < prompt_len < ids.shape[0]:
        raise ValueError(f"need 0 < prompt_len < len(ids), got prompt_len={prompt_len}, len(ids)={ids.shape[0]}")
    if hidden is None:
        hidden = draft_hidden_all_rounds(target, draft, ids, prompt_len)
    models = TeacherForcedModels(draft, TargetAdapter(target, ()), hidden, ids, prompt_len)
    history = ids[: prompt_len + 1].tolist()
    rounds = GenerationResult(history[-1:], [], {}, prompt_len)  # the prefill's token (the first root) is no round
    decoder = SequenceDecoder(policies_for(policy, 1)[0], set(stop_token_ids or ()), max_new_tokens)
    run_rounds([decoder], models, [history], [rounds], StageTimer(enabled=False))
    return ReplayResult(rounds.acceptance_lengths, rounds.tree_sizes)


def replay_policies(target, draft, policies: dict[str, BlockPolicy], ids: torch.Tensor, prompt_len: int,
                    max_new_tokens: int, stop_token_ids: Sequence[int] | None = None) -> dict[str, ReplayResult]:
    """Replay several policies from one drafter pass over ``ids``."""
    hidden = draft_hidden_all_rounds(target, draft, ids, prompt_len)
    return {name: replay(target, draft, pol, ids, prompt_len, max_new_tokens, stop_token_ids, hidden)
            for name, pol in policies.items()}


def replay_generate(target, draft, input_ids: torch.Tensor, policy: BlockPolicy | dict[str, BlockPolicy],
                    max_new_tokens: int = 128, stop_token_ids: Sequence[int] | None = None):
    """Replay greedy decoding of a prompt with one policy (or a dict name -> policy) without running the rounds.

    ``input_ids`` is the ``[1, T]`` prompt, as for every ``*_generate`` function; plain greedy decoding runs here to
    get the continuation, then one drafter pass drafts every round. Returns a :class:`ReplayResult` (a dict of them
    for a dict of policies) whose acceptance lengths are those the decode loop would see in exact arithmetic.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [1, T] LongTensor (one prompt), got {shape}")
    plain = autoregressive_generate(target, input_ids, max_new_tokens, 0.0, stop_token_ids)
    prompt_len = int(input_ids.shape[1])
    ids = torch.cat([input_ids[0].cpu(), torch.tensor(plain.new_token_ids, dtype=torch.long)])
    policies = policy if isinstance(policy, dict) else {"policy": policy}
    results = replay_policies(target, draft, policies, ids, prompt_len, max_new_tokens, stop_token_ids)
    return results if isinstance(policy, dict) else results["policy"]
