"""The default training loss against an oracle written from its definition, sharing none of its code: every block
drafted alone through the drafter's decoding call (no block mask, no concatenation), a full-vocabulary softmax in
float64, the hard label and the target's renormalised top-k distribution mixed by the distill weight, positions
weighted by exp(-(k-1)/gamma), normalised by the weight sum."""

from __future__ import annotations

import math

import pytest
import torch

import dflash_core.training.loss as loss_module
from conftest import make_draft, make_target, prompt
from dflash_core.training.train_config import TrainConfig
from dflash_core.training.loss import draft_loss, target_features
from greedy_reference import greedy_reference


@torch.no_grad()
def oracle_loss(target, draft, sequences, gamma: float, distill_weight: float, topk: int, vocab=None) -> float:
    """sum over sequences, anchors a and block positions k (a + k inside the sequence) of
    w_k [(1 - d) CE(label) + d CE(top-k of the target)] / sum w_k, written out one block at a time.

    ``vocab`` (a list of target ids): the drafter's softmax runs over those ids only, the soft labels keep the top-k
    ids inside it (renormalised), a label outside it drops its hard term (the row keeps its soft term; with d = 0 it
    weighs nothing)."""
    b, mask = draft.block_size, draft.mask_token_id
    head = target.lm_head.weight.double()
    cols = list(range(head.shape[0])) if vocab is None else list(vocab)
    total, weights = 0.0, 0.0
    for ids, anchors in sequences:
        out = target(input_ids=ids[None], output_hidden_states=True, use_cache=False)
        taps = torch.cat([out.hidden_states[i + 1][0] for i in draft.config.target_layer_ids], -1)  # [T, taps*H]
        target_p = torch.softmax(out.logits[0].double(), -1)  # [T, V]: the target's next-token distributions
        for a in anchors:
            block = torch.tensor([int(ids[a])] + [mask] * (b - 1))
            hidden = draft(target.model.embed_tokens(block)[None], taps[:a][None], torch.arange(a, a + b),
                           torch.arange(a))[0]  # [b, H], the drafter's own call at decode time
            for k in range(1, b):
                if a + k >= len(ids):
                    break
                logp = dict(zip(cols, torch.log_softmax(hidden[k].double() @ head[cols].t(), -1).tolist()))
                label = int(ids[a + k])
                top = target_p[a + k - 1].topk(topk)
                kept = [(float(v), int(i)) for v, i in zip(top.values, top.indices) if int(i) in logp]
                # no top-k id inside the vocabulary: no soft label (the term is 0)
                soft = -sum(v * logp[i] for v, i in kept) / sum(v for v, _ in kept) if kept else 0.0
                inside = label in logp
                if not inside and distill_weight == 0:
                    loss, w = 0.0, 0.0
                else:
                    loss = (1 - distill_weight) * (-logp[label] if inside else 0.0) + distill_weight * soft
                    w = math.exp(-(k - 1) / gamma)
                total += loss * w
                weights += w
    return total / weights


@pytest.fixture(scope="module")
def setup():
    target = make_target("llama", vocab=64)
    draft = make_draft(target, block_size=5)
    sequences = []
    for seed, anchors in ((0, [6, 9, 15, 24]), (1, [5, 21, 22])):  # the last blocks run past the sequence's end
        p = prompt(seed, 5, 64)
        ids = torch.cat([p[0], torch.tensor(greedy_reference(target, p, 20))])
        sequences.append((ids, torch.tensor(anchors)))
    return target, draft, sequences


def library_loss(target, draft, sequences, cfg: TrainConfig) -> float:
    batch = [(ids, target_features(target, ids, draft.config.target_layer_ids, cfg.distill_topk), anchors)
             for ids, anchors in sequences]
    loss, _ = draft_loss(draft, target.model.embed_tokens, target.lm_head.weight, batch, cfg)
    return float(loss)


@pytest.mark.parametrize("distill_weight,gamma", [(0.5, 7.0), (0.2, 2.0), (0.0, 7.0), (1.0, 3.0)])
def test_default_loss_equals_the_oracle(setup, distill_weight, gamma):
    target, draft, sequences = setup
    cfg = TrainConfig(autocast=False, distill_topk=4, distill_weight=distill_weight, gamma=gamma)
    assert cfg.loss_vocab == "full"
    got = library_loss(target, draft, sequences, cfg)
    # rel 1e-6: the soft labels are the target's fp32 log-softmax (target_features), the rest is fp64
    assert got == pytest.approx(oracle_loss(target, draft, sequences, gamma, distill_weight, 4), rel=1e-6)


def test_the_oracle_catches_soft_labels_left_unnormalised(setup, monkeypatch):
    """The control: the library with its top-k soft labels not renormalised is off the oracle by far more than
    rounding."""
    target, draft, sequences = setup
    real = loss_module._topk_soft_labels

    def unnormalised(feats, src, dev, dtype):
        ids, prob = real(feats, src, dev, dtype)
        return ids, prob * feats.top_logp[src].exp().sum(-1, keepdim=True).to(prob.dtype)

    monkeypatch.setattr(loss_module, "_topk_soft_labels", unnormalised)
    cfg = TrainConfig(autocast=False, distill_topk=4)
    got = library_loss(target, draft, sequences, cfg)
    assert abs(got - oracle_loss(target, draft, sequences, cfg.gamma, cfg.distill_weight, 4)) > 1e-3


@pytest.mark.parametrize("distill_weight", [0.5, 0.0])
def test_draft_vocabulary_loss_equals_the_oracle(setup, distill_weight):
    """A drafter with a reduced vocabulary (30 of 64 ids; several labels fall outside it): a
    row whose label cannot be drafted keeps its soft term (the old loss gave it weight 0 and lost the soft term too)."""
    target, draft, sequences = setup
    vocab = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:30]
    labels = torch.cat([ids[int(a) + 1:] for ids, anchors in sequences for a in anchors])
    assert (~torch.isin(labels, vocab)).sum() >= 5  # the case has undraftable labels
    draft.set_draft_vocab(vocab)
    try:
        cfg = TrainConfig(autocast=False, distill_topk=4, distill_weight=distill_weight, loss_vocab="draft")
        got = library_loss(target, draft, sequences, cfg)
        want = oracle_loss(target, draft, sequences, cfg.gamma, distill_weight, 4, vocab.tolist())
    finally:
        draft.draft_vocab = None
    assert got == pytest.approx(want, rel=1e-6)

