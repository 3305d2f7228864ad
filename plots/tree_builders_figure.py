"""The tree-builder comparison figure, from ``experiments.bench.tree_builders``' summary::

    python -m plots.tree_builders_figure runs/baselines/summary.json [--out runs/baselines/tree_builders.png]

One row per temperature, three panels against the node budget: tau (committed tokens per round), the speedup over
plain decoding, and tau per verified node (tree efficiency). Replayed results are lines, live ones are markers
without lines; the drafter's chain (DFlash) is a dotted horizontal line. The x axis is log2 of the budget.
"""

from __future__ import annotations

from pathlib import Path

from plots.colors import METHOD_COLORS
from plots.style import record_figure_main, save_to

__all__ = ["BUILDER_COLORS", "series", "plot_tree_builders"]

BUILDER_COLORS = {"ddtree": METHOD_COLORS["ddtree"], "dflash": METHOD_COLORS["dflash"], "eagle2": "#2ca02c",
                  "sequoia": "#9467bd", "medusa": "#8c564b", "sampled": "#ff7f0e", "traversal": "#e377c2",
                  "specinfer": "#17becf"}
PANELS = (("tau", "tau (committed tokens / round)"), ("speedup", "speedup over plain decoding"),
          ("tau_per_node", "tau per verified node"))


def series(summary: list[dict], form: str, temperature: float, metric: str) -> dict[str, list[tuple[int, float]]]:
    """{method: [(budget, value), ...]} of one form and temperature, budgets ascending; the chain under budget 0."""
    out: dict[str, list[tuple[int, float]]] = {}
    for e in summary:
        if e["form"] == form and e["temperature"] == temperature and e.get(metric) is not None:
            out.setdefault(e["method"], []).append((int(e["budget"] or 0), float(e[metric])))
    return {m: sorted(pts) for m, pts in out.items()}


def plot_tree_builders(record: dict, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = record["summary"]
    temperatures = sorted({e["temperature"] for e in summary})
    fig, axes = plt.subplots(len(temperatures), len(PANELS), figsize=(13, 3.6 * len(temperatures)), squeeze=False)
    for row, temperature in zip(axes, temperatures):
        for ax, (metric, label) in zip(row, PANELS):
            for form, style in (("replay", dict(linestyle="-", marker="o", markersize=3)),
                                ("live", dict(linestyle="none", marker="s", markersize=6, fillstyle="none"))):
                for method, pts in series(summary, form, temperature, metric).items():
                    color = BUILDER_COLORS.get(method, "#7f7f7f")
                    if method == "dflash":
                        if form == "replay":
                            ax.axhline(pts[0][1], color=color, linestyle=":", linewidth=1.2, label="dflash (chain)")
                        continue
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color,
                            label=f"{method} ({form})", **style)
            if metric == "speedup":
                ax.axhline(1.0, color="black", linewidth=0.8)
            budgets = sorted({int(e["budget"]) for e in summary if e["budget"]})
            ax.set_xscale("log", base=2)
            if budgets:
                ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.set_xlabel("node budget")
            ax.set_ylabel(label)
            ax.set_title(f"T = {temperature:g}", fontsize=9)
            ax.grid(True, alpha=0.3)
        row[0].legend(fontsize=6, ncol=2)
    settings = record.get("settings", {})
    fig.suptitle(f"Tree builders on one drafter: {record.get('machine', '')}; replay "
                 f"{settings.get('max_new_tokens', '?')} tokens, live {settings.get('live_max_new_tokens', '?')}",
                 fontsize=9)
    return save_to(fig, out)


def main(argv: list[str] | None = None) -> int:
    return record_figure_main(argv, "python -m plots.tree_builders_figure", __doc__,
                              "summary.json written by experiments.bench.tree_builders", "tree_builders.png",
                              plot_tree_builders)


if __name__ == "__main__":
    raise SystemExit(main())
