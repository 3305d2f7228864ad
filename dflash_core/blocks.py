"""The block a drafter drafts, laid out for one batched forward over many blocks: used by offline replay (inference)
and by training (:mod:`dflash_core.training.loss`), so it lives in the core.

An anchor opens a block ``[token at anchor, MASK x (b-1)]``; the attention mask lets each block see the context
features strictly before its anchor plus its own block (bidirectionally), exactly what the drafter sees when it drafts
from that anchor during decoding.
"""

from __future__ import annotations

import torch

__all__ = ["block_inputs", "block_attention_mask"]


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Inputs and labels of the concatenated blocks of one sequence.

    ids: [T]; anchors: [A]. Returns block token ids [A*b] (anchor token then MASK), block positions [A*b]
    (anchor + 0..b-1) and labels [A, b-1] (token at anchor + k, or -100 past the end of the sequence).
    """
    b, t = block_size, ids.shape[0]
    offsets = torch.arange(b, device=anchors.device)  # on the anchors' device (CUDA in replay)
    positions = anchors[:, None] + offsets  # [A, b]
    tokens = torch.full_like(positions, mask_token_id)
    tokens[:, 0] = ids[anchors]
    label_pos = positions[:, 1:]  # [A, b-1]
    labels = torch.where(label_pos < t, ids[label_pos.clamp(max=t - 1)], torch.full_like(label_pos, -100))
    return tokens.reshape(-1), positions.reshape(-1), labels


def block_attention_mask(anchors: torch.Tensor, block_size: int, n_context: int,
                         device: torch.device | str | None = None) -> torch.Tensor:
    """[A*b, n_context + A*b] bool, True = may attend, built on ``device`` (default: the anchors' device).

    Query rows of block j see context columns c < anchors[j] (features strictly before its anchor) and every
    column of block j itself (bidirectional); nothing of the other blocks.
    """
    device = anchors.device if device is None else torch.device(device)
    anchors = anchors.to(device)
    a, b = anchors.shape[0], block_size
    block_of_row = torch.arange(a, device=device).repeat_interleave(b)  # [A*b]
    context = torch.arange(n_context, device=device)[None, :] < anchors[block_of_row][:, None]  # [A*b, Nc]
    own = block_of_row[:, None] == block_of_row[None, :]  # [A*b, A*b]
    return torch.cat([context, own], dim=1)
