"""The DDTree builders: oracle, property and edge-case tests (CPU, a few seconds; DraftTree itself: test_draft_tree.py).

Oracles: the best prefix-closed tree of every size found by a tree knapsack over all prefixes, the brute-force list of
all prefixes in the canonical order (score desc, depth asc, rank path read from the node up), and the plain heap
reference.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddtree.build as build_module
from ddtree.build import build_tree, reference_build_tree, select_prefixes, top_candidates
from dflash_core.tree import ROOT, DraftTree

# ---------------------------------------------------------------------------------------------- oracles


def row_log_probs(logits: torch.Tensor) -> np.ndarray:
    """[depth, vocab] float64 copies of the float32 log-probs the builders use."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32).double().numpy()


def canonical_ranks(log_probs: np.ndarray) -> np.ndarray:
    """[depth, vocab] rank of each token in its row: log-prob descending, then token id ascending."""
    depth, vocab = log_probs.shape
    order = np.lexsort((np.broadcast_to(np.arange(vocab), log_probs.shape), -log_probs), axis=-1)
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.broadcast_to(np.arange(vocab), order.shape), axis=-1)
    return ranks


def all_prefixes_canonical(logits: torch.Tensor) -> list[tuple[float, tuple[int, ...]]]:
    """Every prefix (token path) with its score, sorted in the builders' canonical order."""
    lp = row_log_probs(logits)
    ranks = canonical_ranks(lp)
    depth, vocab = lp.shape
    entries = []
    for d in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=d):
            score = 0.0
            for row, token in enumerate(path):  # the same float64 running sum the builders use
                score = score + lp[row, token]
            ranks_up = tuple(ranks[row, t] for row, t in reversed(list(enumerate(path))))  # own rank first
            entries.append(((-score, d, ranks_up), score, path))
    entries.sort(key=lambda e: e[0])
    return [(score, path) for _, score, path in entries]


def best_prefix_closed_totals(logits: torch.Tensor) -> list[float]:
    """totals[b-1] = max total probability of a prefix-closed set of b prefixes, by a knapsack over the prefix tree.

    Independent of the "best B prefixes" argument: it searches all connected subtrees that contain the root.
    """
    lp = row_log_probs(logits)
    depth, vocab = lp.shape

    def best(prob: float, row: int) -> list[float]:
        # table[k]: best total over subtrees hanging at this node (node included) with k nodes; -inf if impossible
        table = [-math.inf, prob]
        for token in range(vocab) if row < depth else ():
            child = best(prob * math.exp(lp[row, token]), row + 1)
            merged = table + [-math.inf] * (len(child) - 1)
            for i, a in enumerate(table):
                for j, b in enumerate(child):
                    if j and a != -math.inf:
                        merged[i + j] = max(merged[i + j], a + b)
            table = merged
        return table

    root = best(1.0, 0)  # the root (weight 1, the bonus token) is always there and is counted in k
    return [total - 1.0 for total in root[2:]]


def tree_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Token path of every node, following parents."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.token_ids.tolist(), tree.parents.tolist()):
        paths.append((paths[parent] if parent != ROOT else ()) + (token,))
    return paths


def naive_visibility(tree: DraftTree) -> torch.Tensor:
    n = len(tree)
    vis = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    vis[0, 0] = True
    for i in range(n):
        vis[i + 1, 0] = True
        node = i
        while node != ROOT:
            vis[i + 1, node + 1] = True
            node = int(tree.parents[node])
    return vis


def assert_consistent_with_logits(tree: DraftTree, logits: torch.Tensor) -> None:
    """Valid tree whose log-probs are the path sums of the float32 log-softmax (exactly) and of the float64 one
    (closely), with every token among the top min(B, V) of its row."""
    tree.validate()
    lp32 = row_log_probs(logits)
    lp64 = torch.log_softmax(logits.double(), dim=-1).numpy()
    ranks = canonical_ranks(lp32)
    for i, path in enumerate(tree_paths(tree)):
        exact = 0.0
        for row, token in enumerate(path):
            exact = exact + lp32[row, token]
        assert tree.log_probs[i].item() == exact
        assert abs(tree.log_probs[i].item() - sum(lp64[row, t] for row, t in enumerate(path))) < 1e-4
        assert int(tree.depths[i]) == len(path)
        assert max(ranks[row, t] for row, t in enumerate(path)) < max(len(tree), 1)


