"""The one target loader, for decoding or training: the embedded default or any Hugging Face causal LM, straight onto
its device, with an attention backend that applies the tree mask, and the token ids that end its turns.

Used by the benchmark (``experiments.bench.models``), the training recipe (``dflash_core.training``) and the studies.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["DEFAULT_TARGET_NAMES", "load_target", "placement", "stop_token_ids", "unreachable_error"]

DEFAULT_TARGET_NAMES = ("default", "smollm2")  # the embedded target (dflash_core.default)
_TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


def placement(device: torch.device | str, device_map: str | None = None,
              max_memory: dict[int, int] | None = None) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that place the weights where they will run.

    ``device_map="auto"`` splits the layers over the GPUs allowed by ``max_memory``. Otherwise a non-CPU device gets
    ``device_map={"": device}``: every tensor is read straight onto that GPU, instead of materializing the whole
    model on the CPU first (per rank, under torchrun) and copying it over.
    """
    if device_map == "auto":
        return {"device_map": "auto", **({"max_memory": max_memory} if max_memory else {})}
    if device_map is not None:
        raise ValueError(f"device_map must be None or 'auto', got {device_map!r}")
    device = torch.device(device)
    return {} if device.type == "cpu" else {"device_map": {"": str(device)}}


def load_target(name: str | None, dtype: torch.dtype | None, device: torch.device | str, *,
                device_map: str | None = None, max_memory: dict[int, int] | None = None,
                attn_implementation: str = "sdpa"):
    """(target, tokenizer, stop ids), the target in ``dtype``, in eval mode.

    ``name``: one of :data:`DEFAULT_TARGET_NAMES` (or None) for the embedded SmolLM2-135M-Instruct, offline (its
    stop ids: :func:`dflash_core.default.stop_token_ids`; ``dtype`` None: the device's default), else a Hugging Face
    model id or folder (stop ids: :func:`stop_token_ids`). SDPA is the default backend because tree verification
    needs one that applies a 4D mask (see ``dflash_core.target.check_mask_backend``).
    """
    if name is None or name in DEFAULT_TARGET_NAMES:
        from .default import load_default_target, stop_token_ids as default_stops

        target, tokenizer = load_default_target(dtype, device)
        return target, tokenizer, default_stops(tokenizer)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation=attn_implementation,
                                                     **placement(device, device_map, max_memory))
    except OSError as err:  # not on disk and the hub unreachable (or refused): say what to carry, not a traceback
        raise unreachable_error(name, err) from err
    if device_map is None and torch.device(device).type == "cpu":
        model = model.to(device)
    return model.eval(), tokenizer, stop_token_ids(tokenizer, model)


def unreachable_error(name: str, err: Exception) -> FileNotFoundError:
    """The error for a model that is neither a local folder nor in the Hugging Face cache, the hub out of reach."""
    offline = any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
                  for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    where = ("HF_HUB_OFFLINE is set, so the hub was not asked" if offline else
             "the Hugging Face Hub could not be reached; on a machine without network set HF_HUB_OFFLINE=1, so "
             "that only the cache is read")
    return FileNotFoundError(
        f"cannot load {name!r}: it is not a local folder and not complete in the Hugging Face cache, and {where}. "
        f"Carry its weights to this machine: a folder from `hf download {name} --local-dir DIR` (pass DIR instead "
        f"of the id), or the cache folder models--{name.replace('/', '--')} copied under $HF_HUB_CACHE "
        f"(default ~/.cache/huggingface/hub). ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")


def stop_token_ids(tokenizer, target) -> list[int]:
    """Token ids that end a turn: the tokenizer's and generation config's EOS plus the usual chat end tokens."""
    ids: set[int] = set()
    generation = getattr(target, "generation_config", None)
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(generation, "eos_token_id", None)):
        ids.update([value] if isinstance(value, int) else (value or []))
    vocab = getattr(tokenizer, "get_vocab", dict)() or {}
    for token in _TURN_END_TOKENS:
        if token in vocab:
            ids.add(tokenizer.convert_tokens_to_ids(token))
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)
