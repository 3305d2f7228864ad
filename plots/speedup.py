"""The speedup figure: one panel per method family, one colour family per panel with a distinct shade per variant.

Each panel groups its bars by dataset (and their mean), so a group holds the few variants of one family (DFlash's
chain and chosen length; DDTree's fixed budgets and ``auto``; sampled trees; prompt lookup and DDTree+lookup; user
policies) and every bar's value label, written upright above it, has its own column: labels never overlap. Panels
share the y axis, so heights compare across families at a glance. The oracle (the best fixed DDTree budget per
dataset, chosen after the fact) is the fixed-budget bar with a black triangle at its foot; the tables hold every
number.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from experiments.bench.schema import dataset_label
from plots.metrics import Stats, groups_of, oracle_stats
from plots.style import STYLE, figure_title, save_figure, temperature_tag

__all__ = ["FAMILY_SHADES", "plot_speedup", "speedup_families"]

# Per family: shades from light to dark (sequential ColorBrewer palettes), so variants of one family read as one
# family and still apart; the policy of a family (auto) takes the darkest shade and a hatch.
FAMILY_SHADES = {
    "DFlash": ("#9ecae1", "#2171b5", "#08306b"),
    "DDTree": ("#fcbba1", "#fc9272", "#fb6a4a", "#ef3b2c", "#cb181d", "#a50f15", "#67000d"),
    "DDTree sampled": ("#dadaeb", "#bcbddc", "#9e9ac8", "#807dba", "#6a51a3", "#4a1486"),
    "Lookup": ("#a1d99b", "#74c476", "#41ab5d", "#238b45", "#006d2c", "#00441b"),
    "Your policies": ("#d9b38c", "#b07d4f", "#8c564b", "#5c3a2e"),
}
AR_LINE = {"color": "#555555", "linestyle": ":", "linewidth": 1.3}
POLICY_HATCH = "///"


def _family(s: Stats) -> str | None:
    if s.method == "ar":
        return None
    if s.method == "dflash":
        return "DFlash"
    if s.method == "pld" or s.is_lookup_tree or (s.method == "ddtree" and s.policy == "lookup"):
        return "Lookup"
    if s.is_sampled_tree:
        return "DDTree sampled"
    if s.is_fixed_tree or s.budget in ("auto",):
        return "DDTree"
    return "Your policies"


def _order(s: Stats) -> tuple:
    """Within a family: PLD first, then int budgets by size, then policies (auto last)."""
    if s.method == "pld":
        return (0, 0, "")
    if isinstance(s.budget, int):
        return (1, s.budget, "")
    return (2 if s.budget is None else 3, 0, str(s.budget))


def speedup_families(stats: list[Stats], temperature: float) -> dict[str, list[tuple[str, str, bool]]]:
    """{family: [(label, colour, is_policy)]} in display order, for the variants with a speedup at ``temperature``."""
    rows = sorted({(s.label, _family(s)): s for s in stats
                   if s.temperature == temperature and s.speedup is not None and _family(s)}.items(),
                  key=lambda kv: _order(kv[1]))
    out: dict[str, list[tuple[str, str, bool]]] = {}
    for family in FAMILY_SHADES:
        members = [(label, s) for (label, fam), s in rows if fam == family]
        shades = FAMILY_SHADES[family]
        n = len(members)
        for i, (label, s) in enumerate(members):  # spread over the palette, darkest for the last (the policy)
            shade = shades[round(i * (len(shades) - 1) / (n - 1))] if n > 1 else shades[round(0.6 * (len(shades) - 1))]
            policy = isinstance(s.budget, str) and s.method != "pld"
            out.setdefault(family, []).append((label, shade, policy))
    return out


def _panel(ax, stats: list[Stats], temperature: float, datasets: list[str], members, show_mean: bool) -> float:
    """Draw one family's bars; returns the highest value drawn."""
    groups = datasets + (["Mean"] if show_mean else [])
    width = 0.84 / max(len(members), 1)
    top = 1.0
    for j, (label, color, policy) in enumerate(members):
        by = {s.dataset: s for s in stats if s.temperature == temperature and s.label == label
              and s.speedup is not None}
        offset = (j - (len(members) - 1) / 2) * width
        values = [(i, by[d].speedup, by[d]) for i, d in enumerate(datasets) if d in by]
        if show_mean and len(by) == len(datasets):
            values.append((len(datasets), sum(s.speedup for s in by.values()) / len(by), None))
        for i, value, s in values:
            x = i + offset
            ax.bar(x, value, width * 0.9, color=color, edgecolor="white" if not policy else "#222222",
                   linewidth=0.4, hatch=POLICY_HATCH if policy else None, label=label if i == values[0][0] else None)
            peak = value
            if s is not None and s.speedup_q25 is not None and s.num_paired > 1:
                ax.plot([x, x], [s.speedup_q25, s.speedup_q75], color="black", linewidth=0.8)
                peak = max(peak, s.speedup_q75)
            if s is not None and s.is_fixed_tree and _is_oracle(stats, s):  # inside the bar, at its foot
                ax.plot([x], [0.04], marker="^", color="black", markeredgecolor="white", markersize=6,
                        linestyle="none", transform=ax.get_xaxis_transform())
            ax.annotate(f"{value:.2f}", (x, peak), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", rotation=90, fontsize=7)
            top = max(top, peak)
    ax.axhline(1.0, **AR_LINE)
    if show_mean:
        ax.axvline(len(datasets) - 0.5, color="#999999", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [dataset_label(g) for g in groups])
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.grid(axis="x", visible=False)
    return top


def _is_oracle(stats: list[Stats], s: Stats) -> bool:
    best = oracle_stats(stats, s.dataset, s.temperature)
    return best is not None and best.budget == s.budget


def plot_speedup(stats: list[Stats], temperature: float, out_dir: str | Path, *,
                 formats: Sequence[str] = ("png", "pdf"), fixed_budget: int | None = None,
                 subtitle: str | None = None) -> list[Path]:
    """Token-weighted speedup over AR per dataset (and the mean), one panel per method family (see the module
    docstring); per-prompt interquartile ranges as thin black lines. ``fixed_budget`` is accepted for the callers'
    sake: every fixed budget is drawn anyway."""
    families = speedup_families(stats, temperature)
    if not families:
        return []
    datasets = [d for d, t in groups_of(stats) if t == temperature
                and any(s.speedup is not None and s.method != "ar"
                        for s in stats if s.dataset == d and s.temperature == t)]
    show_mean = len(datasets) > 1
    widest = max(len(m) for m in families.values())
    with matplotlib.rc_context(STYLE):
        width_in = min(18.0, max(12.0, 0.22 * (len(datasets) + show_mean) * widest + 3.5))
        fig = Figure(figsize=(width_in, 2.7 * len(families) + 1.2), layout="constrained")
        axes = fig.subplots(len(families), 1, sharey=True, squeeze=False)[:, 0]
        top = 1.0
        for ax, (family, members) in zip(axes, families.items()):
            top = max(top, _panel(ax, stats, temperature, datasets, members, show_mean))
            ax.set_ylabel("Speedup (×)")
            ax.set_title(family, loc="left", fontsize=11)
            handles, labels = ax.get_legend_handles_labels()
            ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8.5)
        axes[0].set_ylim(0, top * 1.28)
        fig.suptitle(figure_title(f"Decoding speedup over AR per dataset, T = {temperature:g}", subtitle))
        keys = [Line2D([], [], **AR_LINE), Line2D([], [], color="black", linewidth=0.8),
                Line2D([], [], color="black", marker="^", markersize=6, linestyle="none")]
        fig.legend(keys, ["AR (1×)", "per-prompt interquartile range",
                          "best fixed budget of the dataset (oracle, chosen after the fact)"],
                   loc="outside lower center", ncol=3, frameon=False)
        return save_figure(fig, Path(out_dir), f"speedup_{temperature_tag(temperature)}", formats)
