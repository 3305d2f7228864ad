"""The Markov head's own trainer (dflash_core.training.markov_fit) against the drafter's training loss: features from
one padded batch equal per-sequence target passes, and the head's loss over the collected positions equals the
library loss of the same blocks."""

import pytest
import torch

from conftest import make_draft, make_target
from dflash_core.model import attach_markov_head
from dflash_core.training.anchors import sample_anchors
from dflash_core.training.train_config import TrainConfig
from dflash_core.training.loss import draft_loss, target_features
from dflash_core.training.markov_fit import _block_batch, batch_features, block_spans, collect_positions, head_loss


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama", vocab=64, dtype=torch.float32, init=0.3)
    draft = make_draft(target, block_size=5, dtype=torch.float32)
    draft.set_draft_vocab(torch.randperm(64, generator=torch.Generator().manual_seed(0))[:40])
    head = attach_markov_head(draft, 6, "gated")
    with torch.no_grad():
        head.out.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    seqs = [(torch.randint(0, 64, (n,), generator=g), p) for n, p in ((30, 6), (19, 4), (41, 10))]
    return target, draft, seqs


def test_padded_batch_features_equal_single_passes(pair):
    target, draft, seqs = pair
    got = batch_features(target, [s for s, _ in seqs], draft.config.target_layer_ids, 4)
    for (ids, _), feats in zip(seqs, got):
        want = target_features(target, ids, draft.config.target_layer_ids, 4)
        torch.testing.assert_close(feats.features, want.features, rtol=1e-5, atol=1e-5)
        assert torch.equal(feats.top_ids, want.top_ids)
        torch.testing.assert_close(feats.top_logp, want.top_logp, rtol=1e-5, atol=1e-5)


def test_head_loss_on_collected_positions_equals_the_training_loss(pair):
    """Same anchors (the collector's seeded draws, replayed), distill 0.5, draft vocabulary with undraftable labels:
    the stored-position loss equals draft_loss up to the bf16 storage of the drafter's states (the blocks recovered
    from the stored weights)."""
    target, draft, seqs = pair
    data = collect_positions(target, draft, seqs, deadline=float("inf"), anchors=6, gamma=7.0, topk=4, seed=3,
                             batch=2, log=lambda *_: None)
    assert int(data["sequences"]) == 3 and (data["label"] < 0).any()
    rows = draft.head_rows(target.lm_head.weight).float()
    starts, lengths = block_spans(data["w"])
    idx = _block_batch(starts, lengths)
    assert torch.equal(idx, torch.arange(len(data["w"]))) and len(starts) == 18  # 6 anchors x 3 sequences
    data = {k: v for k, v in data.items() if v.dim() > 0}
    with torch.no_grad():
        got = float(head_loss(draft, rows, data, distill_weight=0.5))
    g = torch.Generator().manual_seed(3)
    batch = [(ids, target_features(target, ids, draft.config.target_layer_ids, 4), sample_anchors(p, len(ids), 6, g))
             for ids, p in seqs]
    cfg = TrainConfig(distill_weight=0.5, distill_topk=4, loss_vocab="draft", autocast=False)
    with torch.no_grad():
        want = float(draft_loss(draft, target.model.embed_tokens, target.lm_head.weight, batch, cfg)[0])
    assert got == pytest.approx(want, rel=5e-3)
    with torch.no_grad():
        off = float(head_loss(draft, rows, data, distill_weight=0.0))
    assert off != pytest.approx(want, rel=5e-2)  # the comparison can tell the mixes apart

