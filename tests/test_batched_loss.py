"""The batched training step (one padded target pass, one padded drafter forward) against the per-sequence one.

Oracle: the per-sequence path (:func:`sequence_loss`, :func:`target_features`), in fp64 without autocast, on
sequences of different lengths and anchor counts: features, loss, statistics and every gradient must agree, and a
short training run must follow the same loss curve.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_draft, make_target
from dflash_core.model import attach_markov_head
from dflash_core.training.anchors import sample_anchors
from dflash_core.training.batched import batched_sequence_loss, batched_target_features
from dflash_core.training.loop import train
from dflash_core.training.loss import sequence_loss, target_features
from dflash_core.training.train_config import TrainConfig


def _setup(markov: str | None = "gated", vocab_ids: int | None = 40):
    target = make_target(vocab=64, dtype=torch.float64)
    draft = make_draft(target, block_size=4, layers=2, dtype=torch.float64)
    if vocab_ids:
        draft.set_draft_vocab(torch.randperm(64, generator=torch.Generator().manual_seed(5))[:vocab_ids])
    if markov:
        with torch.no_grad():
            attach_markov_head(draft, 6, markov).out.weight.normal_(generator=torch.Generator().manual_seed(6))
    g = torch.Generator().manual_seed(2)
    seqs = [(torch.randint(0, 64, (n,), generator=g), p) for n, p in ((30, 8), (17, 5), (41, 12), (9, 4))]
    return target, draft, seqs


def test_batched_target_features_equal_one_pass_per_sequence():
    target, draft, seqs = _setup()
    layers = list(draft.config.target_layer_ids)
    batched = batched_target_features(target, [s for s, _ in seqs], layers, 5)
    for (ids, _), got in zip(seqs, batched):
        want = target_features(target, ids, layers, 5)
        torch.testing.assert_close(got.features, want.features)
        torch.testing.assert_close(got.top_logp, want.top_logp)
        assert torch.equal(got.top_ids, want.top_ids)


@pytest.mark.parametrize("markov,vocab_ids", [("gated", 40), ("token", 40), (None, None)])
def test_batched_loss_and_gradients_equal_the_sum_over_sequences(markov, vocab_ids):
    target, draft, seqs = _setup(markov, vocab_ids)
    cfg = TrainConfig(autocast=False, loss_vocab="draft" if vocab_ids else "full",
                      distill_topk=5, anchors=6)
    layers = list(draft.config.target_layer_ids)
    g = torch.Generator().manual_seed(3)
    batch = [(ids, target_features(target, ids, layers, 5), sample_anchors(p, len(ids), cfg.anchors, g))
             for ids, p in seqs]
    assert len({len(a) for _, _, a in batch}) > 1  # different anchor counts: padding is exercised
    embed, head = target.model.embed_tokens, target.lm_head.weight
    draft.zero_grad()
    total, stats = batched_sequence_loss(draft, embed, head, batch, cfg)
    total.backward()
    grads = {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad()
    want, want_stats = 0.0, {"weight": 0.0, "hits1": 0, "n1": 0}
    for ids, feats, anchors in batch:
        s, st = sequence_loss(draft, embed, head, ids, feats, anchors, cfg)
        s.backward()
        want = want + float(s.detach())
        for k in want_stats:
            want_stats[k] += st[k]
    assert float(total) == pytest.approx(want, rel=1e-10)
    assert stats == pytest.approx(want_stats)
    for k, p in draft.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[k], p.grad, rtol=1e-8, atol=1e-10)


def test_batched_training_follows_the_per_sequence_loss_curve():
    target, draft, seqs = _setup()
    cfg = TrainConfig(autocast=False, loss_vocab="draft", distill_topk=5, anchors=6, seqs_per_step=3, steps=4,
                      cache_features=False, lr=1e-3)
    curves = []
    for batched in (False, True):
        d = make_draft(target, block_size=4, layers=2, dtype=torch.float64)
        d.load_state_dict(draft.state_dict(), strict=False)
        d.set_draft_vocab(draft.draft_vocab)
        attach_markov_head(d, 6, "gated").load_state_dict(draft.markov.state_dict())
        state = train(target, d, seqs, dataclasses.replace(cfg, batched=batched), log=lambda *_: None)
        curves.append([h["loss"] for h in state.history])
    assert len(curves[0]) == 4
    # train() keeps fp32 master weights: the two paths agree to fp32 rounding, step after step
    assert curves[1] == pytest.approx(curves[0], rel=2e-6)
