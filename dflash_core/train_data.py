"""Old import path of the training prompts and HF-generate responses: :mod:`dflash_core.training.prompts` and
:mod:`dflash_core.training.respond`."""

from __future__ import annotations

from .training.prompts import PromptItem, build_prompts
from .training.respond import GenerationConfig, generate_responses, load_samples

__all__ = ["PromptItem", "build_prompts", "GenerationConfig", "generate_responses", "load_samples"]
