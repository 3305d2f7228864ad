"""The long-context figure: what decoding costs as the context grows, from the long-context study's summary
(``experiments.studies.long_context``, ``bash run_benchmark.sh --preset long``)::

    python -m plots.long_context_figure runs/long/summary.json [--out runs/long/long_context.png]

Left: tokens per second after the prefill, plain decoding and each DDTree budget; middle: each budget's speedup over
plain decoding at the same context; right: plain decoding's step (ms per token) and the prefill rate (prompt tokens
per second), on their own axes.
"""

from __future__ import annotations

from pathlib import Path

from plots.colors import METHOD_COLORS, VARIANT_COLORS
from plots.style import record_figure_main, save_to

__all__ = ["context_lines", "plot_long_context"]


def context_lines(summary: dict) -> dict[str, list[tuple[int, float, float]]]:
    """{method: [(context, tok/s, speedup over plain), ...]} with plain decoding as ``"ar"``, contexts ascending."""
    lines: dict[str, list[tuple[int, float, float]]] = {"ar": []}
    for row in sorted(summary["rows"], key=lambda r: r["context"]):
        lines["ar"].append((row["context"], row["plain_tok_s"], 1.0))
        for name, m in row["methods"].items():
            lines.setdefault(name, []).append((row["context"], m["tok_s"], m["speedup"]))
    return lines


def _style(name: str, shade) -> dict:
    if name == "ar":
        return dict(color=METHOD_COLORS["ar"], label="plain decoding")
    if name.endswith("auto"):
        return dict(color=VARIANT_COLORS["auto"], label="DDTree (auto)")
    return dict(color=shade, label=f"DDTree (B={name.removeprefix('ddtree_')})")


def plot_long_context(summary: dict, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = context_lines(summary)
    fig, (rate, speed, cost) = plt.subplots(1, 3, figsize=(13.0, 3.8))
    fixed = [n for n in lines if n not in ("ar",) and not n.endswith("auto")]
    shades = {n: plt.cm.Reds(0.45 + 0.5 * i / max(len(fixed) - 1, 1)) for i, n in enumerate(fixed)}
    for name, pts in lines.items():
        style = dict(marker="o", markersize=4, linewidth=1.6, **_style(name, shades.get(name)))
        rate.plot([p[0] for p in pts], [p[1] for p in pts], **style)
        if name != "ar":
            speed.plot([p[0] for p in pts], [p[2] for p in pts], **style)
    speed.axhline(1.0, color="black", linewidth=0.8)
    rows = sorted(summary["rows"], key=lambda r: r["context"])
    contexts = [r["context"] for r in rows]
    cost.plot(contexts, [r["plain_step_ms"] for r in rows], marker="o", color=METHOD_COLORS["ar"],
              label="plain step (ms)")
    prefill = cost.twinx()
    prefill.plot(contexts, [r["prefill_tok_s"] for r in rows], marker="s", color="grey", linestyle="--",
                 label="prefill (tokens/s)")
    prefill.set_ylabel("prefill (prompt tokens / s)")
    for ax, label in ((rate, "tokens / s after the prefill"), (speed, "over plain decoding"),
                      (cost, "plain decoding step (ms per token)")):
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    rate.legend(fontsize=7)
    cost.legend(fontsize=7, loc="upper left")
    prefill.legend(fontsize=7, loc="upper right")
    machine, settings = summary.get("machine", {}), summary.get("settings", {})
    fig.suptitle(f"Long contexts: {machine.get('cpu', '')}, {machine.get('dtype', '')}, "
                 f"{settings.get('max_new_tokens', '?')} new tokens per answer", fontsize=9)
    return save_to(fig, out)


def main(argv: list[str] | None = None) -> int:
    return record_figure_main(argv, "python -m plots.long_context_figure", __doc__,
                              "summary.json written by experiments.studies.long_context", "long_context.png",
                              plot_long_context)


if __name__ == "__main__":
    raise SystemExit(main())
