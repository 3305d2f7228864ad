"""From a runs folder to every figure and table (what ``python plot_results.py`` does)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from experiments.bench.schema import write_text_atomic
from plots.figures import plot_all
from plots.load import Run, find_runs, merge_records, merge_replayed
from plots.metrics import compute_stats, headline_stats
from plots.replayed import auto_vs_oracle, live_paired, projected_table, tau_check
from plots.tables import all_rows, footnote, latex_table, markdown_table, policy_table, stage_table


def describe_runs(runs: list[Run]) -> str | None:
    """A subtitle such as ``cpu · bfloat16 · preset default`` when all runs agree on it, else None."""
    manifests = [run.manifest for run in runs if run.manifest]
    parts = []
    for field in ("device", "dtype", "preset"):
        values = {getattr(m, field) for m in manifests}
        if len(values) == 1 and None not in values:
            value = values.pop()
            parts.append(f"preset {value}" if field == "preset" else str(value))
    return " · ".join(parts) or None


def make_report(runs_dir: str | Path, out_dir: str | Path | None = None, *, formats: Sequence[str] = ("png", "pdf"),
                fixed_budget: int | None = None) -> list[Path]:
    """Write the figures (every format), ``results_table.{md,tex}`` (AR, DFlash, oracle budget, policies, sampled
    and lookup trees next to top-K trees of the same budgets), ``all_budgets.{md,tex}`` (every variant),
    ``policies_vs_oracle.md`` (when a budget policy was measured), ``stage_times.md`` (where a round's time goes,
    when a speculative method was measured), ``replayed.md`` (with replayed records: the projected table, ``auto``
    against the oracle on the same text, replayed vs live τ) and ``auto_live.md`` (``auto`` over the fixed budgets,
    paired per prompt) for the runs under ``runs_dir``; returns the files written."""
    runs_dir = Path(runs_dir)
    out_dir = Path(out_dir) if out_dir is not None else runs_dir / "figures"
    runs = find_runs(runs_dir)
    records = merge_records(runs)
    if not records:
        raise FileNotFoundError(f"no result records under {runs_dir}")
    stats = compute_stats(records)
    replayed = merge_replayed(runs)
    projected = compute_stats(replayed) if replayed else []
    subtitle = describe_runs(runs)
    paths = plot_all(records, stats, out_dir, formats=formats, fixed_budget=fixed_budget, subtitle=subtitle,
                     projected=projected)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stem, rows in (("results_table", headline_stats(stats, fixed_budget)), ("all_budgets", all_rows(stats))):
        md = out_dir / f"{stem}.md"
        write_text_atomic(md, markdown_table(rows) + "\n" + footnote(rows) + "\n")
        tex = out_dir / f"{stem}.tex"
        write_text_atomic(tex, latex_table(rows))
        paths += [md, tex]
    policies = policy_table(records)
    if policies:
        path = out_dir / "policies_vs_oracle.md"
        write_text_atomic(path, policies)
        paths.append(path)
    texts = {"replayed.md": "\n".join(t for t in (
        projected_table(replayed),
        auto_vs_oracle(projected, "auto against the oracle on the same text (replayed, projected)"),
        tau_check(records, replayed)) if t) if replayed else "", "auto_live.md": live_paired(records)}
    for name, text in texts.items():
        if text:
            write_text_atomic(out_dir / name, text)
            paths.append(out_dir / name)
    if any(r.method != "ar" for r in records):
        path = out_dir / "stage_times.md"
        write_text_atomic(path, "Where a round's time goes (all datasets):\n\n" + stage_table(records))
        paths.append(path)
    return paths