def assert_same_tree(fast: DraftTree, reference: DraftTree) -> None:
    for name in ("token_ids", "parents", "depths", "log_probs"):
        a, b = getattr(fast, name), getattr(reference, name)
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), f"{name} differ at {torch.nonzero(a != b).flatten()[:5].tolist()}"


def random_logits(depth: int, vocab: int, seed: int, scale: float = 3.0, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=g) * scale
    return logits.round() if ties else logits


def drafter_like_logits(depth: int, vocab: int, seed: int) -> torch.Tensor:
    """A confident first guess per row with confidence decaying along the block, over a noisy tail."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=g) * 1.5
    for row in range(depth):
        top = 0.7 * 0.93 ** row
        tokens = torch.randint(0, vocab, (3,), generator=g)
        logits[row, tokens[0]] += math.log(top / (1 - top)) + math.log(vocab) + 1.0
        logits[row, tokens[1]] += math.log(top / (1 - top)) + math.log(vocab) - 0.5
        logits[row, tokens[2]] += math.log(vocab) - 1.0
    return logits


# ---------------------------------------------------------------------------------------------- optimality


@pytest.mark.parametrize("vocab,depth", [(3, 2), (3, 3), (2, 4), (4, 2), (2, 3)])
def test_builder_matches_best_prefix_closed_tree_of_every_size(vocab: int, depth: int) -> None:
    for seed in range(3):
        logits = random_logits(depth, vocab, seed, scale=1.5)
        totals = best_prefix_closed_totals(logits)
        num_prefixes = sum(vocab ** d for d in range(1, depth + 1))
        assert len(totals) == num_prefixes
        for budget in range(0, num_prefixes + 3):
            tree = build_tree(logits, budget)
            assert len(tree) == min(budget, num_prefixes)
            got = float(torch.exp(tree.log_probs).sum())
            want = totals[min(budget, num_prefixes) - 1] if budget else 0.0
            assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (seed, budget)


@pytest.mark.parametrize("vocab,depth", [(3, 1), (3, 5), (4, 4), (5, 3), (6, 3), (8, 3), (8, 2), (7, 1)])
@pytest.mark.parametrize("ties", [False, True])
def test_builder_equals_brute_force_canonical_prefix_list(vocab: int, depth: int, ties: bool) -> None:
    """Node order, tokens and scores equal the first B prefixes of the canonical sort of ALL prefixes, for every B
    (integer logits give many exact ties, which exercises the tie order)."""
    logits = random_logits(depth, vocab, seed=vocab * 10 + depth, scale=1.5, ties=ties)
    ordered = all_prefixes_canonical(logits)
    for budget in range(0, len(ordered) + 2):
        tree = build_tree(logits, budget)
        want = ordered[:budget]
        assert tree_paths(tree) == [path for _, path in want], budget
        assert tree.log_probs.tolist() == [score for score, _ in want], budget
    assert_consistent_with_logits(build_tree(logits, len(ordered)), logits)


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(depth=st.integers(1, 6), vocab=st.integers(1, 40), budget=st.integers(0, 80), seed=st.integers(0, 2**16),
       ties=st.booleans(), scale=st.sampled_from([0.3, 2.0, 8.0]))
def test_property_fast_equals_reference_and_is_valid(depth, vocab, budget, seed, ties, scale) -> None:
    logits = random_logits(depth, vocab, seed, scale=scale, ties=ties)
    fast, reference = build_tree(logits, budget), reference_build_tree(logits, budget)
    assert_same_tree(fast, reference)
    num_prefixes = sum(vocab ** d for d in range(1, depth + 1))
    assert len(fast) == min(budget, num_prefixes)
    assert_consistent_with_logits(fast, logits)
    if len(fast):
        assert fast.expected_acceptance() == pytest.approx(1 + math.fsum(math.exp(x) for x in fast.log_probs.tolist()))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(depth=st.integers(1, 4), vocab=st.integers(2, 5), seed=st.integers(0, 2**16), ties=st.booleans())
def test_property_prefix_sets_are_nested_and_best(depth, vocab, seed, ties) -> None:
    """The tree for budget B is the first B nodes of the tree for any larger budget, and equals the brute force."""
    logits = random_logits(depth, vocab, seed, scale=2.0, ties=ties)
    ordered = all_prefixes_canonical(logits)
    full = build_tree(logits, len(ordered))
    assert tree_paths(full) == [path for _, path in ordered]
    for budget in range(len(ordered) + 1):
        tree = build_tree(logits, budget)
        assert torch.equal(tree.parents, full.parents[:budget])
        assert torch.equal(tree.token_ids, full.token_ids[:budget])


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(depth=st.integers(1, 8), vocab=st.integers(1, 3000), budget=st.integers(1, 120), seed=st.integers(0, 2**16),
       ties=st.booleans(), drafter=st.booleans())
def test_property_both_selection_strategies_agree(depth, vocab, budget, seed, ties, drafter) -> None:
    """select_prefixes picks the heap for small budgets and the depth-by-depth enumeration for larger ones; both
    must give the same nodes on the same candidate rows, whatever the budget."""
    logits = drafter_like_logits(depth, vocab, seed) if drafter and vocab > 3 else random_logits(depth, vocab, seed)
    logits = logits.round() if ties else logits
    for complete in (False, True):
        candidates = top_candidates(logits, budget, complete=complete)
        by_levels = build_module._select_by_levels(candidates, budget)
        by_heap = build_module._select_by_heap(candidates, budget)
        assert (by_levels is None) == (by_heap is None)
        if by_levels is not None:
            assert_same_tree(by_levels.to_tree(), by_heap.to_tree())


# ---------------------------------------------------------------------------------------------- fast == reference


@pytest.mark.parametrize("vocab", [49152])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ["randn", "drafter"])
def test_fast_equals_reference_on_large_vocab(vocab: int, seed: int, kind: str) -> None:
    logits = random_logits(15, vocab, seed) if kind == "randn" else drafter_like_logits(15, vocab, seed)
    for budget in (1, 16, 64, 512, 1024):
        assert_same_tree(build_tree(logits, budget), reference_build_tree(logits, budget))
        # the candidate search must suffice on its own (no silent refetch of complete rows)
        assert select_prefixes(top_candidates(logits, budget), budget) is not None


def test_fast_equals_reference_on_chunked_path_with_tail() -> None:
    """A vocabulary that is not a multiple of the chunk size (tail tokens) and several depths/budgets."""
    vocab = 3000 + 17
    for seed, depth, budget in [(0, 15, 64), (1, 3, 200), (2, 15, 700), (3, 1, 40), (4, 8, 1)]:
        logits = drafter_like_logits(depth, vocab, seed)
        logits[:, -5:] += 12.0  # make some tail tokens win
        assert_same_tree(build_tree(logits, budget), reference_build_tree(logits, budget))
        assert_consistent_with_logits(build_tree(logits, min(budget, 64)), logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_inputs(dtype: torch.dtype) -> None:
    """Half-precision logits have many exact ties, which both builders break the same canonical way."""
    logits = random_logits(15, 49152, seed=3).to(dtype)
    for budget in (16, 100, 512):
        fast = build_tree(logits, budget)
        assert_same_tree(fast, reference_build_tree(logits, budget))
        assert_consistent_with_logits(fast, logits)


def test_ties_at_the_rank_k_boundary_of_the_first_row() -> None:
    """A flat first row over a flat second row: the tree is B depth-1 siblings, all tied, so ranks up to K-1 = B-1
    are used and which tied tokens fill them must not depend on torch.topk's choice: the smallest ids, in order."""
    for vocab, budget in [(8192, 100), (8192, 40), (500, 300), (49152, 1024)]:
        logits = random_logits(15, vocab, seed=vocab + budget)
        logits[0] = 0.0
        fast = build_tree(logits, budget)
        assert_same_tree(fast, reference_build_tree(logits, budget))
        assert bool((fast.depths == 1).all()) and fast.token_ids.tolist() == list(range(budget))


