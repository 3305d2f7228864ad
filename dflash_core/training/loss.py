"""The drafter's loss: a teacher-forced target pass gives the features and soft labels, one drafter forward the loss.

:func:`target_features` runs the frozen target over a sequence (no grad) and keeps the tapped hidden states (the
drafter's context) and the target's top-k next-token distributions (soft labels). :func:`sequence_loss` puts all
blocks of the sequence (:mod:`dflash_core.blocks`) through one drafter forward and mixes the hard-label cross-entropy
with the distillation term.

Restricted-vocabulary loss (``loss_vocab="batch"``): the frozen LM head over the full vocabulary dominates a CPU step.
With it on, the softmax runs over the union of this step's labels, the target's top-k candidates at every predicted
position and ``negatives`` uniformly drawn other tokens (fresh each step), i.e. a sampled softmax. All probability mass
the loss cares about (hard label and soft labels) lies inside the set; the random negatives keep pushing the logits
of the remaining tokens down, so the full-vocabulary argmax used at decode time stays inside the trained region.
``loss_vocab="draft"`` is the exact softmax of a drafter with a reduced vocabulary (``set_draft_vocab``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..model import draft_index
from ..target import tapped_forward
from ..blocks import block_attention_mask, block_inputs
from .anchors import position_weights
from .train_config import TrainConfig

__all__ = ["SequenceFeatures", "target_features", "sequence_loss", "rows_loss", "draft_loss"]


@dataclass
class SequenceFeatures:
    features: torch.Tensor  # [T, taps*hidden] tapped target hidden states (target dtype)
    top_ids: torch.Tensor | None  # [T, k] the target's top-k next-token ids at each position
    top_logp: torch.Tensor | None  # [T, k] their log-probabilities (full-vocabulary softmax)
    # [T, V'] the target's log-distribution over the drafter's draft vocabulary (its order), renormalised inside it:
    # dense soft labels from a teacher-forced pass (:mod:`.stream`); used instead of the top-k with loss_vocab="draft"
    soft_logp: torch.Tensor | None = None
    distill_weight: float | None = None  # this sequence's weight of the soft term (None: the config's)


@torch.no_grad()
def target_features(target, ids: torch.Tensor, layer_ids: Sequence[int], topk: int) -> SequenceFeatures:
    """One teacher-forced target pass over ``ids`` [T] (no grad): tapped hidden states and top-k distributions.

    The features come from :func:`dflash_core.target.tapped_forward`, the one reader of the target's taps, so the
    drafter trains on exactly the states the decode loop will hand it.
    """
    device = target.lm_head.weight.device
    out = tapped_forward(target, ids[None].to(device), layer_ids, use_cache=False)
    feats = out.features[0]  # [T, taps*H]
    top_ids = top_logp = None
    if topk > 0:
        logp = torch.log_softmax(out.logits[0].float(), dim=-1)
        top_logp, top_ids = logp.topk(topk, dim=-1)
    return SequenceFeatures(feats.clone(), top_ids, top_logp)


# ---------------------------------------------------------------------------------------------------- loss
def _predicted_hidden(model, embed: torch.nn.Module, ids: torch.Tensor, feats: SequenceFeatures,
                      anchors: torch.Tensor, cfg: TrainConfig, dev: torch.device,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ONE drafter forward over all blocks of the sequence. Returns the hidden states [N, H] of the N predicted
    positions (block positions 1..b-1 whose label lies inside the sequence), their labels [N] (on ``dev``) and the
    [A, b-1] mask that picked them."""
    core = getattr(model, "module", model)
    b = core.block_size
    n_ctx = int(anchors.max())  # context features 0..max_anchor-1 cover every block's needs
    tokens, positions, labels = block_inputs(ids, anchors, b, core.mask_token_id)
    mask = block_attention_mask(anchors, b, n_ctx, device=dev)[None, None]  # [1, 1, A*b, Nc + A*b]
    with torch.no_grad():
        block_embeds = embed(tokens.to(embed.weight.device))[None].to(dev, dtype)  # [1, A*b, H] (frozen target embeddings)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.autocast):
        hidden = model(block_embeds, feats.features[:n_ctx][None].to(dev, dtype), positions.to(dev),
                       torch.arange(n_ctx, device=dev), attn_mask=mask)  # [1, A*b, H]
    valid = labels >= 0  # [A, b-1]
    hidden = hidden[0].view(len(anchors), b, -1)[:, 1:][valid.to(dev)]  # [N, H] predicted positions
    return hidden, labels[valid].to(dev), valid


