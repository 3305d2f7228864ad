"""The target adapter: the ONE place that touches transformers' model and cache plumbing.

Everything version-specific lives here: how the KV cache is passed (``cache=`` in transformers 5.x,
``past_key_values=`` before), how a tree reaches the model (a 4D additive mask plus explicit position ids), how the
cache is cropped and compacted (5.x's ``DynamicCache.crop`` takes a negative count; we slice the layers directly), and
which hidden states feed the drafter (:func:`tapped_forward`: tap i is layer i's output; index 0 of transformers'
hidden-state tuple is the embedding output). The decode loop, replay, the training loss, the training stream and
data generation all read the drafter's features through :func:`tapped_forward`, so the tap convention lives in one
line.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from .grouped import grouped_attention, sdpa_configs
from .recurrent import RECURRENT_KIND, RecurrentLayer, recurrent_modules, run_by_depth, tree_levels

__all__ = ["TargetAdapter", "TargetOutput", "TappedOutput", "tapped_forward", "IncompatibleModelError",
           "SUPPORTED_MODEL_TYPES", "NOT_YET", "LAYER_KINDS", "TREE_MASK_BACKENDS", "check_compatibility",
           "check_mask_backend"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral", "qwen3_moe", "gemma3_text", "gpt_oss", "deepseek_v3",
                         "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_VLM = ("the checkpoint is a vision-language model whose causal LM is not loaded as one here; its language model is "
        "DeepSeek-V3-shaped (model_type deepseek_v3, multi-head latent attention), which is supported")
# families DFlash drafters serve that tree verification here does not cover yet, with the reason
NOT_YET = MappingProxyType({"kimi_k25": _VLM})
# layer kinds a tree can be verified on: full attention sees the whole ancestry, a sliding layer the ancestors and
# committed tokens within its window (both from one 4D mask per kind); a linear-attention (Gated DeltaNet) layer runs
# depth by depth, each node from its parent's recurrent state (dflash_core.recurrent)
LAYER_KINDS = ("full_attention", "sliding_attention", RECURRENT_KIND)
# attention backends that apply a custom 4D mask as given; flash-attention kernels read a mask as 2D padding only
TREE_MASK_BACKENDS = ("sdpa", "eager", "flex_attention")


class IncompatibleModelError(ValueError):
    """The target cannot be driven, or the drafter does not fit it. The message says what to change."""


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [n, V] float32 (n = new tokens, or 1 when only the last position was asked for)
    features: torch.Tensor | None  # [n, n_taps * hidden] tapped hidden states, None when no taps were requested


@dataclass
class TappedOutput:
    features: torch.Tensor | None  # [B, n, n_taps * hidden] tapped hidden states on the head's device; None: no taps
    logits: torch.Tensor | None  # [B, n', V] as the model returns them (its dtype); None when run without the head
    last_hidden: torch.Tensor | None  # [B, n, hidden] the final normed states; only when run without the head


def tapped_forward(model: nn.Module, input_ids: torch.Tensor, layer_ids: Sequence[int], head: bool = True,
                   **forward_kwargs) -> TappedOutput:
    """One forward of a Hugging Face causal LM over ``input_ids`` [B, n]: the drafter's features and the logits.

    The drafter is conditioned on the outputs of the target layers ``layer_ids``, concatenated in that order. In
    transformers' ``hidden_states`` tuple index 0 is the embedding output, so layer i's output is
    ``hidden_states[i + 1]``; this function is the only place that indexes it, so that the decode loop, replay, the
    training loss, the stream and data generation cannot disagree on which states a drafter sees. With the layers
    split over several devices (``device_map="auto"``) the taps are gathered on the head's device.

    ``head=False`` runs the base model (``model.model``) and returns its ``last_hidden`` instead of logits: the
    training stream applies only the draft vocabulary's rows of the head, which is much cheaper than the full one.
    ``forward_kwargs`` pass through (cache, attention mask, position ids, ``use_cache``, ``logits_to_keep``). Grad
    mode is the caller's.
    """
    want = bool(layer_ids)
    out = (model if head else model.model)(input_ids=input_ids, output_hidden_states=want, **forward_kwargs)
    features = None
    if want:
        device = model.lm_head.weight.device
        features = torch.cat([out.hidden_states[i + 1].to(device) for i in layer_ids], dim=-1)
    if head:
        return TappedOutput(features, out.logits, None)
    return TappedOutput(features, None, out.last_hidden_state)


class SlotLayer(DynamicLayer):
    """A KV-cache layer written in place: keys and values live in a buffer ``[B, kv_heads, capacity, head_dim]``
    that grows geometrically (by half its size, at least 256 slots), and ``keys`` / ``values`` are views of its first ``length`` slots. transformers'
    ``DynamicLayer`` concatenates the whole cache at every forward (O(context) copies per step); here a forward writes
    only its new slots, and cropping or moving slots touches only those slots."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._keys = self._values = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        end = start + key_states.shape[-2]
        if self._keys is None or end > self._keys.shape[-2] or self._keys.shape[0] != key_states.shape[0]:
            self._grow(key_states, value_states, start, end + max(256, end // 2))
        self._keys[:, :, start:end] = key_states
        self._values[:, :, start:end] = value_states
        self.keep(end)
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, length: int, capacity: int) -> None:
        keys = key_states.new_empty(key_states.shape[:2] + (capacity, key_states.shape[-1]))
        values = value_states.new_empty(value_states.shape[:2] + (capacity, value_states.shape[-1]))
        if length:
            keys[:, :, :length], values[:, :, :length] = self.keys, self.values
        self._keys, self._values = keys, values

    def keep(self, length: int) -> None:
        """The first ``length`` slots are the cache (no copy)."""
        self.keys, self.values = self._keys[:, :, :length], self._values[:, :, :length]

    def select(self, rows: torch.Tensor) -> None:
        """Keep the sequences ``rows`` of the batch (one copy of what they hold)."""
        length = self.keys.shape[-2]
        self._keys, self._values = self._keys.index_select(0, rows), self._values.index_select(0, rows)
        self.keep(length)


class TargetAdapter:
    """Drives a Hugging Face causal LM one forward at a time on top of a shared KV cache for a batch of sequences."""

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...] | list[int] = ()) -> None:
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type in NOT_YET:
            raise IncompatibleModelError(
                f"target model_type {model_type!r} is not supported yet: {NOT_YET[model_type]}")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise IncompatibleModelError(
                f"target model_type {model_type!r} is not supported; supported families: {', '.join(SUPPORTED_MODEL_TYPES)} "
                "(decoder-only models with full attention, model.model.embed_tokens and model.lm_head)"
            )
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "embed_tokens") or not hasattr(model, "lm_head"):
            raise IncompatibleModelError(
                f"{type(model).__name__} has no .model.embed_tokens / .lm_head: pass an AutoModelForCausalLM, not a base model"
            )
        self.layer_kinds, self.window = _attention_layout(config)
        # the Gated DeltaNet mixers of a hybrid target (Qwen3-Next, Qwen3.5), run depth by depth in a tree forward
        self.recurrent = recurrent_modules(model) if RECURRENT_KIND in (self.layer_kinds or ()) else []
        if len(self.recurrent) != (self.layer_kinds or ()).count(RECURRENT_KIND):
            raise IncompatibleModelError(
                f"{type(model).__name__} names {self.layer_kinds.count(RECURRENT_KIND)} linear_attention layers in "
                f"config.layer_types but has {len(self.recurrent)} Gated DeltaNet mixers (layer.linear_attn): tree "
                "verification drives Qwen3-Next / Qwen3.5 style hybrids; load the model with its own class")
        self.model = model
        self.config = config
        self.grouped = sdpa_configs(model)  # forwards read grouped K/V heads in place (dflash_core.grouped)
        self.num_layers = int(config.num_hidden_layers)
        self.layer_ids = tuple(int(i) for i in layer_ids)
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise IncompatibleModelError(
                f"tapped target layers {bad} are out of range for a target with {self.num_layers} layers "
                f"(valid ids 0..{self.num_layers - 1}); retrain or re-configure the drafter's target_layer_ids"
            )
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def sliding(self) -> bool:
        """Whether some layer attends within a sliding window (its tree mask then differs from the full one)."""
        return self.window is not None

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.model.lm_head.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.model.lm_head.weight.shape[1]

    @property
    def input_vocab_size(self) -> int:
        return self.model.model.embed_tokens.weight.shape[0]

    def check_token_ids(self, token_ids: torch.Tensor) -> None:
        """Raise ValueError naming the first id outside the target's embedding table (before it fails deep inside)."""
        vocab = self.input_vocab_size
        bad = token_ids[(token_ids < 0) | (token_ids >= vocab)]
        if bad.numel():
            raise ValueError(
                f"input_ids holds token id {int(bad[0])}, outside the target's vocabulary (ids 0..{vocab - 1}, "
                f"{vocab} tokens): was the prompt encoded with another model's tokenizer?"
            )

    # ------------------------------------------------------------------ shared pieces for the drafter
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[..., n] token ids -> [..., n, hidden] input embeddings of the target (on the embedding's device)."""
        table = self.model.model.embed_tokens
        return table(token_ids.to(table.weight.device))

    def lm_head(self, hidden: torch.Tensor, draft=None) -> torch.Tensor:
        """[..., hidden] -> [..., V] logits with the target's head (in float32, on the head's device).

        With ``draft`` given, its draft vocabulary (if any) decides which rows are computed (others are -inf).
        """
        hidden = hidden.to(self.device)
        if draft is not None and getattr(draft, "draft_vocab", None) is not None:
            return draft.vocab_logits(hidden, self.model.lm_head.weight)
        return self.head(hidden.to(self.dtype))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> float32 logits as the model's own forward returns them (its LM head, then the final
        logit soft-capping of the families that have one, e.g. Gemma)."""
        logits = self.model.lm_head(hidden).float()
        cap = getattr(self.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def draft_logits(self, hidden: torch.Tensor, draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[..., hidden] -> (float32 logits [..., V'] over ``draft``'s draft vocabulary, its id map [V'] on the
        logits' device); without a draft vocabulary the full head's logits and None (column j is token j)."""
        if getattr(draft, "draft_vocab", None) is None:
            return self.lm_head(hidden), None
        logits, token_map = draft.compact_logits(hidden.to(self.device), self.model.lm_head.weight)
        return logits, token_map.to(logits.device)

    # ------------------------------------------------------------------ cache
    def new_cache(self):
        """An empty cache whose attention layers are written in place (:class:`SlotLayer`); a hybrid target's
        linear-attention layers hold recurrent states (:class:`~dflash_core.recurrent.RecurrentLayer`)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        if self.recurrent:
            cache.layer_class_to_replicate = None
            cache.layers = [RecurrentLayer() if kind == RECURRENT_KIND else SlotLayer() for kind in self.layer_kinds]
        else:
            cache.layer_class_to_replicate = SlotLayer  # each layer is created on its first update
        return cache

    @staticmethod
    def _layers(cache):
        layers = getattr(cache, "layers", None)
        if layers is None:
            raise IncompatibleModelError(
                f"unsupported cache type {type(cache).__name__}: needs transformers >= 5.0 (DynamicCache.layers)"
            )
        return layers

    def crop(self, cache, length: int) -> None:
        """Keep the first ``length`` positions of every layer."""
        for layer in self._layers(cache):
            if isinstance(layer, RecurrentLayer):
                layer.rewind(length)
            elif isinstance(layer, SlotLayer) and getattr(layer, "_keys", None) is not None:
                layer.keep(min(length, layer.keys.shape[-2]))
            elif getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]

    # ------------------------------------------------------------------ forward
    # A batch shares one cache of shape [B, kv_heads, S, head_dim] per layer (one prompt is a batch of one). Sequence
    # b's committed tokens sit at slots [0, length_b); slots from length_b to S hold leftovers that every mask hides.
    # A forward appends the same number of new slots to every sequence (ragged inputs are padded) and
    # :meth:`move_slots` then moves each sequence's kept entries down to the end of its own prefix, so the cache never
    # holds more than the longest sequence.
    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [B, n] new tokens (padded rows hold any valid id)
        position_ids: torch.Tensor,  # [B, n]
        cache,
        visible: torch.Tensor | None = None,  # [B, n, S + n] bool: may attend (cache slots, then new); None: causal
        rows: torch.Tensor | None = None,  # [K] flat indices b * n + i of the rows whose logits are wanted; None: all
        with_features: bool = True,
    ) -> TargetOutput:
        """One target forward over a batch of new tokens on the shared cache (it grows by ``n``): the logits of the
        ``rows`` asked for, float32 [K, V], and the features of all, [B, n, F]. Only those rows pass through the LM
        head. ``visible=None`` runs the model's own causal mask: exact when every row continues its whole cache."""
        b, n = token_ids.shape
        mask = None if visible is None else self.masks(visible.to(self.device), position_ids.to(self.device))
        with self._by_depth(cache, visible, b, n), grouped_attention(self.grouped):
            out = tapped_forward(self.model, token_ids.to(self.device), self.layer_ids if with_features else (),
                                 head=False, position_ids=position_ids.to(self.device), attention_mask=mask,
                                 use_cache=True, **{self._cache_kw: cache})
        hidden = out.last_hidden.reshape(b * n, -1)
        if rows is not None:
            hidden = hidden.index_select(0, rows.to(hidden.device))
        return TargetOutput(logits=self.head(hidden.to(self.device)), features=out.features)

    def _by_depth(self, cache, visible: torch.Tensor | None, b: int, n: int):
        """The context a forward runs in: for a hybrid target past its prefill, its linear-attention layers go
        depth by depth over the rows' tree (``visible``'s new part; None: chains); otherwise nothing changes."""
        layers = [layer for layer in self._layers(cache) if isinstance(layer, RecurrentLayer)]
        if not layers or not layers[0].started:
            if visible is not None and layers:
                raise ValueError("a hybrid target's first forward is its prefill: run it with visible=None")
            return contextlib.nullcontext()
        slots = max((layer.keys.shape[-2] for layer in self._layers(cache)
                     if isinstance(layer, SlotLayer) and layer.is_initialized), default=0)
        levels = tree_levels(None if visible is None else visible[:, :, -n:], b, n)
        return run_by_depth(self.recurrent, layers, levels, slots)

    @torch.inference_mode()
    def prefill(self, prompts: list[torch.Tensor], cache, with_features: bool = True) -> TargetOutput:
        """Prompts ([1, T_b] each) into an empty cache, right-padded in one forward under the model's own causal
        mask (a padding slot is hidden by every later mask): the logits after each prompt [B, V] and the features
        [B, max T_b, F]. A hybrid target's recurrent layers would carry the padding into a shorter prompt's state,
        so there the common length goes first and each prompt's rest follows as a chain (one token per step in the
        linear layers), after which each sequence commits the state after its own last token."""
        lengths = [int(p.shape[1]) for p in prompts]
        width, batch = max(lengths), len(prompts)
        ids = torch.zeros(batch, width, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : lengths[b]] = p[0].cpu()
        split = min(lengths) if self.recurrent else width
        parts = [(0, split)] + ([(split, width)] if split < width else [])
        logits, features = [None] * batch, []
        for start, end in parts:
            ends = [b for b in range(batch) if start < lengths[b] <= end]
            rows = torch.tensor([b * (end - start) + lengths[b] - 1 - start for b in ends])
            out = self.forward(ids[:, start:end], torch.arange(start, end).expand(batch, -1), cache, None, rows,
                               with_features)
            for b, row in zip(ends, out.logits):
                logits[b] = row
            features.append(out.features)
        for layer in self._layers(cache):
            if isinstance(layer, RecurrentLayer):
                if split < width:
                    layer.commit([n - 1 - split if n > split else -1 for n in lengths], lengths)
                layer.lengths, layer.before = list(lengths), None
        if features[0] is not None and len(features) > 1:
            features = [torch.cat(features, dim=1)]
        return TargetOutput(torch.stack(logits), features[0])

    def masks(self, visible: torch.Tensor, position_ids: torch.Tensor):
        """The model's attention mask for ``visible`` [B, n, S + n] (cache slots, then the new tokens): one additive
        [B, 1, n, S + n] mask, or with sliding-window layers one per layer kind (a dict, as transformers' models
        take it), where a sliding layer also hides every key ``window`` or more positions before the query. Cache
        slot j holds position j (a sequence's committed tokens sit at slots [0, L_b); later slots are hidden);
        the new tokens sit at ``position_ids``."""
        def additive(allowed: torch.Tensor) -> torch.Tensor:
            mask = torch.zeros(allowed.shape[:1] + (1,) + allowed.shape[1:], dtype=self.dtype, device=self.device)
            return mask.masked_fill_(~allowed[:, None], torch.finfo(self.dtype).min)

        if self.recurrent:  # the linear-attention layers read the tree from their depth order, not from a mask
            masks = self._sliding_masks(visible, position_ids, additive) if self.sliding else \
                {"full_attention": additive(visible)}
            return {**masks, RECURRENT_KIND: None}
        if not self.sliding:
            return additive(visible)
        return self._sliding_masks(visible, position_ids, additive)

    def _sliding_masks(self, visible: torch.Tensor, position_ids: torch.Tensor, additive):
        b, n, width = visible.shape
        keys = torch.cat([torch.arange(width - n, device=self.device).expand(b, -1), position_ids], dim=1)
        near = position_ids[:, :, None] - keys[:, None, :] < self.window  # [B, n, S + n]
        if self.layer_kinds is None:  # every layer slides (Mistral): the model takes one mask
            return additive(visible & near)
        return {"full_attention": additive(visible), "sliding_attention": additive(visible & near)}

    @torch.inference_mode()
    def move_slots(self, cache, source: torch.Tensor, dest: torch.Tensor, width: int) -> None:
        """In every layer of a batch cache copy sequence b's slots ``source[b]`` to ``dest[b]`` ([B, K] slot
        indices; a row may repeat its last pair as padding), then keep the first ``width`` slots. All sources are
        read before any destination is written, so the two may overlap. Only the moved entries are copied."""
        rows = torch.arange(source.shape[0])[:, None].expand_as(source)
        for layer in self._layers(cache):  # advanced indexing: [B, K, heads, dim] (on the CPU much faster than scatter_)
            if isinstance(layer, RecurrentLayer):  # the state after each sequence's last kept row of the tree forward
                layer.commit((source[:, -1] - layer.base).tolist(), (dest[:, -1] + 1).tolist())
                continue
            device = layer.keys.device
            b, src, dst = rows.to(device), source.to(device), dest.to(device)
            keys, values = layer.keys[b, :, src], layer.values[b, :, src]
            layer.keys[b, :, dst], layer.values[b, :, dst] = keys, values
            if isinstance(layer, SlotLayer):
                layer.keep(width)
            else:
                layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]

    @torch.inference_mode()
    def select_sequences(self, cache, batch_rows: torch.Tensor) -> None:
        """Keep only the sequences ``batch_rows`` of a batch cache (finished sequences leave the batch)."""
        for layer in self._layers(cache):
            if isinstance(layer, RecurrentLayer):
                layer.select(batch_rows)
            elif isinstance(layer, SlotLayer) and getattr(layer, "_keys", None) is not None:
                layer.select(batch_rows.to(layer.keys.device))
            elif getattr(layer, "keys", None) is not None and layer.keys.numel():
                index = batch_rows.to(layer.keys.device)
                layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)


