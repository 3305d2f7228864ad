"""The dry run's estimates (:mod:`experiments.bench.plan`): prior machine constants, a pair's memory, the decoding
seconds per token of a method variant, the longest generation's context, and the disk and GPU-memory checks of a pair.

Prior costs, not measurements: a target forward costs its per-layer launch overhead plus the larger of reading its
weights and computing its tokens; a DFlash round adds the drafter and the tree; rounds commit tau tokens (``_TAU``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_CHARS_PER_TOKEN = 3.0  # conservative (BPE chat text is ~4): prompt lengths are estimated, not tokenized
_CHAT_OVERHEAD = 32  # template tokens around the messages


@dataclass(frozen=True)
class Prior:
    """Rough machine constants for the time prior (a kind of machine, not a measurement)."""

    name: str
    bandwidth: float  # bytes/s of weights read per forward
    flops: float  # dense bf16 FLOP/s reached by a forward over many tokens
    layer_s: float  # launch overhead per decoder layer and forward (HF Transformers, eager)
    moe_layer_s: float  # the same for a mixture-of-experts layer (experts looped per layer)
    tree_s_per_node: float  # building the best-first tree, per node (plus 1 ms)


PRIORS = {
    "cuda": Prior("an H200-class GPU (prior)", bandwidth=4.0e12, flops=4.0e14, layer_s=0.55e-3, moe_layer_s=1.2e-3,
                  tree_s_per_node=5e-6),
    "cpu": Prior("a 2-core CPU (prior)", bandwidth=4.0e10, flops=5.0e11, layer_s=0.5e-3,
                 moe_layer_s=1.0e-3, tree_s_per_node=1e-5),
}
# Committed tokens per round (tau) by drafter kind and temperature: (chain, tree at B=16, tree at B=1024); trees in
# between are interpolated in log2(B). z-lab: the DDTree paper's Qwen3-8B numbers rounded down (T=0 DFlash 6.5-7.8,
# DDTree 9.5-10.7; T=1 DFlash 6.5, DDTree 9.5 on MATH-500); shipped: its model card (chain 1.93, B=32 2.62).
_TAU = {("hub", 0.0): (6.0, 7.0, 9.5), ("hub", 1.0): (5.0, 6.0, 8.5),
        ("default", 0.0): (1.9, 2.5, 3.2), ("default", 1.0): (1.6, 2.0, 2.6),
        ("random", 0.0): (1.0, 1.0, 1.0), ("random", 1.0): (1.0, 1.0, 1.0)}


def _gib(n: float | int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**30:.1f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.0f} MiB"


# ---------------------------------------------------------------------------------------------------- shapes
def _shape(config: dict[str, Any] | None) -> dict[str, Any]:
    cfg = (config or {}).get("text_config") or (config or {})
    heads = int(cfg.get("num_attention_heads") or 1)
    hidden = int(cfg.get("hidden_size") or 0)
    return {"layers": int(cfg.get("num_hidden_layers") or 0), "kv": int(cfg.get("num_key_value_heads") or heads),
            "head_dim": int(cfg.get("head_dim") or (hidden // heads if hidden else 0)), "hidden": hidden,
            "vocab": int(cfg.get("vocab_size") or 0), "experts": int(cfg.get("num_experts") or 0),
            "experts_per_token": int(cfg.get("num_experts_per_tok") or 0),
            "moe_intermediate": int(cfg.get("moe_intermediate_size") or 0)}


def _builtin_config(name: str) -> dict[str, Any] | None:
    """Shapes of the built-in targets, for estimates: the embedded SmolLM2-135M and the tiny random Llama."""
    if name == "default":
        return {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
    if name == "tiny":
        return {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                "intermediate_size": 64, "vocab_size": 260}
    return None


# ---------------------------------------------------------------------------------------------------- memory
def pair_memory(target_cfg: dict | None, draft_cfg: dict | None, target_params: int | None,
                draft_params: int | None, run_bytes: int, context: int, nodes: int = 0) -> dict[str, int | None]:
    """GPU memory of a pair in the run's dtype: weights, the target's KV cache at ``context`` positions (its
    attention layers only) and the drafter's (its cache holds the committed context per draft layer); for a hybrid
    target, the per-node states a tree of ``nodes`` draft nodes keeps in its linear-attention layers (one
    recurrent state in fp32 and one conv window per node, root included, and layer)."""
    t, d = _shape(target_cfg), _shape(draft_cfg)
    cfg = (target_cfg or {}).get("text_config") or (target_cfg or {})
    linear = list(cfg.get("layer_types") or []).count("linear_attention")
    kv_target = 2 * (t["layers"] - linear) * t["kv"] * t["head_dim"] * run_bytes * context if target_cfg else None
    kv_draft = 2 * d["layers"] * d["kv"] * d["head_dim"] * run_bytes * context if draft_cfg else 0
    node_states = linear * (nodes + 1) * _linear_state_bytes(cfg, run_bytes) if linear else 0
    weights = None if target_params is None else (target_params + (draft_params or 0)) * run_bytes
    total = None if weights is None or kv_target is None else weights + kv_target + kv_draft + node_states
    return {"weights": weights, "kv_target": kv_target, "kv_draft": kv_draft, "node_states": node_states,
            "total": total}


def _linear_state_bytes(cfg: dict, run_bytes: int) -> int:
    """One sequence's state in one Gated DeltaNet layer: the recurrent matrices (fp32) and the conv window."""
    keys, v_heads = int(cfg.get("linear_key_head_dim") or 0), int(cfg.get("linear_num_value_heads") or 0)
    values = int(cfg.get("linear_value_head_dim") or 0)
    channels = 2 * int(cfg.get("linear_num_key_heads") or 0) * keys + v_heads * values
    return 4 * v_heads * keys * values + run_bytes * channels * int(cfg.get("linear_conv_kernel_dim") or 4)


