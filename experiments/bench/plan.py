"""The dry run: what ``python -m experiments.bench`` would run here, without loading a model or running anything.

    python -m experiments.bench.plan --preset paper  # also: bash run_benchmark.sh --preset paper --dry-run
    python -m experiments.bench.plan --preset paper --hub-datasets   # with the hub-only datasets
    python -m experiments.bench.plan --preset default --json plan.json

It takes the benchmark's own flags (``--target``, ``--draft``, ``--datasets``, ``--max-samples``, ``--full``,
``--time-budget``, ...) and prints, for the resolved preset:

- datasets: which are installed offline, which need the Hugging Face Hub (left out unless asked for; each is
  checked for the package its loader needs and, with an offline switch set, for its folder in the local Hugging
  Face cache: ``experiments.bench.plan_sources``), how many prompts and turns each contributes;
- models per pair: a local folder (its config.json is read), a complete snapshot in the Hugging Face cache, or
  "needs download" (sized from a known published shape when there is no config.json); parameters and checkpoint size;
- devices: the GPUs and ranks the run would use (``run_benchmark.sh`` launches torchrun over all visible GPUs for
  the paper preset), or "no CUDA here"; the GPU memory a pair needs (weights + the KV cache of the longest
  generation: longest prompt + earlier turns' answers + ``max_new_tokens`` + the largest tree + 1);
- disk: what would be downloaded against the free disk of the hub cache (the check ``experiments.bench.models`` makes
  before loading: a pair that cannot fit is refused there);
- time: the decoding time per pair from prior costs (below), sized by the runner's own rule
  (``experiments.bench.sizing.size_run``) to the preset's budget, so the printed plan is the sized plan; plus loading
  and warm-up, which the budget does not count.

Prior costs, not measurements: a target forward costs its per-layer launch overhead plus the larger of reading its
weights and computing its tokens; a DFlash round adds the drafter and the tree; rounds commit tau tokens, with tau
from the papers' published numbers for the z-lab drafters, the model card's for the shipped
one, and 1 for a random drafter. The real run measures seconds per token in its warm-up and sizes itself again
from those, so what it keeps can differ from this plan. Exit status: 0 when the plan was printed (``--check``: 1
when something listed under "blocked" would stop the run), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from experiments.bench.plan_estimates import (
    PRIORS, Prior, _builtin_config, _context, _disk_refusal, _gib, _gpu_fit, pair_memory, seconds_per_token,
    turn_costs,
)
from experiments.bench.plan_render import _jsonable, render
from experiments.bench.plan_sources import DatasetPlan, _devices, dataset_plans

__all__ = ["Prior", "PRIORS", "DatasetPlan", "dataset_plans", "pair_memory", "seconds_per_token", "build_plan",
           "render", "main"]


def build_plan(preset, *, out: Path, full: bool = False, variants=None, required: Sequence[str] = ()) -> dict[str, Any]:
    """The plan as plain data (what :func:`main` prints). ``required``: datasets named by the user (``--datasets``,
    ``--hub-datasets``), which stop the run when unavailable instead of being left out with a note."""
    from experiments.bench.cli import output_folders
    from experiments.bench.models import _free_bytes, hub_cache_dir, hub_offline
    from experiments.bench.variants import make_variants

    variants = make_variants(preset) if variants is None else variants
    datasets = dataset_plans(preset)
    devices = _devices(preset)
    convs = _conversations(preset, datasets)
    plan = {"preset": preset, "out": out, "variants": variants, "datasets": datasets, "devices": devices,
            "prior": PRIORS[devices["kind"]], "run_bytes": _run_bytes(preset, devices["kind"]),
            "context": _context(datasets, preset), "conversations": len(convs), "cache": hub_cache_dir(),
            "offline": hub_offline(), "blocked": _run_blocks(datasets, devices, convs, required), "full": full,
            "required": tuple(required)}
    pairs: list[dict[str, Any]] = []
    download = 0
    for pair, folder in output_folders(preset, out):
        pairs.append(_pair_plan(plan, convs, pair, folder, download))
        download += pairs[-1]["download"]
    free = _free_bytes(plan["cache"]) if download else None
    return {**plan, "pairs": pairs, "download": download, "free": free}


def _run_bytes(preset, kind: str) -> int:
    """Bytes per parameter of the run's dtype on the device kind."""
    import torch

    from experiments.bench.models import resolve_dtype

    return torch.empty(0, dtype=resolve_dtype(preset.dtype, torch.device(kind))).element_size()


