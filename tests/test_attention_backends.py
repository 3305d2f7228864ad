"""Attention backends that cannot take a 4D tree mask: tree verification refuses them, the chain stays exact."""

import pytest
import torch
import torch.nn.functional as F

from conftest import make_draft, make_target, prompt
from dflash_core import IncompatibleModelError, autoregressive_generate, dflash_generate
from dflash_core.target import TargetAdapter, check_mask_backend


def _flash_like_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Like flash-attention: causal attention aligned at the bottom right, whatever mask is passed (ignored)."""
    q_len, k_len = query.shape[2], key.shape[2]
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@pytest.fixture
def flash_like_target():
    from transformers import AttentionInterface

    AttentionInterface.register("test_flash_like", _flash_like_attention)
    target = make_target("qwen3", vocab=64, dtype=torch.float64)
    target.config._attn_implementation = "test_flash_like"
    return target


def test_tree_verification_refuses_a_backend_without_4d_masks(flash_like_target):
    from ddtree import ddtree_generate

    target = flash_like_target
    draft = make_draft(target, block_size=4)
    p = prompt(3, 8, 64)
    with pytest.raises(IncompatibleModelError, match="attn_implementation='sdpa'"):
        ddtree_generate(target, draft, p, budget=4, max_new_tokens=8)
    with pytest.raises(IncompatibleModelError, match="4D attention mask"):  # a batch needs the padding mask
        autoregressive_generate(target, [p, p[:, :5]], max_new_tokens=4)
    with pytest.raises(IncompatibleModelError, match="4D attention mask"):
        check_mask_backend(target, batch=1, chains_only=False)
    assert check_mask_backend(target, batch=1, chains_only=True) is False  # one prompt's chains: no mask, allowed
    # the chain needs no mask: DFlash is exact on this backend too, and equals SDPA's output
    ar = autoregressive_generate(target, p, max_new_tokens=16).new_token_ids
    assert dflash_generate(target, draft, p, max_new_tokens=16).new_token_ids == ar
    assert ddtree_generate(target, draft, p, budget="chain", max_new_tokens=16).new_token_ids == ar
    target.config._attn_implementation = "sdpa"
    assert autoregressive_generate(target, p, max_new_tokens=16).new_token_ids == ar


def test_chains_on_a_flash_like_backend_accept_whole_blocks_and_equal_the_reference(flash_like_target):
    """DFlash, chain-auto and an oracle chain (real acceptance: whole blocks) on a backend that ignores masks give
    the cache-free reference's tokens; trees alone are refused."""
    from ddtree import ddtree_generate, make_policy
    from ddtree.cost import CostModel
    from dflash_core import speculative_generate
    from greedy_reference import greedy_reference
    from test_decoding import OracleChain

    target = flash_like_target
    draft = make_draft(target, block_size=4)
    cost = CostModel((0, 1, 3), (0.010, 0.010, 0.010), 0.004)  # verifying is free: chain-auto drafts to its cap
    for seed in range(2):
        p = prompt(20 + seed, 7, 64)
        ref = greedy_reference(target, p, 24)
        oracle = speculative_generate(target, draft, p, OracleChain(ref, p.shape[1], seed), max_new_tokens=24)
        assert oracle.new_token_ids == ref and max(oracle.acceptance_lengths) == 4
        auto = make_policy("chain-auto", target, draft, cost=cost, cap=3, online=False)
        out = ddtree_generate(target, draft, p, max_new_tokens=24, policy=auto)
        assert out.new_token_ids == ref and max(out.tree_sizes) == 3
        # the public path: its cost curve is measured on this backend (chains need no mask)
        assert ddtree_generate(target, draft, p, budget="chain-auto", max_new_tokens=24).new_token_ids == ref
