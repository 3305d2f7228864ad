"""GPU check: does tree verification hold up on CUDA at real model sizes, and what does it cost there?

    python -m experiments.studies.gpu_check --out experiments/profiles/h200.json          # CUDA, bf16, at most ~8 min
    python -m experiments.studies.gpu_check --device cpu --tiny --out /tmp/profile.json  # the code path on a tiny model

Run it from the repository root with the GPU image's own python: nothing needs installing when that python has
torch (2.5 or newer, CUDA build), transformers (5.17 or newer, < 6) and numpy; the repository's packages are imported
from the working tree. A GPU image without network that lacks transformers must be given these wheels (pure Python
unless noted): transformers, huggingface-hub, tokenizers (binary), safetensors (binary), regex (binary), pyyaml
(binary), tqdm, packaging, typer and their own small dependencies -- see ``experiments/profiles/README.md``.

No downloads: the target is a random-weight model built from the Qwen3-8B configuration (numbers below; Qwen3-4B with
``--models qwen3-4b,qwen3-8b``), with a random DFlash drafter of the published shape (5 layers, 5 tapped target
layers, block 16). Random weights are enough for what is measured here, because cost depends only on shapes and the
checks compare the target with itself:

1. tree-attention oracle: the target's logits at every node of a best-first tree, verified in ONE forward under the
   ancestor mask, against a plain causal forward over that node's root path on the same cache (max |diff|, argmax
   agreement);
2. greedy losslessness: ``ddtree_generate`` (chain, and fixed budgets) against ``autoregressive_generate`` on random
   prompts, exact token match (bf16 is not bit-exact across different token counts per forward, so a mismatch in
   bf16 is reported, and the same check in fp32 tells a numeric tie from a bug);
3. verify cost curve: one target forward appending N tokens (a root plus N-1 tree nodes under the tree mask, and the
   same N tokens causally) to a cache of 512 and of 4096 tokens, N = 1, 2, 4, ..., 1024; CUDA events, median of
   several runs;
4. drafter cost: one drafter pass (block of 16 on top of a 512-token context cache), the LM head over its 15 rows,
   and building the tree from those logits at several budgets;
5. round cost: ``ddtree.cost.measure_cost_model`` at both context lengths, i.e. what ``budget="auto"`` measures
   (the N-dependent part of a round: mask, forward, walk, compaction; the fixed part: drafter pass, LM head, tree
   at the cap of 1024).

The profile (JSON) carries the round costs per model as ``cost_models`` (one per context length, in the form
``ddtree.cost.CostModel`` reads), so ``budget="auto"`` can use the measured GPU curve without measuring:
``AutoBudget.for_models(target, draft, profile="experiments/profiles/h200.json", context=prompt_len)`` or
``CostModel.from_profile(path, context=...)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ddtree.cost import measure_cost_model
from dflash_core.tree import BlockPolicy
from dflash_core.tree import DraftTree
from dflash_core.timing import median_seconds

__all__ = ["QWEN3_4B", "QWEN3_8B", "TINY", "MODELS", "CheckConfig", "run_checks", "main"]

# Published Qwen3 shapes (config.json of Qwen/Qwen3-4B and Qwen/Qwen3-8B); weights are random.
QWEN3_4B = dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=9728, vocab_size=151936, rope_theta=1_000_000.0)
QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=12288, vocab_size=151936, rope_theta=1_000_000.0)
TINY = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512, rope_theta=1_000_000.0)
MODELS = {"qwen3-4b": QWEN3_4B, "qwen3-8b": QWEN3_8B}


@dataclass(frozen=True)
class CheckConfig:
    models: tuple[tuple[str, dict], ...] = (("qwen3-8b", QWEN3_8B),)
    dtype: torch.dtype = torch.bfloat16
    fp32_lossless_model: str | None = "qwen3-8b"  # also run the losslessness check in fp32 on this model
    context: int = 512  # oracle, drafter cost
    contexts: tuple[int, ...] = (512, 4096)  # verify cost curves and round costs (the 1-6K-token contexts of a run)
    nodes: tuple[int, ...] = tuple(2 ** k for k in range(11))  # 1 .. 1024 appended tokens
    repeats: int = 7
    warmups: int = 2
    oracle_budget: int = 128  # tree nodes in the oracle check (every node is compared)
    lossless_prompts: int = 3
    lossless_prompt_len: int = 128
    lossless_tokens: int = 64
    lossless_budgets: tuple[int | str, ...] = ("chain", 32, 256)
    draft_layers: int = 5
    draft_taps: int = 5
    block_size: int = 16
    tree_budgets: tuple[int, ...] = (16, 64, 256, 1024)
    time_limit_s: float = 450.0  # skip what is left after this (the whole check must fit 8 minutes)


TINY_CHECK = CheckConfig(models=(("tiny", TINY),), dtype=torch.float32, fp32_lossless_model="tiny", context=64,
                         contexts=(64, 128),
                         nodes=(1, 2, 4, 8, 16, 32, 64), repeats=3, warmups=1, oracle_budget=24, lossless_prompts=2,
                         lossless_prompt_len=16, lossless_tokens=12, lossless_budgets=("chain", 8),
                         draft_layers=1, draft_taps=2, block_size=8, tree_budgets=(8, 32), time_limit_s=120.0)


def log(message: str) -> None:
    print(f"[gpu_check] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- models
def build_target(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A random Qwen3 causal LM with the given shape, created directly on ``device``."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**shape, max_position_embeddings=40960, tie_word_embeddings=False, use_sliding_window=False,
                         initializer_range=0.02)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def build_draft(target, config: CheckConfig):
    from experiments.bench.models import random_draft

    return random_draft(target, layers=config.draft_layers, taps=config.draft_taps, block_size=config.block_size)


# ---------------------------------------------------------------------------------------------------- timing
def median_ms(fn: Callable[[], Any], device: torch.device, config: CheckConfig) -> float:
    """Median milliseconds of ``fn`` over the check's repeats after its warm-ups (:func:`median_seconds`)."""
    return 1000.0 * median_seconds(fn, config.repeats, device, warmup=config.warmups)


