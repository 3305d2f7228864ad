"""The benchmark's model pairs: load (or build) a target, its tokenizer and its drafter, on the right GPU(s).

``load_models(pair, dtype, device, rank)`` is what the runner calls. Targets from the hub or a folder are read straight
onto their device (``dflash_core.loading``); drafters go next to the target's LM head. A ``device_map="auto"`` target
is spread over the rank's share of the GPUs: under torchrun with G GPUs and R local ranks, local rank r owns GPUs
``r * G // R ... (r + 1) * G // R - 1`` (:func:`dflash_core.default.rank_gpus`), makes the first of them current and
never touches another rank's GPUs.

Where the weights come from (:func:`locate_weights`): a local folder, the Hugging Face cache (a hub id whose snapshot
is there; ``HF_HUB_OFFLINE=1`` then keeps transformers off the network), or a download. Before anything is loaded,
:func:`check_weights` refuses a pair whose downloads cannot fit the free disk of the cache (sizes from the
config: parameters x bytes per dtype) or that would need a download with ``HF_HUB_OFFLINE`` set. A target from a
folder keeps the chat settings of its family: a Qwen3 chat template that reads ``enable_thinking`` gets
``enable_thinking=False`` (what the paper preset's Qwen3 pairs set) unless the pair says otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from experiments.bench.presets import ModelPair

__all__ = ["ByteTokenizer", "Models", "WeightSource", "InsufficientDiskError", "KNOWN_SHAPES", "tiny_target",
           "FAMILY_TARGETS", "family_target",
           "random_draft", "resolve_dtype", "parameter_count", "linear_attention_params", "dtype_bytes",
           "hub_cache_dir", "hub_offline", "locate_weights", "check_weights", "chat_settings", "load_models"]

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
_BUILT_IN = ("default", "tiny", "random")  # names that are not weights anywhere: built or shipped


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


# tiny random targets of the families beyond dense full attention (tests and experiments.studies.target_families)
FAMILY_TARGETS = ("qwen3", "mistral", "gemma3", "gpt_oss", "deepseek_v3", "qwen3_next", "qwen3_5")


def family_target(family: str, vocab: int = 48, window: int = 4, dtype: torch.dtype = torch.float64,
                   layers: int = 4, seed: int = 0):
    """A tiny random target of ``family`` (one of :data:`FAMILY_TARGETS`) from transformers' own config class, whose
    sliding layers (if any) see ``window`` positions. The mixtures of experts
    (gpt-oss: eager attention with sinks; DeepSeek-V3: MLA; Qwen3-Next) run in fp32: their grouped expert matmul
    has no fp64 kernel. The hybrids (Qwen3-Next, Qwen3.5) have no window; their Gated DeltaNet kernels compute in
    fp32 whatever the model's dtype."""
    from transformers import (
        AutoModelForCausalLM, DeepseekV3Config, Gemma3TextConfig, GptOssConfig, MistralConfig, Qwen3Config,
        Qwen3NextConfig,
    )
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                  initializer_range=0.2, tie_word_embeddings=False, sliding_window=window)
    if family == "qwen3":  # layer 0 full, the rest sliding
        config = Qwen3Config(**common, use_sliding_window=True, max_window_layers=1)
    elif family == "mistral":  # every layer sliding, no per-layer kinds
        config = MistralConfig(**common)
    elif family == "gemma3":  # alternating, with a final logit soft-cap the adapter must apply
        config = Gemma3TextConfig(**common, sliding_window_pattern=2, final_logit_softcapping=5.0)
    elif family == "gpt_oss":  # alternating, attention sinks, 4 experts
        config = GptOssConfig(**{**common, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2)
        dtype = torch.float32
    elif family == "deepseek_v3":  # MLA: low-rank queries and keys/values, a shared rope part, 4 routed experts
        del common["sliding_window"], common["head_dim"]
        config = DeepseekV3Config(**{**common, "num_key_value_heads": 4}, moe_intermediate_size=16, n_routed_experts=4,
                                  num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                  q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)
        dtype = torch.float32
    elif family in ("qwen3_next", "qwen3_5"):  # hybrid: three Gated DeltaNet layers, then gated full attention
        del common["sliding_window"]
        linear = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_conv_kernel_dim=4,  # the last layer full, as every 4th is
                      layer_types=["linear_attention"] * (layers - 1) + ["full_attention"])
        if family == "qwen3_next":  # with its mixture of experts (4 routed and a shared one), so fp32
            config = Qwen3NextConfig(**common, **linear, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=16, shared_expert_intermediate_size=16)
            dtype = torch.float32
        else:  # Qwen3.5's text model (dense)
            config = Qwen3_5TextConfig(**common, **linear)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def random_draft(target, layers: int = 1, taps: int = 5, block_size: int = 16, mask_token_id: int | None = None,
                 seed: int = 1):
    """A DFlash drafter with random weights shaped for ``target`` (same dtype and device as its LM head, same rotary).

    It proposes nonsense, so speculative methods gain nothing; it exercises every code path at the right sizes.
    """
    from dflash_core import DFlashDraftModel
    from dflash_core.config import DFlashConfig, build_target_layer_ids
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


