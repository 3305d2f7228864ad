"""The training loop: AdamW, the learning-rate schedule, checkpoints, data parallelism, logging and export.

AdamW, cosine schedule with linear warm-up, gradient clipping, bf16 autocast. Every ``eval_every`` steps an
``evaluate`` callable (:mod:`.evaluate`) scores the drafter, and the best one is kept in ``best/``. ``checkpoint.pt``
in the output folder makes every run resumable.

Scale-out: under ``torchrun`` the same command runs data-parallel (DDP). Each rank makes its own GPU current
(``LOCAL_RANK``) and joins one process group with both backends (``cpu:gloo,cuda:nccl``: NCCL for CUDA tensors, gloo
for CPU ones; gloo alone on CPU). Each step's global batch of sequences is split across ranks, the loss is normalised
by the global weight sum, and anchors are drawn from a generator keyed by (seed, epoch, sequence), so 1 process and N
processes with the same global batch follow the same loss curve (full-vocabulary loss).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ..blocks import block_inputs
from ..files import save_atomic
from ..model import DFlashDraftModel
from .anchors import position_weights, sample_anchors
from .train_config import TrainConfig
from .loss import SequenceFeatures, sequence_loss, target_features

__all__ = ["TrainState", "load_checkpoint", "train", "make_optimizer", "optimizer_step", "batch_weight",
           "init_distributed", "setup_logging", "export_drafter"]


def _lr_factor(progress: float, warmup_frac: float, min_ratio: float) -> float:
    """Linear warm-up over the first ``warmup_frac`` of training, then cosine decay to ``min_ratio``."""
    if progress < warmup_frac:
        return max(progress / warmup_frac, 1e-3)
    rest = min(1.0, (progress - warmup_frac) / max(1e-9, 1 - warmup_frac))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * rest))


def _progress(state: "TrainState", cfg: TrainConfig) -> float:
    """Fraction of training done: by steps, or by wall time when a time budget is set (the schedule follows it)."""
    if cfg.time_budget_s is not None:
        return state.train_seconds / cfg.time_budget_s
    return state.step / state.total_steps


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the initialized process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass
class TrainState:
    step: int = 0
    total_steps: int | None = None
    history: list[dict] = field(default_factory=list)
    best_tau: float = -1.0
    train_seconds: float = 0.0


def _save_checkpoint(path: Path, draft, optimizer, state: TrainState) -> None:
    save_atomic({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
                 "state": dataclasses.asdict(state), "config": draft.config.to_dict()}, path)


def load_checkpoint(path: Path, device: torch.device | str = "cpu") -> dict:
    """A training checkpoint (tensors, numbers, strings, lists and dicts only), read without unpickling code."""
    import pickle

    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} holds more than tensors and plain values, so it is not loaded (that would run arbitrary code "
            f"from the file): {err}. Delete it to restart training from scratch, or load it yourself if you trust it"
        ) from err


def make_optimizer(draft: DFlashDraftModel, cfg: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)


def optimizer_step(model, optimizer, embed, head_weight: torch.Tensor,
                   batch: list[tuple[torch.Tensor, SequenceFeatures, torch.Tensor]], wsum: float, cfg: TrainConfig,
                   lr: float, generator: torch.Generator | None = None) -> dict:
    """One optimizer step over this rank's ``batch`` of (ids, features, anchors), normalised by the GLOBAL weight sum
    ``wsum``: one forward and backward per sequence (gradient accumulation; DDP syncs on the last one only), or with
    ``cfg.batched`` one padded forward and backward for all of them; gradient clipping, AdamW. Returns this rank's loss share, top-1 accuracy at block position 1 and the gradient norm."""
    _, world = rank_and_world()
    core = getattr(model, "module", model)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    local_sum, hits, n1 = 0.0, 0, 0
    if cfg.batched:  # one padded forward and ONE backward (so DDP syncs once)
        from .batched import batched_sequence_loss

        s, st = batched_sequence_loss(model, embed, head_weight, batch, cfg, generator)
        (s * (world / wsum)).backward()
        local_sum, hits, n1 = float(s.detach()), st["hits1"], st["n1"]
    else:
        for j, (ids, feats, anchors) in enumerate(batch):
            sync = j == len(batch) - 1 or world == 1
            with (contextlib.nullcontext() if sync else model.no_sync()):
                s, st = sequence_loss(model, embed, head_weight, ids, feats, anchors, cfg, generator)
                (s * (world / wsum)).backward()  # DDP averages over ranks: world/wsum makes it sum/wsum
            local_sum, hits, n1 = local_sum + float(s.detach()), hits + st["hits1"], n1 + st["n1"]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(core.parameters(), cfg.grad_clip))
    optimizer.step()
    return {"loss": local_sum / wsum, "acc1": hits / max(1, n1), "grad_norm": grad_norm}


def batch_weight(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int,
                 gamma: float) -> float:
    """The loss weight sum of one sequence's blocks (known before any forward: it depends on anchors and length)."""
    _, _, labels = block_inputs(ids, anchors, block_size, mask_token_id)
    return float((position_weights(block_size, gamma).expand_as(labels) * (labels >= 0)).sum())


