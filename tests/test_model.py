"""The DFlash drafter: checkpoint format, cache equivalence, KV injection, compatibility checks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import forward_one, make_draft, make_target
from dflash_core.config import DFlashConfig, build_target_layer_ids
from dflash_core.model import DraftCache
from dflash_core.target import TargetAdapter
from dflash_core import (
    DFlashDraftModel, IncompatibleModelError, check_compatibility, dflash_generate, load_draft,
)


def test_build_target_layer_ids_matches_published_formula():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(36, 1) == [18]
    assert build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert build_target_layer_ids(28, 4) == [1, 9, 17, 25]


def _inputs(draft, ctx_len=11, block=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = draft.config
    b = block or cfg.block_size
    dtype = next(draft.parameters()).dtype
    ctx = torch.randn(1, ctx_len, cfg.num_taps * cfg.hidden_size, generator=g, dtype=dtype)
    blk = torch.randn(1, b, cfg.hidden_size, generator=g, dtype=dtype)
    return ctx, blk


def test_cached_incremental_pass_equals_full_recompute():
    draft = make_draft(make_target("qwen3"), block_size=4, layers=2)
    ctx, blk = _inputs(draft, ctx_len=11)
    full = draft(blk, ctx, torch.arange(11, 15), torch.arange(11))
    cache = DraftCache()
    draft(blk, ctx[:, :6], torch.arange(6, 10), torch.arange(6), cache=cache)  # round 1: 6 context tokens
    assert cache.length == 6  # the block's keys/values were not kept
    draft(blk, ctx[:, 6:9], torch.arange(9, 13), torch.arange(6, 9), cache=cache)  # round 2: 3 more
    incremental = draft(blk, ctx[:, 9:], torch.arange(11, 15), torch.arange(9, 11), cache=cache)
    assert cache.length == 11
    torch.testing.assert_close(incremental, full)


def test_the_drafter_cache_is_written_in_place_and_survives_crops_and_reassignment():
    """Passes write into one buffer per layer (no copy of the cached context), a crop and a re-draft equal a fresh
    run, and keys assigned from elsewhere (a batch's stacked caches) move into a new buffer on the next pass."""
    draft = make_draft(make_target("qwen3"), block_size=4, layers=2)
    ctx, blk = _inputs(draft, ctx_len=40)
    cache = DraftCache()
    draft(blk, ctx[:, :20], torch.arange(20, 24), torch.arange(20), cache=cache)
    buffers = [b[0].data_ptr() for b in cache.buffers]
    for start in range(20, 36, 4):  # four more passes: the same buffers, the keys views of them
        draft(blk, ctx[:, start:start + 4], torch.arange(start + 4, start + 8), torch.arange(start, start + 4),
              cache=cache)
    assert [b[0].data_ptr() for b in cache.buffers] == buffers
    assert all(k.data_ptr() == b[0].data_ptr() for k, b in zip(cache.keys, cache.buffers)) and cache.length == 36
    cache.crop(30)  # back six tokens, as a measurement's rewind does, then on again
    again = draft(blk, ctx[:, 30:], torch.arange(40, 44), torch.arange(30, 40), cache=cache)
    torch.testing.assert_close(again, draft(blk, ctx, torch.arange(40, 44), torch.arange(40)))
    moved = DraftCache([k.clone() for k in cache.keys], [v.clone() for v in cache.values])
    moved.crop(36)
    out = draft(blk, ctx[:, 36:], torch.arange(40, 44), torch.arange(36, 40), cache=moved)
    torch.testing.assert_close(out, again)
    assert moved.length == 40 and all(k.data_ptr() == b[0].data_ptr() for k, b in zip(moved.keys, moved.buffers))


def test_context_is_injected_and_block_attention_is_bidirectional():
    draft = make_draft(make_target("llama"), block_size=4, layers=2)
    ctx, blk = _inputs(draft)
    base = draft(blk, ctx, torch.arange(11, 15), torch.arange(11))
    other_ctx = ctx.clone()
    other_ctx[:, 3] += 1.0
    assert not torch.allclose(draft(blk, other_ctx, torch.arange(11, 15), torch.arange(11)), base)
    later = blk.clone()
    later[:, -1] += 1.0  # changing the LAST block position changes the FIRST one's output: non-causal
    assert not torch.allclose(draft(later, ctx, torch.arange(11, 15), torch.arange(11))[:, 0], base[:, 0])


def test_mask_restricts_attention():
    draft = make_draft(make_target("llama"), block_size=4)
    ctx, blk = _inputs(draft)
    mask = torch.ones(1, 1, 4, 15, dtype=torch.bool)
    mask[..., 5:11] = False  # context positions 5..10 hidden
    masked = draft(blk, ctx, torch.arange(11, 15), torch.arange(11), attn_mask=mask)
    short = draft(blk, ctx[:, :5], torch.arange(11, 15), torch.arange(5))
    torch.testing.assert_close(masked, short)


def test_save_load_round_trip(tmp_path):
    draft = make_draft(make_target("qwen3"), block_size=8, layers=2, dtype=torch.float32)
    draft.save_pretrained(tmp_path / "ckpt")
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 8
    assert raw["dflash_config"] == {"mask_token_id": draft.config.mask_token_id,
                                    "target_layer_ids": list(draft.config.target_layer_ids)}
    loaded = load_draft(tmp_path / "ckpt")
    assert loaded.config == draft.config
    ctx, blk = _inputs(draft)
    torch.testing.assert_close(loaded(blk, ctx, torch.arange(11, 19), torch.arange(11)),
                               draft(blk, ctx, torch.arange(11, 19), torch.arange(11)))


ZLAB_CONFIG = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 4, "bos_token_id": 1,
    "dflash_config": {"mask_token_id": 60, "target_layer_ids": [1, 2]}, "eos_token_id": 2, "head_dim": 8,
    "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
    "layer_types": ["full_attention"], "max_position_embeddings": 40960, "max_window_layers": 1,
    "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 1, "num_key_value_heads": 2,
    "num_target_layers": 4, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.57.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 64,
}


