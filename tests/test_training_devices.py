"""Training on GPUs, checked on the CPU: torchrun setup, device placement, the loss's LM head, attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_draft, make_target, prompt
from dflash_core.config import DFlashConfig


def _inputs(config: DFlashConfig, ctx_len: int, block: int, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(1, ctx_len, config.num_taps * config.hidden_size, generator=g, dtype=dtype)
    blk = torch.randn(1, block, config.hidden_size, generator=g, dtype=dtype)
    return ctx, blk


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
    from dflash_core.blocks import block_attention_mask

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
    from dflash_core.training.train_config import TrainConfig
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


def test_block_inputs_follow_the_anchors_device():
    """Replay and training on CUDA build blocks from anchors on the GPU: every tensor block_inputs makes must follow
    the anchors' device (the meta device stands in for CUDA: mixing it with a CPU tensor raises the same way)."""
    from dflash_core.blocks import block_attention_mask, block_inputs

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