def _attention_layout(config) -> tuple[tuple[str, ...] | None, int | None]:
    """(the layer kinds when the model names them per layer, else None; the sliding window or None) of a target
    config, refusing layer kinds a tree cannot be verified on yet with what they are and why."""
    kinds = tuple(getattr(config, "layer_types", None) or ())
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise IncompatibleModelError(
            f"target layers of kind {', '.join(unknown)} are not supported: tree verification here covers "
            f"{', '.join(LAYER_KINDS)} layers (Gated DeltaNet for linear attention; another recurrent or "
            "convolutional mixer would need its own per-node state)")
    window = getattr(config, "sliding_window", None)
    if kinds:
        return kinds, (int(window) if "sliding_attention" in kinds else None)
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2-style switch: the window is off
        return None, None
    return None, (int(window) if window else None)


def check_mask_backend(target: nn.Module, batch: int = 1, chains_only: bool = False) -> bool:
    """Whether the target's attention backend applies a 4D attention mask; raise :class:`IncompatibleModelError`
    when the call needs one and the backend would ignore it.

    Trees and batches reach the target as a 4D mask (ancestors, padding). SDPA, eager and flex attention apply it;
    flash-attention kernels read a mask as 2D padding and would verify every node under the plain causal mask,
    silently accepting tokens the target never saw in that context. One prompt decoded with chains needs no mask.
    """
    backend = getattr(getattr(target, "config", None), "_attn_implementation", None)
    masks = backend is None or backend in TREE_MASK_BACKENDS
    if not masks and (batch > 1 or not chains_only):
        need = "a batch of prompts" if batch > 1 else "tree verification"
        raise IncompatibleModelError(
            f"the target's attention backend {backend!r} does not apply a 4D attention mask, which {need} needs (it "
            f"works with {', '.join(TREE_MASK_BACKENDS)}). Load the target with attn_implementation='sdpa' or call "
            "target.set_attn_implementation('sdpa'); budget='chain' (DFlash) on one prompt runs on any backend"
        )
    return masks


