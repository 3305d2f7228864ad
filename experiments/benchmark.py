"""The benchmark runner: ``python -m experiments.benchmark [--preset default|quick|sampling|paper|tiny] [overrides]``.

For every (temperature, dataset, sample, turn) the runner generates with every method variant back to back on the
same prompt: AR first (the reference for ``matches_ar`` and, for MT-Bench, the shared conversation history), then
DFlash and the DDTree variants (budgets; tree kinds top-K and sampled) in an order that rotates from turn to turn, so
drift and noise hit all methods alike.
Each variant gets one untimed warm-up generation before anything is timed.

A run folder (``--out``, default ``runs/<preset>``) holds::

    records.jsonl          one SampleRecord per finished (dataset, sample, turn, method variant, temperature)
    records.rank<r>.jsonl  per-rank records while a torchrun run is in flight (rank 0 merges them at the end)
    manifest.json          environment and resolved preset (experiments.schema.Manifest), replaced atomically

Every record is appended (and fsynced) as soon as its generation ends, so an interrupted run loses at most the
generation in flight; rerunning the same command skips every finished record. A preset with several model pairs
(``paper``) writes one such folder per pair under ``--out``.

Multi-GPU: under ``torchrun --nproc_per_node=G`` the conversations are dealt round-robin to the ranks, each rank
uses its own GPU (or, for a ``device_map="auto"`` target, its share of the GPUs, see ``experiments.models``) and
writes its own records file; after a barrier rank 0 merges them into ``records.jsonl``. Loading the models lives in
:mod:`experiments.models`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import os
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from experiments.datasets import BenchmarkItem, DatasetUnavailableError, build_chat, select_items
from experiments.models import (  # noqa: F401  (ByteTokenizer, random_draft, tiny_target: kept importable from here)
    ByteTokenizer, Models, load_models, random_draft, tiny_target,
)
from experiments.models import pick_device as _pick_device
from experiments.presets import (
    BUDGET_POLICIES, DTYPES, PRESETS, TREE_KINDS, ModelPair, Preset, get_preset, with_overrides,
)
from experiments.schema import (
    EXTRA_AR_MARGIN, EXTRA_TREE_SIZES, MANIFEST_FILENAME, RECORDS_FILENAME, Manifest, SampleRecord, append_record, method_label,
    read_records, record_key, tree_kind,
)

__all__ = ["Variant", "Models", "RankInfo", "load_models", "make_variants", "pick_device", "run_benchmark", "run_pair",
           "main"]

RANK_RECORDS_GLOB = "records.rank*.jsonl"
WARMUP_PROMPT = "Count from one to ten."


def log(message: str) -> None:
    print(f"[benchmark] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- method variants
@dataclass(frozen=True)
class Variant:
    """One method as measured: ``ar``, ``dflash``, or ``ddtree`` with a node budget (int) or policy (``"auto"``)
    and a tree kind (``"topk"``, the default, or ``"sampled"``; None for AR and DFlash)."""

    method: str
    budget: int | str | None = None
    tree: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tree", tree_kind(self.method, self.tree))

    @property
    def policy(self) -> str:
        if self.method != "ddtree":
            return {"ar": "ar", "dflash": "chain"}[self.method]
        return "fixed" if isinstance(self.budget, int) else str(self.budget)

    @property
    def label(self) -> str:
        return method_label(self.method, self.policy, self.budget, self.tree)

    def key(self, dataset: str, sample_id: str, turn: int, temperature: float) -> tuple:
        return record_key(dataset, sample_id, turn, self.method, self.budget, temperature, self.tree)

    def generate(self, models: "Models", input_ids: torch.Tensor, max_new_tokens: int, temperature: float,
                 seed: int):
        from dflash_core import autoregressive_generate, dflash_generate

        args = dict(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=models.stop_token_ids,
                    seed=seed)
        if self.method == "ar":
            return autoregressive_generate(models.target, input_ids, **args)
        if self.method == "dflash":
            return dflash_generate(models.target, models.draft, input_ids, **args)
        from ddtree import ddtree_generate

        return ddtree_generate(models.target, models.draft, input_ids, budget=self.budget, tree=self.tree, **args)


def budget_supported(budget: int | str) -> bool:
    """Integer budgets always are; a policy such as ``"auto"`` when the installed ddtree implements it."""
    if isinstance(budget, int):
        return True
    if budget in ("auto", "chain-auto"):
        try:
            import ddtree.budget  # noqa: F401
        except ImportError:
            return False
        return True
    return False


def make_variants(preset: Preset) -> list[Variant]:
    """The preset's method variants, AR first; optional budgets the installed ddtree lacks are left out. Each DDTree
    budget is measured with every tree kind of the preset, the sampled tree at int budgets only."""
    variants = []
    for method in ("ar", "dflash", "ddtree"):
        if method not in preset.methods:
            continue
        if method != "ddtree":
            variants.append(Variant(method))
            continue
        for budget in preset.budgets:
            if budget_supported(budget):
                variants += [Variant("ddtree", budget, tree) for tree in preset.trees
                             if tree == "topk" or isinstance(budget, int)]
            elif budget in preset.optional_budgets:
                log(f"note: DDTree budget {budget!r} is not supported by the installed ddtree; skipped")
            else:
                raise ValueError(f"DDTree budget {budget!r} is not supported by the installed ddtree")
    return variants


# ---------------------------------------------------------------------------------------------------- ranks
@dataclass(frozen=True)
class RankInfo:
    """This process's place in a torchrun launch (rank 0 of 1 otherwise)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int | None = None  # ranks on this machine (LOCAL_WORLD_SIZE); None = world

    @classmethod
    def from_env(cls) -> "RankInfo":
        env = os.environ
        local_world = env.get("LOCAL_WORLD_SIZE")
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)),
                   int(local_world) if local_world else None)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def records_path(self, folder: Path) -> Path:
        return folder / (RECORDS_FILENAME if self.world == 1 else f"records.rank{self.rank}.jsonl")

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


