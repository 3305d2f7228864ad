"""experiments.studies.sampled_head_study on a tiny random pair with a random gated Markov head: the head-free
wrapper really drops the head, the depth-1 agreement is what it says (by hand and against the live loop's own
blocks), and the study's rows and paired ratios add up."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_draft, make_target, prompt
from ddtree import build_tree
from ddtree.generate import FixedBudget
from ddtree.sampled import SampledTreePolicy
from dflash_core import BlockPolicy, speculative_generate
from dflash_core.decoding import make_block
from dflash_core.markov import attach_markov_head
from dflash_core.target import TargetAdapter
from experiments.studies.sampled_head_study import (
    WithoutHead, _round_stats, entropy, make_variants, overlap, paired_ratio, parse_args, root_agreement, run_study,
    summarise,
)

VOCAB = 64


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama", vocab=VOCAB, dtype=torch.float64, init=0.3)
    draft = make_draft(target, block_size=5, dtype=torch.float64)
    draft.set_draft_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:48])
    head = attach_markov_head(draft, 6, "gated")
    with torch.no_grad():
        torch.manual_seed(0)
        head.out.weight.normal_(0, 1.5)  # strong enough to reorder the drafter's choices
        head.gate.weight.normal_(0, 1.0)
    return target, draft


def _block(pair, seed: int = 0, root: int = 5):
    target, draft = pair
    states = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return make_block(draft, TargetAdapter(target, ()), states, root)


def _paths(tree) -> set:
    tokens, parents = tree.token_ids.tolist(), tree.parents.tolist()

    def path(i):
        return (path(parents[i]) if parents[i] >= 0 else ()) + (tokens[i],)

    return {path(i) for i in range(len(tokens))}


def test_without_head_builds_the_base_logits_tree(pair):
    block = _block(pair)
    assert block.scorer is not None
    plain = build_tree(block.logits, 12, token_map=block.token_map)
    without = WithoutHead(FixedBudget(12)).propose(block, [1, 2, block.root])
    assert _paths(without) == _paths(plain)
    assert _paths(FixedBudget(12).propose(block, [1, 2, block.root])) != _paths(plain)  # the head matters here
    assert block.scorer is not None  # the caller's block keeps its scorer


def test_without_head_samples_from_the_per_depth_rows(pair):
    block = _block(pair, seed=1)
    token_map = pair[1].draft_vocab
    without = WithoutHead(SampledTreePolicy(10, 1.0, seed=3, token_map=token_map)).propose(block, [block.root])
    plain = SampledTreePolicy(10, 1.0, seed=3, token_map=token_map).propose(block.logits, token_map=block.token_map)
    assert without.token_ids.tolist() == plain.token_ids.tolist()
    assert without.parents.tolist() == plain.parents.tolist()
    assert torch.equal(without.proposals, plain.proposals)
    assert without.proposals.shape[0] <= without.max_depth  # one row per depth: no conditioned rows
    headed = SampledTreePolicy(10, 1.0, seed=3, token_map=token_map).propose(block, [block.root])
    assert headed.proposals.shape[0] > headed.max_depth  # with the head, rows per parent token


def test_overlap_and_entropy_by_hand():
    p = torch.tensor([0.5, 0.2, 0.1, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    token_map = torch.tensor([3, 0, 1])  # q's columns are target tokens 3, 0, 1
    assert overlap(p, q, token_map) == pytest.approx(min(0.15, 0.6) + min(0.5, 0.3) + min(0.2, 0.1))  # 0.55
    assert overlap(p, p) == pytest.approx(1.0)
    assert entropy(torch.full((8,), 1 / 8)) == pytest.approx(math.log(8))
    assert entropy(torch.tensor([1.0, 0.0, 0.0])) == 0.0
    assert entropy(q) == pytest.approx(-(0.6 * math.log(0.6) + 0.3 * math.log(0.3) + 0.1 * math.log(0.1)))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = torch.softmax(3 * torch.randn(5, generator=g, dtype=torch.float64), 0)
        b = torch.softmax(3 * torch.randn(3, generator=g, dtype=torch.float64), 0)
        assert 0.0 <= overlap(a, b, token_map) <= 1.0


def test_round_stats_read_the_heads_row_and_the_base_row(pair):
    block = _block(pair, seed=2)
    p = torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(4), dtype=torch.float64), 0)
    stats = _round_stats(p, block, (1.0, 2.0))
    head_q = torch.from_numpy(block.scorer.log_probs(1, [block.root])[0]).double().exp()
    base_q = torch.softmax(block.logits[0].double(), 0)
    ids = block.token_map
    assert stats["overlap_head"] == pytest.approx(float(torch.minimum(p[ids], head_q).sum()), abs=1e-6)
    assert stats["overlap_nohead"] == pytest.approx(float(torch.minimum(p[ids], base_q).sum()), abs=1e-9)
    assert stats["overlap_head"] != pytest.approx(stats["overlap_nohead"], abs=1e-4)
    assert stats["overlap_head@1"] == pytest.approx(stats["overlap_head"])
    assert stats["p_outside_draft_vocab"] == pytest.approx(1 - float(p[ids].sum()))
    assert stats["entropy_q_nohead"] == pytest.approx(entropy(base_q))
    tempered = torch.softmax(torch.log(head_q) / 2.0, 0)
    assert stats["overlap_head@2"] == pytest.approx(float(torch.minimum(p[ids], tempered).sum()), abs=1e-6)
    for key in ("overlap_head", "overlap_nohead", "overlap_head@2", "q_top1_head", "p_at_q_top1_nohead"):
        assert 0.0 <= stats[key] <= 1.0


class Recording(BlockPolicy):
    """FixedBudget that keeps the entropies of each live round's depth-1 rows (head and base)."""

    name = "recording"

    def __init__(self, budget: int) -> None:
        self.inner, self.head, self.base = FixedBudget(budget), [], []

    def propose(self, block, history):
        self.base.append(entropy(torch.softmax(block.logits[0].double(), 0)))
        self.head.append(entropy(torch.from_numpy(block.scorer.log_probs(1, [block.root])[0]).double().exp()))
        return self.inner.propose(block, history)


