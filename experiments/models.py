"""The benchmark's model pairs: load (or build) a target, its tokenizer and its drafter, on the right GPU(s).

``load_models(pair, dtype, device, rank)`` is what the runner calls. Targets from the hub or a folder are read straight
onto their device (``dflash_core.loading``); drafters go next to the target's LM head. A ``device_map="auto"`` target
is spread over the rank's share of the GPUs: under torchrun with G GPUs and R local ranks, local rank r owns GPUs
``r * G // R ... (r + 1) * G // R - 1`` (:func:`rank_gpus`), makes the first of them current and never touches
another rank's GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from experiments.presets import ModelPair

__all__ = ["ByteTokenizer", "Models", "tiny_target", "random_draft", "resolve_dtype", "rank_gpus", "pick_device",
           "load_models"]

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


class ByteTokenizer:
    """Bytes as tokens (ids 0-255) plus four specials; the tiny preset's tokenizer (no files, no chat template)."""

    chat_template = None
    bos_token_id, eos_token_id, pad_token_id, mask_token_id = 256, 257, 258, 259
    vocab_size = 260

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([self.bos_token_id] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        data = bytes(i for i in ids if i < 256) if skip_special_tokens else bytes(i % 256 for i in ids)
        return data.decode("utf-8", errors="replace")


@dataclass
class Models:
    """A loaded target/drafter pair and what the runner needs around it."""

    target: Any
    draft: Any
    tokenizer: Any
    stop_token_ids: list[int]
    pair: ModelPair
    dtype: torch.dtype
    device: torch.device

    def describe(self) -> dict[str, Any]:
        cfg = self.target.config
        info = {"target": self.pair.target, "draft": self.pair.draft, "model_type": cfg.model_type,
                "target_params": sum(p.numel() for p in self.target.parameters()),
                "stop_token_ids": self.stop_token_ids}
        if self.draft is not None:
            info["draft_params"] = sum(p.numel() for p in self.draft.parameters())
            info["draft_config"] = {"layers": self.draft.config.num_hidden_layers,
                                    "block_size": self.draft.config.block_size,
                                    "target_layer_ids": list(self.draft.config.target_layer_ids),
                                    "mask_token_id": self.draft.config.mask_token_id}
        return info


def tiny_target(vocab: int = ByteTokenizer.vocab_size, layers: int = 4, hidden: int = 32, seed: int = 0):
    """A random tiny Llama; a wide init keeps its distributions peaked, so greedy near-ties are rare."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         initializer_range=0.2, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def random_draft(target, layers: int = 1, taps: int = 5, block_size: int = 16, mask_token_id: int | None = None,
                 seed: int = 1):
    """A DFlash drafter with random weights shaped for ``target`` (same dtype and device as its LM head, same rotary).

    It proposes nonsense, so speculative methods gain nothing; it exercises every code path at the right sizes.
    """
    from dflash_core import DFlashConfig, DFlashDraftModel, build_target_layer_ids
    from dflash_core.config import target_rope

    cfg = target.config
    n_layers = int(cfg.num_hidden_layers)
    taps = max(1, min(taps, n_layers))
    if n_layers >= taps + 4:
        layer_ids = build_target_layer_ids(n_layers, taps)
    else:  # too shallow for the published spread rule: spread evenly over all layers
        layer_ids = sorted({round(i * (n_layers - 1) / max(taps - 1, 1)) for i in range(taps)})
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    vocab = int(target.lm_head.weight.shape[0])
    theta, scaling = target_rope(cfg)  # transformers 5.x configs carry rope_parameters, not rope_theta
    config = DFlashConfig(
        hidden_size=int(cfg.hidden_size), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(getattr(cfg, "num_key_value_heads", heads)), head_dim=head_dim,
        intermediate_size=int(cfg.intermediate_size), vocab_size=vocab, target_layer_ids=tuple(layer_ids),
        mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id, num_target_layers=n_layers,
        block_size=block_size, rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 40960)),
    )
    weight = target.lm_head.weight
    torch.manual_seed(seed)
    with torch.device(weight.device):
        draft = DFlashDraftModel(config)
    return draft.to(weight.dtype).eval()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        from dflash_core.default import default_dtype

        return default_dtype(device)
    return _TORCH_DTYPES[name]


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


def pick_device(name: str, local_rank: int = 0, local_world: int = 1) -> torch.device:
    """The device this process runs on; on CUDA it becomes the current device (and no other GPU is touched).

    ``cuda`` without an index means the first GPU of this rank's share (:func:`rank_gpus`); ``cuda:N`` is taken
    as given. Making it current matters: CUDA events and kernels launched without a device go to the current one.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("this run needs CUDA (the paper preset's models do not fit a CPU run), and no GPU is "
                         "visible; use --preset default or quick on a machine without a GPU")
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", rank_gpus(local_rank, local_world, torch.cuda.device_count())[0])
        torch.cuda.set_device(device)
    return device


def _placement(pair: ModelPair, device: torch.device, local_rank: int, local_world: int) -> dict[str, Any]:
    """device_map / max_memory for the target: this rank's share of the GPUs for a ``device_map="auto"`` pair."""
    if pair.device_map != "auto" or device.type != "cuda":
        return {}
    gpus = rank_gpus(local_rank, local_world, torch.cuda.device_count())
    return {"device_map": "auto",
            "max_memory": {g: torch.cuda.get_device_properties(g).total_memory for g in gpus}}


def load_models(pair: ModelPair, dtype_name: str, device: torch.device, rank=None) -> Models:
    """Load (or build) the target, its tokenizer and the drafter of ``pair`` in the requested dtype.

    ``rank`` (``experiments.benchmark.RankInfo``) decides a ``device_map="auto"`` target's share of the GPUs.
    """
    from dflash_core import check_compatibility, load_draft
    from dflash_core.loading import load_target, stop_token_ids

    local_rank = getattr(rank, "local_rank", 0)
    local_world = getattr(rank, "local_world", None) or getattr(rank, "world", 1)
    dtype = resolve_dtype(dtype_name, device)
    if pair.target == "default":
        from dflash_core.default import load_default_target, stop_token_ids as default_stops

        target, tokenizer = load_default_target(dtype, device)
        stops = default_stops(tokenizer)
    elif pair.target == "tiny":
        target, tokenizer = tiny_target().to(device=device, dtype=dtype), ByteTokenizer()
        stops = [tokenizer.eos_token_id]
    else:
        target, tokenizer = load_target(pair.target, dtype, device,
                                        **_placement(pair, device, local_rank, local_world))
        stops = stop_token_ids(tokenizer, target)

    head = target.lm_head.weight
    if pair.draft == "random":
        tiny = pair.target == "tiny"
        draft = random_draft(target, layers=1 if tiny else 2, taps=2 if tiny else 5, block_size=8 if tiny else 16)
    elif pair.draft == "default":
        from dflash_core.default import DEFAULT_DRAFT_DIR

        if not (DEFAULT_DRAFT_DIR / "model.safetensors").is_file():
            raise FileNotFoundError(
                f"the shipped drafter is not in {DEFAULT_DRAFT_DIR} yet; pass --draft PATH for a DFlash checkpoint, "
                "or --draft random to check the whole path with a random drafter (no speedup)")
        draft = load_draft(DEFAULT_DRAFT_DIR, device=head.device, dtype=head.dtype)
    else:
        draft = load_draft(pair.draft, device=head.device, dtype=head.dtype)
    check_compatibility(target, draft)
    return Models(target, draft, tokenizer, stops, pair, head.dtype, head.device)
