"""Losslessness of the one decode loop (plain, DFlash chain) against plain autoregressive decoding."""

from __future__ import annotations

import random

import pytest
import torch

import dflash_core.decoding as decoding
from conftest import answer_counts, make_draft, make_target, prompt, sampled_answers
from dflash_core import autoregressive_generate, dflash_generate, speculative_generate
from dflash_core.tree import BlockPolicy, Chain, DraftTree, NoDraft


class OracleChain(BlockPolicy):
    """Test policy: proposes the known AR continuation, corrupted at a random depth, so rounds accept 0..b-1 tokens.

    The random drafter of a tiny model almost never agrees with the target; this policy exercises every acceptance
    length, the cache compaction and the stop/max-token bookkeeping while the drafter still runs every round.
    """

    name, uses_draft, proposes_chains = "oracle-chain", True, True

    def __init__(self, reference: list[int], prompt_len: int, seed: int) -> None:
        self.reference, self.prompt_len, self.rng = reference, prompt_len, random.Random(seed)

    def propose(self, block, history: list[int]) -> DraftTree:
        draft_logits = block.full_logits()
        depth = draft_logits.shape[0]
        pos = len(history) - self.prompt_len  # index in `reference` of the first token after the root
        tokens = list(self.reference[pos: pos + depth])
        tokens += [0] * (depth - len(tokens))
        cut = self.rng.randint(0, depth)
        if cut < depth:  # corrupt one token: everything below it must be rejected
            tokens[cut] = (tokens[cut] + 1 + self.rng.randrange(draft_logits.shape[1] - 1)) % draft_logits.shape[1]
        return DraftTree.chain(torch.tensor(tokens), torch.zeros(depth))


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_dflash_greedy_equals_autoregressive(family, block_size):
    target = make_target(family, vocab=64)
    draft = make_draft(target, block_size=block_size)
    for seed in range(4):
        p = prompt(seed, 3 + 4 * seed, 64)
        ref = autoregressive_generate(target, p, max_new_tokens=40, seed=seed)
        out = dflash_generate(target, draft, p, max_new_tokens=40, seed=seed)
        assert out.new_token_ids == ref.new_token_ids and len(ref.new_token_ids) == 40
        assert sum(out.acceptance_lengths) == len(out.new_token_ids) - 1


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_chain_with_accepting_proposals_is_lossless(family, block_size):
    target = make_target(family, vocab=64)
    draft = make_draft(target, block_size=block_size)
    lengths = set()
    for seed in range(5):
        p = prompt(100 + seed, 5 + seed, 64)
        ref = autoregressive_generate(target, p, max_new_tokens=60).new_token_ids
        out = speculative_generate(target, draft, p, OracleChain(ref, p.shape[1], seed), max_new_tokens=60)
        assert out.new_token_ids == ref
        lengths.update(out.acceptance_lengths)
    assert max(lengths) == block_size and min(lengths) == 1  # every acceptance length was exercised


def test_stop_tokens_and_max_new_tokens_edges():
    target = make_target("llama", vocab=64)
    draft = make_draft(target, block_size=8)
    p = prompt(7, 6, 64)
    ref = autoregressive_generate(target, p, max_new_tokens=50).new_token_ids
    for max_new in [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 33]:
        out = speculative_generate(target, draft, p, OracleChain(ref, p.shape[1], max_new), max_new_tokens=max_new)
        assert out.new_token_ids == ref[:max_new]
        assert dflash_generate(target, draft, p, max_new_tokens=max_new).new_token_ids == ref[:max_new]
    for stop_pos in [0, 1, 4, 5, 12, 20]:  # the stop token lands at every offset inside a block
        stop = ref[stop_pos]
        expect = ref[: ref.index(stop) + 1]
        got = speculative_generate(target, draft, p, OracleChain(ref, p.shape[1], stop_pos), max_new_tokens=50,
                                   stop_token_ids=[stop]).new_token_ids
        assert got == expect == autoregressive_generate(target, p, 50, stop_token_ids=[stop]).new_token_ids