def test_teacher_forced_blocks_equal_the_live_rounds(pair):
    """The mechanism's replayed drafter blocks are the live loop's, round by round (fp64)."""
    target, draft = pair
    ids = prompt(3, 7, VOCAB)
    policy = Recording(6)
    res = speculative_generate(target, draft, ids, policy, max_new_tokens=14, temperature=1.0, seed=2)
    sums = root_agreement(target, draft, ids[0].tolist(), res.new_token_ids, res.acceptance_lengths, 1.0, (1.0,))
    assert sums["rounds"] == len(res.acceptance_lengths) == len(policy.head)
    assert sums["entropy_q_head"] == pytest.approx(sum(policy.head), abs=1e-6)
    assert sums["entropy_q_nohead"] == pytest.approx(sum(policy.base), abs=1e-6)


def test_run_study_rows_and_summary(pair):
    target, draft = pair
    prompts = [("math", "toy", str(i), prompt(10 + i, 6, VOCAB)[0].tolist()) for i in range(2)]
    temps = (1.0, 1.5)
    rows, mech = run_study(target, draft, prompts, seeds=1, budget=6, draft_temps=temps, max_new_tokens=10,
                           mechanism="all", log=lambda *_: None)
    names = [v.name for v in make_variants(temps)]
    assert sorted(r["variant"] for r in rows) == sorted(names * 2)
    assert [r["variant"] for r in rows[:len(names)]] != [r["variant"] for r in rows[len(names):]]  # order rotates
    for r in rows:
        assert r["rounds"] > 0 and r["tokens"] == r["new_tokens"] - 1  # the prefill's token is no round
    by_run = {(m["prompt_index"], m["variant"]): m for m in mech}
    for r in rows:
        m = by_run[(r["prompt_index"], r["variant"])]
        assert m["rounds"] == r["rounds"]
        for key in ("overlap_head", "overlap_nohead", "overlap_head@1.5"):
            assert 0.0 <= m[key] / m["rounds"] <= 1.0
    summary = summarise(rows, mech, temps)
    for name in names[2:]:
        entry, base = summary[name], summary[make_variants(temps)[names.index(name)].baseline]
        ratio = entry["vs_" + make_variants(temps)[names.index(name)].baseline]
        assert ratio["ratio"] == pytest.approx(entry["tau"] / base["tau"])
        assert ratio["lo"] <= ratio["ratio"] <= ratio["hi"]
    assert all(e["tokens_per_s"] > 0 for e in summary.values())
    assert 0 <= summary["topk+head"]["mechanism"]["overlap_head"] <= 1


def test_paired_ratio_by_hand():
    rows = [{"prompt_index": 0, "variant": "a", "tokens": 10, "rounds": 5},
            {"prompt_index": 0, "variant": "b", "tokens": 8, "rounds": 4},
            {"prompt_index": 1, "variant": "a", "tokens": 9, "rounds": 3},
            {"prompt_index": 1, "variant": "b", "tokens": 6, "rounds": 3},
            {"prompt_index": 1, "variant": "a", "tokens": 3, "rounds": 3}]  # a second seed of prompt 1
    got = paired_ratio(rows, "a", "b")
    assert got["ratio"] == pytest.approx((22 / 11) / (14 / 7))
    assert got["prompts"] == 2 and got["lo"] <= got["ratio"] <= got["hi"]
    assert paired_ratio(rows, "b", "a")["ratio"] == pytest.approx(1 / got["ratio"])


def test_command_line():
    a = parse_args(["--draft-temps", "1,1.25", "--limit", "1"])
    assert a.draft_temps == (1.0, 1.25) and a.limit == 1 and a.seeds == 2 and a.budget == 16
    assert a.max_new_tokens == 96


def test_paired_ratio_of_one_prompt_has_a_zero_width_interval():
    rows = [{"prompt_index": 0, "variant": "a", "tokens": 9, "rounds": 3},
            {"prompt_index": 0, "variant": "b", "tokens": 8, "rounds": 4}]
    got = paired_ratio(rows, "a", "b")
    assert got["ratio"] == got["lo"] == got["hi"] == pytest.approx(1.5)