class _Epochs:
    """The training sequences with their deterministic schedule: which sequences each step trains on, their anchors
    (resampled every epoch, identical on every rank layout) and their target features (kept, cached or computed)."""

    def __init__(self, target, sequences, cfg: TrainConfig, layer_ids, feature_source) -> None:
        keep = [i for i, (ids, p) in enumerate(sequences) if min(len(ids), cfg.max_len) - p >= 2]
        if feature_source is not None and len(keep) < len(sequences):
            source = feature_source
            feature_source = lambda i: source(keep[i])  # noqa: E731  indices follow the kept sequences
        self.sequences = [(sequences[i][0][: cfg.max_len], sequences[i][1]) for i in keep]
        self.target, self.cfg, self.layer_ids, self.feature_source = target, cfg, layer_ids, feature_source
        self.steps_per_epoch = max(1, len(self.sequences) // cfg.seqs_per_step)
        self.cache: dict[int, SequenceFeatures] = {}

    def features(self, i: int) -> SequenceFeatures:
        if self.feature_source is not None:
            f = self.feature_source(i)
            if f is not None:
                return f
        if i in self.cache:
            return self.cache[i]
        cfg = self.cfg
        f = target_features(self.target, self.sequences[i][0], self.layer_ids,
                            cfg.distill_topk if cfg.distill_weight > 0 else 0)
        if cfg.cache_features:
            self.cache[i] = f
        return f

    def step_features(self, indices: list[int]) -> list[SequenceFeatures]:
        """The features of a step's sequences: kept or cached ones as they are, the rest from one padded target pass
        when ``cfg.batched`` (one pass per sequence otherwise)."""
        cfg = self.cfg
        if not cfg.batched:
            return [self.features(i) for i in indices]
        got = {}
        for i in indices:
            f = self.feature_source(i) if self.feature_source is not None else None
            if f is None:
                f = self.cache.get(i)
            if f is not None:
                got[i] = f
        missing = [i for i in indices if i not in got]
        if missing:
            from .batched import batched_target_features

            fresh = batched_target_features(self.target, [self.sequences[i][0] for i in missing], self.layer_ids,
                                            cfg.distill_topk if cfg.distill_weight > 0 else 0)
            got.update(zip(missing, fresh))
            if cfg.cache_features:
                self.cache.update(zip(missing, fresh))
        return [got[i] for i in indices]

    def batch_indices(self, step: int) -> list[int]:
        epoch, offset = divmod(step, self.steps_per_epoch)
        seed = self.cfg.seed * 7919 + epoch
        order = torch.randperm(len(self.sequences), generator=torch.Generator().manual_seed(seed)).tolist()
        return order[offset * self.cfg.seqs_per_step:(offset + 1) * self.cfg.seqs_per_step]

    def anchors_for(self, i: int, step: int) -> torch.Tensor:
        epoch = step // self.steps_per_epoch
        g = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + epoch) * 1_000_033 + i)
        ids, p = self.sequences[i]
        return sample_anchors(p, len(ids), self.cfg.anchors, g)


def _resume(ckpt: Path | None, draft, optimizer, device, log) -> TrainState:
    """The run's state: from ``checkpoint.pt`` when there is one (weights and optimizer restored), else fresh."""
    if ckpt is None or not ckpt.is_file():
        return TrainState()
    blob = load_checkpoint(ckpt, device)
    draft.load_state_dict(blob["draft"])
    optimizer.load_state_dict(blob["optimizer"])
    state = TrainState(**blob["state"])
    log(f"train: resumed from {ckpt} at step {state.step}")
    return state


def _evaluate(draft, evaluate, state: TrainState, record: dict, out: Path | None, log) -> None:
    """Evaluate the drafter, add the result to the step's record, keep the best drafter by tau in ``out/best``."""
    draft.eval()
    ev = evaluate(draft)
    draft.train()
    record.update(ev)
    log(f"train: eval at step {state.step}: {ev}")
    if out is not None and ev.get("tau", -1) > state.best_tau:
        state.best_tau = ev["tau"]
        draft.save_pretrained(out / "best", dtype=torch.bfloat16)


