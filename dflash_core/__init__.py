"""dflash_core: the DFlash drafter, the target adapter and the one speculative decode loop."""

from .config import DFlashConfig, build_target_layer_ids
from .decoding import (
    Chain,
    ChainProposal,
    GenerationResult,
    NoDraft,
    autoregressive_generate,
    dflash_generate,
    follow,
    speculative_generate,
)
from .lookup import PromptLookup, lookup_generate
from .model import DFlashDraftModel, DraftCache, load_draft
from .target import IncompatibleModelError, TargetAdapter, check_compatibility

__all__ = [
    "DFlashConfig", "DFlashDraftModel", "DraftCache", "GenerationResult", "IncompatibleModelError", "TargetAdapter",
    "Chain", "ChainProposal", "NoDraft", "autoregressive_generate", "build_target_layer_ids", "check_compatibility",
    "dflash_generate", "follow", "load_default_pair", "load_draft", "speculative_generate", "PromptLookup",
    "lookup_generate",
]


def load_default_pair(*args, **kwargs):
    """The embedded offline pair (SmolLM2-135M-Instruct target, the shipped drafter, tokenizer); see default.py."""
    from .default import load_default_pair as _load

    return _load(*args, **kwargs)