def _context(datasets: list, preset) -> int:
    """Positions of the longest generation: prompt (+ earlier turns' answers) + max_new_tokens + tree + root."""
    longest = 0
    for d in datasets:
        for item in d.items or []:
            turns = len(item.turns)
            chars = sum(len(t) for t in item.turns)
            tokens = int(chars / _CHARS_PER_TOKEN) + _CHAT_OVERHEAD * turns + (turns - 1) * preset.max_new_tokens
            longest = max(longest, tokens)
    tree = max([b for b in preset.budgets if isinstance(b, int) and not isinstance(b, bool)] + [15])
    return longest + preset.max_new_tokens + tree + 1


# ---------------------------------------------------------------------------------------------------- time
def _forward_s(prior: Prior, cfg: dict | None, params: int | None, run_bytes: int, tokens: int) -> float:
    """One target forward over ``tokens`` new tokens (prior)."""
    if not cfg or not params:
        return prior.layer_s * 30
    s = _shape(cfg)
    if s["experts"]:
        expert = 3 * s["hidden"] * s["moe_intermediate"]
        all_experts = s["layers"] * s["experts"] * expert
        dense = params - all_experts
        touched = min(s["experts"], s["experts_per_token"] * tokens)  # experts read per layer by `tokens` tokens
        read = (dense + s["layers"] * touched * expert) * run_bytes
        active = dense + s["layers"] * s["experts_per_token"] * expert
        overhead = prior.moe_layer_s * s["layers"]
    else:
        read, active, overhead = params * run_bytes, params, prior.layer_s * s["layers"]
    return overhead + max(read / prior.bandwidth, 2.0 * active * tokens / prior.flops)


def _tau(kind: str, temperature: float, budget: int | None) -> float:
    chain, low, high = _TAU[(kind, 1.0 if temperature > 0 else 0.0)]
    if budget is None:
        return chain
    x = min(max(math.log2(max(budget, 1) / 16) / math.log2(1024 / 16), 0.0), 1.0)
    return low + (high - low) * x if budget >= 16 else chain + (low - chain) * budget / 16


