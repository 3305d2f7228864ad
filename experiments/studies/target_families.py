"""What a tree verify costs per target family: ``python -m experiments.studies.target_families``.

For every family of :data:`experiments.bench.models.FAMILY_TARGETS` (tiny random configurations from transformers'
own config classes: Qwen3 with sliding windows, Mistral, Gemma 3, gpt-oss, DeepSeek-V3's latent attention, the
Gated DeltaNet hybrids Qwen3-Next and Qwen3.5, whose linear layers verify a tree depth by depth), on a
``--context``-token prompt: the median seconds of one plain decoding step (one token, the model's own causal mask)
and of one verify forward of a best-first tree of 1, 16 and 64 draft nodes (plus the root) (the loop's ``LiveModels.verify``: the tree
mask, one per layer kind where the family has sliding layers), each from the same prefilled cache. Also, per
family, greedy DDTree at budgets 16 and 64 against plain decoding on ``--prompts`` prompts: how many outputs were
equal. One JSON object per family is printed and, with ``--out``, written atomically.

The configurations are tiny, so the ratios say what the masks and the family's attention path add per node, not
what a real model's verify costs.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from ddtree import build_tree, ddtree_generate
from dflash_core import autoregressive_generate
from dflash_core.decoding import LiveModels
from dflash_core.target import TargetAdapter
from dflash_core.timing import cpu_model
from experiments.bench.models import FAMILY_TARGETS, family_target, random_draft


def _median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def family_costs(family: str, context: int, nodes=(1, 16, 64), repeats: int = 30, prompts: int = 3) -> dict:
    target = family_target(family, vocab=256, dtype=torch.float32, window=max(4, context // 4))
    vocab = target.config.vocab_size
    adapter = TargetAdapter(target)
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0))
    models = LiveModels.prefilled(adapter, None, [ids])[0]
    base = copy.deepcopy(models.cache)
    empty = build_tree(torch.zeros(1, vocab), 0)

    def step():  # one plain decoding step on a copy of the prefilled cache
        models.cache = copy.deepcopy(base)
        models.verify([0], [empty], [1])

    def copy_only():
        models.cache = copy.deepcopy(base)

    copy_s = _median(copy_only, repeats)
    out = {"family": family, "model_type": target.config.model_type, "context": context,
           "attention": target.config._attn_implementation,
           "plain_step_ms": 1e3 * (_median(step, repeats) - copy_s)}
    for n in nodes:
        logits = torch.randn(15, vocab, generator=torch.Generator().manual_seed(n)) * 4
        tree = build_tree(logits, n)  # n draft nodes below the root: n + 1 rows

        def verify(tree=tree):
            models.cache = copy.deepcopy(base)
            models.verify([0], [tree], [1])

        seconds = _median(verify, repeats) - copy_s
        out[f"verify_{n}_ms"] = 1e3 * seconds
        out[f"verify_{n}_over_step"] = 1e3 * seconds / out["plain_step_ms"]
    draft = random_draft(target, layers=1, taps=2, block_size=16)
    equal = {16: 0, 64: 0}
    for seed in range(prompts):
        p = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(100 + seed))
        plain = autoregressive_generate(target, p, 32).new_token_ids
        for budget in equal:
            equal[budget] += ddtree_generate(target, draft, p, budget=budget, max_new_tokens=32).new_token_ids == plain
    out["greedy_equal"] = {str(b): f"{k}/{prompts}" for b, k in equal.items()}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.target_families",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILY_TARGETS))
    p.add_argument("--context", type=int, default=256, help="prompt tokens before the timed forward (default 256)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--prompts", type=int, default=3, help="prompts of the greedy equality check (default 3)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON file for the results (written atomically)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    for family in [f for f in a.families.split(",") if f]:
        if family not in FAMILY_TARGETS:
            raise SystemExit(f"unknown family {family!r}; choose from {', '.join(FAMILY_TARGETS)}")
        rows.append({**family_costs(family, a.context, repeats=a.repeats, prompts=a.prompts), "cpu": cpu_model(),
                     "threads": a.threads})
        print(json.dumps(rows[-1]), flush=True)
        if a.out:
            from experiments.bench.schema import write_json_atomic

            write_json_atomic(Path(a.out), rows)


if __name__ == "__main__":
    main()
