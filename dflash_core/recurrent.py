"""Recurrent (linear-attention) target layers under tree verification: Qwen3-Next and Qwen3.5's Gated DeltaNet.

A linear-attention layer keeps no per-token keys and values: after token t it holds a short convolution window (the
last ``kernel - 1`` inputs of its causal conv) and a recurrent state (a ``[heads, d_k, d_v]`` matrix per sequence). A
tree node must read the state after *its own* ancestors, which a single left-to-right pass over the flattened tree
cannot give (a node would read its sibling's state). Here a tree forward runs each such layer depth by depth: all
nodes of one depth, of every sequence of the batch, go through the layer's own ``forward`` together as a batch of
one-token rows, each row handed its parent's conv window and recurrent state (the committed state for a root) through
:class:`NodeStates`, which stands in for the cache the layer reads. The layer's math is transformers' own single-token
decode step, so a node's output is exactly what plain decoding computes after the same path. Full-attention layers
of the same model see the usual ancestor mask in the same forward.

Every node's resulting state is kept (:class:`RecurrentLayer` ``.nodes``) until the commit, which makes the accepted
node's state the committed one; nothing is run again. Cost per verified node and linear layer: one decode step of
that layer (projections batched per depth; the depth loop adds at most ``depth + 1`` sequential calls per layer and
forward), and the memory of one state, ``heads * d_k * d_v`` fp32 values plus the conv window.

Only :mod:`dflash_core.target` uses this module.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn
from transformers.cache_utils import LinearAttentionLayer

__all__ = ["RECURRENT_KIND", "RecurrentLayer", "NodeStates", "TreeLevels", "tree_levels", "recurrent_modules",
           "run_by_depth", "state_bytes"]

RECURRENT_KIND = "linear_attention"  # transformers' layer_types name for a Gated DeltaNet layer


class RecurrentLayer(LinearAttentionLayer):
    """transformers' linear-attention cache layer (the prefill writes it through the model's own code) plus what a
    tree needs: the per-node states of the last tree forward, each sequence's committed length, and the state before
    the last commit (one step back, for measurements that repeat a round)."""

    def __init__(self, number_of_states: int = 1, **kwargs) -> None:
        super().__init__(number_of_states, **kwargs)
        self.nodes: tuple[torch.Tensor, torch.Tensor] | None = None  # conv [B, n, C, K], recurrent [B, n, H, dk, dv]
        self.base = 0  # cache slots before the last tree forward (its row i sits at slot base + i)
        self.lengths: list[int] = []  # committed tokens per sequence
        self.before: tuple[list[int], torch.Tensor, torch.Tensor] | None = None

    @property
    def started(self) -> bool:
        return bool(self.has_previous_state[0])

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window [B, C, K], recurrent state [B, H, dk, dv]) after each sequence's committed tokens."""
        return self.conv_states[0], self.recurrent_states[0]

    def commit(self, rows: list[int], lengths: list[int]) -> None:
        """Sequence b now ends at row ``rows[b]`` of the last tree forward (-1: it keeps its committed state) and
        holds ``lengths[b]`` tokens."""
        conv, recurrent = self.state()
        self.before = (list(self.lengths), conv, recurrent)
        if any(r >= 0 for r in rows):
            if self.nodes is None:
                raise RuntimeError("commit of a recurrent layer without a tree forward before it")
            take = torch.tensor([max(r, 0) for r in rows], device=conv.device)
            keep = torch.tensor([r < 0 for r in rows], device=conv.device)
            batch = torch.arange(len(rows), device=conv.device)
            conv = torch.where(keep[:, None, None], conv, self.nodes[0][batch, take])
            recurrent = torch.where(keep[:, None, None, None], recurrent, self.nodes[1][batch, take])
        self.conv_states[0], self.recurrent_states[0] = conv, recurrent
        self.lengths, self.nodes = list(lengths), None

    def select(self, rows: torch.Tensor) -> None:
        """Keep the sequences ``rows`` of the batch."""
        conv, recurrent = self.state()
        rows = rows.to(conv.device)
        self.conv_states[0], self.recurrent_states[0] = conv.index_select(0, rows), recurrent.index_select(0, rows)
        self.lengths = [self.lengths[int(r)] for r in rows]
        self.nodes = self.before = None

    def rewind(self, length: int) -> None:
        """Every sequence back to at most ``length`` tokens: a no-op for those already there; the others must have
        held exactly ``length`` tokens before the last commit (a recurrent state cannot be cut like a KV cache)."""
        back = [b for b, n in enumerate(self.lengths) if n > length]
        self.nodes = None
        if not back:
            return
        if self.before is None or any(self.before[0][b] != length for b in back):
            raise ValueError(f"a recurrent (linear-attention) layer can go back only to its state before the last "
                             f"commit; asked for {length} tokens, it holds {self.lengths}")
        conv, recurrent = self.state()
        index = torch.tensor(back, device=conv.device)
        conv, recurrent = conv.clone(), recurrent.clone()
        conv[index], recurrent[index] = self.before[1][index], self.before[2][index]
        self.conv_states[0], self.recurrent_states[0] = conv, recurrent
        for b in back:
            self.lengths[b] = length


