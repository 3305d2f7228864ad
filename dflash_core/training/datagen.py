"""Generate (more) training data: ``python -m dflash_core.training.datagen --out runs/data --minutes 60``.

The target answers every training prompt (:func:`dflash_core.training.prompts.build_prompts`) with
:func:`dflash_core.training.responses.generate_batch`; each batch becomes one shard (:mod:`.shards`). Prompts already
answered in ``--out`` are skipped, so reruns extend the corpus. ``--passes 2`` answers every prompt a second time,
sampled with another seed (``#p1`` keys), which adds data once the prompts run out.

On a CPU the work is split over ``--workers`` single-thread processes (one per core): a small machine's cores then
never wait on each other in lock-step, and another short job on the machine slows one worker, not all. On a GPU one
process generates with large batches; under ``torchrun`` each rank answers its share of the prompts on its own GPU.
Any Hugging Face causal LM can be the target (``--target``); ``--taps`` defaults to the drafter's 5-tap rule.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import time
from pathlib import Path

import torch

from ..timing import cpu_model
from .responses import fast_decoding, generate_batch, teacher_forced_ceiling
from .shards import ShardSample, done_prompt_keys, target_fingerprint, write_shard

__all__ = ["main", "prompt_plan"]


def prompt_plan(seed: int, passes: int):
    """[(prompt_key, PromptItem, pass)] in generation order: pass 0 over every prompt, then pass 1, ..."""
    from .prompts import build_prompts

    items = build_prompts(seed)
    return [(f"{it.prompt_id}#p{p}", it, p) for p in range(passes) for it in items]


def _worker(index: int, a: argparse.Namespace) -> None:
    torch.set_num_threads(a.threads)
    from .pools.catalog import build_chat
    from ..loading import load_target
    from .targets import default_taps, resolve_device

    device = resolve_device(a.device)
    target, tokenizer, stops = load_target(a.target, torch.bfloat16 if a.dtype == "bf16" else torch.float32, device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    layer_ids = [int(x) for x in a.taps.split(",")] if a.taps else default_taps(target)
    out = Path(a.out)
    done = done_prompt_keys(out)
    for other in a.skip_done_in or ():  # prompts answered in other data folders (e.g. the committed shards)
        done |= done_prompt_keys(other)
    plan = [x for k, x in enumerate(prompt_plan(a.seed, a.passes)) if k % a.workers == index and x[0] not in done]
    fingerprint = target_fingerprint(target)
    log = open(out / f"datagen.w{index}.log", "a", buffering=1)
    log.write(f"worker {index}: {len(plan)} prompts to go ({len(done)} done), target {fingerprint}\n")
    t_start = time.perf_counter()
    deadline = t_start + a.minutes * 60 if a.minutes else None
    total = batches = 0
    # batches of similar prompt length inside windows of 8 batches (less left padding), pass by pass
    window = a.batch * 8
    with fast_decoding(target):
        for w in range(0, len(plan), window):
            group = []
            for key, item, p in plan[w:w + window]:
                ids = build_chat(tokenizer, [item.text])
                if len(ids) <= a.max_prompt_tokens:
                    group.append((key, item, p, ids))
            group.sort(key=lambda x: len(x[3]))
            for b0 in range(0, len(group), a.batch):
                if a.max_batches is not None and batches >= a.max_batches:
                    log.write(f"worker {index}: --max-batches reached, {total} response tokens\n")
                    return
                batches += 1
                if deadline is not None and time.perf_counter() > deadline:
                    log.write(f"worker {index}: time budget reached, {total} response tokens\n")
                    return
                batch = group[b0:b0 + a.batch]
                rng = random.Random(f"mode:{a.seed}:{batch[0][0]}")
                sampled = batch[0][2] > 0 or rng.random() < a.sampled_fraction
                temperature = a.temperature if sampled else 0.0
                gen = torch.Generator(device=device).manual_seed(int(hashlib.sha256(f"{a.seed}:{batch[0][0]}".encode()).hexdigest()[:8], 16))
                t0 = time.perf_counter()
                res = generate_batch(target, [x[3] for x in batch], layer_ids, a.max_new_tokens, stops, pad,
                                     temperature=temperature, top_p=a.top_p, topk=a.topk, generator=gen)
                dt = time.perf_counter() - t0
                n_tok = sum(len(r.response_ids) for r in res)
                total += n_tok
                samples = [ShardSample(key, item.source, "sampled" if sampled else "greedy", len(ids), r.response_ids)
                           for (key, item, _, ids), r in zip(batch, res)]
                manifest = {
                    "target": fingerprint, "generator": "dflash_core.training.responses.generate_batch",
                    "taps": layer_ids, "max_new_tokens": a.max_new_tokens, "temperature": temperature,
                    "top_p": a.top_p if sampled else 1.0, "topk": a.topk, "seed": a.seed, "pass": batch[0][2],
                    "batch_size": len(batch), "dtype": a.dtype, "threads": a.threads, "workers": a.workers,
                    "cpu": cpu_model(), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu", "torch": torch.__version__, "seconds": dt,
                    "response_tokens_per_s": n_tok / dt, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                }
                name = f"shard-{time.strftime('%Y%m%d%H%M%S')}-w{index}-{b0 // a.batch + w // a.batch:05d}"
                write_shard(out, name, samples, manifest, [r.features for r in res],
                            [r.top_ids for r in res] if a.topk else None,
                            [r.top_logp for r in res] if a.topk else None)
                el = time.perf_counter() - t_start
                log.write(f"worker {index}: {name}: {len(batch)} x <= {len(batch[-1][3])}+{a.max_new_tokens} "
                          f"{'sampled' if sampled else 'greedy'}: {n_tok} tokens in {dt:.0f} s "
                          f"({n_tok / dt:.0f} tok/s); total {total} tokens, {total / el:.0f} tok/s, {el / 60:.1f} min\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m dflash_core.training.datagen", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="data folder (shards accumulate here)")
    p.add_argument("--minutes", type=float, default=None, help="stop starting new batches after this long")
    p.add_argument("--target", default="smollm2", help="'smollm2' (embedded) or a Hugging Face id / folder")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    p.add_argument("--workers", type=int, default=None,
                   help="processes (default: one per core, at most 2, on a CPU; one on a GPU)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--batch", type=int, default=None, help="sequences per batch (default: 96 on a CPU, 256 on a GPU)")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches per worker (smoke)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--skip-done-in", action="append", default=None,
                   help="also skip prompts answered in this data folder (repeatable): extend a corpus kept elsewhere")
    p.add_argument("--sampled-fraction", type=float, default=0.35, help="share of pass-0 batches that sample")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--topk", type=int, default=8, help="keep the target's top-k next-token distribution (0: none)")
    p.add_argument("--taps", default=None,
                   help="target layers whose hidden states are kept (default: the 5-tap rule, e.g. 1,8,14,20,27)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ceiling", action="store_true", help="only measure the teacher-forced ceiling and exit")
    a = p.parse_args(argv)
    from .targets import resolve_device

    gpu = resolve_device(a.device).type == "cuda"
    if a.workers is None:
        a.workers = 1 if gpu else max(1, min(2, os.cpu_count() or 1))
    if a.batch is None:
        a.batch = 256 if gpu else 96
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.ceiling:
        from ..loading import load_target

        torch.set_num_threads(a.threads * a.workers)
        target, _, _ = load_target(a.target, torch.bfloat16 if a.dtype == "bf16" else torch.float32,
                                   resolve_device(a.device))
        rate = teacher_forced_ceiling(target, 8, 320)
        print(json.dumps({"ceiling_tokens_per_s": rate, "threads": torch.get_num_threads(), "cpu": cpu_model(),
                          "dtype": a.dtype, "batch": 8, "length": 320}))
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # under torchrun: each rank answers its share of the prompts on its own GPU
        a.workers = world
        _worker(int(os.environ.get("RANK", "0")), a)
    elif a.workers > 1:
        import torch.multiprocessing as mp

        mp.spawn(_worker, args=(a,), nprocs=a.workers, join=True)
    else:
        _worker(0, a)


if __name__ == "__main__":
    main()
