"""A batch of prompts through the one decode loop: every sequence commits exactly what it commits alone.

Oracles: the independent cache-free greedy reference (tests/greedy_reference.py) and each prompt decoded alone.
Batches of 1, 2, 4 and 8 prompts of mixed lengths and mixed stop positions, with plain decoding, chains, fixed
budgets (drafter trees and oracle trees that accept deep, non-contiguous paths), ``auto`` and lookup branches; at
T = 1 each sequence reproduces its solo run with seed + b and passes a chi-square test against the exact joint.
Broken variants (one sequence's path kept in another's cache, one shared position offset, a padding slot left
visible) must fail the same checks.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conftest import make_draft, make_target, prompt
from ddtree import build_tree, ddtree_generate
from dflash_core import decoding
from dflash_core.decoding import LiveModels, autoregressive_generate, dflash_generate, speculative_generate
from dflash_core.tree import BlockPolicy, Chain
from greedy_reference import exact_joint, greedy_reference
from test_decoding import chi_square_p, lossy_follow

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
LENGTHS = [3, 17, 8, 25, 5, 12, 30, 9]  # mixed prompt lengths; batch b uses the first b


class PlantedTree(BlockPolicy):
    """A best-first tree over the drafter's logits with the sequence's reference continuation planted at ranks 0-2
    (sometimes not at all), so the walk accepts deep paths through first and later siblings: the commit keeps
    non-contiguous cache entries, different ones in every sequence."""

    name = "planted"

    def __init__(self, reference: list[int], prompt_len: int, budget: int, seed: int) -> None:
        self.reference, self.prompt_len, self.budget = reference, prompt_len, budget
        self.rng = random.Random(seed)

    def propose(self, block, history):
        logits = block.full_logits().clone()
        pos = len(history) - self.prompt_len
        for d in range(logits.shape[0]):
            if pos + d >= len(self.reference) or self.rng.random() < 0.15:
                continue
            top = torch.sort(logits[d], descending=True).values
            rank = self.rng.choice([0, 0, 1, 2])
            logits[d, self.reference[pos + d]] = top[rank] + (1.0 if rank == 0 else -1e-3)
        return build_tree(logits, self.budget)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request):
    target = make_target(request.param, vocab=VOCAB, dtype=torch.float32)
    draft = make_draft(target, block_size=5, dtype=torch.float32)
    prompts = [prompt(10 + b, n, VOCAB) for b, n in enumerate(LENGTHS)]
    max_new = 24
    plain = [greedy_reference(target, p, max_new) for p in prompts]
    # a stop token that ends the sequences at as many different positions as possible (and some not at all)
    def ends(token):
        return [r.index(token) + 1 if token in r else max_new for r in plain]

    stop = max(range(VOCAB), key=lambda t: (max_new in ends(t), len(set(ends(t)))))
    stopped = [greedy_reference(target, p, max_new, [stop]) for p in prompts]
    return target, draft, prompts, max_new, stop, stopped


def _methods(target, draft, prompts, max_new, stops):
    references = [greedy_reference(target, p, max_new, stops) for p in prompts]
    planted = [PlantedTree(r, int(p.shape[1]), 8, seed=b) for b, (r, p) in enumerate(zip(references, prompts))]
    return {
        "plain": lambda: autoregressive_generate(target, prompts, max_new, stop_token_ids=stops),
        "chain": lambda: dflash_generate(target, draft, prompts, max_new, stop_token_ids=stops),
        "fixed-32": lambda: ddtree_generate(target, draft, prompts, budget=32, max_new_tokens=max_new,
                                            stop_token_ids=stops),
        "planted-8": lambda: speculative_generate(target, draft, prompts, planted, max_new, stop_token_ids=stops),
        "auto": lambda: ddtree_generate(target, draft, prompts, budget="auto", max_new_tokens=max_new,
                                        stop_token_ids=stops),
        "lookup": lambda: ddtree_generate(target, draft, prompts, budget=8, lookup=True, max_new_tokens=max_new,
                                          stop_token_ids=stops),
    }


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_every_sequence_of_a_batch_equals_the_greedy_reference(pair, size):
    target, draft, prompts, max_new, stop, stopped = pair
    prompts, references = prompts[:size], stopped[:size]
    for name, run in _methods(target, draft, prompts, max_new, [stop]).items():
        results = run()
        assert len(results) == size, name
        for b, (result, reference) in enumerate(zip(results, references)):
            assert result.new_token_ids == reference, (name, size, b)
            assert sum(result.acceptance_lengths) + 1 == len(reference), (name, b)
    if size == 8:  # the stop token ends some sequences early and not others: mixed stop positions were covered
        assert len({len(r) for r in references}) > 2 and any(r[-1] == stop for r in references)
        assert any(len(r) == max_new for r in references)


def test_a_batch_equals_each_prompt_decoded_alone_and_accepts_deep_paths(pair, monkeypatch):
    target, draft, prompts, max_new, stop, _ = pair
    references = [greedy_reference(target, p, max_new) for p in prompts]
    kept = []
    real = LiveModels.commit

    def spy(self, seqs, paths, committed):
        kept.extend(paths)
        return real(self, seqs, paths, committed)

    monkeypatch.setattr(LiveModels, "commit", spy)
    planted = [PlantedTree(r, int(p.shape[1]), 16, seed=b) for b, (r, p) in enumerate(zip(references, prompts))]
    together = speculative_generate(target, draft, prompts, planted, max_new)
    assert any(path != list(range(len(path))) for path in kept)  # accepted paths through later siblings
    planted = [PlantedTree(r, int(p.shape[1]), 16, seed=b) for b, (r, p) in enumerate(zip(references, prompts))]
    alone = [speculative_generate(target, draft, p, policy, max_new) for p, policy in zip(prompts, planted)]
    for t, a, r in zip(together, alone, references):
        assert t.new_token_ids == a.new_token_ids == r
        assert t.acceptance_lengths == a.acceptance_lengths  # the same trees, the same walks
    assert max(max(r.acceptance_lengths) for r in together) >= 3  # two draft tokens and the bonus


def test_padded_ids_with_an_attention_mask_equal_the_list_left_or_right(pair):
    target, draft, prompts, max_new, _, _ = pair
    prompts = prompts[:4]
    width = max(int(p.shape[1]) for p in prompts)
    expected = [r.new_token_ids for r in dflash_generate(target, draft, prompts, 12)]
    for side in ("left", "right"):
        ids = torch.full((4, width), 7, dtype=torch.long)
        mask = torch.zeros(4, width, dtype=torch.long)
        for b, p in enumerate(prompts):
            n = int(p.shape[1])
            span = slice(width - n, width) if side == "left" else slice(0, n)
            ids[b, span], mask[b, span] = p[0], 1
        got = dflash_generate(target, draft, ids, 12, attention_mask=mask)
        assert [r.new_token_ids for r in got] == expected, side


def test_sampling_in_a_batch_reproduces_each_solo_run_with_its_seed():
    target = make_target("llama", vocab=VOCAB)  # float64: no draw sits on a rounding boundary
    draft = make_draft(target, block_size=4)
    prompts = [prompt(40 + b, n, VOCAB) for b, n in enumerate([4, 11, 7])]
    for budget, tree in (("chain", "topk"), (8, "topk"), (8, "sampled")):
        together = ddtree_generate(target, draft, prompts, budget=budget, max_new_tokens=16, temperature=1.0, seed=5,
                                   tree=tree)
        for b, p in enumerate(prompts):
            alone = ddtree_generate(target, draft, p, budget=budget, max_new_tokens=16, temperature=1.0, seed=5 + b,
                                    tree=tree)
            assert together[b].new_token_ids == alone.new_token_ids, (budget, tree, b)
    together = autoregressive_generate(target, prompts, max_new_tokens=16, temperature=1.0, seed=5)
    for b, p in enumerate(prompts):
        alone = autoregressive_generate(target, p, max_new_tokens=16, temperature=1.0, seed=5 + b)
        assert together[b].new_token_ids == alone.new_token_ids, ("plain", b)
    same = ddtree_generate(target, draft, [prompts[0]] * 3, budget=8, max_new_tokens=16, temperature=1.0)
    assert len({tuple(r.new_token_ids) for r in same}) > 1  # one prompt thrice: three different samples


class PeakedTree(BlockPolicy):
    """A confident, often wrong drafter: the same peaked tree every round."""

    name = "peaked"

    def propose(self, block, history):
        logits = torch.full_like(block.full_logits(), -4.0)
        logits[:, 1], logits[:, 2] = 2.0, 1.0
        return build_tree(logits, 6)


CALLS = 500


def _batched_joint(target, draft, prompts):
    counts = [{} for _ in prompts]
    for call in range(CALLS):
        results = speculative_generate(target, draft, prompts, PeakedTree(), max_new_tokens=3, temperature=1.0,
                                       seed=call * len(prompts))
        for b, r in enumerate(results):
            counts[b][tuple(r.new_token_ids)] = counts[b].get(tuple(r.new_token_ids), 0) + 1
    return counts


@pytest.fixture(scope="module")
def small_vocab():
    target = make_target("qwen3", vocab=4, init=0.3, dtype=torch.float32, seed=7)
    draft = make_draft(target, block_size=4, dtype=torch.float32)
    prompts = [prompt(2, 4, 4), prompt(3, 7, 4), prompt(2, 4, 4)]  # two different prompts, one of them twice
    return target, draft, prompts, [exact_joint(target, p, 3) for p in prompts]


def test_sampling_in_a_batch_matches_each_sequences_distribution(small_vocab):
    target, draft, prompts, joints = small_vocab
    for b, (counts, probs) in enumerate(zip(_batched_joint(target, draft, prompts), joints)):
        assert chi_square_p(counts, probs, CALLS) > 1e-3, b


def test_a_broken_walk_in_a_batch_is_detected(small_vocab, monkeypatch):
    target, draft, prompts, joints = small_vocab
    monkeypatch.setattr(decoding, "follow", lossy_follow)
    pooled = [chi_square_p(c, p, CALLS) for c, p in zip(_batched_joint(target, draft, prompts), joints)]
    assert min(pooled) < 1e-3


# ---------------------------------------------------------------------------------------------- broken variants
def _planted_batch(target, draft, prompts, max_new):
    references = [greedy_reference(target, p, max_new) for p in prompts]
    planted = [PlantedTree(r, int(p.shape[1]), 8, seed=b) for b, (r, p) in enumerate(zip(references, prompts))]
    results = speculative_generate(target, draft, prompts, planted, max_new)
    return [r.new_token_ids for r in results], references


def test_a_path_kept_in_another_sequences_cache_is_caught(pair, monkeypatch):
    target, draft, prompts, max_new, _, _ = pair
    real = LiveModels.commit

    def swapped(self, seqs, paths, committed):  # sequence b's cache keeps sequence b+1's accepted path
        return real(self, seqs, paths[1:] + paths[:1] if len(paths) > 1 else paths, committed)

    monkeypatch.setattr(LiveModels, "commit", swapped)
    got, references = _planted_batch(target, draft, prompts[:4], max_new)
    assert got != references


def test_one_shared_position_offset_is_caught(pair, monkeypatch):
    target, draft, prompts, max_new, _, _ = pair
    real = decoding.tree_inputs
    shared = {}

    def first_start(proposal, root, start):  # every sequence placed at the first sequence's length
        shared.setdefault("start", start)
        ids, positions, visibility = real(proposal, root, start)
        return ids, positions - start + shared["start"], visibility

    real_verify = LiveModels.verify

    def verify(self, seqs, proposals, roots):
        shared.clear()
        return real_verify(self, seqs, proposals, roots)

    monkeypatch.setattr(decoding, "tree_inputs", first_start)
    monkeypatch.setattr(LiveModels, "verify", verify)
    got, references = _planted_batch(target, draft, prompts[:4], max_new)
    assert got != references


def test_a_visible_padding_slot_is_caught(pair, monkeypatch):
    target, draft, prompts, max_new, _, _ = pair
    from dflash_core.target import TargetAdapter

    forward = TargetAdapter.forward

    def leaky(self, token_ids, position_ids, cache, visible, rows, with_features=True):
        if visible is None:  # the prefill: causal, nothing cached yet
            return forward(self, token_ids, position_ids, cache, visible, rows, with_features)
        visible = visible.clone()
        visible[..., : visible.shape[-1] - token_ids.shape[1]] = True  # every cached slot, leftovers included
        return forward(self, token_ids, position_ids, cache, visible, rows, with_features)

    monkeypatch.setattr(TargetAdapter, "forward", leaky)
    got, references = _planted_batch(target, draft, prompts[:4], max_new)
    assert got != references


# ---------------------------------------------------------------------------------------------- the batch's shape
def test_one_drafter_pass_and_one_target_forward_per_round_and_finished_sequences_leave(pair, monkeypatch):
    target, draft, prompts, max_new, stop, stopped = pair
    drafter_batches, verify_batches = [], []
    real_draft = type(draft).forward

    def counting_draft(self, block_embeds, *args, **kwargs):
        drafter_batches.append(block_embeds.shape[0])
        return real_draft(self, block_embeds, *args, **kwargs)

    from dflash_core.target import TargetAdapter

    real_forward = TargetAdapter.forward

    def counting_forward(self, token_ids, *args, **kwargs):
        verify_batches.append(token_ids.shape[0])
        return real_forward(self, token_ids, *args, **kwargs)

    monkeypatch.setattr(type(draft), "forward", counting_draft)
    monkeypatch.setattr(TargetAdapter, "forward", counting_forward)
    results = dflash_generate(target, draft, prompts, max_new, stop_token_ids=[stop])
    assert [r.new_token_ids for r in results] == stopped
    rounds = max(len(r.acceptance_lengths) for r in results)
    assert len(drafter_batches) == rounds and len(verify_batches) == rounds + 1  # + the prefill
    assert verify_batches[0] == 8 and drafter_batches == verify_batches[1:]  # every active sequence drafts
    assert verify_batches == sorted(verify_batches, reverse=True) and verify_batches[-1] < 8  # finished ones left
    active = [sum(len(r.acceptance_lengths) > k for r in results) for k in range(rounds)]
    assert drafter_batches == active


def test_a_drafter_with_causal_layers_drafts_each_sequence_alone_and_stays_exact(pair):
    target, _, prompts, max_new, _, _ = pair
    draft = make_draft(target, block_size=5, dtype=torch.float32)
    draft.layers[0].self_attn.causal = True
    results = ddtree_generate(target, draft, prompts[:3], budget=8, max_new_tokens=max_new)
    assert [r.new_token_ids for r in results] == [greedy_reference(target, p, max_new) for p in prompts[:3]]


def test_a_batch_refuses_bad_input_with_a_message():
    target = make_target("llama", vocab=VOCAB)
    draft = make_draft(target)
    p = prompt(1, 5, VOCAB)
    with pytest.raises(ValueError, match="empty"):
        autoregressive_generate(target, [], 4)
    with pytest.raises(ValueError, match="prompt 1 of the batch"):
        autoregressive_generate(target, [p, torch.zeros(1, 0, dtype=torch.long)], 4)
    with pytest.raises(ValueError, match="contiguous"):
        autoregressive_generate(target, torch.ones(2, 4, dtype=torch.long), 4,
                                attention_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="shape"):
        autoregressive_generate(target, torch.ones(2, 4, dtype=torch.long), 4, attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="one policy per prompt"):
        speculative_generate(target, draft, [p, p], [Chain()] * 3, 4)
    with pytest.raises(ValueError, match="draft="):
        speculative_generate(target, None, [p, p], Chain(), 4)
    with pytest.raises(ValueError, match="z-lab"):
        draft.spec_generate(target=target, input_ids=torch.ones(2, 4, dtype=torch.long), max_new_tokens=4)
    target.config._attn_implementation = "flash_attention_2"
    try:
        from dflash_core import IncompatibleModelError

        with pytest.raises(IncompatibleModelError, match="sdpa"):
            autoregressive_generate(target, [p, p], 4)
    finally:
        target.config._attn_implementation = "sdpa"


def test_auto_in_a_batch_prices_rounds_with_the_batch_curve_per_sequence(pair, monkeypatch):
    """``auto`` for B sequences measures the batch round (one drafter pass and one verify of B trees) and divides it
    by B; the curve is cached per batch size and not corrected online."""
    import ddtree.cost as cost

    target, draft, prompts, max_new, _, _ = pair

    def timer(functions, repeats, device=None, warmup=0):
        for _ in range(warmup + repeats):
            for fn in functions:
                fn()
        return [[0.004] * repeats for _ in functions]  # every call of the batch of 4: its per-sequence share is 1 ms

    from dflash_core.target import TargetAdapter

    verify_rows = []
    real = TargetAdapter.forward

    def spy(self, token_ids, *args, **kwargs):
        verify_rows.append(token_ids.shape[0])
        return real(self, token_ids, *args, **kwargs)

    monkeypatch.setattr(cost, "time_samples", timer)
    monkeypatch.setattr(TargetAdapter, "forward", spy)
    curve = cost.measure_cost_model(target, draft, grid=(0, 2, 8), context=32, repeats=1, cap=16, batch=4)
    assert curve.verify(8) == pytest.approx(0.001) and curve.fixed_s == pytest.approx(0.001)
    assert set(verify_rows) == {4}  # every timed forward verified the four sequences together
    single = cost.measure_cost_model(target, draft, grid=(0, 2, 8), context=32, repeats=1, cap=16)
    assert single.verify(8) == pytest.approx(0.004)  # batch 1 is its own curve
    import ddtree.budget as budget

    asked = []
    real_measure = budget.measure_cost_model

    def measure(*args, **kwargs):
        asked.append(kwargs.get("batch", 1))
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(budget, "measure_cost_model", measure)
    results = ddtree_generate(target, draft, prompts[:4], budget="auto", max_new_tokens=max_new)
    assert [r.new_token_ids for r in results] == [greedy_reference(target, p, max_new) for p in prompts[:4]]
    # each sequence's policy asked for the batch-of-4 curve; the single one prices the batch once it has shrunk
    assert asked == [4] * 4 + [1]


def test_the_shared_size_maximizes_the_batchs_rate_by_brute_force():
    from ddtree.budget import shared_size

    rng = np.random.default_rng(0)
    for _ in range(200):
        seconds = np.sort(rng.uniform(0.01, 0.05, 17))
        probs = [np.sort(rng.uniform(0, 1, rng.integers(0, 17)))[::-1] for _ in range(rng.integers(1, 5))]
        rate = None if rng.random() < 0.5 else float(rng.uniform(10, 200))

        def value(n):
            tokens = sum(1 + p[:n].sum() for p in probs)
            return tokens / seconds[n] if rate is None else tokens - rate * seconds[n]

        values = [value(n) for n in range(17)]
        assert shared_size(probs, seconds, rate) == int(np.argmax(values))


def test_a_shared_budget_gives_every_sequence_one_size_per_round(pair, monkeypatch):
    from ddtree.budget import SharedBudget

    target, draft, prompts, max_new, _, _ = pair
    sizes, chosen = [], []
    real = SharedBudget.propose

    def spy(self, seqs, blocks, histories):
        trees = real(self, seqs, blocks, histories)
        sizes.append([len(t) for t in trees])
        chosen.append(self.chosen[-1])
        return trees

    monkeypatch.setattr(SharedBudget, "propose", spy)
    results = ddtree_generate(target, draft, prompts[:4], budget="auto", max_new_tokens=max_new)
    assert [r.new_token_ids for r in results] == [greedy_reference(target, p, max_new) for p in prompts[:4]]
    assert sizes and all(max(row) <= n for row, n in zip(sizes, chosen))
    # every tree has the shared size, unless the sequence's built tree held fewer nodes
    assert sum(all(k == n for k in row) for row, n in zip(sizes, chosen)) >= 0.5 * len(sizes)
    assert len({n for n in chosen}) > 1  # the size follows the rounds
    with pytest.raises(TypeError, match="AutoBudget"):
        SharedBudget([Chain()])


def test_auto_caps_a_batchs_trees_at_24_nodes_per_sequence_on_a_cpu(pair):
    from ddtree.budget import AutoBudget
    from ddtree.cost import default_cap

    target, draft, _, _, _, _ = pair
    assert default_cap(torch.device("cpu")) == 128 and default_cap(torch.device("cpu"), batch=4) == 24
    assert default_cap(torch.device("cuda"), batch=4) == 1024  # unmeasured there: the single-sequence cap
    assert AutoBudget.for_models(target, draft, batch=4).cap == 24
    assert AutoBudget.for_models(target, draft, batch=4, cap=64).cap == 64
