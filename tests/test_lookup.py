"""Prompt-lookup decoding: the n-gram index against a brute-force scan, and the output equal to plain decoding."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conftest import make_target, prompt
from dflash_core import autoregressive_generate, lookup_generate
from dflash_core.prompt_lookup import NgramIndex, PromptLookup


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


# ---------------------------------------------------------------------------------------------------- in the tree
def test_merge_keeps_the_best_nodes_of_the_union_prefix_closed():
    """Brute force over the union: the merged tree holds the B largest values, each node's parent is in the tree,
    a path both sources propose is one node with the larger value."""
    import math

    from ddtree import build_tree
    from ddtree.lookup import merge_lookup

    token_paths = _paths
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, generator=g) * 2
    full = build_tree(logits, 6 + 36 + 216 + 1296)  # every prefix with its q
    q = {p: math.exp(float(lp)) for p, lp in zip(token_paths(full), full.log_probs)}
    continuation, estimates = [2, 5, 1], [0.9, 0.5, 0.45]
    union = dict(q)
    for k, a in enumerate(estimates, start=1):
        union[tuple(continuation[:k])] = max(union.get(tuple(continuation[:k]), 0.0), a)
    for budget in (1, 3, 8, 20):
        merged, placed, _ = merge_lookup(build_tree(logits, budget), continuation, estimates, budget)
        merged.validate()
        paths = token_paths(merged)
        assert len(paths) == len(set(paths)) == budget
        best = sorted(union.values(), reverse=True)[:budget]
        assert sorted((union[p] for p in paths), reverse=True) == pytest.approx(best)
        assert all(p[:-1] in paths for p in paths if len(p) > 1)
        assert [paths[i] for i in placed] == [tuple(continuation[:k]) for k in range(1, len(placed) + 1)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("budget", [8, "auto"])
def test_ddtree_with_lookup_branches_equals_plain_decoding(temperature, budget, monkeypatch):
    from conftest import make_draft, steady_clocks
    from ddtree import ddtree_generate

    steady_clocks(monkeypatch)  # the rounds' clock: which rounds skip the drafter does not depend on the load
    target = make_target("llama", vocab=8, init=0.3)
    draft = make_draft(target, block_size=5)
    from_lookup = 0
    for seed in range(3):
        p = prompt(70 + seed, 12, 8)
        ref = autoregressive_generate(target, p, 40, temperature=temperature, seed=seed, stop_token_ids=[7])
        got = ddtree_generate(target, draft, p, budget=budget, max_new_tokens=40, temperature=temperature, seed=seed,
                              stop_token_ids=[7], lookup=True, check_trees=True)
        assert got.new_token_ids == ref.new_token_ids
        assert len(got.lookup_tokens) == len(got.acceptance_lengths)
        from_lookup += sum(got.lookup_tokens)
    assert from_lookup > 0
    with pytest.raises(ValueError, match="lookup=True"):
        ddtree_generate(target, draft, prompt(0, 5, 8), budget="chain-auto", lookup=True)


def test_auto_with_lookup_ranks_both_sources_and_learns_from_the_drafters_nodes():
    """Under auto the merged list is sized by auto's rule; auto's memory learns from its drafter nodes only."""
    from ddtree.budget import AutoBudget
    from ddtree.cost import CostModel
    from ddtree.lookup import LookupTreePolicy
    from dflash_core.tree import DraftBlock

    flat = CostModel(nodes=(0, 8, 32), verify_s=(0.01, 0.01, 0.01), fixed_s=0.001)  # verifying is free here
    policy = LookupTreePolicy(AutoBudget(flat, cap=16))
    logits = torch.full((4, 8), -4.0)
    logits[:, 3] = 4.0  # the drafter is sure of token 3 at every depth
    history = [1, 2, 5, 6, 1, 2]  # the suffix (1, 2) occurred before, followed by 5, 6, 1, 2
    tree = policy.propose(DraftBlock(logits, None, history[-1], 8), history).validate(best_first=True)
    paths = {tuple(p) for p in _paths(tree)}
    assert (3, 3, 3, 3) in paths and (5, 6, 1, 2) in paths  # both sources made it into one tree
    paths = _paths(tree)
    path = [paths.index((5,)), paths.index((5, 6))]  # the target accepted two tokens of the continuation
    policy.observe(path)
    assert policy.lookup_committed == [2]
    # auto learns from its own nodes only: (5,) may be a drafter node too (merged), (5, 6) is the lookup's alone
    drafter = policy._drafter_nodes
    assert path[1] not in drafter
    (remembered,) = list(policy.auto.memory)
    assert set(np.flatnonzero(remembered.accepted)) == {drafter[i] for i in path if i in drafter}
    assert len(remembered.accepted) == len(drafter)
    # ... but every accepted token counts in the rate the next rounds are sized against: (5, 6) and the bonus too
    assert remembered.tokens == len(path) + 1 and auto_tokens(policy) == len(path) + 1


def auto_tokens(policy) -> int:
    return policy.auto.memory.tokens


def _paths(tree):
    out = []
    for i in range(len(tree)):
        parent = int(tree.parents[i])
        out.append((out[parent] if parent >= 0 else ()) + (int(tree.token_ids[i]),))
    return out


class FakeClock:
    """A clock whose rounds take ``drafted_s`` with the drafter and ``alone_s`` without it (read by the policy)."""

    def __init__(self, policy, drafted_s: float, alone_s: float) -> None:
        self.policy, self.now, self.drafted_s, self.alone_s = policy, 0.0, drafted_s, alone_s

    def __call__(self) -> float:
        if self.policy._open is not None:  # the round in flight ends now: it took what its kind takes
            self.now += self.alone_s if self.policy._open[2] else self.drafted_s
        return self.now


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_lookup_tree_skips_the_drafter_where_the_continuation_pays_and_stays_exact(temperature):
    from conftest import make_draft
    from ddtree.lookup import LookupTreePolicy
    from dflash_core import speculative_generate

    target = make_target("llama", vocab=8, init=0.3)
    draft = make_draft(target, block_size=5)
    p = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2]])  # a repetitive context: the lookup is reliable
    ref = autoregressive_generate(target, p, 60, temperature=temperature, seed=3)
    cheap = LookupTreePolicy(8)
    cheap.clock = FakeClock(cheap, drafted_s=1.0, alone_s=0.05)  # the drafter pass costs almost the whole round
    got = speculative_generate(target, draft, p, cheap, 60, temperature=temperature, seed=3)
    assert got.new_token_ids == ref.new_token_ids and any(cheap.skipped) and not all(cheap.skipped)
    dear = LookupTreePolicy(8)
    dear.clock = FakeClock(dear, drafted_s=1.0, alone_s=5.0)  # a round without the drafter would cost more
    again = speculative_generate(target, draft, p, dear, 60, temperature=temperature, seed=3)
    assert again.new_token_ids == ref.new_token_ids
    assert sum(dear.skipped) <= 1  # at most the one round priced by the prior before rounds without it were timed
    no_clock = LookupTreePolicy(8)
    speculative_generate(target, draft, p, no_clock, 60, temperature=temperature, seed=3)
    assert not any(no_clock.skipped)  # without a clock every round drafts (replayable)


def test_deep_continuation_cells_take_their_match_lengths_pooled_predictive():
    """Depth 1 keeps its own Beta(1, 1) estimate; a deeper cell never tried is priced at the pooled rate of the
    depths >= 2 that were tried, as the posterior predictive given the depths above it on the path were accepted
    (each accepted depth is one more hit), and a tried cell moves towards its own share. Before any round the
    estimates are 1/2 * 1/k (E[p^(k-1)] under a flat prior), not 2^-k."""
    from ddtree.lookup import LookupTreePolicy

    policy = LookupTreePolicy(8, max_ngram=2, num_tokens=6, prior=False)  # (the corpus prior: its own test)
    policy.counts[2][1] = [9, 10]  # depth 1: 9 of 10 rounds
    policy.counts[2][2] = [17, 18]  # depth 2: 17 of 18; deeper depths never tried
    first = (9 + 1) / (10 + 2)
    second = (17 + policy.PRIOR * (17 + 1) / (18 + 2)) / (18 + policy.PRIOR)
    want = [first, first * second]
    for k in range(3, 7):
        want.append(want[-1] * (17 + 1 + k - 2) / (18 + 2 + k - 2))
    assert policy.estimates(2, 6) == pytest.approx(want)
    assert policy.estimates(1, 4) == pytest.approx([1 / 2, 1 / 4, 1 / 6, 1 / 8])  # nothing learnt for n = 1


def test_a_call_starts_from_what_earlier_calls_on_its_memory_learnt():
    """Under ``auto`` the branches' counts and skip timings live in the policy's memory: a later call prices a
    continuation from them, weighed as ``CARRY`` rounds of depth 1 (proportions kept), where a fresh memory starts
    from the flat prior; a batch's forks bring back what each learnt; a memory refuses another lookup shape; round
    durations are kept in multiples of the curve's ``verify(0)`` (comparable across context lengths)."""
    from ddtree import RoundMemory
    from ddtree.budget import AutoBudget
    from ddtree.cost import CostModel
    from ddtree.lookup import LookupStats, LookupTreePolicy

    curve = CostModel((0, 4, 16), (0.010, 0.011, 0.014), fixed_s=0.010)

    def policy(memory, num_tokens=6):  # from the flat priors alone (the corpus prior: its own test)
        return LookupTreePolicy(AutoBudget(curve, cap=16, memory=memory), max_ngram=2, num_tokens=num_tokens,
                                prior=False)

    memory = RoundMemory()
    first = policy(memory)
    first.counts[2, 1] = [39, 40]  # depth 1: 39 of 40 rounds
    first.counts[2, 2] = [60, 80]
    first._timed[False].append((0.05, 4))
    second = policy(memory)
    w = LookupStats.CARRY / 40
    assert second.counts[2, 1] == pytest.approx([39 * w, 8]) and second.counts[2, 2] == pytest.approx([60 * w, 80 * w])
    assert second.estimates(2, 1) == pytest.approx([(39 * w + 1) / (8 + 2)])
    assert list(second._timed[False]) == [(0.05, 4)]
    assert policy(RoundMemory()).estimates(2, 1) == [0.5]
    ticks = iter([1.0, 1.03])  # a round of 30 ms that committed 3 tokens: 3 steps of this curve's verify(0)
    timed = policy(RoundMemory())
    timed.clock = lambda: next(ticks)
    timed.wants_draft([1, 2, 3])
    timed.wants_draft([1, 2, 3, 4, 5, 6])
    assert list(timed._timed[False]) == [(pytest.approx(3.0), 3)]
    forks = [memory.fork() for _ in range(2)]
    batch = [policy(fork) for fork in forks]
    before = memory.lookup.counts.copy()
    batch[0].counts[1, 1] += [1, 1]
    batch[1].counts[1, 1] += [0, 1]
    memory.absorb(forks)
    assert memory.lookup.counts[1, 1] == pytest.approx(before[1, 1] + [1, 2])
    with pytest.raises(ValueError, match="num_tokens=6"):
        policy(memory, num_tokens=5)


