"""The prepared GPU run's one-screen summary, from the steps' results (plain dicts, as written to the output folder)."""

from __future__ import annotations

from typing import Any

WIDTH = 100


def _status(result: dict[str, Any]) -> str:
    text = f"{result.get('status', '?')} ({result.get('wall_s', result.get('seconds', 0)) or 0:.0f} s)"
    why = result.get("error") or result.get("reason")
    return text + (f": {why}"[:WIDTH - 30] if why else "")


def _env_lines(env: dict[str, Any]) -> list[str]:
    info = env.get("environment") or {}
    versions = info.get("versions") or {}
    where = info.get("gpu") or info.get("device", "?")
    memory = f", {info['gpu_memory_gib']} GiB" if info.get("gpu_memory_gib") else ""
    return [f"  device {where}{memory}; python {info.get('python')}, torch {versions.get('torch')} "
            f"(CUDA {info.get('torch_cuda')}), transformers {versions.get('transformers')}"]


def _verify_lines(verify: dict[str, Any]) -> list[str]:
    lines = []
    oracle = verify.get("oracle") or {}
    if "max_abs_diff" in oracle:
        lines.append(f"  tree-attention oracle: {oracle['nodes']} nodes, max |diff| {oracle['max_abs_diff']:.3g} "
                     f"(logit std {oracle['logit_scale']:.3g}), argmax agreement {oracle['argmax_agreement']:.3f}")
    for key, curve in verify.items():
        if key.startswith("verify_cost_") and "tree_median_ms" in curve:
            pairs = zip(curve["appended_tokens"], curve["tree_median_ms"])
            lines.append(f"  verify ms @ctx {curve['context']} (tokens: ms): "
                         + ", ".join(f"{n}: {ms:.1f}" for n, ms in pairs if n in (1, 16, 64, 256, 1024) or n ==
                                     curve["appended_tokens"][-1]))
    return lines


def _exactness_lines(exact: dict[str, Any]) -> list[str]:
    lines = []
    for key, part in exact.items():
        if isinstance(part, dict) and "runs" in part:
            runs = part["runs"]
            oracle = [r for r in runs if r["policy"] == "oracle"]
            lines.append(f"  {key}: {part['exact_match']}/{part['runs_total']} equal plain decoding "
                         f"(oracle trees {sum(r['match'] for r in oracle)}/{len(oracle)}, oracle tau "
                         f"{part.get('oracle_mean_tau')})")
            bad = [r for r in runs if not r["match"]]
            if bad:
                margins = [r.get("plain_top2_margin") for r in bad if r.get("plain_top2_margin") is not None]
                lines.append(f"    mismatches: {len(bad)}, plain decoding's top-2 margin there: "
                             + ", ".join(f"{m:.2g}" for m in margins[:8]))
        elif isinstance(part, dict) and "not_run" in part:
            lines.append(f"  {key}: not run ({part['not_run']})")
    return lines


def _cost_lines(cost: dict[str, Any]) -> list[str]:
    lines = []
    for key, part in cost.items():
        projection = (part or {}).get("projection") if isinstance(part, dict) else None
        if not projection:
            continue
        lines.append(f"  PROJECTION @ctx {part['context']}: plain step {projection['plain_step_ms']:.1f} ms, "
                     f"DFlash round {projection['dflash_round_ms']:.1f} ms, DDTree rounds "
                     + ", ".join(f"B={b} {ms:.1f} ms" for b, ms in projection["ddtree_round_ms"].items()))
        for dataset, row in projection["datasets"].items():
            pub = row["published"]
            lines.append(f"    {dataset}: DFlash {row['projected_dflash']:.2f}x (paper {pub['dflash']['speedup']}x), "
                         "DDTree " + ", ".join(f"B={b} {s:.2f}x" for b, s in row["projected_ddtree"].items())
                         + f" (paper {pub['ddtree']['speedup']}x)")
    return lines


def _benchmark_lines(bench: dict[str, Any]) -> list[str]:
    return [f"  {name}: tau {v['tau']:.2f}, {v['tokens_per_s']:.1f} tok/s, median speedup "
            f"{v['median_speedup'] if v['median_speedup'] is None else round(v['median_speedup'], 2)}x"
            + ("" if name == "ar" else f", equal to plain {v['equal_to_ar']}/{v['records']}")
            for name, v in (bench.get("variants") or {}).items()]


MODES = {"full": "full run", "check": "5-minute check (--check)"}


def summarize(results: dict[str, dict[str, Any]], mode: str = "full", time_budget: float | None = None,
              not_run: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """``{"mode", "time_budget_s", "steps": {step: status}, "not_run": [...], "lines": [...]}``: which mode ran, the
    status of every step it ran and its headline numbers, and the steps the mode leaves out (``not_run``)."""
    detail = {"env": _env_lines, "verify": _verify_lines, "exactness": _exactness_lines, "round_cost": _cost_lines,
              "benchmark": _benchmark_lines}
    budget = f", {time_budget:.0f} s budget" if time_budget else ""
    lines = ["=" * WIDTH, f"DDTree prepared GPU run: summary of the {MODES.get(mode, mode)}{budget}", "=" * WIDTH]
    for name, result in results.items():
        lines.append(f"{name}: {_status(result)}")
        try:
            lines += detail[name](result)
        except (KeyError, TypeError, ValueError) as err:  # a partial result must not cost the summary
            lines.append(f"  (summary of this step failed: {type(err).__name__}: {err})")
    if not_run:
        lines.append(f"not run in this mode (no file): {', '.join(not_run)}")
    lines.append("=" * WIDTH)
    return {"mode": mode, "time_budget_s": time_budget, "steps": {name: r.get("status") for name, r in results.items()},
            "not_run": list(not_run), "lines": lines}
