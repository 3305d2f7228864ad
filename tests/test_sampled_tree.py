"""Sampled draft trees and recursive rejection sampling: exactness, detected breakage, tree validity, the loop.

Three levels of evidence that ``tree="sampled"`` is lossless:

1. exact: at one node, the committed token's distribution, summed over every possible draw of the children, equals the
   target's p to rounding (enumeration on a 5-token vocabulary), and is visibly off for each broken rule;
2. statistical, model-free: the real tree builder and verifier generate the first three tokens under a synthetic
   target on a 4-token vocabulary; a chi-square test against the exact joint accepts the real rule and rejects
   each broken one;
3. end to end: ``ddtree_generate(..., tree="sampled")`` with tiny random models matches plain sampling (chi-square),
   and is the greedy walk at T = 0 (``test_sampling_temperature`` runs each broken rule through the loop, and the
   loop at T = 0.6 and 1.7).
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
import torch

from conftest import answer_counts, make_draft, make_target, prompt, sampled_answers
from ddtree import SampledTreePolicy, ddtree_generate
from ddtree.sampled import RecursiveRejection, SampledDraftTree, sample_tree
from dflash_core import autoregressive_generate, speculative_generate
from dflash_core.tree import DraftBlock
from test_decoding import chi_square_p, exact_joint

F64 = torch.float64


# ---------------------------------------------------------------------------------------------- broken rules
class NoResidual(RecursiveRejection):
    """Broken: after a rejection the target is not replaced by the residual max(p - q, 0)."""

    def residual(self, p, q, accept):
        return p


class Unclipped(RecursiveRejection):
    """Broken: the acceptance ratio p / q is not clipped at 1, so the mass accepting delivers (q * ratio = p) is
    overstated and the residual comes out empty."""

    def acceptance(self, p, q):
        return torch.where(q > 0, p / torch.where(q > 0, q, torch.ones_like(q)), torch.zeros_like(p))


class NoRenormalisation(RecursiveRejection):
    """Broken: after a rejected child the next draw's law is q with that token removed but NOT renormalised, so the
    later siblings' acceptance ratios p / q are computed against too little proposal mass."""

    def without(self, q, token):
        rest = q.clone()
        rest[token] = 0.0
        return rest


class WithReplacement(SampledTreePolicy):
    """Broken: children drawn WITH replacement (a repeated token becomes another sibling) but verified by the
    without-replacement rule."""

    def draw_child(self, rows, row, taken):
        return super().draw_child(rows, row, [])


# ---------------------------------------------------------------------------------------------- 1. exact, one node
def draws_without_replacement(q: torch.Tensor, k: int):
    """Every ordered sequence of min(k, |support|) distinct tokens, with its probability when drawn one after the
    other without replacement from q."""
    support = [x for x in range(len(q)) if q[x] > 0]
    for seq in itertools.permutations(support, min(k, len(support))):
        prob, left = 1.0, 1.0
        for x in seq:
            prob *= float(q[x]) / left
            left -= float(q[x])
        yield seq, prob


def draws_with_replacement(q: torch.Tensor, k: int):
    support = [x for x in range(len(q)) if q[x] > 0]
    for seq in itertools.product(support, repeat=k):
        yield seq, float(np.prod([float(q[x]) for x in seq]))


def committed_distribution(rule: RecursiveRejection, p: torch.Tensor, q: torch.Tensor, draws) -> torch.Tensor:
    """[V] exact distribution of the token committed at the node (accepted child or bonus), over all draws."""
    total = torch.zeros_like(p)
    for seq, prob in draws:
        move, bonus = rule.outcomes(p, q, list(seq))
        committed = bonus.clone()
        for i, x in enumerate(seq):
            committed[x] += move[i]
        total += prob * committed
    return total


