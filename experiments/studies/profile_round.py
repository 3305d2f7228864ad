"""Where a speculative round's time goes: ``python -m experiments.studies.profile_round``.

For the embedded default pair (or ``--pair tiny``, a random tiny pair for smoke runs), greedy, on a few prompts of the
fixed drafter protocol, interleaved per prompt: plain decoding, DFlash (chain) and DDTree at the given budgets. Per
method: tau, milliseconds per round split into draft (drafter layers + its LM head), tree, verify and commit
(follow + cache compaction), tokens/s, speedup over plain decoding, and the speed-of-light ratio

    measured speedup / (tau * t_plain / (t_draft + t_verify(N)))

with t_plain the plain step, t_draft the drafter pass and t_verify(N) the measured forward over the round's mean tree
size: 1.0 means the loop adds nothing beyond the two forwards; below it, bookkeeping eats the gain. Also times the
drafter's layers and its LM head separately, the verify cost curve, and Hugging Face ``generate()`` on the same prompts
(our plain decoding must not be slower). ``--kernels torch,packed`` runs everything with both CPU linear kernels
(:mod:`dflash_core.cpu_kernels`), interleaved per prompt, and compares them. The method ``auto`` (``budget="auto"``)
also reports how far its online cost curve moved from the measured one over the run (relative error of the round
seconds per tree size, :func:`ddtree.cost.curve_error`). Prints a table; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import time

import torch

from ddtree import ddtree_generate
from ddtree.budget import AutoBudget
from ddtree.cost import curve_error, measure_cost_model
from dflash_core import autoregressive_generate
from dflash_core.cpu_kernels import KERNEL_CHOICES, pack_linear_layers, set_packed_enabled
from dflash_core.decoding import LiveModels
from dflash_core.target import TargetAdapter
from dflash_core.timing import cpu_model, median_seconds
from experiments.bench.models import resolve_dtype
from experiments.bench.schema import write_json_atomic
from experiments.studies.cpu_peers import make_generator


def _load(pair: str, dtype_name: str, device: torch.device, draft_dir: str | None = None):
    from dflash_core.default import load_default_pair, stop_token_ids

    if pair == "tiny":
        from experiments.bench.models import random_draft, tiny_target

        target = tiny_target().to(device)
        draft = random_draft(target, layers=1, taps=2, block_size=8)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, target.config.vocab_size, (24,), generator=g).tolist() for _ in range(2)]
        return target, draft, prompts, []
    target, draft, tokenizer = load_default_pair(resolve_dtype(dtype_name, device), device)
    if draft_dir is not None:  # another drafter for the embedded target (e.g. one with a Markov head)
        from dflash_core import load_draft

        draft = load_draft(draft_dir, device=device, dtype=next(draft.parameters()).dtype)
    from experiments.studies.drafter_eval import protocol_prompts

    prompts = [ids for _, _, _, ids in protocol_prompts(tokenizer)]
    return target, draft, prompts, stop_token_ids(tokenizer)


@torch.inference_mode()
def draft_split_ms(target, draft, context: int = 200, repeats: int = 7) -> dict:
    """Median ms of one steady-state drafter pass: its layers (4 new context tokens + a block) and its LM head."""
    adapter = TargetAdapter(target, draft.config.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, adapter.vocab_size, (1, context + 4), generator=g)
    models, _ = LiveModels.prefilled(adapter, draft, [ids])
    feats = models.unread[0][0]  # [context + 4, taps * hidden]
    models.unread[0], models.lengths = [feats[:context]], [context]
    models.draft_states([0], [0])  # the context enters the draft cache

    def layers():  # the loop's draft step without the head: 4 newly committed tokens join the context
        models.unread[0], models.lengths = [feats[context:]], [context + 4]
        out = models.draft_states([0], [int(ids[0, -1])])[0]
        models.draft_caches[0].crop(context)
        return out

    hidden = layers()
    layers_s = median_seconds(layers, repeats, adapter.device)
    head_s = median_seconds(lambda: adapter.lm_head(hidden[1:], draft), repeats, adapter.device)
    return {"layers_ms": 1000 * layers_s, "head_ms": 1000 * head_s,
            "draft_vocab": getattr(draft.config, "draft_vocab_size", None)}


def hf_generate_tps(target, prompts, max_new_tokens: int, stops) -> float:
    """Tokens/s of Hugging Face greedy ``generate()`` over the prompts (batch 1 each; cpu_peers' runner)."""
    run, timed = make_generator("hf_greedy", target, stops), []
    for ids in prompts:
        x = torch.tensor([ids], device=target.device)
        t0 = time.perf_counter()
        timed.append((len(run(x, max_new_tokens)[0]), time.perf_counter() - t0))
    return sum(n for n, _ in timed) / sum(s for _, s in timed)


def _summarize(acc: dict, cost, t_plain: float, ar_tps: float | None) -> dict:
    rows = {}
    for m, e in acc.items():
        rounds = max(1, e["rounds"])
        tau = e["tokens"] / rounds
        tps = e["tokens"] / max(e["decode"], 1e-9)
        mean_nodes = e["nodes"] / rounds
        t_draft = e["draft"] / rounds
        ideal = tau * t_plain / (t_draft + float(cost.verify(mean_nodes))) if m != "ar" else 1.0
        speedup = tps / ar_tps if ar_tps else None
        rows[str(m)] = {"tau": tau, "ms_per_round": 1000 * e["decode"] / rounds,
                        **{f"{s}_ms": 1000 * e[s] / rounds for s in ("draft", "tree", "verify", "commit")},
                        "mean_nodes": mean_nodes, "tokens_per_s": tps, "speedup": speedup,
                        "speed_of_light": None if speedup is None else speedup / ideal}
    return rows


def _print_rows(rows: dict) -> None:
    print(f"{'method':>8} {'tau':>5} {'ms/round':>9} {'draft':>7} {'tree':>6} {'verify':>7} {'commit':>7} "
          f"{'nodes':>6} {'tok/s':>7} {'speedup':>8} {'SoL':>5}")
    for m, r in rows.items():
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        sol = f"{r['speed_of_light']:.2f}" if r["speed_of_light"] is not None else "-"
        print(f"{m:>8} {r['tau']:5.2f} {r['ms_per_round']:9.1f} {r['draft_ms']:7.1f} {r['tree_ms']:6.1f} "
              f"{r['verify_ms']:7.1f} {r['commit_ms']:7.1f} {r['mean_nodes']:6.1f} {r['tokens_per_s']:7.1f} {sp:>8} "
              f"{sol:>5}")


STAGES = ("draft", "tree", "verify", "commit")


def _run_all(target, draft, prompts, stops, methods, kernels, max_new_tokens: int) -> tuple[dict, dict]:
    """Every method on every prompt with every kernel choice, interleaved per prompt: ({kernel: {method: totals}},
    {kernel: the last ``auto`` policy})."""

    def run(method, ids, n):
        x = torch.tensor([ids])
        if method == "ar":
            return autoregressive_generate(target, x, n, stop_token_ids=stops), None
        if method != "auto":
            return ddtree_generate(target, draft, x, budget=method, max_new_tokens=n, stop_token_ids=stops), None
        policy = AutoBudget.for_models(target, draft, context=len(ids))  # kept, to read its online cost curve
        return ddtree_generate(target, draft, x, policy=policy, max_new_tokens=n, stop_token_ids=stops), policy

    for k in kernels:
        set_packed_enabled(k == "packed", target, draft)
        for m in methods:  # warm-up: every code path and shape once (``auto`` measures its cost curve here)
            run(m, prompts[0], 8)
    acc = {k: {m: {"tokens": 0, "rounds": 0, "nodes": 0, "decode": 0.0, **{s: 0.0 for s in STAGES}} for m in methods}
           for k in kernels}
    auto = {}
    for ids in prompts:
        for k in kernels:
            set_packed_enabled(k == "packed", target, draft)
            for m in methods:
                res, policy = run(m, ids, max_new_tokens)
                e = acc[k][m]
                e["tokens"] += sum(res.acceptance_lengths)
                e["rounds"] += len(res.acceptance_lengths)
                e["nodes"] += sum(res.tree_sizes)
                e["decode"] += res.timings.get("decode", 0.0)
                for stage in STAGES:
                    e[stage] += res.timings.get(stage, 0.0)
                if policy is not None:
                    auto[k] = policy
    return acc, auto


def _print_kernel(r: dict) -> None:
    _print_rows(r["methods"])
    split = r["draft_split"]
    print(f"drafter pass: layers {split['layers_ms']:.1f} ms + LM head {split['head_ms']:.1f} ms "
          f"(draft vocabulary: {split['draft_vocab'] or 'full'})")
    print("verify cost (ms) by draft nodes: " + ", ".join(f"{n}: {v:.1f}" for n, v in r["verify_curve_ms"].items()))
    if r.get("auto_online_curve_error"):
        print("auto: online cost curve vs measured (round seconds, relative, by draft nodes): "
              + ", ".join(f"{n}: {e:+.0%}" for n, e in r["auto_online_curve_error"].items()))


def main(argv=None) -> None:
    kernel_choices = tuple(k for k in KERNEL_CHOICES if k != "auto")  # compared side by side: no "auto"
    p = argparse.ArgumentParser(prog="python -m experiments.studies.profile_round",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", choices=["default", "tiny"], default="default")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument("--device", default="auto", help="auto (CUDA when available, else the CPU), cuda, cuda:1, cpu")
    p.add_argument("--methods", default="ar,chain,4,8,16,32", help="ar, chain, auto and node budgets, comma-separated")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--draft", default=None, help="a drafter folder for the default pair (default: the shipped one)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kernels", default="torch",
                   help=f"CPU linear kernels to compare, interleaved per prompt: comma-separated of {kernel_choices} "
                        "(see dflash_core.cpu_kernels)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    kernels = a.kernels.split(",")
    if not kernels or any(k not in kernel_choices for k in kernels) or len(set(kernels)) != len(kernels):
        p.error(f"--kernels must be distinct entries of {kernel_choices}, got {a.kernels!r}")
    if a.threads:
        torch.set_num_threads(a.threads)
    from dflash_core.default import resolve_device

    target, draft, prompts, stops = _load(a.pair, a.dtype, resolve_device(a.device), a.draft)
    prompts = prompts[: a.prompts]
    methods = [m if m in ("ar", "chain", "auto") else int(m) for m in a.methods.split(",")]
    if "packed" in kernels:
        if not (pack_linear_layers(target) + pack_linear_layers(draft)):
            p.error("--kernels packed: this torch build has no oneDNN packed linear")
    acc, auto = _run_all(target, draft, prompts, stops, methods, kernels, a.max_new_tokens)
    by_kernel = {}
    for k in kernels:
        set_packed_enabled(k == "packed", target, draft)
        cost = measure_cost_model(target, draft, grid=(0, 1, 2, 4, 8, 16, 32, 64), context=200, use_cache=False)
        split = draft_split_ms(target, draft)
        plain = acc[k].get("ar")
        t_plain = plain["decode"] / max(1, plain["rounds"]) if plain else float(cost.verify(0))
        ar_tps = plain["tokens"] / plain["decode"] if plain else None
        by_kernel[k] = {"methods": _summarize(acc[k], cost, t_plain, ar_tps), "draft_split": split,
                        "verify_curve_ms": {str(n): 1000 * v for n, v in zip(cost.nodes, cost.verify_s)},
                        "ar_tokens_per_s": ar_tps}
        if k in auto:
            by_kernel[k]["auto_online_curve_error"] = {
                str(n): e for n, e in curve_error(auto[k].online_cost, auto[k].cost).items()}
    set_packed_enabled(True, target, draft)
    hf_tps = hf_generate_tps(target, prompts, a.max_new_tokens, stops) if kernels == ["torch"] else None
    first = by_kernel[kernels[0]]
    result = {"cpu": cpu_model(), "device": str(target.device), "dtype": str(target.dtype), "threads": torch.get_num_threads(), "pair": a.pair,
              "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "kernels": kernels, **first,
              "hf_generate_tokens_per_s": hf_tps, "by_kernel": by_kernel}
    _report(result, kernels, by_kernel, first, hf_tps)
    if a.out:
        write_json_atomic(a.out, result)


def _report(result: dict, kernels: list[str], by_kernel: dict, first: dict, hf_tps: float | None) -> None:
    print(f"round profile: {result['cpu']}, {result['dtype']}, {result['threads']} threads, {result['prompts']} "
          f"prompts x {result['max_new_tokens']} tokens, greedy")
    for k in kernels:
        if len(kernels) > 1:
            print(f"\nkernels: {k}")
        _print_kernel(by_kernel[k])
    if len(kernels) > 1 and all(by_kernel[k]["ar_tokens_per_s"] for k in kernels):
        base = by_kernel[kernels[0]]
        for k in kernels[1:]:
            rel = {m: by_kernel[k]["methods"][m]["tokens_per_s"] / base["methods"][m]["tokens_per_s"]
                   for m in base["methods"]}
            by_kernel[k]["vs_" + kernels[0]] = rel
            print(f"\n{k} vs {kernels[0]} (tokens/s ratio, same prompts, interleaved): "
                  + ", ".join(f"{m} {v:.2f}x" for m, v in rel.items()))
    if hf_tps and first["ar_tokens_per_s"]:
        print(f"plain decoding {first['ar_tokens_per_s']:.1f} tok/s vs Hugging Face generate() {hf_tps:.1f} tok/s "
              f"({first['ar_tokens_per_s'] / hf_tps:.2f}x)")


if __name__ == "__main__":
    main()
