"""The benchmark runner: ``python -m experiments.bench [--preset default|quick|sampling|paper|tiny] [overrides]``.

For every (temperature, dataset, sample, turn) the runner generates with every method variant back to back on the
same prompt: AR first (the reference for ``matches_ar`` and, for MT-Bench, the shared conversation history), then
DFlash, PLD and the DDTree variants (budgets; tree kinds top-K and sampled; lookup branches; user policies) in an
order that rotates from turn to turn, so drift and noise hit all methods alike.
Each variant gets one untimed warm-up generation before anything is timed.

A run folder (``--out``, default ``runs/<preset>``) holds ``records.jsonl`` (one SampleRecord per finished
generation, appended and fsynced at once), per-rank ``records.rank<r>.jsonl`` while a torchrun run is in flight, and
``manifest.json`` (:mod:`experiments.bench.run_folder`). Rerunning the same command skips every finished record. A
preset with several model pairs (``paper``) writes one such folder per pair under ``--out``. A dataset that is
unavailable here (e.g. a hub dataset offline) is left out with a note, unless it was named with ``--datasets``.

Multi-GPU: under ``torchrun --nproc_per_node=G`` the conversations are dealt round-robin to the ranks
(:mod:`experiments.bench.ranks`); after a barrier rank 0 merges the ranks' records. The pieces: method variants
(:mod:`experiments.bench.variants`, user policies :mod:`experiments.bench.policies`), the session loop
(:mod:`experiments.bench.session`), self-sizing (:mod:`experiments.bench.sizing`), the machine's cost curve
(:mod:`experiments.bench.cost_curve`), the closing summary (:mod:`experiments.bench.summary_table`), loading the models
(:mod:`experiments.bench.models`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from dflash_core.cpu_kernels import KERNEL_CHOICES
from dflash_core.training.pools.items import DatasetUnavailableError
from experiments.bench.console import log
from experiments.bench.cost_curve import machine_cost_curve
from experiments.bench.models import Models, load_models
from experiments.bench.presets import (
    BUDGET_POLICIES, DTYPES, PRESETS, TREE_KINDS, ModelPair, Preset, get_preset, with_overrides,
)
from experiments.bench.ranks import RankInfo, device_name, pick_device, process_group
from experiments.bench.replayer import Replayer, replay_variants
from experiments.bench.run_folder import RunFolder, existing_records, merge_rank_files
from experiments.bench.schema import METHODS, read_records, record_key
from experiments.bench.conversation import Conversation, conversations
from experiments.bench.session import Session, StopRun
from experiments.bench.sizing import Unit, coverage, coverage_message, size_run, sizing_message
from experiments.bench.summary_table import summary_table
from experiments.bench.variants import Variant, make_variants

__all__ = ["main", "output_folders", "parse_args", "run_benchmark", "run_pair"]


# ---------------------------------------------------------------------------------------------------- one pair
def run_pair(preset: Preset, pair: ModelPair, folder: Path, *, device: torch.device, rank: RankInfo,
             max_generations: int | None = None, command_line: Sequence[str] = (), full: bool = False,
             variants: list[Variant] | None = None, required_datasets: Sequence[str] = (), replay: bool = True) -> bool:
    """Run (or resume) one model pair into ``folder``; True when every record of this rank's share is done.

    ``variants``: what to measure (default: the preset's, :func:`make_variants`); ``required_datasets``: datasets
    whose unavailability is an error instead of a note; ``replay``: replay each turn on plain decoding's text
    (the preset's ``replay_budgets``, :mod:`experiments.bench.replayer`)."""
    return _run_pair(preset, pair, RunFolder(folder, rank), device, max_generations=max_generations,
                     command_line=command_line, full=full, variants=variants, required_datasets=required_datasets,
                     replay=replay)


def _run_pair(preset: Preset, pair: ModelPair, run: RunFolder, device: torch.device, *, max_generations: int | None,
              command_line: Sequence[str], full: bool, variants: list[Variant] | None,
              required_datasets: Sequence[str], replay: bool = True) -> bool:
    rank = run.rank
    run.check_resumable(preset, pair)
    variants = make_variants(preset) if variants is None else variants
    dropped = [v.label for v in variants if not pair.keeps(v.budget)]
    variants = [v for v in variants if pair.keeps(v.budget)]
    if dropped:
        log(f"{pair.slug}: left out above its max_budget {pair.max_budget}: {', '.join(dropped)}")
    if not variants:
        raise ValueError("nothing to run: no method variants")
    done = run.existing_records()
    every, unavailable = conversations(preset, required_datasets)
    mine = [c for c in every if c.index % rank.world == rank.rank]
    log(f"{pair.slug}: loading target {pair.target!r} and drafter {pair.draft!r}")
    t0 = time.perf_counter()
    models = load_models(pair, preset.dtype, device, rank)
    log(f"{pair.slug}: loaded in {time.perf_counter() - t0:.1f} s on {device_name(models.device)}, "
        f"{str(models.dtype).removeprefix('torch.')}; variants: {', '.join(v.label for v in variants)}")
    session = _session_info(preset, models, variants, command_line, rank, unavailable)
    run.start_session(preset, models, session)
    complete = _run_conversations(preset, models, variants, mine, done, run, max_generations,
                                  full=full or rank.world > 1, replay=replay)
    run.finish_session(complete)
    return complete


def _session_info(preset: Preset, models: Models, variants: list[Variant], command_line: Sequence[str],
                  rank: RankInfo, unavailable: dict[str, str]) -> dict[str, Any]:
    """This session's manifest entry; applies the CPU kernels and measures the cost curve (rank 0) on the way."""
    slug = models.pair.slug
    info: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command_line": list(command_line),
                            "rank_world": rank.world}
    if unavailable:
        info["datasets_unavailable"] = unavailable
    asked = [v for v in variants if v.lookup or v.policy_class]  # variants asked for beyond the preset
    if asked:
        info["extra_variants"] = [{"label": v.label, "variant": v.name} for v in asked]
    if models.device.type == "cpu":
        from dflash_core.cpu_kernels import apply_cpu_kernels

        info["cpu_kernels"] = apply_cpu_kernels(models.target, models.draft, kernels=preset.cpu_kernels)
        log(f"{slug}: CPU linear kernels: {info['cpu_kernels']} (asked: {preset.cpu_kernels})")
    if rank.is_main and models.draft is not None and any(v.method in ("dflash", "ddtree") for v in variants):
        info["cost_curve"] = machine_cost_curve(models)
        log(f"{slug}: {info['cost_curve']['explanation']}")
    return info


def _replayer(preset: Preset, models: Models, run: RunFolder, replay: bool) -> "Replayer | None":
    """What replays each turn on plain decoding's text (the preset's ``replay_budgets``), or None: not asked for,
    no drafter, or a torchrun launch (the replay runs in single-process runs only)."""
    variants = replay_variants(preset) if replay else []
    if not variants or models.draft is None:
        return None
    if run.rank.world > 1:
        log("note: the replay runs in single-process runs only; skipped under torchrun")
        return None
    return Replayer(models, variants, preset.max_new_tokens)


def _run_conversations(preset: Preset, models: Models, variants: list[Variant], mine: list[Conversation],
                       done: dict, run: RunFolder, max_generations: int | None, full: bool = False,
                       replay: bool = True) -> bool:
    from tqdm import tqdm

    rank, slug = run.rank, models.pair.slug
    with tqdm(total=0, desc=f"{slug} r{rank.rank}" if rank.world > 1 else slug, unit="gen",
              position=rank.rank, dynamic_ncols=True, file=sys.stderr) as progress:
        session = Session(preset, models, variants, run, done, progress, max_generations,
                          replayer=_replayer(preset, models, run, replay))
        todo = [c for c in mine if session.pending(c)]
        progress.total = sum(session.pending(c) for c in todo)
        progress.refresh()
        if not todo:
            log(f"{slug}: all {len(mine)} conversations of this rank are already done")
            return True
        t_warm = time.perf_counter()
        todo = _warm_up_and_size(session, todo, run, full)
        log(f"{slug}: warm-up {time.perf_counter() - t_warm:.1f} s; "
            f"{progress.total} generations to go ({len(done)} records already done)")
        t_run = time.perf_counter()
        try:
            for conv in todo:
                session.run(conv)
        except StopRun:
            log("stopped after --max-generations; rerun the same command to continue")
            return False
        _took(run, slug, time.perf_counter() - t_run)
    return True


def _took(run: RunFolder, slug: str, seconds: float) -> None:
    """Say how long the sized part took against its projection (the sizing's own check), and keep it in this
    session's manifest entry, written with the session's end (no write of its own)."""
    session = run.last_session
    projected = (session.get("sizing") or {}).get("projected_s")
    session["took_s"] = round(seconds, 1)
    if projected:
        log(f"{slug}: decoding and replay took {seconds / 60:.1f} min, projected {projected / 60:.1f} min "
            f"({seconds / max(projected, 1e-9):.2f}x; over 1.2x: the machine was busier than in the warm-up)")


def _warm_up_and_size(session: Session, todo: list[Conversation], run: RunFolder, full: bool) -> list[Conversation]:
    """Warm every variant up, project the decoding time and, over the preset's budget, leave work out by the rule
    (:func:`experiments.bench.sizing.size_run`); returns the conversations to run and records the sizing report."""
    preset, variants, done = session.preset, session.variants, session.done
    calibration = session.calibrate(todo)
    if calibration is not None:
        run.update_session(calibration=calibration)
    per_token, per_call = session.warm_up(todo)
    units = [Unit(c, turn, v) for c in todo for turn in range(c.num_turns) for v in variants
             if record_key(c.item.dataset, c.item.sample_id, turn, v, c.temperature) not in done]
    budget = None if full else preset.time_budget_s
    kept, report = size_run(units, per_token, preset.max_new_tokens, budget if budget else float("inf"), per_call,
                            min_samples=preset.min_samples, costs=session.turn_costs,
                            min_budgets=preset.min_budgets)
    if budget and report["left_out"]:
        turns: dict[int, int] = {}
        for u in kept:
            turns[u.conv.index] = max(turns.get(u.conv.index, 0), u.turn + 1)
        keep_var = {u.variant for u in kept} | {v for v in variants if v.method == "ar"}
        todo = [dataclasses.replace(c, max_turns=turns[c.index]) for c in todo if c.index in turns]
        session.restrict([v for v in variants if v in keep_var])
        session.progress.total = len(kept)
        session.progress.refresh()
    log(sizing_message(session.models.pair.slug, report, budget))
    report["live"] = coverage(todo, session.variants, session.replayer)
    log(coverage_message(session.models.pair.slug, report["live"]))
    run.update_session(sizing=report)
    return todo


# ---------------------------------------------------------------------------------------------------- the run
def output_folders(preset: Preset, out: Path) -> list[tuple[ModelPair, Path]]:
    if len(preset.models) == 1:
        return [(preset.models[0], out)]
    return [(pair, out / pair.slug) for pair in preset.models]


def _print_summary(pair: ModelPair, run: RunFolder, path: Path) -> None:
    records = read_records(path)
    print(f"\n## {pair.slug}: {pair.target} + {pair.draft} ({len(records)} records)\n", flush=True)
    print(summary_table(records), flush=True)
    live = (run.last_session.get("sizing") or {}).get("live")
    if live:
        print(coverage_message(pair.slug, live) + "\n", flush=True)
    if run.replayed_path.is_file():
        print("### Projected: every replayed policy on plain decoding's own text, priced by this machine's measured "
              "cost curve (not timed)\n", flush=True)
        print(summary_table(read_records(run.replayed_path)), flush=True)
    curve = run.last_session.get("cost_curve")
    if curve:
        print(f"why: {curve['explanation']}\n", flush=True)
    print(f"records:  {path}\nmanifest: {run.manifest_path}\n"
          f"figures:  python plot_results.py --runs {run.path}  (figures; tables with per-prompt intervals, the oracle "
          "budget, policies against it, stage times; replayed.md: auto against the oracle on the same text and "
          "replayed vs live tau; auto_live.md: auto over the fixed budgets, paired per prompt)", flush=True)


def run_benchmark(preset: Preset, out: str | Path, *, max_generations: int | None = None,
                  command_line: Sequence[str] = (), rank: RankInfo | None = None, summary: bool = True,
                  full: bool = False, variants: list[Variant] | None = None,
                  required_datasets: Sequence[str] = (), replay: bool = True) -> bool:
    """Run every model pair of ``preset`` into ``out``; returns True when all records are done. Rank 0 merges
    per-rank records and prints the summary table. ``variants`` and ``required_datasets``: see :func:`run_pair`."""
    rank = rank or RankInfo.from_env()
    out = Path(out)
    complete = True
    with process_group(rank):
        torch_device = pick_device(preset.device, rank)
        for pair, folder in output_folders(preset, out):
            run = RunFolder(folder, rank)
            finished = _run_pair(preset, pair, run, torch_device, max_generations=max_generations,
                                 command_line=command_line, full=full, variants=variants,
                                 required_datasets=required_datasets, replay=replay)
            complete &= finished
            rank.barrier()
            if rank.is_main:
                path = run.merge_rank_files()
                if summary and path.is_file():
                    _print_summary(pair, run, path)
            if not finished and rank.world == 1:
                break  # --max-generations reached: the remaining pairs wait for the next session
    return complete


# ---------------------------------------------------------------------------------------------------- command line
def _csv(kind):
    def parse(text: str):
        return tuple(kind(part.strip()) for part in text.split(",") if part.strip())
    return parse


def _budget(text: str) -> int | str:
    return text if text in BUDGET_POLICIES else int(text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="default", choices=sorted(PRESETS), help="base configuration")
    parser.add_argument("--target", help="'default', 'tiny', or a Hugging Face id / folder (replaces the preset's)")
    parser.add_argument("--draft", help="'default', 'random', or a DFlash checkpoint folder / hub id")
    parser.add_argument("--datasets", type=_csv(str),
                        help="comma-separated, e.g. gsm8k,humaneval,mt-bench (each must be available here)")
    parser.add_argument("--max-samples", type=int, help="samples per dataset")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--methods", type=_csv(str),
                        help=f"comma-separated subset of {','.join(METHODS)} (pld: draft-free prompt lookup)")
    parser.add_argument("--budgets", type=_csv(_budget),
                        help="DDTree budgets, e.g. 8,16,32,64,auto (chain-auto: DFlash with a chosen chain length)")
    parser.add_argument("--trees", type=_csv(str),
                        help=f"DDTree tree kinds, comma-separated subset of {','.join(TREE_KINDS)} (sampled: T > 0)")
    parser.add_argument("--lookup-budgets", type=_csv(_budget), default=None,
                        help="DDTree+lookup (the draft tree plus the context's n-gram continuation, under the same "
                             "budget) at these budgets, e.g. 16,auto (default: the preset's; '' for none)")
    parser.add_argument("--policy", action="append", default=[], metavar="MODULE:CLASS",
                        help="also run your own ProposalPolicy class (built with no arguments, labelled by its name; "
                             "see experiments/bench/policies.py); repeatable")
    parser.add_argument("--temperatures", type=_csv(float), help="e.g. 0 or 0,1")
    parser.add_argument("--top-k", type=int, default=None, help="sampling: keep the k most likely tokens (T > 0; "
                        "transformers' top_k, 0 = off)")
    parser.add_argument("--top-p", type=float, default=None, help="sampling: nucleus mass (T > 0; transformers' "
                        "top_p, 1 = off)")
    parser.add_argument("--min-p", type=float, default=None, help="sampling: drop tokens below min_p x the top "
                        "token's probability (T > 0; transformers' min_p, 0 = off)")
    parser.add_argument("--enable-thinking", action="store_true", default=None,
                        help="switch the chat template's thinking on (Qwen3-style templates; off by default)")
    parser.add_argument("--dtype", choices=DTYPES)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--device", help="auto (CUDA when available), cpu, cuda, cuda:1, ... (default: the preset's)")
    parser.add_argument("--out", help="run folder (default: runs/<preset>); rerun with the same folder to resume")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--cpu-kernels", choices=KERNEL_CHOICES, default=None,
                        help="linear kernels on a CPU (default: the preset's; see dflash_core.cpu_kernels)")
    parser.add_argument("--full", action="store_true",
                        help="run the preset's whole grid live (default: its budgets 2/4/32/64, chain-auto and "
                             "DDTree+lookup B=16 too), even where it projects past its time budget")
    parser.add_argument("--no-replay", action="store_true",
                        help="skip the replay of every budget on plain decoding's text (experiments.bench.replayer)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="minutes of decoding to size the run to on this machine (default: the preset's)")
    parser.add_argument("--max-generations", type=int, default=None,
                        help="stop this session after N generations (the run resumes from there next time)")
    return parser.parse_args(argv)


def preset_from_args(args: argparse.Namespace, include_hub: bool = False) -> Preset:
    """The preset the command line asks for: ``--preset`` with every given override (the dry-run plan uses it too)."""
    return with_overrides(
        get_preset(args.preset), target=args.target, draft=args.draft, datasets=args.datasets,
        max_samples=args.max_samples, max_new_tokens=args.max_new_tokens, methods=args.methods,
        budgets=args.budgets, trees=args.trees, temperatures=args.temperatures, dtype=args.dtype, seed=args.seed,
        device=args.device, time_budget_s=args.time_budget * 60 if args.time_budget else None,
        cpu_kernels=args.cpu_kernels, lookup_budgets=args.lookup_budgets, include_hub=include_hub,
        full=bool(getattr(args, "full", False)), top_k=getattr(args, "top_k", None),
        top_p=getattr(args, "top_p", None), min_p=getattr(args, "min_p", None),
        enable_thinking=getattr(args, "enable_thinking", None))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        preset = preset_from_args(args)
        variants = make_variants(preset, lookup_budgets=args.lookup_budgets or (), policies=args.policy)
    except ValueError as err:  # includes experiments.bench.policies.PolicyError
        print(f"benchmark: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or Path("runs") / preset.name)
    command_line = [sys.executable, "-m", "experiments.bench", *(sys.argv[1:] if argv is None else argv)]
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    try:
        complete = run_benchmark(preset, out, max_generations=args.max_generations, command_line=command_line,
                                 full=args.full, variants=variants,
                                 required_datasets=preset.datasets if args.datasets else (),
                                 replay=not args.no_replay)
    except (FileNotFoundError, ValueError, ImportError, DatasetUnavailableError) as err:
        print(f"benchmark: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nbenchmark: interrupted; finished records are kept in {out}; rerun the same command to resume",
              file=sys.stderr)
        return 130
    log(f"{'done' if complete else 'incomplete'} in {time.perf_counter() - t0:.1f} s")
    return 0 if complete else 3

