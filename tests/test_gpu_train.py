"""The GPU training run's pieces that run anywhere: the arms' drafter surgery, the weight parts, the summary.

Oracles: a deepened drafter against the original (identical outputs, since its new layers start as the identity); a
widened drafter against the original on the old columns (identical logits and Markov bias); parts joined back against
the saved weights; the summary's tau against tokens and rounds counted by hand.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_draft, make_target
from dflash_core.model import attach_markov_head, load_draft
from experiments.studies.gpu_train.arms import ARMS, apply_arm, deepen, strip_markov, widen_vocab
from experiments.studies.gpu_train.pack import join, split_drafter
from experiments.studies.gpu_train.run import _choose, summarise


def _drafter(seed: int = 0, vocab_ids: int = 20, kind: str = "gated"):
    target = make_target(vocab=64, dtype=torch.float64)
    draft = make_draft(target, block_size=4, layers=2, dtype=torch.float64)
    draft.set_draft_vocab(torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:vocab_ids])
    head = attach_markov_head(draft, 6, kind)
    with torch.no_grad():  # a trained-looking head: nonzero output weights
        head.out.weight.normal_(generator=torch.Generator().manual_seed(seed + 1))
    return target, draft


def _inputs(target, draft, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = target.config.hidden_size
    block = torch.randn(1, draft.block_size, h, generator=g, dtype=torch.float64)
    context = torch.randn(1, 7, len(draft.config.target_layer_ids) * h, generator=g, dtype=torch.float64)
    return block, context, torch.arange(7, 7 + draft.block_size), torch.arange(7)


def test_deepened_drafter_starts_as_the_original():
    target, draft = _drafter()
    args = _inputs(target, draft)
    before = draft(*args)
    deepen(draft, 4)
    assert len(draft.layers) == 4 and draft.config.num_hidden_layers == 4
    torch.testing.assert_close(draft(*args), before, rtol=0, atol=1e-12)
    # the new layers are not inert: their input projections are the last layer's (gradients flow at once)
    torch.testing.assert_close(draft.layers[3].self_attn.q_proj.weight, draft.layers[1].self_attn.q_proj.weight)
    assert float(draft.layers[3].mlp.down_proj.weight.detach().abs().sum()) == 0.0
    with pytest.raises(ValueError, match="fewer"):
        deepen(draft, 3)


def test_deepened_drafter_round_trips_through_save(tmp_path):
    _, draft = _drafter()
    deepen(draft, 3)
    draft.save_pretrained(tmp_path)
    loaded = load_draft(tmp_path, dtype=torch.float64)
    assert len(loaded.layers) == 3
    for key, value in draft.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value)


@pytest.mark.parametrize("kind", ["token", "gated"])
def test_widened_vocabulary_keeps_every_old_score(kind):
    target, draft = _drafter(kind=kind)
    old_ids = draft.draft_vocab.clone()
    hidden = torch.randn(5, target.config.hidden_size, dtype=torch.float64)
    head = target.lm_head.weight
    logits_before, _ = draft.compact_logits(hidden, head)
    prev = torch.tensor([0, 3, 19, 20, 7])  # draft indices; 20 = the old out-of-vocabulary bucket
    bias_before = draft.markov(prev, hidden)
    ranked = torch.randperm(64, generator=torch.Generator().manual_seed(9))
    widen_vocab(draft, ranked, 32)
    assert draft.draft_vocab[:20].tolist() == old_ids.tolist() and len(set(draft.draft_vocab.tolist())) == 32
    expected_new = [int(t) for t in ranked if int(t) not in set(old_ids.tolist())][:12]
    assert draft.draft_vocab[20:].tolist() == expected_new
    logits_after, _ = draft.compact_logits(hidden, head)
    torch.testing.assert_close(logits_after[:, :20], logits_before)
    new_prev = torch.tensor([0, 3, 19, 32, 7])  # the OOV bucket moved to index 32
    bias_after = draft.markov(new_prev, hidden)
    torch.testing.assert_close(bias_after[:, :20], bias_before)
    assert float(bias_after[:, 20:].detach().abs().max()) == 0.0  # new columns: the base logits alone
    # a token that was out of vocabulary and now has its own row scores as the bucket did
    torch.testing.assert_close(draft.markov(torch.tensor([25]), hidden[:1]),
                               draft.markov(torch.tensor([32]), hidden[:1]))
    with pytest.raises(ValueError, match="distinct ids"):
        widen_vocab(draft, ranked[:3], 40)


def test_strip_and_apply_arm(tmp_path):
    _, draft = _drafter()
    apply_arm(draft, ARMS["l3"])
    assert len(draft.layers) == 3 and draft.markov is not None
    strip_markov(draft)
    draft.save_pretrained(tmp_path)
    assert load_draft(tmp_path).markov is None
    with pytest.raises(ValueError, match="ranked"):
        apply_arm(_drafter()[1], ARMS["l2-v8k"])


def test_parts_join_back_to_the_saved_drafter(tmp_path):
    _, draft = _drafter()
    draft.save_pretrained(tmp_path / "d", dtype=torch.float32)
    parts = split_drafter(tmp_path / "d", tmp_path, "x", part_bytes=16384)
    assert len(parts) > 2 and all(p.stat().st_size < 16384 + 2048 for p in parts)
    (tmp_path / "results.json").write_text(json.dumps({"configs": {"x": json.loads(
        (tmp_path / "d" / "config.json").read_text())}}))
    loaded = load_draft(join(tmp_path, "x", tmp_path / "joined"), dtype=torch.float32)
    for key, value in draft.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value.float() if value.is_floating_point() else value)
    with pytest.raises(FileNotFoundError, match="no drafter 'y'"):
        join(tmp_path, "y", tmp_path / "none")


def test_summary_counts_tau_and_pairs_per_prompt():
    rows = [{"draft": d, "budget": b, "dataset": "gsm8k", "sample_id": str(i), "rounds": r, "tokens": t}
            for d, b, i, r, t in [("v6", 32, 0, 10, 20), ("v6", 32, 1, 5, 15), ("l3", 32, 0, 8, 20),
                                  ("l3", 32, 1, 5, 20), ("l2", 32, 0, 10, 20), ("l2", 32, 1, 5, 15)]]
    s = summarise(rows, "v6")
    assert s["v6"]["32"]["tau"] == pytest.approx(35 / 15)
    assert s["l3"]["32"]["tau"] == pytest.approx(40 / 13)
    mean, lo, hi = s["l3"]["32"]["paired_vs_v6"]
    assert mean == pytest.approx(((20 / 8 - 2) + (4 - 3)) / 2) and lo <= mean <= hi
    assert s["l2"]["32"]["paired_vs_v6"] == [0.0, 0.0, 0.0]
    assert _choose(s, ["l2", "l3", "l4"], keep=2) == ["l2", "l3"]  # l4 never trained: not chosen
