"""Prompt-lookup decoding on the one loop: draft-free continuations found in the context.

A text that copies from its input (editing given code, quoting, summarising) repeats n-grams of the prompt or of what
it has already written. :class:`PromptLookup` matches the last n committed tokens (n from ``max_ngram`` down to 1)
against everything before them and proposes the ``num_tokens`` tokens that followed the most recent earlier
occurrence of the longest match, as a chain. The target verifies it like any proposal (sample-and-match), so the
output is exactly the target's, greedy or sampled; no drafter runs.

:class:`NgramIndex` keeps, for every n-gram of the context, where it last occurred, and is updated as tokens are
committed: O(max_ngram) dictionary updates per token, no rescan of the context per round.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .decoding import GenerationResult, speculative_generate
from .tree import BlockPolicy, DraftTree

__all__ = ["NgramIndex", "PromptLookup", "lookup_generate"]


class NgramIndex:
    """Where each n-gram (n = 1..``max_ngram``) of a growing token list last ended, and the one before that.

    ``ends[n][gram]`` = (latest end, previous end), an end being the index just past the gram's last token, i.e. where
    its continuation starts; the latest one of the current suffix is the suffix itself, so :meth:`continuation`
    continues the one before it (continuing the earliest occurrence instead, as transformers' prompt lookup does, was
    measured and is no better: docs/results.md).
    """

    def __init__(self, max_ngram: int = 3) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.ends: list[dict[tuple[int, ...], tuple[int, int]]] = [{} for _ in range(max_ngram + 1)]
        self._history_id: int | None = None  # the list :meth:`follow` indexes

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                gram = tuple(self.tokens[end - n:end])
                table = self.ends[n]
                latest = table.get(gram)
                table[gram] = (end, latest[0] if latest else -1)

    def follow(self, history: list[int]) -> None:
        """Index what ``history`` (the loop's growing list of committed tokens) added since the last call; a list that
        does not extend the indexed tokens (a new generation) restarts the index."""
        indexed = len(self.tokens)
        if (id(history) != self._history_id or len(history) < indexed
                or (indexed and (history[0] != self.tokens[0] or history[indexed - 1] != self.tokens[-1]))):
            self.tokens, self.ends, indexed = [], [{} for _ in range(self.max_ngram + 1)], 0
            self._history_id = id(history)
        self.extend(history[indexed:])

    def continuation(self, num_tokens: int) -> tuple[int, list[int]]:
        """(match length n, up to ``num_tokens`` tokens that followed the most recent EARLIER occurrence of the
        longest suffix n-gram); (0, []) when no suffix of length >= 1 occurred before."""
        end = len(self.tokens)
        for n in range(min(self.max_ngram, end), 0, -1):
            seen = self.ends[n].get(tuple(self.tokens[end - n:]))
            if seen is None:
                continue
            earlier = seen[0] if seen[0] != end else seen[1]  # the latest is usually the suffix itself
            if earlier > 0:
                return n, self.tokens[earlier:earlier + num_tokens]
        return 0, []


class PromptLookup(BlockPolicy):
    """Proposal policy: the continuation of the longest earlier match of the context's suffix (see the module).

    The index follows the history the loop hands over (:meth:`NgramIndex.follow`). ``lookup_committed``: per round,
    how many committed tokens came from the continuation (the accepted nodes the loop reports as committed: a round
    cut by a stop token or by ``max_new_tokens`` inside the continuation commits only lookup tokens, no bonus).
    """

    uses_draft, proposes_chains = False, True

    def __init__(self, max_ngram: int = 3, num_tokens: int = 10) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        self.max_ngram, self.num_tokens = max_ngram, num_tokens
        self.name = f"lookup-{max_ngram}x{num_tokens}"
        self.index = NgramIndex(max_ngram)
        self.lookup_committed: list[int] = []

    def propose(self, block: None, history: list[int]) -> DraftTree:
        self.index.follow(history)
        _, tokens = self.index.continuation(self.num_tokens)
        return DraftTree.chain(torch.tensor(tokens, dtype=torch.long))  # no draft probabilities: unknown (NaN)

    def observe(self, path: list[int]) -> None:
        """The round's accepted nodes that were committed: every one of them is a lookup token."""
        self.lookup_committed.append(len(path))


def lookup_generate(target, input_ids: torch.Tensor, max_new_tokens: int = 128, temperature: float = 0.0,
                    stop_token_ids: Sequence[int] | None = None, seed: int = 0, max_ngram: int = 3,
                    num_tokens: int = 10, top_k: int | None = None, top_p: float | None = None,
                    min_p: float | None = None) -> GenerationResult:
    """Prompt-lookup decoding: the same arguments and result as the other ``*_generate`` functions, no drafter.

    ``max_ngram``: the longest suffix matched against the context; ``num_tokens``: how many tokens a round proposes.
    ``top_k`` / ``top_p`` / ``min_p``: transformers' sampling filters (T > 0, :mod:`dflash_core.sampling`).
    """
    policy = PromptLookup(max_ngram, num_tokens)
    result = speculative_generate(target, None, input_ids, policy, max_new_tokens, temperature, stop_token_ids, seed,
                                  top_k=top_k, top_p=top_p, min_p=min_p)
    result.lookup_tokens = policy.lookup_committed  # every committed draft token is a lookup one
    return result
