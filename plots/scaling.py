"""The drafter's scaling curve: tau against training tokens seen, from a training log, with a log-linear projection.

    python -m plots.scaling --log dflash_core/zoo/smollm2-135m-dflash/training_log.json --out scaling.png

The log (``training_log.json`` next to the shipped drafter, extended by ``python -m
experiments.studies.drafter_stream``) holds ``curve``: fixed-protocol evaluations with the cumulative response tokens
the drafter had trained on. The projection fits tau = a + b * log10(tokens) to the points and solves for a goal; it says
how many tokens the trend needs, not that the trend holds.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

__all__ = ["fit_log_linear", "tokens_for", "scaling_summary", "gpu_projection", "plot_scaling"]


def fit_log_linear(tokens: list[float], taus: list[float]) -> tuple[float, float] | None:
    """Least-squares (a, b) of tau = a + b * log10(tokens); None with fewer than two distinct token counts."""
    pts = [(math.log10(t), y) for t, y in zip(tokens, taus) if t > 0]
    xs = [x for x, _ in pts]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return my - b * mx, b


def tokens_for(fit: tuple[float, float] | None, goal: float) -> float | None:
    """Tokens at which the fitted line reaches ``goal`` (None when it does not rise)."""
    if fit is None or fit[1] <= 0:
        return None
    return 10 ** ((goal - fit[0]) / fit[1])


def base_series(log: dict) -> list[dict]:
    """The curve's points of the original design (no ``series`` field); other designs are their own series
    (e.g. ``"markov"``: drafters with a Markov head) and stay out of the fit."""
    return [p for p in log.get("curve", []) if p.get("series", "base") == "base"]


def scaling_summary(log: dict, goals: dict[str, float] | None = None) -> dict:
    """Per tau kind: the fit, the tokens the goal needs, and the CPU hours that takes at the last run's rate."""
    goals = goals or {"tau_chain": 2.5, "tau_b32": 3.3}
    curve = base_series(log)
    runs = log.get("runs", [])
    rate = runs[-1].get("end_to_end_response_tokens_per_s") if runs else None
    out = {}
    for kind, goal in goals.items():
        fit = fit_log_linear([p["tokens"] for p in curve], [p[kind] for p in curve])
        need = tokens_for(fit, goal)
        last = max((p["tokens"] for p in curve), default=0)
        out[kind] = {"fit": fit, "goal": goal, "tokens_needed": need,
                     "more_tokens": None if need is None else max(0.0, need - last),
                     "cpu_hours": None if need is None or not rate else max(0.0, need - last) / rate / 3600}
    return out


def gpu_projection(log: dict, goals: dict[str, float], series: str = "markov") -> dict:
    """What the GPU runs of one design's series need to reach ``goals``: per tau kind, the log-linear fit through
    that series' points, the cumulative tokens the goal needs, the tokens beyond the series' last point, and the
    GPU minutes that takes at the rate of the log's GPU runs (response tokens seen per training minute, from runs
    that name a ``gpu`` and record ``response_tokens_seen_est`` and ``train_minutes``). A fit through few points of
    one design; the minutes are at the recorded rate and schedule, not a promise that the trend holds."""
    curve = [p for p in log.get("curve", []) if p.get("series", "base") == series]
    gpu_runs = [r for r in log.get("runs", []) if r.get("gpu") and r.get("response_tokens_seen_est")
                and r.get("train_minutes")]
    rate = (sum(r["response_tokens_seen_est"] for r in gpu_runs) / sum(r["train_minutes"] for r in gpu_runs)
            if gpu_runs else None)
    last = max((p["tokens"] for p in curve), default=0)
    out = {"series": series, "points": len(curve), "tokens_per_gpu_minute": rate}
    for kind, goal in goals.items():
        fit = fit_log_linear([p["tokens"] for p in curve], [p[kind] for p in curve])
        need = tokens_for(fit, goal)
        more = None if need is None else max(0.0, need - last)
        out[kind] = {"fit": fit, "goal": goal, "tokens_needed": need, "more_tokens": more,
                     "gpu_minutes": None if more is None or not rate else more / rate}
    return out


def plot_scaling(log: dict, out: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = base_series(log)
    others = [p for p in log.get("curve", []) if p.get("series", "base") != "base"]
    summary = scaling_summary(log)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for kind, color, label in (("tau_chain", "tab:blue", "DFlash chain"), ("tau_b32", "tab:orange", "DDTree B=32")):
        pts = sorted((p["tokens"], p[kind]) for p in curve if p["tokens"] > 0)
        if not pts:
            continue
        ax.plot([t for t, _ in pts], [y for _, y in pts], "o-", color=color, label=label, markersize=4)
        fit, goal = summary[kind]["fit"], summary[kind]["goal"]
        ax.axhline(goal, color=color, linestyle=":", linewidth=1)
        if fit is not None and fit[1] > 0:
            lo, hi = pts[0][0], max(pts[-1][0], summary[kind]["tokens_needed"] or pts[-1][0])
            xs = [lo * (hi / lo) ** (i / 40) for i in range(41)]
            ax.plot(xs, [fit[0] + fit[1] * math.log10(x) for x in xs], "--", color=color, linewidth=1,
                    label=f"{label} fit (goal {goal} at {summary[kind]['tokens_needed']:.2g} tokens)")
    for kind, color, label in (("tau_chain", "navy", "DFlash chain"), ("tau_b32", "darkred", "DDTree B=32")):
        for series in sorted({p["series"] for p in others}):
            pts = sorted((p["tokens"], p[kind]) for p in others if p["series"] == series and p["tokens"] > 0)
            if pts:
                ax.plot([t for t, _ in pts], [y for _, y in pts], "s--", color=color, markersize=6,
                        label=f"{label}, {series} design")
    ax.set_xscale("log")
    ax.set_xlabel("training response tokens seen (cumulative, all runs)")
    ax.set_ylabel("tau (fixed protocol: 24 prompts, greedy, 128 tokens)")
    ax.set_title(title or "Drafter scaling curve")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m plots.scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--log", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    log = json.loads(Path(a.log).read_text())
    print(f"wrote {plot_scaling(log, a.out, a.title)}")
    print(json.dumps(scaling_summary(log), indent=1))
    print(json.dumps(gpu_projection(log, {"tau_chain": 2.3, "tau_b32": 3.1}), indent=1))


if __name__ == "__main__":
    main()