def train(target, draft: DFlashDraftModel, sequences: list[tuple[torch.Tensor, int]], cfg: TrainConfig,
          out: Path | None = None, log: Callable[[str], None] = print,
          evaluate: Callable[[DFlashDraftModel], dict] | None = None, stop_after: int | None = None,
          feature_source: Callable[[int], SequenceFeatures] | None = None) -> TrainState:
    """Train ``draft`` on ``sequences`` = [(ids [T], prompt_len)] against ``target`` (frozen).

    Runs data-parallel when torch.distributed is initialised (the caller wraps nothing: DDP is applied here).
    ``out`` holds ``checkpoint.pt`` (resumed when present) and ``best/`` (the best drafter by eval tau).
    ``stop_after`` ends this call after that many steps (checkpoint written), as an interruption would.
    ``feature_source(i)`` gives sequence i's target features when they were kept at generation time
    (:mod:`dflash_core.training.shards`); where it is absent or returns None, one teacher-forced target pass per
    sequence computes them.
    """
    from tqdm import tqdm

    rank, world = rank_and_world()
    dev = target.lm_head.weight.device
    draft.to(dev).float().train()
    for p in target.parameters():
        p.requires_grad_(False)
    embed, head_weight = target.model.embed_tokens, target.lm_head.weight
    model = draft
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(draft, device_ids=[dev.index] if dev.type == "cuda" else None)
    optimizer = make_optimizer(draft, cfg)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint.pt" if out is not None else None
    state = _resume(ckpt, draft, optimizer, dev, log)
    data = _Epochs(target, sequences, cfg, draft.config.target_layer_ids, feature_source)
    if cfg.time_budget_s is None:
        state.total_steps = cfg.steps or max(1, int(cfg.epochs * data.steps_per_epoch))
    if cfg.cache_features and data.feature_source is None:  # one target pass per sequence, up front (untimed)
        for i in tqdm(range(len(data.sequences)), desc="target features", unit="seq", disable=rank != 0,
                      mininterval=5):
            data.features(i)
    bar = tqdm(total=state.total_steps, initial=state.step, desc="train", unit="step", disable=rank != 0,
               mininterval=5)
    t_start = time.perf_counter()
    seconds_before, first_step = state.train_seconds, state.step
    neg_gen = torch.Generator().manual_seed(cfg.seed + 17 * rank)
    while _progress(state, cfg) < 1.0:
        step, global_idx = state.step, data.batch_indices(state.step)
        # global weight sum: known before any forward (labels depend only on anchors and lengths)
        wsum = sum(batch_weight(data.sequences[i][0], data.anchors_for(i, step), draft.block_size,
                                draft.mask_token_id, cfg.gamma) for i in global_idx)
        mine = global_idx[rank::world]
        batch = [(data.sequences[i][0], f, data.anchors_for(i, step)) for i, f in zip(mine, data.step_features(mine))]
        factor = _lr_factor(_progress(state, cfg), cfg.warmup_frac, cfg.min_lr_ratio)
        stats = optimizer_step(model, optimizer, embed, head_weight, batch, wsum, cfg, cfg.lr * factor, neg_gen)
        state.step += 1
        # the global loss (sum of weighted CE over all ranks / global weight sum); collectives on the training device
        global_loss = torch.tensor([stats["loss"]], dtype=torch.float64, device=dev)
        if world > 1:
            dist.all_reduce(global_loss)
        record = {"step": state.step, "loss": float(global_loss), "acc1": stats["acc1"], "lr": cfg.lr * factor,
                  "grad_norm": stats["grad_norm"]}
        state.history.append(record)
        state.train_seconds = seconds_before + time.perf_counter() - t_start
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", acc1=f"{stats['acc1']:.2f}")
        if cfg.time_budget_s is not None:
            elapsed = torch.tensor([state.train_seconds], dtype=torch.float64, device=dev)
            if world > 1:  # every rank stops at the same step
                dist.broadcast(elapsed, 0)
            state.train_seconds = float(elapsed)
        if state.step % 25 == 0 and rank == 0:
            log(f"train: step {state.step}/{state.total_steps} loss {record['loss']:.4f} acc1 {stats['acc1']:.3f} "
                f"lr {record['lr']:.2e} |g| {stats['grad_norm']:.2f} ({state.train_seconds / 60:.1f} min)")
        last = _progress(state, cfg) >= 1.0
        interrupted = stop_after is not None and state.step - first_step >= stop_after
        if evaluate is not None and rank == 0 and (state.step % cfg.eval_every == 0 or last):
            _evaluate(draft, evaluate, state, record, out, log)
        if out is not None and rank == 0 and (state.step % cfg.ckpt_every == 0 or last or interrupted):
            _save_checkpoint(ckpt, draft, optimizer, state)
        if interrupted:
            break
    bar.close()
    draft.eval()
    return state


# ---------------------------------------------------------------------------------------------------- setup and export
def init_distributed(device: str | None = None) -> tuple[torch.device, bool]:
    """This process's device, and whether it joined a process group (``WORLD_SIZE`` > 1, as under torchrun).

    Each rank makes its own GPU (``cuda:LOCAL_RANK`` unless ``device`` names one) current BEFORE the group starts, so
    NCCL never touches another rank's GPU; the group carries gloo for CPU tensors and NCCL for CUDA ones.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device:
        dev = torch.device(device)
    elif torch.cuda.is_available():
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo")
    return dev, distributed


def setup_logging(out: Path, rank: int = 0) -> logging.Logger:
    out.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("dflash_core.training")
    logger.setLevel(logging.INFO)
    logger.handlers.clear()
    logger.propagate = False
    if rank == 0:
        fmt = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
        for h in (logging.FileHandler(out / "train.log"), logging.StreamHandler(sys.stderr)):
            h.setFormatter(fmt)
            logger.addHandler(h)
    return logger


def export_drafter(folder: str | Path, dest: str | Path, log: Callable[[str], None] = print) -> None:
    """Copy a saved drafter (config.json + model.safetensors) into ``dest``, e.g. the package zoo."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(Path(folder) / name, dest / name)
    log(f"exported the drafter to {dest}")
