"""The lookup branches' starting statistics: ``python -m experiments.studies.lookup_prior``.

A fresh :class:`ddtree.lookup.LookupStats` (a call without a carried memory, or a memory's first call) starts from
``ddtree/lookup_prior.json``, which this script writes: prompt lookup's rounds walked over the target's own answers to
the drafter's training prompts (the response shards in the embedded drafter's ``data`` folder; the prompts are
rebuilt from their offline sources, and none is a benchmark prompt). Each round takes the continuation of the longest
earlier match (up to ``--max-ngram`` tokens) of everything before it, prompt included, compares up to
``--num-tokens`` of it with the answer's next tokens, records how deep it held (:meth:`LookupStats.record`), and moves
past the accepted tokens and the one the target would add; the counts are those a policy keeps,
``[match length, depth, (held, tried)]``. Greedy and sampled answers alike. About 30 seconds on a 2-core CPU for the
~19K shipped sequences; the file is written atomically.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ddtree.lookup import LookupStats
from dflash_core.prompt_lookup import NgramIndex

REPO = Path(__file__).resolve().parents[2]


def walk(sequences: Iterable[tuple[Sequence[int], int]], max_ngram: int = 3, num_tokens: int = 32) -> LookupStats:
    """Prompt lookup's rounds over each ``(ids, prompt length)`` (module docstring), recorded in statistics that
    start from nothing. A continuation that runs past the end of its sequence is tested only as far as the
    sequence goes."""
    stats = LookupStats(max_ngram, num_tokens, prior=False)
    for ids, start in sequences:
        ids = [int(t) for t in ids]
        index = NgramIndex(max_ngram)
        index.extend(ids[:start])
        t = start
        while t < len(ids):
            n, continuation = index.continuation(num_tokens)
            accepted = 0
            if n and continuation:
                verified = min(len(continuation), len(ids) - t)
                while accepted < verified and continuation[accepted] == ids[t + accepted]:
                    accepted += 1
                stats.record(n, verified, accepted)
            index.extend(ids[t:t + accepted + 1])
            t += accepted + 1
    return stats


def table(stats: LookupStats, about: dict) -> dict:
    """The JSON record: the counts as integers, with the held share per match length and depth for readers."""
    counts = np.rint(stats.counts).astype(int)
    held, tried = counts[..., 0], counts[..., 1]
    shares = np.divide(held, tried, out=np.full(held.shape, np.nan), where=tried > 0)
    return {**about, "max_ngram": counts.shape[0] - 1, "num_tokens": counts.shape[1] - 1,
            "held_share_by_depth": {str(n): [None if np.isnan(x) else round(float(x), 3) for x in shares[n, 1:13]]
                                    for n in range(1, counts.shape[0])},
            "counts": counts.tolist()}


def main(argv=None) -> None:
    from dflash_core.default import DEFAULT_DRAFT_DIR, load_default_target
    from dflash_core.training.corpus import load_corpus
    from experiments.bench.schema import write_text_atomic

    p = argparse.ArgumentParser(prog="python -m experiments.studies.lookup_prior", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DEFAULT_DRAFT_DIR / "data"), help="a folder of response shards")
    p.add_argument("--max-ngram", type=int, default=3)
    p.add_argument("--num-tokens", type=int, default=32)
    p.add_argument("--limit", type=int, default=0, help="use only the first N sequences (0: all)")
    p.add_argument("--out", default=str(LookupStats.PRIOR_FILE))
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    _, tokenizer = load_default_target(device="cpu")
    corpus = load_corpus(a.data, tokenizer)
    sequences = [(ids.tolist(), start) for ids, start in corpus.sequences]
    if a.limit:
        sequences = sequences[:a.limit]
    if not sequences:
        p.error(f"no response shards with rebuildable prompts in {a.data}")
    stats = walk(sequences, a.max_ngram, a.num_tokens)
    data = Path(a.data).resolve()
    about = {"about": "prompt lookup's rounds over the target's answers to the drafter's training prompts "
                      "(experiments/studies/lookup_prior.py)",
             "data": str(data.relative_to(REPO)) if data.is_relative_to(REPO) else str(data),
             "sequences": len(sequences), "response_tokens": sum(len(ids) - s for ids, s in sequences),
             "rounds_by_match_length": {str(n): int(stats.counts[n, 1, 1]) for n in range(1, a.max_ngram + 1)}}
    write_text_atomic(a.out, json.dumps(table(stats, about), separators=(",", ":")) + "\n")
    print(f"{len(sequences)} sequences in {time.perf_counter() - t0:.0f} s -> {a.out}")
    for n, shares in table(stats, about)["held_share_by_depth"].items():
        print(f"  n={n}: " + " ".join("-" if x is None else f"{x:.2f}" for x in shares))


if __name__ == "__main__":
    main()
