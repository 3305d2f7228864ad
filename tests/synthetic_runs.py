"""A synthetic run folder shaped like the default preset's (live records plus replayed ones), for plot tests and
for looking at the figures without running the benchmark: ``python tests/synthetic_runs.py OUT``."""

from __future__ import annotations

import random
import sys
from pathlib import Path

from experiments.bench.schema import REPLAYED_FILENAME, SampleRecord, append_record

DATASETS = ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mt-bench", "grounded")
LIVE = (("ar", None, "ar"), ("dflash", None, "chain"), ("ddtree", 8, "fixed"), ("ddtree", 16, "fixed"),
        ("ddtree", "auto", "auto"), ("pld", None, "lookup"), ("ddtree", "auto", "lookup"))
REPLAYED = (("ar", None, "ar"), ("dflash", None, "chain"), *(("ddtree", b, "fixed") for b in (2, 4, 8, 16, 32, 64)),
            ("ddtree", "auto", "auto"), ("pld", None, "lookup"), ("ddtree", 16, "lookup"), ("ddtree", "auto", "lookup"))
PLAIN_STEP = 0.026  # seconds per plain decoding token


def _tau(method, budget, policy, dataset: str) -> float:
    grounded = dataset == "grounded"
    if method == "ar":
        return 1.0
    if method == "pld":
        return 3.4 if grounded else 1.7
    if method == "dflash":
        return 2.1
    size = 12 if budget == "auto" else budget
    tau = 1.5 + 0.55 * min(size, 64) ** 0.5
    return tau + (1.5 if grounded else 0.4) if policy == "lookup" else tau


def _round_s(method, budget, dataset: str) -> float:
    if method == "ar":
        return PLAIN_STEP
    if method == "pld":
        return 1.1 * PLAIN_STEP
    size = 12 if budget == "auto" else (15 if budget is None else budget)
    return PLAIN_STEP * (1.15 + 0.018 * size)


def _record(dataset, sid, variant, tokens, rng, jitter: float, replayed: bool) -> SampleRecord:
    method, budget, policy = variant
    tau = _tau(method, budget, policy, dataset) * (1 + rng.uniform(-jitter, jitter))
    rounds = max(1, round((tokens - 1) / max(tau, 1.0)))
    base, extra_len = divmod(tokens - 1, rounds)
    lengths = [base + (1 if i < extra_len else 0) for i in range(rounds)]
    seconds = rounds * _round_s(method, budget, dataset) * (1 + rng.uniform(-jitter, jitter))
    sizes = [] if method == "ar" else [12 if budget == "auto" else (budget or 15)] * rounds
    extra = {"tree_sizes": sizes, "output_ids": []}
    if replayed:
        extra["replayed"] = True
    return SampleRecord(dataset=dataset, sample_id=sid, turn=0, method=method, budget=budget, policy=policy,
                        temperature=0.0, num_input_tokens=100, num_new_tokens=tokens, prefill_s=0.01,
                        decode_s=seconds, acceptance_lengths=lengths, matches_ar=None if method == "ar" else True,
                        extra=extra)


def write_synthetic_run(out: Path, prompts: int = 6, seed: int = 0) -> Path:
    """Write ``records.jsonl`` (live, noisy) and ``replayed.jsonl`` (projected, smooth) under ``out``."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    for dataset in DATASETS:
        for k in range(prompts):
            sid, tokens = f"{dataset}-{k}", 96
            for variant in LIVE:
                append_record(out / "records.jsonl", _record(dataset, sid, variant, tokens, rng, 0.12, False))
            for variant in REPLAYED:
                append_record(out / REPLAYED_FILENAME, _record(dataset, sid, variant, tokens, rng, 0.03, True))
    return out


if __name__ == "__main__":
    print(write_synthetic_run(Path(sys.argv[1])))
