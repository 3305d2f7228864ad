"""GPU and multi-GPU readiness (issue 12), checked on the CPU wherever the behaviour can be reproduced there.

Training under torchrun, attention backends that cannot take a tree mask, rank-to-GPU placement and CUDA event
streams, every published z-lab config shape (rope scalings, sliding windows, field placements), supported versions,
fast loading, a cost model that measures whole rounds, the import direction, the GPU check's profile, bad input.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from conftest import make_draft, make_target, prompt
from dflash_core.config import DFlashConfig
from dflash_core.model import DraftCache
from dflash_core.target import TargetAdapter
from dflash_core import (
    DFlashDraftModel, IncompatibleModelError, autoregressive_generate, dflash_generate, load_draft,
)
from dflash_core.model import rope_frequencies, window_mask

REPO = Path(__file__).resolve().parents[1]

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


# ---------------------------------------------------------------------------------------------------- 1. training
def test_distributed_init_sets_the_rank_gpu_first_and_carries_both_backends(monkeypatch):
    import dflash_core.training.loop as loop_mod

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", torch.device(d))))
    monkeypatch.setattr(loop_mod.dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend)))
    device, distributed = loop_mod.init_distributed(None)
    assert distributed and device == torch.device("cuda", 1)
    assert calls == [("set_device", torch.device("cuda", 1)), ("init", "cpu:gloo,cuda:nccl")]
    calls.clear()
    device, _ = loop_mod.init_distributed("cpu")  # a CPU run under torchrun: gloo only, no GPU touched
    assert device == torch.device("cpu") and calls == [("init", "gloo")]


def test_block_attention_mask_is_built_on_the_requested_device():
    from dflash_core.training.blocks import block_attention_mask

    anchors = torch.tensor([2, 5, 9])
    on_meta = block_attention_mask(anchors, 4, 9, device="meta")
    assert on_meta.device.type == "meta" and on_meta.shape == (12, 21) and on_meta.dtype == torch.bool
    assert block_attention_mask(anchors, 4, 9).device.type == "cpu"


class _HeadCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op that reads the LM head's storage and returns a new tensor of the head's size (a copy)."""

    def __init__(self, head: torch.Tensor) -> None:
        super().__init__()
        self.ptr, self.numel, self.copies = head.untyped_storage().data_ptr(), head.numel(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.ptr for a in leaves):
            for o in torch.utils._pytree.tree_leaves(out):
                if (isinstance(o, torch.Tensor) and o.numel() == self.numel
                        and o.untyped_storage().data_ptr() != self.ptr):
                    self.copies.append(str(func))
        return out


@pytest.mark.parametrize("autocast", [True, False])
def test_the_loss_never_copies_the_lm_head(autocast):
    """A bf16 target under an fp32 drafter: the head (V x H) must not be cast or copied per sequence."""
    from dflash_core.training.config import TrainConfig
    from dflash_core.training.loss import sequence_loss, target_features

    target = make_target("llama", vocab=96, hidden=32, dtype=torch.bfloat16)
    draft = make_draft(target, block_size=4, dtype=torch.float32).float().train()
    ids = prompt(0, 30, 96)[0]
    feats = target_features(target, ids, draft.config.target_layer_ids, topk=4)
    cfg = TrainConfig(anchors=3, autocast=autocast, loss_vocab="full", distill_topk=4)
    head = target.lm_head.weight
    with _HeadCopies(head) as watch:
        loss, _ = sequence_loss(draft, target.model.embed_tokens, head, ids, feats, torch.tensor([8, 14, 20]), cfg)
        loss.backward()
    assert watch.copies == []
    assert torch.isfinite(loss)


