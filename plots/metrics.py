"""The one definition of speedup, τ and exact-match rate used by every figure and table.

Per (dataset, temperature) and method variant (method, policy, budget, tree kind):

- speedup = AR time per token ÷ variant time per token, token-weighted over the (sample, turn) pairs that both AR
  and the variant finished: ``(Σ ar.decode_s / Σ ar.num_new_tokens) / (Σ m.decode_s / Σ m.num_new_tokens)``;
  the spread is over per-sample (per-prompt, paired with AR) speedups ``(ar.decode_s / ar.n) / (m.decode_s / m.n)``:
  median, quartiles, and a percentile-bootstrap 95% interval of the median (an interval that contains 1 means "not
  distinguishable from AR" at this sample size);
- τ = Σ acceptance lengths ÷ number of rounds, over all rounds of all the variant's records;
- exact-match rate = mean of ``matches_ar`` over the records where it is not None;
- per-depth acceptance = share of rounds whose accepted path reached depth d; target forwards = prefill + rounds;
- lookup share = committed tokens that came from context-lookup nodes ÷ all committed tokens (PLD, DDTree+lookup);
- the oracle budget is the fixed DDTree budget with the highest speedup, chosen after the fact (among top-K trees;
  sampled trees, ``tree="sampled"``, and lookup trees, ``policy="lookup"``, are shown next to the top-K tree at the
  same budgets, never as the oracle).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from experiments.bench.schema import (
    EXTRA_TREE_SIZES, SampleRecord, Variant, bootstrap_ci, dataset_sort_key, lookup_share, near_tie_or_equal,
    paired_speedup,
)

ORACLE_LABEL = "DDTree (oracle budget)"


@dataclass(frozen=True)
class Stats:
    """Aggregates of one method variant on one (dataset, temperature)."""

    dataset: str
    temperature: float
    method: str
    policy: str
    budget: int | str | None
    label: str
    num_records: int
    num_paired: int  # records with an AR partner (the speedup's support)
    num_new_tokens: int
    decode_s: float
    time_per_token_s: float | None
    speedup: float | None
    speedup_median: float | None
    speedup_q25: float | None
    speedup_q75: float | None
    tau: float | None
    num_rounds: int
    exact_match: float | None
    num_compared: int  # records with matches_ar not None
    mean_tree_size: float | None  # mean verified nodes per round, from extra["tree_sizes"] when recorded
    oracle: bool = False
    tree: str | None = None  # DDTree tree kind ("topk", "sampled"); None for AR and DFlash
    speedup_ci_low: float | None = None  # bootstrap 95% interval of the per-prompt median speedup
    speedup_ci_high: float | None = None
    acceptance_by_depth: tuple[float, ...] = ()  # [d-1]: share of rounds that accepted a draft token at depth d
    target_forwards: int | None = None  # target forward passes (prefill included) over all records
    # share of compared records equal to plain decoding or first leaving it at a near-tie (schema.NEAR_TIE_MARGIN)
    near_tie_match: float | None = None
    lookup_share: float | None = None  # committed tokens from lookup nodes ÷ all committed (PLD, DDTree+lookup)
    variant: str = "ar"  # the variant's canonical name (experiments.bench.variant_spec)

    @property
    def within_noise(self) -> bool:
        """True when the per-prompt speedup's 95% interval contains 1.0 (not distinguishable from AR)."""
        return (self.speedup_ci_low is not None and self.speedup_ci_high is not None
                and self.speedup_ci_low <= 1.0 <= self.speedup_ci_high)

    @property
    def spec(self) -> Variant:
        """The variant these stats aggregate; ``method``, ``policy``, ``budget``, ``tree`` and ``label`` are read
        off it (copied into fields so that tables and tests can compare plain values)."""
        return Variant.parse(self.variant)

    @property
    def is_fixed_tree(self) -> bool:
        """A top-K tree with an integer budget (no lookup branches)."""
        return self.spec.is_fixed_tree

    @property
    def is_lookup_tree(self) -> bool:
        return self.spec.is_lookup_tree

    @property
    def is_policy(self) -> bool:
        """A budget policy (a string budget such as ``auto``, DFlash's ``chain-auto`` or a user policy's name)."""
        return self.spec.is_policy

    @property
    def is_sampled_tree(self) -> bool:
        return self.spec.is_sampled_tree


def _quartiles(values: list[float]) -> tuple[float, float, float] | tuple[None, None, None]:
    if not values:
        return None, None, None
    if len(values) == 1:
        return values[0], values[0], values[0]
    q25, q50, q75 = statistics.quantiles(values, n=4, method="inclusive")
    return q50, q25, q75


def bootstrap_median_ci(values: list[float], level: float = 0.95, resamples: int = 2000,
                        seed: int = 0) -> tuple[float, float] | tuple[None, None]:
    """Percentile-bootstrap interval of the median of ``values`` (fixed seed: the same records give the same
    interval). One value gives a zero-width interval; none gives (None, None)."""
    return bootstrap_ci(values, statistics.median, level, resamples, seed)


def acceptance_by_depth(lengths: Iterable[int]) -> tuple[float, ...]:
    """[d-1] = share of rounds whose accepted path reached depth d (committed tokens - 1 >= d), d = 1..max."""
    lengths = list(lengths)
    if not lengths:
        return ()
    deepest = max(lengths) - 1
    return tuple(sum(1 for n in lengths if n - 1 >= d) / len(lengths) for d in range(1, deepest + 1))


