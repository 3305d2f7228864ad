"""The CPU builder's row blocks: rows are log-softmaxed ROW_BLOCK at a time and the search stops at the first row that
no tree prefix can reach. Oracle: the plain heap reference (every row, complete top-K), bit for bit, and the
candidate rows must prove themselves exact (``select_prefixes`` not None: no silent refetch of complete rows, which
would hide a wrong stop behind a correct but slow result).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddtree.build as build_module
from ddtree.build import ROW_BLOCK, build_tree, reference_build_tree, select_prefixes, top_candidates


def flat_logits(depth: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    """N(0, scale^2) logits: every row is flat, so the tree is a few levels deep."""
    return torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def confident_logits(depth: int, vocab: int, seed: int, sure_rows: int) -> torch.Tensor:
    """A near-certain token in each of the first ``sure_rows`` rows (the chain stays near 0, so deep rows matter),
    then flat rows."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, vocab, generator=g) * 2.0
    for row in range(min(sure_rows, depth)):
        logits[row, int(torch.randint(0, vocab, (1,), generator=g))] += 40.0
    return logits


def rows_looked_at(candidates: build_module.CandidateRows) -> int:
    """Rows the candidate search log-softmaxed: the rest carry cutoff 0 and no candidate."""
    never = np.flatnonzero((candidates.cutoff == 0.0) & (np.diff(candidates.row_start) == 0))
    return int(never[0]) if never.size else candidates.cutoff.size


def assert_exact(logits: torch.Tensor, budget: int) -> None:
    fast, reference = build_tree(logits, budget), reference_build_tree(logits, budget)
    for name in ("token_ids", "parents", "depths", "log_probs"):
        a, b = getattr(fast, name), getattr(reference, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert select_prefixes(top_candidates(logits, budget), budget) is not None


@pytest.mark.parametrize("vocab", [8192, 8192 + 37, 49152])
@pytest.mark.parametrize("budget", [16, 64, 512])
def test_a_flat_draft_stops_after_the_first_block_and_stays_exact(vocab: int, budget: int) -> None:
    """Flat rows: the chain drops ~2-3 nats a row, so the tree is 2-4 levels deep and the rows below are skipped
    (all but the first block where a row has enough chunk maxima for a tight tau; 8192 has only 128 a row)."""
    logits = flat_logits(15, vocab, seed=vocab + budget)
    looked = rows_looked_at(top_candidates(logits, budget))
    assert int(build_tree(logits, budget).depths.max()) <= looked
    assert looked == ROW_BLOCK if vocab >= 49152 or budget < 512 else looked < 15
    assert_exact(logits, budget)


@pytest.mark.parametrize("sure_rows", [3, 4, 5, 9, 15])
def test_deep_confident_chains_read_as_many_blocks_as_they_need(sure_rows: int) -> None:
    """A near-certain chain through ``sure_rows`` rows pulls nodes down to depth sure_rows + 1 or so: the search
    must read past every block boundary that a deep node needs (a stop one block early fails the exactness check,
    a missing row would change the tree)."""
    logits = confident_logits(15, 8192, seed=sure_rows, sure_rows=sure_rows)
    for budget in (32, 512):
        tree = build_tree(logits, budget)
        looked = rows_looked_at(top_candidates(logits, budget))
        assert looked >= int(tree.depths.max()) and looked <= 15
        assert_exact(logits, budget)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_row_blocks_give_bit_identical_log_probs_in_every_dtype(dtype: torch.dtype) -> None:
    """Each block is log-softmaxed on its own (into a slice of one buffer): the values must equal the reference's
    one call over all rows, including the many exact ties of half precision."""
    logits = confident_logits(15, 8192 + 5, seed=1, sure_rows=9).to(dtype)
    for budget in (64, 512):
        assert_exact(logits, budget)


def test_non_contiguous_logits_in_row_blocks() -> None:
    base = confident_logits(15, 2 * 8192, seed=2, sure_rows=8)
    for logits in (base[:, ::2], base[:, :8192 + 11], base.t().contiguous().t()[:, :8192]):
        assert not logits.is_contiguous() or logits.shape[1] == 8192
        assert_exact(logits, 200)


@pytest.mark.parametrize("row,value", [(12, math.nan), (14, math.inf), (9, -math.inf)])
def test_a_bad_row_that_is_never_log_softmaxed_still_raises(row: int, value: float) -> None:
    """The reference rejects NaN, +inf and all -inf rows anywhere; skipping a row must not skip its check."""
    logits = flat_logits(15, 8192, seed=3)
    if value == -math.inf:
        logits[row] = value
    else:
        logits[row, 4321] = value
    for builder in (build_tree, reference_build_tree):
        with pytest.raises(ValueError, match=f"row {row} has no finite"):
            builder(logits, 64)


def test_a_budget_above_one_row_of_chunk_maxima_opens_a_larger_first_block() -> None:
    """V = 2048 has 32 chunk maxima a row: B = 300 needs ceil(300 / 32) = 10 rows before tau can exist. The tree is
    one level deep; the search reads one more row (tau, the 300th of 320 entries, is loose) and stops. A first
    block of 4 rows would give no tau and a second block of 8, ending at row 12."""
    logits = flat_logits(15, 2048, seed=4, scale=1.0)
    assert rows_looked_at(top_candidates(logits, 300)) <= 11
    assert_exact(logits, 300)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(depth=st.integers(1, 15), vocab=st.integers(1024, 4200), budget=st.integers(1, 700),
       sure_rows=st.integers(0, 15), scale=st.sampled_from([0.5, 2.0, 4.0]), seed=st.integers(0, 2**16),
       ties=st.booleans())
def test_property_row_blocks_equal_the_reference(depth, vocab, budget, sure_rows, scale, seed, ties) -> None:
    logits = confident_logits(depth, vocab, seed, sure_rows) * (scale / 2.0)
    logits = logits.round() if ties else logits
    fast, reference = build_tree(logits, budget), reference_build_tree(logits, budget)
    assert fast.equals(reference)
    if not ties:  # with exact ties a refetch is legitimate; without them the candidate rows must suffice
        assert select_prefixes(top_candidates(logits, budget), budget) is not None


@pytest.mark.parametrize("vocab", [8192, 8192 + 37])
def test_the_accelerator_path_run_on_cpu_tensors_gives_the_same_tree(vocab: int) -> None:
    """CUDA takes every row at once (``_candidates_on_device``); on CPU tensors it must give the reference's tree too,
    from candidates that suffice on their own."""
    for logits in (flat_logits(15, vocab, seed=5), confident_logits(15, vocab, seed=6, sure_rows=9)):
        for budget in (16, 512):
            candidates = build_module._candidates_on_device(build_module._log_softmax(logits), budget,
                                                            min(budget, vocab))
            selected = select_prefixes(candidates, budget)
            assert selected is not None and selected.to_tree().equals(reference_build_tree(logits, budget))