@contextlib.contextmanager
def process_group(rank: RankInfo):
    """A gloo group (CPU tensors only, long timeout) just for the end-of-run barrier; nothing else is collective."""
    if rank.world == 1:
        yield
        return
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=48))
    try:
        yield
    finally:
        dist.destroy_process_group()


def pick_device(name: str, rank: RankInfo) -> torch.device:
    """This rank's device (made current on CUDA): the first GPU of its share, see ``experiments.models.rank_gpus``."""
    return _pick_device(name, rank.local_rank, rank.local_world or rank.world)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from dflash_core.timing import cpu_model

    return f"cpu ({cpu_model()}, {torch.get_num_threads()} threads)"


# ---------------------------------------------------------------------------------------------------- records on disk
def existing_records(folder: Path) -> dict[tuple, SampleRecord]:
    """Finished records of a run folder, from the merged file and any per-rank files, by resume key."""
    done: dict[tuple, SampleRecord] = {}
    files = [folder / RECORDS_FILENAME] + sorted(Path(p) for p in glob.glob(str(folder / RANK_RECORDS_GLOB)))
    for path in files:
        if path.is_file():
            for record in read_records(path):
                done.setdefault(record.record_key(), record)
    return done


def merge_rank_files(folder: Path) -> Path:
    """Fold ``records.rank*.jsonl`` into ``records.jsonl`` (atomic replace), then delete the rank files."""
    target = folder / RECORDS_FILENAME
    rank_files = sorted(Path(p) for p in glob.glob(str(folder / RANK_RECORDS_GLOB)))
    if not rank_files:
        return target
    records = list(existing_records(folder).values())
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{RECORDS_FILENAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(record.to_json() + "\n" for record in records)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    for path in rank_files:
        path.unlink()
    return target


# Settings that change what a record means: a rerun into the same folder must keep them.
_IDENTITY_FIELDS = ("max_new_tokens", "dtype", "seed")


def check_resumable(folder: Path, preset: Preset, pair: ModelPair) -> Manifest | None:
    """The folder's manifest; raises when it was written for different models or settings."""
    path = folder / MANIFEST_FILENAME
    if not path.is_file():
        return None
    manifest = Manifest.read(path)
    old = manifest.extra.get("preset") or {}
    old_pair = manifest.extra.get("pair") or {}
    diffs = [f"{k}: {old.get(k)!r} -> {getattr(preset, k)!r}" for k in _IDENTITY_FIELDS
             if k in old and old[k] != getattr(preset, k)]
    diffs += [f"{k}: {old_pair.get(k)!r} -> {getattr(pair, k)!r}" for k in ("target", "draft")
              if k in old_pair and old_pair[k] != getattr(pair, k)]
    if diffs:
        raise ValueError(f"{folder} holds a run with other settings ({'; '.join(diffs)}); "
                         "use a new --out folder, or the same settings to resume it")
    return manifest


def write_manifest(folder: Path, preset: Preset, models: Models, rank: RankInfo, previous: Manifest | None,
                   session: dict[str, Any]) -> None:
    sessions = list((previous.extra.get("sessions") if previous else None) or []) + [session]
    manifest = Manifest.create(
        command_line=list(session.get("command_line") or sys.argv),
        device=device_name(models.device), dtype=str(models.dtype).removeprefix("torch."),
        attention_backend=getattr(models.target.config, "_attn_implementation", None), seed=preset.seed,
        preset=preset.name,
        extra={"preset": preset.to_dict(), "pair": dataclasses.asdict(models.pair), "models": models.describe(),
               "world_size": rank.world, "sessions": sessions},
    )
    if previous is not None:  # plots orders runs by their creation time: keep the first session's
        manifest.created_at = previous.created_at
    manifest.write(folder / MANIFEST_FILENAME)


def explain_cost_curve(verify_s: dict[int, float], fixed_s: float) -> str:
    """One line on why trees pay or not on this machine, from round costs at N draft nodes (N = 0: one token)."""
    one = verify_s[0]
    r8, r32 = verify_s[8] / one, verify_s[32] / one
    if r32 <= 1.5:
        verdict = "big trees are nearly free to verify here: large budgets win"
    elif r8 <= 1.5:
        verdict = "verifying up to ~8 nodes is cheap, more is not: mid-size trees (8-16) win"
    else:
        verdict = "every verified node costs: small trees win"
    return (f"this machine verifies 8 draft tokens at {r8:.2f}x and 32 at {r32:.2f}x the cost of one token; the "
            f"drafter pass and tree cost {fixed_s / one:.2f} of a plain step: {verdict}")


def machine_cost_curve(models: Models, context: int = 256) -> dict[str, Any]:
    """The measured round cost curve of this machine (``ddtree.budget.measure_cost_model``, cached per machine) as
    plain data for the manifest, with the one-line explanation."""
    from ddtree.budget import measure_cost_model

    cost = measure_cost_model(models.target, models.draft, context=context)
    verify = {int(n): float(v) for n, v in zip(cost.nodes, cost.verify_s)}
    return {"context": context, "nodes": list(verify), "verify_s": list(verify.values()), "fixed_s": cost.fixed_s,
            "relative_to_one_token": {n: round(v / verify[0], 3) for n, v in verify.items()},
            "explanation": explain_cost_curve(verify, cost.fixed_s)}


def finish_manifest(folder: Path, complete: bool) -> None:
    """Stamp the end of this session into the manifest (a session without it crashed or was killed)."""
    manifest = Manifest.read(folder / MANIFEST_FILENAME)
    if manifest.extra.get("sessions"):
        manifest.extra["sessions"][-1].update(finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), complete=complete)
        manifest.write(folder / MANIFEST_FILENAME)


