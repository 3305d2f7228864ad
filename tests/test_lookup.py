"""Prompt-lookup decoding: the n-gram index against a brute-force scan, and the output equal to plain decoding."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import make_target, prompt
from dflash_core import autoregressive_generate, lookup_generate
from dflash_core.lookup import NgramIndex, PromptLookup


def _brute_force(tokens: list[int], max_ngram: int, num_tokens: int) -> tuple[int, list[int]]:
    """The longest suffix (<= max_ngram) with an earlier occurrence; the continuation of the latest such one."""
    end = len(tokens)
    for n in range(min(max_ngram, end), 0, -1):
        suffix = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):  # occurrences ending before the end, latest first
            if tokens[start:start + n] == suffix:
                return n, tokens[start + n:start + n + num_tokens]
    return 0, []


@pytest.mark.parametrize("seed", range(6))
def test_index_finds_what_a_scan_of_the_context_finds(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4 + seed) for _ in range(120)]
    index = NgramIndex(max_ngram=3)
    for i, token in enumerate(tokens):  # updated token by token, queried after every one
        index.extend([token])
        assert index.continuation(5) == _brute_force(tokens[:i + 1], 3, 5)


def test_policy_follows_a_growing_history_and_restarts_for_a_new_one():
    policy = PromptLookup(max_ngram=2, num_tokens=3)
    history = [1, 2, 3, 4, 1, 2]
    assert policy.propose(None, history).token_ids.tolist() == [3, 4, 1]
    history += [3, 9]
    assert policy.propose(None, history).token_ids.tolist() == []  # 9 never occurred before
    assert len(policy.index.tokens) == 8  # extended, not rebuilt
    assert policy.propose(None, [5, 6, 5]).token_ids.tolist() == [6, 5]  # another generation: a fresh index


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_lookup_decoding_equals_plain_decoding(family, temperature):
    """fp64: the same tokens as plain decoding, greedy and sampled with the same seed (sample-and-match draws the
    target's token at every position in the same order as plain decoding)."""
    target = make_target(family, vocab=8, init=0.3)  # a small vocabulary: the output repeats, lookups hit
    multi = 0
    for seed in range(3):
        p = prompt(50 + seed, 12, 8)
        ref = autoregressive_generate(target, p, 40, temperature=temperature, seed=seed, stop_token_ids=[7])
        got = lookup_generate(target, p, 40, temperature=temperature, seed=seed, stop_token_ids=[7])
        assert got.new_token_ids == ref.new_token_ids
        multi += sum(n > 1 for n in got.acceptance_lengths)
    assert multi >= 3  # lookups were accepted, not only bonus tokens
