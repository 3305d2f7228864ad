"""A training step's sequences in ONE padded target pass and ONE padded drafter forward (the GPU mode).

The per-sequence loss (:func:`.loss.sequence_loss`) launches a target pass and a drafter forward and backward per
sequence: on a GPU a 135M target and a 2-layer drafter are then bound by kernel launches, not arithmetic. Here the
step's sequences are right-padded into one batch:

* target pass: ``[S, T_max]`` token ids, right padding. Attention is causal, so a real position never sees a pad and
  its tapped states and top-k distribution are the unpadded pass's (up to the batched kernels' rounding).
* drafter: every sequence's blocks padded to the step's most anchors ``A_max``, its context to the longest context
  ``C_max``. A padded block row sees only itself (one True on the diagonal, so no softmax over nothing) and carries
  no label; a real row sees exactly the columns :func:`dflash_core.blocks.block_attention_mask` gives it (its context
  columns sit at the same indices, the padding context columns are never visible). So each real row's hidden state
  equals the per-sequence forward's.

The rows then go through the same per-sequence loss terms (:func:`.loss.rows_loss`), so the loss and its gradient
equal the per-sequence path's sum (tests: ``tests/test_batched_loss.py``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..blocks import block_attention_mask, block_inputs
from ..target import tapped_forward
from .loss import SequenceFeatures, rows_loss
from .train_config import TrainConfig

__all__ = ["batched_target_features", "batched_sequence_loss"]


@torch.no_grad()
def batched_target_features(target, sequences: Sequence[torch.Tensor], layer_ids: Sequence[int],
                            topk: int) -> list[SequenceFeatures]:
    """:func:`.loss.target_features` of every sequence from one right-padded target pass."""
    device = target.lm_head.weight.device
    lengths = [len(s) for s in sequences]
    ids = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
    for j, s in enumerate(sequences):
        ids[j, : len(s)] = s
    out = tapped_forward(target, ids.to(device), layer_ids, use_cache=False)
    feats = []
    for j, n in enumerate(lengths):
        top_ids = top_logp = None
        if topk > 0:
            top_logp, top_ids = torch.log_softmax(out.logits[j, :n].float(), dim=-1).topk(topk, dim=-1)
        feats.append(SequenceFeatures(out.features[j, :n].clone(), top_ids, top_logp))
    return feats


def _padded_blocks(core, batch, dev: torch.device):
    """(block token ids [S, A_max*b], positions [S, A_max*b], mask [S, 1, A_max*b, C_max + A_max*b], per-sequence
    (labels [A, b-1], n_ctx)) with the padding the module docstring describes."""
    b = core.block_size
    parts = [(block_inputs(ids, anchors, b, core.mask_token_id), int(anchors.max())) for ids, _, anchors in batch]
    a_max = max(len(anchors) for _, _, anchors in batch)
    c_max = max(n for _, n in parts)
    rows = a_max * b
    tokens = torch.full((len(batch), rows), core.mask_token_id, dtype=torch.long)
    positions = torch.zeros(len(batch), rows, dtype=torch.long)
    mask = torch.zeros(len(batch), rows, c_max + rows, dtype=torch.bool, device=dev)
    mask[:, torch.arange(rows), c_max + torch.arange(rows)] = True  # padded rows: themselves (never all False)
    for j, ((tok, pos, _), n_ctx) in enumerate(parts):
        anchors = batch[j][2]
        m = block_attention_mask(anchors, b, n_ctx, device=dev)  # [A*b, n_ctx + A*b]
        r = len(tok)
        tokens[j, :r], positions[j, :r] = tok, pos
        mask[j, :r, :] = False
        mask[j, :r, :n_ctx] = m[:, :n_ctx]
        mask[j, :r, c_max:c_max + r] = m[:, n_ctx:]
    return tokens, positions, mask[:, None], [(lab, n) for (_, _, lab), n in parts], c_max


def batched_sequence_loss(model, embed: torch.nn.Module, head_weight: torch.Tensor,
                          batch: list[tuple[torch.Tensor, SequenceFeatures, torch.Tensor]], cfg: TrainConfig,
                          generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """The sum over ``batch`` of :func:`.loss.sequence_loss` from one padded drafter forward; (loss sum, stats)."""
    core = getattr(model, "module", model)
    b = core.block_size
    dev = head_weight.device
    dtype = next(core.parameters()).dtype
    tokens, positions, mask, labels, c_max = _padded_blocks(core, batch, dev)
    context = torch.zeros(len(batch), c_max, batch[0][1].features.shape[-1], dtype=dtype, device=dev)
    for j, (_, feats, _) in enumerate(batch):
        n = labels[j][1]
        context[j, :n] = feats.features[:n].to(dev, dtype)
    with torch.no_grad():
        block_embeds = embed(tokens.to(embed.weight.device)).to(dev, dtype)  # frozen target embeddings
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.autocast):
        hidden = model(block_embeds, context, positions.to(dev), torch.arange(c_max, device=dev), attn_mask=mask)
    total, stats = None, {"weight": 0.0, "hits1": 0, "n1": 0}
    for j, (ids, feats, anchors) in enumerate(batch):
        lab = labels[j][0]
        valid = lab >= 0
        rows = hidden[j, : len(anchors) * b].view(len(anchors), b, -1)[:, 1:][valid.to(dev)]
        s, st = rows_loss(core, cfg, head_weight, ids, feats, anchors, rows, lab[valid].to(dev), valid, generator)
        total = s if total is None else total + s
        for k in stats:
            stats[k] += st[k]
    return total, stats
