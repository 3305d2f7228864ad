"""Grouped-query attention under a tree mask without copying keys and values per query head.

transformers' SDPA attention reads a grouped-query layer's key/value heads in place only when there is no mask (or a
single query row); under a mask it first copies every key/value head once per query head of its group
(``repeat_kv``), O(context) bytes per layer per verify. A tree verify always has a mask, so on a long context most of
its attention time went to those copies. :func:`grouped_sdpa_attention` is the same attention with the group
dimension left to the kernel (``enable_gqa=True``), which on a CPU takes the mask as well; :func:`grouped_attention`
routes a target's masked forwards to it for the duration of one forward.

Only a CPU forward is rerouted: on CUDA, SDPA's fused kernels do not combine a mask with ``enable_gqa`` (it falls back
to the math kernel), so the copy is the faster path there. The arithmetic is the same either way (the same products,
in the same kernel family); the tests compare the two paths on every supported family.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GROUPED_SDPA", "grouped_attention", "grouped_sdpa_attention", "sdpa_configs"]

GROUPED_SDPA = "ddtree_grouped_sdpa"  # the name the attention function is registered under in transformers
_OTHER_KWARGS = ("softcap", "position_bias", "s_aux", "sinks")  # what only transformers' own function handles


def grouped_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, q, D], key/value [B, H_kv, k, D], output
    [B, q, H, D]. A masked forward of several query rows over grouped heads runs SDPA with ``enable_gqa``; anything
    else (no mask, one row, no groups, soft-capping, sinks, position biases) goes to transformers' own SDPA function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (attention_mask is None or groups <= 1 or query.shape[2] == 1 or key.shape[-1] != value.shape[-1]
            or any(kwargs.get(k) is not None for k in _OTHER_KWARGS)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def sdpa_configs(model: nn.Module) -> list:
    """The configs whose attention layers run transformers' SDPA over grouped key/value heads (each once); empty on
    CUDA (see the module) or when no layer groups its heads."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu":
        return []
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if (getattr(module, "num_key_value_groups", 1) > 1 and config is not None
                and getattr(config, "_attn_implementation", None) == "sdpa"):
            configs[id(config)] = config
    return list(configs.values())


@contextlib.contextmanager
def grouped_attention(configs: list, on: bool = True):
    """Run the forward inside with ``configs``' attention on :func:`grouped_sdpa_attention` (registered with
    transformers on first use), restoring each config's own implementation afterwards."""
    if not on or not configs:
        yield
        return
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if GROUPED_SDPA not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    before = [c._attn_implementation_internal for c in configs]
    try:
        for c in configs:
            c._attn_implementation_internal = GROUPED_SDPA
        yield
    finally:
        for c, name in zip(configs, before):
            c._attn_implementation_internal = name