def test_non_contiguous_input() -> None:
    base = random_logits(49152, 15, seed=5).t()  # [15, 49152] view with strides (1, 15)
    assert not base.is_contiguous()
    strided = random_logits(15, 2 * 49152, seed=6)[:, ::2]
    for logits in (base, strided):
        for budget in (64, 512):
            tree = build_tree(logits, budget)
            assert_same_tree(tree, reference_build_tree(logits, budget))
            assert_same_tree(tree, build_tree(logits.contiguous(), budget))


def test_edge_cases_budget_depth_vocab() -> None:
    logits = random_logits(4, 100, seed=7)
    assert len(build_tree(logits, 0)) == 0 and build_tree(logits, 0).expected_acceptance() == 1.0
    assert len(build_tree(logits[:0], 10)) == 0  # no rows, no prefixes
    depth_one = build_tree(logits[:1], 1000)  # depth 1: the whole row, best first
    assert_same_tree(depth_one, reference_build_tree(logits[:1], 1000))
    assert len(depth_one) == 100 and bool((depth_one.depths == 1).all())
    assert depth_one.token_ids.tolist() == torch.argsort(-logits[0], stable=True).tolist()
    tiny = random_logits(2, 3, seed=8)  # budget above the number of prefixes (3 + 9)
    assert len(build_tree(tiny, 100)) == 12
    assert_same_tree(build_tree(tiny, 100), reference_build_tree(tiny, 100))
    small_vocab = random_logits(15, 100, seed=9)  # vocab < budget
    assert_same_tree(build_tree(small_vocab, 1024), reference_build_tree(small_vocab, 1024))
    single = build_tree(torch.zeros(3, 1), 5)  # vocab 1: a chain
    assert single.parents.tolist() == [-1, 0, 1] and single.log_probs.tolist() == [0.0, 0.0, 0.0]
    uniform = build_tree(torch.zeros(2, 4096), 3000)  # massive ties: canonical order is token order
    assert uniform.token_ids.tolist() == list(range(3000)) and bool((uniform.depths == 1).all())


