"""The embedded target on this CPU against what a user would run instead, side by side, and its step against the
memory floor: ``python -m experiments.studies.cpu_peers``.

Greedy, the same first-turn prompts of the benchmark (default: gsm8k, humaneval, mt-bench, grounded; 2 each), every
method on every prompt in an order rotated per prompt (:func:`compare_prompts`), each call timed whole (prefill
included), after one untimed warm-up of each method and, for ``auto``, its cost curves measured up front for every
prompt's context bucket (:func:`ddtree.cost.calibrate`, as the benchmark does), so that no timed call measures one:

* ``ar``            -- :func:`dflash_core.autoregressive_generate`, our plain decoding (the baseline of every speedup);
* ``hf_greedy``     -- transformers' ``generate()`` greedy on the same model object;
* ``pld``, ``hf_pld`` (asked for with ``--methods``) -- prompt lookup: :func:`dflash_core.lookup_generate` with its
  defaults, and transformers' ``generate(prompt_lookup_num_tokens=10)``;
* ``llama_cpp``     -- llama.cpp through ``llama-cpp-python`` on the very GGUF file the toolkit ships (Q4_1), greedy
  (``top_k=1``, no repeat penalty), ``--threads`` threads; its weights are the 4-bit originals, so its text may leave
  ours where a 4-bit product rounds a near-tie the other way (reported: tokens equal to ``ar`` and the first
  difference);
* ``dflash``, ``ddtree_auto``, ``ddtree_lookup`` -- the shipped drafter's chain, DDTree with ``budget="auto"``, and
  DDTree ``auto`` with lookup branches; ``ddtree_8``, ``ddtree_16``, ``ddtree_lookup8`` (asked for with
  ``--methods``) -- fixed budgets, to pair ``auto`` with the best fixed budget on the same prompts.

Besides whole-call rates, the decode rate after the first token (ms per token of the rest; the prompt's forward and
the first token are the prefill: ours from the loop's own timing, llama.cpp's up to its first token; transformers'
``generate()`` does not split them).

llama.cpp runs in this process; a crash would take the study down, so a one-batch probe runs first in a child process
with the extra (repacked / AMX) weight buffers and, if that probe dies, again without them (``use_extra_bufts=False``);
what was used and why is recorded. Without the package the method is skipped with the reason.

The floor part (``--floor``, on by default): the bytes of weights one plain step reads (every parameter once; tied
embeddings once), the machine's read bandwidth (median of timed reductions over a 512 MiB tensor), the floor
``bytes / bandwidth``, the median one-token step and the verify cost curve (one forward appending N = 1 ... 64 tokens
under a tree mask to a 200-token cache) of our target forward. Prints tables; ``--out`` writes one JSON atomically.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import torch

__all__ = ["METHODS", "DEFAULT_METHODS", "make_generator", "compare_prompts", "probe_llama_cpp", "make_llama_cpp",
           "make_ours", "memory_floor", "summarize", "main"]

DEFAULT_METHODS = ("ar", "hf_greedy", "llama_cpp", "dflash", "ddtree_auto", "ddtree_lookup")
METHODS = DEFAULT_METHODS + ("pld", "hf_pld", "ddtree_8", "ddtree_16", "ddtree_lookup8")
DEFAULT_DATASETS = ("gsm8k", "humaneval", "mt-bench", "grounded")
VERIFY_NODES = (1, 2, 4, 8, 16, 32, 64)
HF_PLD_TOKENS = 10  # transformers' prompt_lookup_num_tokens
WARMUP_TOKENS = 16
PROBE = """
import sys
from llama_cpp import Llama, llama_cpp
extra = sys.argv[2] == "1"
default = llama_cpp.llama_model_default_params
def params():
    p = default(); p.use_extra_bufts = extra; return p
