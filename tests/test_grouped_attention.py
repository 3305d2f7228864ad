"""Grouped-query attention without copies (dflash_core.grouped): a masked CPU verify reads each key/value head in
place (``enable_gqa`` in float32, the group folded into query rows in bf16) instead of copying it per query head,
and a single-row forward (a plain step) folds the group, with the same logits and features as transformers' own
path, on the dense targets and on every family whose layers run SDPA; the model's attention implementation is its
own again after every forward, even one that fails; what the grouped path does not handle goes to transformers'."""

from __future__ import annotations

import pytest
import torch

import dflash_core.grouped as grouped
from conftest import make_target
from dflash_core.target import TargetAdapter
from experiments.bench.models import FAMILY_TARGETS, family_target

pytestmark = pytest.mark.usefixtures("one_thread")


def _tree_forwards(target, spy_calls: list) -> tuple:
    """One masked tree forward with the grouped path and the same one with transformers' path: (outputs, outputs)."""
    adapter = TargetAdapter(target, (0, 1))
    vocab = adapter.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab - 1, (2, 36), generator=gen)
    cache = adapter.new_cache()
    adapter.forward(ids[:, :24], torch.arange(24).expand(2, -1), cache)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 4, 6, 10]  # a 12-node tree, the same for both rows
    depth = [0] * 12
    visible = torch.zeros(12, 12, dtype=torch.bool)
    for i, p in enumerate(parents):
        visible[i, i] = True
        if p >= 0:
            visible[i] |= visible[p]
            depth[i] = depth[p] + 1
    visible = torch.cat([torch.ones(12, 24, dtype=torch.bool), visible], 1).expand(2, -1, -1)
    positions = (24 + torch.tensor(depth)).expand(2, -1)
    outs = []
    for configs in (adapter.grouped, []):
        adapter.grouped = configs
        before = len(spy_calls)
        out = adapter.forward(ids[:, 24:], positions, cache, visible=visible)
        outs.append((out.logits, out.features, sum(bool(c) for c in spy_calls[before:])))
        adapter.crop(cache, 24)
    return outs


@pytest.fixture
def spy(monkeypatch):
    """Every SDPA call's ``enable_gqa`` (torch's function, whoever calls it)."""
    calls = []
    sdpa = grouped.F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa"))
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(grouped.F, "scaled_dot_product_attention", counting)
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3-dense"] + [f for f in FAMILY_TARGETS])
def test_masked_verify_reads_grouped_heads_in_place_with_the_same_outputs(family, spy):
    if family == "llama":
        target = make_target("llama", vocab=48)
    elif family == "qwen3-dense":
        target = make_target("qwen3", vocab=48)
    else:
        target = family_target(family)
    (grouped_logits, grouped_features, grouped_calls), (own_logits, own_features, own_calls) = \
        _tree_forwards(target, spy)
    attention_layers = sum(getattr(m, "num_key_value_groups", 1) > 1 for m in target.modules())
    sdpa = target.config._attn_implementation == "sdpa"
    # every grouped SDPA layer went through the in-place path; eager (gpt-oss) and MLA (no groups) never do
    assert grouped_calls == (attention_layers if sdpa else 0)
    assert own_calls == 0  # transformers' path copies the heads under a mask (no enable_gqa)
    tol = 1e-10 if target.dtype == torch.float64 else 1e-5
    torch.testing.assert_close(grouped_logits, own_logits, atol=tol, rtol=0)
    torch.testing.assert_close(grouped_features, own_features, atol=tol, rtol=0)
    assert target.config._attn_implementation == getattr(target.config, "_attn_implementation_internal")


def test_the_models_own_implementation_comes_back_even_after_a_failed_forward():
    target = make_target("llama", vocab=48)
    adapter = TargetAdapter(target, (0, 1))
    assert adapter.grouped and target.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"):
        with grouped.grouped_attention(adapter.grouped):
            assert target.config._attn_implementation == grouped.GROUPED_SDPA
            raise RuntimeError("inside")
    assert target.config._attn_implementation == "sdpa"
    with grouped.grouped_attention(adapter.grouped, on=False):  # a forward without a mask keeps it
        assert target.config._attn_implementation == "sdpa"


