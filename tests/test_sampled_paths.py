"""Paths at T > 0 that no other test ran end to end: ``auto`` and ``chain-auto``, and a drafter with a reduced
draft vocabulary (compact logits) for chains, top-K trees and sampled trees.

Top-K trees and chains draw each committed token from the target as plain decoding does (one draw per committed
token, same generator), so with the same seed they reproduce plain sampling token for token; sampled trees draw
differently and are checked by a chi-square test against the exact joint instead.
"""

from __future__ import annotations

import torch

from conftest import make_draft, make_target, prompt, steady_clocks
from ddtree import ddtree_generate, make_policy
from ddtree.cost import CostModel
from dflash_core import Chain, autoregressive_generate, dflash_generate, speculative_generate
from greedy_reference import exact_joint
from test_decoding import chi_square_p

FLAT = CostModel((0, 8, 32), (0.010, 0.010, 0.011), 0.004)  # verifying is nearly free: auto grows its trees


def test_auto_and_chain_auto_reproduce_plain_sampling(monkeypatch):
    steady_clocks(monkeypatch)  # budget="auto" below times its rounds: a ticking clock, not the machine's load
    target = make_target("qwen3", vocab=16, init=0.5)
    draft = make_draft(target, block_size=5)
    grown = 0
    for temperature in (0.6, 1.0, 1.7):
        for seed in range(2):
            p = prompt(60 + seed, 6, 16)
            ref = autoregressive_generate(target, p, 30, temperature=temperature, seed=seed).new_token_ids
            for budget in ("auto", "chain-auto"):
                policy = make_policy(budget, target, draft, temperature=temperature, cost=FLAT, cap=16,
                                     online=False)
                out = ddtree_generate(target, draft, p, max_new_tokens=30, temperature=temperature, seed=seed,
                                      policy=policy)
                assert out.new_token_ids == ref, (budget, temperature, seed)
                grown += max(out.tree_sizes) > 1
            if seed == 0:  # the public path, its measured curve and online correction included
                assert ddtree_generate(target, draft, p, budget="auto", max_new_tokens=30, temperature=temperature,
                                       seed=seed).new_token_ids == ref
    assert grown == 12  # every run verified more than one node in some round


def test_compact_draft_vocabulary_at_temperature_reproduces_plain_sampling():
    """The loop hands policies compact logits over 32 even ids; the chain (DFlash's policy) and top-K trees map
    their columns back to target ids. The output alone cannot see a lost id map (any draft is verified losslessly),
    so the traced proposals must hold draft-vocabulary ids only: a tree that kept column indices holds odd ids."""
    target = make_target("llama", vocab=64)
    draft = make_draft(target, block_size=5)
    vocab = torch.arange(0, 64, 2)
    draft.set_draft_vocab(vocab)  # the loop hands policies logits over these 32 ids only
    proposed: set[int] = set()
    for temperature in (0.6, 1.3):
        for seed in range(2):
            ids = prompt(seed, 10, 64)
            plain = autoregressive_generate(target, ids, 24, temperature=temperature, seed=seed).new_token_ids
            assert dflash_generate(target, draft, ids, 24, temperature=temperature, seed=seed).new_token_ids == plain
            chain = speculative_generate(target, draft, ids, Chain(), 24, temperature, seed=seed, trace=True)
            assert chain.new_token_ids == plain
            runs = [chain]
            for budget in (4, 16):
                runs.append(ddtree_generate(target, draft, ids, budget=budget, max_new_tokens=24,
                                            temperature=temperature, seed=seed, trace=True))
                assert runs[-1].new_token_ids == plain
            for run in runs:
                for tree in run.trees:
                    proposed.update(tree.token_ids.tolist())
    assert len(proposed) > 8 and proposed <= set(vocab.tolist())  # target ids of the draft vocabulary only


N_SAMPLED = 400


def test_sampled_tree_over_a_draft_vocabulary_samples_the_target():
    """A drafter scoring 3 of 4 tokens: ``tree="sampled"`` maps its compact columns to target ids (token 2 can only
    come from the residual), and the first three tokens follow plain sampling at T = 0.8."""
    target = make_target("qwen3", vocab=4, layers=2, init=0.3, dtype=torch.float32, seed=7)
    draft = make_draft(target, block_size=4, dtype=torch.float32)
    draft.set_draft_vocab(torch.tensor([1, 0, 3]))
    p = prompt(2, 4, 4)
    counts: dict[tuple, int] = {}
    nodes = set()
    for seed in range(N_SAMPLED):
        out = ddtree_generate(target, draft, p, budget=5, max_new_tokens=3, temperature=0.8, seed=seed,
                              tree="sampled", trace=seed < 50)
        counts[tuple(out.new_token_ids)] = counts.get(tuple(out.new_token_ids), 0) + 1
        for tree in out.trees or ():
            nodes.update(tree.token_ids.tolist())
    assert nodes == {0, 1, 3}  # the trees hold target ids of the draft vocabulary only
    assert chi_square_p(counts, exact_joint(target, p, 3, 0.8), N_SAMPLED) > 1e-3