def check_compatibility(target: nn.Module, draft) -> str:
    """Raise :class:`IncompatibleModelError` with a fix-it message when ``draft`` cannot serve ``target``; else a
    short report of the pair (shapes, taps, draft vocabulary, dtypes, trees possible), with a warning line when the
    drafter's dtype differs from the target's (it runs, but its features are cast and its tau may drop)."""
    _check_shapes(target, draft)
    cfg, t_cfg = draft.config, target.config
    t_dtype = target.lm_head.weight.dtype
    d_dtype = next(draft.parameters()).dtype
    backend = getattr(t_cfg, "_attn_implementation", None)
    trees = backend is None or backend in TREE_MASK_BACKENDS
    lines = [
        f"target: {getattr(t_cfg, 'model_type', '?')}, {t_cfg.num_hidden_layers} layers, hidden {t_cfg.hidden_size}, "
        f"vocab {int(target.lm_head.weight.shape[0])}, {str(t_dtype).removeprefix('torch.')}, attention {backend}",
        f"drafter: {cfg.num_hidden_layers} layers, block {cfg.block_size}, taps {list(cfg.target_layer_ids)}, "
        f"draft vocabulary {cfg.draft_vocab_size or 'full'}, {str(d_dtype).removeprefix('torch.')}",
        f"compatible: yes; trees: {'yes' if trees else 'no (chains only: the backend ignores 4D masks)'}"
        + _layout_note(t_cfg),
    ]
    if d_dtype != t_dtype:
        lines.append(f"warning: drafter dtype {d_dtype} differs from the target's {t_dtype}; "
                     f"draft.to({t_dtype}) matches them")
    return "\n".join(lines)