def test_a_fresh_memory_starts_from_the_corpus_prior_weighed_as_carried_rounds():
    """New statistics hold the shipped corpus counts (``lookup_prior.json``) weighed as ``CARRY`` rounds of depth 1
    per match length, proportions kept, so a fresh call prices a three-token match's continuation above a one-token
    match's (the flat priors price both at 1/2); a match length above the file's takes its longest, a depth beyond
    it stays empty; a batch's memory made new keeps the fork's choice; ``prior=False`` starts from nothing."""
    import json

    from ddtree import RoundMemory
    from ddtree.lookup import LookupStats, LookupTreePolicy

    file = np.asarray(json.loads(LookupStats.PRIOR_FILE.read_text())["counts"], dtype=float)
    top, deepest = file.shape[0] - 1, file.shape[1] - 1
    stats = LookupStats(top + 2, deepest + 4)
    for n in range(1, top + 3):
        row = file[min(n, top)]
        assert stats.counts[n, 1, 1] == pytest.approx(LookupStats.CARRY)
        assert stats.counts[n, :deepest + 1] == pytest.approx(row * LookupStats.CARRY / row[1, 1])
    assert not stats.counts[:, deepest + 1:].any() and not stats.counts[0].any()
    fresh = LookupTreePolicy(8, max_ngram=top, num_tokens=deepest)
    first = [fresh.estimates(n, 1)[0] for n in range(1, top + 1)]
    assert first == pytest.approx([(LookupStats.CARRY * file[n, 1, 0] / file[n, 1, 1] + 1) / (LookupStats.CARRY + 2)
                                   for n in range(1, top + 1)])
    assert first[0] < 0.5 < first[-1] and first == sorted(first)
    assert not LookupTreePolicy(8, max_ngram=top, num_tokens=deepest, prior=False).counts.any()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LookupStats, "PRIOR_FILE", LookupStats.PRIOR_FILE.with_name("no_such_prior.json"))
        with pytest.raises(FileNotFoundError, match="prior=False"):
            LookupStats(2, 6)
        assert not LookupStats(2, 6, prior=False).counts.any()
    for prior in (True, False):
        fork_stats = LookupStats(2, 6, prior=prior)
        memory = RoundMemory()
        fork_stats.add_to(memory)
        assert memory.lookup.prior is prior and memory.lookup.counts == pytest.approx(LookupStats(2, 6, prior).counts)