llama_cpp.llama_model_default_params = params
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[3]), n_ctx=256, verbose=False)
llm.eval(list(range(1, 33)))
print("ok")
"""


def log(message: str) -> None:
    print(f"[cpu_peers] {message}", file=sys.stderr, flush=True)


def make_generator(method: str, target, stop_token_ids: Sequence[int] = (),
                   pad_token_id: int | None = None) -> Callable[[torch.Tensor, int], tuple[list[int], dict]]:
    """``run(input_ids [1, T], max_new_tokens) -> (new token ids, extra)`` for ``ar``, ``pld`` (our loop: ``extra``
    holds its rounds, tau and prefill seconds), ``hf_greedy`` or ``hf_pld`` (transformers' ``generate()``); the stop
    token is included when the generation stopped on one, as every method returns it."""
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
        raise ValueError(f"unknown method {method!r}: use one of ar, pld, hf_greedy, hf_pld")
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


def compare_prompts(target, prompts: Sequence[Sequence[int]], runners: dict[str, Callable],
                    max_new_tokens: int = 128, pairs: Sequence[tuple[str, str]] = (),
                    warmup: Sequence[int] | None = None, labels: Sequence[dict] | None = None,
                    log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One row per prompt (token id lists): every runner (``{name: run(ids, max_new_tokens) -> (new ids, extra)}``)
    on it, in an order rotated by one per prompt.

    ``warmup``: a short prompt each runner runs once, untimed, first. ``labels``: extra fields per row (dataset,
    sample id). A row holds the order, per method its new tokens, seconds and tokens/s, the outputs, and per pair of
    ``pairs`` whether the two outputs are equal and where they first differ.
    """
    device = next(target.parameters()).device
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
        first_diff = {f"{a}~{b}": _first_difference(outputs[a], outputs[b]) for a, b in pairs
                      if a in outputs and b in outputs}
        row = {**(dict(labels[i]) if labels else {}), "index": i, "prompt_tokens": len(prompt), "order": order,
               "methods": {m: stats[m] for m in methods}, "equal": {k: v is None for k, v in first_diff.items()},
               "first_difference": first_diff, "outputs": {m: outputs[m] for m in methods}}
        rows.append(row)
        if log:
            speeds = "  ".join(f"{m} {stats[m]['tok_s']:6.1f}" for m in methods)
            differs = [k for k, v in row["equal"].items() if not v]
            log(f"[{i + 1}/{len(prompts)}] {row.get('dataset', '')} {row.get('sample_id', '')}: tok/s {speeds}"
                + (f"  (differs: {', '.join(differs)})" if differs else ""))
    return rows


def probe_llama_cpp(gguf: str, threads: int) -> dict[str, Any]:
    """Whether llama.cpp can evaluate a batch on this CPU: tried in a child process with the extra weight buffers,
    then without them. ``{"usable": bool, "extra_bufts": bool | None, "tries": [...]}``."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return {"usable": False, "extra_bufts": None,
                "why": "llama-cpp-python is not installed (`pip install llama-cpp-python` builds llama.cpp from source: "
                       "about 8 minutes on 2 cores, needs gcc and cmake)", "tries": []}
    tries = []
    for extra in (True, False):
        proc = subprocess.run([sys.executable, "-c", PROBE, gguf, "1" if extra else "0", str(threads)],
                              capture_output=True, text=True, timeout=300)
        tries.append({"extra_bufts": extra, "returncode": proc.returncode, "stderr_tail": proc.stderr[-600:]})
        if proc.returncode == 0 and proc.stdout.strip().endswith("ok"):
            return {"usable": True, "extra_bufts": extra, "tries": tries}
    return {"usable": False, "extra_bufts": None, "why": "every probe failed (see tries)", "tries": tries}


def make_llama_cpp(gguf: str, threads: int, extra_bufts: bool, stop_token_ids: Sequence[int],
                   n_ctx: int = 4096) -> Callable[[torch.Tensor, int], tuple[list[int], dict]]:
    """``run(input_ids [1, T], max_new_tokens) -> (new ids, {})``: llama.cpp greedy on ``gguf`` (the stop token
    included when hit, as our methods return it)."""
    from llama_cpp import Llama, llama_cpp

    default = llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = extra_bufts
        return p
    llama_cpp.llama_model_default_params = params  # Llama() takes no such argument; restored right after loading
    try:
        llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False)
    finally:
        llama_cpp.llama_model_default_params = default
    stops = {int(s) for s in stop_token_ids}

    def run(ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], dict]:
        llm.reset()  # no prefix reuse from the previous prompt: every call prefills its whole prompt
        out: list[int] = []
        t0, prefill_s = time.perf_counter(), 0.0
        for token in llm.generate(ids[0].tolist(), top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            if not out:  # the prompt's forward and the first token, as our prefill
                prefill_s = time.perf_counter() - t0
            out.append(int(token))
            if int(token) in stops or len(out) >= max_new_tokens:
                break
        return out, {"prefill_s": prefill_s}
    return run


def make_ours(method: str, target, draft, stop_token_ids: Sequence[int]) -> Callable:
    """Our speculative methods as ``run(ids, max_new_tokens) -> (new ids, {"rounds", "tau"})``; ``auto`` keeps one
    memory over the method's calls, as a serving process (and the benchmark) would."""
    from ddtree import RoundMemory, ddtree_generate

    settings = {"dflash": {"budget": "chain"}, "ddtree_auto": {"budget": "auto"}, "ddtree_8": {"budget": 8},
                "ddtree_16": {"budget": 16}, "ddtree_lookup": {"budget": "auto", "lookup": True},
                "ddtree_lookup8": {"budget": 8, "lookup": True}}[method]
    if settings["budget"] == "auto":
        settings["memory"] = RoundMemory()
    stops = [int(s) for s in stop_token_ids]

    def run(ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], dict]:
        res = ddtree_generate(target, draft, ids, max_new_tokens=max_new_tokens, stop_token_ids=stops, **settings)
        return res.new_token_ids, {"rounds": len(res.acceptance_lengths), "tau": res.tau,
                                   "prefill_s": res.timings.get("prefill", 0.0)}
    return run


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter, each storage once (tied embeddings and LM head count once)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = p.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += p.untyped_storage().nbytes()
    return total


