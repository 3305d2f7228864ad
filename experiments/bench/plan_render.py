"""The dry run's plan as text and as JSON (:mod:`experiments.bench.plan` builds the plan, this module only writes
it)."""

from __future__ import annotations

import os
from typing import Any

from experiments.bench.plan_estimates import _gib

_WHERE = {"built-in": "built in (nothing to load from disk)", "local": "local folder {path}",
          "cached": "in the hub cache ({path})"}
_CONFIG_FROM = {"config.json": " (from its config.json)", "published shape": " (its published shape)",
                "estimated": " (estimated from the published recipe)"}


def _minutes(s: float) -> str:
    return f"{s / 60:.1f} min" if s < 5400 else f"{s / 3600:.1f} h"


def _summarize_kept(kept, variants) -> str:
    per_dataset: dict[str, set] = {}
    for u in kept:
        per_dataset.setdefault(u.conv.item.dataset, set()).add(u.conv.item.sample_id)
    labels = [v.label for v in variants if any(u.variant == v for u in kept)]
    return (", ".join(f"{d} x{len(s)}" for d, s in per_dataset.items()) + "; variants: " + ", ".join(labels))


def _launch_line(plan) -> str:
    preset, devices = plan["preset"], plan["devices"]
    base = f"python -m experiments.bench --preset {preset.name} --out {plan['out']}"
    if devices["world"] > 1 and not os.environ.get("WORLD_SIZE"):
        return f"torchrun --standalone --nproc_per_node={devices['world']} -m experiments.bench ..." \
               f" (run_benchmark.sh: {devices['world']} GPUs, one rank each)"
    return base


def render(plan: dict[str, Any]) -> str:
    preset = plan["preset"]
    lines = [f"dry run: preset {preset.name} ({preset.description})", f"  output: {plan['out']}", ""]
    lines += _dataset_lines(plan)
    lines += _model_lines(plan)
    lines += _device_lines(plan)
    lines += _disk_lines(plan)
    lines += _time_lines(plan)
    lines += ["", "would run:", f"  {_launch_line(plan)}"]
    for p in plan["pairs"]:
        variants = [v for v in plan["variants"] if p["pair"].keeps(v.budget)]
        lines.append(f"  {p['folder']}: {len(p['kept'])} generations of {preset.max_new_tokens} tokens at most "
                     f"({p['done']} records already there): {_summarize_kept(p['kept'], variants)}")
    if plan["blocked"]:
        lines += ["", "blocked (the run would stop here):"] + [f"  - {b}" for b in plan["blocked"]]
    lines += ["", "dry run only: nothing was loaded or run."]
    return "\n".join(lines)


def _dataset_lines(plan) -> list[str]:
    lines = ["datasets:"]
    for d in plan["datasets"]:
        if d.status == "available" and d.items is not None:
            lines.append(f"  {d.name:14s} offline, {d.prompts} prompts ({d.turns} turns) x "
                         f"{len(plan['preset'].temperatures)} temperature(s)")
        elif d.status == "available":
            lines.append(f"  {d.name:14s} hub: {d.detail}")
        elif d.status == "unavailable":
            lines.append(f"  {d.name:14s} unavailable: {d.detail}"
                         + ("" if d.name in plan["required"] else " (the run leaves it out with a note)"))
        else:
            lines.append(f"  {d.name:14s} {d.status}: {d.detail}")
    return lines


def _model_lines(plan) -> list[str]:
    lines = ["", f"models ({len(plan['pairs'])} pair(s); run dtype {plan['run_bytes']} bytes per parameter; "
             f"Hugging Face cache {plan['cache']}{', HF_HUB_OFFLINE set' if plan['offline'] else ''}):"]
    memory_name = "GPU memory" if plan["devices"]["kind"] == "cuda" else "memory"
    for p in plan["pairs"]:
        pair = p["pair"]
        lines.append(f"  {pair.slug}: {pair.target} + {pair.draft}"
                     + (f"  [device_map={pair.device_map}]" if pair.device_map else "")
                     + (f"  [chat: {dict(pair.chat_template_kwargs)}]" if pair.chat_template_kwargs else ""))
        lines.append(_source_line("target", p["target"], p["target_params"]))
        lines.append(_source_line("drafter", p["draft"], p["draft_params"]))
        m = p["memory"]
        if m["total"]:
            lines.append(f"    {memory_name} ~{_gib(m['total'])}: weights {_gib(m['weights'])} + KV cache "
                         f"{_gib(m['kv_target'])} (target) + {_gib(m['kv_draft'])} (drafter) at the longest "
                         f"generation, ~{plan['context']} positions"
                         + (f" + {_gib(m['node_states'])} of per-node recurrent states (hybrid target, "
                            f"largest tree)" if m.get("node_states") else ""))
        if pair.max_budget:
            lines.append(f"    node budgets above {pair.max_budget} are left out for this pair (ModelPair.max_budget)")
    return lines


def _source_line(role: str, src, params: int | None) -> str:
    """Where one model of a pair comes from and its size."""
    if src.kind == "download":
        where = "needs download" + (f" (~{_gib(src.download_bytes)})" if src.download_bytes else " (size unknown)")
    else:
        where = _WHERE[src.kind].format(path=src.path)
    size = f"{params / 1e9:.2f} B parameters" if params else "size unknown"
    if src.config_from and src.kind != "built-in":
        size += _CONFIG_FROM.get(src.config_from, "")
    if src.checkpoint_bytes and src.kind != "download":
        size += f", {_gib(src.checkpoint_bytes)} on disk"
    return f"    {role:8s} {where}; {size}"


