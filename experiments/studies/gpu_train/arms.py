"""The drafter variants a GPU run trains, each made from the shipped drafter without changing what it drafts.

* :func:`deepen` appends layers that start as the identity: each copies the last layer's weights except its two
  output projections (attention ``o_proj`` and MLP ``down_proj``), which start at zero, so every residual branch adds
  nothing until trained, while the copied input projections give those branches useful gradients from the first step.
* :func:`widen_vocab` extends the draft vocabulary with the next most frequent response tokens. Old tokens keep their
  columns and their Markov rows; a new token had been out of vocabulary, so its Markov input row starts as the
  out-of-vocabulary bucket's and its output column at zero (the base logits alone). The drafter now can propose
  tokens it could not before; everything it proposed before scores as it did.
* :func:`strip_markov` removes the Markov head (the shipped drafter's head was trained alone on frozen layers, so
  stripping it gives back the drafter it was trained on: the protocol's ``v4`` baseline).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from dflash_core.model import MarkovHead
from dflash_core.model import DFlashDraftModel, DraftLayer

__all__ = ["Arm", "ARMS", "deepen", "widen_vocab", "strip_markov", "apply_arm"]


@dataclass(frozen=True)
class Arm:
    layers: int  # drafter layers after deepening
    vocab: int | None = None  # draft vocabulary size after widening (None: the initial drafter's)


ARMS: dict[str, Arm] = {"l2": Arm(2), "l3": Arm(3), "l4": Arm(4), "l2-v8k": Arm(2, 8192)}


def deepen(draft: DFlashDraftModel, layers: int) -> DFlashDraftModel:
    """Append identity-initialised layers until the drafter has ``layers`` (in place; returns it)."""
    have = len(draft.layers)
    if layers < have:
        raise ValueError(f"cannot deepen a {have}-layer drafter to {layers} layers (fewer)")
    if layers == have:
        return draft
    types = draft.config.layer_types
    if types is not None:
        types = tuple(types) + (types[-1],) * (layers - have)
    draft.config = dataclasses.replace(draft.config, num_hidden_layers=layers, layer_types=types)
    param = next(draft.parameters())
    for index in range(have, layers):
        layer = DraftLayer(draft.config, index).to(param.device, param.dtype)
        layer.load_state_dict(copy.deepcopy(draft.layers[have - 1].state_dict()))
        with torch.no_grad():
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        draft.layers.append(layer)
    return draft


def widen_vocab(draft: DFlashDraftModel, ranked_ids: torch.Tensor, size: int) -> DFlashDraftModel:
    """Extend the draft vocabulary to ``size`` ids: the current ones (same order) and then the first ids of
    ``ranked_ids`` (most frequent first) not already in it. In place; returns the drafter."""
    if draft.draft_vocab is None:
        raise ValueError("widen_vocab needs a drafter with a reduced draft vocabulary")
    old = draft.draft_vocab.tolist()
    if size < len(old):
        raise ValueError(f"cannot widen a {len(old)}-token draft vocabulary to {size}")
    have = set(old)
    extra = [int(t) for t in ranked_ids.tolist() if int(t) not in have][: size - len(old)]
    if len(old) + len(extra) < size:
        raise ValueError(f"only {len(old) + len(extra)} distinct ids available for a vocabulary of {size}")
    head = draft.markov
    if head is not None:
        draft.markov = None  # set_draft_vocab checks the head's size: swap it after
    draft.set_draft_vocab(torch.tensor(old + extra))
    if head is not None:
        draft.markov = _widened_head(head, size)
    return draft


def _widened_head(head: MarkovHead, size: int) -> MarkovHead:
    """``head`` over ``size`` draft tokens: old rows and columns kept, new input rows = the OOV bucket's, new output
    columns zero, the new OOV bucket = the old one."""
    v = head.vocab
    param = head.out.weight
    new = MarkovHead(size, head.gate.in_features if head.gate is not None else 1, head.rank, head.kind)
    new = new.to(param.device, param.dtype)
    with torch.no_grad():
        new.embed.weight[:v] = head.embed.weight[:v]
        new.embed.weight[v:] = head.embed.weight[v]  # new tokens and the OOV bucket: the old bucket's row
        new.out.weight.zero_()
        new.out.weight[:v] = head.out.weight
        if head.gate is not None:
            new.gate.load_state_dict(head.gate.state_dict())
    return new


def strip_markov(draft: DFlashDraftModel) -> DFlashDraftModel:
    """Remove the Markov head (in place; returns the drafter)."""
    draft.markov = None
    draft.config = dataclasses.replace(draft.config, markov_rank=None)
    return draft


def apply_arm(draft: DFlashDraftModel, arm: Arm, ranked_ids: torch.Tensor | None = None) -> DFlashDraftModel:
    """The arm's drafter made from ``draft`` (in place)."""
    deepen(draft, arm.layers)
    if arm.vocab is not None and arm.vocab != draft.config.draft_vocab_size:
        if ranked_ids is None:
            raise ValueError("widening the draft vocabulary needs the ranked response token ids")
        widen_vocab(draft, ranked_ids, arm.vocab)
    return draft
