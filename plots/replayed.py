"""Replayed rounds next to the live run: the projected table, ``auto`` against the oracle on equal terms, the live
paired intervals, and the harness's own check (replayed against live τ).

Replayed records (``replayed.jsonl``, written by ``experiments.bench.replayer``) hold every policy's rounds on plain
decoding's own text with ``decode_s`` = the seconds the machine's measured cost curve gives those rounds, and plain
decoding's row priced the same way, so :func:`plots.metrics.compute_stats` reads them as it reads live records: a
speedup there is a projected one, on the same text for every policy.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Iterable

from experiments.bench.schema import SampleRecord, bootstrap_ci, dataset_label, dataset_sort_key
from plots.metrics import Stats, compute_stats, groups_of
from plots.tables import all_rows, markdown_table

__all__ = ["auto_vs_oracle", "best_single_budget", "live_paired", "projected_table", "tau_check"]

PROJECTED_NOTE = ("PROJECTED, not timed: each policy's rounds replayed on plain decoding's own output (the same text "
                  "for every policy; at T > 0 its sampled text, which replays sample-and-match rounds) and priced by "
                  "this machine's measured round cost curve (ddtree.cost: drafter pass + verify(N) per round, "
                  "verify(N) without the drafter, verify(0) per plain step). Per-prompt interval: over prompts; the "
                  "Equal column does not apply (every replay commits plain decoding's tokens).")


def projected_table(replayed: Iterable[SampleRecord]) -> str:
    """The labelled projected table: every replayed variant per dataset and temperature."""
    rows = all_rows(compute_stats(replayed))
    if not rows:
        return ""
    return "## Projected on plain decoding's text (replayed)\n\n" + markdown_table(rows) + "\n" + PROJECTED_NOTE + "\n"


def _fixed_speedups(stats: list[Stats], temperature: float) -> dict[str, dict[int, float]]:
    """{dataset: {budget: speedup}} of the top-K fixed budgets at ``temperature``."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for s in stats:
        if s.temperature == temperature and s.is_fixed_tree and s.speedup is not None:
            out[s.dataset][s.budget] = s.speedup
    return dict(out)


def best_single_budget(stats: list[Stats], temperature: float) -> int | None:
    """The fixed budget with the best mean speedup over the datasets (among budgets every dataset has)."""
    fixed = _fixed_speedups(stats, temperature)
    if not fixed:
        return None
    common = set.intersection(*(set(by) for by in fixed.values()))
    if not common:
        return None
    return max(sorted(common), key=lambda b: statistics.fmean(by[b] for by in fixed.values()))


def auto_vs_oracle(stats: list[Stats], title: str) -> str:
    """Each budget policy (``auto``, ``DDTree+lookup (auto)`` against the plain oracle, ...) over the oracle (the
    best fixed budget per dataset, after the fact) and over the single best budget across datasets, per dataset,
    with the mean and the worst; and how much choosing per dataset after the fact gains on these numbers."""
    lines = [f"## {title}", ""]
    for temperature in sorted({s.temperature for s in stats}):
        fixed = _fixed_speedups(stats, temperature)
        single = best_single_budget(stats, temperature)
        datasets = sorted(fixed, key=dataset_sort_key)
        policies = sorted({s.label for s in stats if s.temperature == temperature and s.budget == "auto"
                           and s.speedup is not None})
        if not datasets or single is None or not policies:
            continue
        oracle = {d: max(fixed[d].items(), key=lambda kv: kv[1]) for d in datasets}
        lines += [f"T = {temperature:g}; oracle = the best fixed budget per dataset (in parentheses); single best = "
                  f"B={single}, the best mean over the datasets.", "",
                  "| Policy | over | " + " | ".join(dataset_label(d) for d in datasets) + " | mean | worst |",
                  "|---|---|" + "---:|" * (len(datasets) + 2)]
        for label in policies:
            mine = {s.dataset: s.speedup for s in stats
                    if s.temperature == temperature and s.label == label and s.speedup is not None}
            for against, ref in (("oracle", {d: oracle[d][1] for d in datasets}),
                                 (f"B={single}", {d: fixed[d][single] for d in datasets})):
                ratios = {d: mine[d] / ref[d] for d in datasets if d in mine and ref[d]}
                if not ratios:
                    continue
                cells = [(f"{ratios[d]:.3f}" + (f" (B={oracle[d][0]})" if against == "oracle" else ""))
                         if d in ratios else "–" for d in datasets]
                lines.append(f"| {label} | {against} | " + " | ".join(cells)
                             + f" | {statistics.fmean(ratios.values()):.3f} | {min(ratios.values()):.3f} |")
        gain = statistics.fmean(oracle[d][1] / fixed[d][single] for d in datasets)
        lines += ["", f"Bias of the oracle: choosing the budget per dataset after the fact gains {gain:.3f}x over "
                  f"the single best budget B={single} on these same numbers (the oracle is the best of "
                  f"{len(fixed[datasets[0]])} budgets per dataset, picked on the very prompts it is scored on); a "
                  "policy that chooses before seeing them is judged fairly against both.", ""]
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def _per_prompt(records: list[SampleRecord]) -> dict[tuple, dict[str, float]]:
    """{(dataset, temperature, sample, turn): {label: seconds per token}}."""
    out: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in records:
        if r.num_new_tokens > 0 and r.decode_s > 0:
            label = r.spec.label
            out[(r.dataset, r.temperature, r.sample_id, r.turn)][label] = r.decode_s / r.num_new_tokens
    return out