def _placement(pair: ModelPair, device: torch.device, local_rank: int, local_world: int) -> dict[str, Any]:
    """device_map / max_memory for the target: this rank's share of the GPUs for a ``device_map="auto"`` pair."""
    if pair.device_map != "auto" or device.type != "cuda":
        return {}
    from dflash_core.default import rank_gpus

    gpus = rank_gpus(local_rank, local_world, torch.cuda.device_count())
    return {"device_map": "auto",
            "max_memory": {g: torch.cuda.get_device_properties(g).total_memory for g in gpus}}


# ---------------------------------------------------------------------------------------------------- weights on disk
_QWEN3_COMMON = dict(num_attention_heads=32, head_dim=128, vocab_size=151936, torch_dtype="bfloat16")
# Shapes of the paper preset's hub ids, used only to size a download when no config.json is at hand. The targets'
# are their published config.json fields; the drafters' are estimates from the published recipe (hidden size and
# intermediate size of the target, 5 layers, 8 for the coder drafter, 5 tapped target layers).
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-4B": dict(_QWEN3_COMMON, model_type="qwen3", hidden_size=2560, num_hidden_layers=36,
                          num_key_value_heads=8, intermediate_size=9728, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": dict(_QWEN3_COMMON, model_type="qwen3", hidden_size=4096, num_hidden_layers=36,
                          num_key_value_heads=8, intermediate_size=12288, tie_word_embeddings=False),
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": dict(_QWEN3_COMMON, model_type="qwen3_moe", hidden_size=2048,
                                              num_hidden_layers=48, num_key_value_heads=4, intermediate_size=6144,
                                              moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                              tie_word_embeddings=False),
    # Qwen3.5-27B's text model (its config.json's text_config): 64 layers, three of every four Gated DeltaNet
    "Qwen/Qwen3.5-27B": dict(model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64,
                             num_attention_heads=24, num_key_value_heads=4, head_dim=256, intermediate_size=17408,
                             vocab_size=248320, attn_output_gate=True, tie_word_embeddings=False,
                             layer_types=[("full_attention" if i % 4 == 3 else "linear_attention") for i in range(64)],
                             linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                             linear_value_head_dim=128, linear_conv_kernel_dim=4, torch_dtype="bfloat16"),
    "z-lab/Qwen3-4B-DFlash-b16": dict(_QWEN3_COMMON, hidden_size=2560, num_hidden_layers=5, num_key_value_heads=8,
                                      intermediate_size=9728, block_size=16, num_target_layers=36,
                                      dflash_config={"target_layer_ids": [1, 9, 17, 25, 33]}, estimated=True),
    "z-lab/Qwen3-8B-DFlash-b16": dict(_QWEN3_COMMON, hidden_size=4096, num_hidden_layers=5, num_key_value_heads=8,
                                      intermediate_size=12288, block_size=16, num_target_layers=36,
                                      dflash_config={"target_layer_ids": [1, 9, 17, 25, 33]}, estimated=True),
    "z-lab/Qwen3-Coder-30B-A3B-DFlash": dict(_QWEN3_COMMON, hidden_size=2048, num_hidden_layers=8,
                                             num_key_value_heads=4, intermediate_size=6144, block_size=16,
                                             num_target_layers=48,
                                             dflash_config={"target_layer_ids": [1, 12, 24, 35, 45]}, estimated=True),
    "z-lab/Qwen3.5-27B-DFlash": dict(_QWEN3_COMMON, hidden_size=5120, num_hidden_layers=5, num_key_value_heads=8,
                                     intermediate_size=17408, vocab_size=248320, block_size=16, num_target_layers=64,
                                     dflash_config={"target_layer_ids": [1, 16, 31, 46, 61]}, estimated=True),
}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