def _conversations(preset, datasets: list[DatasetPlan]) -> list:
    """The runner's conversations: every available item at every temperature, numbered in order."""
    from experiments.bench.conversation import Conversation

    convs: list = []
    for temperature in preset.temperatures:
        for d in datasets:
            for item in d.items or []:
                convs.append(Conversation(item, temperature, len(convs)))
    return convs


def _run_blocks(datasets: list[DatasetPlan], devices: dict[str, Any], convs: list,
                required: Sequence[str]) -> list[str]:
    """What stops the whole run before any pair: a named dataset missing, no GPU for a CUDA preset, no prompts."""
    blocked = [f"dataset {d.name} was asked for and is unavailable here: {d.detail}"
               for d in datasets if d.status == "unavailable" and d.name in required]
    if devices["kind"] == "cuda" and not devices["cuda"]:
        blocked.append("this preset runs on CUDA and no GPU is visible here (the run would stop before loading)")
    if not convs:
        blocked.append("no dataset is available here")
    return blocked


def _pair_sources(pair):
    """The pair's target and drafter sources, the target's config (a built-in shape when it has none) and both
    parameter counts (the target's from its config when the source does not know)."""
    from experiments.bench.models import locate_weights, parameter_count

    target, draft = locate_weights(pair.target), locate_weights(pair.draft)
    if pair.draft == "default":  # the shipped drafter: its folder in the package
        from dflash_core.default import DEFAULT_DRAFT_DIR

        draft = dataclasses.replace(locate_weights(str(DEFAULT_DRAFT_DIR)), name="default", kind="built-in")
    target_cfg = target.config or _builtin_config(pair.target)
    t_params = target.params
    if t_params is None and target_cfg:
        t_params = parameter_count(target_cfg)
    return target, draft, target_cfg, t_params, draft.params


def _pair_plan(plan: dict[str, Any], convs: list, pair, folder: Path, earlier: int) -> dict[str, Any]:
    """One pair's part of the plan: sources, memory, what stops it (appended to ``plan['blocked']``: the weights'
    check, the disk after the ``earlier`` pairs' downloads, the GPU memory) and its sized share of the grid."""
    from experiments.bench.models import check_weights

    blocked, run_bytes, devices = plan["blocked"], plan["run_bytes"], plan["devices"]
    target, draft, target_cfg, t_params, d_params = _pair_sources(pair)
    variants = [v for v in plan["variants"] if pair.keeps(v.budget)]
    nodes = max([v.budget for v in variants if isinstance(v.budget, int) and not isinstance(v.budget, bool)] + [0])
    memory = pair_memory(target_cfg, draft.config, t_params, d_params, run_bytes, plan["context"], nodes)
    download = sum(s.download_bytes or 0 for s in (target, draft) if s.kind == "download")
    try:
        check_weights(pair)
    except (FileNotFoundError, ValueError) as err:
        refusal: str | None = str(err)
    else:  # the weights' own check passed: the disk left after the earlier pairs' downloads
        refusal = _disk_refusal(download, earlier, plan["cache"])
    if refusal is not None:
        blocked.append(f"{pair.slug}: {refusal}")
    per_token = {v: seconds_per_token(v, plan["prior"], target_cfg, t_params, draft.config, d_params, pair.draft,
                                      run_bytes) for v in variants}
    costs = turn_costs(plan["preset"], plan["prior"], target_cfg, t_params, draft.config, d_params, run_bytes,
                       replayed=len(bench_replay_variants(plan["preset"])) if draft.params or draft.config else 0)
    sized = _sized_grid(plan, convs, folder, per_token, costs)
    load_s = ((target.checkpoint_bytes or (t_params or 0) * run_bytes) + (draft.checkpoint_bytes or 0)) / 1.5e9
    warm_s = sum(2 * plan["preset"].warmup_tokens * t for t in per_token.values())
    gpu_fit = _gpu_fit(pair, memory, devices)
    if gpu_fit and memory["total"] > gpu_fit["memory"]:
        blocked.append(f"{pair.slug}: needs ~{_gib(memory['total'])} of GPU memory, rank 0's GPUs "
                       f"{gpu_fit['gpus']} have {_gib(gpu_fit['memory'])}")
    return {"pair": pair, "folder": folder, "target": target, "draft": draft, "target_params": t_params,
            "draft_params": d_params, "memory": memory, "refusal": refusal, "download": download, **sized,
            "load_s": load_s, "warm_s": warm_s, "gpu_fit": gpu_fit}