def test_the_skip_rule_decides_on_the_rounds_the_memory_saw_not_on_the_corpus_prior():
    """The corpus prior prices the tree's nodes, but skipping the drafter for a round needs the rounds' own evidence:
    where the prior's promise of a continuation would pay for a skip and the flat priors' would not, a fresh policy
    still drafts; once its own rounds show the continuation holding, it skips."""
    from ddtree.lookup import LookupTreePolicy

    history = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # the suffix 1 2 3 occurred before: a 3-token match, 7 tokens follow
    policy = LookupTreePolicy(8, max_ngram=3, num_tokens=7)
    promised = [1 + sum(policy.estimates(3, 7, seen_only)) for seen_only in (False, True)]
    tokens = (promised[0] + promised[1]) / 2 / policy.SKIP_PRIOR  # drafted rounds: 1 s each, this many tokens
    policy.clock = lambda: 0.0
    policy._timed[False].extend([(1.0, tokens)] * policy.SKIP_WARMUP)
    assert promised[0] > promised[1] and policy.wants_draft(history)  # the prior alone would have skipped
    policy.counts[3, 1:8] += [5, 5]  # five rounds that held through depth 7
    assert not policy.wants_draft(history)


def test_lookup_prior_walk_counts_what_a_brute_force_scan_of_each_round_finds():
    """``experiments.studies.lookup_prior.walk`` against rounds walked with a scan of the context (the index's own
    oracle above): each round takes the latest earlier match's continuation, tests it as far as the sequence goes,
    and moves past the accepted tokens and one more."""
    from experiments.studies.lookup_prior import table, walk

    rng = random.Random(7)
    sequences = [([rng.randrange(4) for _ in range(rng.randrange(5, 60))], rng.randrange(1, 5)) for _ in range(40)]
    want = np.zeros((4, 7, 2))
    for ids, start in sequences:
        t = start
        while t < len(ids):
            n, continuation = _brute_force(ids[:t], 3, 6)
            accepted = 0
            if n and continuation:
                reach = min(len(continuation), len(ids) - t)
                while accepted < reach and continuation[accepted] == ids[t + accepted]:
                    accepted += 1
                for k in range(1, min(reach, accepted + 1) + 1):
                    want[n, k] += [k <= accepted, 1]
            t += accepted + 1
    got = walk(sequences, max_ngram=3, num_tokens=6)
    assert want[:, 1, 1].sum() > 100 and (want[:, 2:, 0] > 0).any()  # the walk tested deep continuations
    np.testing.assert_array_equal(got.counts, want)
    record = table(got, {})
    assert record["counts"] == want.astype(int).tolist() and record["max_ngram"] == 3 and record["num_tokens"] == 6