class InsufficientDiskError(ValueError):
    """The weights a pair would download do not fit the free disk where the Hugging Face cache lives."""


def dtype_bytes(name: Any, default: int = 2) -> int:
    """Bytes per parameter of a dtype name (``bfloat16``, ``bf16``, ``torch.float32``, ...)."""
    text = str(name or "").removeprefix("torch.")
    return _DTYPE_BYTES.get(text, default)


def _is_draft_config(cfg: dict[str, Any]) -> bool:
    return "dflash_config" in cfg or "DFlashDraftModel" in (cfg.get("architectures") or []) or (
        "block_size" in cfg and "target_layer_ids" in cfg)


def parameter_count(config: dict[str, Any]) -> int:
    """Parameters of a decoder-only config (dense or mixture-of-experts) or of a DFlash drafter config, from its
    shape fields alone: embeddings (+ an untied LM head), attention, MLP or experts, norms; a drafter has no
    embeddings or head of its own but the ``fc`` projection of its tapped layers."""
    cfg = config.get("text_config") or config
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads = int(cfg.get("num_attention_heads") or 1)
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    attn = hidden * heads * head_dim * 2 + 2 * hidden * kv * head_dim + 2 * head_dim  # q, o; k, v; q/k norms
    if cfg.get("attention_bias"):
        attn += heads * head_dim + 2 * kv * head_dim + hidden
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    dense_mlp = 3 * hidden * int(cfg.get("intermediate_size") or 4 * hidden)
    sparse_layers = 0
    if experts:
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense_only = set(cfg.get("mlp_only_layers") or [])
        sparse_layers = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    moe_mlp = experts * 3 * hidden * int(cfg.get("moe_intermediate_size") or 0) + hidden * experts
    if cfg.get("shared_expert_intermediate_size"):
        moe_mlp += 3 * hidden * int(cfg["shared_expert_intermediate_size"]) + hidden
    if cfg.get("attn_output_gate", str(cfg.get("model_type", "")).startswith(("qwen3_next", "qwen3_5"))):
        # Qwen3-Next / Qwen3.5: q_proj also gives the attention output's gate
        attn += hidden * heads * head_dim
    linear = list(cfg.get("layer_types") or []).count("linear_attention")
    total = (layers - linear) * attn + linear * linear_attention_params(cfg) + layers * 2 * hidden
    total += sparse_layers * moe_mlp + (layers - sparse_layers) * dense_mlp + hidden
    if _is_draft_config(cfg):
        taps = len((cfg.get("dflash_config") or {}).get("target_layer_ids") or cfg.get("target_layer_ids") or [0])
        total += taps * hidden * hidden + hidden  # fc, hidden_norm
        markov = cfg.get("markov_head") or {}
        if markov:  # embedding (+ the out-of-vocabulary row), output, and the gate when it has one
            rank, draft_vocab = int(markov["rank"]), int(cfg.get("draft_vocab_size") or cfg["vocab_size"])
            total += (draft_vocab + 1) * rank + rank * draft_vocab
            total += (hidden * rank + rank) if markov.get("kind") == "gated" else 0
        return total
    vocab = int(cfg.get("vocab_size") or 0)
    return total + vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)


