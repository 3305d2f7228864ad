"""The throughput figure: tokens per second against batch size, one line per method, from the benchmark's throughput
mode (``experiments.bench.throughput``)::

    python -m plots.throughput_figure runs/throughput/throughput.json [--out runs/throughput/throughput.png]

The left panel is tokens/s (all new tokens over all calls' wall time, prefill included); the right panel divides each
method by plain decoding at the same batch size, so the line at 1 is where speculation stops paying.
"""

from __future__ import annotations

from pathlib import Path

from plots.colors import METHOD_COLORS, VARIANT_COLORS
from plots.style import record_figure_main, save_to

__all__ = ["throughput_lines", "plot_throughput"]


def throughput_lines(record: dict) -> dict[str, list[tuple[int, float, float]]]:
    """{method: [(batch size, tok/s, over plain), ...]} from a throughput record's summary, batch sizes ascending."""
    lines: dict[str, list[tuple[int, float, float]]] = {}
    for size, entry in sorted(record["summary"].items(), key=lambda kv: int(kv[0])):
        for name, m in entry["methods"].items():
            lines.setdefault(name, []).append((int(size), m["tok_s"], m.get("over_plain", float("nan"))))
    return lines


def _color(name: str) -> str | None:
    if name in METHOD_COLORS:
        return METHOD_COLORS[name]
    if name.startswith("auto"):
        return {"auto": VARIANT_COLORS["auto"], "auto+lookup": METHOD_COLORS["pld"]}.get(name, VARIANT_COLORS["other"])
    return None  # fixed budgets: shades of red, set by the caller


def plot_throughput(record: dict, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = throughput_lines(record)
    settings = record.get("settings", {})
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.0))
    fixed = [n for n in lines if n.startswith("ddtree-")]
    shades = {n: plt.cm.Reds(0.35 + 0.6 * i / max(len(fixed) - 1, 1)) for i, n in enumerate(fixed)}
    for name, pts in lines.items():
        style = dict(color=shades.get(name) or _color(name), marker="o", markersize=4,
                     linestyle="--" if name.startswith("ddtree-") else "-", linewidth=1 if name.startswith("ddtree-")
                     else 2)
        left.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **style)
        right.plot([p[0] for p in pts], [p[2] for p in pts], label=name, **style)
    right.axhline(1.0, color="black", linewidth=0.8)
    for ax, label in ((left, "tokens / s (all sequences)"), (right, "over plain decoding at the same batch size")):
        sizes = sorted({p[0] for pts in lines.values() for p in pts})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("batch size (sequences decoded together)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=7)
    machine = record.get("machine", {}).get("cpu", "")
    fig.suptitle(f"Throughput vs batch size: {settings.get('dtype', '')}, {settings.get('threads', '?')} threads"
                 + (f", {machine}" if machine else "") + f", {settings.get('max_new_tokens', '?')} new tokens",
                 fontsize=9)
    return save_to(fig, out)


def main(argv: list[str] | None = None) -> int:
    return record_figure_main(argv, "python -m plots.throughput_figure", __doc__,
                              "throughput.json written by experiments.bench.throughput", "throughput.png",
                              plot_throughput)


if __name__ == "__main__":
    raise SystemExit(main())
