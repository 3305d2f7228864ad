"""The target's KV cache is written in place (``dflash_core.target.SlotLayer``): a forward writes only its new slots
into a buffer that grows geometrically, and crop / move / select keep working on it. Oracle: the same forwards on
transformers' own concatenating ``DynamicLayer`` give the same logits and the same cache contents."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from conftest import make_draft, make_target, prompt
from dflash_core.target import SlotLayer, TargetAdapter
from greedy_reference import greedy_reference
from ddtree import ddtree_generate

VOCAB = 48


def _plain_cache():
    return DynamicCache()


def _run(adapter: TargetAdapter, cache, steps: list[tuple[str, tuple]]) -> list[torch.Tensor]:
    outs = []
    for op, args in steps:
        if op == "forward":
            outs.append(adapter.forward(*args[:2], cache, *args[2:]).logits)
        elif op == "move":
            adapter.move_slots(cache, *args)
        elif op == "crop":
            adapter.crop(cache, *args)
        elif op == "select":
            adapter.select_sequences(cache, *args)
    return outs


def test_in_place_cache_equals_the_concatenating_one():
    target = make_target("qwen3", vocab=VOCAB)  # float64
    adapter = TargetAdapter(target)
    ids = torch.stack([prompt(b, 9, VOCAB)[0] for b in range(3)])
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    visible = torch.cat([torch.ones(3, 3, 9, dtype=torch.bool), tree.expand(3, 3, 3)], dim=-1)
    steps = [
        ("forward", (ids, torch.arange(9).expand(3, -1))),  # prefill, causal
        ("forward", (ids[:, :3], torch.tensor([9, 10, 10]).expand(3, -1), visible)),  # a tree of 3 per sequence
        ("move", (torch.tensor([[9, 11]] * 3), torch.tensor([[9, 10]] * 3), 11)),  # keep root and second child
        ("forward", (ids[:, 3:4], torch.tensor([[11]] * 3))),
        ("crop", (10,)),
        ("select", (torch.tensor([0, 2]),)),
        ("forward", (ids[:2, 4:6], torch.tensor([[10, 11]] * 2))),
    ]
    slot, plain = adapter.new_cache(), _plain_cache()
    got, want = _run(adapter, slot, steps), _run(adapter, plain, steps)
    assert all(isinstance(layer, SlotLayer) for layer in slot.layers)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for a, b in zip(slot.layers, plain.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_decode_step_writes_into_the_same_buffer():
    target = make_target("llama", vocab=VOCAB)
    adapter = TargetAdapter(target)
    cache = adapter.new_cache()
    adapter.forward(prompt(0, 20, VOCAB), torch.arange(20)[None], cache)
    buffers = [layer._keys.data_ptr() for layer in cache.layers]
    for t in range(20, 60):
        adapter.forward(torch.tensor([[t % VOCAB]]), torch.tensor([[t]]), cache)
    assert [layer._keys.data_ptr() for layer in cache.layers] == buffers  # no reallocation, no concatenation
    assert cache.layers[0].keys.shape[-2] == 60 and cache.get_seq_length() == 60


def test_the_buffer_grows_past_its_capacity_and_decoding_stays_exact():
    target = make_target("llama", vocab=VOCAB)
    draft = make_draft(target, block_size=4)
    p = prompt(3, 100, VOCAB)  # the first buffer holds 100 + 256 slots: 300 new tokens outgrow it
    got = ddtree_generate(target, draft, p, budget=6, max_new_tokens=300).new_token_ids
    assert got == greedy_reference(target, p, 300)