def test_minus_infinity_logits_and_the_heap_fallback() -> None:
    """Masked tokens (-inf) are legal; with fewer finite tokens than the budget the builder must neither blow up
    (enumerating every zero-probability prefix) nor differ from the reference."""
    logits = torch.full((15, 50), -math.inf)
    logits[:, :2] = random_logits(15, 2, seed=10)
    for budget in (5, 300, 1024):
        assert_same_tree(build_tree(logits, budget), reference_build_tree(logits, budget))
    big = torch.full((15, 5000), -math.inf)
    big[:, :3] = random_logits(15, 3, seed=11)
    for budget in (10, 700):
        assert_same_tree(build_tree(big, budget), reference_build_tree(big, budget))


def test_short_candidate_rows_are_detected_and_refetched(monkeypatch: pytest.MonkeyPatch) -> None:
    """select_prefixes must refuse rows that were cut too short, and build_tree must then use complete rows."""
    logits = drafter_like_logits(6, 300, seed=12)
    budget = 200
    complete = top_candidates(logits, budget, complete=True)
    assert select_prefixes(complete, budget) is not None

    def truncated(keep: int) -> build_module.CandidateRows:
        rows = complete.rows
        ranks = np.arange(rows.size) - complete.row_start[rows]
        mask = (rows != 0) | (ranks < keep)
        cutoff = complete.cutoff.copy()
        # every missing token is at most the first missing one, hence strictly below the next float up
        cutoff[0] = np.nextafter(complete.log_probs[complete.row_start[0] + keep], np.inf)
        counts = np.bincount(rows[mask], minlength=rows.max() + 1)
        row_start = np.concatenate([[0], np.cumsum(counts)])
        return build_module.CandidateRows(row_start, rows[mask], complete.token_ids[mask], complete.log_probs[mask],
                                       cutoff, complete.max_rank, complete.reachable_rows)

    reference = reference_build_tree(logits, budget)
    used_first_row = int(reference.token_ids[reference.depths == 1].numel())
    assert select_prefixes(truncated(used_first_row - 1), budget) is None
    enough = select_prefixes(truncated(used_first_row + 1), budget)
    assert enough is not None and tree_paths(enough.to_tree()) == tree_paths(reference)

    calls = []
    original = build_module.top_candidates

    def first_call_truncated(draft_logits, budget_, complete_=False, **kwargs):
        calls.append(complete_ or kwargs.get("complete", False))
        return truncated(used_first_row - 1) if len(calls) == 1 else original(draft_logits, budget_, True)

    monkeypatch.setattr(build_module, "top_candidates", first_call_truncated)
    assert_same_tree(build_module.build_tree(logits, budget), reference)
    assert len(calls) == 2