def linear_attention_params(cfg: dict[str, Any]) -> int:
    """Parameters of one Gated DeltaNet layer (Qwen3-Next / Qwen3.5): input projections (q, k, v, the output gate
    z, and the per-head beta and decay), the short depthwise conv over q, k and v, the output projection, the gated
    norm, and the per-head decay parameters."""
    hidden = int(cfg["hidden_size"])
    keys = int(cfg.get("linear_num_key_heads") or 0) * int(cfg.get("linear_key_head_dim") or 0)
    v_heads, v_dim = int(cfg.get("linear_num_value_heads") or 0), int(cfg.get("linear_value_head_dim") or 0)
    values = v_heads * v_dim
    kernel = int(cfg.get("linear_conv_kernel_dim") or 4)
    return hidden * (2 * keys + 2 * values + 2 * v_heads) + (2 * keys + values) * kernel + values * hidden \
        + v_dim + 2 * v_heads


def hub_cache_dir() -> Path:
    """Where the Hugging Face Hub keeps (and downloads) models: HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub (read now, not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@dataclass(frozen=True)
class WeightSource:
    """Where one model's weights are: ``kind`` is ``built-in`` (default/tiny/random), ``local`` (a folder),
    ``cached`` (a complete snapshot in the hub cache) or ``download`` (not here: the hub would be asked).
    ``config`` is its config.json (or a known shape, ``config_from`` says which); ``disk_bytes``: the weight files
    present; ``download_bytes``: what a download would add (None: unknown)."""

    name: str
    kind: str
    path: Path | None = None
    config: dict[str, Any] | None = None
    config_from: str | None = None
    disk_bytes: int | None = None
    download_bytes: int | None = None

    @property
    def params(self) -> int | None:
        try:
            return parameter_count(self.config) if self.config else None
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def checkpoint_bytes(self) -> int | None:
        """Size of the checkpoint: the files present, else parameters x bytes of the config's dtype."""
        if self.disk_bytes:
            return self.disk_bytes
        params = self.params
        dtype = (self.config or {}).get("torch_dtype") or (self.config or {}).get("dtype")
        return None if params is None else params * dtype_bytes(dtype)