def test_masked_attention_repeats_kv_instead_of_enable_gqa(monkeypatch):
    import dflash_core.model as model_mod

    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((attn_mask is not None, bool(kwargs.get("enable_gqa", False)), k.shape[1] == q.shape[1]))
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(model_mod.F, "scaled_dot_product_attention", spy)
    draft = make_draft(make_target("qwen3"), block_size=4, layers=1)  # 4 query heads over 2 K/V heads
    ctx, blk = _inputs(draft.config, 11, 4)
    mask = torch.ones(1, 1, 4, 15, dtype=torch.bool)
    mask[..., 5:11] = False
    masked = draft(blk, ctx, torch.arange(11, 15), torch.arange(11), attn_mask=mask)
    plain = draft(blk, ctx[:, :5], torch.arange(11, 15), torch.arange(5))
    torch.testing.assert_close(masked, plain)
    assert calls[0] == (True, False, True)  # masked: K/V repeated to the query heads, no enable_gqa
    assert calls[1] == (False, True, False)  # unmasked: grouped K/V with enable_gqa


def test_step_memory_formula_matches_a_cpu_measurement():
    pytest.importorskip("torch.distributed._tools.mem_tracker")
    import dataclasses

    from dflash_core.training.memory import QWEN3_8B_PRESET, SMALL_PRESET, measure_small, step_memory

    for shape in (SMALL_PRESET, dataclasses.replace(SMALL_PRESET, layers=2, vocab_rows=2368, anchors=32)):
        measured, formula = measure_small(shape)
        assert 0.85 < measured / formula < 1.25, (shape, measured, formula)
    real = step_memory(QWEN3_8B_PRESET)
    assert 60e9 < real["peak"] < 75e9 and real["loss"] == max(v for k, v in real.items() if k != "peak"
                                                              and k != "resident")


# ---------------------------------------------------------------------------------------------------- 2. backends
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
    adapter = TargetAdapter(target)
    cache = adapter.new_cache()
    adapter.forward(p[0], torch.arange(8), cache, with_features=False)
    with pytest.raises(IncompatibleModelError, match="4D attention mask"):
        adapter.forward(torch.tensor([1, 2]), torch.tensor([8, 9]), cache,
                        visibility=torch.ones(2, 2, dtype=torch.bool), with_features=False)
    # the chain needs no mask: DFlash is exact on this backend too, and equals SDPA's output
    ar = autoregressive_generate(target, p, max_new_tokens=16).new_token_ids
    assert dflash_generate(target, draft, p, max_new_tokens=16).new_token_ids == ar
    assert ddtree_generate(target, draft, p, budget="chain", max_new_tokens=16).new_token_ids == ar
    target.config._attn_implementation = "sdpa"
    assert autoregressive_generate(target, p, max_new_tokens=16).new_token_ids == ar


# ---------------------------------------------------------------------------------------------------- 3. devices
@pytest.mark.parametrize("local_rank,local_world,gpus,expected", [
    (0, 1, 1, [0]), (0, 1, 8, list(range(8))), (0, 2, 8, [0, 1, 2, 3]), (1, 2, 8, [4, 5, 6, 7]),
    (3, 4, 8, [6, 7]), (1, 3, 8, [2, 3]), (2, 3, 8, [4, 5]), (5, 8, 8, [5]), (9, 16, 8, [1]),
])
def test_each_rank_gets_its_own_share_of_the_gpus(local_rank, local_world, gpus, expected):
    from experiments.models import rank_gpus

    assert rank_gpus(local_rank, local_world, gpus) == expected


def test_pick_device_makes_only_the_ranks_own_gpu_current(monkeypatch):
    from experiments import benchmark
    from experiments.models import pick_device

    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
    assert pick_device("cuda", local_rank=1, local_world=2) == torch.device("cuda", 4)
    assert pick_device("cuda:6", local_rank=0, local_world=2) == torch.device("cuda", 6)  # explicit: made current too
    assert benchmark.pick_device("auto", benchmark.RankInfo(3, 4, 3, 4)) == torch.device("cuda", 6)
    assert current == [torch.device("cuda", 4), torch.device("cuda", 6), torch.device("cuda", 6)]


class _FakeEvent:
    log: list = []

    def __init__(self, enable_timing=False):
        pass

    def record(self, stream=None):
        _FakeEvent.log.append(stream)

    def elapsed_time(self, other):
        return 2.0


