"""The target writes its own training data: batched, KV-cached generation that keeps what the drafter needs.

A drafter is trained on the target's own responses, conditioned on the target's tapped hidden states, and (with
distillation) on the target's next-token distributions. All three fall out of the forwards that generate the tokens:
the prefill gives the prompt's hidden states, every decode step gives one more position's hidden states and the
distribution its next token is drawn from. :func:`generate_batch` keeps them, so no second teacher-forced pass over
the data is needed.

Layout of what a sequence keeps (``T`` = prompt + response tokens):

* ``features`` [T, taps * hidden]: hidden states of the tapped layers at every position (the last row, the final
  token's, is never used by training and left zero: generation stops before feeding it back);
* ``top_ids`` / ``top_logp`` [T, k]: the target's top-k next-token ids and full-softmax log-probabilities at each
  position (rows before the last prompt token are zero: training only asks for response positions).

Batches shrink as rows finish (the KV cache is re-indexed), so a long answer does not make the short ones pay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..target import tapped_forward

__all__ = ["GeneratedSequence", "generate_batch", "sample_next", "teacher_forced_ceiling", "GrowingCache",
           "fast_decoding"]

_ATTN_NAME = "dflash_gen"


# ---------------------------------------------------------------------------------------------------- fast decoding
def _growing_layer_class():
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A KV layer in a preallocated buffer: appending a token writes in place.

        transformers' DynamicLayer concatenates the whole cache at every step (a copy of everything, per layer, per
        token); at batch 64 and a few hundred tokens that copy costs as much as the model's matmuls. With
        ``capacity`` (the longest sequence the caller will write: prompt + max_new_tokens) the buffer is allocated
        once at exactly that size; without it, or past it, it doubles when full.
        """

        def __init__(self, capacity: int | None = None):
            super().__init__()
            self.capacity = capacity

        def lazy_initialization(self, key_states, value_states, *args, **kwargs):
            self.device = key_states.device
            self._k = self._v = None
            self._len = 0
            self.keys = key_states[..., :0, :]
            self.values = value_states[..., :0, :]
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            need = self._len + n
            if self._k is None or need > self._k.shape[-2]:
                if self._k is None and self.capacity is not None and need <= self.capacity:
                    cap = self.capacity  # sized for the whole generation: never grows, never doubles
                else:
                    cap = max(need, 2 * (self._k.shape[-2] if self._k is not None else 0), 64)
                shape = (*key_states.shape[:-2], cap, key_states.shape[-1])
                k = key_states.new_empty(shape)
                v = value_states.new_empty(shape)
                if self._len:
                    k[..., :self._len, :] = self._k[..., :self._len, :]
                    v[..., :self._len, :] = self._v[..., :self._len, :]
                self._k, self._v = k, v
            self._k[..., self._len:need, :] = key_states
            self._v[..., self._len:need, :] = value_states
            self._len = need
            self.keys, self.values = self._k[..., :need, :], self._v[..., :need, :]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self._len if self.is_initialized else 0

        def batch_select_indices(self, indices):
            if self.is_initialized and self._k is not None:
                self._k, self._v = self._k[indices], self._v[indices]
                self.keys, self.values = self._k[..., :self._len, :], self._v[..., :self._len, :]

    return GrowingLayer


def GrowingCache(capacity: int | None = None):
    """A DynamicCache whose layers append in place (see ``GrowingLayer``; ``capacity``: positions to allocate per
    layer up front); supports ``batch_select_indices``."""
    from functools import partial

    from transformers import DynamicCache

    cache = DynamicCache()
    make = partial(_growing_layer_class(), capacity)
    cache.layer_class_to_replicate = make
    cache.layers = [make() for _ in cache.layers]
    return cache


