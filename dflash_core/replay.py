"""Replay greedy speculative decoding offline: the rounds' acceptance from one batched drafter pass.

At temperature 0 a lossless decoder outputs the target's greedy continuation, so the whole run is determined by it:
a round whose root sits at sequence position ``a`` drafts from the target features of positions ``< a`` (exactly the
context the drafter would have seen), the policy builds its tree from those draft logits, and the walk accepts the
longest path that spells the continuation. The next root is the bonus token right after the accepted path. Given
the continuation (plain decoding, once per prompt) and ONE teacher-forced target pass, every possible round start is
drafted in one batched drafter forward (the training code's block attention mask), and the rounds are then replayed
in order by the same policy and walk code the decode loop uses.

In exact arithmetic the acceptance lengths equal those of :func:`dflash_core.decoding.speculative_generate`; in
fp32/fp64 they match it exactly in the tests. In bf16 the decode loop's multi-token forwards round differently from
one-token plain decoding, so its output (and tau) can drift from the replay's by a little. The gain: evaluating a
drafter costs one drafter pass per prompt instead of a target forward per round, which makes ablations and
frequent evaluation during training cheap.

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
    BlockPolicy, as_policy, autoregressive_generate, check_structure, make_block, truncate_at_stop, verify_walk,
)
from .target import TargetAdapter, tapped_forward

__all__ = ["ReplayResult", "draft_hidden_all_rounds", "replay", "replay_policies", "replay_generate"]


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


@torch.no_grad()
def replay(target, draft, policy: BlockPolicy, ids: torch.Tensor, prompt_len: int, max_new_tokens: int,
           stop_token_ids: Sequence[int] | None = None, hidden: torch.Tensor | None = None) -> ReplayResult:
    """Replay greedy decoding of ``ids[prompt_len:]`` (the target's greedy continuation) with ``policy``.

    ``hidden`` may pass :func:`draft_hidden_all_rounds`' result to replay several policies from one drafter pass.
    The continuation must be what plain greedy decoding produced (it ends at a stop token or ``max_new_tokens``).
    """
    ids = ids.cpu()
    t = ids.shape[0]
    if hidden is None:
        hidden = draft_hidden_all_rounds(target, draft, ids, prompt_len)
    adapter = TargetAdapter(target, ())
    stops = set(stop_token_ids or ())
    vocab = adapter.vocab_size
    history = ids[: prompt_len + 1].tolist()
    generated = 1  # the prefill's token (the first root) is not a round
    done = history[-1] in stops or max_new_tokens <= 1
    anchor = prompt_len
    result = ReplayResult([], [])
    policy = as_policy(policy)
    while not done:
        if anchor - prompt_len >= len(hidden):
            raise ValueError("the continuation ended before max_new_tokens without a stop token: pass the full "
                             "greedy continuation (plain decoding with the same stop tokens and max_new_tokens)")
        drafted = None
        if policy.uses_draft and policy.wants_draft(history):  # as the loop: the policy may skip the drafter
            states = hidden[anchor - prompt_len].to(adapter.device)  # [b-1, H]
            drafted = make_block(draft, adapter, states, history[-1])
        proposal = policy.propose(drafted, history)
        check_structure(proposal, policy.name)
        # the target's greedy choice after a node at depth d is the continuation's token at anchor + d + 1 (only
        # nodes on the continuation's path are ever reached by the walk); past the end: a token no child carries
        depths = torch.cat([torch.zeros(1, dtype=torch.long), proposal.depths.cpu().long()])
        nxt = anchor + depths + 1
        choice = torch.where(nxt < t, ids[nxt.clamp(max=t - 1)], torch.full_like(nxt, -1))
        logits = torch.zeros(len(depths), vocab)
        logits[choice >= 0, choice[choice >= 0]] = 1.0
        logits[choice < 0, 0] = 1.0  # only past the last committed token: truncated below
        path, bonus = verify_walk(proposal, logits, 0.0, None)
        committed, done = truncate_at_stop([int(proposal.token_ids[i]) for i in path] + [bonus], stops,
                                           max_new_tokens - generated)
        policy.observe(path[: len(committed)])  # as the decode loop: only the accepted nodes that were committed
        history += committed
        generated += len(committed)
        if anchor + len(committed) >= t:
            raise ValueError("the continuation ended before max_new_tokens without a stop token: pass the full "
                             "greedy continuation (plain decoding with the same stop tokens and max_new_tokens)")
        if committed != ids[anchor + 1: anchor + 1 + len(committed)].tolist():
            raise AssertionError("replay left the continuation: the policy or walk is not greedy")
        result.acceptance_lengths.append(len(committed))
        result.tree_sizes.append(len(proposal.token_ids))
        anchor += len(committed)
    return result


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
