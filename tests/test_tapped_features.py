"""The drafter's features are read in one place (target.tapped_forward), and every reader sees the same states.

The oracle does not go through transformers' ``hidden_states`` tuple at all: forward hooks record what each decoder
layer returns, and tap i must be layer i's output. The decode loop's incremental adapter forwards, the training
loss's teacher-forced pass, the stream's batched base-model pass and the replay's drafter pass must all agree with it.
"""

from __future__ import annotations

import dataclasses

import torch

from conftest import forward_one, make_draft, make_target, prompt
from dflash_core.replay import draft_hidden_all_rounds
from dflash_core.target import TargetAdapter, tapped_forward
from dflash_core.training.loss import target_features
from dflash_core.training.stream import teacher_forced_batch

TAPS = (2, 0)  # out of order on purpose: the concatenation follows the drafter's order, not the layers'


def _layer_outputs(target, ids: torch.Tensor) -> list[torch.Tensor]:
    """[T, H] output of every decoder layer over ``ids`` [T], recorded by hooks (the oracle)."""
    seen = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: seen.append(out[0] if isinstance(out, tuple) else out))
             for layer in target.model.layers]
    try:
        with torch.no_grad():
            target(input_ids=ids[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [s.reshape(len(ids), -1) for s in seen]


def _oracle(target, ids: torch.Tensor) -> torch.Tensor:
    outs = _layer_outputs(target, ids)
    return torch.cat([outs[i] for i in TAPS], dim=-1)


def test_tapped_forward_is_the_tapped_layers_outputs_in_the_drafters_order():
    target = make_target("llama", vocab=64, layers=4)
    ids = prompt(0, 11, 64)[0]
    with torch.no_grad():
        out = tapped_forward(target, ids[None], TAPS, use_cache=False)
        base = tapped_forward(target, ids[None], TAPS, head=False, use_cache=False)
        full = target(input_ids=ids[None], use_cache=False).logits
    expected = _oracle(target, ids)
    assert out.features.shape == (1, len(ids), len(TAPS) * 32)
    assert torch.equal(out.features[0], expected)
    assert torch.equal(out.logits, full) and out.last_hidden is None
    assert torch.equal(base.features[0], expected) and base.logits is None
    assert torch.allclose(target.lm_head(base.last_hidden), full, atol=1e-12)  # head=False: the head's input
    assert tapped_forward(target, ids[None], (), use_cache=False).features is None


def test_decode_loop_loss_and_stream_read_the_same_features():
    target = make_target("qwen3", vocab=64, layers=4)
    ids = prompt(1, 14, 64)[0]
    expected = _oracle(target, ids)
    # the decode loop: a prefill, then one token and then a three-token chunk on the growing cache
    adapter = TargetAdapter(target, TAPS)
    cache = adapter.new_cache()
    parts = [forward_one(adapter, ids[a:b], torch.arange(a, b), cache)[1] for a, b in ((0, 10), (10, 11), (11, 14))]
    assert torch.allclose(torch.cat(parts), expected, atol=1e-10)
    # the training loss's teacher-forced pass, and the stream's batched base-model pass (padded by a longer row)
    assert torch.equal(target_features(target, ids, TAPS, topk=2).features, expected)
    draft = make_draft(target, taps=2)
    draft.config = dataclasses.replace(draft.config, target_layer_ids=TAPS)
    draft.set_draft_vocab(torch.arange(40))
    batch = teacher_forced_batch(target, draft, [ids, torch.cat([ids, ids[:3]])])
    assert torch.allclose(batch[0].features, expected, atol=1e-10)


def test_replay_drafts_from_the_tapped_features_of_the_prefix():
    """Row j of the replay's drafter pass == the drafter run on the oracle's features of the positions before the
    root, the way the decode loop conditions it."""
    target = make_target("llama", vocab=64, layers=4)
    draft = make_draft(target, taps=2, block_size=4)
    draft.config = dataclasses.replace(draft.config, target_layer_ids=TAPS)
    ids = prompt(2, 12, 64)[0]
    prompt_len = 8
    hidden = draft_hidden_all_rounds(target, draft, ids, prompt_len)
    feats = _oracle(target, ids)
    adapter = TargetAdapter(target, TAPS)
    for j, root in enumerate(range(prompt_len, len(ids))):
        block = torch.full((4,), draft.mask_token_id)
        block[0] = ids[root]
        with torch.no_grad():
            own = draft(adapter.embed(block)[None], feats[:root][None], torch.arange(root, root + 4),
                        torch.arange(root))[0, 1:]
        assert torch.allclose(hidden[j], own, atol=1e-9), j
