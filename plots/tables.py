"""Markdown and LaTeX tables of speedup, τ and exact-match rate per dataset × method × temperature."""

from __future__ import annotations

from typing import Iterable

from experiments.bench.schema import (
    NEAR_TIE_MARGIN, SampleRecord, dataset_label, dataset_sort_key,
)
from plots.metrics import ORACLE_LABEL, Stats, compute_stats, groups_of, headline_stats, oracle_stats, target_forwards

_HEADER = ("Dataset", "T", "Method", "Speedup", "Per-prompt median [95% CI]", "τ", "Equal / up to near-ties", "n")
FOOTNOTE = (f"Speedup = AR time per token ÷ method time per token (token-weighted over samples both finished); "
            f"τ = mean tokens committed per round; {ORACLE_LABEL} = best fixed budget chosen after the fact. "
            f"Per-prompt median: "
            f"paired with AR on the same prompt, bootstrap 95% interval; ≈ marks an interval that contains 1 (within "
            f"noise of AR). Equal: outputs identical to plain decoding's; up to near-ties: identical, or first leaving "
            f"it at a token where plain decoding's top-2 logit margin is below {NEAR_TIE_MARGIN} (bf16 multi-token "
            f"and one-token forwards round differently and flip such near-ties; in fp32 every output is equal).")
SAMPLED_NOTE = ("DDTree sampled = children drawn from the drafter's distribution and verified by recursive rejection "
                "sampling; DDTree (B=…) = the deterministic top-K tree, verified by sample-and-match.")
LOOKUP_NOTE = ("PLD = draft-free prompt lookup (the continuation of the context's longest earlier n-gram match); "
               "DDTree+lookup = the top-K tree with that continuation merged in under the same budget; Lookup = share "
               "of committed tokens that came from lookup nodes.")
AUTO_CHAIN_NOTE = "DFlash (auto) = the drafter's chain with a per-round length chosen from the machine's cost curve."


def _has_lookup(rows: Iterable[Stats]) -> bool:
    return any(s.lookup_share is not None for s in rows)


def footnote(rows: Iterable[Stats]) -> str:
    """The table's footnote; it explains sampled trees, lookup variants and DFlash (auto) when the table shows them."""
    rows = list(rows)
    notes = [FOOTNOTE]
    if any(s.is_sampled_tree for s in rows):
        notes.append(SAMPLED_NOTE)
    if _has_lookup(rows):
        notes.append(LOOKUP_NOTE)
    if any(s.method == "dflash" and isinstance(s.budget, str) for s in rows):
        notes.append(AUTO_CHAIN_NOTE)
    return " ".join(notes)


def _num(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _temperature(t: float) -> str:
    return f"{t:g}"


def _cells(s: Stats, times: str = "×", lookup: bool = False) -> list[str]:
    spread = "–"
    if s.speedup_median is not None:
        spread = f"{s.speedup_median:.2f} [{s.speedup_ci_low:.2f}, {s.speedup_ci_high:.2f}]"
        if s.method != "ar" and s.within_noise:
            spread = "≈ " + spread
    match = "–"
    if s.exact_match is not None:
        near = s.exact_match if s.near_tie_match is None else s.near_tie_match
        match = f"{100 * s.exact_match:.0f}% / {100 * near:.0f}% ({s.num_compared})"
    cells = [dataset_label(s.dataset), _temperature(s.temperature), s.label, _num(s.speedup, 2, times), spread,
             _num(s.tau), match, str(s.num_records)]
    if lookup:  # the lookup share, just before n
        cells.insert(7, "–" if s.lookup_share is None else f"{100 * s.lookup_share:.0f}%")
    return cells


def markdown_table(rows: Iterable[Stats]) -> str:
    """One row per variant; a ``Lookup`` column (share of committed tokens from lookup nodes) when a row has one."""
    rows = list(rows)
    lookup = _has_lookup(rows)
    header = list(_HEADER)
    if lookup:
        header.insert(7, "Lookup")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(header) - 3)) + "|"]
    lines += ["| " + " | ".join(_cells(s, lookup=lookup)) + " |" for s in rows]
    return "\n".join(lines) + "\n"


_LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "–": "--",
                  "≈": r"$\approx$"}


def _latex_escape(text: str) -> str:
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in text)