def random_pair(seed: int, vocab: int = 5):
    """A target p and proposal q, each with some zero entries now and then, and sometimes p == q."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(vocab, generator=g, dtype=F64) * 2, 0)
    q = torch.softmax(torch.randn(vocab, generator=g, dtype=F64) * 2, 0)
    if seed % 3 == 1:
        p[seed % vocab] = 0.0
        q[(seed + 2) % vocab] = 0.0
    if seed % 7 == 3:
        q = p.clone()
    return p / p.sum(), q / q.sum()


# a proposal confident in the wrong token: breaks show strongly
P_FIXED = torch.tensor([0.05, 0.40, 0.30, 0.15, 0.10], dtype=F64)
Q_FIXED = torch.tensor([0.60, 0.15, 0.10, 0.10, 0.05], dtype=F64)


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_rule_is_exact_for_every_number_of_children():
    rule = RecursiveRejection()
    worst = 0.0
    for seed in range(24):
        p, q = random_pair(seed)
        for k in range(6):
            got = committed_distribution(rule, p, q, draws_without_replacement(q, k))
            worst = max(worst, float((got - p).abs().max()))
    assert worst < 1e-12
    # disjoint supports: every child is rejected and the residual (= p) decides
    p, q = torch.tensor([0.5, 0.5, 0, 0, 0], dtype=F64), torch.tensor([0, 0, 0.2, 0.3, 0.5], dtype=F64)
    assert float((committed_distribution(rule, p, q, draws_without_replacement(q, 2)) - p).abs().max()) < 1e-15


@pytest.mark.parametrize("k", [2, 3])
def test_broken_rules_are_visible_in_the_exact_distribution(k):
    rule = RecursiveRejection()
    exact = tv(committed_distribution(rule, P_FIXED, Q_FIXED, draws_without_replacement(Q_FIXED, k)), P_FIXED)
    broken = {
        "no residual update": committed_distribution(NoResidual(), P_FIXED, Q_FIXED,
                                                     draws_without_replacement(Q_FIXED, k)),
        "p/q unclipped": committed_distribution(Unclipped(), P_FIXED, Q_FIXED, draws_without_replacement(Q_FIXED, k)),
        "no renormalisation without replacement": committed_distribution(
            NoRenormalisation(), P_FIXED, Q_FIXED, draws_without_replacement(Q_FIXED, k)),
        "with replacement, verified as without": committed_distribution(rule, P_FIXED, Q_FIXED,
                                                                        draws_with_replacement(Q_FIXED, k)),
    }
    distances = {name: tv(dist, P_FIXED) for name, dist in broken.items()}
    assert exact < 1e-14
    assert all(d > 0.04 for d in distances.values()), distances


def test_one_child_is_standard_speculative_sampling_exactly():
    rule = RecursiveRejection()
    for seed in range(10):
        p, q = random_pair(seed)
        for x in range(5):
            if q[x] == 0:
                continue
            move, bonus = rule.outcomes(p, q, [x])
            accept = min(1.0, float(p[x] / q[x]))
            residual = (p - q).clamp(min=0)
            expected_bonus = (1 - accept) * (residual / residual.sum() if residual.sum() > 1e-12 else p)
            assert float(move[0]) == pytest.approx(accept, abs=1e-15)
            torch.testing.assert_close(bonus, expected_bonus, atol=1e-15, rtol=0)


def textbook_speculative_sampling(ps, qs, drafts, generator):
    """Standard speculative sampling of a chain (Leviathan et al.; Chen et al.), written independently."""
    accepted = []
    for i, x in enumerate(drafts):
        u = torch.rand((), generator=generator, dtype=F64)
        if u < min(1.0, float(ps[i][x] / qs[i][x])):
            accepted.append(x)
            continue
        residual = (ps[i] - qs[i]).clamp(min=0)
        return accepted, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return accepted, int(torch.multinomial(ps[len(drafts)], 1, generator=generator))


def test_single_child_trees_reduce_to_speculative_sampling():
    """A sampled chain (one child per node) is verified exactly like standard speculative sampling: same random
    stream, same committed tokens."""
    vocab, depth = 6, 4
    agree = lengths = 0
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        qs = torch.softmax(torch.randn(depth, vocab, generator=g, dtype=F64) * 1.5, -1)  # [depth, V]
        target_logits = torch.randn(depth + 1, vocab, generator=g, dtype=F64) * 1.5  # [n+1, V]: root + nodes
        drafts = [int(torch.multinomial(qs[d], 1, generator=g)) for d in range(depth)]
        chain = SampledDraftTree(
            torch.tensor(drafts), torch.arange(-1, depth - 1), torch.arange(1, depth + 1),
            torch.log(qs[torch.arange(depth), drafts]).cumsum(0), proposals=qs,
            proposal_rows=torch.tensor(list(range(depth)) + [-1]))
        path, bonus = chain.verify(target_logits, 1.0, torch.Generator().manual_seed(1000 + seed))
        ps = torch.softmax(target_logits, -1)
        accepted, expected_bonus = textbook_speculative_sampling(ps, qs, drafts,
                                                                 torch.Generator().manual_seed(1000 + seed))
        agree += [drafts[i] for i in path] == accepted and bonus == expected_bonus and path == list(range(len(path)))
        lengths += len(path)
    assert agree == 200 and lengths > 50  # and the chains were accepted to various depths


# ---------------------------------------------------------------------------------------------- tree validity
@pytest.mark.parametrize("vocab,depth,budget", [(5, 3, 4), (50, 6, 16), (50, 6, 64), (3, 2, 50), (1000, 15, 32)])
def test_sampled_tree_is_a_valid_tree_within_budget(vocab, depth, budget):
    g = torch.Generator().manual_seed(vocab + depth + budget)
    logits = torch.randn(depth, vocab, generator=g) * 3
    logits[:, 0] = -torch.inf  # a token the drafter cannot produce
    for seed in range(5):
        tree = sample_tree(logits, budget, temperature=0.8, seed=seed)
        tree.validate(best_first=False)  # parents first, depth = parent + 1, distinct siblings, path probs shrink
        possible = sum((vocab - 1) ** d for d in range(1, depth + 1))
        assert len(tree) == min(budget, possible)
        assert 0 not in tree.token_ids.tolist()
        q = torch.softmax(logits.double() / 0.8, -1)
        has_children = set(tree.parents.tolist())
        for node in range(-1, len(tree)):
            row = int(tree.proposal_rows[node + 1])
            if node not in has_children:
                assert row == -1
                continue
            assert row == (0 if node < 0 else int(tree.depths[node]))
            torch.testing.assert_close(tree.proposal(node, vocab), q[row])
        scores = torch.log(q[tree.depths - 1, tree.token_ids])
        parent_scores = torch.where(tree.parents >= 0, tree.log_probs[tree.parents.clamp(min=0)], 0.0)
        torch.testing.assert_close(tree.log_probs, parent_scores + scores)
    again = sample_tree(logits, budget, temperature=0.8, seed=4)
    assert again.equals(tree) and torch.equal(again.proposals, tree.proposals)  # seeded: reproducible


def test_tree_shape_follows_the_drafters_confidence():
    """Best-first growth: a confident drafter gets a deep tree, a flat one a wide tree."""
    confident = torch.full((8, 100), -10.0)
    confident[:, 7] = 10.0
    deep = sample_tree(confident, 8, seed=0)
    assert deep.max_depth == 8 and deep.token_ids.tolist() == [7] * 8
    wide = sample_tree(torch.zeros(8, 100), 8, seed=0)
    assert wide.max_depth == 1 and len(set(wide.token_ids.tolist())) == 8


def test_sampled_children_follow_the_drafter():
    """The first child of the root is a draw from q_1; later siblings are draws without replacement."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    q = torch.softmax(logits[0].double(), 0)
    policy = SampledTreePolicy(2, temperature=1.0, seed=11)
    firsts, seconds = torch.zeros(4), torch.zeros(4)
    n = 4000
    for _ in range(n):
        tree = policy.propose(block_of(logits), [])
        firsts[int(tree.token_ids[0])] += 1
        seconds[int(tree.token_ids[1])] += 1
    expected_second = torch.tensor([sum(q[a] * q[b] / (1 - q[a]) for a in range(4) if a != b) for b in range(4)])
    from scipy.stats import chisquare

    assert chisquare(firsts.numpy(), n * q.numpy()).pvalue > 1e-3
    assert chisquare(seconds.numpy(), n * expected_second.numpy()).pvalue > 1e-3


