"""Figures and tables from benchmark result records (JSONL). Needs matplotlib, never torch.

    from plots import make_report, summary_table
    make_report("runs/", "runs/figures")      # PNG + PDF figures, Markdown + LaTeX tables
    print(summary_table(records))             # every variant per dataset x temperature

Colours of methods and variants: :mod:`plots.colors`. Nothing in ``experiments`` imports ``plots``.
"""

from plots.figures import plot_acceptance_histograms, plot_all, plot_budget_tradeoff, plot_speedup
from plots.load import Run, find_runs, load_records, merge_records
from plots.metrics import ORACLE_LABEL, Stats, compute_stats, headline_stats, oracle_stats
from plots.report import make_report
from plots.tables import latex_table, markdown_table, summary_table

__all__ = [
    "ORACLE_LABEL", "Run", "Stats", "compute_stats", "find_runs", "headline_stats", "latex_table", "load_records",
    "make_report", "markdown_table", "merge_records", "oracle_stats", "plot_acceptance_histograms", "plot_all",
    "plot_budget_tradeoff", "plot_speedup", "summary_table",
]
