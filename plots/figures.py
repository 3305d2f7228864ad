"""Figures: speedup per dataset, the budget trade-off, acceptance-length histograms.

Drawn with matplotlib's object API (``Figure`` + savefig), so no pyplot state and no global backend switch: it
renders headless anywhere. One figure per temperature; each is saved in every requested format.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

from experiments.bench.schema import METHOD_LABELS, SampleRecord, dataset_label
from plots.colors import METHOD_COLORS
from plots.metrics import Stats, find, groups_of, oracle_stats
from plots.speedup import plot_speedup
from plots.style import STYLE, figure_title, save_figure, temperature_tag

DATASET_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                   "#bcbd22", "#17becf")
AR_LINE = {"color": "#555555", "linestyle": ":", "linewidth": 1.3}
# Sampled trees (acceptance histograms): greens.
SAMPLED_SHADES = ("#2ca02c", "#98df8a", "#1a7a1a", "#74c476", "#006d2c")
SAMPLED_LINE = {"linestyle": "-.", "marker": "^", "markersize": 5, "linewidth": 1.4}
# DDTree with lookup branches in the budget trade-off: a dotted line with diamonds.
LOOKUP_LINE = {"linestyle": ":", "marker": "D", "markersize": 4, "linewidth": 1.6}
# Replayed (projected) fixed budgets: thin dash-dot lines with hollow circles, beside the live (solid) lines.
PROJECTED_LINE = {"linestyle": (0, (5, 2, 1, 2)), "marker": "o", "markersize": 4, "markerfacecolor": "white",
                  "linewidth": 1.0, "alpha": 0.9}


def _temperatures(stats: Iterable[Stats]) -> list[float]:
    return sorted({s.temperature for s in stats})


# ---- (a) speedup per dataset: plots.speedup (one panel per method family) -------------------------------------


# ---- (b) budget trade-off ----------------------------------------------------------------------------------------


def _tradeoff_lines(stats: list[Stats], temperature: float,
                    datasets: list[str]) -> dict[str, dict[str, list[Stats]]]:
    """{kind: {dataset: stats by budget}} of the lines drawn against the budget: top-K, sampled and lookup trees."""
    def kind_of(s: Stats) -> str | None:
        if s.is_fixed_tree:
            return "fixed"
        return "sampled" if s.is_sampled_tree else "lookup" if s.is_lookup_tree else None

    return {kind: {d: sorted((s for s in find(stats, d, temperature, "ddtree") if kind_of(s) == kind),
                             key=lambda s: s.budget) for d in datasets}
            for kind in ("fixed", "sampled", "lookup")}


def _policies(stats: list[Stats], dataset: str, temperature: float) -> list[Stats]:
    """Budget policies (DDTree's ``auto``, DFlash's ``chain-auto``, user policies): drawn at their mean tree size."""
    return [s for m in ("dflash", "ddtree") for s in find(stats, dataset, temperature, m) if s.is_policy]


def _projected_axis(ax, metric: str, projected: list[Stats], temperature: float, datasets: list[str],
                    colors: dict[str, str]) -> None:
    """Replayed (projected) fixed budgets as thin dash-dot lines with hollow circles, replayed ``auto`` as a hollow
    star at its mean tree size: every budget on plain decoding's text, beside the live rows."""
    for d in datasets:
        rows = sorted((s for s in find(projected, d, temperature, "ddtree")
                       if s.is_fixed_tree and getattr(s, metric) is not None), key=lambda s: s.budget)
        if rows:
            ax.plot([s.budget for s in rows], [getattr(s, metric) for s in rows], color=colors[d], **PROJECTED_LINE)
        for s in find(projected, d, temperature, "ddtree"):
            if s.budget == "auto" and s.policy == "auto" and s.mean_tree_size and getattr(s, metric) is not None:
                ax.plot([s.mean_tree_size], [getattr(s, metric)], marker="*", markersize=12, color="white",
                        markeredgecolor=colors[d], markeredgewidth=1.2, linestyle="none")


