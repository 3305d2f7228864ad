"""Grouped-query attention without copying keys and values per query head.

transformers' SDPA attention reads a grouped-query layer's key/value heads in place only when there is no mask (or a
single query row); under a mask it first copies every key/value head once per query head of its group
(``repeat_kv``), O(context) bytes per layer per verify. A tree verify always has a mask, so on a long context most of
its attention time went to those copies. :func:`grouped_sdpa_attention` leaves the group to the kernel instead, and
:func:`grouped_attention` routes a target's forwards to it for the duration of one forward.

Two ways to leave the group to the kernel, chosen by measurement on 2-core CPUs (2026-12-06):

* **folding**: the query heads that share a key/value head become extra query rows of that head (``[B, H, q, D]`` ->
  ``[B, H_kv, groups * q, D]``, the mask's rows repeated per group), one ordinary SDPA call; for a single query row
  this is transformers' own ``pack_gqa``. Used for every single-row forward (a plain step, a root-only round) and
  for masked forwards in reduced precision. On an AMD EPYC Zen 4 in bf16, SDPA's ``enable_gqa`` took 3.5 ms per
  layer for one query row over 6,000 cached tokens against 0.56 ms folded (a plain step at 6K spent ~90 ms of its
  194 ms there), and 7.5 ms against 4.1 ms for a 33-row tree;
* ``enable_gqa=True``: masked forwards of several rows in float32, where it matched or beat folding (5.2 against 5.9
  ms per layer for 33 rows over 6,000 tokens; 9 rows: 1.9 against 1.8).

Only a CPU forward is rerouted: on CUDA, SDPA's fused kernels do not combine a mask with ``enable_gqa`` (it falls back
to the math kernel), so the copy is the faster path there. The arithmetic is the same either way (the same products,
in the same kernel family); the tests compare the paths on every supported family.
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
    [B, q, H, D]. Over grouped heads with a mask shared by the heads (or none): one query row, or a masked forward in
    reduced precision, folds the group into query rows; a masked forward of several rows in float32 runs SDPA with
    ``enable_gqa`` (module docstring). Anything else (an unmasked forward of several rows: a causal prefill; no
    groups; per-head masks; soft-capping, sinks, position biases) goes to transformers' own SDPA function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    rows = query.shape[2]
    handled = (groups > 1 and key.shape[-1] == value.shape[-1]
               and not any(kwargs.get(k) is not None for k in _OTHER_KWARGS)
               and (attention_mask is None or attention_mask.shape[1] == 1))
    if handled and (rows == 1 or (attention_mask is not None and query.dtype not in (torch.float32, torch.float64))):
        return _folded(query, key, value, attention_mask, groups, dropout, scaling), None
    if not handled or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _folded(query, key, value, mask, groups: int, dropout: float, scaling: float | None) -> torch.Tensor:
    """Attention with each group's query heads as extra rows of their key/value head: heads are numbered key/value
    head first (transformers' ``repeat_kv`` order), so ``[B, H, q, D]`` reshapes to ``[B, H_kv, groups * q, D]``,
    and row ``g * q + i`` is query row ``i`` of the group's head ``g``, which sees mask row ``i``."""
    b, heads, rows, dim = query.shape
    folded = query.reshape(b, heads // groups, groups * rows, dim)
    if mask is not None and rows > 1:
        mask = mask[:, :, None].expand(mask.shape[0], 1, groups, rows, mask.shape[-1])
        mask = mask.reshape(mask.shape[0], 1, groups * rows, mask.shape[-1])
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(b, heads, rows, value.shape[-1]).transpose(1, 2).contiguous()


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
    transformers on first use, with SDPA's mask builder: a model that builds its own masks, causal or sliding, builds
    what SDPA would get; unregistered, it would build none), restoring each config's own implementation afterwards."""
    if not on or not configs:
        yield
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if GROUPED_SDPA not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    if GROUPED_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # the model builds SDPA's masks for it
        AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    before = [c._attn_implementation_internal for c in configs]
    try:
        for c in configs:
            c._attn_implementation_internal = GROUPED_SDPA
        yield
    finally:
        for c, name in zip(configs, before):
            c._attn_implementation_internal = name