def target_forwards(record: SampleRecord) -> int:
    """Target forward passes of one record: as recorded, else the prefill plus one per round."""
    recorded = record.extra.get("target_forwards")
    return int(recorded) if recorded is not None else 1 + len(record.acceptance_lengths)


def _sample_key(record: SampleRecord) -> tuple:
    return (record.sample_id, record.turn)


def compute_stats(records: Iterable[SampleRecord]) -> list[Stats]:
    """Stats of every variant present, sorted by dataset, temperature, then AR, DFlash, DDTree by budget (top-K and
    sampled trees of one budget next to each other)."""
    groups: dict[tuple, dict[tuple, list[SampleRecord]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        groups[(record.dataset, record.temperature)][record.spec].append(record)

    stats = []
    for (dataset, temperature), variants in groups.items():
        ar_by_sample = {_sample_key(r): r for variant, rs in variants.items() if variant.method == "ar" for r in rs}
        for variant, rs in variants.items():
            stats.append(_variant_stats(dataset, temperature, variant, rs, ar_by_sample))
    stats.sort(key=lambda s: (dataset_sort_key(s.dataset), s.temperature, s.spec.sort_key))
    return stats


def _variant_stats(dataset: str, temperature: float, variant: Variant, records: list[SampleRecord],
                   ar_by_sample: dict[tuple, SampleRecord]) -> Stats:
    partners = ((ar_by_sample.get(_sample_key(r)), r) for r in records)
    pairs = [(a, m) for a, m in partners if a is not None and a.num_new_tokens > 0 and m.num_new_tokens > 0]
    speedup = paired_speedup(pairs)
    per_sample = sorted((a.decode_s / a.num_new_tokens) / (m.decode_s / m.num_new_tokens)
                        for a, m in pairs if m.decode_s > 0)
    median, q25, q75 = _quartiles(per_sample)
    ci_low, ci_high = bootstrap_median_ci(per_sample)

    tokens = sum(r.num_new_tokens for r in records)
    decode_s = sum(r.decode_s for r in records)
    rounds = sum(len(r.acceptance_lengths) for r in records)
    accepted = sum(sum(r.acceptance_lengths) for r in records)
    compared = [r.matches_ar for r in records if r.matches_ar is not None]
    near = [near_tie_or_equal(r.matches_ar, r.extra) for r in records if r.matches_ar is not None]
    sizes = [size for r in records for size in (r.extra.get(EXTRA_TREE_SIZES) or [])]
    return Stats(
        dataset=dataset, temperature=temperature, method=variant.method, policy=variant.policy,
        budget=variant.budget, label=variant.label, variant=variant.name, num_records=len(records),
        num_paired=len(pairs),
        num_new_tokens=tokens, decode_s=decode_s, time_per_token_s=decode_s / tokens if tokens else None,
        speedup=speedup, speedup_median=median, speedup_q25=q25, speedup_q75=q75,
        tau=accepted / rounds if rounds else None, num_rounds=rounds,
        exact_match=sum(compared) / len(compared) if compared else None, num_compared=len(compared),
        mean_tree_size=sum(sizes) / len(sizes) if sizes else None, tree=variant.tree,
        speedup_ci_low=ci_low, speedup_ci_high=ci_high,
        acceptance_by_depth=acceptance_by_depth(n for r in records for n in r.acceptance_lengths),
        target_forwards=sum(target_forwards(r) for r in records),
        near_tie_match=sum(near) / len(near) if near else None, lookup_share=lookup_share(records),
    )


def groups_of(stats: Iterable[Stats]) -> list[tuple[str, float]]:
    """The (dataset, temperature) pairs present, in display order."""
    return sorted({(s.dataset, s.temperature) for s in stats}, key=lambda g: (dataset_sort_key(g[0]), g[1]))


def find(stats: Iterable[Stats], dataset: str, temperature: float, method: str) -> list[Stats]:
    return [s for s in stats if s.dataset == dataset and s.temperature == temperature and s.method == method]


def oracle_stats(stats: Iterable[Stats], dataset: str, temperature: float) -> Stats | None:
    """The fixed-budget DDTree variant with the best speedup, relabelled as the oracle (None if none has one)."""
    fixed = [s for s in find(stats, dataset, temperature, "ddtree") if s.is_fixed_tree and s.speedup is not None]
    if not fixed:
        return None
    best = max(fixed, key=lambda s: s.speedup)
    return dataclasses.replace(best, label=f"{ORACLE_LABEL}, B={best.budget}", oracle=True)


def headline_stats(stats: list[Stats], fixed_budget: int | None = None) -> list[Stats]:
    """Per (dataset, temperature): AR, PLD, DFlash (and DFlash with a chosen chain length), DDTree at the oracle
    budget, every non-oracle DDTree policy (a string budget such as ``auto``), the preset ``fixed_budget`` when given,
    and every sampled or lookup tree together with the top-K tree at the same budget (the side-by-side comparison
    of the tree kinds)."""
    rows = []
    for dataset, temperature in groups_of(stats):
        rows += find(stats, dataset, temperature, "ar") + find(stats, dataset, temperature, "pld")
        rows += find(stats, dataset, temperature, "dflash")
        oracle = oracle_stats(stats, dataset, temperature)
        if oracle is not None:
            rows.append(oracle)
        trees = find(stats, dataset, temperature, "ddtree")
        paired_budgets = {s.budget for s in trees if s.is_sampled_tree or s.is_lookup_tree}
        for s in trees:
            if not s.is_fixed_tree or s.budget == fixed_budget or s.budget in paired_budgets:
                rows.append(s)
    return rows
