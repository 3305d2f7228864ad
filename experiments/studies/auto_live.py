"""``budget="auto"`` against a fixed budget, live, and where a difference comes from:
``python -m experiments.studies.auto_live``.

Greedy, first turns of the benchmark's datasets, every variant on every prompt in one process in an order rotated per
prompt, outputs checked equal. Variants (``--variants``):

* ``B<n>``        -- DDTree with a fixed budget of n nodes (``B8``: the reference the ratios are taken to);
* ``auto``        -- ``budget="auto"`` as a call makes it: a fresh memory, the cached cost curve, online correction;
* ``auto_off``    -- the same without reading the clock (no online correction);
* ``auto_mem``    -- with one :class:`ddtree.RoundMemory` carried from prompt to prompt (as a benchmark or a server);
* ``auto_fresh``  -- with a cost curve measured now, in this process (not the cached one), per context bucket;
* ``lookup``      -- DDTree with lookup branches under ``auto`` (``lookup=True``), a fresh memory per call;
* ``lookup_mem``  -- the same with one memory carried from prompt to prompt (its lookup statistics with it);
* ``lookup_flat`` -- ``lookup`` whose fresh statistics start from the flat priors, not the corpus prior
  (:class:`ddtree.lookup.LookupStats`);
* ``pld``         -- prompt lookup without a drafter (:func:`dflash_core.lookup_generate`).

``--repeats 2`` runs each prompt's variants forwards and then backwards (A B B A) and pools their decode time (a
carried memory's later passes start from the memory as it was before the prompt's first pass): on a machine whose
memory bandwidth moves by 20% within seconds (shared with other tenants), a single pass per prompt compares variants
timed in different phases. Per variant: tokens per second of decoding (prefill excluded) and its per-prompt
geometric-mean ratio to the first variant, tau, the loop's stage times per round (draft, tree, verify, commit), for
``auto`` the mean tree size verified and built and the modeled round seconds against the real ones, and for lookup
branches the share of tokens they committed and of rounds without the drafter. Writes one JSON atomically.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time

import numpy as np
import torch

__all__ = ["make_runner", "merge", "summarize", "main"]

STAGES = ("draft", "tree", "verify", "commit")


def make_runner(target, draft, stops: list[int]):
    """``run(variant, ids [1, T], max_new_tokens, again=False) -> record`` (the record holds the new ids under
    ``ids``). ``again=True`` (a repeated pass over the prompt): a carried memory starts from what it held when the
    prompt's first pass began, not from what that pass learnt about this very prompt."""
    from ddtree import RoundMemory, ddtree_generate, make_policy
    from ddtree.budget import AutoBudget
    from ddtree.lookup import LookupTreePolicy
    from ddtree.cost import context_bucket, measure_cost_model
    from dflash_core import lookup_generate

    carried = {"auto_mem": RoundMemory(), "lookup_mem": RoundMemory()}
    before: dict[tuple[str, int], RoundMemory] = {}  # (variant, prompt id) -> the memory before the first pass
    curves = {}

    def memory_for(variant: str, ids: torch.Tensor, again: bool) -> RoundMemory | None:
        if variant not in carried:
            return None
        key = (variant, hash(tuple(ids.flatten().tolist())))
        if not again:
            before[key] = copy.deepcopy(carried[variant])
            return carried[variant]
        return copy.deepcopy(before[key])

    def policy(variant: str, length: int, memory: RoundMemory | None):
        if variant.startswith("B"):
            return make_policy(int(variant[1:]))
        if variant in ("lookup", "lookup_mem"):
            return make_policy("auto", target, draft, lookup=True, context=length, memory=memory)
        if variant == "lookup_flat":
            return LookupTreePolicy(AutoBudget.for_models(target, draft, context=length), clock=time.perf_counter,
                                    prior=False)
        options = {"auto": {}, "auto_off": {"online": False}, "auto_mem": {"memory": memory}}.get(variant)
        if variant == "auto_fresh":
            bucket = context_bucket(length)
            if bucket not in curves:
                curves[bucket] = measure_cost_model(target, draft, context=bucket, use_cache=False)
            options = {"cost": curves[bucket]}
        if options is None:
            raise ValueError(f"unknown variant {variant!r}: B<n>, auto, auto_off, auto_mem, auto_fresh, lookup, "
                             "lookup_mem, lookup_flat or pld")
        return make_policy("auto", target, draft, context=length, **options)

    def run(variant: str, ids: torch.Tensor, max_new_tokens: int, again: bool = False) -> dict:
        pol = None if variant == "pld" else policy(variant, int(ids.shape[1]), memory_for(variant, ids, again))
        res = (lookup_generate(target, ids, max_new_tokens=max_new_tokens, stop_token_ids=stops) if pol is None else
               ddtree_generate(target, draft, ids, max_new_tokens=max_new_tokens, stop_token_ids=stops, policy=pol))
        rounds = max(1, len(res.acceptance_lengths))
        record = {"tok_s": len(res.new_token_ids) / res.timings["decode"], "tau": res.tau, "rounds": rounds,
                  "tokens": len(res.new_token_ids), "decode_s": res.timings["decode"],
                  "ms_per_round": {s: 1e3 * res.timings.get(s, 0.0) / rounds for s in STAGES},
                  "ids": res.new_token_ids}
        if hasattr(pol, "lookup_committed"):
            record["lookup_share"] = sum(pol.lookup_committed) / max(1, len(res.new_token_ids))
            record["skipped_share"] = sum(pol.skipped) / rounds
        if hasattr(pol, "chosen"):
            modeled = sum(r.seconds for r in list(pol.memory)[-rounds:])
            record.update(chosen=float(np.mean(pol.chosen)), built=float(np.mean(pol.built)),
                          modeled_over_real=modeled / res.timings["decode"], memory_rounds=len(pol.memory))
        return record
    return run


