"""The DFlash block-diffusion drafter: Qwen3-style layers with the target's features injected as keys and values.

One forward drafts a whole block. The block's input is ``[root, MASK x (b-1)]`` embedded with the TARGET's embedding
table; attention inside the block is bidirectional. In every layer the queries come from the block only, while keys
and values are the layer's own ``k_proj``/``v_proj`` applied to ``[context features ; block hidden]``. The context
features are hidden states of several target layers, concatenated and fused by ``fc`` + ``hidden_norm``. The drafter
returns final-normed hidden states; logits come from the target's LM head (shared, frozen).

During decoding the context keys/values are cached (:class:`DraftCache`) and only the new context is projected each
round; the block's keys/values are never stored, so the cache always holds exactly the committed context.

The Markov head (the end of this module) makes each drafted position's logits depend on the token drafted just before
it. A DFlash block predicts its positions independently given the context: the distribution at depth d does not know
which token the tree placed at depth d-1 on a branch. The head adds a low-rank logit bias over the draft vocabulary
that depends on that previous token::

    logits_d(prev) = base_d + W_out z,   z = E[prev]                      (kind "token")
                                         z = E[prev] * sigmoid(G h_d)     (kind "gated": h_d the drafter's state)

``E`` has one row per draft-vocabulary token plus one out-of-vocabulary bucket (a previous token the drafter cannot
draft, e.g. a root outside its vocabulary); ``W_out`` starts at zero, so a head added to a trained drafter leaves its
outputs unchanged until trained. The previous token of depth 1 is the root (the last committed token); in training it
is the target's own token before each predicted position (teacher forcing). :class:`MarkovScorer` is the per-round
inference side: it holds one block's base logits and states and returns a node's children distribution given that
node's token, for the conditioned chain and tree builders.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import DFlashConfig
from .files import atomic_write

__all__ = ["DFlashDraftModel", "DraftCache", "MARKOV_KINDS", "MarkovHead", "MarkovScorer", "attach_markov_head",
           "draft_index", "load_draft", "markov_scorer", "rope_frequencies", "window_mask"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() if x.element_size() < 4 else x  # normalize half precision in fp32; keep fp32/fp64 as is
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                     max_positions: int = 40960) -> tuple[torch.Tensor, float]:
    """[head_dim/2] float32 inverse frequencies and the cos/sin scale of a rotary embedding.

    ``scaling`` is None (plain rotary) or ``{"rope_type": "linear" | "llama3" | "yarn", ...}`` with the parameters
    transformers reads for those types; the formulas are transformers' (``modeling_rope_utils``), computed in float64.
    """
    dims = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim  # [head_dim/2]
    inv = 1.0 / theta ** dims
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv.float(), 1.0
    if kind == "linear":
        return (inv / scaling["factor"]).float(), 1.0
    if kind == "llama3":
        # long wavelengths (beyond original/low_freq_factor positions) are slowed by `factor`, short ones kept,
        # the band in between interpolated smoothly
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > original / low, inv / factor, inv)
        smooth = (original / wavelen - low) / (high - low)
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled).float(), 1.0
    if kind == "yarn":
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or max_positions / original

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = scaling.get("attention_factor")
        if attention is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

        def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
        # high-frequency dims keep their frequency (extrapolation), low-frequency dims are divided by the factor
        return (inv / factor * ramp + inv * (1 - ramp)).float(), float(attention)
    raise ValueError(f"rope scaling of type {kind!r} is not supported (default, linear, llama3, yarn)")


class Rotary(nn.Module):
    """Rotary embedding (same convention as Qwen3/Llama in transformers: rotate-half), optionally scaled."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                 max_positions: int = 40960) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling, self.max_positions = head_dim, theta, scaling, max_positions
        self.attention_scale = rope_frequencies(head_dim, theta, scaling, max_positions)[1]  # cos/sin factor (yarn)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        return rope_frequencies(self.head_dim, self.theta, self.scaling, self.max_positions)[0]

    def _apply(self, fn, recurse=True):
        # ``model.to(torch.bfloat16)`` would cast the frequencies too (errors up to 0.4%, phase errors > 0.3 rad at a
        # few thousand positions); they stay float32 like the target's own rotary, only their device follows.
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, S] -> cos, sin: [B, 1, S, head_dim]
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        if self.attention_scale != 1.0:
            return (emb.cos() * self.attention_scale).to(dtype), (emb.sin() * self.attention_scale).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