def test_cuda_events_record_on_the_stream_of_the_models_device(monkeypatch):
    from dflash_core.timing import median_seconds
    from dflash_core.timing import StageTimer

    synced = []
    _FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {torch.device(device)}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(torch.device(device)))
    timer = StageTimer("cuda:1")
    with timer.stage("verify"):
        pass
    assert timer.totals() == {"verify": 0.002} and synced == [torch.device("cuda", 1)]
    assert median_seconds(lambda: None, 2, torch.device("cuda", 1)) == 0.002
    assert _FakeEvent.log == ["stream of cuda:1"] * 6


# ---------------------------------------------------------------------------------------------------- 4. z-lab configs
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
    from experiments.models import random_draft

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

    from dflash_core.training.config import DraftSpec, make_draft_config

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


# ---------------------------------------------------------------------------------------------------- 5. versions
def test_installed_versions_lie_in_the_declared_ranges():
    import importlib.metadata

    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = {Requirement(d).name: Requirement(d) for d in deps}
    assert reqs["torch"].specifier.contains("2.5.0") and not reqs["torch"].specifier.contains("2.4.1")  # enable_gqa
    assert reqs["transformers"].specifier.contains("5.17.0")  # what GPU images ship
    for name in ("torch", "transformers"):
        installed = importlib.metadata.version(name).split("+")[0]
        assert reqs[name].specifier.contains(installed, prereleases=True), (name, installed)
    assert (REPO / "scripts" / "test_oldest.sh").is_file()


# ---------------------------------------------------------------------------------------------------- 6. loading
def test_load_draft_builds_on_meta_and_takes_the_checkpoint_tensors(tmp_path, monkeypatch):
    draft = make_draft(make_target("qwen3"), block_size=4, layers=2, dtype=torch.float32)
    draft.save_pretrained(tmp_path)
    init_devices = []
    real = torch.nn.init.kaiming_uniform_

    def spy(tensor, *args, **kwargs):
        init_devices.append(tensor.device.type)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", spy)
    loaded = load_draft(tmp_path, dtype=torch.bfloat16)
    assert init_devices and set(init_devices) == {"meta"}  # no random initialization of real memory
    params = list(loaded.parameters())
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad and p.dtype == torch.bfloat16 for p in params)
    assert loaded.rotary.inv_freq.dtype == torch.float32 and not loaded.rotary.inv_freq.is_meta
    ctx, blk = _inputs(draft.config, 11, 4, dtype=torch.float32)
    torch.testing.assert_close(load_draft(tmp_path)(blk, ctx, torch.arange(11, 15), torch.arange(11)),
                               draft(blk, ctx, torch.arange(11, 15), torch.arange(11)), rtol=0, atol=0)


def test_targets_are_read_straight_onto_their_device(monkeypatch):
    import transformers

    from dflash_core.loading import load_target

    calls = []

    class FakeModel:
        def eval(self):
            return self

        def to(self, device):
            calls.append(("to", str(device)))
            return self

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda name, **kw: "tokenizer")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda name, **kw: calls.append(("load", kw)) or FakeModel())
    load_target("org/model", torch.bfloat16, "cuda:1")
    assert calls == [("load", {"dtype": torch.bfloat16, "attn_implementation": "sdpa", "device_map": {"": "cuda:1"}})]
    calls.clear()
    load_target("org/model", torch.bfloat16, "cuda:0", device_map="auto", max_memory={0: 10, 1: 10})
    assert calls[0][1]["device_map"] == "auto" and calls[0][1]["max_memory"] == {0: 10, 1: 10}