def _random_logits(rows: int, vocab: int, seed: int, scale: float = 4.0) -> torch.Tensor:
    """Peaked random draft logits (a few plausible tokens per row), so trees reach several depths."""
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------------------------------------------- checks
@torch.inference_mode()
def oracle_check(target, layer_ids, config: CheckConfig, device: torch.device) -> dict[str, Any]:
    """Tree logits from one forward vs a causal forward over each node's root path, on the same cache."""
    from ddtree import build_tree
    from dflash_core.decoding import LiveModels
    from dflash_core.target import TargetAdapter

    adapter = TargetAdapter(target, layer_ids)
    vocab, ctx = adapter.vocab_size, config.context
    gen = torch.Generator().manual_seed(1)
    models, _ = LiveModels.prefilled(adapter, None, [torch.randint(0, vocab, (1, ctx), generator=gen)], False)
    cache = models.cache
    tree = build_tree(_random_logits(config.block_size - 1, vocab, 2), config.oracle_budget)
    root = int(torch.randint(0, vocab, (1,), generator=gen))
    tree_logits = models.verify([0], [tree], [root])[0].cpu()  # the loop's verify step
    models.rewind([ctx])
    parents = tree.parents.tolist()
    max_diff, diffs, agree = 0.0, [], 0
    for node in range(-1, len(tree)):  # -1 = the root itself
        path, cur = [], node
        while cur >= 0:
            path.append(cur)
            cur = parents[cur]
        seq = torch.tensor([root] + [int(tree.token_ids[i]) for i in reversed(path)])
        ref = adapter.forward(seq[None], ctx + torch.arange(len(seq))[None], cache, with_features=False).logits[-1].cpu()
        adapter.crop(cache, ctx)
        got = tree_logits[node + 1]
        diff = float((got - ref).abs().max())
        max_diff = max(max_diff, diff)
        diffs.append(diff)
        agree += int(got.argmax() == ref.argmax())
    return {"nodes": len(tree), "max_depth": int(tree.depths.max()) if len(tree) else 0, "context": ctx,
            "positions_checked": len(diffs), "max_abs_diff": max_diff, "median_abs_diff": statistics.median(diffs),
            "argmax_agreement": agree / len(diffs), "logit_scale": float(tree_logits.std())}