def _layout_note(config) -> str:
    kinds, window = _attention_layout(config)
    if kinds and RECURRENT_KIND in kinds:
        return (f"; attention: full in {kinds.count('full_attention')} of {len(kinds)} layers, linear (Gated "
                f"DeltaNet) in {kinds.count(RECURRENT_KIND)} (verified depth by depth from each node's parent state)")
    if window is None:
        return "; attention: full in every layer"
    sliding = "every layer" if kinds is None else f"{kinds.count('sliding_attention')} of {len(kinds)} layers"
    return f"; attention: sliding window {window} in {sliding} (verified with a per-kind tree mask)"


def _check_shapes(target: nn.Module, draft) -> None:
    cfg = draft.config
    t_cfg = target.config
    t_hidden = int(getattr(t_cfg, "hidden_size"))
    t_vocab = int(target.lm_head.weight.shape[0])
    t_layers = int(t_cfg.num_hidden_layers)
    if cfg.hidden_size != t_hidden:
        raise IncompatibleModelError(
            f"drafter hidden_size {cfg.hidden_size} != target hidden_size {t_hidden}: a DFlash drafter must be built "
            "for this target (it shares the target's embeddings and LM head)"
        )
    if cfg.vocab_size != t_vocab:
        raise IncompatibleModelError(
            f"drafter vocab_size {cfg.vocab_size} != target vocab size {t_vocab}: use a drafter trained for this target"
        )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < t_layers]
    if bad:
        raise IncompatibleModelError(
            f"drafter taps target layers {bad}, but the target has only {t_layers} layers (ids 0..{t_layers - 1}): "
            "the drafter was trained for a different target"
        )
    if cfg.num_target_layers != t_layers:
        raise IncompatibleModelError(
            f"drafter was trained for a target with {cfg.num_target_layers} layers, this target has {t_layers}: "
            "use a drafter trained for this target"
        )
    if not 0 <= cfg.mask_token_id < t_vocab:
        raise IncompatibleModelError(
            f"drafter mask_token_id {cfg.mask_token_id} is not a token of the target (vocab size {t_vocab}); "
            "set dflash_config.mask_token_id to a reserved token id of the target tokenizer"
        )
