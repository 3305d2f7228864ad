"""How should ``budget="auto"`` choose, and how do its choices move with the machine's cost curve?

Replays speculative decoding offline (:mod:`dflash_core.replay`) on prompts of the six offline datasets and prices
every round with a cost curve, so dozens of policies and curves are compared in minutes:

* the target's continuation of each prompt is computed once by plain decoding: greedy (T = 0), and sampled at T = 1
  with a fixed seed. Replaying a sampled continuation gives exactly the rounds of sample-and-match decoding with the
  top-K tree under the coupling in which the target draws these tokens, so T = 1 is replayed as faithfully as T = 0;
* the drafter's states for every round start come from one batched pass per prompt;
* policies: fixed budgets (the oracle is the best of them per dataset, chosen after the fact), DFlash's chain,
  ``auto`` and ``chain-auto``. Adaptive policies keep one memory across the prompts, as in a benchmark process; and
  your own policy classes (``--policy module:Class``, built with no arguments, once per replayed prompt; see
  :mod:`experiments.bench.policies`), reported under their ``name``;
* curves: this machine's measured one (``measure_cost_model``, this dtype), optionally fp32 on this machine
  (``--fp32-curve``), the AMD EPYC fp32 costs measured on the 2-core machine this was developed on (and the same with
  the drafter's head scaled to today's 4,096-token draft vocabulary, derived), every GPU profile in
  ``experiments/profiles/`` and, when there is none, a simulated H200-like curve.

The projected rate of a policy is sum(committed tokens) / sum(curve's round seconds at the chosen sizes); rates are
compared as ratios to the oracle (the comparison the benchmark makes on measured time). The choice of prompts
(``--seed``, default 1) differs from the benchmark's (seed 0), so the policy is not tuned on what it is scored on.

    python -m experiments.studies.auto_budget_study --out runs/auto-study [--samples 4 --temperatures 0,1] [--policy
    m:Cls]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from ddtree.budget import AutoBudget
from ddtree.cost import CostModel, measure_cost_model
from ddtree.generate import make_policy
from experiments.bench.policies import PolicyError, make_policy_instance, policy_name
from experiments.bench.schema import write_json_atomic, write_text_atomic

FIXED = (2, 4, 8, 16, 32, 64)

# A GPU-like curve: memory-bound up to ~256 nodes (almost flat), compute-bound beyond (the DDTree paper's
# best budgets on an H200 with an 8B target are 256-512 nodes). Seconds per round as a function of the tree size.
H200_LIKE = CostModel(nodes=(0, 64, 256, 512, 1024), verify_s=(0.0200, 0.0205, 0.0225, 0.0300, 0.0480), fixed_s=0.004,
                      key="h200-like (simulated)")

# Measured once on a 2-core AMD EPYC (AVX2, fp32, MKL; the embedded default pair): a one-token target forward 80 ms;
# verifying 4, 8 and 16 tokens costs 1.95x, 2.1x and 2.5x of it; the drafter pass 66 ms (measured with the full
# 49K-token LM head, before the draft vocabulary). A tree of N nodes verifies N + 1 tokens; past 16 tokens the slope
# of the last segment is extended.
AMD_FP32 = CostModel(nodes=(0, 3, 7, 15), verify_s=(0.080, 0.156, 0.168, 0.200), fixed_s=0.066,
                     key="AMD EPYC fp32 (measured once)")
# The same machine with today's drafter: its LM head covers the 4,096-token draft vocabulary instead of 49,152, so
# the head's 51 ms shrink by that ratio (derived, not measured): 66 - 51 + 51 * 4096 / 49152 = 19 ms.
AMD_FP32_DRAFT_VOCAB = CostModel(nodes=AMD_FP32.nodes, verify_s=AMD_FP32.verify_s, fixed_s=0.019,
                                 key="AMD EPYC fp32 (measured once, head scaled to the draft vocabulary)")


def curves(target, draft, fp32_curve: bool, profiles: Path) -> dict[str, tuple[CostModel, int]]:
    """{name: (cost curve, cap)}: the cap is the largest tree auto builds under that curve (CPU 128, GPU 1024)."""
    from dflash_core.default import load_default_pair
    from dflash_core.timing import cpu_model

    dtype = str(next(target.parameters()).dtype).replace("torch.", "")
    out = {f"this CPU ({cpu_model()}, {dtype})": (measure_cost_model(target, draft, context=256, cap=128), 128)}
    if fp32_curve and dtype != "float32":
        target32, draft32, _ = load_default_pair(dtype=torch.float32, device=target.device)
        out[f"this CPU ({cpu_model()}, float32)"] = (measure_cost_model(target32, draft32, context=256, cap=128), 128)
        del target32, draft32
    out[AMD_FP32.key] = (AMD_FP32, 128)
    out[AMD_FP32_DRAFT_VOCAB.key] = (AMD_FP32_DRAFT_VOCAB, 128)
    found = sorted(profiles.glob("*.json")) if profiles.is_dir() else []
    for path in found:
        try:
            out[f"profile {path.stem}"] = (CostModel.from_profile(path, context=256), 1024)
        except ValueError as err:
            print(f"skipping profile {path}: {err}")
    if not found:
        out[H200_LIKE.key] = (H200_LIKE, 1024)
    return out


def auto_variants() -> list[tuple[str, dict]]:
    """(name, AutoBudget options) of every adaptive variant compared."""
    return [("auto", {}), ("chain-auto", {"chain": True})]


def user_policies(specs: list[str]) -> dict[str, str]:
    """{name: "module:Class"} of the user policies asked for; PolicyError for a class that is no policy or a name
    that another policy of the study already has."""
    taken = {"chain", *(f"B={b}" for b in FIXED), *(name for name, _ in auto_variants())}
    out: dict[str, str] = {}
    for spec in specs:
        name = policy_name(spec)
        if name in taken or name in out:
            raise PolicyError(f"--policy {spec!r}: the name {name!r} is already a policy of this study")
        out[name] = spec
    return out


def run(args) -> dict:
    from dflash_core.training.pools.catalog import OFFLINE_DATASETS, build_chat, select_items
    from dflash_core.default import load_default_pair, stop_token_ids
    from dflash_core.replay import draft_hidden_all_rounds, replay
    from dflash_core.timing import cpu_model
    from experiments.studies.drafter_eval import reference_continuations

    if args.threads:
        torch.set_num_threads(args.threads)
    mine = user_policies(args.policy)
    target, draft, tokenizer = load_default_pair(device=getattr(args, "device", "auto"))
    stops = stop_token_ids(tokenizer)
    prompts = [("", name, item.sample_id, build_chat(tokenizer, item.turns[:1]))
               for name in OFFLINE_DATASETS for item in select_items(name, args.samples, seed=args.seed)]
    t0 = time.perf_counter()
    cost_curves = curves(target, draft, args.fp32_curve, Path(args.profiles))
    print(f"[{time.perf_counter() - t0:.0f}s] cost curves: {', '.join(cost_curves)}", flush=True)
    results: dict = {"temperatures": {}}
    for temperature in args.temperatures:
        refs = reference_continuations(target, prompts, args.max_new_tokens, stops,
                                       Path(args.out) / f"continuations-T{temperature:g}.json",
                                       temperature=temperature, seed=args.seed)
        print(f"[{time.perf_counter() - t0:.0f}s] T={temperature:g}: continuations ready", flush=True)
        fixed_policies = {"chain": make_policy("chain"), **{f"B={b}": make_policy(b) for b in FIXED}}
        adaptive = {(curve, name): AutoBudget(cost, cap=cap, **opts)  # one memory per policy across prompts
                    for curve, (cost, cap) in cost_curves.items() for name, opts in auto_variants()}
        rows = []  # one per (prompt, policy, curve): rounds' committed tokens and tree sizes
        for _, name, sid, ids in prompts:
            full = torch.tensor(ids + refs[f"{name}/{sid}"])
            hidden = draft_hidden_all_rounds(target, draft, full, len(ids))
            for label, policy in fixed_policies.items():
                got = replay(target, draft, policy, full, len(ids), args.max_new_tokens, stops, hidden)
                rows.append({"dataset": name, "policy": label, "curve": None, "tokens": got.acceptance_lengths,
                             "sizes": got.tree_sizes})
            for label, spec in mine.items():  # a fresh policy per prompt (experiments.bench.policies)
                got = replay(target, draft, make_policy_instance(spec), full, len(ids), args.max_new_tokens, stops,
                             hidden)
                rows.append({"dataset": name, "policy": label, "curve": None, "tokens": got.acceptance_lengths,
                             "sizes": got.tree_sizes})
            for (curve, label), policy in adaptive.items():
                got = replay(target, draft, policy, full, len(ids), args.max_new_tokens, stops, hidden)
                rows.append({"dataset": name, "policy": label, "curve": curve, "tokens": got.acceptance_lengths,
                             "sizes": got.tree_sizes})
            print(f"[{time.perf_counter() - t0:.0f}s] T={temperature:g} {name}/{sid} replayed", flush=True)
        results["temperatures"][f"{temperature:g}"] = summarize(rows, cost_curves)
    results["setup"] = {"cpu": cpu_model(), "device": str(target.device), "dtype": str(next(target.parameters()).dtype), "samples": args.samples,
                        "seed": args.seed, "max_new_tokens": args.max_new_tokens, "datasets": list(OFFLINE_DATASETS),
                        "user_policies": mine,
                        "curves": {k: v[0].to_json() | {"cap": v[1]} for k, v in cost_curves.items()}}
    out = Path(args.out)
    write_json_atomic(out / "auto_budget_study.json", results)
    write_text_atomic(out / "auto_budget_study.md", markdown(results))
    return results


def summarize(rows: list[dict], cost_curves: dict) -> dict:
    """Per curve: projected rate of each policy per dataset, its ratio to the per-dataset oracle (best fixed
    budget), the mean over datasets and the worst dataset, the mean tree size and tau."""
    out = {}
    datasets = sorted({r["dataset"] for r in rows})
    for curve, (cost, _) in cost_curves.items():
        table: dict[str, dict] = {}
        for r in rows:
            if r["curve"] not in (None, curve):
                continue
            entry = table.setdefault(r["policy"], {}).setdefault(r["dataset"], {"tokens": 0, "seconds": 0.0,
                                                                                "rounds": 0, "nodes": 0})
            sizes = np.asarray(r["sizes"])
            entry["tokens"] += int(sum(r["tokens"]))
            entry["seconds"] += float(cost.round_seconds(sizes).sum()) if len(sizes) else 0.0
            entry["rounds"] += len(sizes)
            entry["nodes"] += int(sizes.sum())
        rate = {p: {d: v["tokens"] / v["seconds"] for d, v in per.items()} for p, per in table.items()}
        oracle = {d: max(rate[f"B={b}"][d] for b in FIXED) for d in datasets}
        best_fixed = {d: max(FIXED, key=lambda b: rate[f"B={b}"][d]) for d in datasets}
        plain = float(cost.verify(0))  # one target step: the plain decoding time per token (approximately)
        policies = {}
        for p, per in table.items():
            ratios = {d: rate[p][d] / oracle[d] for d in datasets}
            tokens = sum(v["tokens"] for v in per.values())
            rounds = sum(v["rounds"] for v in per.values())
            policies[p] = {"vs_oracle_mean": float(np.mean(list(ratios.values()))),
                           "vs_oracle_min": float(min(ratios.values())), "vs_oracle": ratios,
                           "speedup_mean": float(np.mean([rate[p][d] * plain for d in datasets])),
                           "speedup": {d: rate[p][d] * plain for d in datasets},
                           "tau": tokens / max(rounds, 1),
                           "mean_nodes": sum(v["nodes"] for v in per.values()) / max(rounds, 1)}
        out[curve] = {"oracle_budget": best_fixed, "policies": policies}
    return out


def markdown(results: dict) -> str:
    setup = results["setup"]
    lines = [f"# auto budget study (replayed; {setup['cpu']}, {setup['dtype']}; {setup['samples']} prompts per "
             f"dataset, seed {setup['seed']}, {setup['max_new_tokens']} tokens)", "",
             "Projected rate = committed tokens / the curve's seconds for the chosen tree sizes. vs oracle: rate / the "
             "best fixed budget's rate per dataset (after the fact), mean over the six datasets and the worst one. "
             "Speedup: against one target step per token (the curve's cost of a root-only round).", ""]
    for temperature, per_curve in results["temperatures"].items():
        for curve, data in per_curve.items():
            lines += [f"## T = {temperature}, {curve}", "",
                      "oracle budget per dataset: " + ", ".join(f"{d} {b}" for d, b in data["oracle_budget"].items()),
                      "", "| policy | vs oracle (mean) | worst dataset | speedup (projected) | τ | mean nodes |",
                      "|---|---:|---:|---:|---:|---:|"]
            for name, s in sorted(data["policies"].items(), key=lambda kv: -kv[1]["vs_oracle_mean"]):
                lines.append(f"| {name} | {s['vs_oracle_mean']:.3f} | {s['vs_oracle_min']:.3f} | "
                             f"{s['speedup_mean']:.2f}x | {s['tau']:.2f} | {s['mean_nodes']:.1f} |")
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.auto_budget_study",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/auto-study")
    p.add_argument("--samples", type=int, default=4, help="prompts per dataset (first turns)")
    p.add_argument("--seed", type=int, default=1, help="prompt selection and sampling seed (the benchmark uses 0)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0])
    p.add_argument("--fp32-curve", action="store_true", help="also measure this machine's fp32 cost curve")
    p.add_argument("--profiles", default=str(Path(__file__).parent / "profiles"), help="folder of GPU profiles")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="auto", help="auto (CUDA when available, else the CPU), cuda, cuda:1, cpu")
    p.add_argument("--policy", action="append", default=[], metavar="MODULE:CLASS",
                   help="also replay your own ProposalPolicy class (no-argument constructor; repeatable)")
    args = p.parse_args(argv)
    if args.samples < 1 or args.max_new_tokens < 2:
        p.error("--samples must be >= 1 and --max-new-tokens >= 2")
    try:
        user_policies(args.policy)  # before any model work: a clear error for a missing or broken class
    except PolicyError as err:
        p.error(str(err))
    results = run(args)
    print(markdown(results))
    print(f"wrote {Path(args.out) / 'auto_budget_study.json'} and .md")


if __name__ == "__main__":
    main()
