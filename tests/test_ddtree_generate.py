"""DDTree end to end: tree attention oracle, KV compaction, losslessness (greedy and sampled)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import dflash_core.decoding as decoding
from conftest import answer_counts, forward_one, make_draft, make_target, prompt, record_masks, sampled_answers
from ddtree import DraftTree, build_tree, ddtree_generate
from dflash_core import BlockPolicy, autoregressive_generate, dflash_generate, speculative_generate
from dflash_core.target import TargetAdapter
from dflash_core.decoding import LiveModels
from test_decoding import chi_square_p, exact_joint, lossy_follow


# ---------------------------------------------------------------------------------------------- tree attention
def _live(target, length=9, seed=0):
    """The loop's live models for one prompt of ``length`` tokens, prefilled as the loop prefills."""
    adapter = TargetAdapter(target, (0, 2))
    p = prompt(seed, length, target.config.vocab_size)
    return adapter, LiveModels.prefilled(adapter, None, [p])[0], p[0]


def _root_path(tree: DraftTree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return path[::-1]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_attention_equals_causal_forward_over_each_root_path(family):
    """The loop's verify step: every node's logits and features equal a causal forward over its root path alone."""
    target = make_target(family, vocab=48, dtype=torch.float32)
    adapter, models, p = _live(target)
    start = len(p)
    tree = build_tree(torch.randn(5, 48, generator=torch.Generator().manual_seed(3)) * 2, 24)
    assert tree.max_depth >= 3 and len(set(tree.depths.tolist())) >= 3
    base = copy.deepcopy(models.cache)
    logits = models.verify([0], [tree], [7])[0]  # [n+1, V]
    features = models._features[0]
    for node in [-1] + list(range(len(tree))):
        path = _root_path(tree, node) if node >= 0 else []
        seq = torch.tensor([7] + [int(tree.token_ids[i]) for i in path])
        ref_logits, ref_features = forward_one(adapter, seq, start + torch.arange(len(seq)), copy.deepcopy(base))
        torch.testing.assert_close(logits[node + 1], ref_logits[-1], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(features[node + 1], ref_features[-1], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_compaction_equals_fresh_forward_over_committed_tokens(family):
    """The loop's commit step keeps exactly the root and a non-contiguous accepted path: the cache then equals a
    fresh forward over the committed tokens."""
    target = make_target(family, vocab=48, dtype=torch.float64)
    adapter, models, p = _live(target)
    tree = build_tree(torch.randn(4, 48, generator=torch.Generator().manual_seed(5)) * 2, 25)
    deepest = int(torch.argmax(tree.depths))
    path = _root_path(tree, deepest)
    assert path != list(range(len(path)))  # a non-contiguous selection is exercised
    models.verify([0], [tree], [3])
    models.commit([0], [path], [[]])
    cache, fresh = models.cache, adapter.new_cache()
    committed = torch.cat([p, torch.tensor([3] + [int(tree.token_ids[i]) for i in path])])
    forward_one(adapter, committed, torch.arange(len(committed)), fresh)
    assert cache.get_seq_length() == len(committed) == models.lengths[0]
    for got, want in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(got.keys, want.keys)
        torch.testing.assert_close(got.values, want.values)


# ---------------------------------------------------------------------------------------------- greedy losslessness
class OracleTree(BlockPolicy):
    """Test policy: a real best-first tree over logits in which the AR continuation is planted at random ranks.

    Depth d's reference token gets rank 0, 1 or 2 (or is left at its random rank), so the walk accepts paths through
    first and later siblings and the compaction keeps non-contiguous entries.
    """

    name, uses_draft = "oracle-tree", True

    def __init__(self, reference: list[int], prompt_len: int, budget: int, seed: int) -> None:
        self.reference, self.prompt_len, self.budget = reference, prompt_len, budget
        self.rng = random.Random(seed)

    def propose(self, block, history):
        logits = block.full_logits().clone()
        pos = len(history) - self.prompt_len
        for d in range(logits.shape[0]):
            if pos + d >= len(self.reference) or self.rng.random() < 0.15:
                continue
            row = logits[d]
            top = torch.sort(row, descending=True).values
            rank = self.rng.choice([0, 0, 1, 2])
            row[self.reference[pos + d]] = top[rank] + (1.0 if rank == 0 else -1e-3)
        return build_tree(logits, self.budget)


class MaskedChain(DraftTree):
    """A chain that does not say it is one: the loop verifies it under its ancestor mask."""

    @property
    def is_chain(self) -> bool:
        return False


def MaskedProposal(tree: DraftTree) -> MaskedChain:
    return MaskedChain(tree.token_ids, tree.parents, tree.depths, tree.log_probs)


class ChainAsTree(BlockPolicy):
    """The DFlash chain verified through the tree mask instead of the causal path (``wrap``: the chain a policy
    proposes, e.g. an oracle's; default the drafter's top-1 chain)."""

    name, uses_draft = "chain-as-tree", True

    def __init__(self, wrap=None) -> None:
        self.wrap = wrap

    def propose(self, block, history):
        if self.wrap is not None:
            return MaskedProposal(self.wrap.propose(block, history))
        logp = torch.log_softmax(block.full_logits().float(), -1)
        best, tokens = logp.max(-1)
        n = len(tokens)
        return MaskedProposal(DraftTree(tokens, torch.arange(-1, n - 1), torch.arange(1, n + 1), best.cumsum(0)))


@pytest.mark.parametrize("budget", [1, 2, 7, 32, 100])
def test_ddtree_greedy_equals_autoregressive(family, budget):
    target = make_target(family, vocab=64)
    draft = make_draft(target, block_size=6)
    lengths = []
    for seed in range(3):
        p = prompt(200 + seed, 4 + 3 * seed, 64)
        ref = autoregressive_generate(target, p, max_new_tokens=48).new_token_ids
        assert ddtree_generate(target, draft, p, budget=budget, max_new_tokens=48, seed=seed).new_token_ids == ref
        out = ddtree_generate(target, draft, p, max_new_tokens=48, seed=seed,
                              policy=OracleTree(ref, p.shape[1], budget, seed))
        assert out.new_token_ids == ref
        assert all(size <= budget for size in out.tree_sizes)
        lengths += out.acceptance_lengths
    assert max(lengths) >= (4 if budget >= 32 else 3 if budget >= 7 else 2)  # deep paths were accepted, not just bonus tokens


def test_ddtree_stop_tokens_and_max_new_tokens_edges():
    target = make_target("qwen3", vocab=64)
    draft = make_draft(target, block_size=8)
    p = prompt(9, 6, 64)
    ref = autoregressive_generate(target, p, max_new_tokens=50).new_token_ids
    for max_new in [0, 1, 2, 5, 8, 9, 17, 31]:
        out = ddtree_generate(target, draft, p, max_new_tokens=max_new, policy=OracleTree(ref, p.shape[1], 16, max_new))
        assert out.new_token_ids == ref[:max_new]
    for stop_pos in [0, 1, 3, 6, 7, 15]:
        stop = ref[stop_pos]
        expect = ref[: ref.index(stop) + 1]
        out = ddtree_generate(target, draft, p, max_new_tokens=50, stop_token_ids=[stop],
                              policy=OracleTree(ref, p.shape[1], 16, stop_pos))
        assert out.new_token_ids == expect


def test_chain_policy_equals_dflash_exactly(family, monkeypatch):
    """A chain verified under the tree mask gives DFlash's tokens and acceptance lengths (the causal path), with
    real acceptance (an oracle chain that is corrupted at a random depth), and the reference's tokens."""
    from greedy_reference import greedy_reference
    from test_decoding import OracleChain

    masked = record_masks(monkeypatch)
    target = make_target(family, vocab=16, init=0.5)
    draft = make_draft(target, block_size=4)
    longest = 0
    for seed in range(3):
        p = prompt(300 + seed, 5, 16)
        ref = greedy_reference(target, p, 40)
        causal = dflash_generate(target, draft, p, max_new_tokens=40, seed=seed)
        masked.clear()
        chain = ddtree_generate(target, draft, p, max_new_tokens=40, seed=seed, policy=ChainAsTree())
        assert any(masked) and chain.new_token_ids == causal.new_token_ids == ref
        assert chain.acceptance_lengths == causal.acceptance_lengths
        oracle = lambda: OracleChain(ref, p.shape[1], seed)  # noqa: E731
        masked.clear()
        via_mask = speculative_generate(target, draft, p, ChainAsTree(oracle()), max_new_tokens=40)
        assert sum(masked) == len(via_mask.acceptance_lengths)  # every round's verify forward took the mask
        via_causal = speculative_generate(target, draft, p, oracle(), max_new_tokens=40)
        assert via_mask.new_token_ids == via_causal.new_token_ids == ref
        assert via_mask.acceptance_lengths == via_causal.acceptance_lengths
        longest = max(longest, *via_mask.acceptance_lengths)
    assert longest == 4  # whole blocks were accepted through the mask


def test_trace_and_round_statistics():
    target = make_target("llama", vocab=64)
    draft = make_draft(target, block_size=4)
    out = ddtree_generate(target, draft, prompt(1, 5, 64), budget=10, max_new_tokens=12, trace=True)
    assert len(out.trees) == len(out.acceptance_lengths) == len(out.tree_sizes) == len(out.expected_acceptance)
    assert all(isinstance(t, DraftTree) and len(t) == s for t, s in zip(out.trees, out.tree_sizes))
    assert all(1.0 <= e <= 1 + s for e, s in zip(out.expected_acceptance, out.tree_sizes))
    with pytest.raises(ValueError, match="budget"):
        ddtree_generate(target, draft, prompt(1, 5, 64), budget=-3)
    with pytest.raises(ValueError, match="unknown budget policy"):
        ddtree_generate(target, draft, prompt(1, 5, 64), budget="wide")


# ---------------------------------------------------------------------------------------------- T = 1
class PeakedTree(BlockPolicy):
    """A confident, often wrong drafter: the same peaked logits every round, turned into a best-first tree."""

    name, uses_draft = "peaked-tree", True

    def propose(self, block, history):
        logits = torch.full_like(block.full_logits(), -4.0)
        logits[:, 1] = 2.0
        logits[:, 2] = 1.0
        return build_tree(logits, 6)


N_SAMPLES = 1200


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = make_target("qwen3", vocab=4, init=0.3, dtype=torch.float32, seed=7)
    draft = make_draft(target, block_size=4, dtype=torch.float32)
    p = prompt(2, 4, 4)
    return target, draft, p, exact_joint(target, p, 3)


def _joint(target, draft, p, policy):
    return answer_counts(sampled_answers(lambda seeds: speculative_generate(
        target, draft, [p] * len(seeds), policy, max_new_tokens=3, temperature=1.0, seed=seeds[0]), N_SAMPLES))


def test_tree_sampling_matches_target_distribution(small_vocab_pair):
    target, draft, p, probs = small_vocab_pair
    assert chi_square_p(_joint(target, draft, p, PeakedTree()), probs, N_SAMPLES) > 1e-3


def test_broken_tree_walk_is_detected(small_vocab_pair, monkeypatch):
    target, draft, p, probs = small_vocab_pair
    monkeypatch.setattr(decoding, "follow", lossy_follow)
    assert chi_square_p(_joint(target, draft, p, PeakedTree()), probs, N_SAMPLES) < 1e-3


def test_the_readme_policy_example_runs_and_is_lossless():
    """The README's "Your own policy" block, run on a tiny fp64 pair: a valid best-first tree every round, and the
    output of plain decoding."""
    import re
    from pathlib import Path

    from conftest import make_draft, make_target, prompt, record_masks
    from dflash_core import autoregressive_generate

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Your own policy", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    target = make_target("llama", vocab=16, init=0.3)
    draft = make_draft(target, block_size=5)
    ids = prompt(5, 7, 16)
    scope = {"target": target, "draft": draft, "ids": ids}
    exec(compile(code, "README.md", "exec"), scope)
    res = scope["res"]
    assert res.new_token_ids == autoregressive_generate(target, ids, 64).new_token_ids
    from dflash_core import DraftBlock

    tree = scope["ChainWithAlternatives"]().propose(DraftBlock(torch.randn(4, 16), None, 2, 16), [1, 2])
    tree.validate()
    assert len(tree) == 8 and int(tree.depths.max()) == 4