class NodeStates:
    """The cache a Gated DeltaNet layer sees while it runs one depth of a tree: row r is one node (one token) that
    reads its parent's conv window ``conv[r]`` (updated in place by the layer's conv step, so it ends as the node's
    own) and recurrent state ``recurrent[r]``; the layer hands the node's new recurrent state back through
    :meth:`update_recurrent_state`. It answers both ways transformers' layers read their cache: through the cache's
    methods (``get_conv_state``, 5.2x) and through ``has_previous_state`` and ``layers[i].conv_states`` (5.17)."""

    record_past = False

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv, self.recurrent = conv, recurrent
        self.conv_states, self.recurrent_states = {0: conv}, {0: recurrent}
        self.layers = _Every(self)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return True

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.recurrent

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
                               ) -> torch.Tensor:
        self.recurrent = self.recurrent_states[0] = recurrent_states
        return recurrent_states

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int) -> None:
        pass


class _Every:
    """``layers[i]`` for any i: the one :class:`NodeStates` (a layer reads only its own index)."""

    def __init__(self, item: NodeStates) -> None:
        self.item = item

    def __getitem__(self, index: int) -> NodeStates:
        return self.item


class TreeLevels:
    """The rows of a tree forward grouped by depth: per depth, the batch index, row index and parent row (-1 for a
    root) of each of its rows (long tensors)."""

    def __init__(self, levels: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        self.levels = levels


def tree_levels(visible_new: torch.Tensor | None, batch: int, n: int) -> TreeLevels:
    """Depth groups of a forward's ``n`` new rows per sequence from their ancestor-or-self visibility ``visible_new``
    [B, n, n] (None: every sequence's rows form one chain). A row's depth is its number of visible earlier rows and
    its parent the deepest of them; a row that sees no other (a root, a padding row) reads the committed state."""
    if visible_new is None:
        rows = torch.arange(n)
        depth = rows.expand(batch, n)
        parent = (rows - 1).expand(batch, n)
    else:
        seen = visible_new.cpu() & ~torch.eye(n, dtype=torch.bool)
        depth = seen.sum(-1)
        parent = torch.where(depth > 0, (seen * (depth[:, None, :] + 1)).argmax(-1), torch.full_like(depth, -1))
    levels = []
    for d in range(int(depth.max()) + 1 if n else 0):
        b, i = (depth == d).nonzero(as_tuple=True)
        levels.append((b, i, parent[b, i]))
    return TreeLevels(levels)


def recurrent_modules(model: nn.Module) -> list[nn.Module]:
    """The linear-attention token mixers of a Qwen3-Next / Qwen3.5 style model (``layer.linear_attn``)."""
    return [layer.linear_attn for layer in model.model.layers if getattr(layer, "linear_attn", None) is not None]


def _forward_by_depth(module: nn.Module, layer: RecurrentLayer, levels: TreeLevels, base: int):
    """A stand-in ``forward`` for one Gated DeltaNet module: its own forward, depth by depth (module docstring)."""
    own = type(module).forward
    keyword = "cache" if "cache" in inspect.signature(own).parameters else "cache_params"  # 5.2x / 5.17

    def forward(hidden_states: torch.Tensor, attention_mask=None, **kwargs) -> torch.Tensor:
        kwargs.pop("cache", None), kwargs.pop("cache_params", None)
        batch, n, _ = hidden_states.shape
        conv0, recurrent0 = layer.state()
        _check_room(conv0, recurrent0, batch * n)
        out = torch.empty_like(hidden_states)
        conv = conv0.new_empty((batch, n) + conv0.shape[1:])
        recurrent = recurrent0.new_empty((batch, n) + recurrent0.shape[1:])
        for depth, (b, i, parent) in enumerate(levels.levels):
            b, i, parent = b.to(conv.device), i.to(conv.device), parent.to(conv.device)
            if depth == 0:
                states = NodeStates(conv0[b], recurrent0[b])
            else:
                states = NodeStates(conv[b, parent], recurrent[b, parent])
            out[b, i] = own(module, hidden_states[b, i][:, None], **{keyword: states}, **kwargs)[:, 0]
            conv[b, i], recurrent[b, i] = states.conv, states.recurrent.to(recurrent.dtype)
        layer.nodes, layer.base = (conv, recurrent), base
        return out

    return forward


def state_bytes(conv: torch.Tensor, recurrent: torch.Tensor) -> int:
    """Bytes of one node's state in one layer (conv window and recurrent state of one sequence)."""
    return conv[0].numel() * conv.element_size() + recurrent[0].numel() * recurrent.element_size()


def _check_room(conv: torch.Tensor, recurrent: torch.Tensor, rows: int) -> None:
    """On a GPU, refuse with the numbers before allocating node states that cannot fit (per layer; every linear
    layer keeps its own until the commit)."""
    if conv.device.type != "cuda":
        return
    need = rows * state_bytes(conv, recurrent)
    free = torch.cuda.mem_get_info(conv.device)[0]
    if need > free:
        raise ValueError(
            f"verifying {rows} tree rows on this hybrid target keeps one recurrent state per row and linear layer "
            f"({state_bytes(conv, recurrent) / 2**20:.1f} MiB each); this layer alone needs {need / 2**30:.1f} GiB "
            f"with {free / 2**30:.1f} GiB free: lower the node budget (or the batch)")


@contextmanager
def run_by_depth(modules: list[nn.Module], layers: list[RecurrentLayer], levels: TreeLevels, base: int
                 ) -> Iterator[None]:
    """Within the block, each linear-attention module runs a forward depth by depth against its cache layer (the
    instance's ``forward`` is replaced and restored; the model's class is untouched)."""
    try:
        for module, layer in zip(modules, layers):
            module.forward = _forward_by_depth(module, layer, levels, base)
        yield
    finally:
        for module in modules:
            module.__dict__.pop("forward", None)