def test_candidate_rows_are_sorted_truncated_and_flagged() -> None:
    """Rows sort by (log-prob desc, token asc), keep at most K tokens, and only rows that reached K count as
    complete (cutoff -inf); a row that stops at its cutoff must keep the cutoff, or exactness is unchecked."""
    rows = np.array([0, 0, 0, 0, 1, 1, 2])
    tokens = np.array([5, 2, 9, 7, 4, 3, 8])
    values = np.array([-1.0, -0.5, -1.0, -3.0, -2.0, -2.0, -0.1], dtype=np.float32)
    cutoff = np.array([-9.0, -2.5, -0.2])
    candidates = build_module._sorted_candidates(rows, tokens, values, np.array([-0.5, -2.0, -0.1]), cutoff, 3)
    assert candidates.row_start.tolist() == [0, 3, 5, 6]
    assert candidates.token_ids.tolist() == [2, 5, 9, 3, 4, 8]  # row 0 cut at K = 3; ties by token id
    assert candidates.cutoff.tolist() == [-math.inf, -2.5, -0.2]  # rows 1 and 2 hold fewer than K tokens
    assert candidates.reachable_rows == 3 and cutoff.tolist() == [-9.0, -2.5, -0.2]  # input not modified


def test_device_gather_path_matches_in_place_path() -> None:
    """The accelerator path (gather on the device, one packed copy) run on CPU tensors equals the numpy path."""
    logits = drafter_like_logits(15, 5000, seed=16)
    log_probs = torch.log_softmax(logits, dim=-1)
    body = log_probs[:, : 78 * 64].reshape(15, 78, 64)
    tail = log_probs[:, 78 * 64:]
    chunk_max = body.amax(-1)
    row_max = torch.maximum(chunk_max.amax(-1), tail.amax(-1))
    cutoff = row_max - 3.0
    in_place = build_module._open_chunks_in_place(body, tail, chunk_max, row_max, cutoff)
    copied = build_module._open_chunks_and_copy(body, tail, chunk_max, row_max, cutoff)
    assert in_place[2].size > 0
    for a, b in zip(in_place, copied):
        assert a.shape == b.shape and np.array_equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_match_cpu() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        logits = random_logits(15, 49152, seed=13).to(dtype)
        for budget in (16, 512):
            gpu = build_tree(logits.cuda(), budget)
            assert gpu.token_ids.device.type == "cpu"
            cpu = build_tree(logits, budget)
            assert torch.equal(gpu.parents, cpu.parents) and torch.equal(gpu.depths, cpu.depths)
            gpu.validate()


# ---------------------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("logits,budget,error,match", [
    ([[0.0, 1.0]], 3, TypeError, "torch.Tensor"),
    (torch.zeros(2, 3, dtype=torch.int64), 3, TypeError, "float"),
    (torch.zeros(5), 3, ValueError, r"\[depth, vocab\]"),
    (torch.zeros(2, 3, 4), 3, ValueError, r"\[depth, vocab\]"),
    (torch.zeros(2, 0), 3, ValueError, "empty vocabulary"),
    (torch.zeros(2, 3), -1, ValueError, ">= 0"),
    (torch.zeros(2, 3), 2.0, TypeError, "int"),
    (torch.zeros(2, 3), True, TypeError, "int"),
    (torch.tensor([[0.0, float("nan")], [0.0, 1.0]]), 3, ValueError, "row 0"),
    (torch.tensor([[0.0, 1.0], [float("inf"), 1.0]]), 3, ValueError, "row 1"),
    (torch.full((2, 3), -math.inf), 3, ValueError, "row 0"),
])
@pytest.mark.parametrize("builder", [build_tree, reference_build_tree])
def test_bad_inputs_raise_clear_errors(builder, logits, budget, error, match) -> None:
    with pytest.raises(error, match=match):
        builder(logits, budget)


def test_nan_in_a_large_vocabulary_is_caught() -> None:
    logits = random_logits(4, 8192, seed=14)
    logits[2, 100] = float("nan")
    for builder in (build_tree, reference_build_tree):
        with pytest.raises(ValueError, match="row 2"):
            builder(logits, 64)


def test_numpy_integer_budget_and_grad_input() -> None:
    logits = random_logits(3, 2000, seed=15).requires_grad_()
    assert_same_tree(build_tree(logits, np.int64(40)), reference_build_tree(logits, 40))
