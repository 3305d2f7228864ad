"""A masked verify with grouped-query K/V read in place against transformers' per-head copy:
``python -m experiments.studies.grouped_verify``.

On the embedded target, for each context length (a random prompt prefilled once) and each tree size N (a chain under
an explicit ancestor mask; N = 1 runs without a mask, as a plain step does), the same verify forward is timed with
:mod:`dflash_core.grouped` on and off, alternating which goes first, and the cache cropped back after each. Prints
one line per cell and writes the medians (milliseconds) as JSON, atomically.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

__all__ = ["time_cell", "main"]


def time_cell(adapter, cache, ids: torch.Tensor, context: int, nodes: int, repeats: int) -> tuple[float, float]:
    """Median ms of one verify of ``nodes`` tokens after ``context`` cached ones: (in place, copied)."""
    grouped = adapter.grouped
    visible = torch.cat([torch.ones(nodes, context, dtype=torch.bool),
                         torch.ones(nodes, nodes, dtype=torch.bool).tril()], 1)[None]
    positions = torch.arange(context, context + nodes)[None]
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(repeats + 1):
        for on in ((True, False) if rep % 2 == 0 else (False, True)):
            adapter.grouped = grouped if on else []
            start = time.perf_counter()
            with torch.inference_mode():
                adapter.forward(ids[:, context:context + nodes], positions, cache,
                                visible=None if nodes == 1 else visible)
            if rep:  # the first pass warms up
                times[on].append(time.perf_counter() - start)
            adapter.crop(cache, context)
    adapter.grouped = grouped
    return statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.grouped_verify",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="100,1000,3000,6000")
    p.add_argument("--nodes", default="1,8,16,32,64")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/grouped_verify.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from dflash_core import load_default_pair
    from dflash_core.cpu_kernels import apply_cpu_kernels
    from dflash_core.target import TargetAdapter
    from dflash_core.timing import machine_identity
    from experiments.bench.schema import write_text_atomic

    target, draft, _ = load_default_pair()
    apply_cpu_kernels(target, draft, kernels="auto")
    adapter = TargetAdapter(target, draft.config.target_layer_ids)
    nodes = [int(n) for n in args.nodes.split(",")]
    cells = {}
    for context in (int(c) for c in args.contexts.split(",")):
        cache = adapter.new_cache()
        ids = torch.randint(0, adapter.vocab_size, (1, context + max(nodes)),
                            generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            adapter.forward(ids[:, :context], torch.arange(context)[None], cache, rows=torch.tensor([context - 1]))
        for n in nodes:
            in_place, copied = time_cell(adapter, cache, ids, context, n, args.repeats)
            cells[f"{context}/{n}"] = {"in_place_ms": in_place, "copied_ms": copied}
            print(f"context {context:5d} nodes {n:3d}: in place {in_place:7.1f} ms, copied {copied:7.1f} ms, "
                  f"ratio {in_place / copied:.2f}", flush=True)
    record = {"machine": machine_identity(), "dtype": str(target.dtype), "threads": args.threads,
              "grouped_configs": len(adapter.grouped), "cells": cells}
    write_text_atomic(args.out, json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