class OraclePolicy(BlockPolicy):
    """A tree that holds the target's true greedy continuation on a NON-first branch, so rounds really accept tokens.

    ``reference`` is plain decoding's output for the prompt. Each round, at every depth, ``width - 1`` decoy tokens
    come first and the spine node last; the spine carries the reference's next tokens down to a depth that cycles
    from round to round (then a wrong token), so acceptance lengths vary and the accepted nodes are never a prefix of
    the node list: the target cache is compacted to a scattered path, features of several accepted tokens are
    gathered, and the drafter (``uses_draft``) keeps its cache over rounds. Its logits are not read. Whatever the
    tree, the loop verifies it, so the output must still equal ``reference``; a mismatch is a bug (or, in bf16, a
    near-tie of the target).
    """

    name, uses_draft = "oracle", True

    def __init__(self, reference: list[int], prompt_len: int, budget: int | str, max_depth: int, vocab: int):
        self.reference, self.prompt_len, self.vocab, self.rounds = list(reference), prompt_len, vocab, 0
        if budget == "chain":
            self.depth, self.width = max_depth, 1
        else:
            self.depth = max(1, min(max_depth, int(budget) // 2))
            self.width = max(1, int(budget) // self.depth)

    def _true(self, k: int) -> int:
        return self.reference[k] if k < len(self.reference) else 0

    def propose(self, block, history: list[int]) -> DraftTree:
        done = len(history) - self.prompt_len  # tokens committed so far (the root included)
        reach = 1 + (self.rounds * 5) % self.depth  # the spine follows the reference down to this depth
        self.rounds += 1
        tokens, parents, depths, spine = [], [], [], -1
        for d in range(1, self.depth + 1):
            true = self._true(done + d - 1)
            head = true if d <= reach else (true + 1) % self.vocab
            decoys = [t for t in range(true + 2, true + 2 + self.width + 1) if t % self.vocab not in (true, head)]
            for t in decoys[: self.width - 1]:
                tokens.append(t % self.vocab), parents.append(spine), depths.append(d)
            tokens.append(head), parents.append(spine), depths.append(d)
            spine = len(tokens) - 1
        n = len(tokens)
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths),
                         -0.01 * torch.arange(1, n + 1, dtype=torch.float64))


def _first_difference(ref: list[int], got: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None if len(ref) == len(got) else
                min(len(ref), len(got)))


@torch.inference_mode()
def top2_margin(target, prompt: torch.Tensor, ref: list[int], k: int) -> float:
    """Plain decoding's top-2 logit margin at new token ``k``: small means a near-tie (bf16 may round it over)."""
    ids = torch.cat([prompt[0], torch.tensor(ref[:k], dtype=torch.long, device=prompt.device)])[None]
    top = target(ids).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


@torch.inference_mode()
def exactness_check(target, draft, config: CheckConfig, oracle: bool = True) -> dict[str, Any]:
    """Greedy DDTree / DFlash outputs vs plain decoding on random prompts (exact token match), with the drafter's
    own trees and (``oracle``) with :class:`OraclePolicy` trees that really accept tokens."""
    from ddtree import ddtree_generate
    from dflash_core import autoregressive_generate

    device = target.lm_head.weight.device
    vocab = int(target.lm_head.weight.shape[0])
    runs = []
    for p in range(config.lossless_prompts):
        gen = torch.Generator().manual_seed(p)
        prompt = torch.randint(0, vocab, (1, config.lossless_prompt_len), generator=gen).to(device)
        ref = autoregressive_generate(target, prompt, max_new_tokens=config.lossless_tokens).new_token_ids
        for budget in config.lossless_budgets:
            kinds = ("drafter", "oracle") if oracle else ("drafter",)
            for kind in kinds:
                if kind == "oracle":
                    policy = OraclePolicy(ref, prompt.shape[1], budget, draft.block_size - 1, vocab)
                    res = ddtree_generate(target, draft, prompt, policy=policy, max_new_tokens=config.lossless_tokens,
                                          check_trees=True)
                else:
                    res = ddtree_generate(target, draft, prompt, budget=budget, max_new_tokens=config.lossless_tokens)
                first = _first_difference(ref, res.new_token_ids)
                run = {"prompt": p, "budget": budget, "policy": kind, "match": first is None, "first_mismatch": first,
                       "tau": round(res.tau, 3), "mean_nodes": round(sum(res.tree_sizes) / max(1, len(res.tree_sizes)),
                                                                     1), "tokens": len(res.new_token_ids)}
                if first is not None and first < len(ref):
                    run["plain_top2_margin"] = top2_margin(target, prompt, ref, first)
                runs.append(run)
    matched = sum(r["match"] for r in runs)
    accepted = [r["tau"] for r in runs if r["policy"] == "oracle"]
    return {"dtype": str(next(target.parameters()).dtype).removeprefix("torch."), "prompts": config.lossless_prompts,
            "max_new_tokens": config.lossless_tokens, "exact_match": matched, "runs_total": len(runs),
            "oracle_mean_tau": round(sum(accepted) / len(accepted), 3) if accepted else None, "runs": runs}


def lossless_check(target, draft, config: CheckConfig) -> dict[str, Any]:
    """:func:`exactness_check` with the drafter's trees and the oracle's (kept under its old name for profiles)."""
    return exactness_check(target, draft, config)


@torch.inference_mode()
def verify_curve(target, layer_ids, config: CheckConfig, device: torch.device,
                 context: int | None = None) -> dict[str, Any]:
    """Median ms of one target forward appending N tokens (tree mask and causal) to a ``context``-token cache."""
    from ddtree import build_tree
    from dflash_core.decoding import LiveModels
    from dflash_core.target import TargetAdapter

    adapter = TargetAdapter(target, layer_ids)
    vocab, ctx = adapter.vocab_size, context or config.context
    gen = torch.Generator().manual_seed(3)
    models, _ = LiveModels.prefilled(adapter, None, [torch.randint(0, vocab, (1, ctx), generator=gen)])
    tree_ms, causal_ms, depths = [], [], []
    for n in config.nodes:
        tree = build_tree(_random_logits(config.block_size - 1, vocab, n), n - 1)
        ids = torch.randint(0, vocab, (1, n), generator=gen)

        def tree_forward():  # the loop's verify step: root + the tree's nodes under their ancestor mask
            models.verify([0], [tree], [0])
            models.rewind([ctx])

        def causal_forward():
            adapter.forward(ids, ctx + torch.arange(n)[None], models.cache)
            models.rewind([ctx])

        tree_ms.append(median_ms(tree_forward, device, config))
        causal_ms.append(median_ms(causal_forward, device, config))
        depths.append(int(tree.depths.max()) if len(tree) else 0)
    return {"context": ctx, "appended_tokens": list(config.nodes), "tree_depth": depths,
            "tree_median_ms": tree_ms, "causal_median_ms": causal_ms, "repeats": config.repeats,
            "with_features": True}


@torch.inference_mode()
def draft_cost(target, draft, config: CheckConfig, device: torch.device) -> dict[str, Any]:
    """Median ms of the drafter's block pass on a ``context``-token draft cache, the LM head, and tree building."""
    from ddtree import build_tree
    from dflash_core.decoding import LiveModels
    from dflash_core.target import TargetAdapter

    adapter = TargetAdapter(target, draft.config.target_layer_ids)
    vocab, ctx, b = adapter.vocab_size, config.context, draft.block_size
    gen = torch.Generator().manual_seed(4)
    models, _ = LiveModels.prefilled(adapter, draft, [torch.randint(0, vocab, (1, ctx + 4), generator=gen)])
    features = models.unread[0][0]  # [ctx + 4, taps * hidden]
    root = int(torch.randint(0, vocab, (1,), generator=gen))

    def first_pass():  # the whole prompt's context enters the draft cache
        models.draft_caches[0].crop(0)
        models.unread[0], models.lengths = [features[:ctx]], [ctx]
        models.draft_states([0], [root])

    prefill_ms = median_ms(first_pass, device, config)
    first_pass()

    def steady_pass():  # a typical round (the loop's draft step): a few newly committed tokens join the context
        models.unread[0], models.lengths = [features[ctx:]], [ctx + 4]
        out = models.draft_states([0], [root])[0]
        models.draft_caches[0].crop(ctx)
        return out

    pass_ms = median_ms(steady_pass, device, config)
    hidden = steady_pass()[None]
    head_ms = median_ms(lambda: adapter.lm_head(hidden[0, 1:], draft), device, config)
    logits = adapter.lm_head(hidden[0, 1:], draft)  # [b-1, V] on the device, as in the decode loop
    build_ms = {str(budget): median_ms(lambda budget=budget: build_tree(logits, budget), device, config)
                for budget in config.tree_budgets}
    return {"block_size": b, "layers": draft.config.num_hidden_layers,
            "target_layer_ids": list(draft.config.target_layer_ids),
            "params": sum(p.numel() for p in draft.parameters()), "context": ctx,
            "context_prefill_ms": prefill_ms, "pass_ms": pass_ms, "lm_head_ms": head_ms, "build_tree_ms": build_ms}


def round_costs(target, draft, config: CheckConfig) -> dict[str, Any]:
    """``ddtree.cost.measure_cost_model`` at every context length: the curves ``budget="auto"`` reads."""
    grid = tuple(n - 1 for n in config.nodes)  # tree nodes (the root is the extra token)
    curves = [measure_cost_model(target, draft, grid=grid, context=ctx, repeats=config.repeats, use_cache=False,
                                 cap=max(grid)).to_json() for ctx in config.contexts]
    return {"cost_models": curves}


# ---------------------------------------------------------------------------------------------------- the run
def _model_checks(results: dict[str, Any], name: str, shape: dict, config: CheckConfig, device: torch.device,
                  step) -> None:
    """Every check of one model, into ``results``; the model builds are steps too (a failed build costs only what
    needs it)."""
    models: dict[str, Any] = {}

    def build(dtype: torch.dtype) -> dict[str, Any]:
        models.clear()  # the previous dtype's pair first: one pair in memory at a time
        if device.type == "cuda":
            torch.cuda.empty_cache()
        models["target"] = build_target(shape, dtype, device)
        models["draft"] = build_draft(models["target"], config)
        return {"dtype": str(dtype).removeprefix("torch."),
                "target_params": sum(p.numel() for p in models["target"].parameters())}

    log(f"{name}: building a random target and drafter ({config.dtype})")
    step(results, "build", lambda: build(config.dtype))
    if models:
        target, draft = models["target"], models["draft"]
        layer_ids = draft.config.target_layer_ids
        results["target_params"] = results["build"].get("target_params")
        step(results, "oracle", lambda: oracle_check(target, layer_ids, config, device))
        step(results, "lossless", lambda: lossless_check(target, draft, config))
        for i, ctx in enumerate(config.contexts):
            step(results, "verify_cost" if i == 0 else f"verify_cost_{ctx}",
                 lambda ctx=ctx: verify_curve(target, layer_ids, config, device, ctx))
        step(results, "draft_cost", lambda: draft_cost(target, draft, config, device))
        step(results, "round_cost", lambda: round_costs(target, draft, config))
        if results["round_cost"].get("cost_models"):
            results["cost_models"] = results["round_cost"]["cost_models"]
            results["cost_model"] = results["cost_models"][0]
        del target, draft
    if config.fp32_lossless_model == name:
        log(f"{name}: losslessness again in fp32 (tells numeric near-ties in bf16 from real bugs)")
        step(results, "build_fp32", lambda: build(torch.float32))
        if models:
            step(results, "lossless_fp32", lambda: lossless_check(models["target"], models["draft"], config))
    models.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_checks(config: CheckConfig, device: torch.device,
               save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every check for every model; steps that would start after ``time_limit_s`` are reported as skipped.
    ``save(profile)`` is called after every step with the profile so far (the CLI writes it: a run cut short
    keeps what it measured)."""
    t_start = time.perf_counter()
    profile: dict[str, Any] = {"models": {}}

    def step(results: dict, name: str, fn: Callable[[], Any]) -> None:
        if time.perf_counter() - t_start > config.time_limit_s:
            results[name] = {"skipped": f"time limit of {config.time_limit_s:.0f} s reached"}
            log(f"  {name}: skipped (time limit)")
            return
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as err:  # one failed step must not cost the others (a GPU run is a scarce, single shot)
            results[name] = {"error": f"{type(err).__name__}: {err}"}
            log(f"  {name}: FAILED: {type(err).__name__}: {err}")
        results[name]["seconds"] = round(time.perf_counter() - t0, 2)
        log(f"  {name}: {time.perf_counter() - t0:.1f} s")
        if save is not None:
            save({**profile, "wall_s": round(time.perf_counter() - t_start, 1)})

    for name, shape in config.models:
        profile["models"][name] = {"config": shape}
        _model_checks(profile["models"][name], name, shape, config, device, step)
    profile["wall_s"] = round(time.perf_counter() - t_start, 1)
    return profile


def environment(device: torch.device, config: CheckConfig) -> dict[str, Any]:
    from experiments.bench.ranks import device_name
    from experiments.bench.schema import git_commit, package_versions

    return {"schema": "ddtree-gpu-profile/1", "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "device": device_name(device), "torch_cuda": torch.version.cuda, "git_commit": git_commit(),
            "package_versions": package_versions(("torch", "transformers", "numpy")),
            "dtype": str(config.dtype).removeprefix("torch."), "attention_backend": "sdpa",
            "settings": {k: v for k, v in dataclasses.asdict(config).items() if k not in ("models", "dtype")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.studies.gpu_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="profile JSON to write, e.g. experiments/profiles/h200.json")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of the Qwen3 shapes")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available, else the CPU), cuda, cuda:1, cpu")
    parser.add_argument("--models", default=None,
                        help="comma-separated subset of qwen3-4b,qwen3-8b (default: qwen3-8b)")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds before remaining steps are skipped")
    args = parser.parse_args(argv)

    from dflash_core.default import resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as err:
        raise SystemExit(f"gpu_check: {err}; --device cpu --tiny is the dry run") from err
    if device.type == "cpu" and not args.tiny:
        print("gpu_check: no CUDA device here (or --device cpu). This check measures tree verification on a GPU and "
              "would take hours on a CPU at Qwen3 sizes. Run it on a CUDA machine, or add `--tiny` to exercise the "
              "code path on a tiny model.", file=sys.stderr)
        return 2
    config = TINY_CHECK if args.tiny else CheckConfig()
    if args.tiny and device.type == "cuda":
        config = dataclasses.replace(config, dtype=torch.bfloat16)
    if args.models and not args.tiny:
        wanted = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in wanted if m not in MODELS]
        if unknown:
            print(f"gpu_check: unknown model(s) {unknown}; known: {', '.join(MODELS)}", file=sys.stderr)
            return 2
        config = dataclasses.replace(config, models=tuple((m, MODELS[m]) for m in wanted),
                                     fp32_lossless_model=config.fp32_lossless_model if config.fp32_lossless_model
                                     in wanted else wanted[0])
    if args.time_limit is not None:
        config = dataclasses.replace(config, time_limit_s=args.time_limit)

    from experiments.bench.schema import write_json_atomic

    env = environment(device, config)
    profile = {**env, **run_checks(config, device, save=lambda so_far: write_json_atomic(Path(args.out),
                                                                                          {**env, **so_far}))}
    write_json_atomic(Path(args.out), profile)
    for name, res in profile["models"].items():
        oracle, lossless = res.get("oracle", {}), res.get("lossless", {})
        log(f"{name}: oracle max|diff| {oracle.get('max_abs_diff')}, "
            f"argmax agreement {oracle.get('argmax_agreement')}; lossless {lossless.get('exact_match')}/{lossless.get('runs_total')} exact")
    log(f"profile written to {args.out} ({profile['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