# ---------------------------------------------------------------------------------------------- 2. model-free joint
class SyntheticTarget:
    """p(. | prefix) on a tiny vocabulary: a fixed random distribution for every prefix, keyed by the prefix."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.seed, self.memo = vocab, seed, {}

    def probs(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self.memo:
            g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, prefix)).encode()))
            self.memo[prefix] = torch.softmax(torch.randn(self.vocab, generator=g, dtype=F64) * 1.5, 0)
        return self.memo[prefix]

    def joint(self, steps: int) -> dict[tuple[int, ...], float]:
        out = {(): 1.0}
        for _ in range(steps):
            out = {seq + (t,): pr * float(self.probs(seq)[t]) for seq, pr in out.items() for t in range(self.vocab)}
        return out


def path_tokens(tree, node: int) -> tuple[int, ...]:
    tokens = []
    while node >= 0:
        tokens.append(int(tree.token_ids[node]))
        node = int(tree.parents[node])
    return tuple(reversed(tokens))


def block_of(logits: torch.Tensor, token_map: torch.Tensor | None = None) -> DraftBlock:
    """A round's drafter block from its logits (over a draft vocabulary when ``token_map`` is given)."""
    return DraftBlock(logits, token_map, 0, logits.shape[1] if token_map is None else int(token_map.max()) + 1)