def test_generated_mask_tokens_are_kept():
    target = make_target("qwen3", vocab=64)
    p = prompt(3, 8, 64)
    ref = autoregressive_generate(target, p, max_new_tokens=40).new_token_ids
    frequent = max(set(ref), key=ref.count)
    draft = make_draft(target, block_size=4, mask_token_id=frequent)
    out = speculative_generate(target, draft, p, OracleChain(ref, p.shape[1], 0), max_new_tokens=40)
    assert frequent in out.new_token_ids and out.new_token_ids == ref
    assert dflash_generate(target, draft, p, max_new_tokens=40).new_token_ids == ref


def test_input_validation_messages():
    target = make_target("llama", vocab=32)
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        autoregressive_generate(target, torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        autoregressive_generate(target, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        autoregressive_generate(target, torch.zeros(1, 3, dtype=torch.long), max_new_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        autoregressive_generate(target, torch.zeros(1, 3, dtype=torch.long), temperature=-0.5)
    with pytest.raises(ValueError, match="needs a drafter"):
        speculative_generate(target, None, torch.zeros(1, 3, dtype=torch.long), Chain())


# ---------------------------------------------------------------------------------------------- T = 1 distribution
def exact_joint(target, p: torch.Tensor, steps: int) -> dict[tuple[int, ...], float]:
    """Exact probability of every sequence of the first `steps` tokens under plain sampling at T = 1."""
    vocab = target.config.vocab_size
    probs = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for seq, pr in probs.items():
            ids = torch.cat([p, torch.tensor([list(seq)], dtype=torch.long)], dim=1)
            with torch.no_grad():
                dist = torch.softmax(target(ids).logits[0, -1].double(), -1)
            for t in range(vocab):
                nxt[seq + (t,)] = pr * float(dist[t])
        probs = nxt
    return probs


def chi_square_p(counts: dict, probs: dict, n: int) -> float:
    """Chi-square goodness of fit, cells with expectation < 5 pooled; returns the p-value."""
    from scipy.stats import chi2

    stat, pooled_obs, pooled_exp, dof = 0.0, 0, 0.0, 0
    for seq, pr in probs.items():
        e, o = pr * n, counts.get(seq, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
        else:
            stat, dof = stat + (o - e) ** 2 / e, dof + 1
    if pooled_exp > 0:
        stat, dof = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, dof + 1
    return float(chi2.sf(stat, dof - 1))


class PeakedChain(BlockPolicy):
    """Proposes the same fixed chain every round (a confident but often wrong drafter)."""

    name, uses_draft = "peaked", True

    def propose(self, block, history):
        return DraftTree.chain(torch.tensor([1, 2, 1, 2][: block.depth]))


def lossy_follow(token_ids, parents, logits, temperature, generator):
    """A deliberately broken walk: accept a draft child whenever the target gives it >= 0.15 probability."""
    path, node = [], 0
    children = {(p + 1, t): i for i, (p, t) in enumerate(zip(parents.tolist(), token_ids.tolist()))}
    while True:
        probs = torch.softmax(logits[node] / temperature, -1)
        for (par, tok), child in children.items():
            if par == node and probs[tok] >= 0.15:
                path.append(child)
                node = child + 1
                break
        else:
            return path, int(torch.multinomial(probs, 1, generator=generator))


def sample_joint(target, draft, p, policy, n, steps=3):
    return answer_counts(sampled_answers(lambda seeds: speculative_generate(
        target, draft, [p] * len(seeds), policy, max_new_tokens=steps, temperature=1.0, seed=seeds[0]), n))


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = make_target("llama", vocab=4, init=0.3, dtype=torch.float32, seed=5)
    draft = make_draft(target, block_size=4, dtype=torch.float32)
    p = prompt(1, 4, 4)
    return target, draft, p, exact_joint(target, p, 3)


N_SAMPLES = 1500


def test_sampling_matches_target_distribution(small_vocab_pair):
    target, draft, p, probs = small_vocab_pair
    for policy in (NoDraft(), Chain(), PeakedChain()):
        counts = sample_joint(target, draft, p, policy, N_SAMPLES)
        assert chi_square_p(counts, probs, N_SAMPLES) > 1e-3, policy.name


def test_broken_acceptance_rule_is_detected(small_vocab_pair, monkeypatch):
    target, draft, p, probs = small_vocab_pair
    monkeypatch.setattr(decoding, "follow", lossy_follow)
    counts = sample_joint(target, draft, p, PeakedChain(), N_SAMPLES)
    assert chi_square_p(counts, probs, N_SAMPLES) < 1e-3
