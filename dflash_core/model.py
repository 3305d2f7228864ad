"""The DFlash block-diffusion drafter: Qwen3-style layers with the target's features injected as keys and values.

One forward drafts a whole block. The block's input is ``[root, MASK x (b-1)]`` embedded with the TARGET's embedding
table; attention inside the block is bidirectional. In every layer the queries come from the block only, while keys
and values are the layer's own ``k_proj``/``v_proj`` applied to ``[context features ; block hidden]``. The context
features are hidden states of several target layers, concatenated and fused by ``fc`` + ``hidden_norm``. The drafter
returns final-normed hidden states; logits come from the target's LM head (shared, frozen).

During decoding the context keys/values are cached (:class:`DraftCache`) and only the new context is projected each
round; the block's keys/values are never stored, so the cache always holds exactly the committed context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .config import DFlashConfig

__all__ = ["DFlashDraftModel", "DraftCache", "load_draft"]


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


class Rotary(nn.Module):
    """Default rotary embedding (same convention as Qwen3/Llama in transformers: rotate-half)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        return (1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))).float()

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
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


@dataclass
class DraftCache:
    """Keys and values of the committed context, per layer: each ``[B, kv_heads, ctx_len, head_dim]``."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2] if self.keys else 0

    def crop(self, length: int) -> None:
        self.keys = [k[..., :length, :] for k in self.keys]
        self.values = [v[..., :length, :] for v in self.values]


def _flash_attn_available(q: torch.Tensor) -> bool:
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class DraftAttention(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        hd, bias = config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.use_flash_attn = False

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
        past: tuple[torch.Tensor, torch.Tensor] | None,
        attn_mask: torch.Tensor | None,  # [B or 1, 1, Nq, Nk] bool, True = may attend
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, nq, _ = block.shape
        q = self.q_norm(self.q_proj(block).view(b, nq, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _apply_rotary(q, *block_rope)
        k_ctx, v_ctx = self._project_kv(context, *context_rope)
        if past is not None:
            k_ctx, v_ctx = torch.cat([past[0], k_ctx], dim=2), torch.cat([past[1], v_ctx], dim=2)
        k_blk, v_blk = self._project_kv(block, *block_rope)
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)  # [B, kv_heads, Nc+Nq, hd]
        if attn_mask is None and self.use_flash_attn and _flash_attn_available(q):
            from flash_attn import flash_attn_func

            out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=False)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True).transpose(1, 2)
        return self.o_proj(out.reshape(b, nq, -1)), (k_ctx, v_ctx)


class DraftMLP(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, block, context, block_rope, context_rope, past, attn_mask):
        attn, kv = self.self_attn(self.input_layernorm(block), context, block_rope, context_rope, past, attn_mask)
        block = block + attn
        return block + self.mlp(self.post_attention_layernorm(block)), kv


class DFlashDraftModel(nn.Module):
    """The published DFlash drafter (z-lab checkpoint layout, no remote code).

    ``forward(block_embeds, context_features, block_positions, context_positions, cache=None, attn_mask=None)``
    returns the final-normed hidden states of the block, ``[B, Nq, hidden]``.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.num_taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        if config.draft_vocab_size is not None:
            # target token ids the drafter drafts over (most frequent first); saved with the weights as "draft_vocab"
            self.register_buffer("draft_vocab", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        else:
            self.draft_vocab = None
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
        import dataclasses

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

    def vocab_logits(self, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> float32 logits over the TARGET vocabulary from the target's head ``head_weight``.

        With a draft vocabulary only its rows are computed (the point: the head dominates a small drafter's cost);
        every other token gets -inf, so trees and samples never propose it. Without one, the full head.
        """
        if self.draft_vocab is None:
            return (hidden.to(head_weight.dtype) @ head_weight.t()).float()
        sub = (hidden.to(head_weight.dtype) @ self.head_rows(head_weight).t()).float()  # [..., V']
        full = sub.new_full((*sub.shape[:-1], head_weight.shape[0]), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab.to(sub.device), sub)

    def set_flash_attention(self, enabled: bool) -> None:
        """Use flash-attn for the (unmasked) decoding pass when it is installed and tensors are fp16/bf16 on CUDA."""
        for layer in self.layers:
            layer.self_attn.use_flash_attn = enabled

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
        new_keys, new_values = [], []
        for i, layer in enumerate(self.layers):
            past = (cache.keys[i], cache.values[i]) if cache is not None and cache.keys else None
            hidden, (k, v) = layer(hidden, context, block_rope, context_rope, past, attn_mask)
            new_keys.append(k)
            new_values.append(v)
        if cache is not None:
            cache.keys, cache.values = new_keys, new_values
        return self.norm(hidden)

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, folder: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write ``config.json`` + ``model.safetensors`` in the z-lab layout (loadable by the reference code)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        extra = dict(self.config.extra)
        state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        extra["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        config = DFlashConfig(**{**self.config.__dict__, "extra": extra})
        tmp = folder / "model.safetensors.tmp"
        save_file(state, str(tmp), metadata={"format": "pt"})
        tmp.replace(folder / "model.safetensors")
        config.save(folder)

    @classmethod
    def from_pretrained(cls, folder: str | Path, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None) -> "DFlashDraftModel":
        return load_draft(folder, device=device, dtype=dtype)


def load_draft(folder: str | Path, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None) -> DFlashDraftModel:
    """Load a DFlash drafter checkpoint folder (z-lab format; parameter names with or without ``model.``).

    Hub ids (``z-lab/Qwen3-8B-DFlash-b16``) are resolved with ``huggingface_hub.snapshot_download`` when the folder
    does not exist locally, which needs network access to the Hugging Face Hub.
    """
    from safetensors.torch import load_file

    path = Path(folder)
    if not path.exists():
        path = _download(str(folder))
    config = DFlashConfig.load(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    model = DFlashDraftModel(config)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the DFlash layout: missing {sorted(missing)[:6]}, "
            f"unexpected {sorted(unexpected)[:6]}"
        )
    model.load_state_dict(state)
    dtype = dtype or next(iter(state.values())).dtype
    return model.to(device=device, dtype=dtype).eval()


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # offline, unknown repo, ...
        raise FileNotFoundError(
            f"{repo_id!r} is neither a local folder nor a reachable Hugging Face Hub repository ({exc}). "
            "Pass a local checkpoint folder, or run where the hub is reachable."
        ) from exc