def merge(records: list[dict]) -> dict:
    """One variant's calls on one prompt as one record: tokens/s over all of them (total tokens / total decode
    seconds), the first call's ids, the mean of every other number."""
    first = records[0]
    out = {k: statistics.fmean(r[k] for r in records) for k, v in first.items() if isinstance(v, (int, float))}
    out["ms_per_round"] = {s: statistics.fmean(r["ms_per_round"][s] for r in records) for s in STAGES}
    out["tok_s"] = sum(r["tokens"] for r in records) / sum(r["decode_s"] for r in records)
    out["ids"], out["calls"] = first["ids"], len(records)
    return out


def summarize(rows: list[dict], variants: list[str]) -> dict:
    """Per variant: the geometric mean (and median) of its per-prompt tokens/s ratio to the first variant, mean tau,
    stage ms per round, and (auto) the mean sizes and modeled/real seconds."""
    base, out = variants[0], {}
    for v in variants:
        ratios = [r[v]["tok_s"] / r[base]["tok_s"] for r in rows]
        entry = {"over_first_geomean": math.exp(statistics.fmean(math.log(x) for x in ratios)),
                 "over_first_median": statistics.median(ratios), "over_first": ratios,
                 "tau": statistics.fmean(r[v]["tau"] for r in rows),
                 "ms_per_round": {s: statistics.fmean(r[v]["ms_per_round"][s] for r in rows) for s in STAGES}}
        for key in ("chosen", "built", "modeled_over_real", "lookup_share", "skipped_share"):
            if key in rows[0][v]:
                entry[key] = statistics.fmean(r[v][key] for r in rows)
        out[v] = entry
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.auto_live", description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", default="gsm8k,math500,humaneval,mt-bench")
    p.add_argument("--max-samples", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--variants", default="B8,auto,auto_mem")
    p.add_argument("--repeats", type=int, default=1,
                   help="passes over the variants per prompt, forwards then backwards (2: A B B A), so a machine "
                        "whose speed drifts within seconds times every variant alike")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="the pair's precision (auto: the machine's default; fp32 keeps every variant on plain "
                        "decoding's text, where bf16 parts at near-ties)")
    p.add_argument("--out", default="runs/auto_live.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from dflash_core import load_default_pair
    from dflash_core.cpu_kernels import apply_cpu_kernels
    from dflash_core.default import stop_token_ids
    from dflash_core.timing import machine_identity
    from experiments.bench.conversation import benchmark_prompts
    from experiments.bench.models import resolve_dtype
    from experiments.bench.schema import write_text_atomic

    dtype = None if args.dtype == "auto" else resolve_dtype(args.dtype, torch.device("cpu"))  # auto: the device's
    target, draft, tokenizer = load_default_pair(dtype)
    apply_cpu_kernels(target, draft, kernels="auto")
    run = make_runner(target, draft, stop_token_ids(tokenizer))
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    prompts, labels = benchmark_prompts(tokenizer, args.datasets.split(","), args.max_samples)
    run(variants[0], torch.as_tensor(prompts[0]).reshape(1, -1)[:, :32], 8)  # warm-up
    rows, t0 = [], time.perf_counter()
    for i, (ids, label) in enumerate(zip(prompts, labels)):
        ids = torch.as_tensor(ids).reshape(1, -1)
        order = variants[i % len(variants):] + variants[:i % len(variants)]
        calls = {v: [] for v in variants}
        for k in range(args.repeats):
            for v in order if k % 2 == 0 else order[::-1]:
                calls[v].append(run(v, ids, args.max_new_tokens, again=k > 0))
        row = {v: merge(calls[v]) for v in variants}
        reference = row[variants[0]]["ids"]
        row["equal"] = {v: row[v].pop("ids") == reference for v in variants}
        rows.append({"label": label, **row})
        print(i, label, " ".join(f"{v} {row[v]['tok_s']:.1f} tok/s tau {row[v]['tau']:.2f}" for v in variants),
              flush=True)
    summary = summarize(rows, variants)
    for v, s in summary.items():
        print(f"{v}: x{variants[0]} {s['over_first_geomean']:.3f} (median {s['over_first_median']:.3f}), "
              f"tau {s['tau']:.2f}, ms/round " + ", ".join(f"{k} {x:.1f}" for k, x in s["ms_per_round"].items())
              + (f", chosen {s['chosen']:.1f}, built {s['built']:.1f}" if "chosen" in s else ""))
    record = {"machine": machine_identity(), "dtype": str(target.dtype), "settings": vars(args),
              "wall_s": time.perf_counter() - t0, "summary": summary, "rows": rows}
    write_text_atomic(args.out, json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
