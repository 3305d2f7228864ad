"""Every published z-lab drafter config shape: field placements, rope scalings, sliding windows, refused settings."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_target, prompt
from dflash_core import DFlashDraftModel, autoregressive_generate, dflash_generate, load_draft
from dflash_core.config import DFlashConfig
from dflash_core.model import DraftCache, window_mask


# The published Qwen3-8B-DFlash-b16 layout (top-level block_size, dflash_config with the mask token and taps), small.
BASE = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "block_size": 4,
    "dflash_config": {"mask_token_id": 60, "target_layer_ids": [1, 2]}, "head_dim": 8, "hidden_act": "silu",
    "hidden_size": 32, "intermediate_size": 64, "layer_types": ["full_attention"], "max_position_embeddings": 40960,
    "max_window_layers": 1, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 1,
    "num_key_value_heads": 2, "num_target_layers": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 64,
}


def _config(**changes) -> dict:
    raw = json.loads(json.dumps(BASE))
    for key, value in changes.items():
        if value is None and key.startswith("-"):
            raw.pop(key[1:], None)
        else:
            raw[key] = value
    return raw


def _drafter(config: DFlashConfig, seed: int = 0, dtype=torch.float64) -> DFlashDraftModel:
    torch.manual_seed(seed)
    draft = DFlashDraftModel(config)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return draft.to(dtype).eval()


def _inputs(config: DFlashConfig, ctx_len: int, block: int, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(1, ctx_len, config.num_taps * config.hidden_size, generator=g, dtype=dtype)
    blk = torch.randn(1, block, config.hidden_size, generator=g, dtype=dtype)
    return ctx, blk


def test_fields_are_found_where_zlab_puts_them():
    inside = DFlashConfig.from_dict(_config(**{"-block_size": None}, dflash_config={
        "mask_token_id": 60, "target_layer_ids": [1, 2], "block_size": 8}))
    assert inside.block_size == 8
    both = DFlashConfig.from_dict(_config(block_size=16, dflash_config={
        "mask_token_id": 60, "target_layer_ids": [1, 2], "block_size": 8}))
    assert both.block_size == 8  # dflash_config first, as z-lab's loader reads it
    top = DFlashConfig.from_dict(_config(**{"-dflash_config": None}, mask_token_id=61, target_layer_ids=[0, 3]))
    assert (top.mask_token_id, top.target_layer_ids, top.block_size) == (61, (0, 3), 4)
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.from_dict(_config(**{"-dflash_config": None}))


def test_transformers5_rope_parameters_carry_theta():
    cfg = DFlashConfig.from_dict(_config(**{"-rope_theta": None, "-rope_scaling": None},
                                         rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}))
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None
    # a random drafter for a transformers-5 target (its config has rope_parameters, no rope_theta) follows it
    from experiments.bench.models import random_draft

    target = make_target("qwen3", vocab=64)
    target.config.rope_parameters = {"rope_theta": 123456.0, "rope_type": "default"}
    assert random_draft(target, taps=2, block_size=4).config.rope_theta == 123456.0


def _hf_frequencies(kind: str, rope: dict, head_dim: int = 16):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=131072, rope_parameters={"rope_type": kind, **rope})
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu")


LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
YARN = {"factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("kind,params,theta", [("llama3", LLAMA31, 500000.0), ("yarn", YARN, 1e6),
                                               ("linear", {"factor": 2.0}, 10000.0)])
def test_scaled_rope_matches_transformers(kind, params, theta):
    # the Llama-3.1 drafter's shape: transformers-4 rope_theta + rope_scaling; yarn in the transformers-5 shape
    if kind == "yarn":
        raw = _config(**{"-rope_theta": None, "-rope_scaling": None},
                      rope_parameters={"rope_type": kind, "rope_theta": theta, **params})
    else:
        raw = _config(rope_theta=theta, rope_scaling={"rope_type": kind, **params})
    raw.update(head_dim=16, hidden_size=64, intermediate_size=128, max_position_embeddings=131072)
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.rope_scaling["rope_type"] == kind and cfg.rope_theta == theta
    rotary = DFlashDraftModel(cfg).rotary
    expected, scale = _hf_frequencies(kind, {"rope_theta": theta, **params})
    torch.testing.assert_close(rotary.inv_freq, expected.float(), rtol=2e-6, atol=0)
    assert rotary.attention_scale == pytest.approx(scale)
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg  # written back in a loadable shape
    if kind == "yarn":
        cos, _ = rotary(torch.tensor([[0]]), torch.float64)
        assert float(cos[0, 0, 0, 0]) == pytest.approx(scale)  # cos/sin carry yarn's attention factor


def test_drafter_rotary_equals_a_llama31_targets_rotary():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from dflash_core.training.train_config import DraftSpec, make_draft_config

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072,
                         rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA31})
    target = AutoModelForCausalLM.from_config(config).eval()
    draft = DFlashDraftModel(make_draft_config(target.config, DraftSpec(layers=1, taps=2, block_size=4)))
    positions = torch.tensor([[0, 1, 500, 9000, 70000]])
    cos_t, sin_t = target.model.rotary_emb(torch.zeros(1, 5, 64), positions)
    cos_d, sin_d = draft.rotary(positions, torch.float32)
    # float32 angles: one ulp of a frequency is ~1e-3 rad at position 70000 (an unscaled rotary is off by > 1 rad)
    torch.testing.assert_close(cos_d[:, 0], cos_t, rtol=0, atol=1e-3)
    torch.testing.assert_close(sin_d[:, 0], sin_t, rtol=0, atol=1e-3)
    unscaled = DFlashDraftModel(DFlashConfig(**{**draft.config.__dict__, "rope_scaling": None})).rotary
    assert (unscaled(positions, torch.float32)[0][:, 0] - cos_t).abs().max() > 0.5


@pytest.mark.parametrize("changes,message", [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "longrope"),
    (dict(rope_scaling={"type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(layer_types=["chunked_attention"]), "chunked_attention"),
    (dict(layer_types=["sliding_attention"], sliding_window=None), "sliding_window"),
    (dict(output_multiplier=0.2), "output_multiplier"),
    (dict(dflash_config={"mask_token_id": 60, "target_layer_ids": [1, 2], "final_logit_softcapping": 20.0}),
     "final_logit_softcapping"),
    (dict(architectures=["DFlash2DraftModel"]), "DFlash2"),
    (dict(dflash_config={"mask_token_id": 60, "target_layer_ids": [1, 2], "conv_kernel_size": 2}), "DFlash2"),
])
def test_unimplemented_settings_are_refused_never_ignored(changes, message):
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_dict(_config(**changes))


# The sliding-window drafter shape (z-lab's 5-layer drafters for 52-layer targets, here small): every layer sliding,
# transformers 5 rope_parameters, is_causal false.
SLIDING = dict(layer_types=["sliding_attention"] * 2, num_hidden_layers=2, sliding_window=5, use_sliding_window=True,
               max_window_layers=2, is_causal=False, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
               **{"-rope_theta": None, "-rope_scaling": None})


def _dense_window(n_query: int, n_key: int, causal: bool, window: int | None) -> torch.Tensor:
    mask = torch.zeros(n_query, n_key, dtype=torch.bool)
    for i in range(n_query):
        q = n_key - n_query + i
        for k in range(n_key):
            ok = (k <= q) if causal else True
            if window is not None:
                ok = ok and abs(q - k) < window if not causal else ok and q - k < window
            mask[i, k] = ok
    return mask


@pytest.mark.parametrize("n_query,n_key,causal,window", [(4, 15, False, 5), (4, 15, True, 5), (4, 15, True, None),
                                                       (3, 4, False, 2), (16, 40, False, 20), (4, 6, True, 100)])
def test_window_mask_matches_the_rule_cell_by_cell(n_query, n_key, causal, window):
    assert torch.equal(window_mask(n_query, n_key, causal, window)[0, 0], _dense_window(n_query, n_key, causal, window))


def test_sliding_window_drafter_config_loads_and_is_applied(tmp_path):
    cfg = DFlashConfig.from_dict(_config(**SLIDING))
    assert cfg.layer_types == ("sliding_attention",) * 2 and cfg.sliding_window == 5 and cfg.is_causal is False
    assert cfg.layer_attention(0) == (False, 5) and DFlashConfig.from_dict(cfg.to_dict()) == cfg
    draft = _drafter(cfg)
    ctx, blk = _inputs(cfg, 12, 4)
    base = draft(blk, ctx, torch.arange(12, 16), torch.arange(12))
    # the first block row (key 12) sees keys 8..15; so context 0..7 cannot matter, context 8..11 does
    old = ctx.clone()
    old[:, :8] += 1.0
    torch.testing.assert_close(draft(blk, old, torch.arange(12, 16), torch.arange(12)), base)
    recent = ctx.clone()
    recent[:, 9] += 1.0
    assert not torch.allclose(draft(blk, recent, torch.arange(12, 16), torch.arange(12)), base)
    # with the window wider than everything, the same weights give plain full attention
    wide = DFlashDraftModel(DFlashConfig(**{**cfg.__dict__, "sliding_window": 64})).to(torch.float64)
    wide.load_state_dict(draft.state_dict())
    full = DFlashDraftModel(DFlashConfig(**{**cfg.__dict__, "layer_types": None, "is_causal": None})).to(torch.float64)
    full.load_state_dict(draft.state_dict())
    torch.testing.assert_close(wide(blk, ctx, torch.arange(12, 16), torch.arange(12)),
                               full(blk, ctx, torch.arange(12, 16), torch.arange(12)))
    # the decode loop's cached rounds give what one pass over the whole context gives
    cache = DraftCache()
    draft(blk, ctx[:, :7], torch.arange(7, 11), torch.arange(7), cache=cache)
    cached = draft(blk, ctx[:, 7:], torch.arange(12, 16), torch.arange(7, 12), cache=cache)
    torch.testing.assert_close(cached, base)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        draft(blk, ctx, torch.arange(12, 16), torch.arange(12), attn_mask=torch.ones(1, 1, 4, 16, dtype=torch.bool))


def test_causal_drafter_layers_hide_later_block_positions():
    cfg = DFlashConfig.from_dict(_config(is_causal=True))
    assert cfg.layer_attention(0) == (True, None)
    draft = _drafter(cfg)
    ctx, blk = _inputs(cfg, 11, 4)
    base = draft(blk, ctx, torch.arange(11, 15), torch.arange(11))
    later = blk.clone()
    later[:, -1] += 1.0
    changed = draft(later, ctx, torch.arange(11, 15), torch.arange(11))
    torch.testing.assert_close(changed[:, :3], base[:, :3])
    assert not torch.allclose(changed[:, 3], base[:, 3])


def test_sliding_window_drafter_decodes_losslessly(tmp_path):
    from ddtree import ddtree_generate

    target = make_target("qwen3", vocab=64, dtype=torch.float64)
    cfg = DFlashConfig.from_dict(_config(**SLIDING))
    draft = _drafter(cfg)
    draft.save_pretrained(tmp_path)
    loaded = load_draft(tmp_path, dtype=torch.float64)
    p = prompt(5, 9, 64)
    ar = autoregressive_generate(target, p, max_new_tokens=24).new_token_ids
    assert dflash_generate(target, loaded, p, max_new_tokens=24).new_token_ids == ar
    assert ddtree_generate(target, loaded, p, budget=6, max_new_tokens=24).new_token_ids == ar