def bench_replay_variants(preset) -> list:
    """The variants the run replays on plain decoding's text (:func:`experiments.bench.replayer.replay_variants`)."""
    from experiments.bench.replayer import replay_variants

    return replay_variants(preset)


def _sized_grid(plan: dict[str, Any], convs: list, folder: Path, per_token: dict, costs=None) -> dict[str, Any]:
    """The pair's units not yet recorded in ``folder``, and what the runner's rule keeps of them in the budget
    (a single-process run with a budget and without --full is sized; a torchrun launch is not)."""
    from experiments.bench.run_folder import existing_records
    from experiments.bench.schema import record_key
    from experiments.bench.sizing import Unit, size_run

    preset = plan["preset"]
    done = existing_records(folder) if folder.is_dir() else {}
    units = [Unit(c, turn, v) for c in convs for turn in range(len(c.item.turns)) for v in plan["variants"]
             if record_key(c.item.dataset, c.item.sample_id, turn, v, c.temperature) not in done]
    sized = not plan["full"] and plan["devices"]["world"] == 1 and bool(preset.time_budget_s)
    budget = preset.time_budget_s if sized else float("inf")
    kept, report = size_run(units, per_token, preset.max_new_tokens, budget, min_samples=preset.min_samples,
                                  costs=costs, min_budgets=preset.min_budgets)
    return {"done": len(done), "units": units, "kept": kept, "report": report, "sized": sized}


def preset_from_args(args: argparse.Namespace, include_hub: bool = False):
    """The preset ``python -m experiments.bench`` resolves from the same flags (one definition, there)."""
    from experiments.bench.cli import preset_from_args as resolve

    return resolve(args, include_hub=include_hub)


def main(argv: Sequence[str] | None = None) -> int:
    own = argparse.ArgumentParser(prog="python -m experiments.bench.plan", add_help=False)
    own.add_argument("--hub-datasets", action="store_true", help="add the preset's hub-only datasets")
    own.add_argument("--json", help="also write the plan as JSON to this file")
    own.add_argument("--check", action="store_true", help="exit 1 when something would stop the run")
    own.add_argument("-h", "--help", action="store_true")
    mine, rest = own.parse_known_args(argv)
    if mine.help:
        print(__doc__)
        return 0
    from experiments.bench.cli import parse_args
    from experiments.bench.variants import make_variants

    try:
        args = parse_args(rest)
    except SystemExit as err:
        return int(err.code or 0) if err.code not in (None, 0) else 2
    try:
        preset = preset_from_args(args, include_hub=mine.hub_datasets)
        variants = make_variants(preset, lookup_budgets=getattr(args, "lookup_budgets", None) or (),
                                       policies=getattr(args, "policy", ()))
    except ValueError as err:
        print(f"plan: {err}", file=sys.stderr)
        return 2
    required = preset.datasets if (args.datasets or mine.hub_datasets) else ()
    plan = build_plan(preset, out=Path(args.out or Path("runs") / preset.name), full=args.full, variants=variants,
                      required=required)
    print(render(plan), flush=True)
    if mine.json:
        Path(mine.json).write_text(json.dumps(_jsonable(plan), indent=2, default=str))
    return 1 if mine.check and plan["blocked"] else 0


if __name__ == "__main__":
    sys.exit(main())
