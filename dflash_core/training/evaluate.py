"""The drafter's acceptance length tau during and after training: real greedy ``dflash_generate``, or replayed.

:func:`replay_evaluator` computes the target's greedy continuations of the held-out prompts once and then replays the
chain's rounds from one batched drafter pass per prompt (:mod:`dflash_core.replay`): the same tau (exactly so in
fp32) for a fraction of the cost, so a run can evaluate often and on more prompts.
"""

from __future__ import annotations

import torch

__all__ = ["tau_evaluator", "replay_evaluator"]


def tau_evaluator(target, tokenizer, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]):
    """A callable draft -> {"tau": mean acceptance length over the prompts} using real greedy dflash_generate."""
    from ..decoding import dflash_generate

    def evaluate(draft) -> dict:
        lengths = []
        for ids in prompts:
            res = dflash_generate(target, draft, torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                  stop_token_ids=stop_ids)
            lengths += res.acceptance_lengths
        return {"tau": sum(lengths) / max(1, len(lengths))}

    return evaluate


def replay_evaluator(target, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]):
    """A callable draft -> {"tau": chain tau over the prompts}, replayed from greedy continuations computed here."""
    from ..decoding import Chain, autoregressive_generate
    from ..replay import replay

    sequences = []
    for ids in prompts:
        out = autoregressive_generate(target, torch.tensor([ids]), max_new_tokens, stop_token_ids=stop_ids)
        sequences.append((torch.tensor(ids + out.new_token_ids), len(ids)))

    def evaluate(draft) -> dict:
        was_training = draft.training
        draft.eval()
        lengths = []
        for full, p in sequences:
            lengths += replay(target, draft, Chain(), full, p, max_new_tokens, stop_ids).acceptance_lengths
        draft.train(was_training)
        return {"tau": sum(lengths) / max(1, len(lengths))}

    return evaluate
