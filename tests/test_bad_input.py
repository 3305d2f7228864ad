"""Bad input a new user may pass: each ends in a clear error (what is wrong, how to fix it) or a documented result,
and none can exhaust the machine."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import torch

from conftest import make_draft, make_target, prompt
from ddtree import build_tree, ddtree_generate
from ddtree.build import reference_build_tree
from ddtree.generate import FixedBudget, make_policy
from ddtree.sampled import SampledTreePolicy
from dflash_core import autoregressive_generate, load_draft
from dflash_core.tree import DraftBlock


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama", vocab=64, layers=4, hidden=32)
    return target, make_draft(target, block_size=4, layers=1, taps=2)


def test_a_huge_budget_is_refused_before_any_work(pair):
    """budget=10**6: the tree would hold all 64 + 64^2 + 64^3 = 266,304 prefixes, whose verify forward needs
    hundreds of GiB: a clear error instead of a process killed by the operating system."""
    with pytest.raises(ValueError, match=r"budget=1000000: a tree of 266304 nodes cannot be verified"):
        ddtree_generate(pair[0], pair[1], prompt(0, 6, 64), budget=10**6, max_new_tokens=12)


def test_a_budget_above_the_prefix_count_is_capped_by_the_draft(pair):
    """A drafter of 2 depths over 64 tokens has 64 + 64^2 = 4,160 prefixes: budget 10**5 builds at most those, and
    the output is plain decoding's."""
    target = pair[0]
    draft = make_draft(target, block_size=3, layers=1, taps=2)
    x = prompt(0, 6, 64)
    got = ddtree_generate(target, draft, x, budget=10**5, max_new_tokens=8)
    assert got.new_token_ids == autoregressive_generate(target, x, 8).new_token_ids
    assert max(got.tree_sizes) <= 64 + 64 ** 2


def test_a_budget_too_large_to_verify_names_the_largest_that_fits(pair, monkeypatch):
    import ddtree.generate as gen

    monkeypatch.setattr(gen, "_memory_bytes", lambda device: 4 * 2**20)  # a machine with 4 MiB
    with pytest.raises(ValueError, match=r"budget=2000: .* use a budget of at most \d+"):
        ddtree_generate(pair[0], pair[1], prompt(0, 6, 64), budget=2000, max_new_tokens=4)


def test_build_tree_memory_grows_with_the_nodes_not_the_vocabulary_squared():
    """A budget far above what a depth-by-depth enumeration can hold (60,000 nodes over 8,192 tokens: the old
    enumeration allocated an [8192, ~8192] outer sum, about 1.1 GB) runs the heap, equal to the reference."""
    logits = torch.randn(15, 8192, generator=torch.Generator().manual_seed(0)) * 0.3
    tracemalloc.start()
    try:
        tree = build_tree(logits, 60_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    ref = reference_build_tree(logits, 60_000)
    assert torch.equal(tree.token_ids, ref.token_ids) and torch.equal(tree.parents, ref.parents)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5, "0.7", True])
def test_temperature_must_be_a_finite_number(pair, temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        autoregressive_generate(pair[0], prompt(0, 5, 64), 4, temperature=temperature)
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        ddtree_generate(pair[0], pair[1], prompt(0, 5, 64), budget=4, max_new_tokens=4, temperature=temperature)


def test_a_prompt_longer_than_the_targets_positions_is_refused(pair):
    target = pair[0]  # max_position_embeddings = 512
    with pytest.raises(ValueError, match="shorten the prompt"):
        autoregressive_generate(target, prompt(0, 600, 64), 4)
    with pytest.raises(ValueError, match="lower max_new_tokens to at most 12"):
        ddtree_generate(target, pair[1], prompt(0, 500, 64), budget=4, max_new_tokens=20)
    assert len(autoregressive_generate(target, prompt(0, 500, 64), 12).new_token_ids) == 12  # exactly fits


@pytest.mark.parametrize("stops", [[64], [-1], [10**6], ["2"]])
def test_stop_token_ids_must_be_tokens_of_the_target(pair, stops):
    with pytest.raises(ValueError, match="stop token id .* is not a token of the target"):
        ddtree_generate(pair[0], pair[1], prompt(0, 5, 64), budget=4, max_new_tokens=4, stop_token_ids=stops)


def test_a_damaged_config_json_names_the_file_and_the_fix(tmp_path, pair):
    pair[1].save_pretrained(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text('{"hidden_size": 32,')  # truncated
    with pytest.raises(ValueError, match=r"config.json is not valid JSON .*restore it"):
        load_draft(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="not an object of config fields"):
        load_draft(tmp_path / "d")


def test_a_sampled_tree_over_a_row_without_finite_probabilities_says_so():
    logits = torch.randn(3, 10)
    logits[0] = float("-inf")
    with pytest.raises(ValueError, match="row 0 has no finite probabilities"):
        SampledTreePolicy(4, temperature=1.0).propose(DraftBlock(logits, None, 0, 10), [0])


def test_numpy_integer_budgets_are_budgets():
    assert FixedBudget(np.int64(5)).budget == 5 and isinstance(FixedBudget(np.int64(5)).budget, int)
    assert make_policy(np.int32(6), tree="sampled", temperature=1.0).budget == 6
    assert len(build_tree(torch.randn(3, 10), np.int64(4)).token_ids) == 4


def test_auto_validates_the_input_before_it_measures_anything(pair, monkeypatch):
    from ddtree import budget as budget_module

    def measured(*args, **kwargs):
        raise AssertionError("the cost curve was measured before the input was validated")

    monkeypatch.setattr(budget_module.AutoBudget, "for_models", classmethod(measured))
    with pytest.raises(ValueError, match="empty"):
        ddtree_generate(pair[0], pair[1], torch.zeros((1, 0), dtype=torch.long), budget="auto")


# ---------------------------------------------------------------------------------------------------- files
def test_an_interrupted_write_leaves_the_old_file_whole(tmp_path):
    from dflash_core.files import atomic_write, write_text_atomic

    path = tmp_path / "config.json"
    write_text_atomic(path, "old\n")

    def crash(tmp):
        tmp.write_text("half of a new fi")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, crash)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_an_object_that_is_no_policy_says_what_it_lacks(pair):
    class Half:
        name = "half"

        def propose(self, draft_logits, history):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="Half is not a policy: subclass dflash_core.BlockPolicy"):
        ddtree_generate(pair[0], pair[1], prompt(0, 5, 64), max_new_tokens=4, policy=Half())