def test_folded_rows_and_what_goes_to_transformers_own_function(monkeypatch):
    """Against the copied-heads arithmetic: a masked forward of several rows (float64: ``enable_gqa``; bf16: folded)
    and a single row with or without a mask (folded); an unmasked forward of several rows (a causal prefill),
    soft-capping, sinks and ungrouped heads go to transformers' function."""
    import transformers.integrations.sdpa_attention as hf_sdpa

    delegated = []
    monkeypatch.setattr(hf_sdpa, "sdpa_attention_forward", lambda *a, **kw: delegated.append(kw) or ("theirs", None))
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64, generator=gen)
    k, v = torch.randn(2, 1, 2, 5, 8, dtype=torch.float64, generator=gen)
    mask = torch.zeros(1, 1, 3, 5, dtype=torch.float64)
    mask[..., 1] = torch.finfo(torch.float64).min
    mask[..., 1, 3] = torch.finfo(torch.float64).min  # rows see different keys: a folded row must keep its own

    def reference(query, m):
        keys, values = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)  # what transformers' path computes
        scores = query.double() @ keys.transpose(-1, -2) * 0.3 + (0 if m is None else m.double())
        return (torch.softmax(scores, -1) @ values).transpose(1, 2)

    for query, m in ((q, mask), (q[:, :, :1], mask[:, :, :1]), (q[:, :, :1], None)):
        out, _ = grouped.grouped_sdpa_attention(module, query, k, v, m, scaling=0.3)
        torch.testing.assert_close(out, reference(query, m))
    half = grouped.grouped_sdpa_attention(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask.bfloat16(),
                                          scaling=0.3)[0]
    torch.testing.assert_close(half.double(), reference(q, mask), atol=3e-2, rtol=0)
    assert not delegated
    for query, m, kwargs in ((q, None, {}), (q, mask, {"softcap": 2.0}), (q, mask, {"s_aux": torch.zeros(4)})):
        assert grouped.grouped_sdpa_attention(module, query, k, v, m, scaling=0.3, **kwargs)[0] == "theirs"
    module.num_key_value_groups = 1
    assert grouped.grouped_sdpa_attention(module, q, k.repeat_interleave(2, 1), v, mask)[0] == "theirs"
    assert len(delegated) == 4


def test_a_plain_step_folds_the_group_with_the_same_outputs(spy):
    """A one-token forward without a tree (a plain step, a root-only round) folds each group into query rows of its
    key/value head: one SDPA call per layer with H_kv heads and no ``enable_gqa``, the same logits and features."""
    target = make_target("llama", vocab=48)
    adapter = TargetAdapter(target, (0, 1))
    ids = torch.randint(0, 47, (1, 30), generator=torch.Generator().manual_seed(1))
    outs = []
    for configs in (adapter.grouped, []):
        adapter.grouped = configs
        cache = adapter.new_cache()
        adapter.forward(ids[:, :29], torch.arange(29)[None], cache)
        before = len(spy)
        out = adapter.forward(ids[:, 29:], torch.tensor([[29]]), cache)
        outs.append((out.logits, out.features, spy[before:]))
    (logits, features, calls), (own_logits, own_features, _) = outs
    layers = len(target.model.layers)
    assert calls == [None] * layers  # every layer folded: SDPA without enable_gqa
    torch.testing.assert_close(logits, own_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(features, own_features, atol=1e-5, rtol=0)


def test_no_rerouting_on_a_model_whose_heads_are_not_grouped():
    target = make_target("llama", vocab=48)
    for layer in target.model.layers:
        layer.self_attn.num_key_value_groups = 1
    assert grouped.sdpa_configs(target) == []
