"""What a training run is: the drafter's shape and the recipe's hyper-parameters (presets: ``fit.FIT_PRESETS``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import DFlashConfig, build_target_layer_ids, target_rope

__all__ = ["DraftSpec", "TrainConfig", "make_draft_config"]


@dataclass(frozen=True)
class DraftSpec:
    """The drafter's shape; everything else (hidden size, heads, vocab) follows the target."""

    layers: int = 2
    taps: int = 5
    block_size: int = 16
    mask_token_id: int = 16
    intermediate_size: int | None = None  # None = the target's


@dataclass(frozen=True)
class TrainConfig:
    gamma: float = 7.0  # position-weight decay, exp(-(k-1)/gamma)
    anchors: int = 48  # random anchors (blocks) per sequence per step
    seqs_per_step: int = 8  # global batch, in sequences
    lr: float = 6e-4
    min_lr_ratio: float = 0.05
    warmup_frac: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    epochs: float = 6.0  # used when neither steps nor time_budget_s is set
    steps: int | None = None
    time_budget_s: float | None = None  # total steps fixed from the measured speed of the first steps
    max_len: int = 3072
    distill_weight: float = 0.5  # loss = (1-w) * CE(hard label) + w * CE(target's top-k distribution)
    distill_topk: int = 8
    loss_vocab: str = "full"  # "full", "batch" (restricted) or "draft": see dflash_core.training.loss
    negatives: int = 2048
    autocast: bool = True  # bf16 autocast (CPU and CUDA)
    cache_features: bool = True  # keep each sequence's target features after its first use (small targets)
    # one right-padded target pass and one padded drafter forward per step instead of one per sequence
    # (dflash_core.training.batched): the same loss up to rounding, far fewer kernel launches (the GPU mode)
    batched: bool = False
    eval_every: int = 200
    eval_prompts: int = 6
    eval_new_tokens: int = 64
    ckpt_every: int = 100
    seed: int = 0


def make_draft_config(target_config, spec: DraftSpec) -> DFlashConfig:
    """A drafter config matching the target's hidden size, heads and vocabulary."""
    hidden = int(target_config.hidden_size)
    heads = int(target_config.num_attention_heads)
    n_layers = int(target_config.num_hidden_layers)
    theta, scaling = target_rope(target_config)  # the target's rotary, in either transformers config format
    return DFlashConfig(
        hidden_size=hidden, num_hidden_layers=spec.layers, num_attention_heads=heads,
        num_key_value_heads=int(getattr(target_config, "num_key_value_heads", heads)),
        head_dim=int(getattr(target_config, "head_dim", None) or hidden // heads),
        intermediate_size=int(spec.intermediate_size or target_config.intermediate_size),
        vocab_size=int(target_config.vocab_size),
        target_layer_ids=tuple(build_target_layer_ids(n_layers, spec.taps)),
        mask_token_id=spec.mask_token_id, num_target_layers=n_layers, block_size=spec.block_size,
        rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 40960)),
    )
