"""Mechanism study, no models: at T = 1, does a sampled tree accept more than the top-K tree of the same budget?

``python -m experiments.studies.sampled_tree_study [--rounds 600] [--noise 0,0.5,1,2] [--budgets 16,32]``
(about 20 s on one CPU thread).

Each simulated round draws, for every depth d = 1..D+1, a target distribution p_d over V tokens: Zipf-like
(p ∝ rank^-s with an exponent s drawn per depth from ``--zipf``, so some depths are confident and some are not) on a
random permutation of the token ids. The drafter's distribution at depth d is q_d = softmax(log p_d + σ_d ε) with
standard normal ε: σ = 0 is a perfect drafter, larger σ a worse one, and ``--drift`` makes it worse with depth
(σ_d = σ (1 + drift (d - 1))). As in DDTree's own model, the target's distribution at a node depends on the node's
depth only (every node at depth d has p_{d+1} for its children).

Both trees go through the toolkit's real code, on the same p and q in every round:

* top-K: ``ddtree.build_tree`` on the drafter's logits, walked by ``dflash_core.decoding.follow`` (sample-and-match);
* sampled: ``ddtree.SampledTreePolicy`` (children drawn without replacement from q), verified by the tree's own
  ``verify`` (recursive rejection sampling, ``ddtree.RecursiveRejection``).

Reported: τ (committed tokens per round, bonus included) of both, their ratio, and the ratio's standard error over
rounds (paired: both trees see the same p and q).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Sequence

import torch

from ddtree import SampledTreePolicy, build_tree
from dflash_core.decoding import follow


def round_distributions(vocab: int, depth: int, zipf: tuple[float, float], noise: float, drift: float,
                        generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Target log-probs [depth+1, V] (row d: the distribution of the token at depth d+1) and draft logits
    [depth, V] (row d: the drafter's guess for depth d+1)."""
    low, high = zipf
    exponents = low + (high - low) * torch.rand(depth + 1, 1, generator=generator, dtype=torch.float64)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    log_p = -exponents * torch.log(ranks)  # [depth+1, V], rank order
    log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)
    order = torch.argsort(torch.rand(depth + 1, vocab, generator=generator), dim=-1)
    log_p = torch.gather(log_p, 1, order)  # each depth's ranks on its own permutation of the token ids
    sigma = noise * (1 + drift * torch.arange(depth, dtype=torch.float64))[:, None]  # [depth, 1]
    draft_logits = log_p[:depth] + sigma * torch.randn(depth, vocab, generator=generator, dtype=torch.float64)
    return log_p, draft_logits.float()


def committed(tree, log_p: torch.Tensor, generator: torch.Generator, sampled: bool) -> int:
    """Tokens one verification commits (accepted nodes + the bonus), with the target at every node from ``log_p``."""
    at_depth = torch.cat([torch.zeros(1, dtype=torch.int64), tree.depths])  # [n+1]: depth of the root and nodes
    logits = log_p[at_depth]  # [n+1, V]: the target's distribution for the children of each node
    if sampled:
        path, _ = tree.verify(logits, 1.0, generator)
    else:
        path, _ = follow(tree.token_ids, tree.parents, logits.float(), 1.0, generator)
    return len(path) + 1


def study(vocab: int, depth: int, rounds: int, budgets: Sequence[int], noises: Sequence[float],
          zipf: tuple[float, float], drift: float, seed: int) -> list[dict]:
    rows = []
    for noise in noises:
        for budget in budgets:
            generator = torch.Generator().manual_seed(seed)  # same p, q and target draws for every setting's rounds
            walk = torch.Generator().manual_seed(seed + 1)
            policy = SampledTreePolicy(budget, temperature=1.0, seed=seed + 2)
            topk, sampled = [], []
            for _ in range(rounds):
                log_p, draft_logits = round_distributions(vocab, depth, zipf, noise, drift, generator)
                topk.append(committed(build_tree(draft_logits, budget), log_p, walk, sampled=False))
                sampled.append(committed(policy.propose(draft_logits), log_p, walk, sampled=True))
            tau_topk, tau_sampled = sum(topk) / rounds, sum(sampled) / rounds
            ratio = tau_sampled / tau_topk
            # delta method on the paired per-round differences: se(ratio) ~ se(sampled - ratio * topk) / tau_topk
            resid = [s - ratio * t for s, t in zip(sampled, topk)]
            mean = sum(resid) / rounds
            se = math.sqrt(sum((r - mean) ** 2 for r in resid) / (rounds - 1) / rounds) / tau_topk
            rows.append({"noise": noise, "budget": budget, "tau_topk": tau_topk, "tau_sampled": tau_sampled,
                         "ratio": ratio, "ratio_se": se})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| drafter noise σ | budget B | τ top-K (sample-and-match) | τ sampled (recursive rejection) | ratio |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['noise']:g} | {r['budget']} | {r['tau_topk']:.3f} | {r['tau_sampled']:.3f} | "
                     f"{r['ratio']:.3f} ± {r['ratio_se']:.3f} |")
    return "\n".join(lines) + "\n"


def _csv(kind):
    return lambda text: tuple(kind(part) for part in text.split(",") if part.strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.studies.sampled_tree_study",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--depth", type=int, default=15, help="draft depths per round (block size - 1)")
    parser.add_argument("--rounds", type=int, default=600, help="simulated rounds per setting")
    parser.add_argument("--budgets", type=_csv(int), default=(16, 32))
    parser.add_argument("--noise", type=_csv(float), default=(0.0, 0.5, 1.0, 2.0),
                        help="drafter noise σ, comma-separated")
    parser.add_argument("--zipf", type=_csv(float), default=(1.1, 2.5), help="range of the target's Zipf exponents")
    parser.add_argument("--drift", type=float, default=0.1, help="relative growth of σ per depth")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = study(args.vocab, args.depth, args.rounds, args.budgets, args.noise, tuple(args.zipf), args.drift,
                 args.seed)
    print(f"T = 1, V = {args.vocab}, depth {args.depth}, {args.rounds} rounds per row, Zipf exponents "
          f"{args.zipf[0]:g}-{args.zipf[1]:g}, drift {args.drift:g}, seed {args.seed}\n")
    print(table(rows))
    print(f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
