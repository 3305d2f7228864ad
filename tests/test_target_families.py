"""Target families beyond dense full attention: sliding-window layers (Qwen3 with use_sliding_window, Mistral, Gemma 3,
gpt-oss with its attention sinks), multi-head latent attention (DeepSeek-V3) and hybrid linear attention (Qwen3-Next
with its experts, Qwen3.5: Gated DeltaNet layers and gated full attention), tiny random configurations from
transformers' own config classes, generated well past the window.

Oracles: every node's logits from one tree forward equal a forward over its root path alone, on the cache and
without one (the model's own full-sequence forward); greedy DDTree (chain, budgets 8 and 64, an oracle tree whose
deep paths are accepted, lookup branches, ``auto``) equals plain decoding and the independent cache-free reference;
mixed-length batches equal their solo runs; at T = 1 the loop's first tokens pass a chi-square test against the exact
joint. Broken variants are caught: a window one position wider, a node that also sees the node before it, a
recurrent layer run left to right over the flattened tree (a node reading its earlier siblings' state).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import dflash_core.target as target_module
from conftest import answer_counts, forward_one, make_draft, prompt, sampled_answers
from experiments.bench.models import FAMILY_TARGETS, family_target as sliding_target
from ddtree import build_tree, ddtree_generate
from dflash_core import autoregressive_generate, check_compatibility, speculative_generate
from dflash_core.decoding import LiveModels
from dflash_core.target import IncompatibleModelError, TargetAdapter
from greedy_reference import exact_joint, greedy_reference
from test_ddtree_generate import OracleTree, PeakedTree, _root_path
from test_decoding import chi_square_p
from test_sampling_temperature import FixedSampled

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILIES = FAMILY_TARGETS
SLIDING = ("qwen3", "mistral", "gemma3", "gpt_oss")
HYBRID = ("qwen3_next", "qwen3_5")
assert set(SLIDING + HYBRID + ("deepseek_v3",)) == set(FAMILIES)
WINDOW = 4  # family_target's default



def test_each_family_reports_its_layout_and_what_is_refused_says_why():
    reports = {f: check_compatibility(t, make_draft(t)) for f in FAMILIES for t in [sliding_target(f)]}
    assert "sliding window 4 in 3 of 4 layers" in reports["qwen3"]
    assert "sliding window 4 in every layer" in reports["mistral"]
    assert "sliding window 4 in 2 of 4 layers" in reports["gemma3"] and "2 of 4" in reports["gpt_oss"]
    assert "full in every layer" in reports["deepseek_v3"]
    for family in HYBRID:
        assert "full in 1 of 4 layers, linear (Gated DeltaNet) in 3" in reports[family]
    other = sliding_target("qwen3")
    other.config.layer_types = ["full_attention", "conv", "conv", "full_attention"]  # an LFM2-style mixer
    with pytest.raises(IncompatibleModelError, match="kind conv are not supported.*own per-node state"):
        TargetAdapter(other)
    other.config.layer_types = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    with pytest.raises(IncompatibleModelError, match="2 linear_attention layers.*has 0 Gated DeltaNet"):
        TargetAdapter(other)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_node_of_a_tree_sees_what_its_path_alone_sees(family):
    """One tree forward on a context longer than the window: each node's logits and features equal a forward over
    its root path alone (the model's own causal and sliding masks)."""
    adapter, models, tree, p = deep_tree_case(family)
    assert tree.max_depth > WINDOW  # deep nodes reach past the window through their ancestors alone
    check_nodes(adapter, models, tree, p)


def deep_tree_case(family: str):
    """(adapter, models holding an 11-token prompt, a 24-node tree deeper than the window, the prompt)."""
    adapter = TargetAdapter(sliding_target(family), (0, 2))
    p = prompt(3, 11, 48)
    models = LiveModels.prefilled(adapter, None, [p])[0]
    return adapter, models, build_tree(torch.randn(8, 48, generator=torch.Generator().manual_seed(3)) * 8, 24), p


def check_nodes(adapter, models, tree, p: torch.Tensor) -> None:
    """Each node's logits and features from one tree forward equal those of its root path run alone on the cache
    (the adapter's own causal forward) and the model's own forward over the whole sequence without a cache."""
    start = p.shape[1]
    base = copy.deepcopy(models.cache)
    logits, features = models.verify([0], [tree], [7])[0], models._features[0]
    tol = dict(atol=2e-4, rtol=1e-4)
    for node in [-1] + list(range(len(tree))):
        path = _root_path(tree, node) if node >= 0 else []
        seq = torch.tensor([7] + [int(tree.token_ids[i]) for i in path])
        ref_logits, ref_features = forward_one(adapter, seq, start + torch.arange(len(seq)), copy.deepcopy(base))
        torch.testing.assert_close(logits[node + 1], ref_logits[-1], **tol)
        torch.testing.assert_close(features[node + 1], ref_features[-1], **tol)
        with torch.no_grad():
            own = adapter.model(input_ids=torch.cat([p[0], seq])[None], use_cache=False).logits[0, -1]
        torch.testing.assert_close(logits[node + 1], own.float(), **tol)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_trees_equal_plain_decoding_and_the_reference_past_the_window(family):
    target = sliding_target(family, window=2)
    draft = make_draft(target, block_size=6, dtype=next(target.parameters()).dtype)
    accepted = []
    for seed in range(2):
        p = prompt(10 + seed, 9, 48)
        ref = greedy_reference(target, p, 24)
        assert autoregressive_generate(target, p, 24).new_token_ids == ref
        for kwargs in (dict(budget="chain"), dict(budget=8), dict(budget=64), dict(budget=16, lookup=True),
                       dict(budget="auto")):
            assert ddtree_generate(target, draft, p, max_new_tokens=24, **kwargs).new_token_ids == ref, kwargs
        oracle = ddtree_generate(target, draft, p, max_new_tokens=24, policy=OracleTree(ref, 9, 32, seed))
        assert oracle.new_token_ids == ref
        accepted += oracle.acceptance_lengths
    assert max(accepted) > 2  # a round accepted a path longer than the window


@pytest.mark.parametrize("family", ("gemma3",) + HYBRID)
def test_a_mixed_length_batch_equals_its_solo_runs(family):
    target = sliding_target(family)
    draft = make_draft(target, block_size=6)
    prompts = [prompt(20 + i, n, 48) for i, n in enumerate((3, 9, 14))]
    batch = ddtree_generate(target, draft, prompts, budget=16, max_new_tokens=20)
    assert [r.new_token_ids for r in batch] == [greedy_reference(target, p, 20) for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_node_that_also_sees_the_node_before_it_is_caught(family, monkeypatch):
    adapter, models, tree, p = deep_tree_case(family)
    masks = TargetAdapter.masks

    def leaky(self, visible, positions):
        n = visible.shape[1]
        visible = visible.clone()
        visible[:, torch.arange(1, n), visible.shape[2] - n + torch.arange(n - 1)] = True  # node i sees node i - 1
        return masks(self, visible, positions)

    monkeypatch.setattr(target_module.TargetAdapter, "masks", leaky)
    with pytest.raises(AssertionError):
        check_nodes(adapter, models, tree, p)


@pytest.mark.parametrize("family", HYBRID)
def test_a_recurrent_layer_run_over_the_flattened_tree_is_caught(family, monkeypatch):
    """The naive hybrid verify: the Gated DeltaNet layers run left to right over the flattened tree, so a node reads
    the state after its earlier siblings and their subtrees instead of its parent's."""
    adapter, models, tree, p = deep_tree_case(family)
    levels = target_module.tree_levels
    monkeypatch.setattr(target_module, "tree_levels", lambda visible, b, n: levels(None, b, n))
    with pytest.raises(AssertionError):
        check_nodes(adapter, models, tree, p)


@pytest.mark.parametrize("family", HYBRID)
def test_a_hybrid_round_commits_the_accepted_nodes_state_and_rewinds_one_round(family):
    """After a tree round, the committed recurrent state is the one plain decoding reaches on the accepted path;
    ``rewind`` returns to the state before the commit, and going back further is refused with the reason."""
    target = sliding_target(family)
    adapter = TargetAdapter(target, ())
    p = prompt(5, 9, 48)
    models = LiveModels.prefilled(adapter, None, [p], with_features=False)[0]
    tree = build_tree(torch.randn(6, 48, generator=torch.Generator().manual_seed(1)) * 8, 16)
    deepest = int(tree.depths.argmax())
    path = _root_path(tree, deepest)
    models.verify([0], [tree], [7])
    models.commit([0], [path], [[0]])
    after = [int(t) for t in [7] + [tree.token_ids[i] for i in path]]
    plain = LiveModels.prefilled(adapter, None, [torch.cat([p, torch.tensor([after])], dim=1)], with_features=False)[0]
    for ours, theirs in zip(models.cache.layers, plain.cache.layers):
        if isinstance(ours, target_module.RecurrentLayer):
            for a, b in zip(ours.state(), theirs.state()):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            assert ours.lengths == theirs.lengths == [p.shape[1] + len(after)]
    before = copy.deepcopy(models.cache)
    models.rewind([p.shape[1]])
    fresh = LiveModels.prefilled(adapter, None, [p], with_features=False)[0]
    for ours, theirs in zip(models.cache.layers, fresh.cache.layers):
        if isinstance(ours, target_module.RecurrentLayer):
            for a, b in zip(ours.state(), theirs.state()):
                torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="recurrent .* can go back only to its state before the last commit"):
        adapter.crop(before, p.shape[1] - 1)


@pytest.mark.parametrize("family", SLIDING)
def test_a_window_one_position_too_wide_is_caught(family, monkeypatch):
    target = sliding_target(family)
    draft = make_draft(target, block_size=6, dtype=next(target.parameters()).dtype)
    masks = TargetAdapter.masks

    def wider(self, visible, positions):
        self.window += 1
        try:
            return masks(self, visible, positions)
        finally:
            self.window -= 1

    monkeypatch.setattr(target_module.TargetAdapter, "masks", wider)
    wrong = 0
    for seed in range(3):
        p = prompt(10 + seed, 9, 48)
        ref = greedy_reference(target, p, 24)
        wrong += ddtree_generate(target, draft, p, max_new_tokens=24,
                                 policy=OracleTree(ref, 9, 32, seed)).new_token_ids != ref
    assert wrong


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_through_trees_matches_the_target_past_the_window(family):
    """T = 1, a 6-token vocabulary and a window of 2, so the first three tokens after a 3-token prompt are sampled
    under sliding masks: top-K and sampled trees against the exact joint of plain sampling."""
    target = sliding_target(family, vocab=6, window=2, layers=2, dtype=torch.float32)
    draft = make_draft(target, block_size=4, dtype=torch.float32)
    p = prompt(1, 3, 6)
    joint = exact_joint(target, p, 3, 1.0)
    for make in (lambda seed: PeakedTree(), lambda seed: FixedSampled(6, 1.0, seed=seed)):
        counts = answer_counts(sampled_answers(lambda seeds: speculative_generate(
            target, draft, [p] * len(seeds), [make(seed) for seed in seeds], max_new_tokens=3, temperature=1.0,
            seed=seeds[0]), 300))
        assert chi_square_p(counts, joint, 300) > 1e-3


def test_the_adapters_logits_are_the_models_own_with_gemmas_final_soft_cap():
    target = sliding_target("gemma3")
    target.config.final_logit_softcapping = 0.5  # small enough to change every logit
    adapter, ids = TargetAdapter(target), prompt(2, 12, 48)
    with torch.no_grad():
        own = target(input_ids=ids, use_cache=False).logits[0].float()
        hidden = target.model(input_ids=ids, use_cache=False).last_hidden_state[0]
    assert not torch.allclose(target.lm_head(hidden).float(), own, atol=1e-3)  # the cap matters here
    models = LiveModels.prefilled(adapter, None, [ids[:, :-1]])[0]
    logits = models.verify([0], [build_tree(torch.zeros(1, 48), 0)], [int(ids[0, -1])])[0]
    torch.testing.assert_close(logits[0], own[-1], atol=1e-6, rtol=1e-6)


def test_the_family_cost_study_runs_and_writes_its_rows(tmp_path):
    from experiments.studies.target_families import main

    out = tmp_path / "families.json"
    main(["--families", "mistral,deepseek_v3", "--context", "32", "--repeats", "1", "--prompts", "1",
          "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [r["family"] for r in rows] == ["mistral", "deepseek_v3"]
    assert all(r["greedy_equal"] == {"16": "1/1", "64": "1/1"} and r["verify_64_ms"] > 0 for r in rows)
    with pytest.raises(SystemExit, match="unknown family"):
        main(["--families", "lfm2"])


def test_a_random_drafter_for_gemma_takes_the_full_attention_layers_rotary():
    from dflash_core.config import target_rope
    from experiments.bench.models import random_draft

    target = sliding_target("gemma3", dtype=torch.float32)
    kinds = target.config.rope_parameters
    assert kinds["full_attention"]["rope_theta"] != kinds["sliding_attention"]["rope_theta"]
    assert target_rope(target.config)[0] == kinds["full_attention"]["rope_theta"]
    assert random_draft(target, taps=2).config.rope_theta == kinds["full_attention"]["rope_theta"]


@pytest.mark.parametrize("family", HYBRID)
def test_a_random_drafter_for_a_hybrid_target_takes_its_theta_not_its_partial_rotary(family):
    from dflash_core.config import target_rope
    from experiments.bench.models import random_draft

    target = sliding_target(family, dtype=torch.float32)
    assert target.config.rope_parameters.get("partial_rotary_factor", 1.0) < 1.0  # the target rotates part of a head
    theta = target.config.rope_parameters["rope_theta"]
    assert target_rope(target.config) == (theta, None)
    draft = random_draft(target, taps=2, block_size=6)
    assert draft.config.rope_theta == theta
    p = prompt(4, 9, 48)
    assert ddtree_generate(target, draft, p, budget=8, max_new_tokens=12).new_token_ids == \
        autoregressive_generate(target, p, 12).new_token_ids