def test_lookup_statistics_carry_over_calls_and_come_back_from_a_batch(monkeypatch):
    """On the loop: a call with ``memory=`` leaves what its continuations did in ``memory.lookup``; a batch on the
    same memory decodes plain decoding's tokens and gives back what its sequences' forks tried."""
    from conftest import make_draft, steady_clocks
    from ddtree import RoundMemory, ddtree_generate

    steady_clocks(monkeypatch)
    target = make_target("llama", vocab=8, init=0.3)  # a small vocabulary: the output repeats, lookups hit
    draft = make_draft(target, block_size=5)
    prompts = [prompt(80 + seed, 12, 8) for seed in range(2)]
    memory = RoundMemory()
    ddtree_generate(target, draft, prompts[0], budget="auto", lookup=True, memory=memory, max_new_tokens=30,
                    stop_token_ids=[7])
    first = memory.lookup.counts.copy()
    assert first[:, 1, 1].sum() > 0  # the call tried continuations, and its memory holds them
    refs = [autoregressive_generate(target, p, 30, stop_token_ids=[7]).new_token_ids for p in prompts]
    got = ddtree_generate(target, draft, prompts, budget="auto", lookup=True, memory=memory, max_new_tokens=30,
                          stop_token_ids=[7])
    assert [g.new_token_ids for g in got] == refs
    assert (memory.lookup.counts >= first).all() and memory.lookup.counts[:, 1, 1].sum() > first[:, 1, 1].sum()


