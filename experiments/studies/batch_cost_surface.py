"""What one target forward costs for a batch of sequences on this machine, and what that says about speculative
decoding under concurrency: ``python -m experiments.studies.batch_cost_surface``.

The surface: for batch sizes B and tokens per sequence N, the median seconds of ONE forward of the embedded target
appending N tokens to each of B sequences on a ``--context``-token cache (a [B, 1, N, context + N] additive mask: the
cache fully visible, the new tokens under a chain-shaped tree mask; N = 1 is the plain step, no mask), with the
drafter's tapped features, as a verify needs them. Plain transformers batching (every sequence at the same length);
ragged trees and per-sequence compaction are not part of the price.

From the surface and the drafter's tau at each tree size (``--tau``: ``N:tau`` pairs measured elsewhere, default the
shipped drafter's replayed fixed-protocol tau: the chain's 15 nodes 2.13, B=8 2.47, B=32 2.99), it prints the throughput
each would reach, labelled as a projection: plain decoding B / t(B, 1) tokens per second, and speculative decoding
B * tau(n) / (t(B, n + 1) + B * t_draft) with ``t_draft`` the measured single-sequence drafter pass (a batched drafter
pass would cost less: an upper bound on the drafter's share). ``--out`` writes JSON atomically.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import torch

__all__ = ["forward_surface", "project", "main"]

DEFAULT_TAU = {15: 2.133, 8: 2.468, 32: 2.989}  # v7, fixed protocol, replayed (bf16): the chain's 15 nodes, B=8, B=32


@torch.inference_mode()
def forward_surface(target, layer_ids: Sequence[int], batches: Sequence[int], nodes: Sequence[int],
                    context: int = 200, repeats: int = 7) -> dict[int, dict[int, float]]:
    """{B: {N: median ms}} of one target forward appending N tokens to each of B sequences (see the module doc)."""
    from transformers import DynamicCache

    from dflash_core.target import TargetAdapter, tapped_forward
    from dflash_core.timing import median_seconds

    cache_kw = TargetAdapter(target, ())._cache_kw  # `cache=` or `past_key_values=`, as the installed version takes
    vocab = target.config.vocab_size
    dtype = target.lm_head.weight.dtype
    gen = torch.Generator().manual_seed(0)
    out: dict[int, dict[int, float]] = {}
    for b in batches:
        cache = DynamicCache()
        ids = torch.randint(0, vocab, (b, context + max(nodes)), generator=gen)
        tapped_forward(target, ids[:, :context], layer_ids, **{cache_kw: cache}, use_cache=True, logits_to_keep=1)
        out[b] = {}
        for n in nodes:
            hidden = torch.zeros(b, 1, n, context + n, dtype=torch.bool)
            hidden[..., context:] = ~torch.tril(torch.ones(n, n, dtype=torch.bool))
            mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, torch.finfo(dtype).min)
            positions = torch.arange(context, context + n).expand(b, n)

            def call(n=n, mask=mask, positions=positions):
                tapped_forward(target, ids[:, context:context + n], layer_ids, **{cache_kw: cache}, use_cache=True,
                               attention_mask=None if n == 1 else mask, position_ids=positions)
                for layer in cache.layers:  # back to the context
                    layer.keys, layer.values = layer.keys[..., :context, :], layer.values[..., :context, :]
            out[b][n] = median_seconds(call, repeats=repeats, warmup=1) * 1e3
    return out


def project(surface: dict[int, dict[int, float]], tau: dict[int, float], draft_ms: float) -> dict[int, dict]:
    """Per batch size: plain tokens/s, and per tree size n (with tau(n) known and n + 1 measured) the projected
    speculative tokens/s and its ratio to plain at that batch size."""
    out = {}
    for b, row in surface.items():
        plain = b / row[1] * 1e3
        spec = {n: b * t / (row[n + 1] + b * draft_ms) * 1e3 for n, t in tau.items() if n + 1 in row}
        out[b] = {"plain_tok_s": plain, "spec_tok_s": spec, "spec_over_plain": {n: v / plain for n, v in spec.items()}}
    return out


@torch.inference_mode()
def _draft_ms(target, draft, context: int, repeats: int) -> float:
    from dflash_core.decoding import draft_round
    from dflash_core.model import DraftCache
    from dflash_core.target import TargetAdapter
    from dflash_core.timing import median_seconds

    adapter = TargetAdapter(target, draft.config.target_layer_ids)
    ids = torch.randint(0, adapter.vocab_size, (context,), generator=torch.Generator().manual_seed(1))
    feats = adapter.forward(ids, torch.arange(context), adapter.new_cache()).features
    new = 3  # a steady round: the tokens committed by the last round join the drafter's cache
    cache = DraftCache()
    draft_round(draft, adapter, int(ids[-1]), feats[:context - new], context - new, cache)
    cache.crop(context - new)

    def call():
        draft_round(draft, adapter, int(ids[-1]), feats[context - new:], context, cache)
        cache.crop(context - new)
    return median_seconds(call, repeats=repeats, warmup=1) * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.batch_cost_surface",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--nodes", default="1,2,4,9,16,33", help="tokens per sequence per forward (root + tree nodes)")
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tau", default=",".join(f"{n}:{t}" for n, t in DEFAULT_TAU.items()),
                   help="tree size:tau pairs for the projection")
    p.add_argument("--out", default="runs/batch_cost_surface.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from dflash_core import load_default_pair
    from dflash_core.cpu_kernels import apply_cpu_kernels
    from dflash_core.timing import machine_identity
    from experiments.bench.schema import write_json_atomic

    target, draft, _ = load_default_pair(device="cpu")
    kernels = apply_cpu_kernels(target, draft, kernels="auto")
    batches = [int(x) for x in a.batches.split(",")]
    nodes = [int(x) for x in a.nodes.split(",")]
    tau = {int(k): float(v) for k, v in (pair.split(":") for pair in a.tau.split(","))}
    surface = forward_surface(target, draft.config.target_layer_ids, batches, nodes, a.context, a.repeats)
    draft_ms = _draft_ms(target, draft, a.context, a.repeats)
    proj = project(surface, tau, draft_ms)
    print(f"ms per forward (B sequences x N tokens each, context {a.context}); drafter pass {draft_ms:.1f} ms")
    print(f"{'B':>3}" + "".join(f"{'N=' + str(n):>9}" for n in nodes) + "   plain tok/s   projected spec/plain "
          + " ".join(f"n={n}" for n in tau))
    for b in batches:
        ratios = " ".join(f"{proj[b]['spec_over_plain'].get(n, float('nan')):.2f}" for n in tau)
        print(f"{b:>3}" + "".join(f"{surface[b][n]:>9.1f}" for n in nodes) + f"   {proj[b]['plain_tok_s']:>11.1f}   "
              + ratios)
    write_json_atomic(a.out, {"schema": "batch_cost_surface/1", "machine": machine_identity(), "kernels": kernels,
                              "dtype": str(target.dtype).removeprefix("torch."), "context": a.context,
                              "surface_ms": surface, "draft_ms": draft_ms, "tau": tau, "projection": proj,
                              "command_line": [sys.executable, "-m", "experiments.studies.batch_cost_surface",
                                               *(sys.argv[1:] if argv is None else argv)]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
