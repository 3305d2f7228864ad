"""Our prompt-lookup decoding against transformers' on the same prompts, interleaved.

``python -m experiments.studies.pld_compare`` loads the embedded pair (dtype and CPU kernels chosen as the benchmark
does), takes the first turns of the benchmark's prompts (default: grounded, gsm8k, humaneval, mt-bench, 3 each) and
runs, per prompt, in an order that rotates from prompt to prompt:

* ``hf_greedy`` -- ``target.generate(ids, do_sample=False, max_new_tokens=N)`` (plain greedy in transformers);
* ``hf_pld``    -- the same with ``prompt_lookup_num_tokens=10`` (transformers' prompt lookup, its default
  ``max_matching_ngram_size`` of 2);
* ``pld``       -- :func:`dflash_core.lookup_generate` with its defaults (``max_ngram=3``, ``num_tokens=10``);
* ``ar``        -- :func:`dflash_core.autoregressive_generate` (plain decoding on the toolkit's loop).

Each call is timed whole with ``time.perf_counter`` (prefill included for every method), after one untimed warm-up
of each method on a short prompt. It prints tokens/s per dataset and overall, our PLD / HF PLD (median of per-prompt
tokens/s ratios and the token-weighted ratio: total tokens over total seconds, divided), both PLDs relative to HF
greedy, and whether the lookup outputs equal greedy ones (in bf16 a multi-token forward can round a near-tie the
other way: reported, not failed; ``--dtype fp32`` for an exact check). One JSON (per-prompt rows, the machine, dtype,
versions, the command line) is written atomically to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

__all__ = ["METHODS", "make_generator", "compare_prompts", "summarize", "benchmark_prompts", "main"]

METHODS = ("hf_greedy", "hf_pld", "pld", "ar")
HF_PLD_TOKENS = 10  # transformers' prompt_lookup_num_tokens
DEFAULT_DATASETS = ("grounded", "gsm8k", "humaneval", "mt-bench")
# (output, reference) pairs whose equality each row reports, where both methods ran
EQUALITY_PAIRS = (("hf_pld", "hf_greedy"), ("pld", "ar"), ("pld", "hf_greedy"), ("ar", "hf_greedy"))
WARMUP_TOKENS = 16


def log(message: str) -> None:
    print(f"[pld_compare] {message}", file=sys.stderr, flush=True)


def make_generator(method: str, target, stop_token_ids: Sequence[int] = (),
                   pad_token_id: int | None = None) -> Callable[[torch.Tensor, int], tuple[list[int], dict]]:
    """``run(input_ids [1, T], max_new_tokens) -> (new token ids, extra)`` for one of :data:`METHODS` (the stop token
    included when the generation stopped on one, as every method returns it); ``extra``: our loop's rounds and tau."""
    stops = [int(s) for s in stop_token_ids]
    if method in ("hf_greedy", "hf_pld"):
        base = copy.deepcopy(target.generation_config)
        base.do_sample = False
        base.eos_token_id = stops or None  # none: no stop (not the model config's default eos)
        base.pad_token_id = pad_token_id if pad_token_id is not None else (stops[0] if stops else 0)
        base.prompt_lookup_num_tokens = HF_PLD_TOKENS if method == "hf_pld" else None
        configs: dict[int, Any] = {}  # one config per length, copied once (first call at that length)

        def run(ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], dict]:
            if max_new_tokens not in configs:
                configs[max_new_tokens] = copy.deepcopy(base)
                configs[max_new_tokens].max_new_tokens = max_new_tokens
            out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=configs[max_new_tokens])
            return out[0, ids.shape[1]:].tolist(), {}
        return run
    from dflash_core import autoregressive_generate, lookup_generate

    if method not in ("pld", "ar"):
        raise ValueError(f"unknown method {method!r}: use one of {METHODS}")
    generate = lookup_generate if method == "pld" else autoregressive_generate

    def ours(ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], dict]:
        res = generate(target, ids, max_new_tokens=max_new_tokens, stop_token_ids=stops)
        return res.new_token_ids, {"rounds": len(res.acceptance_lengths), "tau": res.tau,
                                   "prefill_s": res.timings.get("prefill", 0.0)}
    return ours


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """None when equal, else the first index where they differ (the shorter one's length if one is a prefix)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _timed(run, ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], dict, float]:
    cuda = ids.is_cuda
    if cuda:
        torch.cuda.synchronize(ids.device)
    t0 = time.perf_counter()
    out, extra = run(ids, max_new_tokens)
    if cuda:
        torch.cuda.synchronize(ids.device)
    return out, extra, time.perf_counter() - t0


def compare_prompts(target, prompts: Sequence[Sequence[int]], methods: Sequence[str] = METHODS,
                    max_new_tokens: int = 128, stop_token_ids: Sequence[int] = (), pad_token_id: int | None = None,
                    warmup: Sequence[int] | None = None, labels: Sequence[dict] | None = None,
                    log: Callable[[str], None] | None = None, runners: dict[str, Callable] | None = None,
                    pairs: Sequence[tuple[str, str]] = EQUALITY_PAIRS) -> list[dict[str, Any]]:
    """One row per prompt (token id lists): every method run on it, in an order rotated by one per prompt.

    ``warmup``: a short prompt each method runs once, untimed, first. ``labels``: extra fields per row (dataset,
    sample id). A row holds the order, per method its new tokens, seconds and tokens/s, the outputs, and per pair of
    ``pairs`` whether the outputs are equal and where they first differ. ``runners``: ``{name: run(ids,
    max_new_tokens) -> (new ids, extra)}`` to compare other generators (then ``methods`` is ignored).
    """
    device = next(target.parameters()).device
    if runners is None:
        runners = {m: make_generator(m, target, stop_token_ids, pad_token_id) for m in methods}
    methods = list(runners)
    if warmup is not None:
        warm = torch.tensor([list(warmup)], dtype=torch.long, device=device)
        for m in methods:
            runners[m](warm, WARMUP_TOKENS)
    rows = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        shift = i % len(methods)
        order = methods[shift:] + methods[:shift]
        outputs, stats = {}, {}
        for m in order:
            outputs[m], extra, seconds = _timed(runners[m], ids, max_new_tokens)
            stats[m] = {"tokens": len(outputs[m]), "seconds": seconds,
                        "tok_s": len(outputs[m]) / max(seconds, 1e-9), **extra}
        equal, first_diff = {}, {}
        for a, b in pairs:
            if a in outputs and b in outputs:
                first_diff[f"{a}~{b}"] = _first_difference(outputs[a], outputs[b])
                equal[f"{a}~{b}"] = first_diff[f"{a}~{b}"] is None
        row = {**(dict(labels[i]) if labels else {}), "index": i, "prompt_tokens": len(prompt), "order": order,
               "methods": {m: stats[m] for m in methods}, "equal": equal, "first_difference": first_diff,
               "outputs": {m: outputs[m] for m in methods}}
        rows.append(row)
        if log:
            speeds = "  ".join(f"{m} {stats[m]['tok_s']:6.1f}" for m in methods)
            differs = [k for k, v in equal.items() if not v]
            log(f"[{i + 1}/{len(prompts)}] {row.get('dataset', '')} {row.get('sample_id', '')}: tok/s {speeds}"
                + (f"  (differs: {', '.join(differs)})" if differs else ""))
    return rows


def _ratios(rows: list[dict], num: str, den: str) -> dict[str, float] | None:
    """num/den: the median of per-prompt tokens/s ratios and the token-weighted ratio (tokens/total seconds each)."""
    if not rows or num not in rows[0]["methods"] or den not in rows[0]["methods"]:
        return None
    per = [r["methods"][num]["tok_s"] / max(r["methods"][den]["tok_s"], 1e-12) for r in rows]

    def rate(m: str) -> float:
        return sum(r["methods"][m]["tokens"] for r in rows) / max(sum(r["methods"][m]["seconds"] for r in rows), 1e-12)
    return {"median": statistics.median(per), "weighted": rate(num) / max(rate(den), 1e-12),
            "min": min(per), "max": max(per)}


def _group_summary(rows: list[dict]) -> dict[str, Any]:
    methods = list(rows[0]["methods"])
    tok_s = {m: sum(r["methods"][m]["tokens"] for r in rows) / max(sum(r["methods"][m]["seconds"] for r in rows),
                                                                      1e-12) for m in methods}
    ratios = {f"{a}/{b}": _ratios(rows, a, b) for a, b in
              (("pld", "hf_pld"), ("hf_pld", "hf_greedy"), ("pld", "hf_greedy"), ("ar", "hf_greedy"))}
    equal = {k: sum(r["equal"][k] for r in rows) for k in rows[0]["equal"]}
    return {"prompts": len(rows), "tokens": {m: sum(r["methods"][m]["tokens"] for r in rows) for m in methods},
            "tok_s": tok_s, "ratios": {k: v for k, v in ratios.items() if v is not None}, "equal": equal}


def summarize(rows: list[dict]) -> dict[str, dict[str, Any]]:
    """{dataset or "overall": prompts, tokens and token-weighted tokens/s per method, ratios, equality counts}."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(str(r.get("dataset", "prompts")), []).append(r)
    out = {name: _group_summary(g) for name, g in groups.items()}
    if rows:
        out["overall"] = _group_summary(rows)
    return out


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    """The summary as a text table: tokens/s per method, then the ratios (median / token-weighted)."""
    if not summary:
        return "(no prompts)"
    methods = list(next(iter(summary.values()))["tok_s"])
    ratio_keys = list(next(iter(summary.values()))["ratios"])
    head = (f"{'dataset':<12}{'n':>3}" + "".join(f"{m + ' tok/s':>16}" for m in methods)
            + "".join(f"{k + ' med/wt':>24}" for k in ratio_keys) + "  equal")
    lines = [head, "-" * len(head)]
    for name, s in summary.items():
        ratios = "".join(f"{s['ratios'][k]['median']:>14.3f} /{s['ratios'][k]['weighted']:>6.3f}  " for k in ratio_keys)
        equal = ", ".join(f"{k} {v}/{s['prompts']}" for k, v in s["equal"].items())
        lines.append(f"{name:<12}{s['prompts']:>3}" + "".join(f"{s['tok_s'][m]:>16.1f}" for m in methods)
                     + ratios + "  " + equal)
    return "\n".join(lines)