@pytest.mark.parametrize("prefix", ["", "model."])
def test_zlab_checkpoint_loads_with_and_without_model_prefix(tmp_path, prefix):
    ref = DFlashDraftModel(DFlashConfig.from_dict(ZLAB_CONFIG))
    torch.manual_seed(0)
    for p in ref.parameters():
        p.data.normal_(0, 0.3)
    names = sorted(ref.state_dict())
    assert "fc.weight" in names and "hidden_norm.weight" in names and "layers.0.self_attn.q_norm.weight" in names
    (tmp_path / "config.json").write_text(json.dumps(ZLAB_CONFIG))
    save_file({prefix + k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = load_draft(tmp_path, dtype=torch.float32)
    assert loaded.config.target_layer_ids == (1, 2) and loaded.config.mask_token_id == 60
    ctx, blk = _inputs(ref)
    torch.testing.assert_close(loaded(blk, ctx, torch.arange(11, 15), torch.arange(11)),
                               ref(blk, ctx, torch.arange(11, 15), torch.arange(11)))
    target = make_target("qwen3", vocab=64, dtype=torch.float32)
    check_compatibility(target, loaded)
    out = dflash_generate(target, loaded, torch.tensor([[1, 2, 3]]), max_new_tokens=8)
    assert len(out.new_token_ids) == 8


def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        tmp_path.joinpath("empty").mkdir()
        load_draft(tmp_path / "empty")
    bad = dict(ZLAB_CONFIG)
    del bad["dflash_config"]
    with pytest.raises(ValueError, match="dflash_config"):
        DFlashConfig.from_dict(bad)
    (tmp_path / "config.json").write_text(json.dumps(ZLAB_CONFIG))
    save_file({"fc.weight": torch.zeros(32, 64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        load_draft(tmp_path)


def test_compatibility_errors_say_what_to_fix():
    target = make_target("llama", vocab=64, layers=4)
    good = make_draft(target)
    check_compatibility(target, good)

    def variant(**changes):
        return DFlashDraftModel(DFlashConfig(**{**good.config.__dict__, **changes}))

    cases = [
        (dict(hidden_size=48, head_dim=12), "hidden_size"),
        (dict(vocab_size=65), "vocab_size"),
        (dict(target_layer_ids=(1, 7)), "only 4 layers"),
        (dict(num_target_layers=36), "36 layers"),
        (dict(mask_token_id=64), "mask_token_id"),
    ]
    for changes, message in cases:
        with pytest.raises(IncompatibleModelError, match=message):
            check_compatibility(target, variant(**changes))
    with pytest.raises(IncompatibleModelError, match="out of range"):
        TargetAdapter(target, (0, 9))


def test_unsupported_targets_are_refused():
    from transformers import AutoModelForCausalLM, GPT2Config, Qwen3Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(IncompatibleModelError, match="not supported"):
        TargetAdapter(gpt2)
    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    TargetAdapter(AutoModelForCausalLM.from_config(Qwen3Config(**small, use_sliding_window=True, sliding_window=8,
                                                               max_window_layers=0)))  # sliding windows are served
    hybrid = AutoModelForCausalLM.from_config(Qwen3Config(**small))
    hybrid.config.layer_types = ["linear_attention", "full_attention"]  # named, but no Gated DeltaNet mixer to drive
    with pytest.raises(IncompatibleModelError, match="1 linear_attention layers.*has 0 Gated DeltaNet mixers"):
        TargetAdapter(hybrid)
    hybrid.config.layer_types = ["conv", "full_attention"]
    with pytest.raises(IncompatibleModelError, match="layers of kind conv are not supported"):
        TargetAdapter(hybrid)
    hybrid.config.model_type = "kimi_k25"
    with pytest.raises(IncompatibleModelError, match="not supported yet: the checkpoint is a vision-language model"):
        TargetAdapter(hybrid)


def test_adapter_causal_mask_reproduces_plain_forward():
    target = make_target("qwen3", vocab=64, dtype=torch.float32)
    adapter = TargetAdapter(target, (1,))
    ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(0))
    c1, c2 = adapter.new_cache(), adapter.new_cache()
    forward_one(adapter, ids[:5], torch.arange(5), c1)
    forward_one(adapter, ids[:5], torch.arange(5), c2)
    plain, _ = forward_one(adapter, ids[5:], torch.arange(5, 12), c1)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    masked, _ = forward_one(adapter, ids[5:], torch.arange(5, 12), c2, visibility=causal)
    torch.testing.assert_close(masked, plain, atol=1e-5, rtol=1e-5)
    adapter.crop(c1, 8)
    assert c1.get_seq_length() == 8


def reference_forward(draft: DFlashDraftModel, block: torch.Tensor, context: torch.Tensor,
                      block_pos: torch.Tensor, context_pos: torch.Tensor) -> torch.Tensor:
    """The DFlash drafter's attention written out naively (per head, float64; queries are the block, keys and values the
    context features then the block): an independent oracle for the drafter's forward."""
    cfg = draft.config
    w = {k: v.double() for k, v in draft.state_dict().items()}
    eps, hd = cfg.rms_norm_eps, cfg.head_dim

    def rms(x, weight):
        return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x: [S, heads, hd]
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = pos.double()[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * cos + rot * sin

    ctx = rms(context[0].double() @ w["fc.weight"].T, w["hidden_norm.weight"])  # [Nc, hidden]
    h = block[0].double()
    all_pos = torch.cat([context_pos, block_pos])
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = rope(rms((x @ w[p + "self_attn.q_proj.weight"].T).view(len(x), -1, hd), w[p + "self_attn.q_norm.weight"]), block_pos)
        kv_in = torch.cat([ctx, x])  # context features first, then the block
        k = rope(rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(len(kv_in), -1, hd), w[p + "self_attn.k_norm.weight"]), all_pos)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(len(kv_in), -1, hd)
        heads = []
        for head in range(cfg.num_attention_heads):
            scores = q[:, head] @ k[:, head // group].T / hd ** 0.5  # no mask: bidirectional, sees all context
            heads.append(torch.softmax(scores, -1) @ v[:, head // group])
        h = h + torch.cat(heads, -1) @ w[p + "self_attn.o_proj.weight"].T
        y = rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"])[None]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_forward_matches_naive_reference_of_the_published_architecture(family):
    draft = make_draft(make_target(family), block_size=5, layers=2)
    ctx, blk = _inputs(draft, ctx_len=9)
    got = draft(blk, ctx, torch.arange(20, 25), torch.arange(11, 20))
    torch.testing.assert_close(got, reference_forward(draft, blk, ctx, torch.arange(20, 25), torch.arange(11, 20)))