def first_tokens(policy, target: SyntheticTarget, draft_logits: torch.Tensor, steps: int, seed: int,
                 temperature: float = 1.0, verify_temperature: float | None = None):
    """The decode loop in miniature: propose, 'verify forward' (the synthetic target at every node), walk, commit.

    The target's logits are ``temperature * log p``, so sampling at ``temperature`` means sampling from p (the
    synthetic joint); ``verify_temperature`` (default: ``temperature``) is the temperature the walk is told."""
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    told = temperature if verify_temperature is None else verify_temperature
    while len(out) < steps:
        tree = policy.propose(block_of(draft_logits), out)
        prefixes = [tuple(out)] + [tuple(out) + path_tokens(tree, i) for i in range(len(tree))]
        logits = temperature * torch.stack([target.probs(prefix).log() for prefix in prefixes])  # [n+1, V]
        path, bonus = tree.verify(logits, told, generator)
        out += [int(tree.token_ids[i]) for i in path] + [bonus]
    return tuple(out[:steps])


# the drafter: confident, and often wrong, differently at each depth
DRAFT_LOGITS = torch.tensor([[2.5, 0.5, 0.0, -1.0], [0.0, 2.5, -1.0, 0.5], [-1.0, 0.0, 2.5, 0.5]])
N_MODEL_FREE = 2500


def model_free_p_value(policy, target_vocab: int = 4, draft_logits=DRAFT_LOGITS, n: int = N_MODEL_FREE,
                       temperature: float = 1.0, verify_temperature: float | None = None) -> float:
    target = SyntheticTarget(target_vocab, seed=5)
    counts: dict[tuple, int] = {}
    for seed in range(n):
        key = first_tokens(policy, target, draft_logits, 3, seed, temperature, verify_temperature)
        counts[key] = counts.get(key, 0) + 1
    return chi_square_p(counts, target.joint(3), n)


def test_sampled_tree_joint_equals_plain_sampling_model_free():
    assert model_free_p_value(SampledTreePolicy(6, temperature=1.0, seed=1)) > 1e-3


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_sampled_tree_is_exact_away_from_temperature_one(temperature):
    """At T != 1 the tree is drawn from the drafter at T and verified against softmax(logits / T); a rule that drops
    the division by T (verifies as if T were 1) samples softmax(T log p) instead and is caught."""
    policy = SampledTreePolicy(6, temperature=temperature, seed=1)
    assert model_free_p_value(policy, temperature=temperature, n=2000) > 1e-3
    broken = SampledTreePolicy(6, temperature=temperature, seed=1)
    assert model_free_p_value(broken, temperature=temperature, verify_temperature=1.0, n=2000) < 1e-6


@pytest.mark.parametrize("policy", [
    SampledTreePolicy(6, temperature=1.0, seed=1, rule=NoResidual()),
    SampledTreePolicy(6, temperature=1.0, seed=1, rule=Unclipped()),
    SampledTreePolicy(6, temperature=1.0, seed=1, rule=NoRenormalisation()),
    WithReplacement(6, temperature=1.0, seed=1),
], ids=["no-residual", "unclipped", "no-renormalisation", "with-replacement"])
def test_broken_rules_are_detected_model_free(policy):
    assert model_free_p_value(policy) < 1e-6