def benchmark_prompts(tokenizer, datasets: Sequence[str], max_samples: int, seed: int = 0,
                      chat_template_kwargs: dict | None = None) -> tuple[list[list[int]], list[dict]]:
    """(input id lists, labels) of the first turns of the benchmark's selection, chat template as the benchmark's."""
    from dflash_core.pools.catalog import build_chat, select_items

    prompts, labels = [], []
    for name in datasets:
        for item in select_items(name, max_samples, seed):
            prompts.append(build_chat(tokenizer, item.turns[:1], chat_template_kwargs=chat_template_kwargs))
            labels.append({"dataset": item.dataset, "sample_id": item.sample_id})
    return prompts, labels


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = prompt_parser("pld_compare", __doc__, DEFAULT_DATASETS, METHODS, max_samples=3)
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto: as the benchmark (bf16 on CPUs with bf16 instructions, else fp32)")
    p.add_argument("--cpu-kernels", choices=("auto", "torch", "packed"), default="auto",
                   help="linear kernels on a CPU (dflash_core.cpu_kernels; auto as the default preset)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available, else the CPU), cuda, cuda:1, cpu")
    p.add_argument("--seed", type=int, default=0, help="the benchmark's selection seed")
    p.add_argument("--out", default="runs/pld_compare/pld_compare.json")
    return split_lists(p, p.parse_args(argv), METHODS)


