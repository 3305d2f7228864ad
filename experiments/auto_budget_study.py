"""Which tree size does ``budget="auto"`` pick per round, and how does it move with the verify-cost curve?

Runs greedy DDTree with the auto policy on a few prompts of the offline suite twice: with the cost curve measured on
this machine, and with a simulated H200-like curve (verifying a few hundred nodes costs little more than one). The
outputs are identical (the policy only changes the tree); the per-round tree sizes are collected and drawn as
histograms.

    python -m experiments.auto_budget_study --out runs/auto-study [--samples 2 --max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from ddtree import ddtree_generate
from ddtree.budget import AutoBudget, CostModel, measure_cost_model
from dflash_core.default import load_default_pair, stop_token_ids
from experiments.datasets import OFFLINE_DATASETS, build_chat, select_items
from experiments.schema import write_json_atomic

# A GPU-like curve: memory-bound up to ~256 nodes (almost flat), compute-bound beyond (FACTS §2: the DDTree paper's
# best budgets on an H200 with an 8B target are 256-512 nodes). Seconds per target forward over N+1 tokens.
H200_LIKE = CostModel(nodes=(0, 64, 256, 512, 1024), verify_s=(0.0200, 0.0205, 0.0225, 0.0300, 0.0480), fixed_s=0.004)


def run(out: Path, samples: int, max_new_tokens: int, cap_cpu: int, cap_gpu: int) -> dict:
    target, draft, tokenizer = load_default_pair()
    stops = stop_token_ids(tokenizer)
    curves = {"measured (this CPU)": (measure_cost_model(target, draft), cap_cpu), "H200-like (simulated)": (H200_LIKE, cap_gpu)}
    chosen = {name: [] for name in curves}
    betas = {name: [] for name in curves}
    same_output = True
    for dataset in OFFLINE_DATASETS:
        for item in select_items(dataset, samples, seed=0):
            ids = torch.tensor([build_chat(tokenizer, item.turns[:1])])
            outputs = []
            for name, (cost, cap) in curves.items():
                policy = AutoBudget(cost, cap=cap)
                res = ddtree_generate(target, draft, ids, max_new_tokens=max_new_tokens, stop_token_ids=stops,
                                      policy=policy)
                chosen[name] += policy.chosen
                betas[name].append(policy.beta)
                outputs.append(res.new_token_ids)
            same_output &= all(o == outputs[0] for o in outputs)
    summary = {
        name: {"rounds": len(v), "median_nodes": float(np.median(v)), "mean_nodes": float(np.mean(v)),
               "p10": float(np.percentile(v, 10)), "p90": float(np.percentile(v, 90)),
               "final_beta_median": float(np.median(betas[name])), "cost": curves[name][0].to_json()}
        for name, v in chosen.items()
    }
    summary["identical_outputs"] = same_output
    write_json_atomic(out / "auto_budget_study.json", {"summary": summary, "chosen": chosen})
    _plot(chosen, out / "auto_budget_hist.png")
    return summary


def _plot(chosen: dict[str, list[int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 3.6), layout="constrained")
    ax = fig.add_subplot()
    top = max(max(v) for v in chosen.values() if v) + 1
    bins = np.unique(np.geomspace(1, max(top, 2), 30).astype(int))
    bins = np.concatenate([[0], bins])
    for name, values in chosen.items():
        ax.hist(values, bins=bins, alpha=0.6, label=f"{name} (median {np.median(values):.0f})")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("tree nodes chosen per round by budget='auto'")
    ax.set_ylabel("rounds")
    ax.set_title("Auto budget: chosen tree size vs verify-cost curve")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=130)
    fig.savefig(path.with_suffix(".pdf"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/auto-study"))
    parser.add_argument("--samples", type=int, default=2, help="prompts per offline dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--cap-cpu", type=int, default=128)
    parser.add_argument("--cap-gpu", type=int, default=1024)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = run(args.out, args.samples, args.max_new_tokens, args.cap_cpu, args.cap_gpu)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "cost"} if isinstance(v, dict) else v
                      for k, v in summary.items()}, indent=1))
    print(f"wrote {args.out / 'auto_budget_study.json'} and {args.out / 'auto_budget_hist.png'}")


if __name__ == "__main__":
    main()
