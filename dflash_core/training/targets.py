"""The target a training run uses, on the device it runs on (CPU or CUDA), with its stop tokens."""

from __future__ import annotations

import torch

__all__ = ["load_training_target", "resolve_device", "default_taps"]


def resolve_device(name: str | None) -> torch.device:
    """``None``/``"auto"``: CUDA when available, else the CPU. A CUDA device without an index (``"auto"`` or
    ``"cuda"``) is the rank's own GPU under torchrun (``LOCAL_RANK``), never ``cuda:0`` for every rank; the chosen
    GPU is made current, so kernels and NCCL of this process run on it."""
    import os

    if name in (None, "auto"):
        if not torch.cuda.is_available():
            return torch.device("cpu")
        name = "cuda"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {name}: CUDA is not available here (use --device cpu)")
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return device


def load_training_target(name: str | None, dtype: torch.dtype, device: torch.device | str):
    """(target, tokenizer, stop ids): ``"smollm2"``/None is the embedded default, anything else a Hugging Face id
    or folder loaded straight onto ``device``."""
    if name in (None, "smollm2"):
        from ..default import load_default_target, stop_token_ids

        target, tokenizer = load_default_target(dtype, device)
        return target, tokenizer, stop_token_ids(tokenizer)
    from ..loading import load_target, stop_token_ids

    target, tokenizer = load_target(name, dtype, device)
    return target, tokenizer, stop_token_ids(tokenizer, target)


def default_taps(target, n: int = 5) -> list[int]:
    """The target layers a drafter with ``n`` taps reads (the same rule the drafter's config uses)."""
    from ..config import build_target_layer_ids

    return list(build_target_layer_ids(target.config.num_hidden_layers, n))
