"""The device a training CLI runs on (this torchrun rank's) and the target layers a drafter taps."""

from __future__ import annotations

import os

import torch

__all__ = ["resolve_device", "default_taps"]


def resolve_device(name: str | None) -> torch.device:
    """``--device`` of a training CLI through the one resolver (:func:`dflash_core.default.resolve_device`) as this
    torchrun rank (``LOCAL_RANK``): ``auto``/``cuda`` is the rank's own GPU, never ``cuda:0`` for every rank, made
    current so kernels and NCCL of this process run on it. CUDA asked for without CUDA stops with the reason."""
    from ..default import resolve_device as resolve

    try:
        return resolve(name, local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as err:
        raise SystemExit(f"--device {name}: {err}") from None


def default_taps(target, n: int = 5) -> list[int]:
    """The target layers a drafter with ``n`` taps reads (the same rule the drafter's config uses)."""
    from ..config import build_target_layer_ids

    return list(build_target_layer_ids(target.config.num_hidden_layers, n))