# ---------------------------------------------------------------------------------------------------- one conversation
@dataclass(frozen=True)
class Conversation:
    """One benchmark item at one temperature; its turns run in order (MT-Bench: 2)."""

    item: BenchmarkItem
    temperature: float
    index: int  # position in the run's global order (ranks take every world-th)


def conversations(preset: Preset) -> list[Conversation]:
    out = []
    for temperature in preset.temperatures:
        for dataset in preset.datasets:
            for item in select_items(dataset, preset.samples_for(dataset), preset.seed):
                out.append(Conversation(item, temperature, len(out)))
    return out


def generation_seed(seed: int, dataset: str, sample_id: str, turn: int) -> int:
    """The sampling seed of one turn, shared by every method variant (stable across runs and ranks)."""
    return zlib.crc32(f"{seed}:{dataset}:{sample_id}:{turn}".encode()) & 0x7FFFFFFF


def _answer_text(tokenizer, token_ids: Sequence[int], stops: Sequence[int]) -> str:
    ids = list(token_ids)
    while ids and ids[-1] in stops:
        ids.pop()
    return tokenizer.decode(ids, skip_special_tokens=True)


def first_mismatch(output: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token where ``output`` leaves ``reference`` (None when equal)."""
    if list(output) == list(reference):
        return None
    return next((i for i, (a, b) in enumerate(zip(output, reference)) if a != b), min(len(output), len(reference)))


@torch.inference_mode()
def top2_margin(target, prompt_ids: torch.Tensor, continuation: Sequence[int], index: int) -> float:
    """Top-1 minus top-2 logit of the target's next-token distribution after ``prompt_ids`` [1, T] followed by
    ``continuation[:index]`` (one teacher-forced forward, in the target's dtype)."""
    device = target.lm_head.weight.device
    ids = torch.cat([prompt_ids[0], torch.tensor(list(continuation[:index]), dtype=torch.long)])[None].to(device)
    top = target(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def _record(variant: Variant, conv: Conversation, turn: int, result, seed: int, models: Models, wall_s: float,
            reference: list[int] | None, order: int, input_ids: torch.Tensor | None = None) -> SampleRecord:
    """``reference``: AR's output to compare with (greedy only), or None; ``input_ids``: the prompt, to price where
    an output first leaves the reference (plain decoding's top-2 margin there, after the timed generation)."""
    timings = dict(result.timings)
    out = list(result.new_token_ids)
    extra: dict[str, Any] = {"output_ids": out, "wall_s": round(wall_s, 6), "order": order,
                             "stopped": bool(out) and out[-1] in models.stop_token_ids}
    matches_ar = None
    if reference is not None and variant.method != "ar":
        extra["first_mismatch"] = first_mismatch(out, reference)  # where a bf16 near-tie flipped the argmax
        matches_ar = extra["first_mismatch"] is None
        at = extra["first_mismatch"]
        if at is not None and input_ids is not None and at < len(reference):
            extra[EXTRA_AR_MARGIN] = round(top2_margin(models.target, input_ids, reference, at), 4)
    extra["target_forwards"] = 1 + len(result.acceptance_lengths)  # the prefill, then one verify per round
    if variant.method != "ar":
        extra[EXTRA_TREE_SIZES] = list(result.tree_sizes)
        extra["expected_acceptance"] = [round(float(x), 4) for x in result.expected_acceptance]
    return SampleRecord(
        dataset=conv.item.dataset, sample_id=conv.item.sample_id, turn=turn, method=variant.method,
        budget=variant.budget, policy=variant.policy, temperature=conv.temperature, tree=variant.tree,
        num_input_tokens=result.num_input_tokens, num_new_tokens=len(result.new_token_ids),
        prefill_s=float(timings.pop("prefill", 0.0)), decode_s=float(timings.pop("decode", 0.0)),
        acceptance_lengths=list(result.acceptance_lengths), stage_times={k: float(v) for k, v in timings.items()},
        matches_ar=matches_ar, seed=seed, dtype=str(models.dtype).removeprefix("torch."), extra=extra,
    )


class StopRun(Exception):
    """Raised when the generation limit of this session (``--max-generations``) is reached."""


class Session:
    """Runs conversations for one model pair, appending a record per finished generation."""

    def __init__(self, preset: Preset, models: Models, variants: list[Variant], records_path: Path,
                 done: dict[tuple, SampleRecord], progress, max_generations: int | None = None) -> None:
        self.preset, self.models, self.variants = preset, models, variants
        self.records_path, self.done, self.progress = records_path, done, progress
        self.remaining = max_generations
        self.ar = Variant("ar") if Variant("ar") in variants else None
        self.others = [v for v in variants if v.method != "ar"]
        self.chat_kwargs = dict(models.pair.chat_template_kwargs) or None

    def pending(self, conv: Conversation) -> int:
        item = conv.item
        return sum(v.key(item.dataset, item.sample_id, turn, conv.temperature) not in self.done
                   for turn in range(len(item.turns)) for v in self.variants)

    def _generate(self, variant: Variant, input_ids: torch.Tensor, temperature: float, seed: int):
        t0 = time.perf_counter()
        result = variant.generate(self.models, input_ids, self.preset.max_new_tokens, temperature, seed)
        return result, time.perf_counter() - t0

    def _write(self, record: SampleRecord) -> None:
        append_record(self.records_path, record)
        self.done[record.record_key()] = record
        self.progress.update(1)
        label = method_label(record.method, record.policy, record.budget, record.tree)
        self.progress.set_postfix_str(f"{record.dataset} {label} τ={record.tau or 0:.2f}", refresh=False)
        if self.remaining is not None:
            self.remaining -= 1
            if self.remaining <= 0:
                raise StopRun

    def _reference(self, conv: Conversation, turn: int, input_ids: torch.Tensor, seed: int) -> list[int] | None:
        """AR's output for this turn: from its record, freshly generated (and recorded), or None when AR is not
        measured and nothing needs it."""
        item, t = conv.item, conv.temperature
        if self.ar is not None:
            record = self.done.get(self.ar.key(item.dataset, item.sample_id, turn, t))
            if record is not None and "output_ids" in record.extra:
                return list(record.extra["output_ids"])
            result, wall = self._generate(self.ar, input_ids, t, seed)
            if record is None:
                self._write(_record(self.ar, conv, turn, result, seed, self.models, wall, None, order=0))
            return result.new_token_ids
        if turn + 1 < len(item.turns):  # not measured, but the next turn continues AR's answer
            return self._generate(Variant("ar"), input_ids, t, seed)[0].new_token_ids
        return None

    def run(self, conv: Conversation) -> None:
        item, t = conv.item, conv.temperature
        answers: list[str] = []
        for turn in range(len(item.turns)):
            keys = {v: v.key(item.dataset, item.sample_id, turn, t) for v in self.variants}
            later_pending = any(v.key(item.dataset, item.sample_id, later, t) not in self.done
                                for later in range(turn + 1, len(item.turns)) for v in self.variants)
            if not later_pending and all(k in self.done for k in keys.values()):
                continue  # nothing left in this turn, and no later turn needs its answer
            ids = build_chat(self.models.tokenizer, item.turns[: turn + 1], answers,
                             chat_template_kwargs=self.chat_kwargs)
            input_ids = torch.tensor([ids], dtype=torch.long)
            seed = generation_seed(self.preset.seed, item.dataset, item.sample_id, turn)
            reference = self._reference(conv, turn, input_ids, seed)
            shift = (conv.index + turn) % max(len(self.others), 1)
            for order, variant in enumerate(self.others[shift:] + self.others[:shift], start=1):
                if keys[variant] in self.done:
                    continue
                result, wall = self._generate(variant, input_ids, t, seed)
                compare_with = reference if t == 0 else None  # sampled outputs differ from AR's by design
                self._write(_record(variant, conv, turn, result, seed, self.models, wall, compare_with, order,
                                    input_ids))
            if turn + 1 < len(item.turns):
                answers.append(_answer_text(self.models.tokenizer, reference or [], self.models.stop_token_ids))

    def warm_up(self) -> dict[Variant, float]:
        """One short untimed generation per variant (kernels, allocator, ``auto``'s cost measurement), twice; the
        second one's decoding seconds per token, per variant, size the run (:func:`size_run`)."""
        ids = build_chat(self.models.tokenizer, [WARMUP_PROMPT], chat_template_kwargs=self.chat_kwargs)
        input_ids = torch.tensor([ids], dtype=torch.long)
        per_token = {}
        for variant in self.variants:
            variant.generate(self.models, input_ids, self.preset.warmup_tokens, 0.0, 0)
            result = variant.generate(self.models, input_ids, self.preset.warmup_tokens, 0.0, 0)
            per_token[variant] = result.timings.get("decode", 0.0) / max(1, len(result.new_token_ids) - 1)
        return per_token

    def restrict(self, variants: list[Variant]) -> None:
        """Measure only ``variants`` in this session (a sized run)."""
        self.variants = [v for v in self.variants if v in variants]
        self.others = [v for v in self.others if v in variants]


# ---------------------------------------------------------------------------------------------------- the run
def run_pair(preset: Preset, pair: ModelPair, folder: Path, *, device: torch.device, rank: RankInfo,
             max_generations: int | None = None, command_line: Sequence[str] = (), full: bool = False) -> bool:
    """Run (or resume) one model pair into ``folder``; True when every record of this rank's share is done."""
    folder.mkdir(parents=True, exist_ok=True)
    previous = check_resumable(folder, preset, pair)
    variants = make_variants(preset)
    done = existing_records(folder)
    mine = [c for c in conversations(preset) if c.index % rank.world == rank.rank]
    if not variants:
        raise ValueError("nothing to run: no method variants")
    log(f"{pair.slug}: loading target {pair.target!r} and drafter {pair.draft!r}")
    t0 = time.perf_counter()
    models = load_models(pair, preset.dtype, device, rank)
    log(f"{pair.slug}: loaded in {time.perf_counter() - t0:.1f} s on {device_name(models.device)}, "
        f"{str(models.dtype).removeprefix('torch.')}; variants: {', '.join(v.label for v in variants)}")
    session_info = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command_line": list(command_line),
                    "rank_world": rank.world}
    if models.device.type == "cpu":
        from dflash_core.cpu_kernels import apply_cpu_kernels

        session_info["cpu_kernels"] = apply_cpu_kernels(models.target, models.draft, kernels=preset.cpu_kernels)
        log(f"{pair.slug}: CPU linear kernels: {session_info['cpu_kernels']} (asked: {preset.cpu_kernels})")
    if rank.is_main and models.draft is not None and any(v.method != "ar" for v in variants):
        curve = machine_cost_curve(models)
        session_info["cost_curve"] = curve
        log(f"{pair.slug}: {curve['explanation']}")
    if rank.is_main:
        write_manifest(folder, preset, models, rank, previous, session_info)

    def record_sizing(report: dict) -> None:
        if rank.is_main:
            manifest = Manifest.read(folder / MANIFEST_FILENAME)
            manifest.extra["sessions"][-1]["sizing"] = report
            manifest.write(folder / MANIFEST_FILENAME)

    complete = _run_conversations(preset, models, variants, mine, done, rank.records_path(folder), rank,
                                  max_generations, full=full or rank.world > 1, report_to=record_sizing)
    if rank.is_main:
        finish_manifest(folder, complete)
    return complete


def _run_conversations(preset: Preset, models: Models, variants: list[Variant], mine: list[Conversation],
                       done: dict[tuple, SampleRecord], records_path: Path, rank: RankInfo,
                       max_generations: int | None, full: bool = False, report_to=None) -> bool:
    from tqdm import tqdm

    slug = models.pair.slug
    with tqdm(total=0, desc=f"{slug} r{rank.rank}" if rank.world > 1 else slug, unit="gen",
              position=rank.rank, dynamic_ncols=True, file=sys.stderr) as progress:
        session = Session(preset, models, variants, records_path, done, progress, max_generations)
        todo = [c for c in mine if session.pending(c)]
        progress.total = sum(session.pending(c) for c in todo)
        progress.refresh()
        if not todo:
            log(f"{slug}: all {len(mine)} conversations of this rank are already done")
            return True
        t_warm = time.perf_counter()
        per_token = session.warm_up()
        units = [Unit(c, turn, v) for c in todo for turn in range(len(c.item.turns)) for v in variants
                 if v.key(c.item.dataset, c.item.sample_id, turn, c.temperature) not in done]
        budget = None if full else preset.time_budget_s
        kept, report = size_run(units, per_token, preset.max_new_tokens, budget if budget else float("inf"))
        if budget and report["left_out"]:
            keep_conv = {u.conv.index for u in kept}
            keep_var = {u.variant for u in kept} | {v for v in variants if v.method == "ar"}
            todo = [c for c in todo if c.index in keep_conv]
            session.restrict([v for v in variants if v in keep_var])
            progress.total = len(kept)
            progress.refresh()
            log(f"{slug}: the full grid projects to {report['projected_full_s'] / 60:.1f} min of decoding on this "
                f"machine, over the {budget / 60:.0f}-minute budget; left out by the stated rule (samples, then outer "
                f"DDTree budgets, then the last datasets): {', '.join(report['left_out'])}; projected now "
                f"{report['projected_s'] / 60:.1f} min"
                + (" (still over: nothing more is left out)" if report["projected_s"] > budget else "")
                + ". --full runs everything.")
        else:
            log(f"{slug}: projected decoding time {report['projected_full_s'] / 60:.1f} min"
                + (f" (budget {budget / 60:.0f} min)" if budget else ""))
        if report_to is not None:
            report_to(report)
        log(f"{slug}: warm-up {time.perf_counter() - t_warm:.1f} s; "
            f"{progress.total} generations to go ({len(done)} records already done)")
        try:
            for conv in todo:
                session.run(conv)
        except StopRun:
            log("stopped after --max-generations; rerun the same command to continue")
            return False
    return True


@dataclass(frozen=True)
class Unit:
    """One pending generation: a turn of a conversation with one variant."""

    conv: Conversation
    turn: int
    variant: Variant


def size_run(units: list[Unit], per_token: dict[Variant, float], max_new_tokens: int,
             budget_s: float) -> tuple[list[Unit], dict[str, Any]]:
    """Leave work out until the projected decoding time fits ``budget_s``; returns (kept units, report).

    Projection: every generation runs ``max_new_tokens`` at its variant's warm-up seconds per token. The rule, in
    order, while the projection exceeds the budget:
    1. drop the last selected sample (all its turns and variants) of the dataset with the most samples left,
       down to one sample per dataset;
    2. drop DDTree fixed budgets from the outside in (the largest, then the smallest, ...) down to the middle one;
       AR, DFlash and policies such as ``auto`` always stay;
    3. drop datasets from the end of the run's order, down to one;
    4. run what is left, and say that it will take longer than the budget.
    """
    def cost(us):
        return sum(per_token.get(u.variant, 0.0) * max_new_tokens for u in us)

    full = cost(units)
    kept, left_out = list(units), []
    while cost(kept) > budget_s:
        samples: dict[str, list[tuple[int, str]]] = {}
        for u in kept:
            entry = (u.conv.index, u.conv.item.sample_id)
            group = samples.setdefault(u.conv.item.dataset, [])
            if entry not in group:
                group.append(entry)
        dataset = max(samples, key=lambda d: (len(samples[d]), d)) if samples else None
        if dataset is not None and len(samples[dataset]) > 1:
            index, sid = max(samples[dataset])
            kept = [u for u in kept if u.conv.index != index]
            left_out.append(f"{dataset} sample {sid}")
            continue
        fixed = sorted({u.variant.budget for u in kept if u.variant.method == "ddtree" and u.variant.policy == "fixed"})
        if len(fixed) > 1:
            drop = fixed[-1] if len(fixed) % 2 == 0 else fixed[0]  # outside in: the middle budget stays
            kept = [u for u in kept if not (u.variant.policy == "fixed" and u.variant.budget == drop)]
            left_out.append(f"DDTree budget {drop}")
            continue
        if len(samples) > 1:
            last = max(samples, key=lambda d: min(samples[d]))  # the dataset that comes last in the run's order
            kept = [u for u in kept if u.conv.item.dataset != last]
            left_out.append(f"dataset {last}")
            continue
        break
    report = {"budget_s": budget_s if budget_s != float("inf") else None, "projected_full_s": round(full, 1), "projected_s": round(cost(kept), 1),
              "left_out": left_out, "seconds_per_token": {v.label: round(t, 5) for v, t in per_token.items()}}
    return kept, report


def output_folders(preset: Preset, out: Path) -> list[tuple[ModelPair, Path]]:
    if len(preset.models) == 1:
        return [(preset.models[0], out)]
    return [(pair, out / pair.slug) for pair in preset.models]


def run_benchmark(preset: Preset, out: str | Path, *, max_generations: int | None = None,
                  command_line: Sequence[str] = (), rank: RankInfo | None = None, summary: bool = True,
                  full: bool = False) -> bool:
    """Run every model pair of ``preset`` into ``out``; returns True when all records are done. Rank 0 merges
    per-rank records and prints the summary table."""
    from plots import summary_table
    from plots.tables import policy_table, stage_table

    rank = rank or RankInfo.from_env()
    out = Path(out)
    complete = True
    with process_group(rank):
        torch_device = pick_device(preset.device, rank)
        for pair, folder in output_folders(preset, out):
            finished = run_pair(preset, pair, folder, device=torch_device, rank=rank,
                                max_generations=max_generations, command_line=command_line, full=full)
            complete &= finished
            rank.barrier()
            if rank.is_main:
                path = merge_rank_files(folder)
                if summary and path.is_file():
                    records = read_records(path)
                    print(f"\n## {pair.slug}: {pair.target} + {pair.draft} ({len(records)} records)\n", flush=True)
                    print(summary_table(records), flush=True)
                    curve = (Manifest.read(folder / MANIFEST_FILENAME).extra.get("sessions") or [{}])[-1].get(
                        "cost_curve") if (folder / MANIFEST_FILENAME).is_file() else None
                    if curve:
                        print(f"why: {curve['explanation']}\n", flush=True)
                    policies = policy_table(records)
                    if policies:
                        print("Policies against the oracle budget:\n\n" + policies, flush=True)
                    print("Where a round's time goes (all datasets):\n\n" + stage_table(records), flush=True)
                    print(f"records:  {path}\nmanifest: {folder / MANIFEST_FILENAME}\n"
                          f"figures:  python plot_results.py --runs {folder}", flush=True)
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
    parser = argparse.ArgumentParser(prog="python -m experiments.benchmark", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="default", choices=sorted(PRESETS), help="base configuration")
    parser.add_argument("--target", help="'default', 'tiny', or a Hugging Face id / folder (replaces the preset's)")
    parser.add_argument("--draft", help="'default', 'random', or a DFlash checkpoint folder / hub id")
    parser.add_argument("--datasets", type=_csv(str), help="comma-separated, e.g. gsm8k,humaneval,mt-bench")
    parser.add_argument("--max-samples", type=int, help="samples per dataset")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--methods", type=_csv(str), help="comma-separated subset of ar,dflash,ddtree")
    parser.add_argument("--budgets", type=_csv(_budget), help="DDTree budgets, e.g. 8,16,32,64,auto")
    parser.add_argument("--trees", type=_csv(str),
                        help=f"DDTree tree kinds, comma-separated subset of {','.join(TREE_KINDS)} (sampled: T > 0)")
    parser.add_argument("--temperatures", type=_csv(float), help="e.g. 0 or 0,1")
    parser.add_argument("--dtype", choices=DTYPES)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--device", help="auto (CUDA when available), cpu, cuda, cuda:1, ... (default: the preset's)")
    parser.add_argument("--out", help="run folder (default: runs/<preset>); rerun with the same folder to resume")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--cpu-kernels", choices=("torch", "packed", "auto"), default=None,
                        help="linear kernels on a CPU (default: the preset's; see dflash_core.cpu_kernels)")
    parser.add_argument("--full", action="store_true",
                        help="run the preset's whole grid even where it projects past its time budget")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="minutes of decoding to size the run to on this machine (default: the preset's)")
    parser.add_argument("--max-generations", type=int, default=None,
                        help="stop this session after N generations (the run resumes from there next time)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        preset = with_overrides(
            get_preset(args.preset), target=args.target, draft=args.draft, datasets=args.datasets,
            max_samples=args.max_samples, max_new_tokens=args.max_new_tokens, methods=args.methods,
            budgets=args.budgets, trees=args.trees, temperatures=args.temperatures, dtype=args.dtype, seed=args.seed,
            device=args.device, time_budget_s=args.time_budget * 60 if args.time_budget else None,
            cpu_kernels=args.cpu_kernels)
    except ValueError as err:
        print(f"benchmark: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or Path("runs") / preset.name)
    command_line = [sys.executable, "-m", "experiments.benchmark", *(sys.argv[1:] if argv is None else argv)]
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    try:
        complete = run_benchmark(preset, out, max_generations=args.max_generations,
                                 command_line=command_line, full=args.full)
    except (FileNotFoundError, ValueError, ImportError, DatasetUnavailableError) as err:
        print(f"benchmark: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nbenchmark: interrupted; finished records are kept in {out}; rerun the same command to resume",
              file=sys.stderr)
        return 130
    log(f"{'done' if complete else 'incomplete'} in {time.perf_counter() - t0:.1f} s")
    return 0 if complete else 3


if __name__ == "__main__":
    sys.exit(main())
