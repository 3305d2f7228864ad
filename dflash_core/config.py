"""The drafter's configuration, read from and written to the z-lab DFlash ``config.json`` format.

A DFlash checkpoint is a Hugging Face folder whose ``config.json`` is a Qwen3 config plus three DFlash fields:
top-level ``block_size`` and ``num_target_layers``, and ``dflash_config: {"mask_token_id", "target_layer_ids"}``.
Fields this module does not model are kept in ``extra`` so a load/save round trip preserves them.

Every shape the published checkpoints use is read the way z-lab's own loader reads it: ``block_size``,
``mask_token_id`` and ``target_layer_ids`` are looked up in ``dflash_config`` first and at the top level second; rotary
settings come from ``rope_theta`` + ``rope_scaling`` (transformers 4.x) or ``rope_parameters`` (5.x), with the
``linear``, ``llama3`` and ``yarn`` scalings implemented; ``layer_types`` / ``sliding_window`` / ``is_causal`` select
per-layer sliding-window or causal attention. Anything that would change the drafter's outputs and is not
implemented (DFlash2's convolutions and candidate selector, logit multipliers or soft-capping, other rope scalings,
partial rotary) is refused with a message naming the field: a checkpoint is never loaded with a setting ignored.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

__all__ = ["DFlashConfig", "build_target_layer_ids", "rope_settings", "target_rope"]

LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DEFAULT_ROPE_THETA = 10_000.0  # what transformers' Qwen3Config / LlamaConfig assume when a config names no theta

# z-lab features that change what a drafter computes and that DFlashDraftModel does not implement
_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
_NEUTRAL_VALUES = MappingProxyType({"output_multiplier": 1.0, "input_embedding_scale": 1.0,
                                    "final_logit_softcapping": None})


def rope_settings(raw: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """(theta, scaling) from the rotary fields of a config dictionary, in either transformers format.

    transformers 4.x writes ``rope_theta`` plus ``rope_scaling`` (``{"rope_type" or "type": ..., "factor": ...}`` or
    null); 5.x writes ``rope_parameters = {"rope_type", "rope_theta", ...}`` and no ``rope_theta``. ``scaling`` is None
    for plain rotary, else a dictionary with ``rope_type`` in ``linear``, ``llama3``, ``yarn`` and its parameters;
    theta is None when the config names none. Unsupported types raise ValueError.
    """
    params = dict(raw.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (gemma-style)
        distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(distinct) > 1:
            raise ValueError("rope_parameters differ per layer type; DFlashDraftModel uses one rotary for all layers")
        params = dict(next(iter(params.values())))
    merged = {**params, **dict(raw.get("rope_scaling") or {})}
    inner_theta = merged.pop("rope_theta", None)
    theta = raw.get("rope_theta") if raw.get("rope_theta") is not None else inner_theta
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope scaling of type {rope_type!r} is not supported by DFlashDraftModel "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    partial = merged.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported by DFlashDraftModel (only 1.0)")
    if rope_type == "default":
        return (None if theta is None else float(theta)), None
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings"),
              "yarn": ("original_max_position_embeddings",)}[rope_type]
    missing = [k for k in needed if merged.get(k) is None]
    if missing:
        raise ValueError(f"rope scaling {rope_type!r} needs {missing} in rope_scaling / rope_parameters")
    return (None if theta is None else float(theta)), {"rope_type": rope_type, **merged}


def target_rope(target_config) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of a Hugging Face target config object, in either transformers format (4.x or 5.x). A target
    with a rotary per layer kind (Gemma 3: local and global) gives its full-attention layers' rotary. A partial
    rotary (Qwen3-Next, Qwen3.5: a quarter of each head) describes the target's heads, not a drafter's, which
    rotates its whole head: it is left out."""
    raw = {k: getattr(target_config, k, None) for k in ("rope_theta", "rope_scaling", "rope_parameters")}
    per_kind = raw.get("rope_parameters")
    if isinstance(per_kind, dict) and per_kind and all(isinstance(v, dict) for v in per_kind.values()):
        raw["rope_parameters"] = per_kind.get("full_attention") or next(iter(per_kind.values()))
    for key in ("rope_parameters", "rope_scaling"):  # 5.x may also show rope_parameters as rope_scaling
        if isinstance(raw.get(key), dict):
            raw[key] = {k: v for k, v in raw[key].items() if k != "partial_rotary_factor"}
    theta, scaling = rope_settings({k: v for k, v in raw.items() if v is not None})
    if theta is None:
        theta = float(getattr(target_config, "default_theta", None) or DEFAULT_ROPE_THETA)
    return theta, scaling


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Target layers whose hidden states condition the drafter (the published rule).

    One tap takes the middle layer; several taps are spread evenly from layer 1 to layer L-3 (Python's round,
    half to even), e.g. L=36, n=5 -> [1, 9, 17, 25, 33].
    """
    if num_target_layers < 1 or num_taps < 1:
        raise ValueError(f"need num_target_layers >= 1 and num_taps >= 1, got {num_target_layers}, {num_taps}")
    if num_taps == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_taps - 1)) for i in range(num_taps)]


@dataclass(frozen=True)
class DFlashConfig:
    """Architecture of a DFlash drafter: a stack of Qwen3-style decoder layers with KV injection."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    draft_vocab_size: int | None = None  # reduced draft vocabulary (ids in the weights as "draft_vocab"); None = full
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # None = plain rotary; see rope_settings
    layer_types: tuple[str, ...] | None = None  # per layer "full_attention" / "sliding_attention"; None = all full
    sliding_window: int | None = None  # keys further than this from a query are hidden in sliding layers
    is_causal: bool | None = None  # z-lab's switch: None = causal in sliding layers only, bidirectional elsewhere
    markov_rank: int | None = None  # a Markov head (dflash_core.model) of this rank; None = none (z-lab drafters)
    markov_kind: str = "token"  # "token" (bias from the previous token) or "gated" (also by the drafter's state)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one root plus at least one drafted position), got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: a DFlash drafter needs at least one tapped target layer")
        if self.layer_types is not None:
            types = tuple(str(t) for t in self.layer_types)
            unknown = sorted(set(types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer type(s) {unknown} are not supported by DFlashDraftModel "
                                 f"(supported: {', '.join(LAYER_TYPES)})")
            if len(types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(types)} entries for {self.num_hidden_layers} layers")
            if "sliding_attention" in types and not self.sliding_window:
                raise ValueError("sliding_attention layers need a positive sliding_window")
            object.__setattr__(self, "layer_types", None if set(types) == {"full_attention"} else types)
        if self.layer_types is None:
            object.__setattr__(self, "sliding_window", None)  # only meaningful with sliding layers
        if self.markov_rank is not None and (int(self.markov_rank) < 1 or self.markov_kind not in ("token", "gated")):
            raise ValueError(f"markov_head needs a rank >= 1 and a kind 'token' or 'gated', got rank "
                             f"{self.markov_rank}, kind {self.markov_kind!r}")
        if self.rope_scaling is not None:  # validated; {"rope_type": "default"} becomes None
            object.__setattr__(self, "rope_scaling", rope_settings({"rope_scaling": self.rope_scaling})[1])

    def layer_attention(self, index: int) -> tuple[bool, int | None]:
        """(causal, sliding window or None) of layer ``index``, with z-lab's defaults: sliding layers are causal
        unless ``is_causal`` says otherwise; full layers are bidirectional unless ``is_causal`` is true."""
        sliding = self.layer_types is not None and self.layer_types[index] == "sliding_attention"
        causal = sliding if self.is_causal is None else bool(self.is_causal)
        return causal, (self.sliding_window if sliding else None)

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    # ------------------------------------------------------------------ z-lab format
    def to_dict(self) -> dict[str, Any]:
        """The z-lab ``config.json`` dictionary (loads in the reference code and in this package)."""
        out = dict(self.extra)
        out.update(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            hidden_act="silu",
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            dflash_config={"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        )
        if self.draft_vocab_size is not None:
            out["draft_vocab_size"] = self.draft_vocab_size
        if self.markov_rank is not None:
            out["markov_head"] = {"rank": self.markov_rank, "kind": self.markov_kind}
        out["layer_types"] = list(self.layer_types or ["full_attention"] * self.num_hidden_layers)
        out["sliding_window"] = self.sliding_window
        out["use_sliding_window"] = self.layer_types is not None
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        out.setdefault("tie_word_embeddings", False)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DFlashConfig":
        """Parse a z-lab ``config.json`` dictionary; errors name the missing or unsupported field."""
        raw = dict(raw)
        dflash = dict(raw.pop("dflash_config", None) or {})
        architectures = raw.get("architectures") or []
        if "DFlash2DraftModel" in architectures or any(k in dflash for k in _DFLASH2_FIELDS):
            raise ValueError("this is a DFlash2 drafter (dynamic convolutions and a candidate selector), which "
                             "DFlashDraftModel does not implement; use a DFlash (v1) checkpoint")
        for name, neutral in _NEUTRAL_VALUES.items():
            value = dflash.get(name, raw.get(name, neutral))
            if value != neutral:
                raise ValueError(f"{name}={value} is not supported by DFlashDraftModel (it would be ignored and change "
                                 "the drafter's outputs)")
            raw.pop(name, None)

        def lookup(name: str, default: Any = None) -> Any:  # z-lab's order: dflash_config first, then top level
            top = raw.pop(name, None)
            return dflash.get(name, top if top is not None else default)

        mask_token_id = lookup("mask_token_id")
        if mask_token_id is None:
            raise ValueError(
                "config.json has no 'dflash_config' with a 'mask_token_id' (nor a top-level one): this is not a DFlash "
                "drafter checkpoint (expected {'dflash_config': {'mask_token_id': int, 'target_layer_ids': [...]}, "
                "'block_size': ..., ...})"
            )
        block_size = lookup("block_size", 16)
        layer_ids = lookup("target_layer_ids")
        rope_theta, rope_scaling = rope_settings(raw)
        for key in ("rope_theta", "rope_parameters", "rope_scaling", "partial_rotary_factor"):
            raw.pop(key, None)
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
                   if k not in raw]
        if missing:
            raise ValueError(f"config.json is missing required field(s) {missing}")
        heads = raw.pop("num_attention_heads")
        hidden = raw.pop("hidden_size")
        num_target_layers = raw.pop("num_target_layers", None)
        if layer_ids is None:
            if num_target_layers is None:
                raise ValueError("config.json needs dflash_config.target_layer_ids or num_target_layers")
            layer_ids = build_target_layer_ids(num_target_layers, raw.get("num_hidden_layers"))
        if num_target_layers is None:
            num_target_layers = max(layer_ids) + 3  # the spread rule ends at layer L-3
        # attention per layer: explicit layer_types, or Qwen2/3's use_sliding_window + max_window_layers rule
        markov = raw.pop("markov_head", None) or {}
        if markov and not isinstance(markov, dict):
            raise ValueError(f"markov_head must be an object {{'rank': int, 'kind': 'token' | 'gated'}}, got {markov!r}")
        layer_types = raw.pop("layer_types", None)
        use_sliding = bool(raw.pop("use_sliding_window", False))
        if layer_types is None and use_sliding:
            first = raw.get("max_window_layers", 0) or 0
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(raw["num_hidden_layers"])]
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: raw.pop(k) for k in list(raw) if k in known and k != "extra"}
        for dropped in ("architectures", "model_type", "hidden_act"):
            raw.pop(dropped, None)
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kwargs.pop("num_key_value_heads", heads),
            head_dim=kwargs.pop("head_dim", None) or hidden // heads,
            target_layer_ids=tuple(layer_ids),
            mask_token_id=int(mask_token_id),
            num_target_layers=int(num_target_layers),
            block_size=int(block_size),
            rope_theta=DEFAULT_ROPE_THETA if rope_theta is None else float(rope_theta),
            rope_scaling=rope_scaling,
            layer_types=None if layer_types is None else tuple(layer_types),
            markov_rank=None if not markov else int(markov.get("rank", 0)),
            markov_kind=str(markov.get("kind", "token")),
            extra=raw,
            **kwargs,
        )

    def save(self, folder: str | Path) -> None:
        """Write ``config.json`` atomically (never half a file)."""
        from .files import write_text_atomic

        write_text_atomic(Path(folder) / "config.json", json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> "DFlashConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {folder}: a DFlash checkpoint folder holds config.json and model.safetensors")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON ({err}): the file is damaged or not a config; restore it from "
                             "the checkpoint's source (or git) or download the checkpoint again") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not an object of config fields")
        return cls.from_dict(raw)
