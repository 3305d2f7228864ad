"""Prompt-lookup decoding's per-round count of committed lookup tokens, against a brute-force replay of its rounds.

A round proposes the continuation of the longest earlier match of the context's suffix; the committed tokens that
came from it are the leading committed tokens equal to that continuation (sample-and-match accepts a chain node
exactly when the target's token equals it). Rounds cut by a stop token or by ``max_new_tokens`` inside the
continuation commit only lookup tokens, no bonus: the count must not drop one there.
"""

from __future__ import annotations

import pytest

from conftest import make_target, prompt
from dflash_core import lookup_generate


def _continuation(tokens: list[int], max_ngram: int, num_tokens: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix n-gram (n <= max_ngram), by a scan."""
    end = len(tokens)
    for n in range(min(max_ngram, end), 0, -1):
        suffix = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + num_tokens]
    return []


def _expected_counts(ids: list[int], new: list[int], lengths: list[int], max_ngram: int, num_tokens: int):
    """Per round: how many of its committed tokens lead with the round's lookup continuation."""
    counts, done = [], 1  # the prefill's token is not a round
    for n in lengths:
        chain = _continuation(ids + new[:done], max_ngram, num_tokens)
        committed = new[done:done + n]
        k = 0
        while k < min(len(chain), len(committed)) and chain[k] == committed[k]:
            k += 1
        counts.append(k)
        done += n
    return counts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_lookup_tokens_count_the_committed_continuation_tokens_even_in_a_cut_round(temperature):
    target = make_target("llama", vocab=6, init=0.6)  # few tokens, peaked: the output repeats, lookups go deep
    cut_inside = 0
    for seed in range(6):
        p = prompt(seed, 10, 6)
        ids = p[0].tolist()
        for max_new in range(2, 26, 3):
            for stops in ([], [seed % 6]):
                res = lookup_generate(target, p, max_new_tokens=max_new, temperature=temperature, seed=seed,
                                      stop_token_ids=stops, max_ngram=2, num_tokens=5)
                want = _expected_counts(ids, res.new_token_ids, res.acceptance_lengths, 2, 5)
                assert res.lookup_tokens == want, (seed, max_new, stops)
                cut_inside += want[-1] == res.acceptance_lengths[-1] if want else 0  # the last round: no bonus
    assert cut_inside > 0  # some rounds really were cut inside the continuation