@dataclass
class DraftCache:
    """Keys and values of the committed context, per layer: each ``[B, kv_heads, ctx_len, head_dim]``.

    They are views of per-layer buffers that grow geometrically (by half, at least 256 slots): a drafter pass writes
    only its new context and its block into the buffer (:meth:`join`), so a pass costs no copy of the cached
    context. Keys assigned from elsewhere (a batch's stacked caches) are taken into a fresh buffer on the next pass.
    """

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False, compare=False)

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2] if self.keys else 0

    def crop(self, length: int) -> None:
        self.keys = [k[..., :length, :] for k in self.keys]
        self.values = [v[..., :length, :] for v in self.values]

    def join(self, layer: int, keys: torch.Tensor, values: torch.Tensor, block_keys: torch.Tensor,
             block_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values for one pass, ``[B, kv_heads, L + m + b, head_dim]``: the committed
        context (L), the new context ``keys`` / ``values`` (m, which joins the committed context) and the block's
        (b, scratch that the next pass overwrites), written in place after the committed slots."""
        past = self.keys[layer] if layer < len(self.keys) else None
        start = 0 if past is None else past.shape[-2]
        mid, end = start + keys.shape[-2], start + keys.shape[-2] + block_keys.shape[-2]
        k_buf, v_buf = self._buffer(layer, past, keys, end)
        k_buf[:, :, start:mid], v_buf[:, :, start:mid] = keys, values
        k_buf[:, :, mid:end], v_buf[:, :, mid:end] = block_keys, block_values
        if layer == len(self.keys):
            self.keys.append(k_buf[:, :, :mid])
            self.values.append(v_buf[:, :, :mid])
        else:
            self.keys[layer], self.values[layer] = k_buf[:, :, :mid], v_buf[:, :, :mid]
        return k_buf[:, :, :end], v_buf[:, :, :end]

    def _buffer(self, layer: int, past: torch.Tensor | None, like: torch.Tensor, need: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s buffers when its keys live in them and ``need`` slots fit, else new ones holding them."""
        while len(self.buffers) <= layer:
            self.buffers.append(None)
        held = self.buffers[layer]
        if held is not None and held[0].shape[0] == like.shape[0] and held[0].shape[-2] >= need and (
                past is None or (past.data_ptr() == held[0].data_ptr()
                                 and self.values[layer].data_ptr() == held[1].data_ptr())):
            return held
        shape = like.shape[:2] + (need + max(256, need // 2), like.shape[-1])
        k_buf, v_buf = like.new_empty(shape), like.new_empty(shape)
        if past is not None and past.shape[-2]:
            k_buf[:, :, : past.shape[-2]], v_buf[:, :, : past.shape[-2]] = past, self.values[layer]
        self.buffers[layer] = (k_buf, v_buf)
        return k_buf, v_buf


def window_mask(n_query: int, n_key: int, causal: bool, window: int | None,
                device: torch.device | str | None = None) -> torch.Tensor:
    """[1, 1, Nq, Nk] bool (True = may attend) of a causal and/or sliding-window layer, as z-lab's drafter builds it.

    The queries are the last ``n_query`` of the ``n_key`` keys (the layout ``[context ; block]``), and distances are
    counted in key positions: causal hides keys after the query, a window of W hides keys W or more positions away
    (on both sides when the layer is not causal).
    """
    q = (n_key - n_query + torch.arange(n_query, device=device))[:, None]  # [Nq, 1] key index of each query
    k = torch.arange(n_key, device=device)[None, :]  # [1, Nk]
    visible = torch.ones(n_query, n_key, dtype=torch.bool, device=device)
    if causal:
        visible &= k <= q
    if window is not None:
        visible &= q - k < window
        if not causal:
            visible &= k - q < window
    return visible[None, None]


class DraftAttention(nn.Module):
    def __init__(self, config: DFlashConfig, index: int = 0) -> None:
        super().__init__()
        self.causal, self.window = config.layer_attention(index)  # z-lab's per-layer causal / sliding-window switch
        hd, bias = config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def _project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [B, S, hidden] -> k, v: [B, kv_heads, S, head_dim] (k normed and rotated)
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _apply_rotary(k, cos, sin), v

    def forward(
        self,
        block: torch.Tensor,  # [B, Nq, hidden] normed block hidden states
        context: torch.Tensor,  # [B, Nc, hidden] fused target features (new context only when a cache is given)
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_rope: tuple[torch.Tensor, torch.Tensor],
        join,  # None, or DraftCache.join for this layer: the cached context before the new one, written in place
        attn_mask: torch.Tensor | None,  # [B or 1, 1, Nq, Nk] bool, True = may attend
    ) -> torch.Tensor:
        b, nq, _ = block.shape
        q = self.q_norm(self.q_proj(block).view(b, nq, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _apply_rotary(q, *block_rope)
        k_ctx, v_ctx = self._project_kv(context, *context_rope)
        k_blk, v_blk = self._project_kv(block, *block_rope)
        if join is None:
            k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)  # [B, kv_heads, Nc+Nq, hd]
        else:
            k, v = join(k_ctx, v_ctx, k_blk, v_blk)
        nk = k.shape[2]
        if self.causal or (self.window is not None and nk > self.window):
            if attn_mask is not None:
                raise NotImplementedError("training with concatenated blocks (an attention mask) is not implemented "
                                          "for drafters with causal or sliding-window layers")
            attn_mask = window_mask(nq, nk, self.causal, self.window, q.device)
        if attn_mask is not None and self.num_heads != self.num_kv_heads:
            # SDPA's fused kernels do not take a mask together with enable_gqa=True (it then runs the math kernel,
            # which materializes [B, heads, Nq, Nk] float scores): repeat K/V up to the query heads instead.
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, heads, Nk, hd]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).transpose(1, 2)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                 enable_gqa=self.num_heads != self.num_kv_heads).transpose(1, 2)
        return self.o_proj(out.reshape(b, nq, -1))


class DraftMLP(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, config: DFlashConfig, index: int = 0) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config, index)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, block, context, block_rope, context_rope, join, attn_mask):
        block = block + self.self_attn(self.input_layernorm(block), context, block_rope, context_rope, join, attn_mask)
        return block + self.mlp(self.post_attention_layernorm(block))