def prompt_parser(name: str, doc: str, datasets: Sequence[str], methods: Sequence[str],
                  max_samples: int) -> argparse.ArgumentParser:
    """The arguments the side-by-side studies share: --datasets, --max-samples, --max-new-tokens, --methods."""
    p = argparse.ArgumentParser(prog=f"python -m experiments.studies.{name}", description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default=",".join(datasets), help="comma-separated (first turns only)")
    p.add_argument("--max-samples", type=int, default=max_samples, help=f"prompts per dataset (default {max_samples})")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default=",".join(methods), help=f"comma-separated subset of {','.join(methods)}")
    return p


def split_lists(parser: argparse.ArgumentParser, args: argparse.Namespace,
                methods: Sequence[str]) -> argparse.Namespace:
    """``--methods`` and ``--datasets`` as lists; a method outside ``methods`` (or none) stops with the choices."""
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in methods]
    if bad or not args.methods:
        parser.error(f"--methods: unknown {bad}; use a subset of {','.join(methods)}")
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    return args


def _verdict(summary: dict) -> str:
    r = summary.get("overall", {}).get("ratios", {}).get("pld/hf_pld")
    if r is None:
        return "our PLD vs HF PLD: not both measured"
    ok = r["weighted"] >= 1.0 and r["median"] >= 1.0
    return (f"our PLD / HF PLD: median {r['median']:.3f}, token-weighted {r['weighted']:.3f} -> "
            f"{'at least as fast' if ok else 'NOT at least as fast'} (criterion: both ratios >= 1)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    from dflash_core import load_default_pair
    from dflash_core.cpu_kernels import apply_cpu_kernels
    from dflash_core.default import default_dtype, resolve_device, stop_token_ids
    from dflash_core.files import write_text_atomic
    from dflash_core.timing import machine_identity
    from dflash_core.pools.catalog import build_chat
    from experiments.bench.presets import PRESETS
    from experiments.bench.session import WARMUP_PROMPT

    transformers.utils.logging.set_verbosity_error()  # generate()'s per-call notices would drown the progress lines
    device = resolve_device(args.device)
    dtype = {"auto": default_dtype(device), "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    target, draft, tokenizer = load_default_pair(dtype, device)
    kernels = apply_cpu_kernels(target, draft, kernels=args.cpu_kernels)
    stops = stop_token_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    chat_kwargs = dict(PRESETS["default"].models[0].chat_template_kwargs) or None
    prompts, labels = benchmark_prompts(tokenizer, args.datasets, args.max_samples, args.seed, chat_kwargs)
    warmup = build_chat(tokenizer, [WARMUP_PROMPT], chat_template_kwargs=chat_kwargs)
    log(f"{len(prompts)} prompts x {len(args.methods)} methods x {args.max_new_tokens} tokens, "
        f"{str(target.dtype).removeprefix('torch.')}, kernels {kernels}, {torch.get_num_threads()} threads")
    hf_ngram = target.generation_config.max_matching_ngram_size or 2  # what generate() falls back to
    t0 = time.perf_counter()
    rows = compare_prompts(target, prompts, args.methods, args.max_new_tokens, stops, pad, warmup, labels, log)
    summary = summarize(rows)
    print(format_table(summary))
    print(_verdict(summary))
    record = {"schema": "pld_compare/1", "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command_line": [sys.executable, "-m", "experiments.studies.pld_compare",
                               *(sys.argv[1:] if argv is None else argv)],
              "machine": {**machine_identity(), "platform": platform.platform()},
              "device": str(device), "dtype": str(target.dtype).removeprefix("torch."), "cpu_kernels": {"asked": args.cpu_kernels,
                                                                                 "in_effect": kernels},
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version()},
              "settings": {"datasets": args.datasets, "max_samples": args.max_samples, "seed": args.seed,
                           "max_new_tokens": args.max_new_tokens, "methods": args.methods,
                           "hf_prompt_lookup_num_tokens": HF_PLD_TOKENS, "hf_max_matching_ngram_size": hf_ngram,
                           "pld_max_ngram": 3, "pld_num_tokens": 10, "warmup_tokens": WARMUP_TOKENS,
                           "stop_token_ids": stops, "pad_token_id": pad},
              "wall_s": time.perf_counter() - t0, "verdict": _verdict(summary), "summary": summary, "rows": rows}
    write_text_atomic(args.out, json.dumps(record, indent=1))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
