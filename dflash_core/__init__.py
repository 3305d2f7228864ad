"""dflash_core: the DFlash drafter, the target adapter and the one speculative decode loop.

The root exports what a researcher uses; everything else is importable from its module (``dflash_core.decoding``
for the loop, ``dflash_core.target`` for the adapter, ``dflash_core.config`` for ``DFlashConfig``, ...).
"""

from .decoding import GenerationResult, autoregressive_generate, dflash_generate, speculative_generate
from .model import DFlashDraftModel, load_draft
from .prompt_lookup import lookup_generate
from .target import IncompatibleModelError, check_compatibility
from .tree import BlockPolicy, Chain, DraftBlock, DraftTree

__all__ = [
    "BlockPolicy", "Chain", "DFlashDraftModel", "DraftBlock", "DraftTree", "GenerationResult", "IncompatibleModelError",
    "autoregressive_generate", "check_compatibility", "dflash_generate", "load_default_pair", "load_draft",
    "lookup_generate", "speculative_generate",
]


def load_default_pair(*args, **kwargs):
    """The embedded offline pair (SmolLM2-135M-Instruct target, the shipped drafter, tokenizer); see default.py."""
    from .default import load_default_pair as _load  # transformers' tokenizer stack loads only when asked

    return _load(*args, **kwargs)