def live_paired(records: Iterable[SampleRecord]) -> str:
    """Live: ``auto``'s speed over the best single fixed budget (and over each fixed budget), per prompt (paired on
    the same prompt: that budget's seconds per token over auto's), median with a bootstrap 95% interval, pooled
    over the datasets and per dataset."""
    records = list(records)
    stats = compute_stats(records)
    per_prompt = _per_prompt(records)
    lines = ["## Live: auto over fixed budgets, paired per prompt", ""]
    for temperature in sorted({s.temperature for s in stats}):
        single = best_single_budget(stats, temperature)
        budgets = sorted({s.budget for s in stats if s.temperature == temperature and s.is_fixed_tree})
        autos = sorted({s.label for s in stats if s.temperature == temperature and s.budget == "auto"})
        if single is None or not autos:
            continue
        datasets = sorted({s.dataset for s in stats if s.temperature == temperature}, key=dataset_sort_key)
        lines += [f"T = {temperature:g}; best single fixed budget (best mean speedup over the datasets): "
                  f"B={single}. Cells: median of per-prompt ratios [95% bootstrap interval] (n prompts).", "",
                  "| Policy | over | all datasets | " + " | ".join(dataset_label(d) for d in datasets) + " |",
                  "|---|---|---:|" + "---:|" * len(datasets)]
        for label in autos:
            for budget in [single] + [b for b in budgets if b != single]:
                ref = f"DDTree (B={budget})"
                cells = []
                for subset in [None] + datasets:
                    ratios = [v[ref] / v[label] for (d, t, _, _), v in per_prompt.items()
                              if t == temperature and (subset is None or d == subset) and ref in v and label in v]
                    cells.append(_interval(ratios))
                mark = " (best single)" if budget == single else ""
                lines.append(f"| {label} | B={budget}{mark} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def _interval(values: list[float]) -> str:
    if not values:
        return "–"
    low, high = bootstrap_ci(values, statistics.median)
    return f"{statistics.median(values):.3f} [{low:.3f}, {high:.3f}] ({len(values)})"


def tau_check(live: Iterable[SampleRecord], replayed: Iterable[SampleRecord]) -> str:
    """Replayed against live τ for every variant measured both ways, per dataset, with the relative difference
    (live - replayed) / replayed and its median over the datasets (absolute values): the harness's own check. In
    fp32 both see the same text and agree; in bf16 a live method decodes its own text after its first near-tie."""
    live_stats, replayed_stats = compute_stats(live), compute_stats(replayed)
    both = {(s.dataset, s.temperature, s.label): s for s in replayed_stats if s.method != "ar" and s.tau}
    pairs = [(s, both[(s.dataset, s.temperature, s.label)]) for s in live_stats
             if (s.dataset, s.temperature, s.label) in both and s.tau]
    if not pairs:
        return ""
    datasets = list(dict.fromkeys(d for d, _ in groups_of(live_stats)))
    labels = list(dict.fromkeys(s.label for s, _ in pairs))
    by_key = {(a.dataset, a.temperature, a.label): (a, b) for a, b in pairs}
    lines = ["## Replayed vs live τ (the harness's own check)", "",
             "| T | Method | " + " | ".join(dataset_label(d) for d in datasets) + " | median abs. diff |",
             "|---|---|" + "---:|" * (len(datasets) + 1)]
    medians = []
    for temperature in sorted({s.temperature for s, _ in pairs}):
        for label in labels:
            cells, diffs = [], []
            for d in datasets:
                if (d, temperature, label) not in by_key:
                    cells.append("–")
                    continue
                a, b = by_key[(d, temperature, label)]
                diff = (a.tau - b.tau) / b.tau
                diffs.append(abs(diff))
                cells.append(f"{a.tau:.2f} / {b.tau:.2f} ({100 * diff:+.1f}%)")
            if diffs:
                medians.append(statistics.median(diffs))
                lines.append(f"| {temperature:g} | {label} | " + " | ".join(cells)
                             + f" | {100 * statistics.median(diffs):.1f}% |")
    lines += ["", "Cells: live τ / replayed τ (relative difference). Median over the variants of the per-dataset "
              f"median: {100 * statistics.median(medians):.1f}%."]
    return "\n".join(lines) + "\n"