def _read_config(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _weight_files(folder: Path) -> list[Path]:
    return [f for f in folder.iterdir() if f.suffix in _WEIGHT_SUFFIXES and f.is_file()] if folder.is_dir() else []


def _snapshot(repo: str, cache: Path) -> Path | None:
    """The cached snapshot folder of ``repo`` that holds a config.json (the one ``refs/main`` names, else any)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    ref = root / "refs" / "main"
    candidates = []
    if ref.is_file():
        candidates.append(root / "snapshots" / ref.read_text().strip())
    if (root / "snapshots").is_dir():
        candidates += sorted((root / "snapshots").iterdir())
    return next((c for c in candidates if (c / "config.json").is_file()), None)


def _complete(folder: Path) -> bool:
    """All weight files of a checkpoint folder are there (the shards an index names, or at least one file)."""
    for index in folder.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError):
            return False
        return bool(shards) and all((folder / s).is_file() for s in shards)
    return bool(_weight_files(folder))


def locate_weights(name: str) -> WeightSource:
    """Where the weights named ``name`` (a folder, a hub id, or a built-in name) are, without loading them."""
    if name in _BUILT_IN:
        return WeightSource(name, "built-in")
    folder = Path(name).expanduser()
    if folder.exists():
        config = _read_config(folder)
        return WeightSource(name, "local", folder, config, "config.json" if config else None,
                            sum(f.stat().st_size for f in _weight_files(folder)) or None)
    snapshot = _snapshot(name, hub_cache_dir()) if name.count("/") == 1 else None
    known = KNOWN_SHAPES.get(name)
    if snapshot is not None and _complete(snapshot):
        return WeightSource(name, "cached", snapshot, _read_config(snapshot), "config.json",
                            sum(f.stat().st_size for f in _weight_files(snapshot)) or None)
    config = _read_config(snapshot) if snapshot is not None else None
    config_from = "config.json" if config else None
    if config is None and known is not None:
        config, config_from = known, "estimated" if known.get("estimated") else "published shape"
    source = WeightSource(name, "download", snapshot, config, config_from)
    present = sum(f.stat().st_size for f in _weight_files(snapshot)) if snapshot is not None else 0
    total = source.checkpoint_bytes
    return dataclasses.replace(source, download_bytes=None if total is None else max(total - present, 0))


def _free_bytes(folder: Path) -> int:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def _gib(n: int | float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_weights(pair: ModelPair) -> list[WeightSource]:
    """Where the pair's target and drafter are; raises before anything is loaded when they cannot be had here:
    a download with ``HF_HUB_OFFLINE`` set (FileNotFoundError), or downloads larger than the free disk of the
    hub cache (:class:`InsufficientDiskError`). Returns the two :class:`WeightSource` s."""
    sources = [locate_weights(pair.target), locate_weights(pair.draft)]
    downloads = [s for s in sources if s.kind == "download"]
    if not downloads:
        return sources
    cache = hub_cache_dir()
    if hub_offline():
        raise FileNotFoundError(
            f"{', '.join(s.name for s in downloads)} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE "
            "is set: copy the model there (the cache layout models--<org>--<name>/), point HF_HUB_CACHE at the "
            "cache that holds it, or pass --target / --draft a local folder")
    need = sum(s.download_bytes or 0 for s in downloads)
    free = _free_bytes(cache)
    if need > free:
        parts = "; ".join(f"{s.name}: ~{_gib(s.download_bytes or 0)} ({(s.params or 0) / 1e9:.2f} B parameters x "
                          f"{dtype_bytes((s.config or {}).get('torch_dtype'))} bytes, {s.config_from})"
                          for s in downloads)
        raise InsufficientDiskError(
            f"the weights to download ({parts}) need ~{_gib(need)}, but only {_gib(free)} are free under {cache}: "
            "free some space, set HF_HUB_CACHE to a larger disk, or pass --target / --draft local folders")
    return sources


def chat_settings(pair: ModelPair, tokenizer: Any, config: Any) -> tuple[tuple[str, Any], ...]:
    """The pair's chat template settings; a pair without any, whose target is a Qwen3 model with a template that
    reads ``enable_thinking``, gets ``enable_thinking=False`` (the benchmark measures answers without thinking)."""
    if pair.chat_template_kwargs:
        return tuple(pair.chat_template_kwargs)
    model_type = str(getattr(config, "model_type", "") or "")
    template = getattr(tokenizer, "chat_template", None) or ""
    if model_type.startswith("qwen3") and "enable_thinking" in str(template):
        return (("enable_thinking", False),)
    return ()


def load_models(pair: ModelPair, dtype_name: str, device: torch.device, rank=None) -> Models:
    """Load (or build) the target, its tokenizer and the drafter of ``pair`` in the requested dtype.

    ``rank`` (``experiments.bench.ranks.RankInfo``) decides a ``device_map="auto"`` target's share of the GPUs.
    """
    from dflash_core import check_compatibility, load_draft
    from dflash_core.loading import load_target

    local_rank = getattr(rank, "local_rank", 0)
    local_world = getattr(rank, "local_world", None) or getattr(rank, "world", 1)
    dtype = resolve_dtype(dtype_name, device)
    check_weights(pair)  # before loading anything: refuse what cannot be downloaded or stored here
    if pair.target == "tiny":
        target, tokenizer = tiny_target().to(device=device, dtype=dtype), ByteTokenizer()
        stops = [tokenizer.eos_token_id]
    else:
        target, tokenizer, stops = load_target(pair.target, dtype, device,
                                               **_placement(pair, device, local_rank, local_world))
    if pair.target not in ("tiny", "default"):
        settings = chat_settings(pair, tokenizer, target.config)
        if settings != tuple(pair.chat_template_kwargs):
            print(f"[models] {pair.target}: chat settings {dict(settings)} (its family's; the pair named none)",
                  file=sys.stderr, flush=True)
            pair = dataclasses.replace(pair, chat_template_kwargs=settings)

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
