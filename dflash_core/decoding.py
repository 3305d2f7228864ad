"""The one speculative decode loop: draft -> propose -> verify -> commit.

A round is :class:`RoundRunner`'s, written once for the live loop (:func:`speculative_generate`, verifying on the
target) and for replay (``dflash_core.replay``, verifying against a known greedy continuation).

Plain decoding, DFlash (a chain) and DDTree (a tree) all run through :func:`speculative_generate`; they differ only in
the *proposal policy*, which turns the drafter's per-position logits into a tree of draft tokens:

* :class:`NoDraft`  proposes nothing: every round verifies just the root, i.e. autoregressive decoding;
* :class:`Chain`    proposes the drafter's top-1 token at every depth: DFlash;
* ``ddtree`` policies propose a best-first tree under a node budget.

Why the output is exactly the target's (lossless), greedy and sampled alike: each committed token is the target's own
choice at a position whose prefix is already committed. The verify pass computes the target's distribution at every
draft node; walking from the root we draw the target's token (argmax, or a sample from softmax(logits / T)) at the
current node and move into the child carrying that token if there is one. Drafting only decides at which positions the
target's distribution was computed in advance; it never changes which token is drawn there ("sample-and-match").
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from .batch import as_prompts, batch_generate, is_batch, policies_for
from .model import DFlashDraftModel
from .policy import (
    BlockPolicy, Chain, DraftBlock, NoDraft, Proposal, ProposalPolicy, as_policy, check_proposal, check_structure,
)
from .rounds import (
    BatchSide, GenerationResult, LiveTarget, OneSequence, RoundRunner, RoundTarget, check_room, check_stop_ids,
    commit_path, compile_proposal, draft_round, draft_states, follow, make_block, prefill, run_rounds,
    truncate_at_stop, validate_request, verify_proposal, verify_walk,
)
from .target import TargetAdapter, check_compatibility
from .timing import StageTimer

__all__ = [
    "GenerationResult", "Proposal", "ProposalPolicy", "NoDraft", "Chain", "check_proposal", "compile_proposal",
    "follow", "speculative_generate", "autoregressive_generate", "dflash_generate", "draft_states",
    "verify_proposal", "commit_path", "truncate_at_stop", "validate_request", "prefill",
    "draft_round", "make_block", "check_structure", "RoundRunner", "RoundTarget", "LiveTarget", "BatchSide",
    "OneSequence", "run_rounds", "verify_walk", "BlockPolicy", "DraftBlock", "as_policy",
]


# ---------------------------------------------------------------------------------------------------- the loop
@torch.inference_mode()
def speculative_generate(
    target,
    draft: DFlashDraftModel | None,
    input_ids: torch.Tensor,
    policy: BlockPolicy,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] | None = None,
    seed: int = 0,
    block_size: int | None = None,
    trace: bool = False,
    check_trees: bool = False,
    attention_mask: torch.Tensor | None = None,
    proposer=None,
) -> GenerationResult | list[GenerationResult]:
    """Generate with ``policy`` deciding each round's draft tree. See the module docstring for why it is lossless.

    Every round the tree's structure is checked (:func:`check_structure`: what positions, mask and cache rely on);
    ``check_trees`` adds the costlier checks of :func:`check_proposal` (distinct sibling tokens), for developing a
    policy. The rounds themselves are :class:`RoundRunner`'s, on the live target (:class:`LiveTarget`).

    A batch: ``input_ids`` a list of prompts ([T] or [1, T] each, any lengths), or padded [B, T] ids with an
    ``attention_mask``. It returns one result per prompt, decoded together (one drafter pass and one target forward
    per round, see :mod:`dflash_core.batch`); sequence b uses its own copy of ``policy`` (or ``policy[b]`` from a
    list) and a generator seeded ``seed + b``, so it commits what a single-prompt call with that seed commits.
    ``proposer`` (batches only): proposes each round's trees for the whole batch (``rounds.BatchProposer``)."""
    if is_batch(input_ids, attention_mask):
        prompts = as_prompts(input_ids, attention_mask)
        return batch_generate(target, draft, prompts, policies_for(policy, len(prompts)), max_new_tokens,
                              temperature, stop_token_ids, seed, block_size, trace, check_trees, proposer)
    if proposer is not None:
        raise ValueError("proposer= proposes the trees of a batch: pass a list of prompts")
    policy, adapter, stops = _prepare(target, draft, input_ids, policy, max_new_tokens, temperature, stop_token_ids,
                                      block_size)
    device, uses_draft = adapter.device, policy.uses_draft
    generator, timer = torch.Generator(device=device).manual_seed(seed), StageTimer(device)
    result = GenerationResult([], [], {}, int(input_ids.shape[1]), trees=[] if trace else None)
    if max_new_tokens == 0:
        result.timings = {"prefill": 0.0, "decode": 0.0}
        return result
    with timer.stage("prefill"):  # the prompt enters the target cache; its features are the drafter's first context
        cache, root, pending = prefill(adapter, input_ids, temperature, generator, uses_draft)
    result.new_token_ids.append(root)
    live = LiveTarget(adapter, draft, cache, int(input_ids.shape[1]), pending, block_size, with_features=uses_draft)
    runner = RoundRunner(policy, live, stops, max_new_tokens, temperature, generator, timer, check_trees)
    t_loop = time.perf_counter()
    runner.run(input_ids[0].tolist() + [root], result)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result.timings = {**timer.totals(), "decode": time.perf_counter() - t_loop}
    return result