def memory_floor(target, draft, repeats: int = 15, context: int = 200) -> dict[str, Any]:
    """Weight bytes, read bandwidth, the floor, the one-token step and the verify curve of our target forward."""
    from dflash_core.target import TargetAdapter
    from dflash_core.timing import median_seconds

    big = torch.ones(256 * 1024 * 1024, dtype=torch.bfloat16)  # 512 MiB: far beyond any cache
    read_s = median_seconds(lambda: big.sum(), repeats=7, warmup=2)
    bandwidth = big.numel() * big.element_size() / read_s
    del big
    adapter = TargetAdapter(target, draft.config.target_layer_ids)
    cache = adapter.new_cache()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, adapter.vocab_size, (1, context + max(VERIFY_NODES)), generator=gen)
    positions = torch.arange(context + max(VERIFY_NODES))[None]
    adapter.forward(ids[:, :context], positions[:, :context], cache, rows=torch.tensor([context - 1]))
    curve = {}
    for n in VERIFY_NODES:
        # a chain-shaped tree under an explicit mask (the whole cache, then the new tokens' ancestors): a verify's path
        visible = torch.cat([torch.ones(n, context, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)

        def verify(n=n, visible=visible[None]):
            adapter.forward(ids[:, context:context + n], positions[:, context:context + n], cache,
                            visible=None if n == 1 else visible)
            adapter.crop(cache, context)
        curve[n] = median_seconds(verify, repeats=repeats, warmup=2) * 1e3
    weights = _weight_bytes(target)
    floor_ms = weights / bandwidth * 1e3
    return {"weight_bytes": weights, "bandwidth_gb_s": bandwidth / 1e9, "floor_ms": floor_ms,
            "step_ms": curve[1], "step_over_floor": curve[1] / floor_ms, "context": context,
            "verify_ms": {str(n): v for n, v in curve.items()},
            "verify_over_step": {str(n): v / curve[1] for n, v in curve.items()}}


def summarize(rows: list[dict]) -> dict[str, dict[str, Any]]:
    """Per method: tokens, seconds, token-weighted tokens/s and ms per token, the median per-prompt tokens/s ratio
    over ``ar`` and over ``llama_cpp`` (where measured), tau, and the prompts whose output equals ``ar``'s."""
    methods = list(rows[0]["methods"]) if rows else []
    out = {}
    for m in methods:
        tokens = sum(r["methods"][m]["tokens"] for r in rows)
        seconds = sum(r["methods"][m]["seconds"] for r in rows)
        entry: dict[str, Any] = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / max(seconds, 1e-12),
                                 "ms_per_token": seconds / max(tokens, 1) * 1e3}
        if all("prefill_s" in r["methods"][m] for r in rows):  # after the first token: decoding alone
            decode_s = sum(r["methods"][m]["seconds"] - r["methods"][m]["prefill_s"] for r in rows)
            entry["decode_ms_per_token"] = decode_s / max(tokens - len(rows), 1) * 1e3
            entry["prefill_s"] = sum(r["methods"][m]["prefill_s"] for r in rows)
        for base in ("ar", "llama_cpp"):
            if base in methods:
                entry[f"over_{base}"] = statistics.median(
                    r["methods"][m]["tok_s"] / max(r["methods"][base]["tok_s"], 1e-12) for r in rows)
        taus = [r["methods"][m]["tau"] for r in rows if "tau" in r["methods"][m]]
        if taus:
            entry["tau"] = statistics.fmean(taus)
        if m != "ar" and f"{m}~ar" in rows[0]["equal"]:
            entry["equal_to_ar"] = sum(r["equal"][f"{m}~ar"] for r in rows)
        out[m] = entry
    return out


def format_tables(summary: dict, floor: dict | None, prompts: int) -> str:
    lines = [f"{'method':<15}{'tok/s':>8}{'ms/token':>10}{'decode ms/tok':>15}{'prefill s':>11}{'x ar':>8}"
             f"{'x llama.cpp':>13}{'tau':>7}{'equal ar':>10}"]
    nan = float("nan")
    for m, s in summary.items():
        eq = f"{s['equal_to_ar']}/{prompts}" if "equal_to_ar" in s else "-"
        lines.append(f"{m:<15}{s['tok_s']:>8.1f}{s['ms_per_token']:>10.2f}{s.get('decode_ms_per_token', nan):>15.2f}"
                     f"{s.get('prefill_s', nan):>11.2f}{s.get('over_ar', nan):>8.2f}"
                     f"{s.get('over_llama_cpp', nan):>13.2f}{s.get('tau', nan):>7.2f}{eq:>10}")
    if floor:
        lines.append(f"plain step {floor['step_ms']:.2f} ms; floor {floor['floor_ms']:.2f} ms "
                     f"({floor['weight_bytes'] / 1e6:.0f} MB at {floor['bandwidth_gb_s']:.1f} GB/s): "
                     f"{floor['step_over_floor']:.2f}x the floor")
        lines.append("verify ms (N tokens): " + ", ".join(f"{n}: {v:.1f}" for n, v in floor["verify_ms"].items()))
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from dflash_core.cpu_kernels import KERNEL_CHOICES

    p = argparse.ArgumentParser(prog="python -m experiments.studies.cpu_peers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default=",".join(DEFAULT_DATASETS), help="comma-separated (first turns only)")
    p.add_argument("--max-samples", type=int, default=2, help="prompts per dataset (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    p.add_argument("--cpu-kernels", choices=KERNEL_CHOICES, default="auto")
    p.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp threads")
    p.add_argument("--no-floor", dest="floor", action="store_false", help="skip the memory-floor part")
    p.add_argument("--out", default="runs/cpu_peers/cpu_peers.json")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad or not args.methods:
        p.error(f"--methods: unknown {bad}; use a subset of {','.join(METHODS)}")
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    return args


def _runners(args, target, draft, stops, pad) -> tuple[dict[str, Callable], dict | None]:
    from dflash_core.default import gguf_path

    runners: dict[str, Callable] = {}
    llama = None
    for m in args.methods:
        if m in ("ar", "hf_greedy", "pld", "hf_pld"):
            runners[m] = make_generator(m, target, stops, pad)
        elif m == "llama_cpp":
            gguf = str(gguf_path())
            llama = {"gguf": gguf, **probe_llama_cpp(gguf, args.threads)}
            log(f"llama.cpp: {'usable' if llama['usable'] else 'NOT usable'}"
                + (f", extra weight buffers {'on' if llama['extra_bufts'] else 'off'}" if llama["usable"] else
                   f": {llama.get('why')}"))
            if llama["usable"]:
                runners[m] = make_llama_cpp(gguf, args.threads, llama["extra_bufts"], stops)
        else:
            runners[m] = make_ours(m, target, draft, stops)
    return runners, llama


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers
    from dflash_core import load_default_pair
    from dflash_core.cpu_kernels import apply_cpu_kernels
    from dflash_core.default import stop_token_ids
    from dflash_core.training.pools.catalog import build_chat
    from dflash_core.timing import machine_identity
    from experiments.bench.conversation import benchmark_prompts
    from experiments.bench.models import resolve_dtype
    from experiments.bench.schema import write_json_atomic
    from experiments.bench.session import WARMUP_PROMPT

    transformers.utils.logging.set_verbosity_error()
    device = torch.device("cpu")
    dtype = resolve_dtype(args.dtype, device)
    target, draft, tokenizer = load_default_pair(dtype, device)
    kernels = apply_cpu_kernels(target, draft, kernels=args.cpu_kernels)
    stops = stop_token_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    runners, llama = _runners(args, target, draft, stops, pad)
    prompts, labels = benchmark_prompts(tokenizer, args.datasets, args.max_samples)
    warmup = build_chat(tokenizer, [WARMUP_PROMPT])
    log(f"{len(prompts)} prompts x {len(runners)} methods x {args.max_new_tokens} tokens, "
        f"{str(target.dtype).removeprefix('torch.')}, kernels {kernels}, {args.threads} threads")
    t0 = time.perf_counter()
    pairs = [(m, "ar") for m in runners if m != "ar"]
    if any(m in ("ddtree_auto", "ddtree_lookup") for m in runners):
        from ddtree.cost import calibrate

        calibrate(target, draft, contexts=[len(p) for p in prompts])
    rows = compare_prompts(target, prompts, runners, args.max_new_tokens, pairs, warmup, labels, log)
    floor = memory_floor(target, draft) if args.floor else None
    summary = summarize(rows)
    print(format_tables(summary, floor, len(rows)))
    record = {"schema": "cpu_peers/1", "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command_line": [sys.executable, "-m", "experiments.studies.cpu_peers",
                               *(sys.argv[1:] if argv is None else argv)],
              "machine": {**machine_identity(), "platform": platform.platform()},
              "dtype": str(target.dtype).removeprefix("torch."), "cpu_kernels": kernels, "threads": args.threads,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "llama_cpp": _version("llama_cpp_python"), "python": platform.python_version()},
              "settings": {"datasets": args.datasets, "max_samples": args.max_samples,
                           "max_new_tokens": args.max_new_tokens, "methods": list(runners), "stop_token_ids": stops},
              "llama_cpp": llama, "wall_s": time.perf_counter() - t0, "summary": summary, "floor": floor,
              "rows": rows}
    write_json_atomic(args.out, record)
    log(f"wrote {args.out}")
    return 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