def _gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """Attention for transformers models: one-token queries run per KV head group without repeating K and V.

    The SDPA path of transformers repeats K/V per query head whenever a padding mask is present (a copy of the whole
    cache per layer per step). For a single query position the grouped product needs no copy and no special kernel;
    longer queries (the prefill) go through transformers' SDPA unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q, d = query.shape
    if q != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    hkv = key.shape[1]
    # the G query heads that share a KV head become G "query rows" of that head: no K/V copy, one SDPA call
    qg = query.reshape(b, hkv, h // hkv, d)  # heads of one group are consecutive (repeat_kv's layout)
    mask = None
    if attention_mask is not None:
        mask = attention_mask[..., -1:, : key.shape[-2]]  # [B, 1, 1, L], broadcast over heads and group rows
    out = torch.nn.functional.scaled_dot_product_attention(qg, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, 1, d).transpose(1, 2).contiguous(), None


class fast_decoding:
    """Context manager: ``target`` uses the grouped one-token attention above while generating training data."""

    def __init__(self, target) -> None:
        self.target = target

    def __enter__(self):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(_ATTN_NAME, _gqa_attention)
        AttentionMaskInterface.register(_ATTN_NAME, sdpa_mask)
        # set on the config directly: set_attn_implementation() only accepts built-in or hub kernels, while the
        # attention layers look the name up in AttentionInterface at every forward
        self.before = self.target.config._attn_implementation
        self.target.config._attn_implementation = _ATTN_NAME
        return self.target

    def __exit__(self, *exc) -> None:
        self.target.config._attn_implementation = self.before


@dataclass
class GeneratedSequence:
    prompt_ids: list[int]
    response_ids: list[int]  # stop token included when hit
    features: torch.Tensor  # [T, taps * hidden] (target dtype)
    top_ids: torch.Tensor | None  # [T, k] int64
    top_logp: torch.Tensor | None  # [T, k] float32


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """[B, V] logits -> [B] next tokens: argmax at temperature 0, else nucleus sampling from softmax(logits / T)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        # the nucleus almost always lies in the top few hundred tokens: sort only those, and fall back to a full
        # sort for a row whose top-k mass stays below top_p (exact either way; a full sort per step is slow on a CPU)
        k = min(256, probs.shape[-1])
        sorted_p, order = probs.topk(k, dim=-1)
        short = sorted_p.sum(-1) < top_p
        if bool(short.any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the smallest prefix whose mass reaches top_p
        pick = torch.multinomial(sorted_p * keep, 1, generator=generator)
        return order.gather(-1, pick)[:, 0]
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, W] token ids and attention mask of the prompts, left-padded so that every row's last prompt token sits in
    the last column."""
    b = len(prompts)
    lens = torch.tensor([len(p) for p in prompts])
    width = int(lens.max())
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        attn[r, width - len(p):] = 1
    return ids, attn


def _prefill(target, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, cache,
             layer_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over the padded prompts into ``cache``: their tapped features [B, W, F] and the distribution of
    each row's first response token [B, V]."""
    out = tapped_forward(target, ids, layer_ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
    return out.features, out.logits[:, -1].float()


@dataclass
class _ResponseBuffers:
    """Per-row response buffers, written in place as rows advance (rows are the batch's original rows)."""

    feats: torch.Tensor  # [B, N, F] tapped hidden states of every fed-back response token
    top_ids: torch.Tensor  # [B, N + 1, max(k, 1)] top-k ids of the distribution each response token is drawn from
    top_logp: torch.Tensor  # [B, N + 1, max(k, 1)] their log-probabilities
    tokens: torch.Tensor  # [B, N] response tokens
    n_tokens: torch.Tensor  # [B] (CPU) response length of every row

    @classmethod
    def allocate(cls, b: int, max_new_tokens: int, n_feat: int, feat_dtype: torch.dtype, topk: int,
                 device) -> "_ResponseBuffers":
        """Zeroed buffers for ``b`` rows of up to ``max_new_tokens`` tokens."""
        return cls(torch.zeros((b, max_new_tokens, n_feat), dtype=feat_dtype, device=device),
                   torch.zeros((b, max_new_tokens + 1, max(topk, 1)), dtype=torch.long, device=device),
                   torch.zeros((b, max_new_tokens + 1, max(topk, 1)), dtype=torch.float32, device=device),
                   torch.zeros((b, max_new_tokens), dtype=torch.long, device=device),
                   torch.zeros(b, dtype=torch.long))


@dataclass
class _Decoding:
    """How a batch decodes: tapped layers, stop tokens, length limit, sampling, kept top-k and batch shrinking."""

    layer_ids: Sequence[int]
    stops: torch.Tensor  # [S] stop token ids on the target's device
    max_new_tokens: int
    temperature: float
    top_p: float
    topk: int
    generator: torch.Generator | None
    shrink_fraction: float


def _sample_step(logits: torch.Tensor, rows: torch.Tensor, done: torch.Tensor, step: int, bufs: _ResponseBuffers,
                 how: _Decoding) -> torch.Tensor:
    """Keep the top-k of the active rows' distributions, sample response token ``step`` from them and mark the rows
    that hit a stop token or the length limit as done. Returns the sampled tokens [B_act]."""
    if how.topk > 0:  # distribution at position P + step - 1 predicts response token `step`
        top_logp, top_ids = torch.log_softmax(logits, dim=-1).topk(how.topk, dim=-1)
        bufs.top_ids[rows, step] = top_ids
        bufs.top_logp[rows, step] = top_logp
    nxt = sample_next(logits, how.temperature, how.top_p, how.generator)  # [B_act]
    bufs.tokens[rows, step] = nxt
    running = ~done[rows]  # rows that finished earlier but are still in the batch only burn compute
    bufs.n_tokens[rows[running].cpu()] = step + 1
    done[rows[running & (torch.isin(nxt, how.stops) | (step + 1 >= how.max_new_tokens))]] = True
    return nxt


def _decode(target, cache, logits: torch.Tensor, attn: torch.Tensor, next_pos: torch.Tensor, bufs: _ResponseBuffers,
            how: _Decoding) -> None:
    """Decode from the prefill's ``logits`` [B, V] until every row is done, writing into ``bufs``. Finished rows leave
    the batch (and the KV cache) once at least ``how.shrink_fraction`` of the active rows have finished."""
    device = target.lm_head.weight.device
    rows = torch.arange(len(logits), device=device)  # active row -> original row
    done = torch.zeros(len(logits), dtype=torch.bool, device=device)  # per original row
    step = 0
    while True:
        nxt = _sample_step(logits, rows, done, step, bufs, how)
        alive = ~done[rows]
        n_alive = int(alive.sum())
        if n_alive == 0:
            break
        if (len(rows) - n_alive) >= max(1.0, how.shrink_fraction * len(rows)):
            keep = alive.nonzero()[:, 0]
            cache.batch_select_indices(keep)
            rows, nxt, attn, next_pos = rows[keep], nxt[keep], attn[keep], next_pos[keep]
        attn = torch.cat([attn, torch.ones((len(rows), 1), dtype=attn.dtype, device=device)], dim=1)
        out = tapped_forward(target, nxt[:, None], how.layer_ids, attention_mask=attn, position_ids=next_pos[:, None],
                             past_key_values=cache, use_cache=True)
        bufs.feats[rows, step] = out.features[:, 0]
        logits = out.logits[:, -1].float()
        next_pos = next_pos + 1
        step += 1


def _kept_sequence(r: int, prompt: Sequence[int], prompt_feats: torch.Tensor, bufs: _ResponseBuffers,
                   topk: int) -> GeneratedSequence:
    """Row ``r`` of the batch as a :class:`GeneratedSequence` on the CPU: its prompt and response, features over all
    T positions (the last left zero) and top-k distributions (position P-1+j predicts response token j)."""
    width, n_feat = prompt_feats.shape[1], prompt_feats.shape[-1]
    n = int(bufs.n_tokens[r])
    resp = bufs.tokens[r, :n].tolist()
    P = len(prompt)
    T = P + n
    feats = torch.zeros((T, n_feat), dtype=prompt_feats.dtype)
    feats[:P] = prompt_feats[r, width - P:].cpu()
    feats[P:T - 1] = bufs.feats[r, :n - 1].cpu()
    top_ids = top_logp = None
    if topk > 0:
        top_ids = torch.zeros((T, topk), dtype=torch.long)
        top_logp = torch.zeros((T, topk), dtype=torch.float32)
        top_ids[P - 1:T - 1] = bufs.top_ids[r, :n].cpu()
        top_logp[P - 1:T - 1] = bufs.top_logp[r, :n].cpu()
    return GeneratedSequence(list(prompt), resp, feats, top_ids, top_logp)


@torch.inference_mode()
def generate_batch(
    target,
    prompts: Sequence[Sequence[int]],
    layer_ids: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    topk: int = 8,
    generator: torch.Generator | None = None,
    shrink_fraction: float = 0.125,
) -> list[GeneratedSequence]:
    """Generate a response to every prompt (left-padded batch) and keep features and top-k distributions.

    ``shrink_fraction``: drop finished rows from the batch (and the KV cache) once at least this share of the
    active rows has finished.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_batch needs at least one prompt and no empty prompt")
    device = target.lm_head.weight.device
    ids, attn = _left_padded(prompts, pad_id)
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = GrowingCache(capacity=ids.shape[1] + max_new_tokens)  # the longest row: padded prompt + the answer
    prompt_feats, logits = _prefill(target, ids, attn, pos, cache, layer_ids)
    bufs = _ResponseBuffers.allocate(len(prompts), max_new_tokens, prompt_feats.shape[-1], prompt_feats.dtype, topk,
                                     device)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    how = _Decoding(layer_ids, stops, max_new_tokens, temperature, top_p, topk, generator, shrink_fraction)
    _decode(target, cache, logits, attn, pos[:, -1] + 1, bufs, how)
    return [_kept_sequence(r, p, prompt_feats, bufs, topk) for r, p in enumerate(prompts)]


@torch.inference_mode()
def teacher_forced_ceiling(target, batch: int, length: int, repeats: int = 3, seed: int = 0) -> float:
    """Tokens/s of one batched teacher-forced forward of ``target`` over [batch, length] random ids (median)."""
    g = torch.Generator().manual_seed(seed)
    device = target.lm_head.weight.device
    vocab = int(target.lm_head.weight.shape[0])
    ids = torch.randint(100, vocab, (batch, length), generator=g).to(device)
    target(input_ids=ids[:, :16], use_cache=False)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        target(input_ids=ids, use_cache=False, output_hidden_states=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return batch * length / times[len(times) // 2]