class DFlashDraftModel(nn.Module):
    """The published DFlash drafter (z-lab checkpoint layout, no remote code).

    ``forward(block_embeds, context_features, block_positions, context_positions, cache=None, attn_mask=None)``
    returns the final-normed hidden states of the block, ``[B, Nq, hidden]``.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.num_taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)
        if config.draft_vocab_size is not None:
            # target token ids the drafter drafts over (most frequent first); saved with the weights as "draft_vocab"
            self.register_buffer("draft_vocab", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        else:
            self.draft_vocab = None
        self.markov = None if config.markov_rank is None else MarkovHead(
            config.draft_vocab_size or config.vocab_size, config.hidden_size, config.markov_rank, config.markov_kind)
        self._head_rows: tuple | None = None  # (weight, version, rows of the target head for draft_vocab)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Give the drafter a reduced vocabulary: the target token ids it may draft.

        Kept in the given order (by convention most frequent first, so ``draft_vocab[:n]`` is the best smaller
        vocabulary); duplicates after their first occurrence are dropped.
        """
        raw = torch.as_tensor(token_ids, dtype=torch.long).flatten().tolist()
        ids = torch.tensor(list(dict.fromkeys(raw)), dtype=torch.long)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in [0, {self.config.vocab_size}) and be non-empty")
        device = next(self.parameters()).device
        if self.markov is not None and self.markov.vocab != len(ids):
            raise ValueError(f"this drafter's Markov head covers {self.markov.vocab} draft tokens: a vocabulary of "
                             f"{len(ids)} needs a new head (dflash_core.model.attach_markov_head)")
        self.config = dataclasses.replace(self.config, draft_vocab_size=int(ids.numel()))
        if "draft_vocab" in self._buffers:
            del self._buffers["draft_vocab"]
        self.__dict__.pop("draft_vocab", None)
        self.register_buffer("draft_vocab", ids.to(device))
        self._head_rows = None

    def head_rows(self, head_weight: torch.Tensor) -> torch.Tensor:
        """The target LM head's rows of the draft vocabulary ([V', hidden]), gathered once and cached."""
        key = (head_weight.data_ptr(), head_weight._version, head_weight.dtype, head_weight.device)
        if self._head_rows is None or self._head_rows[0] != key:
            self._head_rows = (key, head_weight.detach().index_select(0, self.draft_vocab.to(head_weight.device)))
        return self._head_rows[1]

    def compact_logits(self, hidden: torch.Tensor, head_weight: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[..., hidden] -> (float32 logits [..., V'] over the draft vocabulary, its id map [V'] or None).

        Column j is the target token ``draft_vocab[j]``; only those rows of the target's head are computed (the
        point: the head dominates a small drafter's cost). Without a draft vocabulary: the full head and None.
        """
        if self.draft_vocab is None:
            return (hidden.to(head_weight.dtype) @ head_weight.t()).float(), None
        sub = (hidden.to(head_weight.dtype) @ self.head_rows(head_weight).t()).float()  # [..., V']
        return sub, self.draft_vocab

    def vocab_logits(self, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> float32 logits over the TARGET vocabulary: :meth:`compact_logits` scattered into the
        full vocabulary, every token outside the draft vocabulary at -inf (trees and samples never propose it)."""
        sub, token_map = self.compact_logits(hidden, head_weight)
        if token_map is None:
            return sub
        full = sub.new_full((*sub.shape[:-1], head_weight.shape[0]), float("-inf"))
        return full.index_copy_(-1, token_map.to(sub.device), sub)

    def forward(
        self,
        block_embeds: torch.Tensor,  # [B, Nq, hidden] target embeddings of [root, MASK...] (one or many blocks)
        context_features: torch.Tensor,  # [B, Nc, n_taps * hidden] raw concatenated target hidden states
        block_positions: torch.Tensor,  # [B, Nq] or [Nq]
        context_positions: torch.Tensor,  # [B, Nc] or [Nc]
        cache: DraftCache | None = None,
        attn_mask: torch.Tensor | None = None,  # [B or 1, 1, Nq, Nc_total + Nq] bool; None = see everything
    ) -> torch.Tensor:
        b = block_embeds.shape[0]
        block_positions = block_positions.expand(b, -1) if block_positions.dim() == 1 else block_positions
        context_positions = context_positions.expand(b, -1) if context_positions.dim() == 1 else context_positions
        dtype = block_embeds.dtype
        context = self.hidden_norm(self.fc(context_features.to(dtype)))  # [B, Nc, hidden]
        block_rope = self.rotary(block_positions, dtype)
        context_rope = self.rotary(context_positions, dtype)
        hidden = block_embeds
        for i, layer in enumerate(self.layers):
            join = None if cache is None else functools.partial(cache.join, i)
            hidden = layer(hidden, context, block_rope, context_rope, join, attn_mask)
        return self.norm(hidden)

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, folder: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write ``config.json`` + ``model.safetensors`` in the z-lab layout (loadable by the reference code)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        extra = dict(self.config.extra)
        # integer buffers (the draft vocabulary's token ids) keep their dtype: a bf16 cast would round ids above 256
        state = {k: v.detach().to(dtype if dtype is not None and v.is_floating_point() else v.dtype).contiguous().cpu()
                 for k, v in self.state_dict().items()}
        floating = next(v for v in state.values() if v.is_floating_point())
        extra["torch_dtype"] = str(floating.dtype).removeprefix("torch.")
        config = DFlashConfig(**{**self.config.__dict__, "extra": extra})
        atomic_write(folder / "model.safetensors",  # a killed save leaves the old weights, never half of new ones
                     lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
        config.save(folder)

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None) -> "DFlashDraftModel":
        return load_draft(folder, device=device, dtype=dtype)


def load_draft(folder: str | Path, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None) -> DFlashDraftModel:
    """Load a DFlash drafter checkpoint folder (z-lab format; parameter names with or without ``model.``).

    The weights are read straight onto ``device`` and the model is built on the meta device around them, so a large
    drafter costs no random initialization and no CPU copy. Hub ids (``z-lab/Qwen3-8B-DFlash-b16``) are resolved with
    ``huggingface_hub.snapshot_download`` when the folder does not exist locally, which needs network access.
    """
    path = Path(folder)
    if not path.exists():
        path = _download(str(folder))
    config = DFlashConfig.load(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(read_safetensors(f, device))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the DFlash layout: missing {sorted(missing)[:6]}, "
            f"unexpected {sorted(unexpected)[:6]}"
        )
    model.load_state_dict(state, assign=True)  # the loaded tensors become the parameters (no copy)
    first = next(v for v in state.values() if v.is_floating_point())  # the weights' dtype and device
    model.rotary.inv_freq = model.rotary._inv_freq().to(first.device)  # not in checkpoints: computed, float32
    return model.to(device=device, dtype=dtype or first.dtype).eval()


def read_safetensors(path: str | Path, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one ``.safetensors`` file on ``device``; a damaged file gets an error that names it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=str(torch.device(device)) if device is not None else "cpu")
    except SafetensorError as err:
        raise ValueError(
            f"{path} is not a readable safetensors file ({err}). It is truncated or corrupt, e.g. an interrupted "
            "download or copy, or a Git LFS pointer checked out instead of the weights: delete it and download or "
            "export the checkpoint again"
        ) from err


def _looks_local(name: str) -> bool:
    """A path rather than a hub id: hub ids are ``owner/name`` (one slash, no leading dot, slash or tilde)."""
    return (name.startswith((".", "/", "~")) or name.count("/") != 1 or "\\" in name
            or name.endswith((".safetensors", ".json")))


def _download(repo_id: str) -> Path:
    if _looks_local(repo_id):
        parent = Path(repo_id).expanduser().parent
        hint = f" ({parent} exists: check the folder name)" if parent.is_dir() else ""
        raise FileNotFoundError(f"no drafter checkpoint folder at {repo_id!r}{hint}; pass the folder that holds "
                                "config.json and *.safetensors, or a Hugging Face Hub id of the form owner/name")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # offline, unknown repo, ...
        raise FileNotFoundError(
            f"{repo_id!r} is neither a local folder nor a reachable Hugging Face Hub repository ({exc}). "
            "Pass a local checkpoint folder, or run where the hub is reachable."
        ) from exc


# ---------------------------------------------------------------------------------------------------- the Markov head
MARKOV_KINDS = ("token", "gated")


class MarkovHead(nn.Module):
    """Logit bias ``[N, V']`` over the draft vocabulary from the previous token's draft index (``V'`` = OOV)."""

    def __init__(self, vocab: int, hidden: int, rank: int, kind: str = "token") -> None:
        super().__init__()
        if kind not in MARKOV_KINDS:
            raise ValueError(f"markov kind must be one of {MARKOV_KINDS}, got {kind!r}")
        if rank < 1:
            raise ValueError(f"markov rank must be >= 1, got {rank}")
        self.kind, self.rank, self.vocab = kind, rank, vocab
        self.embed = nn.Embedding(vocab + 1, rank)  # row `vocab`: the out-of-vocabulary bucket
        self.gate = nn.Linear(hidden, rank) if kind == "gated" else None
        self.out = nn.Linear(rank, vocab, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embed.weight, std=1.0)
        nn.init.zeros_(self.out.weight)  # a new head changes nothing until trained
        if self.gate is not None:
            nn.init.normal_(self.gate.weight, std=0.02)
            nn.init.zeros_(self.gate.bias)

    def codes(self, prev: torch.Tensor, states: torch.Tensor | None = None) -> torch.Tensor:
        """prev [N] draft indices (``vocab`` = OOV), states [N, H] (gated only) -> z [N, rank]."""
        z = self.embed(prev)
        if self.gate is not None:
            if states is None:
                raise ValueError("a gated Markov head needs the drafter's states")
            z = z * torch.sigmoid(self.gate(states.to(self.gate.weight.dtype)))
        return z

    def forward(self, prev: torch.Tensor, states: torch.Tensor | None = None) -> torch.Tensor:
        return self.out(self.codes(prev, states))  # [N, V']

    def float_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(E [V'+1, r], W_out^T [r, V']) as contiguous float32 CPU tensors, cached until the weights change."""
        key = tuple((w.data_ptr(), w._version, w.dtype) for w in (self.embed.weight, self.out.weight))
        cached = self.__dict__.get("_float")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                embed = self.embed.weight.detach().float().cpu().contiguous()
                out = self.out.weight.detach().float().cpu().t().contiguous()
            cached = (key, embed, out)
            self.__dict__["_float"] = cached
        return cached[1], cached[2]


class MarkovScorer:
    """One round's conditioned drafter: the children distribution of a node given that node's token.

    ``base`` [D, V'] float32: the block's compact logits (row d-1 = depth d); ``states`` [D, H]: the drafter's output
    states; ``to_index``: target ids -> draft indices (OOV bucket for tokens outside the draft vocabulary).
    ``log_probs(depth, prev)`` is the log-softmax of ``base[depth-1] + bias(prev)``: exactly the distribution the
    head was trained to give, as a float32 numpy row (the chain calls it once per depth). Tree builders ask for
    many nodes' best children at once (:meth:`fill`, read back through :attr:`known` or :meth:`cached`); the
    sampled tree takes whole rows (:meth:`logits`). The product runs in torch, on the threads the models use: a
    numpy product would start BLAS threads of its own, which keep spinning after each call and, on two cores, slow
    the next target forward about twofold.
    """

    def __init__(self, head: MarkovHead, base: torch.Tensor, states: torch.Tensor, to_index) -> None:
        self.base = base.detach().float().cpu()  # [D, V']
        self._cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # (depth, parent column) -> children
        self.depth = self.base.shape[0]
        self._to_index = to_index
        self._embed, self._out = head.float_weights()  # [V'+1, r], [r, V']
        with torch.no_grad():
            self._gate = None if head.gate is None else torch.sigmoid(
                head.gate(states.to(head.gate.weight.device, head.gate.weight.dtype))).float().cpu()  # [D, r]

    def index(self, token_ids) -> np.ndarray:
        """Target ids -> rows of the head's embedding (the OOV bucket for ids outside the draft vocabulary)."""
        return self._to_index(np.asarray(token_ids, dtype=np.int64))

    def logits(self, depth: int, prev_ids) -> torch.Tensor:
        """[m, V'] conditioned logits of ``depth`` (1-based) after the previous tokens ``prev_ids`` (target ids)."""
        z = self._embed[torch.from_numpy(self.index(prev_ids))]  # [m, r]
        if self._gate is not None:
            z = z * self._gate[depth - 1]
        return torch.addmm(self.base[depth - 1], z, self._out)

    def fill(self, keys, k: int) -> None:
        """Compute the ``k`` best children of every (depth, parent draft column) in ``keys`` (Python ints) in ONE
        batched product (one row of the head's embedding each, times the depth's gate, times ``W_out``; then one
        log-softmax and one top-k over the batch) and keep them for :meth:`cached` and :attr:`known`. Keys already
        held with ``k`` children are skipped.

        Why batched: each call has a fixed cost (seven torch ops and their Python, the [r, V'] output matrix read
        again) on top of its rows, so a tree's two dozen distributions cost far less in a few batches than one by
        one. Exact: every row is the same sum as :meth:`logits` computes alone (row-wise ops only)."""
        k = min(k, self.base.shape[1])
        cache = self._cache
        todo = [key for key in dict.fromkeys(keys) if key not in cache or len(cache[key][0]) < k]
        if not todo:
            return
        pairs = np.array(todo, dtype=np.int64)  # [m, 2] (depth, parent column)
        columns, depth_rows = torch.from_numpy(pairs[:, 1].copy()), torch.from_numpy(pairs[:, 0] - 1)
        with torch.no_grad():
            z = self._embed.index_select(0, columns)  # [m, r]
            if self._gate is not None:
                z.mul_(self._gate.index_select(0, depth_rows))  # each row gated by its own depth's state
            rows = torch.mm(z, self._out).add_(self.base.index_select(0, depth_rows))  # [m, V']
            values, best = torch.topk(torch.log_softmax(rows, dim=-1), k, dim=-1)
        cache.update(zip(todo, zip(values.numpy().astype(np.float64), best.numpy())))

    def likely_parents(self, width: int, floor: float = -np.inf) -> list[tuple[int, int]]:
        """Keys (children's depth, parent column) of the ``width`` most likely tokens of every depth under the
        block's unconditioned logits, where most tree nodes lie (depths 1..D-1 as parents), down to the last depth
        where the unconditioned top-1 chain still has log-probability >= ``floor`` (deeper ones are rarely in a
        tree: on the shipped drafter's rounds at 32 nodes, a depth's top token below a chain log-probability of -8
        almost never had children in the tree)."""
        width = min(width, self.base.shape[1])
        with torch.no_grad():
            log_probs = torch.log_softmax(self.base[:-1], dim=-1)  # [D-1, V'] depths 1..D-1
            top, parents = torch.topk(log_probs, width, dim=-1)  # [D-1, w]
            chain = torch.cumsum(top[:, 0], 0)  # [D-1] the top-1 chain's log-probability
            rows = int((chain >= floor).sum()) if floor > -np.inf else log_probs.shape[0]
            parents = parents[:rows].numpy()  # [rows, w]
        return [(d + 2, int(c)) for d in range(parents.shape[0]) for c in parents[d]]

    @property
    def known(self) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
        """What :meth:`fill` computed: (depth, parent draft column) -> (float64 log-probabilities, draft columns) of
        that parent's best children, best first (read-only for callers)."""
        return self._cache

    def cached(self, depth: int, prev_id: int, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The ``k`` best children of ``depth`` after the token ``prev_id`` (a target id) if :meth:`fill` holds
        them: (float64 log-probabilities, draft columns), best first; else None."""
        hit = self._cache.get((depth, int(self.index(prev_id))))
        if hit is None or len(hit[0]) < min(k, self.base.shape[1]):
            return None
        return hit[0][:k], hit[1][:k]

    def top_children(self, depth: int, prev_id: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` most probable draft-vocabulary columns of ``depth`` after the token ``prev_id`` (a target id),
        best first: (float64 log-probabilities, columns); from the batch :meth:`fill` computed, else computed (and
        kept) on its own."""
        hit = self.cached(depth, prev_id, k)
        if hit is None:
            self.fill([(depth, int(self.index(prev_id)))], k)
            hit = self.cached(depth, prev_id, k)
        return hit

    def log_probs(self, depth: int, prev_ids) -> np.ndarray:
        """[m, V'] float32 log-probabilities of ``depth`` given the previous tokens (target ids)."""
        with torch.no_grad():
            return torch.log_softmax(self.logits(depth, prev_ids), dim=-1).numpy()


def attach_markov_head(draft, rank: int, kind: str = "token") -> MarkovHead:
    """Give ``draft`` (a :class:`~dflash_core.model.DFlashDraftModel`) a new Markov head over its draft vocabulary
    (set the vocabulary first); its output weights are zero, so the drafter's outputs do not change until trained."""
    param = next(draft.parameters())
    vocab = draft.config.draft_vocab_size or draft.config.vocab_size
    draft.markov = MarkovHead(vocab, draft.config.hidden_size, rank, kind).to(param.device, param.dtype)
    draft.config = dataclasses.replace(draft.config, markov_rank=rank, markov_kind=kind)
    return draft.markov


def _index_map(draft) -> torch.Tensor:
    """[V] target id -> draft index (``V'`` for ids outside the draft vocabulary), cached on the drafter."""
    vocab = draft.draft_vocab
    key = (vocab.data_ptr(), vocab.device, len(vocab))
    cached = getattr(draft, "_markov_index", None)
    if cached is None or cached[0] != key:
        t2d = torch.full((draft.config.vocab_size,), len(vocab), dtype=torch.long, device=vocab.device)
        t2d[vocab] = torch.arange(len(vocab), device=vocab.device)
        cached = (key, t2d, t2d.cpu().numpy())
        draft._markov_index = cached
    return cached


def draft_index(draft, token_ids: torch.Tensor) -> torch.Tensor:
    """Target token ids -> the drafter's draft-vocabulary indices; ids outside it map to the OOV bucket ``V'``."""
    if draft.draft_vocab is None:
        return token_ids
    return _index_map(draft)[1].to(token_ids.device)[token_ids]


def markov_scorer(draft, base: torch.Tensor, states: torch.Tensor) -> MarkovScorer | None:
    """The round's :class:`MarkovScorer` for a drafter with a Markov head (None without one)."""
    if getattr(draft, "markov", None) is None:
        return None
    if draft.draft_vocab is None:
        return MarkovScorer(draft.markov, base, states, lambda ids: ids)
    t2d = _index_map(draft)[2]
    return MarkovScorer(draft.markov, base, states, lambda ids: t2d[ids])


def bigram_head(draft, responses, weight: float = 0.5, smoothing: float = 0.1) -> MarkovHead:
    """A count-based baseline in the head's form: bias = ``weight`` x log p(next | prev) of the token bigrams in
    ``responses`` (lists of target ids), add-``smoothing`` over the draft vocabulary; no bias after an
    out-of-vocabulary token. Exact (rank V', identity output), so for evaluation, not for shipping."""
    vocab = draft.config.draft_vocab_size or draft.config.vocab_size
    counts = torch.full((vocab + 1, vocab), float(smoothing), dtype=torch.float64)
    for seq in responses:
        idx = draft_index(draft, torch.as_tensor(seq, dtype=torch.long))
        prev, nxt = idx[:-1], idx[1:]
        keep = nxt < vocab
        counts.index_put_((prev[keep], nxt[keep]), torch.ones(int(keep.sum()), dtype=torch.float64), accumulate=True)
    table = weight * torch.log(counts / counts.sum(-1, keepdim=True))
    table[vocab] = 0.0  # after a token the drafter cannot draft: no opinion
    head = MarkovHead(vocab, draft.config.hidden_size, vocab, "token")
    with torch.no_grad():
        head.embed.weight.copy_(table.float())
        head.out.weight.copy_(torch.eye(vocab))
    return head