def test_draft_vocabulary_subset():
    """A drafter scoring only target ids d2t = [5, 0, 3] of a 6-token vocabulary: trees hold target ids, proposals
    are zero outside the subset, and verification is still exact (tokens 1, 2, 4 come from the residual)."""
    d2t = torch.tensor([5, 0, 3])
    draft_logits = torch.tensor([[1.5, 0.0, -0.5], [0.0, 1.0, 0.5]])  # [depth, V'] over draft indices
    tree = SampledTreePolicy(5, temperature=1.0, seed=3).propose(block_of(draft_logits, d2t), [])
    assert set(tree.token_ids.tolist()) <= {0, 3, 5}
    q = tree.proposal(-1, 6)
    assert q[[1, 2, 4]].abs().sum() == 0
    torch.testing.assert_close(q[d2t], torch.softmax(draft_logits[0].double(), 0))
    p = torch.tensor([0.1, 0.25, 0.05, 0.2, 0.3, 0.1], dtype=F64)
    for k in range(4):
        got = committed_distribution(RecursiveRejection(), p, q, draws_without_replacement(q, k))
        assert float((got - p).abs().max()) < 1e-12

    class SubsetDrafter(SampledTreePolicy):  # the loop would hand it logits over the draft vocabulary only
        ids = torch.tensor([4, 0, 3])

        def propose(self, block, history):
            return super().propose(block_of(block.logits[:, self.ids], self.ids), history)

    full_logits = torch.full((3, 5), -3.0)
    full_logits[:, [4, 0, 3]] = DRAFT_LOGITS[:, :3]
    assert model_free_p_value(SubsetDrafter(6, 1.0, seed=2), target_vocab=5,
                              draft_logits=full_logits, n=1500) > 1e-3
    # the same drafter as the loop may hand it over: target-wide logits, -inf outside the draft vocabulary
    full_logits[:, [1, 2]] = -torch.inf
    assert model_free_p_value(SampledTreePolicy(6, 1.0, seed=2), target_vocab=5, draft_logits=full_logits, n=1500) > 1e-3


# ---------------------------------------------------------------------------------------------- 3. the decode loop
@pytest.fixture(scope="module")
def tiny_pair():
    target = make_target("qwen3", vocab=4, init=0.3, dtype=torch.float32, seed=7)
    draft = make_draft(target, block_size=4, dtype=torch.float32)
    p = prompt(2, 4, 4)
    return target, draft, p


N_LOOP = 700


def test_ddtree_generate_sampled_matches_plain_sampling(tiny_pair):
    target, draft, p = tiny_pair
    results = sampled_answers(lambda seeds: ddtree_generate(
        target, draft, [p] * len(seeds), budget=6, max_new_tokens=3, temperature=1.0, seed=seeds[0], tree="sampled",
        trace=True), N_LOOP)
    counts = answer_counts(results)
    later_siblings = 0
    for out in results[:100]:
        if out.trees:
            assert all(isinstance(t, SampledDraftTree) and len(t) <= 6 for t in out.trees)
            later_siblings += sum(sum(1 for c in t.children(-1)[1:]) for t in out.trees)
    assert later_siblings > 0  # trees did branch
    assert chi_square_p(counts, exact_joint(target, p, 3), N_LOOP) > 1e-3


def test_sampled_tree_at_t0_is_the_greedy_walk():
    target = make_target("llama", vocab=64)
    draft = make_draft(target, block_size=6)
    for seed in range(2):
        p = prompt(40 + seed, 6, 64)
        ref = autoregressive_generate(target, p, max_new_tokens=30).new_token_ids
        assert ddtree_generate(target, draft, p, budget=8, max_new_tokens=30, seed=seed, tree="sampled",
                               temperature=0.0).new_token_ids == ref
        # a sampled tree verified at T = 0 falls back to the greedy walk as well
        out = speculative_generate(target, draft, p, SampledTreePolicy(8, temperature=1.0, seed=seed), max_new_tokens=30,
                                   temperature=0.0, trace=True)
        assert out.new_token_ids == ref and isinstance(out.trees[0], SampledDraftTree)


def test_tree_argument(tiny_pair):
    target, draft, p = tiny_pair
    runs = [ddtree_generate(target, draft, p, budget=5, max_new_tokens=12, temperature=1.0, seed=3, tree=tree)
            for tree in ("topk", "topk", "sampled", "sampled")]
    default = ddtree_generate(target, draft, p, budget=5, max_new_tokens=12, temperature=1.0, seed=3)
    assert default.new_token_ids == runs[0].new_token_ids == runs[1].new_token_ids  # topk is the default
    assert runs[2].new_token_ids == runs[3].new_token_ids  # seeded
    with pytest.raises(ValueError, match="unknown tree kind"):
        ddtree_generate(target, draft, p, budget=5, tree="wide")
    with pytest.raises(ValueError, match="int budget"):
        ddtree_generate(target, draft, p, budget="chain", temperature=1.0, tree="sampled")