def _tradeoff_axis(ax, metric: str, ylabel: str, stats: list[Stats], temperature: float, datasets: list[str],
                   lines: dict[str, dict[str, list[Stats]]], colors: dict[str, str], budgets: list[int],
                   projected: list[Stats] = ()) -> bool:
    """One panel (speedup or τ); returns True when a policy had no recorded tree size (drawn as a dotted level)."""
    styles = {"fixed": {"marker": "o", "markersize": 4, "linewidth": 1.6}, "sampled": SAMPLED_LINE,
              "lookup": LOOKUP_LINE}
    without_size = False
    if projected:
        _projected_axis(ax, metric, list(projected), temperature, datasets, colors)
    for d in datasets:
        for kind, by in lines.items():
            rows = [s for s in by[d] if getattr(s, metric) is not None]
            if rows:
                ax.plot([s.budget for s in rows], [getattr(s, metric) for s in rows], color=colors[d], **styles[kind])
        for s in find(stats, d, temperature, "dflash"):
            if s.budget is None and getattr(s, metric) is not None:
                ax.axhline(getattr(s, metric), color=colors[d], linestyle="--", linewidth=1.0, alpha=0.8)
        for s in _policies(stats, d, temperature):
            if getattr(s, metric) is None:
                continue
            if s.mean_tree_size:
                ax.plot([s.mean_tree_size], [getattr(s, metric)], marker="*", markersize=13,
                        color=colors[d], markeredgecolor="black", markeredgewidth=0.6, linestyle="none")
            else:  # policy without recorded tree sizes: a dotted level instead of a point
                without_size = True
                ax.axhline(getattr(s, metric), color=colors[d], linestyle=":", linewidth=1.2)
    fixed = lines["fixed"]
    present = [d for d in datasets if any(getattr(s, metric) is not None for s in fixed[d])]
    if len(present) > 1:  # mean over the datasets that have this metric, at budgets all of them ran
        common = [b for b in budgets if all(any(s.budget == b and getattr(s, metric) is not None
                                                for s in fixed[d]) for d in present)]
        if common:
            mean = [sum(getattr(s, metric) for d in present for s in fixed[d] if s.budget == b)
                    / len(present) for b in common]
            ax.plot(common, mean, color="black", linewidth=2.6, marker="s", markersize=5, zorder=5)
    if metric == "speedup":
        ax.axhline(1.0, **AR_LINE)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(budgets))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("Node budget B (log scale)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    return without_size


def _tradeoff_legend(datasets: list[str], colors: dict[str, str], lines: dict[str, dict[str, list[Stats]]],
                     any_policy: bool, policy_without_size: bool, projected: bool = False
                     ) -> tuple[list[Line2D], list[str]]:
    handles = [Line2D([], [], color=colors[d], linewidth=2) for d in datasets]
    labels = [dataset_label(d) for d in datasets]
    if len(datasets) > 1:
        handles.append(Line2D([], [], color="black", linewidth=2.6, marker="s", markersize=5))
        labels.append("Mean over datasets")
    handles += [Line2D([], [], color="gray", marker="o", markersize=4, linewidth=1.6),
                Line2D([], [], color="gray", linestyle="--", linewidth=1.0)]
    labels += ["DDTree, fixed budget (live)", "DFlash (chain, live)"]
    if projected:
        handles += [Line2D([], [], color="gray", **PROJECTED_LINE),
                    Line2D([], [], color="white", marker="*", markersize=11, markeredgecolor="gray", linestyle="none")]
        labels += ["DDTree, fixed budget, projected (replayed on AR's text)", "auto, projected, at its mean size"]
    if any(lines["sampled"].values()):
        handles.append(Line2D([], [], color="gray", **SAMPLED_LINE))
        labels.append("DDTree sampled tree, fixed budget")
    if any(lines["lookup"].values()):
        handles.append(Line2D([], [], color="gray", **LOOKUP_LINE))
        labels.append("DDTree+lookup, fixed budget")
    if any_policy:
        handles.append(Line2D([], [], color="gray", marker="*", markersize=12, markeredgecolor="black",
                              linestyle="none"))
        labels.append("Budget policy (e.g. auto) at its mean tree size")
        if policy_without_size:
            handles.append(Line2D([], [], color="gray", linestyle=":", linewidth=1.2))
            labels.append("Budget policy, tree size not recorded")
    handles.append(Line2D([], [], **AR_LINE))
    labels.append("AR (1×)")
    return handles, labels


def plot_budget_tradeoff(stats: list[Stats], temperature: float, out_dir: str | Path, *,
                         formats: Sequence[str] = ("png", "pdf"), subtitle: str | None = None,
                         projected: Sequence[Stats] = ()) -> list[Path]:
    """Speedup and τ against the node budget (log2 axis), one line per dataset (plus their mean);
    DFlash as dashed reference lines, sampled trees as dash-dot lines with triangles, lookup trees as dotted lines
    with diamonds, budget policies such as ``auto`` (and DFlash's ``chain-auto``) as stars at their mean tree size."""
    datasets = [d for d, t in groups_of(stats) if t == temperature]
    lines = _tradeoff_lines(stats, temperature, datasets)
    projected = [s for s in projected if s.temperature == temperature and s.dataset in datasets]
    replayed_fixed = [s for s in projected if s.is_fixed_tree]
    if not any(rows for by in lines.values() for rows in by.values()) and not replayed_fixed:
        return []
    colors = {d: DATASET_PALETTE[i % len(DATASET_PALETTE)] for i, d in enumerate(datasets)}
    budgets = sorted({s.budget for by in lines.values() for rows in by.values() for s in rows}
                     | {s.budget for s in replayed_fixed})

    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(11, 4.6), layout="constrained")
        axes = fig.subplots(1, 2)
        without_size = False
        for ax, metric, ylabel in ((axes[0], "speedup", "Speedup over AR (×)"),
                                   (axes[1], "tau", "τ (mean tokens committed per round)")):
            without_size |= _tradeoff_axis(ax, metric, ylabel, stats, temperature, datasets, lines, colors, budgets,
                                           projected)
        axes[0].set_title("Speedup")
        axes[1].set_title("Acceptance length τ")
        fig.suptitle(figure_title(f"DDTree budget trade-off, T = {temperature:g}", subtitle))
        any_policy = any(_policies(stats, d, temperature) for d in datasets)
        handles, labels = _tradeoff_legend(datasets, colors, lines, any_policy, without_size, bool(replayed_fixed))
        fig.legend(handles, labels, loc="outside lower center", ncol=min(5, len(labels)), frameon=False)
        return save_figure(fig, Path(out_dir), f"budget_tradeoff_{temperature_tag(temperature)}", formats)