def _topk_soft_labels(feats: SequenceFeatures, src: torch.Tensor, dev: torch.device,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's renormalised top-k distribution labelling each predicted row: ids [N, k] and probabilities [N, k]
    (the distribution for the token at anchor+k sits at sequence position ``src`` = anchor+k-1)."""
    s_ids = feats.top_ids[src.to(feats.top_ids.device)].to(dev)  # [N, k]
    s_prob = feats.top_logp[src.to(feats.top_ids.device)].to(dev).double().exp().to(dtype if dtype == torch.float64 else torch.float32)
    return s_ids, s_prob / s_prob.sum(-1, keepdim=True)


def _loss_vocabulary(cfg: TrainConfig, core, head_weight: torch.Tensor, labels: torch.Tensor,
                     s_ids: torch.Tensor | None, dev: torch.device, generator: torch.Generator | None):
    """The softmax's vocabulary for ``cfg.loss_vocab``: (lookup from token ids to head rows, head [C, H], and for
    ``draft`` the token-to-draft-id map [V], -1 outside the draft vocabulary, else None)."""
    if cfg.loss_vocab == "batch":
        parts = [labels] + ([s_ids.reshape(-1)] if s_ids is not None else [])
        if cfg.negatives > 0:
            parts.append(torch.randint(0, head_weight.shape[0], (cfg.negatives,), generator=generator).to(dev))
        cand = torch.unique(torch.cat(parts))  # sorted candidate ids [C]
        return (lambda x: torch.searchsorted(cand, x)), head_weight[cand], None  # index of an id inside cand
    if cfg.loss_vocab == "full":
        return (lambda x: x), head_weight, None
    if cfg.loss_vocab == "draft":
        # the exact softmax of a drafter with a reduced vocabulary: over its V' tokens
        if core.draft_vocab is None:
            raise ValueError("loss_vocab='draft' needs a drafter with a draft vocabulary (set_draft_vocab)")
        vocab = core.draft_vocab.to(dev)
        t2d = torch.full((head_weight.shape[0],), -1, dtype=torch.long, device=dev)
        t2d[vocab] = torch.arange(len(vocab), device=dev)
        return (lambda x: t2d[x].clamp(min=0)), core.head_rows(head_weight), t2d
    raise ValueError(f"loss_vocab must be 'full', 'batch' or 'draft', got {cfg.loss_vocab!r}")


def _soft_inside_draft_vocab(t2d: torch.Tensor, s_ids: torch.Tensor | None,
                             s_prob: torch.Tensor | None) -> torch.Tensor | None:
    """Soft labels outside the draft vocabulary are dropped and the rest renormalised (the drafter's softmax runs over
    its own V' tokens only)."""
    if s_prob is None:
        return None
    s_prob = s_prob * (t2d[s_ids] >= 0)
    return s_prob / s_prob.sum(-1, keepdim=True).clamp(min=1e-12)


def _head_log_probs(hidden: torch.Tensor, head: torch.Tensor, dev: torch.device,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [N, C] of the predicted rows over the head's vocabulary, and their log-softmax (at least fp32).
    ``bias`` [N, C]: the Markov head's logit bias (added in fp32).

    The head is the frozen target's (up to V x H = 0.6e9 entries): the product runs in the head's own dtype, so the
    head is never cast or copied per sequence (``head.to(fp32)``, or autocast's cast of a non-bf16 head, would be).
    """
    with torch.autocast(dev.type, enabled=False):
        logits = hidden.to(head.dtype) @ head.t()  # [N, C]
        if bias is not None:
            logits = logits.float() + bias.float()
    return logits, torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def _markov_bias(core, cfg: TrainConfig, ids: torch.Tensor, src: torch.Tensor, hidden: torch.Tensor,
                 dev: torch.device) -> torch.Tensor | None:
    """[N, V'] the Markov head's bias for each predicted row, teacher-forced: the previous token of the row that
    predicts ``ids[src + 1]`` is the target's own ``ids[src]`` (the anchor itself for block position 1)."""
    if getattr(core, "markov", None) is None:
        return None
    if cfg.loss_vocab not in ("draft", "full") or (cfg.loss_vocab == "full") != (core.draft_vocab is None):
        raise ValueError("a Markov head is trained over its drafter's own vocabulary: loss_vocab='draft' with a "
                         "draft vocabulary, 'full' without one")
    prev = draft_index(core, ids.to(dev)[src.to(dev)])  # [N]
    with torch.autocast(dev.type, enabled=False):
        return core.markov(prev, hidden.float())


def sequence_loss(model, embed: torch.nn.Module, head_weight: torch.Tensor, ids: torch.Tensor,
                  feats: SequenceFeatures, anchors: torch.Tensor, cfg: TrainConfig,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """Sum over the blocks of one sequence of sum_k w_k * CE_k, from ONE drafter forward over all its blocks.

    ``model`` is the drafter (or its DDP wrapper). Returns (weighted CE sum, stats: weight sum, top-1 hits at k=1).
    CE_k mixes the hard label (the token the target produced) and, with ``distill_weight`` > 0, the target's own
    renormalised top-k distribution at that position.
    """
    core = getattr(model, "module", model)
    dev = head_weight.device
    dtype = next(core.parameters()).dtype  # the drafter's master weights (fp32 when training)
    hidden, labels, valid = _predicted_hidden(model, embed, ids, feats, anchors, cfg, dev, dtype)
    return rows_loss(core, cfg, head_weight, ids, feats, anchors, hidden, labels, valid, generator)


def rows_loss(core, cfg: TrainConfig, head_weight: torch.Tensor, ids: torch.Tensor, feats: SequenceFeatures,
              anchors: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """The loss terms of one sequence's predicted rows: ``hidden`` [N, H] (the drafter's states at the N valid
    block positions, block-major), their ``labels`` [N] and the [A, b-1] ``valid`` mask that picked them; returns
    what :func:`sequence_loss` returns."""
    b = core.block_size
    dev = head_weight.device
    dtype = next(core.parameters()).dtype
    weights = position_weights(b, cfg.gamma).expand(len(anchors), -1)[valid].to(dev)  # [N]
    distill_weight = cfg.distill_weight if feats.distill_weight is None else feats.distill_weight
    dense = feats.soft_logp is not None and distill_weight > 0
    if dense and cfg.loss_vocab != "draft":
        raise ValueError("dense soft labels (soft_logp) are over the draft vocabulary: they need loss_vocab='draft'")
    distill = feats.top_ids is not None and distill_weight > 0 and not dense
    src = (anchors[:, None] + torch.arange(b - 1))[valid]  # [N] sequence position whose distribution labels each row
    s_ids, s_prob = _topk_soft_labels(feats, src, dev, dtype) if distill else (None, None)
    lookup, head, t2d = _loss_vocabulary(cfg, core, head_weight, labels, s_ids, dev, generator)
    drafted = torch.ones_like(labels, dtype=torch.bool) if t2d is None else t2d[labels] >= 0  # [N] label draftable
    if t2d is not None:
        s_prob = _soft_inside_draft_vocab(t2d, s_ids, s_prob)
    logits, logp = _head_log_probs(hidden, head, dev, _markov_bias(core, cfg, ids, src, hidden, dev))
    columns = lookup(labels)  # [N] the label's column (a placeholder 0 where it cannot be drafted)
    # a label outside the draft vocabulary has probability 0 under the drafter: its hard term is dropped (no finite
    # cross-entropy exists), the row keeps its soft term
    hard = -logp.gather(1, columns[:, None])[:, 0] * drafted  # [N]
    d_prob = None
    if dense:
        d_prob = feats.soft_logp[src.to(feats.soft_logp.device)].to(dev).float().exp()  # [N, V'] target's distribution
        soft = -(d_prob * logp).sum(-1)  # [N] cross-entropy against it (the drafter's softmax over the same V')
    elif distill:
        soft = -(s_prob * logp.gather(1, lookup(s_ids))).sum(-1)  # [N]
    mix = distill_weight if dense or distill else 0.0
    ce = hard if mix == 0 else (1 - mix) * hard + mix * soft
    # rows left without any term (an undraftable label and no soft labels) weigh 0; batch_weight counts every row,
    # so the mean stays over the same denominator on every rank (its value is a constant factor on this step)
    w = weights * (drafted | (mix > 0))
    with torch.no_grad():
        first = weights == 1.0  # block position k = 1
        # top-1 agreement with the target's own choice when its distribution is known, else with the label (a label
        # outside the draft vocabulary is a miss)
        want = d_prob[first].argmax(-1) if dense else torch.where(drafted[first], columns[first], -1)
        hits = int((logits[first].argmax(-1) == want).sum())
    return (w * ce).sum(), {"weight": float(w.sum()), "hits1": hits, "n1": int(first.sum())}


def draft_loss(model, embed: torch.nn.Module, head_weight: torch.Tensor,
               batch: list[tuple[torch.Tensor, SequenceFeatures, torch.Tensor]], cfg: TrainConfig,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """Weighted block loss of a batch of (ids [T], target features, anchors [A]): sum_k w_k CE_k / sum_k w_k."""
    sums, stats = [], {"weight": 0.0, "hits1": 0, "n1": 0}
    for ids, feats, anchors in batch:
        s, st = sequence_loss(model, embed, head_weight, ids, feats, anchors, cfg, generator)
        sums.append(s)
        for k in stats:
            stats[k] += st[k]
    loss = torch.stack(sums).sum() / stats["weight"]
    return loss, {**stats, "loss": float(loss), "acc1": stats["hits1"] / max(1, stats["n1"])}