# ---------------------------------------------------------------------------------------------- 4. benchmark + plots
def test_records_keep_the_tree_kind_and_old_records_load():
    import json

    from experiments.bench.schema import SampleRecord, method_label

    common = dict(dataset="gsm8k", sample_id="3", turn=0, method="ddtree", budget=16, policy="fixed",
                  temperature=1.0, num_input_tokens=10, num_new_tokens=8, prefill_s=0.1, decode_s=0.5,
                  acceptance_lengths=[2, 3, 2])
    sampled = SampleRecord(**common, tree="sampled")
    assert SampleRecord.from_json(sampled.to_json()) == sampled and sampled.tree_kind == "sampled"
    old = json.loads(SampleRecord(**common).to_json())
    del old["variant"]  # a version-1 record from before the tree field: method, budget and policy only
    old = SampleRecord.from_dict({**old, **{k: common[k] for k in ("method", "budget", "policy")}})
    assert old.tree_kind == "topk" and old.record_key() == ("gsm8k", "3", 0, "ddtree", 16, 1.0)
    assert SampleRecord(**common, tree="topk").record_key() == old.record_key() != sampled.record_key()
    assert method_label("ddtree", "fixed", 16, "sampled") == "DDTree sampled (B=16)"
    assert method_label("ddtree", "fixed", 16, "topk") == "DDTree (B=16)"


def test_sampling_preset():
    from experiments.bench.presets import get_preset, with_overrides

    preset = get_preset("sampling")
    assert preset.problems() == [] and preset.temperatures == (1.0,) and preset.budgets == (16, 32, "auto")
    assert preset.trees == ("topk", "sampled") and len(preset.datasets) == 7 and preset.methods[0] == "ar"
    with pytest.raises(ValueError, match="trees"):
        with_overrides(preset, trees=("bushy",))
    with pytest.raises(ValueError, match="int budget"):
        with_overrides(preset, budgets=("auto",))


def test_benchmark_runs_both_tree_kinds_side_by_side(tmp_path):
    from experiments.bench import cli as benchmark
    from experiments.bench.schema import read_records
    from plots import make_report, summary_table

    out = tmp_path / "t1"
    args = ["--preset", "tiny", "--out", str(out), "--temperatures", "1", "--datasets", "gsm8k", "--max-samples", "1",
            "--methods", "ar,ddtree", "--budgets", "4,16", "--trees", "topk,sampled"]
    assert benchmark.main(args) == 0
    records = read_records(out / "records.jsonl")
    kinds = {(r.method, r.budget, r.tree) for r in records}
    assert kinds == {("ar", None, None), ("ddtree", 4, "topk"), ("ddtree", 4, "sampled"), ("ddtree", 16, "topk"),
                     ("ddtree", 16, "sampled")}
    assert all(max(r.extra["tree_sizes"]) <= r.budget for r in records if r.method == "ddtree")
    table = summary_table(records)
    for label in ("DDTree (B=4)", "DDTree sampled (B=4)", "DDTree (B=16)", "DDTree sampled (B=16)"):
        row = next(line for line in table.splitlines() if f"| {label} |" in line)
        speedup, tau = row.split("|")[4].strip(), row.split("|")[6].strip()
        assert speedup.endswith("×") and float(tau) >= 1.0
    assert "recursive rejection sampling" in table
    assert benchmark.main(args) == 0  # resuming: every record (both kinds) is found, nothing runs twice
    assert len(read_records(out / "records.jsonl")) == len(records) == 5
    paths = make_report(out, tmp_path / "figures", formats=("png",))
    results = (tmp_path / "figures" / "results_table.md").read_text()
    assert "DDTree sampled (B=16)" in results and "DDTree (B=16)" in results
    assert any(p.name.startswith("speedup_T1") for p in paths) and any(p.name.startswith("budget_tradeoff_T1")
                                                                      for p in paths)
