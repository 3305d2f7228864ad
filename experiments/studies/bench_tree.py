"""Tree-builder benchmark: ``build_tree`` against the plain heap reference on the same draft logits.

    python -m experiments.studies.bench_tree                  # V in {49152, 151936}, B in {16, ..., 1024}, depth 15
    python -m experiments.studies.bench_tree --threads 1      # steadier numbers on a shared machine
    python -m experiments.studies.bench_tree --vocab 49152 --budgets 64 512 --repeats 100 --json runs/bench_tree.json
    python -m experiments.studies.bench_tree --threads 1 --budgets 512 --rounds 3   # the number to quote on a busy
    machine

For every (distribution, vocab, budget) it reports median milliseconds of both builders (timed alternately, call by
call, so machine noise hits both alike), the speed-up (with ``--rounds R``: the median over R independent rounds of
each round's ratio of medians, so that one disturbed round does not decide it; the per-round ratios are printed and
in the JSON), the time of the fast builder's selection stage alone (its "pop loop", ``select_prefixes`` on
precomputed candidates; median and minimum), and whether the two trees are identical. Two logit distributions:
``randn`` (N(0, 3^2) logits: flat rows, shallow wide trees) and ``drafter`` (a confident guess per row whose
confidence decays along the block: deep trees, like a real drafter).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from dflash_core.timing import time_samples
from ddtree.build import build_tree, reference_build_tree, select_prefixes, top_candidates

DISTRIBUTIONS = ("randn", "drafter")


@dataclass(frozen=True)
class BenchRow:
    distribution: str
    vocab: int
    budget: int
    depth: int
    nodes: int
    reference_ms: float
    fast_ms: float
    speedup: float  # median over rounds of reference_ms / fast_ms
    speedup_rounds: list[float]
    fast_select_ms: float
    fast_select_min_ms: float
    identical: bool


def draft_logits(distribution: str, depth: int, vocab: int, seed: int) -> torch.Tensor:
    """[depth, vocab] float32 logits of the named distribution."""
    g = torch.Generator().manual_seed(seed)
    if distribution == "randn":
        return torch.randn(depth, vocab, generator=g) * 3.0
    if distribution == "drafter":
        logits = torch.randn(depth, vocab, generator=g) * 1.5
        for row in range(depth):  # top-1 probability about 0.7 at the first position, decaying along the block
            top = 0.7 * 0.93 ** row
            tokens = torch.randint(0, vocab, (3,), generator=g)
            logits[row, tokens[0]] += math.log(top / (1 - top)) + math.log(vocab) + 1.0
            logits[row, tokens[1]] += math.log(top / (1 - top)) + math.log(vocab) - 0.5
            logits[row, tokens[2]] += math.log(vocab) - 1.0
        return logits
    raise ValueError(f"unknown distribution {distribution!r}; choose from {DISTRIBUTIONS}")


def time_ms(functions: list[Callable[[], object]], repeats: int, device: str) -> list[list[float]]:
    """Milliseconds of each call of each function, calling them in turn so that noise hits all of them alike
    (:func:`dflash_core.timing.time_samples`, after 3 warm-up rounds; CUDA events for logits on CUDA)."""
    return [[1e3 * t for t in times] for times in time_samples(functions, repeats, device, warmup=3)]


def bench_one(distribution: str, vocab: int, budget: int, depth: int, repeats: int, seed: int,
              device: str, rounds: int = 1) -> BenchRow:
    logits = draft_logits(distribution, depth, vocab, seed).to(device)
    fast, reference = build_tree(logits, budget), reference_build_tree(logits, budget)
    medians = [list(map(statistics.median, time_ms([lambda: reference_build_tree(logits, budget),
                                                    lambda: build_tree(logits, budget)], repeats, device)))
               for _ in range(rounds)]  # [rounds] of (reference ms, fast ms)
    ratios = [round(r / f, 2) for r, f in medians]
    reference_ms, fast_ms = (statistics.median(column) for column in zip(*medians))
    candidates = top_candidates(logits, budget)
    select_times, = time_ms([lambda: select_prefixes(candidates, budget)], 4 * repeats, "cpu")
    return BenchRow(distribution, vocab, budget, depth, len(fast), round(reference_ms, 3), round(fast_ms, 3),
                    round(statistics.median(ratios), 2), ratios, round(statistics.median(select_times), 4),
                    round(min(select_times), 4), fast.equals(reference))


def markdown_table(rows: list[BenchRow]) -> str:
    lines = ["| logits | V | B | nodes | reference ms | build_tree ms | speed-up | select (pop loop) ms, median / min "
             "| identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.distribution} | {r.vocab} | {r.budget} | {r.nodes} | {r.reference_ms:.3f} | "
                     f"{r.fast_ms:.3f} | {r.speedup:.1f}x | {r.fast_select_ms:.4f} / {r.fast_select_min_ms:.4f} | "
                     f"{'yes' if r.identical else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[BenchRow]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--depth", type=int, default=15, help="rows of draft logits (block size - 1)")
    parser.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per builder and cell")
    parser.add_argument("--rounds", type=int, default=1,
                        help="independent timing rounds per cell; the speed-up is the median of their ratios")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="device of the logits (cpu or cuda)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice); 1 is steadier on a busy machine")
    parser.add_argument("--json", metavar="OUT", help="also write the rows and the environment to this JSON file")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    rows = []
    for distribution in args.distributions:
        for vocab in args.vocab:
            for budget in args.budgets:
                rows.append(bench_one(distribution, vocab, budget, args.depth, args.repeats, args.seed, args.device,
                                      args.rounds))
                print(f"{distribution:8s} V={vocab:<7d} B={budget:<5d} reference {rows[-1].reference_ms:8.3f} ms  "
                      f"build_tree {rows[-1].fast_ms:7.3f} ms  speed-up {rows[-1].speedup:5.2f}x "
                      f"{rows[-1].speedup_rounds}  select {rows[-1].fast_select_ms:7.4f} ms", flush=True)
    print()
    print(markdown_table(rows))
    if args.json:
        environment = {"torch": torch.__version__, "threads": torch.get_num_threads(), "python":
                       platform.python_version(), "machine": platform.machine(), "processor": platform.processor(),
                       "device": args.device, "repeats": args.repeats, "rounds": args.rounds, "seed": args.seed,
                       "depth": args.depth}
        with open(args.json, "w") as out:
            json.dump({"environment": environment, "rows": [asdict(r) for r in rows]}, out, indent=2)
    return rows


if __name__ == "__main__":
    main()