# ---- (c) acceptance-length histograms ----------------------------------------------------------------------------


def _histogram_variants(stats: list[Stats], dataset: str, temperature: float) -> list[tuple[Stats, str, str]]:
    """(stats, legend label, colour) of DFlash, of DDTree at its best budget and, when measured, of the best sampled
    tree (by speedup, else by τ) for one panel."""
    chosen = [(s, f"{s.label} (τ = {s.tau:.2f})", METHOD_COLORS["dflash"])
              for s in [s for s in find(stats, dataset, temperature, "dflash") if s.budget is None][:1]
              if s.tau is not None]
    best = oracle_stats(stats, dataset, temperature)
    if best is not None:
        chosen.append((best, f"DDTree, oracle B = {best.budget} (τ = {best.tau:.2f})", METHOD_COLORS["ddtree"]))
    else:  # no AR to rank by speed: fall back to the budget with the longest acceptance
        fixed = [s for s in find(stats, dataset, temperature, "ddtree") if s.is_fixed_tree and s.tau is not None]
        if fixed:
            s = max(fixed, key=lambda s: s.tau)
            chosen.append((s, f"DDTree, B = {s.budget}, best τ (τ = {s.tau:.2f})", METHOD_COLORS["ddtree"]))
    sampled = [s for s in find(stats, dataset, temperature, "ddtree") if s.is_sampled_tree and s.tau is not None]
    if sampled:
        timed = [s for s in sampled if s.speedup is not None]
        s = max(timed, key=lambda s: s.speedup) if timed else max(sampled, key=lambda s: s.tau)
        chosen.append((s, f"DDTree sampled, B = {s.budget} (τ = {s.tau:.2f})", SAMPLED_SHADES[0]))
    return chosen