# ---------------------------------------------------------------------------------------------------- 7. cost model
def test_cost_model_times_whole_rounds_at_the_callers_context(monkeypatch, tmp_path):
    import ddtree.budget as budget
    import dflash_core.decoding as decoding

    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    seen = {"build": [], "walk": 0, "compact": [], "prefill": []}
    real_build, real_walk = budget.build_tree, decoding.verify_walk
    real_compact, real_forward = TargetAdapter.compact, TargetAdapter.forward

    def build(logits, n, token_map=None):
        seen["build"].append(n)
        return real_build(logits, n, token_map=token_map)

    def walk(*args, **kwargs):
        seen["walk"] += 1
        return real_walk(*args, **kwargs)

    def compact(self, cache, start, keep):
        seen["compact"].append(keep.tolist())
        return real_compact(self, cache, start, keep)

    def forward(self, token_ids, position_ids, cache, *args, **kwargs):
        if self.cache_length(cache) == 0:
            seen["prefill"].append(len(token_ids))
        return real_forward(self, token_ids, position_ids, cache, *args, **kwargs)

    monkeypatch.setattr(budget, "build_tree", build)
    monkeypatch.setattr(decoding, "verify_walk", walk)
    monkeypatch.setattr(TargetAdapter, "compact", compact)
    monkeypatch.setattr(TargetAdapter, "forward", forward)
    target = make_target("qwen3", vocab=64, dtype=torch.float32)
    draft = make_draft(target, block_size=5)
    cost = budget.measure_cost_model(target, draft, grid=(0, 2, 8), context=48, repeats=1, cap=24)
    assert cost.context == 48 and set(seen["prefill"]) == {48}
    assert seen["build"] and set(seen["build"]) == {24}  # trees are built at the cap, as the policy builds them
    assert seen["walk"] >= 3 * 2  # warm-up + one timed run per size: the walk is inside the timed round
    assert any(keep != list(range(len(keep))) for keep in seen["compact"])  # a real gather, not a crop
    assert budget.measure_cost_model(target, draft, grid=(0, 2, 8), context=48, cap=24) == cost  # cached
    assert budget.measure_cost_model(target, draft, grid=(0, 2, 8), context=96, repeats=1, cap=24).context == 96


def test_auto_measures_at_the_prompt_length(monkeypatch):
    import ddtree.budget as budget
    from ddtree import ddtree_generate

    contexts = []

    def fake(target, draft, context=256, cap=None, **kwargs):
        contexts.append(context)
        return budget.CostModel((0, 8), (0.01, 0.02), 0.001, context=context)

    monkeypatch.setattr(budget, "measure_cost_model", fake)
    target = make_target("llama", vocab=64)
    draft = make_draft(target, block_size=4)
    ddtree_generate(target, draft, prompt(1, 100, 64), budget="auto", max_new_tokens=4)
    ddtree_generate(target, draft, prompt(1, 20, 64), budget="auto", max_new_tokens=4)
    assert contexts == [128, 64] and budget.context_bucket(4097) == 8192


def test_auto_reads_a_gpu_profile(tmp_path):
    from ddtree.budget import AutoBudget
    from ddtree.cost import CostModel

    curves = [{"nodes": [0, 1, 3], "verify_s": [0.01, 0.011, 0.012], "fixed_s": 0.002, "key": "k", "context": c}
              for c in (512, 4096)]
    path = tmp_path / "h200.json"
    path.write_text(json.dumps({"models": {"qwen3-8b": {"cost_models": curves}}}))
    assert CostModel.from_profile(path, context=3000).context == 4096
    assert CostModel.from_profile(path, context=600).context == 512
    assert CostModel.from_profile(path).context == 4096
    target = make_target("llama", vocab=64)
    policy = AutoBudget.for_models(target, make_draft(target), profile=path, context=700)
    assert policy.cost.context == 512 and policy.cap == 128
    with pytest.raises(ValueError, match="not in the profile"):
        CostModel.from_profile(path, model="qwen3-4b")


# ---------------------------------------------------------------------------------------------------- 8. imports
def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_imports_flow_one_way():
    for path in sorted((REPO / "dflash_core").rglob("*.py")):
        bad = {m for m in _imported_modules(path) if m.split(".")[0] in ("experiments", "ddtree", "plots")}
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"
    for path in sorted((REPO / "ddtree").rglob("*.py")):
        bad = {m for m in _imported_modules(path) if m.split(".")[0] in ("experiments", "plots")}
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"
    import dflash_core.data
    import experiments.datasets

    assert experiments.datasets.select_items is dflash_core.data.select_items  # one implementation, two paths
    assert experiments.datasets.build_chat is dflash_core.data.build_chat
    assert "load_models" not in _defined_functions(REPO / "experiments" / "benchmark.py")