def _cycling_target(vocab: int = 16, hidden: int = 32):
    """A tiny Llama that mostly continues a fixed cycle of its vocabulary (next token = (t + 5) mod vocab): one-hot
    embeddings, the layers' outputs scaled down, an LM head that maps each token to the next in the cycle; a context
    that holds the cycle is then continued as far as a lookup reaches."""
    target = make_target("llama", vocab=vocab, hidden=hidden, init=0.2)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
        target.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        target.lm_head.weight.zero_()
        for t in range(vocab):
            target.lm_head.weight[(t + 5) % vocab, t] = 3.0
    return target


@pytest.mark.parametrize("budget", [48, "auto"])
def test_lookup_branches_run_past_the_drafters_block_and_stay_exact(budget, monkeypatch):
    """A drafter of block 5 drafts trees at most 4 deep, and the continuation used to stop at 10 tokens. On a
    context the target continues, the continuation now goes deeper in the same tree (it needs no drafter row):
    rounds commit more than 11 tokens, ``auto`` included (its learnt estimates price the deep nodes), and the
    output is the target's."""
    from conftest import make_draft, steady_clocks
    from ddtree import ddtree_generate

    steady_clocks(monkeypatch)
    target = _cycling_target()
    draft = make_draft(target, block_size=5)
    p = torch.tensor([[(5 * i) % 16 for i in range(40)]])
    ref = autoregressive_generate(target, p, 120)
    assert ref.new_token_ids[:32] == [(5 * i) % 16 for i in range(40, 72)]  # the target does continue the cycle
    got = ddtree_generate(target, draft, p, budget=budget, max_new_tokens=120, lookup=True, check_trees=True,
                          trace=True)
    assert got.new_token_ids == ref.new_token_ids
    assert max(int(t.depths.max()) for t in got.trees if len(t)) > 10
    assert max(got.acceptance_lengths) > 11