def _device_lines(plan) -> list[str]:
    devices, prior = plan["devices"], plan["prior"]
    lines = ["", "devices:"]
    if devices["gpus"]:
        for g in devices["gpus"]:
            lines.append(f"  cuda:{g['index']} {g['name']} ({_gib(g['memory'])})")
        lines.append(f"  ranks: {devices['world']} ({_launch_line(plan)})")
        for p in plan["pairs"]:
            if p["gpu_fit"]:
                lines.append(f"  {p['pair'].slug}: rank 0 holds it on GPU(s) {p['gpu_fit']['gpus']} "
                             f"({_gib(p['gpu_fit']['memory'])})")
    elif devices["kind"] == "cuda":
        lines.append("  no CUDA here: this preset would run on CUDA, one rank per visible GPU "
                     "(run_benchmark.sh launches torchrun when there are several; a device_map=auto pair spreads "
                     "over its rank's share); times below assume " + prior.name)
    else:
        import torch

        lines.append(f"  cpu, {torch.get_num_threads()} threads; times below assume {prior.name}")
    return lines


def _disk_lines(plan) -> list[str]:
    lines = ["", "disk:"]
    weights = sum((p["target"].checkpoint_bytes or 0) + (p["draft"].checkpoint_bytes or 0) for p in plan["pairs"]
                  if p["target"].kind != "built-in")
    if weights:
        lines.append(f"  the pairs' checkpoints take ~{_gib(weights)} in all (kept on disk: one pair is loaded at "
                     "a time, but nothing is deleted)")
    if plan["download"]:
        refused = sorted({p["pair"].slug for p in plan["pairs"]  # the pairs' own refusals (not the datasets')
                          if p["refusal"] and ("free" in p["refusal"] or "HF_HUB_OFFLINE" in p["refusal"])})
        verdict = "REFUSED at load for " + ", ".join(refused) if refused else "fits"
        lines.append(f"  downloads ~{_gib(plan['download'])} into {plan['cache']}, {_gib(plan['free'])} free now"
                     f"{' (HF_HUB_OFFLINE is set: no download at all)' if plan['offline'] else ''}: {verdict}")
    else:
        lines.append("  nothing to download")
    return lines


def _time_lines(plan) -> list[str]:
    lines = ["", "time (priors; the run re-sizes itself from its warm-up):"]
    total = 0.0
    world = plan["devices"]["world"]
    for p in plan["pairs"]:
        lines.append(f"  {p['pair'].slug}: decoding {_decoding_note(plan, p)}; + loading ~{_minutes(p['load_s'])}, "
                     f"warm-up ~{_minutes(p['warm_s'])}")
        total += p["report"]["projected_s"] / max(world, 1) + p["load_s"] + p["warm_s"]
    lines.append(f"  total ~{_minutes(total)}")
    return lines


def _decoding_note(plan, p) -> str:
    """A pair's decoding time: sized to the budget (what the runner's rule leaves out), or the whole grid."""
    r, budget_s = p["report"], plan["preset"].time_budget_s
    if p["sized"]:
        samples = sum(1 for w in r["left_out"] if " sample " in w)
        others = [w for w in r["left_out"] if " sample " not in w]
        what = ", ".join(([f"{samples} samples"] if samples else []) + others)
        note = (f"full grid {_minutes(r['projected_full_s'])} > budget {_minutes(budget_s)}: "
                f"left out by the runner's rule: {what}; kept {_minutes(r['projected_s'])}"
                if r["left_out"] else f"{_minutes(r['projected_s'])} (budget {_minutes(budget_s)})")
        if r["projected_s"] > budget_s:
            note += " (still over: nothing more is left out)"
        return note
    if plan["devices"]["world"] > 1:
        return (f"{_minutes(r['projected_full_s'])} of decoding, shared by {plan['devices']['world']} ranks: "
                "the runner does not size a torchrun launch")
    return f"{_minutes(r['projected_full_s'])} (no budget: the whole grid)"


def _jsonable(plan: dict[str, Any]) -> dict[str, Any]:
    return {
        "preset": plan["preset"].to_dict(), "out": str(plan["out"]), "devices": plan["devices"],
        "datasets": [{"name": d.name, "source": d.source, "status": d.status, "detail": d.detail,
                      "prompts": d.prompts, "turns": d.turns} for d in plan["datasets"]],
        "context": plan["context"], "download_bytes": plan["download"], "free_bytes": plan["free"],
        "blocked": plan["blocked"],
        "pairs": [{"slug": p["pair"].slug, "target": p["pair"].target, "draft": p["pair"].draft,
                   "target_source": p["target"].kind, "draft_source": p["draft"].kind,
                   "target_params": p["target_params"], "draft_params": p["draft_params"], "memory": p["memory"],
                   "download_bytes": p["download"], "sized": p["sized"], "budget_s": p["report"]["budget_s"],
                   "projected_full_s": p["report"]["projected_full_s"], "projected_s": p["report"]["projected_s"],
                   "left_out": p["report"]["left_out"], "generations": len(p["kept"]), "load_s": p["load_s"],
                   "warm_s": p["warm_s"]} for p in plan["pairs"]],
    }
