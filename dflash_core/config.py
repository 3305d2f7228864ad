"""The drafter's configuration, read from and written to the z-lab DFlash ``config.json`` format.

A DFlash checkpoint is a Hugging Face folder whose ``config.json`` is a Qwen3 config plus three DFlash fields:
top-level ``block_size`` and ``num_target_layers``, and ``dflash_config: {"mask_token_id", "target_layer_ids"}``.
Fields this module does not model are kept in ``extra`` so a load/save round trip preserves them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DFlashConfig", "build_target_layer_ids"]


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
            rope_scaling=None,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            hidden_act="silu",
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            dflash_config={"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        )
        if self.draft_vocab_size is not None:
            out["draft_vocab_size"] = self.draft_vocab_size
        out.setdefault("layer_types", ["full_attention"] * self.num_hidden_layers)
        out.setdefault("sliding_window", None)
        out.setdefault("use_sliding_window", False)
        out.setdefault("tie_word_embeddings", False)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DFlashConfig":
        """Parse a z-lab ``config.json`` dictionary; errors name the missing or unsupported field."""
        raw = dict(raw)
        dflash = raw.pop("dflash_config", None)
        if not isinstance(dflash, dict) or "mask_token_id" not in dflash:
            raise ValueError(
                "config.json has no 'dflash_config' with a 'mask_token_id': this is not a DFlash drafter checkpoint "
                "(expected {'dflash_config': {'mask_token_id': int, 'target_layer_ids': [...]}, 'block_size': ..., ...})"
            )
        rope_theta = raw.pop("rope_theta", None)
        rope_params = raw.pop("rope_parameters", None) or {}
        rope_scaling = raw.pop("rope_scaling", None) or {}
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type")) or rope_params.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"rope scaling of type {rope_type!r} is not supported by DFlashDraftModel (only 'default')")
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 1_000_000.0)
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
                   if k not in raw]
        if missing:
            raise ValueError(f"config.json is missing required field(s) {missing}")
        heads = raw.pop("num_attention_heads")
        hidden = raw.pop("hidden_size")
        num_target_layers = raw.pop("num_target_layers", None)
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            if num_target_layers is None:
                raise ValueError("config.json needs dflash_config.target_layer_ids or num_target_layers")
            layer_ids = build_target_layer_ids(num_target_layers, raw.get("num_hidden_layers"))
        if num_target_layers is None:
            num_target_layers = max(layer_ids) + 3  # the spread rule ends at layer L-3
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
            mask_token_id=int(dflash["mask_token_id"]),
            num_target_layers=int(num_target_layers),
            rope_theta=float(rope_theta),
            extra=raw,
            **kwargs,
        )

    def save(self, folder: str | Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> "DFlashConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {folder}: a DFlash checkpoint folder holds config.json and model.safetensors")
        return cls.from_dict(json.loads(path.read_text()))