def _defined_functions(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


# ---------------------------------------------------------------------------------------------------- 9. gpu check
def test_gpu_check_needs_nothing_beyond_torch_transformers_numpy(tmp_path):
    """What a bare GPU image has is enough: the check pulls in none of the project's other dependencies."""
    code = (
        "import sys, torch\n"
        "from experiments import gpu_check\n"
        "env = gpu_check.environment(torch.device('cpu'), gpu_check.TINY_CHECK)\n"
        "target = gpu_check.build_target(gpu_check.TINY, torch.float32, torch.device('cpu'))\n"
        "draft = gpu_check.build_draft(target, gpu_check.TINY_CHECK)\n"
        # (not scipy: transformers itself may load it)
        "extra = {'matplotlib', 'datasets', 'gguf', 'pytest', 'hypothesis', 'plots', 'flash_attn'}\n"
        "print(env['schema'], sorted({m.split('.')[0] for m in sys.modules} & extra))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ddtree-gpu-profile/1 []"


# ---------------------------------------------------------------------------------------------------- 10. bad input
def test_a_prompt_token_outside_the_vocabulary_is_named():
    target = make_target("llama", vocab=64)
    draft = make_draft(target)
    with pytest.raises(ValueError, match=r"token id 70, outside the target's vocabulary \(ids 0\.\.63, 64 tokens\)"):
        autoregressive_generate(target, torch.tensor([[1, 2, 70, 3]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="token id -1"):
        dflash_generate(target, draft, torch.tensor([[-1, 2]]), max_new_tokens=2)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "lfs-pointer"])
def test_a_damaged_safetensors_file_is_named_with_the_fix(tmp_path, damage):
    draft = make_draft(make_target("qwen3"), dtype=torch.float32)
    draft.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    lfs_pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 123\n"
    weights.write_bytes({"garbage": b"\xff" * 64, "truncated": data[: len(data) // 2], "lfs-pointer": lfs_pointer}[damage])
    with pytest.raises(ValueError, match=r"(?s)model\.safetensors is not a readable safetensors file.*download or export"):
        load_draft(tmp_path)


class _Payload:
    def __reduce__(self):
        return (print, ("this would run on load",))


def test_training_checkpoints_are_loaded_without_unpickling_code(tmp_path):
    from dflash_core.training.loop import load_checkpoint

    safe = tmp_path / "ok.pt"
    torch.save({"draft": {"w": torch.ones(2)}, "state": {"step": 3, "history": [{"loss": 1.5}]}}, safe)
    assert load_checkpoint(safe)["state"]["step"] == 3
    evil = tmp_path / "evil.pt"
    torch.save({"draft": {}, "payload": _Payload()}, evil)
    with pytest.raises(ValueError, match="arbitrary code"):
        load_checkpoint(evil)


# ---------------------------------------------------------------------------------------------------- device placement
def test_block_inputs_follow_the_anchors_device():
    """Replay and training on CUDA build blocks from anchors on the GPU: every tensor block_inputs makes must follow
    the anchors' device (the meta device stands in for CUDA: mixing it with a CPU tensor raises the same way)."""
    from dflash_core.training.blocks import block_attention_mask, block_inputs

    ids = torch.arange(30, device="meta")
    anchors = torch.tensor([3, 7, 20], device="meta")
    tokens, positions, labels = block_inputs(ids, anchors, 4, 0)
    assert tokens.device.type == positions.device.type == labels.device.type == "meta"
    assert labels.shape == (3, 3) and tokens.shape == (12,)
    assert block_attention_mask(anchors, 4, 20).device.type == "meta"


def test_resolve_device_gives_each_torchrun_rank_its_own_gpu(monkeypatch):
    """``--device cuda`` (or auto) under torchrun: rank LOCAL_RANK's GPU, made current; an explicit index is kept."""
    from dflash_core.training import targets

    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert targets.resolve_device("cuda") == torch.device("cuda", 3) and current[-1] == torch.device("cuda", 3)
    assert targets.resolve_device("auto") == torch.device("cuda", 3)
    assert targets.resolve_device("cuda:1") == torch.device("cuda", 1) and current[-1] == torch.device("cuda", 1)
    assert targets.resolve_device("cpu") == torch.device("cpu")
