"""The benchmark's throughput mode: tokens per second per method and batch size, ``bash run_benchmark.sh --batch
1,2,4,8`` (``python -m experiments.bench.throughput``).

The same first-turn prompts for every batch size (default: gsm8k, humaneval, mt-bench, grounded, 2 each: 8 prompts),
greedy, the embedded pair (or ``--draft random``: a random drafter, for a smoke test). For batch size B the prompts are
cut into groups of B in their fixed order, and each group is decoded together by one call of the method (plain
decoding batched is the baseline at every B). Per batch size the methods run group by group in an order rotated per
group, after one untimed warm-up call of each at that batch size (32 tokens of the warm-up prompt; ``auto`` measures
its batch cost curve and starts its round memory there). A method's throughput at B is all its new tokens
over all its calls' wall time (prefill included); the decode-only rate leaves the prefill out.

Methods: ``ar`` (plain, batched), ``dflash`` (the chain), ``ddtree-N`` (fixed budgets, ``--budgets``), ``auto`` (one
tree size per round for the batch) and ``auto+lookup``. For each B the table gives tokens/s, the ratio to plain at that B, tau, the best fixed budget and
``auto``'s mean tree size; outputs are compared token for token with plain decoding's (in bf16 a near-tie may round
the other way in a differently grouped product; the count of equal outputs is reported).

Results go to ``--out`` (``throughput.json``, rewritten atomically after every (batch size, method) cell); rerunning
with the same ``--out`` and settings skips the finished cells, so an interrupted run loses nothing it finished. The
figure (``throughput.png``: tokens/s vs batch size, one line per method) is drawn by :mod:`plots.throughput_figure`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

__all__ = ["METHODS", "method_names", "make_runner", "summarize", "format_table", "main"]

DEFAULT_DATASETS = ("gsm8k", "humaneval", "mt-bench", "grounded")
DEFAULT_BUDGETS = (4, 8, 16, 32)
# ``ddtree`` expands to one method per fixed budget; ``auto`` sizes a batch's trees together (one size per round)
METHODS = ("ar", "dflash", "ddtree", "auto", "auto+lookup")
SCHEMA = "throughput/1"
WARMUP_TOKENS = 32


def log(message: str) -> None:
    print(f"[throughput] {message}", file=sys.stderr, flush=True)


def method_names(methods: Sequence[str], budgets: Sequence[int]) -> list[str]:
    """``ddtree`` becomes ``ddtree-<N>`` for each fixed budget; the others stay."""
    out = []
    for m in methods:
        out += [f"ddtree-{b}" for b in budgets] if m == "ddtree" else [m]
    return out


def make_runner(method: str, target, draft, stops: Sequence[int]) -> Callable:
    """``run(prompts, max_new_tokens) -> list[GenerationResult]`` for a list of [1, T] prompts (one batch)."""
    from ddtree import ddtree_generate
    from dflash_core import autoregressive_generate, dflash_generate

    if method == "ar":
        return lambda prompts, n: autoregressive_generate(target, prompts, n, stop_token_ids=stops)
    if method == "dflash":
        return lambda prompts, n: dflash_generate(target, draft, prompts, n, stop_token_ids=stops)
    if method.startswith("ddtree-"):
        budget = int(method.removeprefix("ddtree-"))
        return lambda prompts, n: ddtree_generate(target, draft, prompts, budget=budget, max_new_tokens=n,
                                                  stop_token_ids=stops)
    if method in ("auto", "auto+lookup"):
        return _auto_runner(method, target, draft, stops)
    raise ValueError(f"unknown method {method!r}: use ar, dflash, ddtree-<N>, auto or auto+lookup")


def _auto_runner(method: str, target, draft, stops: Sequence[int]) -> Callable:
    """The runner of an ``auto`` method: every sequence's policy of every batch of one size continues one round
    memory (:class:`ddtree.RoundMemory`; the warm-up's included), as a serving process would; each batch size keeps
    its own, since it prices its rounds with its own cost curve."""
    from ddtree import RoundMemory, ddtree_generate, make_policy

    lookup = method == "auto+lookup"
    memories: dict[int, RoundMemory] = {}

    def run(prompts, n):
        memory = memories.setdefault(len(prompts), RoundMemory())
        longest = max(int(p.shape[-1]) for p in prompts)
        policies = [make_policy("auto", target, draft, lookup=lookup, context=longest, batch=len(prompts),
                                memory=memory) for _ in prompts]
        results = ddtree_generate(target, draft, prompts, policy=policies, max_new_tokens=n, stop_token_ids=stops)
        if lookup:
            for r, policy in zip(results, policies):
                r.lookup_tokens = policy.lookup_committed
        return results

    return run


def _groups(prompts: list, size: int) -> list[list]:
    return [prompts[i: i + size] for i in range(0, len(prompts) - size + 1, size)]


def run_cell(run: Callable, prompts: list, size: int, max_new_tokens: int) -> dict[str, Any]:
    """One method at one batch size over every group: new tokens, wall and decode seconds, per-prompt outputs."""
    out = {"tokens": 0, "wall_s": 0.0, "prefill_s": 0.0, "rounds": 0, "tree_nodes": 0, "outputs": [],
           "calibration_s": 0.0}
    for group in _groups(prompts, size):
        t0 = time.perf_counter()
        results = run(group, max_new_tokens)
        wall = time.perf_counter() - t0
        calibration = max(r.timings.get("calibration", 0.0) for r in results)
        out["wall_s"] += wall - calibration  # ``auto``'s one-off cost-curve measurement is not decoding
        out["calibration_s"] += calibration
        out["prefill_s"] += results[0].timings.get("prefill", 0.0)
        for r in results:
            out["tokens"] += len(r.new_token_ids)
            out["rounds"] += len(r.acceptance_lengths)
            out["tree_nodes"] += sum(r.tree_sizes)
            out["outputs"].append(list(r.new_token_ids))
    return out


def summarize(cells: dict[str, dict[str, dict]], budgets: Sequence[int]) -> dict[str, dict[str, Any]]:
    """Per batch size: per method tokens/s, decode-only tokens/s, over plain, tau, mean tree size, outputs equal
    to plain's; plus the best fixed budget and ``auto`` against it."""
    summary = {}
    for size, row in sorted(cells.items(), key=lambda kv: int(kv[0])):
        plain = row.get("ar")
        methods = {}
        for name, c in row.items():
            rate = c["tokens"] / c["wall_s"] if c["wall_s"] else float("nan")
            decode = c["tokens"] / max(c["wall_s"] - c["prefill_s"], 1e-9)
            m = {"tok_s": rate, "decode_tok_s": decode,
                 "tau": (c["tokens"] - len(c["outputs"])) / c["rounds"] if c["rounds"] else float("nan"),
                 "mean_tree": c["tree_nodes"] / c["rounds"] if c["rounds"] else float("nan")}
            if plain is not None:
                m["over_plain"] = rate / (plain["tokens"] / plain["wall_s"])
                m["equal_to_plain"] = sum(a == b for a, b in zip(c["outputs"], plain["outputs"]))
                m["prompts"] = len(c["outputs"])
            methods[name] = m
        fixed = {n: methods[n]["tok_s"] for n in methods if n.startswith("ddtree-")}
        entry: dict[str, Any] = {"methods": methods}
        if fixed:
            best = max(fixed, key=fixed.get)
            entry["best_fixed"] = {"method": best, "tok_s": fixed[best]}
            for name in ("auto", "auto+lookup"):
                if name in methods:
                    entry[f"{name}_over_best_fixed"] = methods[name]["tok_s"] / fixed[best]
        summary[size] = entry
    return summary


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    lines = ["| batch | method | tok/s | decode tok/s | over plain | tau | mean tree | = plain |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for size, entry in summary.items():
        for name, m in entry["methods"].items():
            lines.append(f"| {size} | {name} | {m['tok_s']:.1f} | {m['decode_tok_s']:.1f} | "
                         f"{m.get('over_plain', float('nan')):.2f} | {m['tau']:.2f} | {m['mean_tree']:.1f} | "
                         f"{m.get('equal_to_plain', '-')}/{m.get('prompts', '-')} |")
    lines.append("")
    for size, entry in summary.items():
        if "best_fixed" in entry:
            best = entry["best_fixed"]
            auto = entry.get("auto_over_best_fixed")
            lines.append(f"batch {size}: best fixed budget {best['method']} ({best['tok_s']:.1f} tok/s)"
                         + (f"; auto at {auto:.3f}x of it" if auto is not None else ""))
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,2,4,8", help="comma-separated batch sizes (default 1,2,4,8)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)), help="fixed budgets of `ddtree`")
    p.add_argument("--datasets", default=",".join(DEFAULT_DATASETS), help="comma-separated (first turns only)")
    p.add_argument("--max-samples", type=int, default=2, help="prompts per dataset (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--draft", default="default", help="default (the shipped drafter) or random (smoke tests)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default="runs/throughput", help="folder for throughput.json and the figure")
    args = p.parse_args(argv)
    try:
        args.batch = sorted({int(x) for x in args.batch.split(",") if x.strip()})
        args.budgets = [int(x) for x in args.budgets.split(",") if x.strip()]
    except ValueError:
        p.error("--batch and --budgets take comma-separated integers, e.g. --batch 1,2,4,8")
    if not args.batch or min(args.batch) < 1:
        p.error("--batch: batch sizes are integers >= 1")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad or not args.methods:
        p.error(f"--methods: unknown {bad}; use a subset of {','.join(METHODS)}")
    if "ar" not in args.methods:
        args.methods.insert(0, "ar")  # the baseline of every ratio
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from dflash_core import load_default_pair
    from dflash_core.cpu_kernels import apply_cpu_kernels
    from dflash_core.default import default_dtype, stop_token_ids
    from dflash_core.files import write_text_atomic
    from dflash_core.training.pools.catalog import build_chat
    from dflash_core.timing import machine_identity
    from experiments.bench.conversation import benchmark_prompts
    from experiments.bench.models import random_draft
    from experiments.bench.presets import PRESETS
    from experiments.bench.session import WARMUP_PROMPT

    transformers.utils.logging.set_verbosity_error()
    dtype = default_dtype(torch.device("cpu"))
    target, draft, tokenizer = load_default_pair(dtype, "cpu")
    if args.draft == "random":
        draft = random_draft(target)
    elif args.draft != "default":
        raise SystemExit(f"--draft: use default or random, got {args.draft!r}")
    kernels = apply_cpu_kernels(target, draft, kernels="auto")
    stops = stop_token_ids(tokenizer)
    chat_kwargs = dict(PRESETS["default"].models[0].chat_template_kwargs) or None
    ids, labels = benchmark_prompts(tokenizer, args.datasets, args.max_samples, 0, chat_kwargs)
    prompts = [torch.tensor([p]) for p in ids]
    if len(prompts) < max(args.batch):
        raise SystemExit(f"{len(prompts)} prompts cannot fill a batch of {max(args.batch)}: raise --max-samples")
    warmup = torch.tensor([build_chat(tokenizer, [WARMUP_PROMPT], chat_template_kwargs=chat_kwargs)])
    names = method_names(args.methods, args.budgets)
    settings = {"batch": args.batch, "methods": names, "datasets": args.datasets, "max_samples": args.max_samples,
                "max_new_tokens": args.max_new_tokens, "draft": args.draft, "prompts": labels,
                "threads": torch.get_num_threads(), "dtype": str(target.dtype).removeprefix("torch."),
                "cpu_kernels": kernels}
    out_dir = Path(args.out)
    path = out_dir / "throughput.json"
    record = _resume(path, settings)
    cells = record["cells"]
    log(f"{len(prompts)} prompts, batch sizes {args.batch}, methods {names}, {args.max_new_tokens} tokens, "
        f"{settings['dtype']}, {settings['threads']} threads")
    runners = {name: make_runner(name, target, draft, stops) for name in names}
    for size in args.batch:
        row = cells.setdefault(str(size), {})
        todo = [n for n in names if n not in row]
        if not todo:
            continue
        for name in todo:  # untimed warm-up at this batch size (``auto`` measures its cost curve and starts its
            runners[name]([warmup] * size, WARMUP_TOKENS)  # round memory here, as a serving process would have)
        groups = _groups(prompts, size)
        partial = {n: [] for n in todo}
        for g, group in enumerate(groups):
            order = todo[g % len(todo):] + todo[: g % len(todo)]
            for name in order:
                partial[name].append(run_cell(runners[name], group, size, args.max_new_tokens))
        for name in todo:
            parts = partial[name]
            row[name] = {k: (sum(p[k] for p in parts) if k != "outputs" else [o for p in parts for o in p[k]])
                         for k in parts[0]}
            rate = row[name]["tokens"] / row[name]["wall_s"]
            log(f"batch {size} {name}: {rate:.1f} tok/s")
        record["summary"] = summarize(cells, args.budgets)
        record["updated_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        out_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(record, indent=1))
    record["summary"] = summarize(cells, args.budgets)
    record["machine"] = {**machine_identity(), "platform": platform.platform()}
    write_text_atomic(path, json.dumps(record, indent=1))
    print(format_table(record["summary"]))
    log(f"wrote {path}")
    return 0


def _resume(path: Path, settings: dict) -> dict:
    """The record at ``path`` when it was made with these settings (its finished cells are kept), else a new one."""
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            old = None
        if old and old.get("schema") == SCHEMA and old.get("settings") == settings:
            log(f"resuming {path}: {sum(len(r) for r in old['cells'].values())} cells already finished")
            return old
        if old:
            log(f"{path} was made with other settings: starting over")
    return {"schema": SCHEMA, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command_line": [sys.executable, "-m", "experiments.bench.throughput", *sys.argv[1:]],
            "settings": settings, "versions": {"torch": torch.__version__, "python": platform.python_version()},
            "machine": {}, "cells": {}}


if __name__ == "__main__":
    raise SystemExit(main())