def plot_acceptance_histograms(records: Sequence[SampleRecord], stats: list[Stats], temperature: float,
                               out_dir: str | Path, *, formats: Sequence[str] = ("png", "pdf"),
                               subtitle: str | None = None) -> list[Path]:
    """Per dataset: the fraction of rounds committing k tokens, DFlash next to DDTree at its best budget."""
    datasets = [d for d, t in groups_of(stats) if t == temperature]
    panels = [(d, v) for d in datasets if (v := _histogram_variants(stats, d, temperature))]
    if not panels:
        return []
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(4.3 * ncols, 3.3 * nrows + 0.6), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
        for ax, (dataset, variants) in zip(axes, panels):
            width = 0.8 / len(variants)
            longest, highest = 1, 0.0
            for j, (s, label, color) in enumerate(variants):
                lengths = [n for r in records if r.dataset == dataset and r.temperature == temperature
                           and r.variant == s.variant
                           for n in r.acceptance_lengths]
                if not lengths:
                    continue
                counts = Counter(lengths)
                ks = sorted(counts)
                longest = max(longest, ks[-1])
                offset = (j - (len(variants) - 1) / 2) * width
                fractions = [counts[k] / len(lengths) for k in ks]
                highest = max(highest, max(fractions))
                ax.bar([k + offset for k in ks], fractions, width * 0.95, color=color, label=label)
            ax.set_title(dataset_label(dataset))
            ax.set_xlim(0.4, longest + 0.6)
            ax.set_ylim(0, highest * 1.4 + 0.01)  # head room for the legend
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(axis="x", visible=False)
            ax.set_xlabel("Tokens committed per round")
            ax.set_ylabel("Fraction of rounds")
            ax.legend(loc="upper right", frameon=False, fontsize=8.5)
        for ax in axes[len(panels):]:
            ax.set_visible(False)
        fig.suptitle(figure_title(f"Acceptance lengths, {METHOD_LABELS['dflash']} vs {METHOD_LABELS['ddtree']}, "
                            f"T = {temperature:g}", subtitle))
        return save_figure(fig, Path(out_dir), f"acceptance_hist_{temperature_tag(temperature)}", formats)


def plot_all(records: Sequence[SampleRecord], stats: list[Stats], out_dir: str | Path, *,
             formats: Sequence[str] = ("png", "pdf"), fixed_budget: int | None = None,
             subtitle: str | None = None, projected: Sequence[Stats] = ()) -> list[Path]:
    """Every figure for every temperature present; returns the files written. ``projected``: stats of replayed
    records (``experiments.bench.replayer``), drawn in the budget trade-off beside the live rows."""
    paths: list[Path] = []
    for t in _temperatures(stats):
        paths += plot_speedup(stats, t, out_dir, formats=formats, fixed_budget=fixed_budget, subtitle=subtitle)
        paths += plot_budget_tradeoff(stats, t, out_dir, formats=formats, subtitle=subtitle, projected=projected)
        paths += plot_acceptance_histograms(records, stats, t, out_dir, formats=formats, subtitle=subtitle)
    return paths
