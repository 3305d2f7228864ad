"""The runner's closing summary on stdout: one Markdown row per dataset × temperature × method variant.

Deliberately small and free of ``plots`` (``experiments`` never imports it): speedup (the token-weighted definition
shared with plots, ``experiments.bench.schema.paired_speedup``), τ, equality with plain decoding, the lookup share
where a variant has one, and the count. The full tables (per-prompt intervals, the oracle budget, policies against it,
stage times) and the figures come from ``python plot_results.py --runs <folder>``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from experiments.bench.schema import (
    SampleRecord, dataset_label, dataset_sort_key, lookup_share, paired_speedup,
)

__all__ = ["summary_rows", "summary_table"]


def summary_rows(records: Iterable[SampleRecord]) -> list[dict]:
    """Per (dataset, temperature, variant) in display order: label, speedup, tau, equal (share of compared outputs
    equal to plain decoding's), compared, lookup (share of committed tokens from lookup nodes), n."""
    groups: dict[tuple, dict[tuple, list[SampleRecord]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        groups[(r.dataset, r.temperature)][r.spec].append(r)
    rows = []
    for (dataset, temperature), variants in groups.items():
        ar = {(r.sample_id, r.turn): r for v, rs in variants.items() if v.method == "ar" for r in rs}
        for variant, rs in variants.items():
            pairs = [(ar[(r.sample_id, r.turn)], r) for r in rs if (r.sample_id, r.turn) in ar]
            rounds = sum(len(r.acceptance_lengths) for r in rs)
            compared = [r.matches_ar for r in rs if r.matches_ar is not None]
            rows.append({"dataset": dataset, "temperature": temperature, "variant": variant,
                         "label": variant.label, "speedup": paired_speedup(pairs),
                         "tau": sum(sum(r.acceptance_lengths) for r in rs) / rounds if rounds else None,
                         "equal": sum(compared) / len(compared) if compared else None, "compared": len(compared),
                         "lookup": lookup_share(rs), "n": len(rs)})
    rows.sort(key=lambda row: (dataset_sort_key(row["dataset"]), row["temperature"], row["variant"].sort_key))
    return rows


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "–" if value is None else format(value, fmt) + suffix


def _cells(row: dict, lookup: bool) -> list[str]:
    equal = "–" if row["equal"] is None else f"{100 * row['equal']:.0f}% ({row['compared']})"
    cells = [dataset_label(row["dataset"]), f"{row['temperature']:g}", row["label"], _num(row["speedup"], ".2f", "×"),
             _num(row["tau"], ".2f"), equal]
    if lookup:
        cells.append(_num(None if row["lookup"] is None else 100 * row["lookup"], ".0f", "%"))
    return cells + [str(row["n"])]


def summary_table(records: Iterable[SampleRecord]) -> str:
    """The Markdown table of :func:`summary_rows` (a ``Lookup`` column only when a variant has a lookup share)."""
    rows = summary_rows(records)
    if not rows:
        return "(no records)\n"
    lookup = any(row["lookup"] is not None for row in rows)
    header = ["Dataset", "T", "Method", "Speedup", "τ", "Equal to AR"] + (["Lookup"] if lookup else []) + ["n"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(header) - 3)) + "|"]
    lines += ["| " + " | ".join(_cells(row, lookup)) + " |" for row in rows]
    note = ("Speedup = AR time per token ÷ the method's, token-weighted over the prompts both finished; τ = mean "
            "tokens committed per round" + ("; Lookup = share of committed tokens from lookup nodes" if lookup else ""))
    return "\n".join(lines) + "\n\n" + note + ".\n"