def _prepare(target, draft, input_ids, policy, max_new_tokens, temperature, stop_token_ids, block_size):
    """Validate a generation request; returns the policy (older ones adapted: :func:`as_policy`), the target adapter
    and the set of stop ids."""
    validate_request(input_ids, max_new_tokens, temperature)
    policy = as_policy(policy)
    if policy.uses_draft:
        if draft is None:
            raise ValueError(f"policy {policy.name!r} needs a drafter; pass draft=...")
        check_compatibility(target, draft)
        if not 2 <= (block_size or draft.block_size):
            raise ValueError(f"block_size must be >= 2, got {block_size}")
    adapter = TargetAdapter(target, draft.config.target_layer_ids if policy.uses_draft else ())
    adapter.check_token_ids(input_ids)
    check_room(adapter, int(input_ids.shape[1]), max_new_tokens)
    return policy, adapter, check_stop_ids(adapter, stop_token_ids)


def autoregressive_generate(target, input_ids: torch.Tensor, max_new_tokens: int = 128, temperature: float = 0.0,
                            stop_token_ids: Sequence[int] | None = None, seed: int = 0,
                            attention_mask: torch.Tensor | None = None) -> GenerationResult | list[GenerationResult]:
    """Plain decoding: one target forward per token (the reference every speculative method must reproduce). A list
    of prompts (or padded ids with ``attention_mask``) decodes as a batch: one forward per token for all."""
    return speculative_generate(target, None, input_ids, NoDraft(), max_new_tokens, temperature, stop_token_ids, seed,
                                attention_mask=attention_mask)


def dflash_generate(target, draft: DFlashDraftModel, input_ids: torch.Tensor, max_new_tokens: int = 128,
                    temperature: float = 0.0, stop_token_ids: Sequence[int] | None = None, seed: int = 0,
                    block_size: int | None = None, attention_mask: torch.Tensor | None = None
                    ) -> GenerationResult | list[GenerationResult]:
    """DFlash: draft a block in one drafter pass, verify it as a chain in one target pass (a list of prompts, or
    padded ids with ``attention_mask``: a batch, see :func:`speculative_generate`)."""
    return speculative_generate(target, draft, input_ids, Chain(), max_new_tokens, temperature, stop_token_ids, seed,
                                block_size=block_size, attention_mask=attention_mask)


def spec_generate(self: DFlashDraftModel, target, input_ids: torch.Tensor, max_new_tokens: int = 2048,
                  stop_token_ids: Sequence[int] | None = None, temperature: float = 0.0, seed: int = 0,
                  block_size: int | None = None) -> torch.Tensor:
    """z-lab's transformers entry point as a drop-in: ``draft.spec_generate(input_ids=..., max_new_tokens=...,
    temperature=..., target=..., stop_token_ids=...)`` returns the prompt followed by the new tokens, ``[1, T]`` on
    the prompt's device, generated by this loop (:func:`dflash_generate`: DFlash, one chain per round). For trees,
    timings and acceptance lengths call ``dflash_generate`` / ``ddtree_generate``."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("spec_generate decodes one [1, T] prompt, as z-lab's does; for a batch call "
                         "dflash_generate(target, draft, [prompt, ...]), which returns one result per prompt")
    result = dflash_generate(target, self, input_ids, max_new_tokens, temperature, stop_token_ids, seed,
                             block_size=block_size)
    new = torch.tensor([result.new_token_ids], dtype=input_ids.dtype, device=input_ids.device)
    return torch.cat([input_ids, new], dim=1)


# The method is bound here, not written in model.py: the network sits below the loop (this module imports it), and a
# method there that called the loop would make the two modules import each other. Every import of dflash_core runs
# this module (the package root imports it), so every drafter has the method.
DFlashDraftModel.spec_generate = spec_generate