def latex_table(rows: Iterable[Stats]) -> str:
    """A booktabs ``tabular`` (needs ``\\usepackage{booktabs}``); a rule between (dataset, temperature) groups."""
    rows = list(rows)
    lookup = _has_lookup(rows)
    header = ["Dataset", "$T$", "Method", "Speedup", "Median [95\\% CI]", r"$\tau$", "Equal / near-ties", "$n$"]
    if lookup:
        header.insert(7, r"Lookup")
    out = [r"\begin{tabular}{lll" + "r" * (len(header) - 3) + "}", r"\toprule", " & ".join(header) + r" \\",
           r"\midrule"]
    previous = None
    for s in rows:
        group = (s.dataset, s.temperature)
        if previous is not None and group != previous:
            out.append(r"\midrule")
        previous = group
        cells = [_latex_escape(c) for c in _cells(s, times="", lookup=lookup)]
        if s.speedup is not None:
            cells[3] += r"$\times$"
        out.append(" & ".join(cells) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(out) + "\n"


def all_rows(stats: list[Stats]) -> list[Stats]:
    """Every variant, with the oracle row after the fixed budgets (and sampled and lookup trees) of its group."""
    rows = []
    for dataset, temperature in groups_of(stats):
        group = [s for s in stats if s.dataset == dataset and s.temperature == temperature]
        oracle = oracle_stats(stats, dataset, temperature)
        fixed_end = max((i for i, s in enumerate(group) if s.is_fixed_tree or s.is_sampled_tree or s.is_lookup_tree),
                        default=None)
        for i, s in enumerate(group):
            rows.append(s)
            if oracle is not None and i == fixed_end:
                rows.append(oracle)
    return rows


def summary_table(records: Iterable[SampleRecord], *, all_budgets: bool = True,
                  fixed_budget: int | None = None) -> str:
    """Markdown summary of a benchmark: speedup, spread, τ and exact-match rate per dataset × T × method.

    ``all_budgets=False`` keeps AR, DFlash, the oracle budget, non-oracle policies and ``fixed_budget``.
    """
    stats = compute_stats(records)
    if not stats:
        return "(no records)\n"
    rows = all_rows(stats) if all_budgets else headline_stats(stats, fixed_budget)
    return markdown_table(rows) + "\n" + footnote(rows) + "\n"


STAGES = ("draft", "tree", "verify", "commit")


def stage_table(records: Iterable[SampleRecord]) -> str:
    """Where a round's time goes, per method variant over all datasets of one temperature: milliseconds per round
    of each decode-loop stage (``SampleRecord.stage_times``), the rest of the round, τ, and target forwards per
    generated token."""
    from collections import defaultdict

    groups: dict[tuple, list[SampleRecord]] = defaultdict(list)
    for r in records:
        groups[(r.temperature, r.spec)].append(r)
    lines = ["| T | Method | ms/round | " + " | ".join(STAGES) + " | other | τ | forwards/token |",
             "|---|---|" + "---:|" * (len(STAGES) + 4)]
    for (t, variant), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1].sort_key)):
        rounds = sum(len(r.acceptance_lengths) for r in rs)
        tokens = sum(r.num_new_tokens for r in rs)
        if not rounds or not tokens:
            continue
        per = {st: 1000 * sum(r.stage_times.get(st, 0.0) for r in rs) / rounds for st in STAGES}
        total = 1000 * sum(r.decode_s for r in rs) / rounds
        tau = sum(sum(r.acceptance_lengths) for r in rs) / rounds
        forwards = sum(target_forwards(r) for r in rs) / tokens
        lines.append(f"| {_temperature(t)} | {variant.label} | {total:.1f} | "
                     + " | ".join(f"{per[st]:.1f}" for st in STAGES)
                     + f" | {max(0.0, total - sum(per.values())):.1f} | {tau:.2f} | {forwards:.2f} |")
    return "\n".join(lines) + "\n"


def policy_table(records: Iterable[SampleRecord]) -> str:
    """How each budget policy (a string budget: DDTree's ``auto``, DFlash's ``chain-auto``, a user policy) compares
    with the oracle: its
    speedup divided by the best fixed top-K budget's, per dataset and temperature, with the mean over datasets and
    the worst one. Empty when the run measured no policy or no fixed budget."""
    stats = compute_stats(records)
    policies = sorted({(s.temperature, s.label) for s in stats if s.is_policy and s.speedup is not None})
    if not policies:
        return ""
    datasets = sorted({s.dataset for s in stats}, key=dataset_sort_key)
    lines = ["| T | Policy | " + " | ".join(dataset_label(d) for d in datasets) + " | mean | worst |",
             "|---|---|" + "---:|" * (len(datasets) + 2)]
    for temperature, label in policies:
        ratios = {}
        for d in datasets:
            oracle = oracle_stats(stats, d, temperature)
            mine = [s for s in stats if s.dataset == d and s.temperature == temperature and s.label == label]
            if oracle is not None and mine and mine[0].speedup is not None and oracle.speedup:
                ratios[d] = (mine[0].speedup / oracle.speedup, oracle.budget)
        if not ratios:
            continue
        cells = [f"{ratios[d][0]:.2f} (B={ratios[d][1]})" if d in ratios else "–" for d in datasets]
        values = [r for r, _ in ratios.values()]
        lines.append(f"| {_temperature(temperature)} | {label} | " + " | ".join(cells)
                     + f" | {sum(values) / len(values):.3f} | {min(values):.2f} |")
    if len(lines) == 2:
        return ""
    return ("\n".join(lines) + "\n\nEach cell: the policy's speedup ÷ the oracle's (the best fixed top-K budget of "
            "that dataset, chosen after the fact, shown in parentheses).\n")