def _draft_kind(draft: str) -> str:
    return draft if draft in ("default", "random") else "hub"


def seconds_per_token(variant, prior: Prior, target_cfg, target_params, draft_cfg, draft_params, draft: str,
                      run_bytes: int, temperature: float = 0.0) -> float:
    """Prior decoding seconds per token of one method variant."""
    step = _forward_s(prior, target_cfg, target_params, run_bytes, 1)
    if variant.method == "ar":
        return step
    if variant.method == "pld":
        return _forward_s(prior, target_cfg, target_params, run_bytes, 8) / 1.3
    if isinstance(variant.budget, int):
        nodes = variant.budget
    elif variant.method == "dflash":
        nodes = None  # the chain: block - 1 nodes
    else:
        nodes = 256  # auto and user policies: priced like a mid-size tree
    d = _shape(draft_cfg)
    chain_nodes = 15
    verify = _forward_s(prior, target_cfg, target_params, run_bytes, 1 + (chain_nodes if nodes is None else nodes))
    draft_pass = (prior.layer_s * max(d["layers"], 1) + (draft_params or 0) * run_bytes / prior.bandwidth
                  + _shape(target_cfg)["vocab"] * _shape(target_cfg)["hidden"] * run_bytes / prior.bandwidth)
    tree = 1e-3 + prior.tree_s_per_node * (nodes or 0)
    tau = _tau(_draft_kind(draft), temperature, nodes)
    return (verify + draft_pass + tree) / tau


def turn_costs(preset, prior: Prior, target_cfg, target_params, draft_cfg, draft_params, run_bytes: int,
               replayed: int):
    """The prior of what a turn costs besides decoding (:class:`experiments.bench.sizing.TurnCosts`): the check forward
    over a typical prompt and its answer at T = 0, and the replay of ``replayed`` policies (one teacher-forced
    target forward, one batched drafter pass, then per policy ``max_new_tokens / tau`` rounds of a drafter block
    and a tree at the cap)."""
    from experiments.bench.sizing import TurnCosts

    prompt = 200  # tokens: a typical first turn of the offline datasets
    check = _forward_s(prior, target_cfg, target_params, run_bytes, prompt + preset.max_new_tokens)
    if not replayed:
        return TurnCosts(per_check=check)
    rounds = preset.max_new_tokens / 2.0  # tau ~2 for the policies replayed (the chain's and the small budgets')
    block = prior.layer_s * max(_shape(draft_cfg)["layers"], 1) + (draft_params or 0) * run_bytes / prior.bandwidth
    tree = 1e-3 + prior.tree_s_per_node * 128
    return TurnCosts(per_turn=check * 2 + replayed * rounds * (block + tree), per_check=check)


# ---------------------------------------------------------------------------------------------------- checks
def _disk_refusal(download: int, earlier: int, cache: Path) -> str | None:
    """Why a pair's ``download`` bytes cannot fit after the earlier pairs' ``earlier`` bytes (which stay in the
    cache), None when they fit. The first download is checked by ``experiments.bench.models.check_weights`` itself."""
    if not download or not earlier:
        return None
    from experiments.bench.models import _free_bytes

    left = _free_bytes(cache) - earlier
    if download <= left:
        return None
    return (f"needs ~{_gib(download)} of downloads, but after the earlier pairs' ~{_gib(earlier)} only "
            f"{_gib(max(left, 0))} would be free under {cache}")


def _gpu_fit(pair, memory: dict[str, int | None], devices: dict[str, Any]) -> dict[str, Any] | None:
    """The GPUs rank 0 would hold the pair on and their memory (None without GPUs or a memory estimate)."""
    if not devices["gpus"] or not memory["total"]:
        return None
    from dflash_core.default import rank_gpus

    share = rank_gpus(0, devices["world"], len(devices["gpus"]))
    if pair.device_map != "auto":
        share = [share[0]]
    return {"gpus": share, "memory": sum(devices["gpus"][g]["memory"] for g in share)}
